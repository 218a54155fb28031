"""NeMo Gym's answers to what the sandbox core asks (``sandbox._host``): the NeMo Gym server
this process is, and whether NeMo Gym's own ``gym_metrics`` records the sandbox lifecycle.

NeMo Gym 0.6+ records the lifecycle metrics in ``nemo_gym.telemetry.gym_metrics``, in the
names ``sandbox/_lifecycle_metrics.py`` records them in; where that module is loaded and its
telemetry exports (``nemo_gym_recording``), NeMo Gym records them and the core records none.
Registered by the instrumentation package when it is imported; never imports NeMo Gym.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym._identity import (
    ATTR_SERVER_NAME,
    server_name,
)
from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym._recording import (
    nemo_gym_recording,
)
from opentelemetry.instrumentation.nemo_gym.sandbox._host import HOST

__all__ = ["NEMO_GYM_METRICS_MODULE", "register"]

NEMO_GYM_METRICS_MODULE: Final = "nemo_gym.telemetry.gym_metrics"


def _server_attributes() -> Mapping[str, str]:
    server = server_name(os.environ)
    return {} if server is None else {ATTR_SERVER_NAME: server}


def _records_lifecycle() -> bool:
    return nemo_gym_recording(NEMO_GYM_METRICS_MODULE)


def register() -> None:
    """Make NeMo Gym's answers the sandbox core's."""
    HOST.register(server_attributes=_server_attributes, records_lifecycle=_records_lifecycle)
