"""The container side of ``DockerSandboxProvider``: its state in a handle, the shell snippets
it runs inside containers, and the engine's status words. Pure: no engine calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxStatus

# Keeps the container alive until it is removed; TERM ends it at once.
KEEP_ALIVE = "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"
# Runs an exec's command after printing the shell's PID, so a timed-out command can be killed:
# the exec API itself has no way to stop what it started.
EXEC_WRAPPER = 'echo "$$"; exec /bin/sh -c "$1"'
# Stops a process and its descendants (through /proc/<pid>/task/<pid>/children), parents first
# so none spawns a new child meanwhile.
KILL_TREE = (
    'k() { kill -STOP "$1" 2>/dev/null; '
    'for c in $(cat /proc/"$1"/task/"$1"/children 2>/dev/null); do k "$c"; done; '
    'kill -KILL "$1" 2>/dev/null; }; k "$1"'
)
STATUS = {
    "created": SandboxStatus.STARTING,
    "configured": SandboxStatus.STARTING,
    "initialized": SandboxStatus.STARTING,
    "restarting": SandboxStatus.STARTING,
    "running": SandboxStatus.RUNNING,
    "paused": SandboxStatus.RUNNING,
    "stopping": SandboxStatus.RUNNING,
    "exited": SandboxStatus.STOPPED,
    "stopped": SandboxStatus.STOPPED,
    "removing": SandboxStatus.STOPPED,
    "dead": SandboxStatus.ERROR,
}


@dataclass(frozen=True)
class Container:
    """The provider's state in ``SandboxHandle.raw``."""

    id: str
    name: str
    workdir: str


def split_pid(stdout: bytes) -> tuple[int | None, bytes]:
    """Separate the wrapper's PID line from the command's own output."""
    line, newline, rest = stdout.partition(b"\n")
    if not newline or not line.strip().isdigit():
        return None, stdout
    return int(line), rest
