"""The loopback aiohttp server the apps here send their requests to (imported by name: an app
run as a script has this folder first on ``sys.path``)."""

import asyncio

from aiohttp import web


async def serve(host: str, delay_s: float) -> tuple[web.AppRunner, str]:
    """Answer every GET ``/`` on ``host`` after ``delay_s``, at a free port: runner and URL."""

    async def handle(_: web.Request) -> web.Response:
        await asyncio.sleep(delay_s)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, 0).start()
    return runner, f"http://{host}:{runner.addresses[0][1]}/"
