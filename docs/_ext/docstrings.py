"""The code's docstrings, read for the Python API page (docs/reference/api.md).

A Griffe extension that mkdocstrings loads (``mkdocs.yml``; this folder is
left out of the built site). The docstrings are written for reading in the
code, in reStructuredText's manner, and the site is Markdown, so for the
``celery_exactonce`` package only:

* the ``#:`` comment lines just above an attribute are its docstring, as
  Sphinx reads them (``ExactOnceTask.exactonce_rerun``, say);
* a role (``:class:`~celery_exactonce.schedules.cron```, ``:func:`save```,
  ``:meth:``, ``:mod:``, ``:attr:``, ``:data:``, ``:exc:``) is a cross-reference:
  a link where the site documents its target, code where it does not (an
  internal module), never a warning. A name is resolved where the docstring
  is, as Sphinx would; ``~`` keeps its last part, ``:func:`` and ``:meth:`` add
  ``()``;
* a paragraph that ends with ``::`` (what introduces a literal block in
  reStructuredText) ends with ``:``; the indented block after it is already
  Markdown's code block.

Only the docstrings' text changes, and only on the site.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

PACKAGE = "celery_exactonce"

_ROLE = re.compile(
    r":(?:py:)?(?P<role>class|func|meth|mod|attr|data|exc|obj):"
    r"`(?P<tilde>~)?(?P<text>[^`<]+?)(?:\s*<(?P<target>[^>`]+)>)?`"
)
_LITERAL_MARKER = re.compile(r"(?<=\S)::$", re.MULTILINE)  # "text::": "text:"
_LONE_MARKER = re.compile(r"[ \t]+::$|^[ \t]*::\n", re.MULTILINE)  # "text ::": "text"


class RstDocstrings(griffe.Extension):
    """Sphinx's ``#:`` attribute comments, roles and ``::`` as the Markdown site needs them."""

    def on_attribute_instance(
        self,
        *,
        node: Any,
        attr: griffe.Attribute,
        agent: griffe.Visitor | griffe.Inspector,
        **kwargs: Any,
    ) -> None:
        if attr.docstring is not None or attr.lineno is None or attr.package.name != PACKAGE:
            return
        filepath = attr.filepath
        if isinstance(filepath, list):  # a namespace package: no attribute lives there
            return
        lines = attr.lines_collection[filepath]
        index = attr.lineno - 2  # the line above, 0-based
        comments: list[str] = []
        while index >= 0 and lines[index].lstrip().startswith("#:"):
            comments.append(lines[index].lstrip()[2:].removeprefix(" ").rstrip())
            index -= 1
        if comments:
            attr.docstring = griffe.Docstring(
                "\n".join(reversed(comments)),
                lineno=index + 2,
                endlineno=attr.lineno - 1,
                parent=attr,
                parser=agent.docstring_parser,
                parser_options=agent.docstring_options,
            )

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name == PACKAGE:
            _convert(pkg)


def _convert(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        obj.docstring.value = markdown(obj.docstring.value, obj)
    for member in obj.members.values():
        if isinstance(member, griffe.Object):  # not an alias: converted where it lives
            _convert(member)


def markdown(text: str, scope: griffe.Object) -> str:
    """``text`` with its roles as cross-references and its ``::`` markers as ``:``."""

    def role(match: re.Match[str]) -> str:
        text = match["text"].strip()
        target = (match["target"] or text).strip().lstrip("~")
        if match["target"]:
            title = text
        elif match["tilde"]:
            title = target.rsplit(".", 1)[-1]
        else:
            title = target
        if match["role"] in {"func", "meth"}:
            title += "()"
        title = f"<code>{html.escape(title)}</code>"
        identifier = _resolve(target, scope)
        if identifier is None:
            return title
        return f'<autoref identifier="{html.escape(identifier)}" optional>{title}</autoref>'

    text = _ROLE.sub(role, text)
    return _LITERAL_MARKER.sub(":", _LONE_MARKER.sub("", text))


def _resolve(target: str, scope: griffe.Object) -> str | None:
    """The full path of ``target`` as seen from ``scope``: itself when it is one already."""
    if target == PACKAGE or target.startswith(f"{PACKAGE}."):
        return target
    first, dot, rest = target.partition(".")
    try:
        found = scope.resolve(first)
    except griffe.NameResolutionError:
        return None if "." not in target else target  # a module of another package
    return found + dot + rest
