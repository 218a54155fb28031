"""One process of the exit tests: known traffic, then it waits for the test to end it.

Run under ``opentelemetry-instrument``. ``--requests N`` requests, one at a time, through one
pool to a loopback server (N connects for ``exit-test``); then one JSON line with the
connector class, and the process waits for a line on stdin (or a signal) and returns from
``main``: the test times exit from that line. ``--own-sigterm-handler`` installs a SIGTERM
handler of the application's own first, which prints ``APP SIGTERM`` and exits with status 3.
"""

import argparse
import asyncio
import json
import os
import signal
import sys

import aiohttp
from loopback import serve

from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    reset_server_name,
    set_server_name,
)


def own_sigterm_handler(signum: int, frame: object) -> None:
    print("APP SIGTERM", flush=True)
    sys.exit(3)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--own-sigterm-handler", action="store_true")
    args = parser.parse_args()
    if args.own_sigterm_handler:
        signal.signal(signal.SIGTERM, own_sigterm_handler)
    runner, url = await serve("127.0.0.1", 0.0)
    token = set_server_name("exit-test")
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            for _ in range(args.requests):
                async with session.get(url, headers={"Connection": "close"}) as response:
                    await response.read()
            connector = type(session.connector).__name__
    finally:
        reset_server_name(token)
        await runner.cleanup()
    # One raw write, not print: the test signals as soon as the line arrives, and a handler
    # that prints while print's buffered stdout is mid-write fails ("reentrant call").
    line = json.dumps({"connector": connector, "connects": args.requests}) + "\n"
    os.write(sys.stdout.fileno(), line.encode())
    sys.stdin.readline()  # a signal's handler runs here, in the main thread


asyncio.run(main())
