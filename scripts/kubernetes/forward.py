"""Forward 127.0.0.1:PORT of the host's network namespace to 127.0.0.1:PORT of another one.

scripts/start-kubernetes.sh runs the cluster inside a network namespace of its own and this
program beside it, so that the API server, which listens inside, is reachable from the host's
processes on loopback only (and at the same address from inside, where the kubeconfig's
``https://127.0.0.1:PORT`` reaches the API server itself). It listens first, in the namespace
it was started in, then enters the cluster's namespace (``setns``): every socket it makes
after that is made there. Bytes are copied as they are; TLS stays end to end.

    python3 forward.py PORT /run/netns/NAME
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import sys

CLONE_NEWNET = 0x40000000


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def serve(listener: socket.socket, port: int) -> None:
    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            inner_reader, inner_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, inner_writer), pipe(inner_reader, writer))

    server = await asyncio.start_server(connection, sock=listener)
    stopped = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stopped.set)
    async with server:
        await stopped.wait()


def main() -> None:
    port, namespace = int(sys.argv[1]), sys.argv[2]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(namespace, os.O_RDONLY)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), f"setns({namespace})")
    os.close(fd)
    asyncio.run(serve(listener, port))


if __name__ == "__main__":
    main()
