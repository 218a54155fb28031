"""A uvicorn server that makes no outgoing request (as NeMo Gym's resources server), killed
during exit.

Run under ``opentelemetry-instrument`` by tests/test_pressure.py. An exit handler registered
at import, before the server starts (as NeMo Gym's and Ray's are), prints ``KILLED`` and ends
the process at once, as NeMo Gym's kill one second after SIGINT ends a server stuck in a slow
exit handler: the SDK's own final export never runs. The server serves one request that holds
the loop for 0.3 s, asked over a plain socket (an aiohttp client would build a connection
pool), then stops.
"""

import asyncio
import atexit
import os
import socket
import time

import uvicorn
from fastapi import FastAPI

app = FastAPI()


@app.get("/hold")
async def hold() -> dict[str, str]:
    time.sleep(0.3)  # noqa: ASYNC251 - synchronous work holding the loop, on purpose
    return {"held": "yes"}


def killed_while_exiting() -> None:
    print("KILLED", flush=True)
    os._exit(0)


atexit.register(killed_while_exiting)


async def main() -> None:
    # Listening before the server starts: the request waits in the backlog until uvicorn
    # accepts it, so nothing polls for the server being up.
    listening = socket.create_server(("127.0.0.1", 0))
    port = listening.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    serving = asyncio.create_task(server.serve(sockets=[listening]))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /hold HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    response = await reader.read()
    writer.close()
    await writer.wait_closed()
    assert response.startswith(b"HTTP/1.1 200"), response
    server.should_exit = True
    await serving


asyncio.run(main())
