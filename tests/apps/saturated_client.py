"""A small app for opentelemetry-instrument tests: a saturated pool against a loopback server.

Prints one line ``connector=<class name>`` so the test can see what construction produced.
No OpenTelemetry code here: everything comes from the auto-loader and the environment.
"""

import asyncio

import aiohttp
from loopback import serve


async def main() -> None:
    runner, url = await serve("127.0.0.1", 0.005)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            print(f"connector={type(session.connector).__name__}", flush=True)

            async def get() -> None:
                async with session.get(url) as response:
                    await response.read()

            await asyncio.gather(*(get() for _ in range(10)))
    finally:
        await runner.cleanup()


asyncio.run(main())
