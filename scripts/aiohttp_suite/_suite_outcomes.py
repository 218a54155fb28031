"""pytest plugin: write each test's outcome to the JSON file named by ``AIOHTTP_SUITE_OUTCOMES``.

Loaded with ``-p _suite_outcomes`` in both the plain and the instrumented run of
scripts/aiohttp-suite.sh (``PYTHONPATH`` names this folder). One outcome per test id, from its
setup, call and teardown reports: ``passed``, ``failed``, ``error`` (setup failed), ``skipped``,
``xfailed``, ``xpassed``, with ``+teardown-error`` appended when teardown failed too; a module
that cannot be collected is ``collection-error`` under its own id. The file also says which
aiohttp was imported: it must be the virtualenv's installed package, never the source package's
own ``aiohttp/`` folder (pure Python, no extensions) beside the tests, and the run stops at once
otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

OUTCOMES_VARIABLE = "AIOHTTP_SUITE_OUTCOMES"

_outcomes: dict[str, str] = {}


def _installed_aiohttp() -> dict[str, str]:
    import aiohttp

    where = Path(aiohttp.__file__).resolve()
    site = {Path(sysconfig.get_paths()[name]).resolve() for name in ("purelib", "platlib")}
    if not any(where.is_relative_to(folder) for folder in site):
        raise pytest.UsageError(
            f"aiohttp imported from {where}, not from this virtualenv's site-packages "
            f"({', '.join(map(str, sorted(site)))}): run python with -P from the source package"
        )
    return {"version": aiohttp.__version__, "file": str(where), "python": sys.version.split()[0]}


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get(OUTCOMES_VARIABLE):
        raise pytest.UsageError(f"{OUTCOMES_VARIABLE} names no file to write the outcomes to")
    config.stash[_AIOHTTP] = _installed_aiohttp()


_AIOHTTP = pytest.StashKey[dict[str, str]]()


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _outcomes[report.nodeid] = "collection-error"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    xfail = hasattr(report, "wasxfail")
    if report.when == "setup":
        if report.failed:
            _outcomes[report.nodeid] = "error"
        elif report.skipped:
            _outcomes[report.nodeid] = "xfailed" if xfail else "skipped"
    elif report.when == "call":
        if report.passed:
            _outcomes[report.nodeid] = "xpassed" if xfail else "passed"
        elif report.skipped:
            _outcomes[report.nodeid] = "xfailed" if xfail else "skipped"
        else:
            _outcomes[report.nodeid] = "failed"
    elif report.when == "teardown" and report.failed:
        _outcomes[report.nodeid] = _outcomes.get(report.nodeid, "passed") + "+teardown-error"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    document: dict[str, Any] = {
        "aiohttp": session.config.stash[_AIOHTTP],
        "exitstatus": int(exitstatus),
        "outcomes": _outcomes,
    }
    Path(os.environ[OUTCOMES_VARIABLE]).write_text(json.dumps(document, indent=1, sort_keys=True))
