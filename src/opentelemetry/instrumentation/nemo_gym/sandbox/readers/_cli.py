"""The command line of a NeMo Gym provider that drives a binary, as its readers run it.

NeMo Gym's ``docker`` and ``apptainer`` providers keep the binary they found in
``provider._binary``; their readers (``docker_cli``, ``host_instance``) ask the same binary,
so they read what the provider drives. ``output_of`` runs one read-only command of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil


def provider_binary(provider: object, default: str) -> str | None:
    """The binary ``provider`` drives (``provider._binary``), else ``default`` on ``PATH``;
    ``None`` when neither is there."""
    binary = getattr(provider, "_binary", None)
    return binary if isinstance(binary, str) and binary else shutil.which(default)


async def output_of(binary: str, *args: str) -> tuple[int | None, bytes]:
    """The exit code and standard output of ``binary *args`` (no input, standard error
    dropped). Runs on the event loop without blocking it; a cancelled read kills the command
    and propagates."""
    process = await asyncio.create_subprocess_exec(
        binary,
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        stdout, _ = await process.communicate()
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        raise
    return process.returncode, stdout
