"""An OpenAI-compatible Responses API stub for the NeMo Gym deployment test.

Run as ``python openai_stub.py PORT_FILE``: serves on 127.0.0.1 on a free port, writes the port
to PORT_FILE, and answers ``POST /v1/responses`` as a model that always calls the
``get_weather`` tool first and answers in text once it has the tool's output, so each rollout of
NeMo Gym's ``example_single_tool_call`` environment makes exactly two model calls.
``GET /stats`` returns how many ``/v1/responses`` requests it has served (the number the test
compares the model server's connects with). Standard library and aiohttp only.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import time
from typing import Any

from aiohttp import web

_ids = itertools.count(1)
served = {"responses": 0}


def _response(body: dict[str, Any], output: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": f"resp_{next(_ids)}",
        "object": "response",
        "created_at": time.time(),
        "model": body.get("model", "stub"),
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": body.get("tools", []),
        "status": "completed",
        "usage": {
            "input_tokens": 10,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 5,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 15,
        },
    }


def _has_tool_output(body: dict[str, Any]) -> bool:
    items = body.get("input")
    return isinstance(items, list) and any(
        isinstance(item, dict) and item.get("type") == "function_call_output" for item in items
    )


async def responses(request: web.Request) -> web.Response:
    body = await request.json()
    served["responses"] += 1
    n = next(_ids)
    if _has_tool_output(body):
        output = [
            {
                "id": f"msg_{n}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "It is cold.", "annotations": []}],
            }
        ]
    else:
        output = [
            {
                "id": f"fc_{n}",
                "type": "function_call",
                "call_id": f"call_{n}",
                "name": "get_weather",
                "arguments": json.dumps({"city": "San Francisco"}),
                "status": "completed",
            }
        ]
    return web.json_response(_response(body, output))


async def stats(request: web.Request) -> web.Response:
    return web.json_response(served)


async def serve(port_file: str) -> None:
    app = web.Application()
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/stats", stats)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    _announce(port_file, runner.addresses[0][1])
    await asyncio.Event().wait()


def _announce(port_file: str, port: int) -> None:
    # Written whole, then renamed: the test never reads half a port number.
    with open(port_file + ".tmp", "w") as f:
        f.write(str(port))
    os.replace(port_file + ".tmp", port_file)


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1]))
