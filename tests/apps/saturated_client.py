"""A small app for opentelemetry-instrument tests: a saturated pool against a loopback server.

Prints one line ``connector=<class name>`` so the test can see what construction produced.
No OpenTelemetry code here: everything comes from the auto-loader and the environment.
"""

import asyncio

import aiohttp
from aiohttp import web


async def main() -> None:
    async def handle(_: web.Request) -> web.Response:
        await asyncio.sleep(0.005)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/"
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
