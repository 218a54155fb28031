"""The no-follow open (``_beneath``), each case both ways: openat2 and the O_NOFOLLOW walk."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import require_service
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._beneath import (
    open_beneath,
    open_directory_beneath,
    openat2_available,
)
from symlink_flipper import FLIPPER, FLIPS
from waiting import eventually_blocking

# Opens of each path beside the flipping process.
OPENS = 4_000
# What each way's ELOOP says.
SYMLINK = os.strerror(errno.ELOOP)


@pytest.fixture(params=[True, False], ids=["openat2", "walk"])
def use_openat2(request: pytest.FixtureRequest) -> bool:
    """Which way the open goes; the walk is forced even where the kernel has openat2."""
    if request.param:
        require_service(openat2_available(), "no openat2 here (Linux 5.6 or later)")
    return bool(request.param)


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """An open ``O_PATH`` descriptor of ``inside/`` (holding ``a/b/f``) and the path of
    ``outside/secret``, beside it."""
    inside = tmp_path / "inside"
    (inside / "a" / "b").mkdir(parents=True)
    (inside / "a" / "b" / "f").write_text("inside")
    (tmp_path / "outside").mkdir()
    secret = tmp_path / "outside" / "secret"
    secret.write_text("secret")
    fd = os.open(inside, os.O_PATH | os.O_DIRECTORY)
    yield fd, secret
    os.close(fd)


def read(fd: int) -> str:
    with os.fdopen(fd, "rb") as reader:
        return reader.read().decode()


def test_openat2_available_on_linux_5_6_and_later() -> None:
    """openat2 is found usable exactly on kernels from 5.6 (this process has no filter)."""
    major, minor = (int(n) for n in os.uname().release.split(".")[:2])
    assert openat2_available() is ((major, minor) >= (5, 6))


def test_open_beneath_reads_through_directories(tree: tuple[int, Path], use_openat2: bool) -> None:
    """A plain path beneath the directory opens, and is closed-on-exec."""
    root, _ = tree
    fd = open_beneath(root, "a/b/f", os.O_RDONLY, use_openat2=use_openat2)
    assert not os.get_inheritable(fd)
    assert read(fd) == "inside"


@pytest.mark.parametrize("symlink", ["a/b/last", "a/middle"])
def test_open_beneath_refuses_a_symlink_at_any_component(
    tree: tuple[int, Path], use_openat2: bool, tmp_path: Path, symlink: str
) -> None:
    """A symlink as the last component or a directory on the way raises ELOOP, whether it
    points out (to a host file) or in (to the file next to it)."""
    root, secret = tree
    inside = tmp_path / "inside"
    for target in (secret, inside / "a" / "b" / "f"):
        link = inside / symlink
        link.unlink(missing_ok=True)
        if symlink == "a/middle":
            link.symlink_to(target.parent)
            path = "a/middle/" + target.name
        else:
            link.symlink_to(target)
            path = symlink
        with pytest.raises(OSError, match=SYMLINK) as refused:
            open_beneath(root, path, os.O_RDONLY, use_openat2=use_openat2)
        assert refused.value.errno == errno.ELOOP


def test_open_beneath_creates_nothing_through_a_dangling_symlink(
    tree: tuple[int, Path], use_openat2: bool, tmp_path: Path
) -> None:
    """O_CREAT on a symlink to a host path that does not exist yet refuses (ELOOP) and
    creates nothing there; an ordinary open, the control, creates the host file."""
    root, secret = tree
    planted = secret.parent / "planted"
    (tmp_path / "inside" / "new").symlink_to(planted)
    with pytest.raises(OSError, match=SYMLINK) as refused:
        open_beneath(root, "new", os.O_WRONLY | os.O_CREAT, 0o600, use_openat2=use_openat2)
    assert refused.value.errno == errno.ELOOP
    assert not planted.exists()
    fd = open_beneath(root, "fresh", os.O_WRONLY | os.O_CREAT, 0o600, use_openat2=use_openat2)
    os.close(fd)
    assert (tmp_path / "inside" / "fresh").stat().st_mode & 0o777 == 0o600
    # Control: an ordinary open through the same symlink creates the host file.
    os.close(os.open(tmp_path / "inside" / "new", os.O_WRONLY | os.O_CREAT, 0o600))
    assert planted.exists()


@pytest.mark.parametrize(
    ("path", "errno_"),
    [("a/b/missing", errno.ENOENT), ("a/b/f/below", errno.ENOTDIR)],
)
def test_open_beneath_missing_or_not_a_directory(
    tree: tuple[int, Path], use_openat2: bool, path: str, errno_: int
) -> None:
    """A missing component raises ENOENT, a file used as a directory ENOTDIR."""
    root, _ = tree
    with pytest.raises(OSError, match=os.strerror(errno_)) as failed:
        open_beneath(root, path, os.O_RDONLY, use_openat2=use_openat2)
    assert failed.value.errno == errno_


@pytest.mark.parametrize("path", ["", "/etc/passwd", "../outside/secret", "a/./b/f", "a//b/f"])
def test_open_beneath_refuses_paths_that_are_not_plain(
    tree: tuple[int, Path], use_openat2: bool, path: str
) -> None:
    """An empty or absolute path, or one with '..', '.' or an empty part, is a caller's
    mistake: ValueError naming it, before any open."""
    root, _ = tree
    with pytest.raises(ValueError, match="path"):
        open_beneath(root, path, os.O_RDONLY, use_openat2=use_openat2)


def test_open_beneath_refuses_o_path(tree: tuple[int, Path], use_openat2: bool) -> None:
    """O_PATH is refused: with O_NOFOLLOW it would open a final symlink instead of failing."""
    root, _ = tree
    with pytest.raises(ValueError, match="O_PATH"):
        open_beneath(root, "a/b/f", os.O_PATH, use_openat2=use_openat2)


def test_open_beneath_keeps_the_file_it_opened(
    tree: tuple[int, Path], use_openat2: bool, tmp_path: Path
) -> None:
    """A symlink swapped in for the file after the open changes nothing: the descriptor
    reads the file that was checked."""
    root, secret = tree
    fd = open_beneath(root, "a/b/f", os.O_RDONLY, use_openat2=use_openat2)
    link = tmp_path / "inside" / "a" / "b" / "f.swap"
    link.symlink_to(secret)
    os.replace(link, tmp_path / "inside" / "a" / "b" / "f")
    assert read(fd) == "inside"


def test_open_directory_beneath_keeps_the_directory_it_opened(
    tree: tuple[int, Path], use_openat2: bool, tmp_path: Path
) -> None:
    """A directory opened, then renamed away and replaced by a symlink to a host directory:
    what is opened beneath the descriptor is still in the directory that was checked."""
    root, secret = tree
    directory = open_directory_beneath(root, "a/b", use_openat2=use_openat2)
    try:
        b = tmp_path / "inside" / "a" / "b"
        b.rename(b.with_name("moved"))
        b.symlink_to(secret.parent)
        (secret.parent / "f").write_text("host")
        assert read(open_beneath(directory, "f", os.O_RDONLY, use_openat2=use_openat2)) == (
            "inside"
        )
    finally:
        os.close(directory)


def test_open_directory_beneath_empty_path_is_the_directory(
    tree: tuple[int, Path], use_openat2: bool
) -> None:
    """The empty path opens the starting directory itself (a new descriptor of it)."""
    root, _ = tree
    same = open_directory_beneath(root, "", use_openat2=use_openat2)
    try:
        assert same != root
        assert os.path.samestat(os.fstat(same), os.fstat(root))
    finally:
        os.close(same)


def test_open_directory_beneath_makes_missing_directories(
    tree: tuple[int, Path], use_openat2: bool, tmp_path: Path
) -> None:
    """With make, missing directories are made and the last one opened; existing ones are
    walked through."""
    root, _ = tree
    made = open_directory_beneath(root, "a/new/deeper", make=True, use_openat2=use_openat2)
    try:
        assert os.path.samestat(os.fstat(made), (tmp_path / "inside/a/new/deeper").stat())
    finally:
        os.close(made)


def test_open_directory_beneath_makes_nothing_through_a_symlink(
    tree: tuple[int, Path], use_openat2: bool, tmp_path: Path
) -> None:
    """With make, a symlink on the way raises ELOOP and nothing is made where it points."""
    root, secret = tree
    (tmp_path / "inside" / "link").symlink_to(secret.parent)
    with pytest.raises(OSError, match=SYMLINK) as refused:
        open_directory_beneath(root, "link/planted", make=True, use_openat2=use_openat2)
    assert refused.value.errno == errno.ELOOP
    assert sorted(p.name for p in secret.parent.iterdir()) == ["secret"]


def test_open_directory_beneath_refuses_a_file(tree: tuple[int, Path], use_openat2: bool) -> None:
    """A regular file asked for as a directory raises ENOTDIR."""
    root, _ = tree
    with pytest.raises(NotADirectoryError) as refused:
        open_directory_beneath(root, "a/b/f", use_openat2=use_openat2)
    assert refused.value.errno == errno.ENOTDIR


def test_open_beneath_never_follows_a_flipping_symlink(
    tree: tuple[int, Path], use_openat2: bool, tmp_path: Path
) -> None:
    """Beside a process that swaps x and d with symlinks to a host file and directory in a
    tight loop, 4,000 opens each of x and d/f never open the host's: each meets the symlink
    (ELOOP) or the file beneath, and both happen."""
    root, secret = tree
    inside = tmp_path / "inside"
    (inside / "x").write_text("inside")
    (inside / "d").mkdir()
    (inside / "d" / "f").write_text("inside")
    host_directory = secret.parent
    (host_directory / "f").write_text("secret")
    flipper = subprocess.Popen(
        [sys.executable, "-c", FLIPPER, str(secret), str(host_directory), str(FLIPS)],
        cwd=inside,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    outcomes: Counter[str] = Counter()
    try:
        eventually_blocking(
            lambda: (inside / "started").exists() or flipper.poll() is not None, "flipper up"
        )
        for attempt in range(2 * OPENS):
            try:
                fd = open_beneath(
                    root, ("x", "d/f")[attempt % 2], os.O_RDONLY, use_openat2=use_openat2
                )
            except OSError as exc:
                outcomes[errno.errorcode.get(exc.errno or 0, str(exc))] += 1
            else:
                outcomes[read(fd)] += 1
    finally:
        (inside / "stop").touch()
        out, err = flipper.communicate(timeout=60)
    assert (flipper.returncode, err) == (0, ""), (flipper.returncode, err)
    assert int(out) > 0
    assert outcomes["secret"] == 0, outcomes
    assert outcomes["ELOOP"] + outcomes["inside"] == 2 * OPENS, outcomes
    assert outcomes["ELOOP"] > 0, outcomes
    assert outcomes["inside"] > 0, outcomes
