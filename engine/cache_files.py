"""Files that several processes may fill at once (a server beside a bench, a test run on
two workers): the embedded default model, synthetic models, the q8 tile cache.

- `write_whole(target, write)`: `write` fills a partial file of this writer's own beside
  the target, which is then renamed over it: a reader sees no file or a whole one, and two
  writers of the same bytes each replace it whole.
- `locked(path)`: an exclusive lock on `path`'s ".lock" neighbour, for a read-modify-write
  of one file or a check-then-fill of several.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["locked", "write_whole"]


def write_whole(target: Path, write: Callable[[Path], object]) -> Path:
    """`write(partial)` fills a partial file made beside `target` (readable by all, as a
    file written in place), which then replaces `target`; the partial is removed where
    `write` fails (a full disk), and `target` is left as it was."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=target.name + ".", suffix=".partial", dir=target.parent)
    os.close(fd)
    partial = Path(name)
    try:
        write(partial)
        partial.chmod(0o644)  # mkstemp's 0600 would keep other users from the cache
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on `path`'s ".lock" neighbour (flock: released when the
    holder exits, killed too), so that two processes' writes of the file do not drop each
    other's records; without one (no flock, an unwritable folder) it goes on unlocked."""
    try:
        import fcntl

        fd = os.open(path.with_name(path.name + ".lock"), os.O_CREAT | os.O_RDWR, 0o644)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
