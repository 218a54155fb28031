"""Every relative link in the README and the pages beside it leads somewhere: to a file of the
repository and, where it names one, to a heading of that file.

Anchors are GitHub's: a heading lower-cased, with everything but letters, digits, spaces,
hyphens and underscores dropped, and spaces turned into hyphens (a repeated heading gets
``-1``, ``-2``, ...).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = (
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    ROOT / "benchmarks" / "README.md",
    ROOT / "examples" / "prometheus" / "README.md",
    ROOT / "examples" / "grafana" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
)
# Pages the README links to that are written on other branches (the tracing and names pages);
# test_docs_links_pending_pages_are_still_missing says when to drop an entry.
PENDING_PAGES: set[Path] = set()

_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.MULTILINE)


def _prose(text: str) -> str:
    """The page without code: a link-like text in a code block or span is no link."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a page's ``text``."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def anchors(page: Path) -> set[str]:
    """The anchors of the headings of ``page``."""
    return heading_anchors(page.read_text(encoding="utf-8"))


def relative_links(page: Path) -> list[str]:
    """The links of ``page`` that point into the repository (not to a URL)."""
    return [
        target
        for target in _LINK.findall(_prose(page.read_text(encoding="utf-8")))
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)
    ]


LINKS = [(page, target) for page in PAGES for target in relative_links(page)]


def test_docs_links_found_on_every_page() -> None:
    """The pages exist and the README links onward (the scan is not silently empty)."""
    for page in PAGES:
        assert page.is_file(), page
    readme_links = {target for page, target in LINKS if page.name == "README.md"}
    assert "docs/quickstart.md" in readme_links
    assert "CONTRIBUTING.md" in readme_links
    assert len(LINKS) >= 30, LINKS


@pytest.mark.parametrize(
    ("page", "target"),
    LINKS,
    ids=[f"{page.relative_to(ROOT)}->{target}" for page, target in LINKS],
)
def test_docs_link_resolves(page: Path, target: str) -> None:
    """The link's file exists, and its anchor, if any, is a heading of that file."""
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    if linked in PENDING_PAGES:
        return
    assert linked.exists(), f"{page.relative_to(ROOT)}: {target!r} names no file"
    assert linked.is_relative_to(ROOT), f"{page.relative_to(ROOT)}: {target!r} leaves the repo"
    if anchor and linked.suffix == ".md":
        assert anchor in anchors(linked), (
            f"{page.relative_to(ROOT)}: {target!r}: no such heading in {linked.name}; "
            f"there are {sorted(anchors(linked))}"
        )


def test_docs_links_pending_pages_are_still_missing() -> None:
    """A page written on another branch is checked like any other once it is here: drop it from
    PENDING_PAGES then."""
    arrived = sorted(str(page.relative_to(ROOT)) for page in PENDING_PAGES if page.exists())
    assert not arrived, f"now in the repository, remove from PENDING_PAGES: {arrived}"


def test_docs_links_anchor_rules() -> None:
    """Anchors follow GitHub's rule: code marks and punctuation dropped, repeats numbered, and
    a heading inside a code block is no heading."""
    text = "# Pressure: what holds a server's event loop\n## `nemo_gym` and Ray\n## Ray\n## Ray\n"
    text += "```\n# a shell comment\n```\n"
    assert heading_anchors(text) == {
        "pressure-what-holds-a-servers-event-loop",
        "nemo_gym-and-ray",
        "ray",
        "ray-1",
    }
