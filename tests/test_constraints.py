"""constraints.txt is one set of OpenTelemetry releases that installs together, and it covers
every opentelemetry-* package this repository installs (beside them, the kubernetes extra's
client, pinned at the release it was tested with).

The scripts and CI install with ``-c constraints.txt`` so that a registry holding contrib
packages a release apart cannot stop them. The set is checked the way it once failed: in a new
virtualenv with the pip that virtualenv starts with (23.2 from Python 3.11.7, Debian 12's
23.0), against the registry as it is today.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import urllib.request
import venv
from pathlib import Path

import pytest

from conftest import require_service

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
OURS = "opentelemetry-instrumentation-nemo-gym"
# Files whose `pip install` lines name OpenTelemetry packages (the scripts and CI).
INSTALLERS = (*sorted((ROOT / "scripts").glob("*.sh")), ROOT / ".ci" / "run")
# A distribution name of the family; `opentelemetry-instrument` alone is the command.
FAMILY_NAME = re.compile(r"\bopentelemetry-[a-z][a-z-]*[a-z]\b")
COMMANDS = {"opentelemetry-instrument", "opentelemetry-bootstrap"}
REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")

pytestmark = pytest.mark.integration


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    """constraints.txt as name -> version; every line must be an exact ``name==version`` pin."""
    pinned: dict[str, str] = {}
    for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, separator, version = line.partition("==")
        assert separator, f"constraints.txt: {line!r} is not an exact name==version"
        assert version.strip(), f"constraints.txt: {line!r} names no version"
        pinned[normalized(name)] = version.strip()
    return pinned


def required_by_the_package() -> set[str]:
    """The opentelemetry-* names that pyproject.toml's dependencies and extras require."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    names = set()
    for requirement in requirements:
        match = REQUIREMENT_NAME.match(requirement)
        assert match, requirement
        names.add(normalized(match.group(1)))
    return {name for name in names if name.startswith("opentelemetry-") and name != OURS}


def named_by_the_installers() -> dict[str, set[str]]:
    """The opentelemetry-* distributions the scripts and CI name, each with where it is named."""
    named: dict[str, set[str]] = {}
    for path in INSTALLERS:
        for name in FAMILY_NAME.findall(path.read_text(encoding="utf-8")):
            if name not in COMMANDS and name != OURS:
                named.setdefault(normalized(name), set()).add(str(path.relative_to(ROOT)))
    return named


def test_constraints_pin_every_opentelemetry_package_we_install() -> None:
    """Every opentelemetry-* requirement of the package, its extras and the scripts is pinned."""
    pinned = pins()
    assert len(pinned) >= 15, pinned
    missing = required_by_the_package() - pinned.keys()
    assert not missing, f"pyproject.toml requires these, constraints.txt lacks them: {missing}"
    unpinned = {n: where for n, where in named_by_the_installers().items() if n not in pinned}
    assert not unpinned, f"scripts install these, constraints.txt does not pin them: {unpinned}"
    # One release of each half: core (api, sdk, proto, OTLP exporters) and contrib (0.NNbN);
    # the other pins (the kubernetes extra's client) are releases of their own.
    releases = {v for n, v in pinned.items() if n.startswith("opentelemetry-")}
    assert len(releases) == 2, f"more than one core and one contrib release: {sorted(releases)}"


def test_constraints_used_by_every_install() -> None:
    """Each script (and CI) that runs pip install takes constraints.txt; the README's two
    commands install only through ``pip_install``, which takes it and shows pip's reason."""
    installers = [path for path in INSTALLERS if re.search(r"pip.install", path.read_text("utf-8"))]
    assert len(installers) >= 7, installers
    # -c constraints.txt, or pip_install from scripts/pip-install.sh (sourced by any path).
    ways = re.compile(
        r'-c constraints\.txt|-c "\$PIP_CONSTRAINTS"|source \S*scripts/pip-install\.sh'
    )
    for path in installers:
        text = path.read_text(encoding="utf-8")
        assert ways.search(text), f"{path.name} installs without constraints.txt"
    for script in ("quickstart.sh", "test.sh"):
        text = (ROOT / "scripts" / script).read_text(encoding="utf-8")
        assert "source scripts/pip-install.sh" in text, script
        assert "-m pip install" not in text, f"{script} installs without pip_install"


def _index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def _registry_reachable() -> bool:
    try:
        with urllib.request.urlopen(f"{_index_url()}/opentelemetry-api/", timeout=15) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


@pytest.mark.skipif(
    Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(),
    reason="run once, by the suite in .venv (the same registry from every virtualenv)",
)
def test_constraints_resolve_with_a_new_virtualenvs_own_pip(tmp_path: Path) -> None:
    """The package, its extras and every pinned package resolve together from the registry,
    with a new virtualenv's own old pip, at exactly the pinned releases."""
    require_service(_registry_reachable(), f"the package index {_index_url()} is not reachable")
    home = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(home)
    python = str(home / "bin" / "python")
    own_pip = subprocess.run(
        [python, "-m", "pip", "--version"], capture_output=True, text=True, check=True
    ).stdout
    pinned = pins()
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_NO_INDEX", "VIRTUAL"))}
    result = subprocess.run(
        [
            python,
            *("-m", "pip", "install", "--dry-run", "--disable-pip-version-check"),
            *("--report", str(report), "-c", str(CONSTRAINTS)),
            *("-e", f"{ROOT}[test,pressure]", *pinned),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, f"{own_pip}{(result.stdout + result.stderr)[-6000:]}"
    resolved = {
        normalized(item["metadata"]["name"]): item["metadata"]["version"]
        for item in json.loads(report.read_text(encoding="utf-8"))["install"]
    }
    family = {n: v for n, v in resolved.items() if n.startswith("opentelemetry-") and n != OURS}
    unpinned = family.keys() - pinned.keys()
    assert not unpinned, f"resolved without a pin (pin them in constraints.txt): {unpinned}"
    assert family == {n: v for n, v in pinned.items() if n.startswith("opentelemetry-")}, own_pip
    others = {n: v for n, v in pinned.items() if not n.startswith("opentelemetry-")}
    assert {n: resolved.get(n) for n in others} == others, own_pip
