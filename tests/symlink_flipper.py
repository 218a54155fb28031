"""The attacker of the race tests: a program that swaps paths with symlinks to host files.

Run in a directory holding ``x`` (a regular file) and ``d`` (a directory) with
``python -c FLIPPER <host file> <host directory> <limit>``, it makes ``x.swap`` and ``d.swap``
(symlinks to the host file and directory), writes ``started``, then swaps ``x`` with
``x.swap`` and ``d`` with ``d.swap`` (renameat2's RENAME_EXCHANGE: atomically, so the path
is never missing) without pause, until ``stop`` appears or ``limit`` rounds; it prints how
many rounds it made.
"""

from __future__ import annotations

# The flipper's own bound: a test stops it with the stop file long before.
FLIPS = 50_000_000
# renameat2(2): swap two names atomically.
AT_FDCWD = -100
RENAME_EXCHANGE = 2

FLIPPER = """\
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
host_file, host_directory, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.symlink(host_file, "x.swap")
os.symlink(host_directory, "d.swap")
open("started", "w").close()
flips = 0
while flips < limit and not (flips % 256 == 0 and os.path.exists("stop")):
    for name in (b"x", b"d"):
        if libc.renameat2(-100, name, -100, name + b".swap", 2) != 0:
            sys.exit("renameat2: " + os.strerror(ctypes.get_errno()))
    flips += 1
print(flips)
"""
