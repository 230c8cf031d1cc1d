"""bench/gpu/provenance.py: the commit a GPU bench run records."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))
import provenance  # noqa: E402


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_commit_is_head_and_says_dirty_when_tracked_files_differ(tmp_path, monkeypatch):
    monkeypatch.delenv("MBUFO_COMMIT", raising=False)
    git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git(tmp_path, "add", "a.py")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    sha = git(tmp_path, "rev-parse", "--short", "HEAD")
    assert provenance.commit_id(tmp_path) == sha
    (tmp_path / "new.py").write_text("")  # untracked: not the tree HEAD names
    assert provenance.commit_id(tmp_path) == sha
    (tmp_path / "a.py").write_text("x = 2\n")
    assert provenance.commit_id(tmp_path) == f"{sha}-dirty"
    monkeypatch.setenv("MBUFO_COMMIT", "abc1234")
    assert provenance.commit_id(tmp_path) == "abc1234"


def test_no_repository_is_unknown(tmp_path, monkeypatch):
    monkeypatch.delenv("MBUFO_COMMIT", raising=False)
    assert provenance.commit_id(tmp_path / "nowhere") == "unknown"
