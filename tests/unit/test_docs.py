"""The docs say what the code does: the transition table, links, and sources of their own.

Fails before the docs were rewritten: pages cited a design file that is not in
the repository, and the transition table lived nowhere in the docs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from celery_exactonce.core.states import ALLOWED, CREATABLE, NEXT_ATTEMPT_EDGES, State

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
PROTOCOL = ROOT / "docs" / "design" / "protocol.md"

_ROW = re.compile(r"^\| (\(none\)|`(\w+)`|terminal) \| (?:`(\w+)`|\(none\))(, attempt \+ 1)? \|")


def _edges() -> tuple[set[State], set[tuple[State, State]], set[tuple[State, State]]]:
    """What protocol.md's table says: creatable states, edges, next-attempt edges."""
    created: set[State] = set()
    edges: set[tuple[State, State]] = set()
    next_attempt: set[tuple[State, State]] = set()
    text = PROTOCOL.read_text(encoding="utf-8")
    table = text[text.index("| from | to | who |") :].split("\n\n", 1)[0]
    for line in table.splitlines():
        match = _ROW.match(line)
        if match is None or match.group(1) == "terminal":
            continue
        src, dst, nxt = match.group(2), match.group(3), match.group(4)
        if src is None:
            created.add(State(dst))
            continue
        edge = (State(src), State(dst))
        edges.add(edge)
        if nxt:
            next_attempt.add(edge)
    return created, edges, next_attempt


def test_the_protocol_page_lists_exactly_the_transitions_the_stores_allow() -> None:
    created, edges, next_attempt = _edges()
    allowed = {(src, dst) for src, dsts in ALLOWED.items() for dst in dsts}
    assert created == set(CREATABLE)
    assert edges == allowed, (sorted(edges - allowed), sorted(allowed - edges))
    assert next_attempt == set(NEXT_ATTEMPT_EDGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_a_page_cites_only_what_the_repository_holds(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"DESIGN\.md|SCENARIOS\.md|\bshared/", text)
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


DIFFERENCES_PAGE = ROOT / "docs" / "reference" / "differences.md"


def test_every_difference_on_its_page_has_a_compatibility_scenario() -> None:
    """Each case of differences.md names the scenario that tests it, and the table matches."""
    from tests.acceptance.test_compat import DIFFERENCES, SCENARIOS

    text = DIFFERENCES_PAGE.read_text(encoding="utf-8")
    named = {
        name
        for bracket in re.findall(r"\[(`[a-z_]+`(?:,\s*`[a-z_]+`)*)\]", text)
        for name in re.findall(r"`([a-z_]+)`", bracket)
    }
    assert named, "differences.md names no scenario"
    assert named <= set(SCENARIOS), sorted(named - set(SCENARIOS))
    assert set(DIFFERENCES) <= named, sorted(set(DIFFERENCES) - named)
