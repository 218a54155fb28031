"""A FastAPI app served by uvicorn, as a NeMo Gym server serves its app, with one request that
holds the loop.

Run under ``opentelemetry-instrument`` by tests/test_pressure.py: it serves on 127.0.0.1, asks
``/hold`` once (the handler holds the loop for 0.3 s with synchronous work), stops the server
and exits; the console exporter prints what was recorded at shutdown.
"""

import asyncio
import socket
import time

import aiohttp
import uvicorn
from fastapi import FastAPI

app = FastAPI()


@app.get("/hold")
async def hold() -> dict[str, str]:
    time.sleep(0.3)  # noqa: ASYNC251 - synchronous work holding the loop, on purpose
    return {"held": "yes"}


async def main() -> None:
    # A socket listening before the server starts: the request waits in its backlog until
    # uvicorn accepts it, so nothing has to poll for the server being up.
    listening = socket.create_server(("127.0.0.1", 0))
    port = listening.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    serving = asyncio.create_task(server.serve(sockets=[listening]))
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/hold") as response,
    ):
        assert await response.json() == {"held": "yes"}
    server.should_exit = True
    await serving


asyncio.run(main())
