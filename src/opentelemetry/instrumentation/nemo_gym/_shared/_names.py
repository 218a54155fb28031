"""The names more than one module uses: the instrumentation scope and shared attribute keys.

Every tracer and meter of the package is named by the one scope, so a backend groups the
pool's, the sandboxes', the pressure metrics' and the rollout spans under one
``otel.scope.name``. A name that only one module uses stays beside its use (the pool's
instruments in ``telemetry/_instruments.py``, the sandbox metrics in their modules).

These values are a contract with dashboards and NeMo Gym's own telemetry: ``docs/names.md``
lists them, and ``tests/test_names_module.py`` keeps that table and this module equal.
Constants only: nothing here imports or runs anything.
"""

from __future__ import annotations

from typing import Final

# --- the instrumentation scope ------------------------------------------------------------

SCOPE_NAME: Final = "opentelemetry.instrumentation.nemo_gym"
TRACER_NAME: Final = SCOPE_NAME
METER_NAME: Final = SCOPE_NAME

# --- resource attributes (the detector, NeMo Gym's identity, Ray's) ------------------------

ATTR_SERVICE_NAME: Final = "service.name"
ATTR_SERVICE_INSTANCE_ID: Final = "service.instance.id"
ATTR_RUN_ID: Final = "nemo.run.id"

# --- metric and span attributes ----------------------------------------------------------

ATTR_ERROR_TYPE: Final = "error.type"
# Every key of a sandbox record and usage point starts so (``resource_telemetry.PREFIX``).
SANDBOX_PREFIX: Final = "nemo.gym.sandbox."
# The fleet metrics' provider attribute, and the label the Docker provider puts on every
# container it creates: one name, so an operator finds the containers by the metric's value.
ATTR_SANDBOX_PROVIDER: Final = SANDBOX_PREFIX + "provider"
# The value a capped label takes past its cap of distinct values (pool destinations,
# sandbox providers, error types).
OVERFLOW_LABEL_VALUE: Final = "other"
