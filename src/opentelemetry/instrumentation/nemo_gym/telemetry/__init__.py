"""aiohttp connection-pool telemetry: queue waits, connects per destination, capacity checks."""
