"""The reference pages that are generated from the code, so they cannot drift from it.

Two regions of the docs are written by this module, between marker comments:

* ``docs/reference/settings.md``: the table of settings, from the fields of
  :class:`~celery_exactonce.config.ExactOnceConfig` (name, type, default, and the
  docstring under each field);
* ``docs/reference/cli.md``: every ``celery exactonce`` subcommand, from the
  click commands of :mod:`celery_exactonce.cli` (usage, help, arguments and
  options).

``python -m celery_exactonce._docgen`` rewrites both regions in place;
``--check`` only compares, and exits 1 naming each page that differs (the docs
tests run the same comparison). Everything outside the markers is prose
written by hand, left as it is.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path

import click

from celery_exactonce import cli, config

#: The command that rewrites the generated regions (named in every drift report).
REGENERATE = "python -m celery_exactonce._docgen"

_BEGIN = "<!-- BEGIN GENERATED: {name}. Do not edit: run `" + REGENERATE + "`. -->"
_END = "<!-- END GENERATED: {name} -->"


@dataclasses.dataclass(frozen=True)
class Region:
    """One generated region: the page (relative to the repository) and its text."""

    name: str
    page: str
    render: Callable[[], str]


# -- settings ---------------------------------------------------------------------------


def field_docs() -> dict[str, str]:
    """Each ``ExactOnceConfig`` field's docstring (the string literal under it), cleaned."""
    tree = ast.parse(inspect.getsource(config))
    cls = next(
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == config.ExactOnceConfig.__name__
    )
    docs: dict[str, str] = {}
    for node, following in zip(cls.body, [*cls.body[1:], None], strict=True):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            text = inspect.cleandoc(following.value.value)
            docs[node.target.id] = markdown(" ".join(text.split()))
    return docs


def type_text(annotation: object) -> str:
    """A field's type for people: ``seconds`` for a float (durations are in seconds)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return ", ".join(f'`"{value}"`' for value in typing.get_args(annotation))
    if origin is not None:  # a Union (X | None) or a tuple
        args = typing.get_args(annotation)
        if origin is tuple:
            return f"list of {type_text(args[0])}"
        parts = [type_text(arg) for arg in args if arg is not type(None)]
        text = " or ".join(parts)
        return f"{text} or `None`" if type(None) in args else text
    if annotation is float:
        return "seconds"
    if isinstance(annotation, type):
        return f"`{annotation.__name__}`"
    return f"`{annotation}`"


def default_text(field: dataclasses.Field[object]) -> str:
    """A field's default: integral seconds without ``.0``, strings in double quotes."""
    if field.default is dataclasses.MISSING:
        return "**required**"
    value = field.default
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def markdown(text: str) -> str:
    """A docstring's reStructuredText literals (````x````) as Markdown's (```x```)."""
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def settings_table() -> str:
    """The table of every setting: name, type, default, what it does (its docstring)."""
    docs = field_docs()
    hints = typing.get_type_hints(config.ExactOnceConfig)
    rows = [
        "| setting | type | default | what it does |",
        "|---|---|---|---|",
    ]
    for field in dataclasses.fields(config.ExactOnceConfig):
        doc = docs.get(field.name)
        if not doc:
            raise ValueError(f"ExactOnceConfig.{field.name} has no docstring to document it with")
        rows.append(
            f"| `{config.PREFIX}{field.name}` | {_cell(type_text(hints[field.name]))} "
            f"| {_cell(default_text(field))} | {_cell(doc)} |"
        )
    return "\n".join(rows)


# -- the CLI ----------------------------------------------------------------------------


def _help_text(text: str | None) -> str:
    lines = [line for line in inspect.cleandoc(text or "").splitlines() if line.strip() != "\b"]
    return markdown("\n".join(lines).strip())


def _value_text(option: click.Option, ctx: click.Context) -> str:
    """What an option takes: ``flag``, its choices, its metavar, or an integer range."""
    if option.is_flag:
        return "flag"
    if option.metavar:
        return f"`{option.metavar}`"
    kind = option.type
    if isinstance(kind, click.Choice):
        return " \\| ".join(f"`{choice}`" for choice in kind.choices)
    if isinstance(kind, click.IntRange) and kind.min is not None and kind.max is not None:
        return f"integer, {kind.min} to {kind.max}"
    return f"`{option.make_metavar(ctx)}`"


def _option_row(option: click.Option, ctx: click.Context) -> str:
    names = ", ".join(f"`{name}`" for name in [*option.opts, *option.secondary_opts])
    notes = []
    if option.multiple:
        notes.append("repeatable")
    if option.show_default and option.default is not None and not option.is_flag:
        notes.append(f"default `{option.default}`")
    if option.required:
        notes.append("required")
    text = _help_text(option.help)
    if notes:
        text += f" ({', '.join(notes)})"
    return f"| {names} | {_value_text(option, ctx)} | {_cell(text)} |"


def cli_reference(group: click.Group | None = None) -> str:
    """Every subcommand of ``celery exactonce`` (and theirs): usage, help, arguments, options."""
    group = cli.exactonce if group is None else group
    root = click.Context(group, info_name="celery -A APP exactonce")
    return "\n".join(_command_reference(group, root, [])).rstrip()


def _command_reference(group: click.Group, parent: click.Context, path: list[str]) -> list[str]:
    out: list[str] = []
    for name, command in group.commands.items():
        ctx = click.Context(command, info_name=name, parent=parent)
        usage = " ".join(command.collect_usage_pieces(ctx))
        full = " ".join([*path, name])
        out += [f"## {full}", "", "```text", f"celery -A APP exactonce {full} {usage}", "```", ""]
        out += [_help_text(command.help), ""]
        arguments = [p for p in command.params if isinstance(p, click.Argument)]
        if arguments:
            listed = ", ".join(
                f"`{p.make_metavar(ctx)}`" + ("" if p.required else " (optional)")
                for p in arguments
            )
            out += [f"Arguments: {listed}.", ""]
        out += ["| option | value | meaning |", "|---|---|---|"]
        out += [_option_row(p, ctx) for p in command.params if isinstance(p, click.Option)]
        out.append("| `--help` | flag | Show the command's help and exit. |")
        out.append("")
        if isinstance(command, click.Group):
            out += _command_reference(command, ctx, [*path, name])
    return out


# -- the regions ------------------------------------------------------------------------

REGIONS = (
    Region("settings", "docs/reference/settings.md", settings_table),
    Region("cli", "docs/reference/cli.md", cli_reference),
)


def root() -> Path:
    """The repository this module belongs to (a checkout: the docs sit beside the package)."""
    return Path(__file__).resolve().parents[1]


def splice(text: str, region: Region) -> str:
    """``text`` with the region between its markers replaced by freshly generated text.

    Raises ``ValueError`` when the page lacks either marker.
    """
    begin, end = _BEGIN.format(name=region.name), _END.format(name=region.name)
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"{region.page} lacks the markers {begin!r} ... {end!r}")
    return text[: start + len(begin)] + "\n\n" + region.render() + "\n\n" + text[stop:]


def stale(base: Path | None = None) -> list[str]:
    """The pages whose generated region differs from what the code gives now."""
    base = root() if base is None else base
    pages = []
    for region in REGIONS:
        text = (base / region.page).read_text(encoding="utf-8")
        if splice(text, region) != text:
            pages.append(region.page)
    return pages


def write(base: Path | None = None) -> list[str]:
    """Rewrite every generated region; return the pages that changed."""
    base = root() if base is None else base
    changed = []
    for region in REGIONS:
        path = base / region.page
        text = path.read_text(encoding="utf-8")
        new = splice(text, region)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(region.page)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    """``--check``: exit 1 if a page is out of date; otherwise rewrite the pages."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--check"]:
        pages = stale()
        for page in pages:
            print(f"{page} is out of date: run `{REGENERATE}`", file=sys.stderr)
        return 1 if pages else 0
    if args:
        print(f"usage: {REGENERATE} [--check]", file=sys.stderr)
        return 2
    for page in write():
        print(f"rewrote {page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
