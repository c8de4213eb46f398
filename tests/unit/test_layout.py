"""The package's import graph: no cycle, and the layers below the task never import it.

Read from the source: every ``import`` a module makes, at its top, inside a
function, or for the type checker only (``if TYPE_CHECKING:``: a cycle there
is still two modules that each need the other). So a new import that breaks
the layering fails here, not in a confusing partially-initialised module at
start-up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import celery_exactonce

PACKAGE = Path(celery_exactonce.__file__).parent
#: The modules above the dispatcher: the Celery task, the schedulers (ours and the
#: django-celery-beat one), what runs the reconcile task, the start-up checks,
#: the package's front (``__init__``, ``__main__``, ``control``), the CLI
#: (``celery_exactonce.cli``), the demo, and ``_docgen`` (which reads the CLI to write
#: its reference page). Every other module is below them.
ABOVE = {
    "celery_exactonce",
    "celery_exactonce.__main__",
    "celery_exactonce.task",
    "celery_exactonce.scheduler",
    "celery_exactonce.reconcile_task",
    "celery_exactonce.startup",
    "celery_exactonce.control",
    "celery_exactonce.contrib.django_celery_beat",
    "celery_exactonce._docgen",
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
    assert {"celery_exactonce.dispatch", "celery_exactonce.stores"} <= graph[
        "celery_exactonce.runtime"
    ]  # ``from celery_exactonce import dispatch``, ``from celery_exactonce.stores import …``
    assert "celery_exactonce.task" in graph["celery_exactonce.reconcile_task"]
    assert "celery_exactonce.jobs" in graph["celery_exactonce.stores.redis"]


def test_no_module_imports_itself_through_others() -> None:
    graph = _graph()
    cycles = sorted(name for name in graph if name in _reach(graph, name))
    assert cycles == []


def test_no_module_below_the_task_imports_the_task_or_the_scheduler() -> None:
    graph = _graph()
    above = {"celery_exactonce.task", "celery_exactonce.scheduler"}
    below = [
        name
        for name in graph
        if name not in ABOVE
        and not name.startswith(("celery_exactonce.demo", "celery_exactonce.cli"))
    ]
    reaching = {name: sorted(_reach(graph, name) & above) for name in below}
    assert {name: found for name, found in reaching.items() if found} == {}


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
