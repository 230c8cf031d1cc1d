"""The commit a GPU bench run records: MBUFO_COMMIT when set (the device machine's copy of
the tree may carry a stale .git), else this tree's git HEAD, with "-dirty" when tracked
files differ from it (a figure from uncommitted code, or from a stale .git's copy, says
so). No imports beyond the standard library, so every bench script can take it
(engine_bench's chain needs gguf, qgemv's not)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def commit_id(root: Path | None = None) -> str:
    if os.environ.get("MBUFO_COMMIT"):
        return os.environ["MBUFO_COMMIT"]
    root = root or Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True, check=True).stdout.strip()

    try:
        sha = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{sha}-dirty" if changed else sha
