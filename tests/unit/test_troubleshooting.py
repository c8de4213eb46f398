"""The troubleshooting page takes every event once, each linked to its row in the events reference.

docs/reference/events.md has a row per event (``| `action` | …``), each with an
anchor of its own (``<a id="action">``). docs/howto/troubleshooting.md has one
row per event, whose first cell links to that anchor. A new event documented
in the reference but not on the page fails here, and so does a link to an
anchor the reference does not have (``mkdocs build --strict`` would warn too,
once the page is in the nav).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EVENTS = ROOT / "docs" / "reference" / "events.md"
PAGE = ROOT / "docs" / "howto" / "troubleshooting.md"

#: A row of the events reference, as the test of the reference reads it.
_EVENT_ROW = re.compile(r"^\| `(\w+)` \|", re.MULTILINE)
#: A row of the page's event tables: the event, linked to its row in the reference.
_PAGE_ROW = re.compile(r"^\| \[`(\w+)`\]\(\.\./reference/events\.md#([^)\s]*)\) \|", re.MULTILINE)
#: A link into the events reference from the page, with its anchor if it has one.
_LINK = re.compile(r"\]\(((?:\.\./reference/)?events\.md)(?:#([^)\s]*))?\)")
_HEADING = re.compile(r"^#{1,6} (.+?)#*$", re.MULTILINE)
_HTML_ID = re.compile(r"<[a-z]+\b[^>]*\b(?:id|name)=\"([^\"]+)\"")


def _slug(heading: str) -> str:
    """The anchor mkdocs' ``toc`` gives a heading (Python-Markdown's default ``slugify``)."""
    text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(text: str) -> set[str]:
    """The anchors a page has: its headings' slugs and the ids of its raw HTML."""
    return {_slug(h) for h in _HEADING.findall(text)} | set(_HTML_ID.findall(text))


def problems(page: str, events: str) -> list[str]:
    """What the page gets wrong against the events reference; empty when nothing."""
    documented = _EVENT_ROW.findall(events)
    rows = _PAGE_ROW.findall(page)
    named = [name for name, _ in rows]
    found = []
    found += [f"not on the page: {n}" for n in documented if n not in named]
    found += [f"not in the reference: {n}" for n in sorted(set(named) - set(documented))]
    found += [f"twice on the page: {n}" for n in sorted({n for n in named if named.count(n) > 1})]
    found += [f"{n} links to #{a}" for n, a in rows if a != n]
    have = anchors(events)
    for _path, anchor in _LINK.findall(page):
        if anchor and anchor not in have:
            found.append(f"no anchor #{anchor} in events.md")
    return found


def test_every_documented_event_is_on_the_page_once_linked_to_its_row() -> None:
    events = EVENTS.read_text(encoding="utf-8")
    page = PAGE.read_text(encoding="utf-8")
    assert len(_EVENT_ROW.findall(events)) > 50
    assert problems(page, events) == []


def test_every_link_into_the_events_reference_finds_its_anchor() -> None:
    events = EVENTS.read_text(encoding="utf-8")
    page = PAGE.read_text(encoding="utf-8")
    have = anchors(events)
    links = _LINK.findall(page)
    assert len(links) >= len(_EVENT_ROW.findall(events))
    assert sorted({a for _, a in links if a and a not in have}) == []
    assert "events-counters-and-log-action-keys" in have  # the heading's slug, as mkdocs makes it


def _without_row(page: str, event: str) -> str:
    return "".join(
        line for line in page.splitlines(keepends=True) if not line.startswith(f"| [`{event}`](")
    )


@pytest.mark.parametrize(
    ("plant", "complaint"),
    [
        (lambda page: _without_row(page, "fail_closed"), "not on the page: fail_closed"),
        (
            lambda page: page.replace("events.md#timed_out)", "events.md#timed-out)"),
            "no anchor #timed-out in events.md",
        ),
        (
            lambda page: page + "\n| [`replayed`](../reference/events.md#replayed) | no | | |\n",
            "twice on the page: replayed",
        ),
        (
            lambda page: page.replace("events.md#completed)", "events.md#requeued)"),
            "completed links to #requeued",
        ),
    ],
    ids=["an event left out", "a broken anchor", "an event twice", "a link to another row"],
)
def test_a_planted_defect_is_found(plant: Callable[[str], str], complaint: str) -> None:
    events = EVENTS.read_text(encoding="utf-8")
    page = PAGE.read_text(encoding="utf-8")
    planted = plant(page)
    assert planted != page
    assert complaint in problems(planted, events)


def test_an_event_documented_without_an_anchor_is_found() -> None:
    events = EVENTS.read_text(encoding="utf-8").replace('<a id="dispatched"></a>', "")
    page = PAGE.read_text(encoding="utf-8")
    assert "no anchor #dispatched in events.md" in problems(page, events)
