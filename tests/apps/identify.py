"""Print this process's OpenTelemetry resource and connector class as one JSON line.

Run under ``opentelemetry-instrument`` by tests/test_resource_detector.py: the resource is the
one the SDK built at start-up (so what every exported series carries), and the connector class
says whether the plugin instrumented this process.
"""

import asyncio
import json

import aiohttp
from opentelemetry import metrics


async def main() -> None:
    connector = aiohttp.TCPConnector()
    try:
        provider = metrics.get_meter_provider()
        config = getattr(provider, "_sdk_config", None)
        resource = dict(config.resource.attributes) if config is not None else {}
        print(json.dumps({"connector": type(connector).__name__, "resource": resource}))
    finally:
        await connector.close()


asyncio.run(main())
