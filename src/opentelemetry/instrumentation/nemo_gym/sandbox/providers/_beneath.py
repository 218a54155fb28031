"""Open a path beneath a directory without following a symlink at any of its components.

Why: the process provider copies files into and out of a sandbox directory from the host, with
the server's own privileges, while the sandbox's commands change that directory at will.
Resolving a path, checking that it stays inside, then opening it by name is a race: between
the check and the open a command swaps a component for a symlink to a host file, and the
server reads or overwrites that host file (a looping command won it within a few hundred
transfers). Here the check *is* the open: each component is opened relative to the
descriptor of the one before and a symlink is refused, never followed, so the file opened is
the one checked whatever the commands do meanwhile; the caller then reads or writes through
that descriptor only.

Two ways to the same result, chosen per call (``use_openat2``; by default the first where
the kernel has it):

- ``openat2(2)`` with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`` (Linux 5.6): one system call,
  in which the kernel refuses any symlink and any way out of the starting directory.
- A walk, where ``openat2`` is missing (an older kernel, a seccomp filter that refuses it):
  each directory opened with ``O_PATH | O_NOFOLLOW`` relative to the previous one and checked
  by ``fstat`` on the descriptor it got, the last component opened with ``O_NOFOLLOW``.

Either way a symlink met at any component raises ``OSError`` with ``errno.ELOOP``, a component
that is not a directory ``ENOTDIR``, a missing one ``ENOENT``. Paths are relative, with no
``..``, ``.`` or empty component (``ValueError``): the caller normalises them first. Blocking
(filesystem calls): run it in a thread from a loop. Written for Linux (``O_PATH``).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import stat
import sys
from collections.abc import Callable
from typing import cast

__all__ = ["open_beneath", "open_directory_beneath", "openat2_available"]

# struct open_how's resolve flags (linux/openat2.h).
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
# openat2's number in the system call table all architectures but alpha share since Linux 5.1.
_SYS_OPENAT2 = 437
# openat2 may answer EAGAIN when a rename raced a resolution it cannot vouch for.
_AGAIN_ATTEMPTS = 16
# O_PATH is Linux's; elsewhere (importable, never used by a sandbox) a read-only open stands in.
_O_PATH = getattr(os, "O_PATH", 0)
_DIRECTORY = _O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = (
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    )


def open_beneath(
    directory: int,
    path: str,
    flags: int,
    mode: int = 0o666,
    *,
    use_openat2: bool | None = None,
) -> int:
    """A descriptor (close-on-exec) of ``path`` opened with ``flags`` beneath the directory
    open as ``directory``, no component of it followed if a symlink. ``use_openat2``: ``True``
    or ``False`` forces the way (see the module), ``None`` takes openat2 where it works."""
    parts = _parts(path)
    if not parts:
        raise ValueError("path must name a file beneath the directory, not the directory")
    if flags & _O_PATH:
        # O_PATH | O_NOFOLLOW would open a final symlink itself rather than refuse it.
        raise ValueError("O_PATH: open directories with open_directory_beneath")
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    if _openat2_chosen(use_openat2):
        return _openat2(directory, path, flags, mode)
    parent = _walk(directory, parts[:-1])
    try:
        return os.open(parts[-1], flags, mode, dir_fd=parent)
    finally:
        os.close(parent)


def open_directory_beneath(
    directory: int,
    path: str,
    *,
    make: bool = False,
    owner: tuple[int, int] | None = None,
    use_openat2: bool | None = None,
) -> int:
    """An ``O_PATH`` descriptor of directory ``path`` beneath ``directory`` (``""``: that
    directory itself), following no symlink; ``make`` creates the missing ones (mode 0777
    less the umask, ``owner``'s (uid, gid) when given), each opened the same way right after
    it is made."""
    parts = _parts(path)
    if not parts:
        return os.dup(directory)
    try:
        if _openat2_chosen(use_openat2):
            return _openat2(directory, path, _DIRECTORY, 0)
        return _walk(directory, parts)
    except FileNotFoundError:
        if not make:
            raise
    # Some are missing: make them one by one.
    current = os.dup(directory)
    try:
        for name in parts:
            try:
                os.mkdir(name, dir_fd=current)
            except FileExistsError:
                pass
            else:
                if owner is not None:
                    # By name, not following a symlink: one swapped in since is changed itself.
                    os.chown(name, *owner, dir_fd=current, follow_symlinks=False)
            # Made or found, it is opened like any other component: a command that swapped a
            # symlink in since the mkdir is refused here.
            following = open_directory_beneath(current, name, use_openat2=use_openat2)
            os.close(current)
            current = following
    except BaseException:
        os.close(current)
        raise
    return current


@functools.cache
def openat2_available() -> bool:
    """Whether this process can call ``openat2`` (probed once: the kernel and any seccomp
    filter decide)."""
    if not sys.platform.startswith("linux"):
        return False  # the number is Linux's
    try:
        root = os.open("/", _DIRECTORY)
    except OSError:
        return False
    try:
        os.close(_openat2(root, ".", _DIRECTORY, 0))
    except (OSError, AttributeError):
        return False  # ENOSYS (before 5.6), EPERM (a filter), no libc syscall (not Linux)
    finally:
        os.close(root)
    return True


def _openat2_chosen(use_openat2: bool | None) -> bool:
    return openat2_available() if use_openat2 is None else use_openat2


def _parts(path: str) -> list[str]:
    if path == "":
        return []
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in path:
        raise ValueError(f"path={path!r} must be relative, without '.', '..' or empty parts")
    return parts


def _walk(directory: int, parts: list[str]) -> int:
    """The directory ``parts`` leads to from ``directory``, one ``O_NOFOLLOW`` step at a time."""
    current = os.dup(directory)
    try:
        for name in parts:
            following = _step(current, name)
            os.close(current)
            current = following
    except BaseException:
        os.close(current)
        raise
    return current


def _step(directory: int, name: str) -> int:
    """Directory ``name`` in ``directory``, opened ``O_PATH`` without following a symlink."""
    # O_PATH | O_NOFOLLOW opens a symlink itself rather than failing, so that fstat can tell
    # a symlink (ELOOP, as openat2 says) from any other non-directory (ENOTDIR).
    opened = os.open(name, _O_PATH | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory)
    kind = os.fstat(opened).st_mode
    if stat.S_ISDIR(kind):
        return opened
    os.close(opened)
    code = errno.ELOOP if stat.S_ISLNK(kind) else errno.ENOTDIR
    raise OSError(code, os.strerror(code), name)


@functools.cache
def _syscall() -> Callable[..., int]:
    function = ctypes.CDLL(None, use_errno=True).syscall
    function.restype = ctypes.c_long
    return cast("Callable[..., int]", function)


def _openat2(directory: int, path: str, flags: int, mode: int) -> int:
    creates = flags & (os.O_CREAT | getattr(os, "O_TMPFILE", 0))
    # The kernel refuses a mode without O_CREAT or O_TMPFILE (EINVAL).
    how = _OpenHow(flags, mode if creates else 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)
    name = os.fsencode(path)
    code = errno.EAGAIN
    for _ in range(_AGAIN_ATTEMPTS):
        fd = int(
            _syscall()(
                ctypes.c_long(_SYS_OPENAT2),
                ctypes.c_int(directory),
                ctypes.c_char_p(name),
                ctypes.byref(how),
                ctypes.c_size_t(ctypes.sizeof(how)),
            )
        )
        if fd >= 0:
            return fd
        code = ctypes.get_errno()
        if code not in (errno.EAGAIN, errno.EINTR):
            break
    raise OSError(code, os.strerror(code), path)
