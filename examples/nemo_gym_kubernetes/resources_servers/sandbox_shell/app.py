"""A NeMo Gym resources server whose every rollout gets a sandbox of its own.

It drives NeMo Gym's sandbox API the way NeMo Gym's own sandboxed environments do
(``resources_servers/litmus_agent``, ``responses_api_agents/mini_swe_agent_2`` in NeMo Gym's
repository): ``AsyncSandbox(provider, spec).start()`` with the provider named by
``sandbox_provider`` (a block of the merged configuration, such as the ``sandbox`` block of
NeMo Gym's ``nemo_gym/sandbox/providers/opensandbox/configs/opensandbox.yaml``) and the shape
given by ``sandbox_spec``. Per rollout:

* ``/seed_session`` creates the sandbox and uploads the task's input file;
* ``/run_task`` (the one tool the tasks offer) runs the task's shell command in it and
  downloads what the command wrote;
* ``/verify`` rewards an exit status equal to the task's ``expected_exit_code`` and closes the
  sandbox; sandboxes of rollouts that never reach ``/verify`` are closed when the server ends.

This server is an example for docs/nemo-gym-kubernetes.md: it is NeMo Gym user code with no
telemetry of its own. Run under ``opentelemetry-instrument``, the plugin's ``nemo_gym``
instrumentor records each sandbox (its spans, its allocation, its usage samples).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.global_config import get_global_config_dict
from nemo_gym.sandbox import (
    AsyncSandbox,
    SandboxResources,
    SandboxSpec,
    resolve_provider_config,
)
from nemo_gym.server_utils import SESSION_ID_KEY
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

# Where a task's input is uploaded and where its command leaves its result.
INPUT_PATH = "/tmp/task-input.txt"
OUTPUT_PATH = "/tmp/task-output.txt"


class SandboxShellConfig(BaseResourcesServerConfig):
    # The name of a sandbox block of the merged configuration (``sandbox`` in NeMo Gym's
    # provider configs), or an inline ``{provider: {...}}`` mapping.
    sandbox_provider: str | dict[str, Any] = "sandbox"
    # image, resources (cpu, memory_mib, disk_gib, gpu), ready_timeout_s, ttl_s, metadata,
    # provider_options: SandboxSpec's fields.
    sandbox_spec: dict[str, Any] = Field(default_factory=dict)
    command_timeout_s: float = 120.0


class SandboxShellSeedSessionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    command: str
    input: str = ""


class SandboxShellVerifyRequest(BaseVerifyRequest):
    model_config = ConfigDict(extra="allow")
    expected_exit_code: int = 0


class RunTaskRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # the model's arguments, unused


class RunTaskResponse(BaseModel):
    exit_code: int | None
    stdout: str
    output: str
    error: str | None = None


class _Rollout:
    """One rollout's sandbox, its task and what its command did."""

    def __init__(self, sandbox: AsyncSandbox, command: str) -> None:
        self.sandbox = sandbox
        self.command = command
        self.exit_code: int | None = None


class SandboxShellServer(SimpleResourcesServer):
    config: SandboxShellConfig
    # Session id -> its rollout: what seed_session made, until verify closes it.
    _rollouts: dict[str, _Rollout] = PrivateAttr(default_factory=dict)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/run_task")(self.run_task)
        serving = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def closing_sandboxes(app: FastAPI) -> AsyncIterator[Any]:
            async with serving(app) as state:
                yield state
            await asyncio.gather(*(self._close(key) for key in list(self._rollouts)))

        app.router.lifespan_context = closing_sandboxes
        return app

    def _spec(self) -> SandboxSpec:
        spec = dict(self.config.sandbox_spec)
        known = SandboxSpec(
            image=spec.pop("image"),
            ready_timeout_s=spec.pop("ready_timeout_s", None),
            ttl_s=spec.pop("ttl_s", None),
            metadata={**spec.pop("metadata", {}), "nemo_gym_server": self.config.name},
            resources=SandboxResources.from_mapping(spec.pop("resources", {})),
            provider_options=dict(spec.pop("provider_options", {})),
        )
        if spec:
            raise ValueError(f"sandbox_spec: unknown keys {sorted(spec)}")
        return known

    async def seed_session(
        self, request: Request, body: SandboxShellSeedSessionRequest
    ) -> BaseSeedSessionResponse:
        provider = resolve_provider_config(self.config.sandbox_provider, get_global_config_dict())
        sandbox = await AsyncSandbox(provider, self._spec()).start()
        rollout = _Rollout(sandbox, body.command)
        self._rollouts[request.session[SESSION_ID_KEY]] = rollout
        with tempfile.TemporaryDirectory() as folder:
            local = Path(folder, "input.txt")
            await asyncio.to_thread(local.write_text, body.input)
            await sandbox.upload(local, INPUT_PATH)
        return BaseSeedSessionResponse()

    async def run_task(self, request: Request, body: RunTaskRequest) -> RunTaskResponse:
        rollout = self._rollouts.get(request.session[SESSION_ID_KEY])
        if rollout is None:
            return RunTaskResponse(exit_code=None, stdout="", output="", error="no sandbox")
        timeout_s = self.config.command_timeout_s
        try:
            result = await rollout.sandbox.exec(rollout.command, timeout_s=timeout_s)
        except Exception as error:  # the provider's, as the model would see it
            return RunTaskResponse(exit_code=None, stdout="", output="", error=repr(error))
        rollout.exit_code = result.return_code
        output = ""
        # A command that wrote nothing (or whose container was killed) has no output file.
        with tempfile.TemporaryDirectory() as folder, contextlib.suppress(Exception):
            local = Path(folder, "output.txt")
            await rollout.sandbox.download(OUTPUT_PATH, local)
            output = await asyncio.to_thread(local.read_text)
        stdout = result.stdout or ""
        return RunTaskResponse(exit_code=result.return_code, stdout=stdout, output=output)

    async def verify(self, request: Request, body: SandboxShellVerifyRequest) -> BaseVerifyResponse:
        session_id = request.session[SESSION_ID_KEY]
        rollout = self._rollouts.get(session_id)
        exit_code = rollout.exit_code if rollout is not None else None
        await self._close(session_id)
        reward = float(exit_code == body.expected_exit_code)
        return BaseVerifyResponse(**body.model_dump(), reward=reward)

    async def _close(self, session_id: str) -> None:
        rollout = self._rollouts.pop(session_id, None)
        if rollout is not None:
            await rollout.sandbox.stop()


if __name__ == "__main__":
    SandboxShellServer.run_webserver()
