"""What this instrumentation instruments, in the form ``opentelemetry-instrument`` checks."""

_instruments = ("aiohttp >= 3.10.11, < 4",)

_supports_metrics = True
