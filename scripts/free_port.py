"""Print a loopback TCP port to listen on: the one asked for where it is free, else a free one.

Used by the start scripts to keep a service's port across restarts (the clients and state made
against it keep their address) without ever taking a port another listener holds.
``SO_REUSEADDR`` as the services themselves bind: a port of ours left in TIME_WAIT counts as
free. Usage: ``python3 scripts/free_port.py PREFERRED`` (0 or anything not a port: any free one).
"""

from __future__ import annotations

import socket
import sys


def free_port(preferred: str) -> int:
    probe = socket.socket()
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind(("127.0.0.1", int(preferred)))
    except (OSError, ValueError):
        probe.close()
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
    with probe:
        return int(probe.getsockname()[1])


if __name__ == "__main__":
    print(free_port(sys.argv[1] if len(sys.argv) > 1 else "0"))
