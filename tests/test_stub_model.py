"""``nemo-gym-otel stub-model``: the OpenAI-compatible endpoint of the deployment walk-through,
run as the command it is (a real subprocess on a loopback port)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.integration

# The tool NeMo Gym's example_single_tool_call offers (its example.jsonl).
GET_WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "strict": True,
}
COMMAND = [sys.executable, "-m", "opentelemetry.instrumentation.nemo_gym.tools.cli", "stub-model"]


@pytest.fixture
def stub() -> Iterator[str]:
    """The command on a free port; yields its base URL (from the line it prints at start)."""
    with subprocess.Popen(
        [*COMMAND, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            assert line.startswith("stub model 'my-model' serving http://127.0.0.1:"), line
            yield line.split(" serving ", 1)[1].split(" ", 1)[0]  # http://127.0.0.1:<port>/v1
        finally:
            process.send_signal(signal.SIGINT)  # Ctrl-C ends it with status 0
            _, errors = process.communicate(timeout=30)
            assert process.returncode == 0, errors


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def test_stub_model_calls_the_tool_then_answers(stub: str) -> None:
    """A first request with a tool gets one function call with every required argument; once
    the tool's output is in the input, one text message; /stats counts both."""
    first = _post(
        f"{stub}/responses",
        {
            "model": "my-model",
            "input": [{"role": "user", "content": "sf?"}],
            "tools": [GET_WEATHER],
        },
    )
    (call,) = first["output"]
    assert (call["type"], call["name"], call["status"]) == (
        "function_call",
        "get_weather",
        "completed",
    )
    assert json.loads(call["arguments"]) == {"city": "San Francisco", "days": 0}
    assert first["status"] == "completed"
    assert first["model"] == "my-model"

    second = _post(
        f"{stub}/responses",
        {
            "model": "my-model",
            "input": [
                {"role": "user", "content": "sf?"},
                {**call},
                {"type": "function_call_output", "call_id": call["call_id"], "output": "cold"},
            ],
            "tools": [GET_WEATHER],
        },
    )
    (message,) = second["output"]
    assert (message["type"], message["role"]) == ("message", "assistant")
    assert message["content"][0]["text"] == "It is cold."
    assert second["id"] != first["id"]
    assert _get(stub.removesuffix("/v1") + "/stats") == {"responses": 2}


def test_stub_model_lists_its_model_and_rejects_a_non_json_body(stub: str) -> None:
    """GET /v1/models lists the one model (the endpoint check of the walk-through); a body that
    is not JSON gets 400 and is not counted."""
    models = _get(f"{stub}/models")
    assert [model["id"] for model in models["data"]] == ["my-model"]
    request = urllib.request.Request(f"{stub}/responses", data=b"not json")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 400
    refused.value.close()
    assert _get(stub.removesuffix("/v1") + "/stats") == {"responses": 0}


def test_stub_model_taken_port_exits_1_naming_it() -> None:
    """A port someone listens on: exit status 1, the reason naming --host and --port."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(
            [*COMMAND, "--port", str(port)], capture_output=True, text=True, timeout=60
        )
    assert done.returncode == 1
    assert f"cannot listen on --host 127.0.0.1 --port {port}" in done.stderr


def test_stub_model_bad_port_exits_2() -> None:
    """A port out of range is bad input: exit status 2 naming --port and the value."""
    done = subprocess.run([*COMMAND, "--port", "70000"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "argument --port: 70000 is not a port" in done.stderr
