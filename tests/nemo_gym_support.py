"""The installed NeMo Gym wheel (``nemo-gym==0.4.0``, installed ``--no-deps``) for tests.

``scripts/test.sh`` and ``.ci/run`` install it; where it is absent the tests that need it skip
with the reason, and under ``CI=true`` they fail instead (``require_service``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from conftest import require_service

INSTALL = "pip install --no-deps --ignore-requires-python nemo-gym==0.4.0"


def nemo_gym_sandbox() -> ModuleType:
    """``nemo_gym.sandbox``, or skip (fail under ``CI=true``) when the wheel is missing."""
    try:
        module = importlib.import_module("nemo_gym.sandbox")
    except ImportError as exc:
        require_service(False, f"nemo_gym.sandbox not importable ({exc}); {INSTALL}")
        raise
    return module
