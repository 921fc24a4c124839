"""Where a benchmark number came from: every JSON in perf/results/ starts with these fields.

    record = {**runinfo.provenance(), ...}     # date, host, command, git_revision

``git_revision`` is the checkout's HEAD, with ``-dirty`` when tracked files differ from it
(the numbers then belong to uncommitted code). tests/test_benchmarks_doc.py checks that every
table of perf/BENCHMARKS.md names a results file carrying these fields.
"""
from __future__ import annotations

import datetime
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("date", "host", "command", "git_revision")


def git_revision(root: Path = ROOT) -> str:
    """HEAD of the checkout at ``root`` (``-dirty`` when tracked files changed), or a note why not."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return head + ("-dirty" if dirty else "")


def provenance(argv: list[str] | None = None) -> dict:
    """date (UTC, ISO), host, the command line that ran, and the git revision."""
    argv = sys.argv if argv is None else argv
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(),
            "command": shlex.join(["python", *argv]),
            "git_revision": git_revision()}
