"""Server process pressure: event-loop lag, garbage-collection pauses, requests in flight and
process resources, started on every uvicorn server's loop and every loop that builds an
aiohttp connector."""
