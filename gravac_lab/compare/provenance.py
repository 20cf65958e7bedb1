"""Where a stored result came from: the command line that produced it and the commit it ran.

A scoreboard's JSON keeps both (:func:`gravac_lab.compare.scoreboard_cli.main`), so that a page
built from it (``gravac compare --report``) prints beside every table the command that made it,
and on which tree.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

__all__ = ["command_line", "source_commit"]

#: seconds ``git`` may take to answer before the commit is reported unknown
_GIT_TIMEOUT = 10.0


def command_line(argv: Sequence[str]) -> str:
    """``gravac`` and its arguments ``argv`` as a shell would take them back."""
    return shlex.join(["gravac", *argv])


def _git(*args: str) -> str | None:
    here = Path(__file__).resolve().parent
    try:
        done = subprocess.run(
            ["git", "-C", str(here), *args],
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_commit() -> str | None:
    """The commit of the git checkout this code runs from, with ``+changes`` where tracked
    files differ from it; ``None`` where it is not a checkout (an installed wheel) or git is
    missing."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return None
    changed = _git("status", "--porcelain", "--untracked-files=no")
    return commit + ("+changes" if changed else "")
