"""Where a committed result came from: the block each results JSON carries and experiments/make_docs.py prints
under its table."""

from __future__ import annotations

import datetime
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def record(note: str | None = None) -> dict[str, str]:
    """{'command', 'commit', 'machine', 'date'} of this process: the script and arguments it was started with, the
    checkout's commit (marked when tracked files differ from it), the CPU count, today's UTC date; and `note`."""
    script = pathlib.Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    # Results and documents being rewritten by this very run do not make the code it ran differ from the commit.
    if _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!experiments/results", ":!*.md"):
        commit += " with uncommitted changes"
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    block = {"command": " ".join(["python", str(shown), *sys.argv[1:]]), "commit": commit,
             "machine": f"{os.cpu_count()} CPU cores", "date": today}
    if note:
        block["note"] = note
    return block
