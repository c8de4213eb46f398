"""The docs site builds with no warning, checks its links, and its references follow the code.

Runs ``mkdocs build --strict`` (the Material theme, every internal link and
anchor validated) into a temporary directory; checks that external links are
well formed without fetching them; and compares the generated regions of the
settings and CLI references with what the code gives now.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import click
import pytest

from celery_exactonce import _docgen, config

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BUILD_TIMEOUT = 120  # seconds; a build takes about five (most of it the Python API page)


def _build(config_file: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict"]
    return subprocess.run(
        [*command, "-f", str(config_file), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        env=env,
        check=False,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as CI builds it (once for the tests of this module that read it)."""
    out = tmp_path_factory.mktemp("built") / "site"
    result = _build(ROOT / "mkdocs.yml", out)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert not re.search(r"^(WARNING|ERROR)\b", output, re.MULTILINE), output
    return out


def test_the_site_builds_strict_with_no_warning(site: Path) -> None:
    for page in ("index.html", "quickstart/index.html", "reference/settings/index.html"):
        assert (site / page).is_file(), page
    guarantees = (site / "discussions" / "guarantees" / "index.html").read_text(encoding="utf-8")
    assert "Residual risks" in guarantees
    assert not (site / "_ext").exists()  # the build's Griffe extension is not a page


def test_the_python_api_reference_is_made_from_the_docstrings(site: Path) -> None:
    page = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    text = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page)))
    for name in (
        "celery_exactonce.ExactOnceTask",
        "celery_exactonce.ExactOnceScheduler",
        "celery_exactonce.cancel",
        "celery_exactonce.idempotency_key",
        "celery_exactonce.entries.save",
        "celery_exactonce.schedules.cron",
        "celery_exactonce.web.create_app",
    ):
        assert f" {name} " in text, name
    # A `#:` comment is its attribute's docstring, and a role is a link to what the page shows.
    assert "Opt in to re-running a RUNNING job" in text
    assert 'href="#celery_exactonce.entries.save"' in page
    assert not re.search(r":(class|func|meth|mod|attr|data|exc):`", text)
    # Only public names: no heading of a private one.
    assert not re.search(r'id="celery_exactonce(\.\w+)*\._', page)


@pytest.mark.parametrize(
    ("link", "complaint"),
    [
        ("[a](glossary.md#no-such-anchor)", "does not contain an anchor '#no-such-anchor'"),
        ("[b](howto/no-such-page.md)", "'howto/no-such-page.md', but the target is not found"),
    ],
    ids=["anchor", "page"],
)
def test_a_broken_link_fails_the_build(tmp_path: Path, link: str, complaint: str) -> None:
    # Given a copy of the site with one broken internal link on the home page
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with (tmp_path / "docs" / "index.md").open("a", encoding="utf-8") as page:
        page.write(f"\n{link}\n")
    # When it is built as CI builds it
    result = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    # Then the build fails, naming the link
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert complaint in output, output


def test_every_page_is_in_the_navigation() -> None:
    listed = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == listed, (sorted(pages - listed), sorted(listed - pages))


_EXTERNAL = re.compile(r"\]\((\w[\w+.-]*:[^)\s]*)\)|<(https?://[^>\s]+)>")


@pytest.mark.parametrize(
    "page",
    sorted([ROOT / "README.md", *DOCS.rglob("*.md")]),
    ids=lambda page: str(page.relative_to(ROOT)),
)
def test_external_links_are_well_formed(page: Path) -> None:
    """Not fetched (CI has no network to spare): a scheme, a host, nothing that cannot be a URL."""
    for groups in _EXTERNAL.findall(page.read_text(encoding="utf-8")):
        url = groups[0] or groups[1]
        parts = urlsplit(url)
        if parts.scheme == "mailto":
            assert re.fullmatch(r"mailto:[^@\s]+@[^@\s]+\.\w+", url), url
            continue
        assert parts.scheme in {"http", "https"}, url
        assert parts.hostname and "." in parts.hostname, url
        assert not re.search(r"[\s<>\"{}|\\^`]", url), url


# -- the generated references ------------------------------------------------------------


def test_the_generated_references_match_the_code() -> None:
    stale = _docgen.stale()
    assert not stale, f"{', '.join(stale)} out of date: run `{_docgen.REGENERATE}`"


def test_a_changed_setting_makes_its_page_stale(tmp_path: Path) -> None:
    # Given a copy of the pages whose settings table has lost one row
    for region in _docgen.REGIONS:
        copy = tmp_path / region.page
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text((ROOT / region.page).read_text(encoding="utf-8"), encoding="utf-8")
    page = tmp_path / "docs" / "reference" / "settings.md"
    text = page.read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| `exactonce_namespace`"))
    page.write_text(text.replace(row + "\n", ""), encoding="utf-8")
    # Then the check names that page, and writing restores it
    assert _docgen.stale(tmp_path) == ["docs/reference/settings.md"]
    assert _docgen.write(tmp_path) == ["docs/reference/settings.md"]
    assert page.read_text(encoding="utf-8") == text
    assert _docgen.stale(tmp_path) == []


def test_the_check_command_exits_1_naming_the_regeneration_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for region in _docgen.REGIONS:
        copy = tmp_path / region.page
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text((ROOT / region.page).read_text(encoding="utf-8"), encoding="utf-8")
    cli_page = tmp_path / "docs" / "reference" / "cli.md"
    cli_page.write_text(
        cli_page.read_text(encoding="utf-8").replace("## migrate", "## migrat"), encoding="utf-8"
    )
    monkeypatch.setattr(_docgen, "root", lambda: tmp_path)
    assert _docgen.main(["--check"]) == 1
    assert f"docs/reference/cli.md is out of date: run `{_docgen.REGENERATE}`" in (
        capsys.readouterr().err
    )
    assert _docgen.main([]) == 0
    assert _docgen.main(["--check"]) == 0


def test_every_setting_has_a_row_with_its_default() -> None:
    text = (DOCS / "reference" / "settings.md").read_text(encoding="utf-8")
    for name, default in (("retention", "`604800`"), ("catchup", '`"latest"`')):
        row = next(line for line in text.splitlines() if line.startswith(f"| `exactonce_{name}`"))
        assert f"| {default} |" in row, row
    rows = re.findall(r"^\| `exactonce_(\w+)` \|", text, re.MULTILINE)
    assert rows == [f.name for f in config.dataclasses.fields(config.ExactOnceConfig)]


def test_every_cli_command_and_option_is_in_the_reference() -> None:
    from celery_exactonce.cli import exactonce

    text = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (\w+)$", text, re.MULTILINE)
    assert headings == list(exactonce.commands)
    for name, command in exactonce.commands.items():
        section = text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        for param in command.params:
            if isinstance(param, click.Option):
                assert f"| `{param.opts[0]}`" in section, (name, param.opts[0])


# -- the failure model cites real events --------------------------------------------------


def test_the_failure_model_counts_only_events_that_exist() -> None:
    events = (DOCS / "reference" / "events.md").read_text(encoding="utf-8")
    known = set(re.findall(r"^\| `(\w+)` \|", events, re.MULTILINE))
    page = (DOCS / "discussions" / "guarantees.md").read_text(encoding="utf-8")
    cited: set[str] = set()
    for line in page.splitlines():
        if line.startswith("| ") and not line.startswith(("| failure", "|---")):
            counted = line.rstrip(" |").rsplit(" | ", 1)[-1]
            cited |= set(re.findall(r"`([a-z][a-z_]+)`", counted))
    assert len(cited) > 30, sorted(cited)
    assert cited <= known, sorted(cited - known)
