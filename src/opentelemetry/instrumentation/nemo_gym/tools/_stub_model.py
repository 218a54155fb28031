"""``nemo-gym-otel stub-model``: an OpenAI-compatible model endpoint that needs no model.

The deployment walk-through (docs/nemo-gym-deployment.md) points NeMo Gym's ``openai_model``
server at ``--model-url``. Without anything listening there, ``gym eval run`` waits for good
while the model server retries. This command serves that endpoint on loopback with aiohttp:

* ``POST /v1/responses`` answers as a model that calls a tool first and then answers in text:
  when the request offers function tools and its input holds no ``function_call_output`` yet,
  the answer is one ``function_call`` of the first tool, with each required argument filled by
  a placeholder of its JSON-schema type; otherwise one assistant message. NeMo Gym's
  ``example_single_tool_call`` environment so makes exactly two model calls per rollout.
* ``GET /v1/models`` lists the one model it serves, so a user can check the endpoint
  (``curl -sf http://127.0.0.1:8000/v1/models``) before starting the eval.
* ``GET /stats`` returns how many ``/v1/responses`` requests it has answered (what the
  deployment test compares the model server's connects with).

Nothing here runs at import time of the plugin: ``cli.py`` imports this module only for the
subcommand.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from typing import Any

from aiohttp import web

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MODEL = "my-model"  # the name docs/nemo-gym-deployment.md passes as --model
ANSWER = "It is cold."  # the text answer, once the tool's output is in the input
# A required tool argument's placeholder, by its JSON-schema type.
_PLACEHOLDERS: dict[str, Any] = {
    "string": "San Francisco",
    "integer": 0,
    "number": 0,
    "boolean": False,
    "array": [],
    "object": {},
}


class StubModel:
    """The endpoint's state: the model name it serves, ids it hands out, requests answered."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.responses_served = 0
        self._ids = itertools.count(1)

    def application(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/stats", self._stats)
        return app

    async def _responses(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body is not a JSON object")
        self.responses_served += 1
        return web.json_response(self.response(body))

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.model, "object": "model", "created": 0, "owned_by": "nemo-gym-otel"}
        return web.json_response({"object": "list", "data": [model]})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response({"responses": self.responses_served})

    def response(self, body: dict[str, Any]) -> dict[str, Any]:
        """The Responses API object answering ``body``: a tool call first, then text."""
        n = next(self._ids)
        tool = _first_function_tool(body)
        if tool is not None and not _has_tool_output(body):
            output: dict[str, Any] = {
                "id": f"fc_{n}",
                "type": "function_call",
                "call_id": f"call_{n}",
                "name": tool["name"],
                "arguments": json.dumps(_placeholder_arguments(tool)),
                "status": "completed",
            }
        else:
            output = {
                "id": f"msg_{n}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": ANSWER, "annotations": []}],
            }
        return {
            "id": f"resp_{n}",
            "object": "response",
            "created_at": time.time(),
            "model": body.get("model", self.model),
            "output": [output],
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


def _error(status: int, message: str) -> web.Response:
    error = {"message": message, "type": "invalid_request"}
    return web.json_response({"error": error}, status=status)


def _first_function_tool(body: dict[str, Any]) -> dict[str, Any] | None:
    tools = body.get("tools")
    if not isinstance(tools, list):
        return None
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "function" and tool.get("name"):
            return tool
    return None


def _has_tool_output(body: dict[str, Any]) -> bool:
    items = body.get("input")
    return isinstance(items, list) and any(
        isinstance(item, dict) and item.get("type") == "function_call_output" for item in items
    )


def _placeholder_arguments(tool: dict[str, Any]) -> dict[str, Any]:
    parameters = tool.get("parameters")
    if not isinstance(parameters, dict):
        return {}
    properties = parameters.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = parameters.get("required")
    arguments = {}
    for name in required if isinstance(required, list) else []:
        schema = properties.get(name)
        kind = schema.get("type") if isinstance(schema, dict) else None
        arguments[str(name)] = _PLACEHOLDERS.get(kind, "") if isinstance(kind, str) else ""
    return arguments


async def serve(host: str, port: int, model: str) -> None:
    """Serve until cancelled; print the endpoint (with the port taken, for ``--port 0``)."""
    runner = web.AppRunner(StubModel(model).application(), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound = runner.addresses[0][1]
        print(
            f"stub model {model!r} serving http://{host}:{bound}/v1 (POST /v1/responses, "
            f"GET /v1/models); Ctrl-C ends it",
            flush=True,
        )
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0 to 65535; 0: any free one)")
    return port


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Register the ``stub-model`` subcommand on ``nemo-gym-otel``'s subparsers."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "stub-model",
        help="serve an OpenAI-compatible stub model on loopback (no model needed)",
        description=(
            "Serve an OpenAI-compatible Responses API endpoint that needs no model: it calls "
            "the first tool it is offered, then answers in text, so NeMo Gym's example agent "
            "finishes its rollouts. GET /v1/models lists the model, to check the endpoint. "
            "Runs until Ctrl-C."
        ),
    )
    parser.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})"
    )
    parser.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"port to listen on (default {DEFAULT_PORT}; 0: any free one, printed at start)",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"the model name /v1/models lists (default {DEFAULT_MODEL}; any name is answered)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C (exit status 0); 1 when the address cannot be bound."""
    try:
        asyncio.run(serve(args.host, args.port, args.model))
    except KeyboardInterrupt:
        return 0
    except OSError as error:
        print(
            f"nemo-gym-otel stub-model: error: cannot listen on --host {args.host} "
            f"--port {args.port}: {error.strerror or error}",
            file=sys.stderr,
        )
        return 1
    return 0
