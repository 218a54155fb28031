"""A loopback aiohttp server for the benchmarks, run in its own process.

The benchmarks measure the client's CPU with ``time.process_time``, which counts every thread
of the calling process, so the server must live elsewhere or its CPU would dilute the ratios.
Prints ``PORT <n>`` once listening; exits when its standard input closes (the parent went
away) or on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from aiohttp import web


async def _serve(host: str, delay_s: float) -> None:
    async def handle(request: web.Request) -> web.Response:
        delay = float(request.query.get("delay", delay_s))
        if delay:
            await asyncio.sleep(delay)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0, backlog=1024)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"PORT {port}", flush=True)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    # The parent holds our stdin open for as long as it wants us; EOF means it is gone.
    loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not sys.stdin.read(1) else None)
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds each response waits")
    args = parser.parse_args()
    asyncio.run(_serve(args.host, args.delay))


if __name__ == "__main__":
    main()
