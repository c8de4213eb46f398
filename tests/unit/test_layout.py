"""The package's layout: its folders, its import graph, and the layers the imports keep to.

The folders show the architecture (docs/design/architecture.md): at most
about 20 entries at the top, about 15 modules a folder, no module name
repeating its folder's. The import graph has no cycle, and each import keeps
to the layers: each rule of :data:`RULES` is one arrow of the architecture
page, named in the failure of an import that breaks it. The graph is read
from the source: every ``import`` a module makes, at its top, inside a
function, or for the type checker only (``if TYPE_CHECKING:``: a cycle there
is still two modules that each need the other). So a new import that breaks
the layering fails here, not in a confusing partially-initialised module at
start-up.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import celery_exactonce

PACKAGE = Path(celery_exactonce.__file__).parent
#: The modules above the dispatcher: the Celery task, the schedulers (ours and the
#: django-celery-beat one), what runs the reconcile task, the start-up checks,
#: the package's front (``__init__``, ``__main__``, ``reconcile.cancel``, ``entries``,
#: and ``beat.checks``, with which it checks an entry as beat does), the CLI
#: (``celery_exactonce.cli``), the dashboard (``celery_exactonce.web``, which reads
#: through the CLI), the demo, and ``_docgen`` (which reads the CLI to write its
#: reference page). Every other module is below them.
ABOVE = {
    "celery_exactonce",
    "celery_exactonce.__main__",
    "celery_exactonce.task.base",
    "celery_exactonce.beat.scheduler",
    "celery_exactonce.reconcile.task",
    "celery_exactonce.startup",
    "celery_exactonce.reconcile.cancel",
    "celery_exactonce.contrib.django_celery_beat",
    "celery_exactonce._docgen",
    "celery_exactonce.entries",
    "celery_exactonce.beat.checks",
}


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports when it runs."""
    name = _name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
    return {module for module in found if module in modules and module != name}


def _graph() -> dict[str, set[str]]:
    paths = {_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: _imports(path, set(paths)) for name, path in paths.items()}


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for module in graph[todo.pop()] - seen:
            seen.add(module)
            todo.append(module)
    return seen


def test_the_graph_holds_the_imports_the_modules_make() -> None:
    graph = _graph()
    assert {"celery_exactonce.dispatch.dispatcher", "celery_exactonce.stores"} <= graph[
        "celery_exactonce.runtime"
    ]  # ``from celery_exactonce import dispatch``, ``from celery_exactonce.stores import …``
    assert "celery_exactonce.task.base" in graph["celery_exactonce.reconcile.task"]
    assert "celery_exactonce.core.jobs" in graph["celery_exactonce.stores.redis.store"]


def test_no_module_imports_itself_through_others() -> None:
    graph = _graph()
    cycles = sorted(name for name in graph if name in _reach(graph, name))
    assert cycles == []


def test_no_module_below_the_task_imports_the_task_or_the_scheduler() -> None:
    graph = _graph()
    above = {"celery_exactonce.task.base", "celery_exactonce.beat.scheduler"}
    below = [
        name
        for name in graph
        if name not in ABOVE
        and not name.startswith(
            ("celery_exactonce.demo", "celery_exactonce.cli", "celery_exactonce.web")
        )
    ]
    reaching = {name: sorted(_reach(graph, name) & above) for name in below}
    assert {name: found for name, found in reaching.items() if found} == {}


#: "About 20" entries at the top (modules and packages), "about 15" modules a folder.
MAX_TOP, MAX_FOLDER = 21, 15


def test_the_folders_show_the_layers() -> None:
    top = [p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()]
    assert len(top) <= MAX_TOP, sorted(top)
    crowded, prefixed = {}, []
    for folder in [PACKAGE, *(p.parent for p in PACKAGE.rglob("__init__.py"))]:
        if folder.name == "migrations":
            continue  # Django writes these
        modules = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
        if len(modules) > MAX_FOLDER:
            crowded[_name(folder / "__init__.py")] = len(modules)
        prefixed += [f"{folder.name}/{m}.py" for m in modules if m.startswith(f"{folder.name}_")]
    assert crowded == {}
    assert prefixed == []


#: "About 400 lines": a module that grows past this has taken in a second concept;
#: split it (docs/design/architecture.md says where each concept lives).
MAX_LINES = 420


def test_every_module_is_about_400_lines_or_fewer_and_says_what_it_holds() -> None:
    long, bare = {}, []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "migrations" in path.parts:
            continue  # Django writes these
        source = path.read_text(encoding="utf-8")
        lines = source.count("\n")
        if lines > MAX_LINES:
            long[_name(path)] = lines
        if path.stat().st_size and ast.get_docstring(ast.parse(source)) is None:
            bare.append(_name(path))
    assert long == {}, f"modules over {MAX_LINES} lines"
    assert bare == [], "modules without a docstring saying what lives there"


# -- the layers ----------------------------------------------------------------------------
# docs/design/architecture.md draws them; each rule below is one of its arrows. A module
# names its package by its path relative to the package ("core.states", "beat.scheduler";
# the package's front is "__init__").

#: Below the paths' users: what every one of them may import.
LOWER = ("core", "schedules", "stores", "dispatch", "observe", "config", "runtime", "policy")
#: The top: the package's front, the CLI, the dashboard, the stored entries' functions, the
#: integrations, the demo, the pytest plugin, and the docs generator. They may import any
#: module below; only the rules about who may import them apply to them.
TOP = ("__init__", "__main__", "_docgen", "cli", "web", "entries", "contrib", "demo", "testing")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One arrow of the architecture page: what the modules under ``governs`` may import."""

    name: str
    governs: tuple[str, ...]
    may_import: tuple[str, ...] = ()  # with ``never`` empty: nothing else
    never: tuple[str, ...] = ()  # or: the packages they may not import (but their own)
    spare: tuple[str, ...] = ()  # modules under ``governs`` the rule leaves out


RULES = (
    Rule("core is pure: it imports only core", ("core",), ("core", "schedules")),
    Rule("the public schedules are core: they import only core", ("schedules",), ("core",)),
    Rule("metrics is a leaf: every layer reports through it", ("observe.metrics",), ()),
    Rule("traces is a leaf: every layer's spans go through it", ("observe.traces",), ()),
    Rule("stores stand on core alone", ("stores",), ("stores", "core", "observe.metrics")),
    Rule(
        "one store backend does not import another",
        ("stores.redis", "stores.sql", "stores.memory"),
        never=("stores.redis", "stores.sql", "stores.memory"),
    ),
    Rule(
        "dispatch stands on stores and core",
        ("dispatch",),
        ("dispatch", "stores", "core", "observe.metrics", "observe.traces"),
    ),
    Rule(
        "plumbing stands below the task, beat and the reconciler",
        ("config", "runtime", "policy", "observe"),
        LOWER,
    ),
    Rule("the task's parts stand on plumbing", ("task",), (*LOWER, "task")),
    Rule("the reconciler's parts stand on plumbing", ("reconcile",), (*LOWER, "reconcile")),
    Rule("beat's parts stand on plumbing", ("beat",), (*LOWER, "beat")),
    Rule(
        "the start-up checks stand on the task and the reconciler",
        ("startup",),
        (*LOWER, "task", "reconcile"),
    ),
    Rule("nothing but the package's front imports it", ("",), never=("__init__",), spare=("demo",)),
    Rule("nothing but __main__ imports the demo", ("",), never=("demo",), spare=("__main__",)),
    Rule(
        "only the docs generator and the dashboard import the CLI",
        ("",),
        never=("cli",),
        spare=("_docgen", "web"),
    ),
    Rule("only the CLI imports the dashboard", ("",), never=("web",), spare=("cli",)),
    Rule("only the CLI imports the integrations", ("",), never=("contrib",), spare=("cli",)),
    Rule("the library never imports the pytest plugin", ("",), never=("testing",)),
)

#: The arrows between beat, the task and the reconciler the architecture page draws, each
#: with why; any other import between them breaks their rules.
DRAWN = {
    ("reconcile.task", "task.base"): "the reconcile task is an ExactOnceTask",
    ("beat.scheduler", "task.base"): "beat tells a gated task by its class",
    ("beat.scheduler", "reconcile.task"): "beat runs the reconcile passes",
    ("beat.scheduler", "startup"): "beat runs the start-up checks",
}


def _relative(name: str) -> str:
    return name.removeprefix("celery_exactonce").removeprefix(".") or "__init__"


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(p in ("", name) or name.startswith(f"{p}.") for p in prefixes)


def _broken(graph: dict[str, set[str]]) -> list[str]:
    """Each import that breaks a rule, as ``rule: importer imports imported``."""
    found = []
    for importer, imported in sorted((i, m) for i, ms in graph.items() for m in ms):
        a, b = _relative(importer), _relative(imported)
        for rule in RULES:
            if not _under(a, rule.governs) or _under(a, rule.spare) or (a, b) in DRAWN:
                continue
            if rule.never:  # a package may import itself
                refused = any(_under(b, (p,)) and not _under(a, (p,)) for p in rule.never)
            else:
                refused = not _under(b, rule.may_import)
            if refused:
                found.append(f"{rule.name}: {a} imports {b}")
    return found


def test_every_import_keeps_to_the_layers() -> None:
    assert _broken(_graph()) == []


def test_every_module_is_in_a_layer() -> None:
    """A new module lands in a package whose rules govern it, or on top."""
    layered = [p for rule in RULES if rule.governs != ("",) for p in rule.governs]
    homeless = [name for name in map(_relative, _graph()) if not _under(name, (*layered, *TOP))]
    assert homeless == []


def test_every_arrow_drawn_between_beat_the_task_and_the_reconciler_is_an_import() -> None:
    graph = {_relative(name): set(map(_relative, found)) for name, found in _graph().items()}
    assert [edge for edge in DRAWN if edge[1] not in graph[edge[0]]] == []


@pytest.mark.parametrize(
    ("importer", "imported", "rule"),
    [
        ("core.states", "beat.scheduler", "core is pure: it imports only core"),
        ("core.jobs", "stores.base", "core is pure: it imports only core"),
        ("observe.metrics", "core.jobs", "metrics is a leaf: every layer reports through it"),
        ("stores.base", "dispatch.messages", "stores stand on core alone"),
        ("stores.redis.store", "runtime", "stores stand on core alone"),
        ("stores.sql.store", "stores.redis.keys", "one store backend does not import another"),
        ("dispatch.dispatcher", "runtime", "dispatch stands on stores and core"),
        ("runtime", "task.gate", "plumbing stands below the task, beat and the reconciler"),
        ("task.gate", "beat.scheduler", "the task's parts stand on plumbing"),
        ("task.base", "reconcile.reconciler", "the task's parts stand on plumbing"),
        ("reconcile.reconciler", "task.gate", "the reconciler's parts stand on plumbing"),
        ("beat.claimer", "reconcile.reconciler", "beat's parts stand on plumbing"),
        ("startup", "beat.scheduler", "the start-up checks stand on the task and the reconciler"),
        ("beat.scheduler", "demo.app", "nothing but __main__ imports the demo"),
        ("startup", "cli.check", "only the docs generator and the dashboard import the CLI"),
        ("runtime", "web.pages", "plumbing stands below the task, beat and the reconciler"),
        ("demo.run", "web.app", "only the CLI imports the dashboard"),
        ("web.pages", "demo.app", "nothing but __main__ imports the demo"),
        ("beat.scheduler", "contrib.periodic_tasks", "only the CLI imports the integrations"),
        ("task.eager", "testing.plugin", "the library never imports the pytest plugin"),
        ("task.base", "celery_exactonce", "nothing but the package's front imports it"),
    ],
)
def test_a_planted_upward_import_fails_naming_its_rule(
    importer: str, imported: str, rule: str
) -> None:
    graph = _graph()
    planted = f"celery_exactonce.{importer}"
    graph[planted] = graph[planted] | {
        imported if imported == "celery_exactonce" else f"celery_exactonce.{imported}"
    }
    assert f"{rule}: {importer} imports {_relative(imported)}" in _broken(graph)
