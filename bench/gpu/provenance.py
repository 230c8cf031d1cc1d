"""The commit a GPU bench run records: MBUFO_COMMIT when set (the device machine's copy of
the tree may carry a stale .git), else this tree's git HEAD. No imports beyond the standard
library, so every bench script can take it (engine_bench's chain needs gguf, qgemv's not)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def commit_id() -> str:
    if os.environ.get("MBUFO_COMMIT"):
        return os.environ["MBUFO_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
