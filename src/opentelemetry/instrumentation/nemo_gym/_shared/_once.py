"""Log a telemetry problem once, not once per request.

Failures inside telemetry repeat at the rate of the traffic that triggers them; one line per
distinct problem is what an operator can read. ``OnceLog`` remembers which keys it has
logged; later occurrences are dropped, or logged at debug level where the repeats are worth
keeping for someone who turns debug on.

Thread-safe: the event loop and an exporter's thread may log through the same instance.

``shown_value`` is how a configured value (an environment variable's, above all) appears in
such a line or in an error: the sandbox core logs through this module but may not import the
settings, so the one helper lives here, beside the one way of logging.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from typing import Final

MAX_SHOWN_CHARS: Final = 64
"""The most characters of a value that a log line or an error quotes."""


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


def shown_value(value: object) -> str:
    """``value`` for a log line or an error: its ``repr``, cut to ``MAX_SHOWN_CHARS`` characters.

    An environment variable can hold anything, 5,000 digits or a pasted file; the warning
    about it must stay one readable line. A cut value is followed by its full length, so the
    reader knows it was cut and by how much. A string is cut before quoting, so the quotes
    stay balanced.
    """
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= MAX_SHOWN_CHARS:
        return repr(value)
    cut = repr(text[:MAX_SHOWN_CHARS]) if isinstance(value, str) else text[:MAX_SHOWN_CHARS]
    return f"{cut}... ({len(text)} characters)"
