"""``uninstrument()`` leaves the process as ``instrument()`` found it, whole.

Each check runs in a fresh interpreter (imports, loggers, exit handlers and signal handlers
are per process): it takes a snapshot of everything the plugin may change in a process
(docs/process-effects.md), instruments with every capability on and uses them (a timed pool
on a running loop, a uvicorn server's start, NeMo Gym's ``create_provider``), uninstruments,
and compares. wrapt's import finder is left out: the documentation says it stays (it patches
nothing once uninstrumented).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

WHOLE = textwrap.dedent(
    """
    import asyncio, atexit, gc, json, logging, os, signal, sys
    sys.argv[0] = "gym"  # NeMo Gym's command line: instrument() begins a run there
    mode = sys.argv[1]
    if mode == "own-handler":
        def own(signum, frame):
            pass
        signal.signal(signal.SIGTERM, own)

    # atexit has no list of its handlers (and _ncallbacks() counts unregistered slots too):
    # a ledger of what is registered and not unregistered, kept before anything registers.
    exit_handlers = []
    register, unregister = atexit.register, atexit.unregister
    def ledger_register(function, *args, **kwargs):
        exit_handlers.append(function)
        return register(function, *args, **kwargs)
    def ledger_unregister(function):
        exit_handlers[:] = [each for each in exit_handlers if each != function]
        return unregister(function)
    atexit.register, atexit.unregister = ledger_register, ledger_unregister

    import aiohttp, uvicorn.server
    import nemo_gym.sandbox.providers.registry as registry
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
    from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
        ProcessSandboxProvider,
    )

    trace.set_tracer_provider(TracerProvider())
    PATCHED = {
        "aiohttp.TCPConnector": vars(aiohttp.TCPConnector),
        "uvicorn.server.Server": vars(uvicorn.server.Server),
        "registry": vars(registry),
        "ProcessSandboxProvider": vars(ProcessSandboxProvider),
    }

    def snapshot():
        loggers = {
            name: (item.level, item.propagate, [id(h) for h in item.handlers])
            for name, item in [("", logging.root), *logging.root.manager.loggerDict.items()]
            if isinstance(item, logging.Logger)
        }
        return {
            "patched": {
                where: {name: id(value) for name, value in namespace.items()}
                for where, namespace in PATCHED.items()
            },
            "loggers": loggers,
            "environ": dict(os.environ),
            "atexit": [repr(function) for function in exit_handlers],
            "gc": [id(callback) for callback in gc.callbacks],
            "sigterm": id(signal.getsignal(signal.SIGTERM)),
        }

    def connects():
        data = reader.get_metrics_data()
        return sum(
            point.value
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == "gym.http.connection_pool.connect_total"
            for point in metric.data.data_points
        )

    async def use_then_uninstrument():
        global used, after
        connector = aiohttp.TCPConnector()  # timed, starts the pressure metrics on this loop
        assert type(connector).__name__ == "QueueTimedTCPConnector", type(connector)
        used = snapshot()
        instrumentor.uninstrument()
        after = snapshot()
        # A connector built while instrumented keeps its telemetry (as contrib's sessions keep
        # their trace configs): its connect after uninstrument() is counted (refused: port 1).
        async with aiohttp.ClientSession(connector=connector) as session:
            try:
                await session.get("http://127.0.0.1:1/")
            except aiohttp.ClientConnectionError:
                pass
        return type(connector).__name__, type(aiohttp.TCPConnector()).__name__

    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    # What importing does (a logger made, the system metrics' psutil exit handler) is not the
    # plugin's doing: done before the first snapshot.
    logging.getLogger("opentelemetry.instrumentation.nemo_gym")
    import opentelemetry.instrumentation.system_metrics
    before = snapshot()
    instrumentor = NemoGymInstrumentor()
    instrumentor.instrument()
    during = snapshot()
    kept, plain = asyncio.run(use_then_uninstrument())
    print(json.dumps({
        "before": before, "during": during, "used": used, "after": after,
        "kept": kept, "plain": plain, "connects_after": connects(),
        "own_sigterm_during": mode == "own-handler" and during["sigterm"] == before["sigterm"],
    }))
    """
)


def _run(mode: str) -> dict[str, object]:
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("OTEL_", "NEMO_GYM_"))
    }
    environment["OTEL_PYTHON_NEMO_GYM_LOG_LEVEL"] = "INFO"
    completed = subprocess.run(
        [sys.executable, "-c", WHOLE, mode],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    result: dict[str, object] = json.loads(completed.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize("mode", ["default-sigterm", "own-handler"])
def test_uninstrument_leaves_the_process_as_instrument_found_it(mode: str) -> None:
    """Patches, loggers and their handlers, the environment, exit and GC callbacks and the
    SIGTERM handler are after ``uninstrument()`` exactly what they were before ``instrument()``,
    while each of them was changed in between (the control: the snapshot sees them)."""
    result = _run(mode)
    before, during, used, after = (result[k] for k in ("before", "during", "used", "after"))
    assert isinstance(before, dict)
    assert isinstance(during, dict)
    assert isinstance(used, dict)
    for part in ("patched", "environ", "atexit", "gc", "sigterm"):
        assert after[part] == before[part], part  # type: ignore[index]
    # Loggers made meanwhile (modules imported by the telemetry) are as logging makes them.
    assert after["loggers"] == {  # type: ignore[index]
        **{name: [0, True, []] for name in after["loggers"]},  # type: ignore[index]
        **before["loggers"],
    }
    # The control: the snapshot saw each change while instrumented.
    assert during["patched"] != before["patched"]
    assert during["loggers"] != before["loggers"]
    assert set(during["environ"]) - set(before["environ"]) == {"NEMO_GYM_OTEL_RUN_ID"}
    assert len(used["atexit"]) == len(before["atexit"]) + 1
    assert len(used["gc"]) == len(before["gc"]) + 1
    if mode == "own-handler":
        assert result["own_sigterm_during"] is True  # the application's handler left alone
    else:
        assert during["sigterm"] != before["sigterm"]


def test_uninstrument_connectors_built_while_instrumented_keep_timing() -> None:
    """A connector built while instrumented stays timed after ``uninstrument()`` (as contrib's
    aiohttp sessions keep their instrumentation); one built afterwards is plain."""
    result = _run("default-sigterm")
    assert (result["kept"], result["plain"]) == ("QueueTimedTCPConnector", "TCPConnector")
    assert result["connects_after"] == 1
