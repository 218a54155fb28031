"""A process sandbox's disk limit: a size-limited tmpfs holding all the sandbox may write.

A sandbox that asks for ``disk_gib`` gets, where this process may mount (root), a tmpfs of
that size at a directory of its own, and its directory and its ``/tmp`` are made inside it:
one bound for everything its commands can write (the rest of what they see is read-only).
A write past it fails with "No space left on device". A tmpfs keeps its files in memory, so
what a sandbox writes there also counts toward its cgroup's memory. Elsewhere nothing bounds
disk use, and the allocation record says no disk limit.

The size in the allocation record is read back from the mounted file system (``statvfs``),
never copied from the request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path

__all__ = ["GIB", "can_mount", "limit_gib", "mount", "unmount"]

logger = logging.getLogger(__name__)

GIB = 1 << 30
_MOUNT_TIMEOUT_S = 30.0


def can_mount() -> bool:
    """Whether this process may try to mount a tmpfs (root, with ``mount`` and ``umount``)."""
    return os.geteuid() == 0 and bool(shutil.which("mount")) and bool(shutil.which("umount"))


async def mount(directory: Path, size_gib: int, owner: tuple[int, int] | None) -> None:
    """Mount a tmpfs of ``size_gib`` GiB on ``directory``, its root ``owner``'s, mode 0700;
    ``OSError`` with ``mount``'s message when it fails."""
    options = [f"size={size_gib * GIB}", "mode=0700", "nosuid", "nodev"]
    if owner is not None:
        options += [f"uid={owner[0]}", f"gid={owner[1]}"]
    await _run("mount", "-t", "tmpfs", "-o", ",".join(options), "nemo-gym-sandbox", str(directory))


async def unmount(directory: Path) -> None:
    """Unmount the tmpfs on ``directory`` (its files go with it); logs a warning if it cannot."""
    try:
        await _run("umount", str(directory))
    except OSError as exc:
        logger.warning("sandbox disk %s could not be unmounted: %s", directory, exc)


def limit_gib(directory: Path) -> int | None:
    """The size of the file system mounted on ``directory`` in whole GiB (what the kernel
    enforces), or ``None`` when it cannot be read."""
    try:
        info = os.statvfs(directory)
    except OSError:
        return None
    return (info.f_blocks * info.f_frsize) // GIB


async def _run(*argv: str) -> None:
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(_MOUNT_TIMEOUT_S):
            _, stderr = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise OSError(f"{argv[0]} did not finish within {_MOUNT_TIMEOUT_S:g} s") from None
    if process.returncode != 0:
        message = stderr.decode("utf-8", errors="replace").strip() or f"status {process.returncode}"
        raise OSError(f"{argv[0]}: {message}")
