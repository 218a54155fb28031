"""Log a telemetry problem once, not once per request.

Failures inside telemetry repeat at the rate of the traffic that triggers them; one line per
distinct problem is what an operator can read. ``OnceLog`` remembers which keys it has
logged; later occurrences are dropped, or logged at debug level where the repeats are worth
keeping for someone who turns debug on.

Thread-safe: the event loop and an exporter's thread may log through the same instance.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable


class OnceLog:
    """Log through ``logger`` the first time each key is seen.

    With ``repeats_at_debug`` later occurrences of a key are logged at debug level; without
    it they are dropped. Never raises for a hashable key.
    """

    def __init__(self, logger: logging.Logger, *, repeats_at_debug: bool = False) -> None:
        self._logger = logger
        self._repeats_at_debug = repeats_at_debug
        self._seen: set[Hashable] = set()
        self._lock = threading.Lock()

    def __call__(
        self,
        key: Hashable,
        level: int,
        message: str,
        *args: object,
        exc_info: BaseException | None = None,
    ) -> None:
        with self._lock:
            first = key not in self._seen
            self._seen.add(key)
        if first:
            self._logger.log(level, message, *args, exc_info=exc_info)
        elif self._repeats_at_debug:
            self._logger.debug(message, *args, exc_info=exc_info)

    def reset(self) -> None:
        """Forget every key (for tests)."""
        with self._lock:
            self._seen.clear()
