"""The Ray walk-through of docs/identity-and-ray.md: its ``console`` block and its ray_task.py.

Read from the page by tests/test_ray_walkthrough.py, which runs them, and by
tests/test_docs_commands.py, which leaves them to it.
"""

from __future__ import annotations

import re
from pathlib import Path

RAY_PAGE = Path(__file__).resolve().parents[1] / "docs" / "identity-and-ray.md"
# The page's own port for the head node, in `ray start` and in ray_task.py's `ray.init`.
HEAD_PORT = "6380"


def _blocks(kind: str) -> list[str]:
    text = RAY_PAGE.read_text(encoding="utf-8")
    return re.findall(rf"^```{kind}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def walkthrough_commands() -> list[str]:
    """The commands of the page's one ``console`` block that starts a Ray cluster, in order,
    as a user types them (a trailing ``# comment`` included)."""
    blocks = [block for block in _blocks("console") if "ray start" in block]
    assert len(blocks) == 1, f"{RAY_PAGE.name}: {len(blocks)} console blocks run `ray start`"
    return [line[2:] for line in blocks[0].splitlines() if line.startswith("$ ")]


def ray_task_source() -> str:
    """The page's ray_task.py: its one ``python`` block that calls ``ray.init(``."""
    blocks = [block for block in _blocks("python") if "ray.init(" in block]
    assert len(blocks) == 1, f"{RAY_PAGE.name}: {len(blocks)} python blocks call ray.init("
    return blocks[0]
