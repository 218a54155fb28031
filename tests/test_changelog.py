"""CHANGELOG.md and the package version move together.

The top release section (``## [X.Y.Z] - YYYY-MM-DD``, below ``## Unreleased``) names the
version that ``version.py`` declares and hatch builds from; the releases run newest first.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from opentelemetry.instrumentation.nemo_gym.version import __version__

ROOT = Path(__file__).resolve().parent.parent
RELEASE = re.compile(r"^## \[(\d+)\.(\d+)\.(\d+)\] - (\d{4}-\d{2}-\d{2})$")


def _releases() -> list[tuple[tuple[int, int, int], str]]:
    releases = []
    for line in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8").splitlines():
        if match := RELEASE.match(line):
            major, minor, patch, date = match.groups()
            releases.append(((int(major), int(minor), int(patch)), date))
    return releases


def test_changelog_top_release_is_package_version() -> None:
    """The newest release in CHANGELOG.md is the version the package declares."""
    releases = _releases()
    assert releases, "CHANGELOG.md has no release section"
    assert ".".join(map(str, releases[0][0])) == __version__


def test_changelog_releases_newest_first() -> None:
    """Release sections are in strictly descending version order, dates never increasing."""
    releases = _releases()
    assert [version for version, _ in releases] == sorted(
        {version for version, _ in releases}, reverse=True
    )
    dates = [date for _, date in releases]
    assert dates == sorted(dates, reverse=True)


def test_changelog_version_source_is_version_module() -> None:
    """hatch reads the distribution's version from version.py, the module the test compares."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["dynamic"] == ["version"]
    assert project["tool"]["hatch"]["version"]["path"] == (
        "src/opentelemetry/instrumentation/nemo_gym/version.py"
    )
