"""The process provider's file transfers and exec working directories, safe from a racing command.

The sandbox's commands may change its directory at any moment, so a path given to the provider
is never checked and then opened by name: it is checked as a string (``..`` collapsed, it must
lie in the sandbox directory), then opened component by component with ``_beneath``, which
follows no symlink, and the copy goes through the descriptor that open returned. A symlink
anywhere on the path is refused with the same ``ValueError`` as a path outside the sandbox,
whether it was there all along or swapped in during the call. Blocking: run the copies in a
thread.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from opentelemetry.instrumentation.nemo_gym.sandbox.providers._beneath import (
    open_beneath,
    open_directory_beneath,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._process_sandbox import Sandbox

__all__ = ["download", "open_working_directory", "relative_to_root", "upload"]

_T = TypeVar("_T")
_COPY_BUFFER = 1 << 20
# What _beneath raises for a symlink on the path (or, defensively, a way out of the directory).
_REFUSED = (errno.ELOOP, errno.EXDEV)


def relative_to_root(state: Sandbox, name: str, value: str | os.PathLike[str]) -> str:
    """``value`` (relative to the working directory, or absolute) as a path relative to the
    sandbox directory, ``..`` collapsed as written (``""`` for the directory itself);
    ``ValueError`` naming ``name`` unless it lies inside. Reads no filesystem."""
    text = os.fspath(value)
    if "\0" in text:
        raise ValueError(f"{name}={text!r} must not contain NUL")
    path = Path(os.path.normpath(state.workdir / text))  # an absolute value replaces workdir
    if not path.is_relative_to(state.root):
        raise ValueError(f"{name}={text!r} is outside sandbox {state.sandbox_id}")
    relative = path.relative_to(state.root).as_posix()
    return "" if relative == "." else relative


def upload(state: Sandbox, source: Path, name: str, value: str | os.PathLike[str]) -> None:
    """Copy local ``source`` to ``value`` in the sandbox, its parents made, an existing file
    overwritten in place (its mode kept, as ``shutil.copyfile`` did); what it makes or writes
    is the sandbox's ``owner``'s, when it has one (a root server's sandbox)."""
    relative = relative_to_root(state, name, value)
    parent, _, file_name = relative.rpartition("/")
    if not file_name:
        raise _is_a_directory(state, name, value)
    with open(source, "rb") as reader:  # the caller's own path, on the host
        root = _open_root(state)
        try:
            directory = _refusing_symlinks(
                state,
                name,
                value,
                lambda: open_directory_beneath(root, parent, make=True, owner=state.owner),
            )
        finally:
            os.close(root)
        try:
            # No O_TRUNC: nothing is changed before fstat has shown a regular file. O_NONBLOCK
            # so that a FIFO swapped in fails at once instead of waiting for a reader.
            fd = _refusing_symlinks(
                state,
                name,
                value,
                lambda: open_beneath(
                    directory, file_name, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, 0o666
                ),
            )
        finally:
            os.close(directory)
        _require_regular_file(state, name, value, fd)
        if state.owner is not None:
            os.fchown(fd, *state.owner)  # a file the command (not root) can read and write
        with os.fdopen(fd, "wb") as writer:
            os.set_blocking(fd, True)
            os.ftruncate(fd, 0)
            shutil.copyfileobj(reader, writer, _COPY_BUFFER)


def download(state: Sandbox, name: str, value: str | os.PathLike[str], target: Path) -> None:
    """Copy the regular file ``value`` in the sandbox to local ``target``."""
    relative = relative_to_root(state, name, value)
    if not relative:
        raise _is_a_directory(state, name, value)
    root = _open_root(state)
    try:
        fd = _refusing_symlinks(
            state,
            name,
            value,
            lambda: open_beneath(root, relative, os.O_RDONLY | os.O_NONBLOCK),
        )
    finally:
        os.close(root)
    _require_regular_file(state, name, value, fd)
    with os.fdopen(fd, "rb") as reader:
        os.set_blocking(fd, True)
        with open(target, "wb") as writer:  # the caller's own path, on the host
            shutil.copyfileobj(reader, writer, _COPY_BUFFER)


def open_working_directory(
    state: Sandbox, name: str, value: str | os.PathLike[str]
) -> tuple[Path, int]:
    """Directory ``value`` in the sandbox: its path as written (``..`` collapsed) and an
    ``O_PATH`` descriptor of it, opened following no symlink, which the caller closes.
    ``ValueError`` naming ``name`` when it is outside, a symlink is on the way, or it is not
    a directory that exists."""
    relative = relative_to_root(state, name, value)
    root = _open_root(state)
    try:
        opened = _refusing_symlinks(
            state, name, value, lambda: open_directory_beneath(root, relative)
        )
    except (FileNotFoundError, NotADirectoryError) as exc:
        shown = os.fspath(value)
        raise ValueError(
            f"{name}={shown!r} is not a directory in sandbox {state.sandbox_id}: {exc.strerror}"
        ) from exc
    finally:
        os.close(root)
    return state.root / relative, opened


def _open_root(state: Sandbox) -> int:
    # The sandbox directory's own path is the provider's, out of the commands' reach (its
    # parent is not in their view): it is opened by name.
    path_only = getattr(os, "O_PATH", os.O_RDONLY)  # Linux's; a read-only open elsewhere
    return os.open(state.root, path_only | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _refusing_symlinks(
    state: Sandbox, name: str, value: str | os.PathLike[str], opening: Callable[[], _T]
) -> _T:
    """``opening()``, a symlink on the way (or a way out) refused with ``ValueError``."""
    try:
        return opening()
    except OSError as exc:
        if exc.errno not in _REFUSED:
            raise
        raise ValueError(
            f"{name}={os.fspath(value)!r} is outside sandbox {state.sandbox_id} or passes "
            "through a symlink in it (the provider follows none: a command could swap one in)"
        ) from exc


def _require_regular_file(
    state: Sandbox, name: str, value: str | os.PathLike[str], fd: int
) -> None:
    """Close ``fd`` and raise unless it is a regular file: the exceptions ``shutil.copyfile``
    raised for the others, before the no-follow open."""
    try:
        kind = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if stat.S_ISREG(kind):
        return
    os.close(fd)
    if stat.S_ISDIR(kind):
        raise _is_a_directory(state, name, value)
    shown = f"{name}={os.fspath(value)!r} in sandbox {state.sandbox_id}"
    raise shutil.SpecialFileError(f"{shown} is not a regular file")


def _is_a_directory(state: Sandbox, name: str, value: str | os.PathLike[str]) -> OSError:
    shown = f"{name}={os.fspath(value)!r} in sandbox {state.sandbox_id}"
    return IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), shown)
