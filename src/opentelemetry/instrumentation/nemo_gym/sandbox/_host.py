"""What the sandbox core asks of the application that creates the sandboxes.

The sandbox telemetry is the same whatever application creates sandboxes, but two of its
answers belong to that application: which of its servers this process is (the usage totals
carry it as attributes) and whether the application records the sandbox lifecycle metrics
itself (then this package records none, so nothing is counted twice). The core asks ``HOST``;
an integration registers its answers there (``integrations.nemo_gym._sandbox_host``, when the
package is imported), so the core imports no integration. Until one does: no attributes, and
nobody else records.

``HOST`` lives as long as the process: registered once at import, read on each record.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

__all__ = ["HOST", "SandboxHost"]


def _no_attributes() -> Mapping[str, str]:
    return {}


def _nobody_else_records() -> bool:
    return False


class SandboxHost:
    """The registered answers; each is called on the recording thread, must not block and
    must not raise (an integration's check logs its own failure and answers the default)."""

    def __init__(self) -> None:
        self._server_attributes: Callable[[], Mapping[str, str]] = _no_attributes
        self._records_lifecycle: Callable[[], bool] = _nobody_else_records

    def register(
        self,
        *,
        server_attributes: Callable[[], Mapping[str, str]],
        records_lifecycle: Callable[[], bool],
    ) -> None:
        """Answer from now on with these: the attributes naming this process's server (empty
        outside one), and whether the application records the lifecycle metrics itself."""
        self._server_attributes = server_attributes
        self._records_lifecycle = records_lifecycle

    def server_attributes(self) -> Mapping[str, str]:
        return self._server_attributes()

    def records_lifecycle(self) -> bool:
        return self._records_lifecycle()


HOST: Final = SandboxHost()
