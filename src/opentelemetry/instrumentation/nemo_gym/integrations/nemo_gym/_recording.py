"""Whether a module of NeMo Gym's own telemetry is loaded and recording.

NeMo Gym 0.6+ records some of the metrics this plugin records, in the same names (the sandbox
lifecycle in ``nemo_gym.telemetry.gym_metrics``, the process pressure in
``nemo_gym.telemetry.observer``). Where NeMo Gym's module is loaded and its telemetry exports,
NeMo Gym records them and we record none, so that no series is counted twice. The check never
imports NeMo Gym and never raises.
"""

from __future__ import annotations

import logging
import sys
from typing import Final

from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog

__all__ = ["nemo_gym_recording"]

logger = logging.getLogger(__name__)
_ONCE = OnceLog(logger)

_NEMO_GYM_SETUP_MODULE: Final = "nemo_gym.telemetry.setup"


def nemo_gym_recording(module_name: str) -> bool:
    """Whether NeMo Gym's ``module_name`` is loaded and recording: its ``metrics_exporting()``
    says so, or (a module without it) NeMo Gym's telemetry handle is exporting. A check that
    raises counts as not recording (logged once): NeMo Gym's recorders would fail the same
    way."""
    module = sys.modules.get(module_name)
    if module is None:
        return False
    try:
        exporting = getattr(module, "metrics_exporting", None)
        if callable(exporting):
            return bool(exporting())
        get_telemetry = getattr(sys.modules.get(_NEMO_GYM_SETUP_MODULE), "get_telemetry", None)
        if not callable(get_telemetry):
            return False
        telemetry = get_telemetry()
        return telemetry is not None and bool(getattr(telemetry, "is_exporting", False))
    except Exception as exc:  # noqa: BLE001 - telemetry never fails the application
        _ONCE(("nemo-gym-check", type(exc).__name__), logging.WARNING, "nemo_gym: %r", exc)
        return False
