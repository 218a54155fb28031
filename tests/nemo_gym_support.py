"""The installed NeMo Gym for tests: the 0.4.0 wheel of the main suite, or NeMo Gym main.

``scripts/test.sh`` and ``.ci/run`` install the ``nemo-gym==0.4.0`` wheel (``--no-deps``); where
it is absent the tests that need it skip with the reason, and under ``CI=true`` they fail
instead (``require_service``). Modules marked ``nemo_gym`` use only what 0.4.0 and main share
and run in both. Tests marked ``nemo_gym_main`` need NeMo Gym's repository main (0.5.1, built
by ``scripts/nemo-gym-main-env.sh``): a section of their own (``SECTIONS`` in ``conftest.py``),
left out of the main suite; ``.ci/run`` runs both marks in that virtualenv with ``-m``, where
anything but main fails them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from types import ModuleType

from conftest import require_service

INSTALL = "pip install --no-deps --ignore-requires-python nemo-gym==0.4.0"
# A module main has and 0.4.0 lacks (its built-in providers were apptainer and opensandbox).
MAIN_ONLY_MODULE = "nemo_gym.sandbox.providers.docker"


def nemo_gym_sandbox() -> ModuleType:
    """``nemo_gym.sandbox``, or skip (fail under ``CI=true``) when the wheel is missing."""
    try:
        module = importlib.import_module("nemo_gym.sandbox")
    except ImportError as exc:
        require_service(False, f"nemo_gym.sandbox not importable ({exc}); {INSTALL}")
        raise
    return module


def nemo_gym_main() -> ModuleType:
    """``nemo_gym.sandbox`` of NeMo Gym main. The ``nemo_gym_main`` section (``SECTIONS`` in
    ``conftest.py``) fails its tests before they start where main is not installed; this is
    the same check for a test that calls it outside that section."""
    try:
        version = importlib.metadata.version("nemo-gym")
        has_main_module = importlib.util.find_spec(MAIN_ONLY_MODULE) is not None
    except (ImportError, ValueError) as exc:  # no nemo_gym at all
        version, has_main_module = f"not installed ({exc!r})", False
    require_service(
        has_main_module, f"needs NeMo Gym main ({MAIN_ONLY_MODULE}); nemo-gym here is {version}"
    )
    return importlib.import_module("nemo_gym.sandbox")
