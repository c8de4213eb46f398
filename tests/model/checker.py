"""The search: breadth first over the model's states, with ids renumbered, to the first violation.

What it holds: :func:`canonical` (a state with its ids renumbered in order of
appearance, since ids are only compared), :func:`search` (breadth first from
the initial state; the first violation found has a shortest trace), the
replay that turns a path of canonical states back into the steps taken, and
V: a state no step leaves is terminal, or a live state some actor moves by
itself.
"""

from __future__ import annotations

from collections import deque

from .model import Model
from .world import Msg, Phase, Result, St, show

#: Where a phase holds ids (revs, run ids): index -> "id", "ids" (a tuple) or "phase".
_IDS: dict[str, tuple[tuple[int, str], ...]] = {
    "claimed": ((1, "id"), (2, "phase")),
    "late": ((1, "id"), (2, "phase")),
    "pub": ((3, "phase"), (4, "id")),
    "rollback": ((1, "id"), (2, "phase")),
    "gate": ((1, "ids"),),
    "sendback": ((1, "ids"),),
    "body": ((1, "id"),),
    "after": ((1, "id"),),
    "begin": ((1, "id"),),
    "tx": ((1, "id"),),
    "commit": ((1, "id"),),
    "committed": ((1, "id"),),
    "listed": ((2, "id"),),
    "check": ((1, "key"), (2, "phase"), (3, "phase"), (4, "phase")),
}


def canonical(s: St) -> St:
    """``s`` with its ids renumbered in order of appearance: ids are only compared."""
    ids: dict[int, int] = {0: 0}
    rec = s.rec
    if rec is not None:
        rec = (rec[0], ids.setdefault(rec[1], len(ids)), rec[2], ids.setdefault(rec[3], len(ids)))
    actors = []
    for actor in s.actors:
        p, m = actor
        if p[0] in _IDS or (m is not None and m[1]):
            actors.append((_phase(p, ids), m if m is None or not m[1] else _msg(m, ids)))
        else:
            actors.append(actor)
    queue = s.queue
    if any(m[1] for m in queue):
        queue = tuple(sorted(_msg(m, ids) for m in queue))
    return St(rec, tuple(actors), queue, *s[3:10], len(ids), *s[11:])


def _phase(p: Phase, ids: dict[int, int]) -> Phase:
    where = _IDS.get(p[0])
    if where is None:
        return p
    out = list(p)
    for n, kind in where:
        x = p[n]
        if kind == "id":
            out[n] = None if x is None else ids.setdefault(x, len(ids))
        elif kind == "ids":
            out[n] = tuple(sorted(ids.setdefault(y, len(ids)) for y in x))
        elif kind == "key":
            out[n] = (x[0], ids.setdefault(x[1], len(ids)))
        else:
            out[n] = None if x is None else _phase(x, ids)
    return tuple(out)


def _msg(m: Msg, ids: dict[int, int]) -> Msg:
    return m if not m[1] else (m[0], tuple(sorted(ids.setdefault(y, len(ids)) for y in m[1])), m[2])


def search(model: Model, limit: int = 5_000_000) -> Result:
    """Breadth first from the initial state; stops at the first violation."""
    start = canonical(model.initial())
    parent: dict[St, St | None] = {start: None}
    todo: deque[St] = deque([start])
    stuck: list[str] = []
    acted_on = model.acted_on
    while todo:
        s = todo.popleft()
        moved = False
        for _, raw, bad in model.steps(s):
            moved = True
            nxt = canonical(raw)
            if bad is not None:
                trace, told = _replay(model, _path(parent, s), nxt)
                return Result(len(parent), told, trace, model.edges)
            if nxt not in parent:
                parent[nxt] = s
                todo.append(nxt)
                if len(parent) > limit:
                    raise RuntimeError(f"more than {limit} states: tighten the bounds")
        rec = s.rec
        if not moved and rec is not None and not rec[0].terminal and rec[0] not in acted_on:
            stuck.append(f"V: quiescent in {show(rec)}, which no actor acts on")
    return Result(len(parent), None, [], model.edges, stuck)


def _path(parent: dict[St, St | None], s: St) -> list[St]:
    path: list[St] = []
    cur: St | None = s
    while cur is not None:
        path.append(cur)
        cur = parent[cur]
    return path[::-1]


def _replay(model: Model, path: list[St], last: St) -> tuple[list[str], str]:
    """The path's steps, taken again from the initial state without renumbering,
    so that each id in the trace (and in the violation) names one rev or run
    throughout; and the violation, as the last step tells it."""
    raw, trace, found = model.initial(), [], ""
    for target in [*path[1:], last]:
        final = target is last
        for label, nxt, bad in model.steps(raw):
            if canonical(nxt) == target and (bad is not None) == final:
                trace.append(f"{label} | {show(nxt.rec)}" + (f"  <- {bad}" if bad else ""))
                raw, found = nxt, bad or found
                break
    return trace, found
