"""``runtime_env()`` builds Ray's runtime_env without Ray; ``setup_worker()`` is safe to call.

The real thing (a two-node cluster, a collector, a worker on the second node) is
tests/test_ray_cluster.py, which runs once in its own CI section.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
from opentelemetry.test.globals_test import reset_metrics_globals

from opentelemetry.instrumentation.nemo_gym import ray as ray_module
from opentelemetry.instrumentation.nemo_gym.ray import (
    SETUP_HOOK,
    flush,
    runtime_env,
    setup_worker,
)

HOOK_VARIABLE = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
SECRET = "sk-live-4242-hunter2"
CREDENTIALS = {
    "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer {SECRET}",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"x-api-key={SECRET}",
    "OTEL_EXPORTER_OTLP_METRICS_HEADERS": f"dd-api-key={SECRET}",
    "OTEL_EXPORTER_OTLP_LOGS_HEADERS": f"x-honeycomb-team={SECRET}",
    "OTEL_EXPORTER_OTLP_ENDPOINT": f"https://ci:{SECRET}@127.0.0.1:4318",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://{SECRET}@127.0.0.1:4318/v1/traces",
    "OTEL_EXPORTER_JAEGER_PASSWORD": SECRET,
    "OTEL_EXPORTER_VENDOR_TOKEN": SECRET,
    "OTEL_EXPORTER_VENDOR_API_KEY": SECRET,
    "OTEL_EXPORTER_VENDOR_CLIENTSECRET": SECRET,
    "OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY": f"-----BEGIN PRIVATE KEY-----\n{SECRET}\n",
}
TLS_PATHS = {
    "OTEL_EXPORTER_OTLP_CERTIFICATE": "/etc/otel/ca.pem",
    "OTEL_EXPORTER_OTLP_CLIENT_KEY": "/etc/otel/client.key",
    "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE": "/etc/otel/client.pem",
}


@pytest.fixture
def otel_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's OTEL_* settings: exactly two, and one unrelated variable."""
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "driver")
    monkeypatch.setenv("UNRELATED", "not copied")
    monkeypatch.delenv("NEMO_GYM_OTEL_RUN_ID", raising=False)


@pytest.mark.usefixtures("otel_environment")
def test_runtime_env_copies_otel_settings_and_installs_hook() -> None:
    """The driver's OTEL_* settings, the nemo_gym detector and the worker hook; nothing else."""
    assert runtime_env() == {
        "env_vars": {
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "nemo_gym",
            HOOK_VARIABLE: SETUP_HOOK,
        }
    }


@pytest.mark.usefixtures("otel_environment")
def test_runtime_env_driver_identity_not_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's service name and instance id stay with it; its other attributes travel."""
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES",
        "service.instance.id=driver-1, deployment.environment=ci,service.name=driver",
    )
    variables = runtime_env()["env_vars"]
    assert "OTEL_SERVICE_NAME" not in variables
    assert variables["OTEL_RESOURCE_ATTRIBUTES"] == " deployment.environment=ci"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=driver-1")
    assert "OTEL_RESOURCE_ATTRIBUTES" not in runtime_env()["env_vars"]


@pytest.mark.usefixtures("otel_environment")
def test_runtime_env_run_id_travels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's run (``NEMO_GYM_OTEL_RUN_ID``) is its workers' run too."""
    monkeypatch.setenv("NEMO_GYM_OTEL_RUN_ID", "3f2a9c1d0b7e")
    assert runtime_env()["env_vars"]["NEMO_GYM_OTEL_RUN_ID"] == "3f2a9c1d0b7e"


@pytest.mark.usefixtures("otel_environment")
def test_runtime_env_precedence_base_then_explicit() -> None:
    """Lowest first: this process, ``base['env_vars']``, ``env_vars``; ``base`` is kept."""
    base = {"pip": ["aiohttp"], "env_vars": {"OTEL_SERVICE_NAME": "base", "A": "1"}}
    built = runtime_env(base, env_vars={"OTEL_SERVICE_NAME": "explicit"})
    assert built["pip"] == ["aiohttp"]
    assert built["env_vars"]["OTEL_SERVICE_NAME"] == "explicit"
    assert built["env_vars"]["A"] == "1"
    assert base == {"pip": ["aiohttp"], "env_vars": {"OTEL_SERVICE_NAME": "base", "A": "1"}}


@pytest.mark.usefixtures("otel_environment")
def test_runtime_env_without_inheritance_copies_nothing() -> None:
    """``inherit_environment=False``: only what is given, plus the detector and the hook."""
    built = runtime_env(inherit_environment=False, env_vars={"OTEL_TRACES_EXPORTER": "none"})
    assert built["env_vars"] == {
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "nemo_gym",
        HOOK_VARIABLE: SETUP_HOOK,
    }


@pytest.mark.parametrize(
    ("configured", "expected"),
    [("", "nemo_gym"), ("host, process", "host,process,nemo_gym"), ("*", "*")],
    ids=["unset", "others", "all"],
)
def test_runtime_env_detector_listed_once(configured: str, expected: str) -> None:
    """The detector is added to the configured list, and not where ``*`` already covers it."""
    built = runtime_env(
        inherit_environment=False,
        env_vars={"OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": configured},
    )
    assert built["env_vars"]["OTEL_EXPERIMENTAL_RESOURCE_DETECTORS"] == expected


def test_runtime_env_base_with_hook_rejected() -> None:
    """A ``base`` with its own setup hook: ``ValueError`` naming the field and the value."""
    with pytest.raises(ValueError, match=r"worker_process_setup_hook='mine\.setup'"):
        runtime_env({"worker_process_setup_hook": "mine.setup"})


def test_runtime_env_non_string_value_named_by_key_never_shown() -> None:
    """A value that is not a string: ``TypeError`` naming the key and the type, not the value."""
    with pytest.raises(TypeError) as raised:
        runtime_env(env_vars={"OTEL_EXPORTER_OTLP_HEADERS": SECRET.encode()})  # type: ignore[dict-item]
    assert str(raised.value) == (
        "runtime_env: env_vars['OTEL_EXPORTER_OTLP_HEADERS'] is of type bytes (value not "
        "shown); Ray's env_vars maps strings to strings"
    )


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (
            {"env_vars": "A=1"},
            "runtime_env: env_vars must be a mapping of strings to strings, not str",
        ),
        (
            {"base": {"env_vars": ["A=1"]}},
            "runtime_env: base['env_vars'] must be a mapping of strings to strings, not list",
        ),
        ({"base": "A=1"}, "runtime_env: base must be a runtime_env mapping, not str"),
    ],
    ids=["env_vars-string", "base-env_vars-list", "base-string"],
)
def test_runtime_env_not_a_mapping_type_error(arguments: dict[str, Any], expected: str) -> None:
    """``env_vars="A=1"`` and the like raise the documented ``TypeError``, naming the field."""
    with pytest.raises(TypeError) as raised:
        runtime_env(**arguments)
    assert str(raised.value) == expected


@pytest.mark.parametrize(
    ("arguments", "given"),
    [
        (
            {"base": {"worker_process_setup_hook": "mine.setup"}},
            "base has worker_process_setup_hook",
        ),
        (
            {"base": {"env_vars": {HOOK_VARIABLE: "mine.setup"}}},
            f"base['env_vars'] has {HOOK_VARIABLE}",
        ),
        ({"env_vars": {HOOK_VARIABLE: "mine.setup"}}, f"env_vars has {HOOK_VARIABLE}"),
    ],
    ids=["field", "base-variable", "variable"],
)
def test_runtime_env_own_setup_hook_rejected_field_or_variable(
    arguments: dict[str, Any], given: str
) -> None:
    """A hook of one's own, by Ray's field or by its variable: one ``ValueError`` naming it."""
    with pytest.raises(ValueError, match=r"a worker setup hook of your own") as raised:
        runtime_env(**arguments)
    assert str(raised.value).startswith(f"runtime_env: {given}='mine.setup' (")
    assert str(raised.value).endswith(f"call {SETUP_HOOK}() from yours instead")


def test_runtime_env_our_own_setup_hook_accepted() -> None:
    """Our hook, by the field or inside a runtime_env() given as ``base``, is no conflict."""
    once = runtime_env(inherit_environment=False)
    assert runtime_env(once, inherit_environment=False) == once
    built = runtime_env({"worker_process_setup_hook": SETUP_HOOK}, inherit_environment=False)
    assert built["worker_process_setup_hook"] == SETUP_HOOK
    assert built["env_vars"][HOOK_VARIABLE] == SETUP_HOOK


@pytest.fixture
def credentials_in_environment(
    otel_environment: None, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """A driver whose OTEL_* settings hold credentials in every form the runtime_env withholds,
    in a fresh process (no notice about them logged yet)."""
    for name, value in {**CREDENTIALS, **TLS_PATHS}.items():
        monkeypatch.setenv(name, value)
    ray_module._ONCE.reset()
    yield
    ray_module._ONCE.reset()


@pytest.mark.usefixtures("credentials_in_environment")
def test_runtime_env_credentials_not_inherited(caplog: pytest.LogCaptureFixture) -> None:
    """Headers, password/token/key/secret names, URL user-info and pasted PEM stay out; TLS
    file paths travel; one INFO line names what was left out, never a value."""
    caplog.set_level(logging.INFO, logger=ray_module.__name__)
    built = runtime_env()
    runtime_env()
    assert built == {
        "env_vars": {
            "OTEL_METRICS_EXPORTER": "otlp",
            **TLS_PATHS,
            "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "nemo_gym",
            HOOK_VARIABLE: SETUP_HOOK,
        }
    }
    assert SECRET not in repr(built)
    assert [r.getMessage() for r in caplog.records] == [
        f"nemo_gym: runtime_env() left {', '.join(sorted(CREDENTIALS))} out of the Ray "
        "runtime_env (Ray logs it and shows it on its dashboard in plain text); Ray workers "
        "read them from their node's environment, or pass inherit_credentials=True"
    ]


@pytest.mark.usefixtures("credentials_in_environment")
def test_runtime_env_inherit_credentials_opt_in_copies_them() -> None:
    """``inherit_credentials=True`` copies every credential, as the docstring's risk says."""
    variables = runtime_env(inherit_credentials=True)["env_vars"]
    for name, value in {**CREDENTIALS, **TLS_PATHS}.items():
        assert variables[name] == value


def test_runtime_env_explicit_credential_copied_as_given() -> None:
    """A header passed in ``env_vars`` is the caller's explicit choice and is copied."""
    headers = {"OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer {SECRET}"}
    assert (
        runtime_env(env_vars=headers, inherit_environment=False)["env_vars"][
            "OTEL_EXPORTER_OTLP_HEADERS"
        ]
        == f"authorization=Bearer {SECRET}"
    )


def test_setup_worker_configured_sdk_left_alone(
    global_meter_provider: MeterProvider, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the SDK is already configured (an inherited environment), the hook changes nothing."""
    caplog.set_level(logging.DEBUG, logger="opentelemetry.instrumentation.nemo_gym.ray")
    setup_worker()
    assert metrics.get_meter_provider() is global_meter_provider
    assert [record.getMessage() for record in caplog.records] == [
        "nemo_gym: OpenTelemetry already configured in this Ray worker"
    ]


def test_flush_exports_what_was_recorded() -> None:
    """``flush()`` exports at once what a 600 s periodic reader would have held back."""
    out = io.StringIO()
    reader = PeriodicExportingMetricReader(
        ConsoleMetricExporter(out=out), export_interval_millis=600_000
    )
    provider = MeterProvider(metric_readers=[reader])
    reset_metrics_globals()
    metrics.set_meter_provider(provider)
    try:
        provider.get_meter("test").create_counter("flushed_counter").add(3)
        assert "flushed_counter" not in out.getvalue()
        assert flush() is True
        assert "flushed_counter" in out.getvalue()
    finally:
        provider.shutdown()
        reset_metrics_globals()
