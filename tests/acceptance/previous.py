"""The previous version of the package, for the tests that run it beside this one.

:data:`PREVIOUS` names a commit of this repository: its source tree is
extracted (``git archive``) into a cache folder, once per commit, and a
process started with :func:`~tests.acceptance.harness.in_tree` (the harness's
``tree=``) imports that version's ``celery_exactonce`` (and its test apps) on
this interpreter and these dependencies. Move :data:`PREVIOUS` to the last
release's commit when releasing; ``EXACTONCE_PREVIOUS_REF`` overrides it.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from tests.acceptance.harness import REPO_ROOT

#: The version a rolling upgrade starts from: the commit before unique submissions and
#: the health probes (format 1 records, schema version 2).
PREVIOUS = "2ea7e70"


def previous_tree() -> Path:
    """The source tree of the previous version, extracted once per commit."""
    ref = os.environ.get("EXACTONCE_PREVIOUS_REF", PREVIOUS)
    sha = _git("rev-parse", "--verify", f"{ref}^{{commit}}").strip()
    tree = Path(tempfile.gettempdir()) / f"exactonce-previous-{sha[:12]}"
    done = tree / ".extracted"
    if not done.exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "archive", sha],
            capture_output=True,
            check=True,
            timeout=120,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True, timeout=120)
        done.write_text(sha, encoding="utf-8")
    return tree


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    except subprocess.CalledProcessError as exc:
        raise AssertionError(
            f"the previous version ({' '.join(args)}) is not in this clone's history: "
            f"{exc.stderr.strip()} (a shallow clone? fetch the full history)"
        ) from exc
