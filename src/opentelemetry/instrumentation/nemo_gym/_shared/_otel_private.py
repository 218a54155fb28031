"""The OpenTelemetry API's private names this package reads when it is imported, each guarded.

The API offers no public way to tell its proxy meter provider from a real one, nor the
context keys behind ``suppress_instrumentation``, so those are read by name. A later release
may rename them; importing this package must not fail because of that. A name that is gone
turns off the capability that needs it, and one warning, at import, names both.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)


def private_name(module: str, name: str, capability: str) -> object | None:
    """``module.name``, or ``None`` (and one warning naming ``capability``) where it is gone.

    Called once per name, at import. Never raises.
    """
    try:
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]
    except Exception as error:  # noqa: BLE001 - a renamed internal must not break importing
        logger.warning(
            "nemo_gym: %s is off: this OpenTelemetry has no %s.%s (%s: %s)",
            capability,
            module,
            name,
            type(error).__name__,
            error,
        )
        return None
