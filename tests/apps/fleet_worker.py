"""One process of the OTLP fleet test: known traffic to two loopback destinations, then exit.

Run under ``opentelemetry-instrument`` (the OTLP exporter, a collector's endpoint): no SDK code
here, the auto-loader builds the providers and patches aiohttp. The traffic is exact:

* ``policy`` on 127.0.0.1: ``--policy N`` requests at once through a pool of ``limit=1``, so
  N connects and N - 1 queued waits on the ``total`` limit;
* ``resources`` on 127.0.0.2: ``--resources M`` requests at once through ``limit_per_host=1``
  (total 100), so M connects and M - 1 queued waits on the ``per_host`` limit.

Prints one JSON line with the connector class and the counts it produced, stays up
``--linger`` seconds, and exits; the SDK's shutdown at exit exports the last collection.
"""

import argparse
import asyncio
import json

import aiohttp
from loopback import serve

from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    reset_server_name,
    set_server_name,
)


async def burst(label: str, url: str, count: int, **limits: int) -> str:
    token = set_server_name(label)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(**limits)) as session:

            async def get() -> None:
                async with session.get(url) as response:
                    await response.read()

            await asyncio.gather(*(get() for _ in range(count)))
            return type(session.connector).__name__
    finally:
        reset_server_name(token)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--policy", type=int, required=True)
    parser.add_argument("--resources", type=int, required=True)
    parser.add_argument("--linger", type=float, default=0.0, help="seconds to stay up after")
    args = parser.parse_args()
    policy, policy_url = await serve("127.0.0.1", 0.01)
    resources, resources_url = await serve("127.0.0.2", 0.01)
    try:
        connector = await burst("policy", policy_url, args.policy, limit=1)
        await burst("resources", resources_url, args.resources, limit=100, limit_per_host=1)
    finally:
        await policy.cleanup()
        await resources.cleanup()
    expected = {
        "connector": connector,
        "connects": {"policy": args.policy, "resources": args.resources},
        "queued": {"policy": args.policy - 1, "resources": args.resources - 1},
    }
    print(json.dumps(expected), flush=True)
    # Time for periodic exports (to a collector that may be down or slow) before the exit.
    await asyncio.sleep(args.linger)


asyncio.run(main())
