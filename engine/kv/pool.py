"""Reference-counted KV pages per layer group, and each sequence's page tables.

Ids are indices into a group's storage: for `full` and `sliding` groups a page holds
`page_size` consecutive positions (slot = page * page_size + offset, engine/kv/cache.py);
for the `recurrent` group an id is a state slot (one per sequence plus snapshots), with
no positions. A page's reference count is the number of holders (sequences and prefix
cache entries); it is free exactly when the count is 0. A page shared by two holders is
never written: sequences only append, and shared pages are always full (prefix matches
are whole pages, `SeqPages.fork` copies a partial last page).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from engine.errors import OutOfKVPages

FULL, SLIDING, RECURRENT = "full", "sliding", "recurrent"
_NO_PAGES = np.empty(0, dtype=np.int64)


class PagePool:
    """Page ids 0..num_pages-1 of one group with reference counts.

    Negative ids (-1: a released sliding page, a missing snapshot) are ignored by
    `incref` and `decref`, so a page table can be passed as it is.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives low ids first

    @property
    def num_pages(self) -> int:
        return len(self._refs)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """`n` free pages, each with count 1; all or nothing (raises OutOfKVPages)."""
        if n > len(self._free):
            raise OutOfKVPages(f"need {n} pages, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        """One more holder for each page; a page must be allocated to be shared."""
        for p in pages:
            if p >= 0:
                if self._refs[p] == 0:
                    raise ValueError(f"incref of free page {p}")
                self._refs[p] += 1

    def decref(self, pages: list[int]) -> list[int]:
        """One holder fewer for each page; returns the pages that became free."""
        freed = []
        for p in pages:
            if p >= 0:
                if self._refs[p] == 0:
                    raise ValueError(f"decref of free page {p} (double free)")
                self._refs[p] -= 1
                if self._refs[p] == 0:
                    self._free.append(p)
                    freed.append(p)
        return freed

    def refcount(self, page: int) -> int:
        return self._refs[page]


class KVPool:
    """Every layer group's PagePool. A group listed in `windows` is sliding (it keeps the
    last `window` positions: a query at position p attends to keys in (p - window, p]);
    the group named "recurrent" holds state slots; every other group is full."""

    def __init__(self, num_pages: dict[str, int], page_size: int,
                 windows: dict[str, int] | None = None) -> None:
        windows = dict(windows or {})
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        for group, window in windows.items():
            if group not in num_pages or group == RECURRENT or window < 1:
                raise ValueError(f"bad window {window} for group {group!r}")
        self.page_size = page_size
        self.windows = windows
        self.groups: dict[str, PagePool] = {g: PagePool(n) for g, n in num_pages.items()}

    def kind(self, group: str) -> str:
        if group == RECURRENT:
            return RECURRENT
        return SLIDING if group in self.windows else FULL

    def pages_for(self, num_tokens: int) -> int:
        """Pages that cover positions [0, num_tokens)."""
        return -(-num_tokens // self.page_size)

    def first_needed_page(self, group: str, num_tokens: int) -> int:
        """Pages below this index hold no key that a query at position >= num_tokens sees."""
        if self.kind(group) != SLIDING:
            return 0
        return max(0, num_tokens - self.windows[group] + 1) // self.page_size


class PageCopy(NamedTuple):
    """Copy storage page (or state slot) `src` to `dst` of `group` before the next forward."""

    group: str
    src: int
    dst: int


class SeqPages:
    """One sequence's page ids per group: `table(group)[i]` holds positions
    [i * page_size, (i + 1) * page_size), -1 once released from a sliding window. The
    recurrent group's table is [live state slot]; snapshots are kept apart.

    A fresh state slot holds garbage: the runner zeroes it at position 0 or copies a
    matched snapshot into it.
    """

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.num_tokens = 0  # positions [0, num_tokens) are covered
        self._pages: dict[str, list[int]] = {g: [] for g in pool.groups}
        # table_array's copy of _pages (capacity grown by doubling) and its entries in step
        self._arrays: dict[str, np.ndarray] = {g: _NO_PAGES for g in pool.groups}
        self._mirrored: dict[str, int] = dict.fromkeys(pool.groups, 0)
        self._released: dict[str, int] = dict.fromkeys(pool.groups, 0)  # sliding: -1 below
        self._snapshots: dict[int, int] = {}  # recurrent: boundary (tokens) -> state slot

    def table(self, group: str) -> list[int]:
        return list(self._pages[group])

    def table_array(self, group: str) -> np.ndarray:
        """table(group) as an int64 array: a view, valid until the table next changes. It
        is kept in step as the table grows (only the new entries are copied), so a step's
        page tables need no copy of a list of every page (16 rows of 262144 keys: 16384
        pages each, ~13 ms a step as lists on the dev CPU, bench/RESULTS.md)."""
        pages, done = self._pages[group], self._mirrored[group]
        if done < len(pages):
            buf = self._arrays[group]
            if len(pages) > len(buf):
                grown = np.empty(max(len(pages), 2 * len(buf), 64), dtype=np.int64)
                grown[:done] = buf[:done]
                buf = self._arrays[group] = grown
            buf[done:len(pages)] = pages[done:]
            self._mirrored[group] = len(pages)
        return self._arrays[group][:len(pages)]

    def pages_needed(self, num_tokens: int) -> dict[str, int]:
        """New pages per group that `ensure(num_tokens)` would allocate."""
        need = {}
        for g, pages in self._pages.items():
            if self.pool.kind(g) == RECURRENT:
                need[g] = 0 if pages else 1
            else:
                need[g] = max(0, self.pool.pages_for(num_tokens) - len(pages))
        return need

    def ensure(self, num_tokens: int) -> None:
        """Allocate pages to cover positions [0, num_tokens) in every group (and the live
        state slot); all or nothing across groups (raises OutOfKVPages)."""
        need = self.pages_needed(num_tokens)
        self._check_free(need)
        for g, n in need.items():
            self._pages[g].extend(self.pool.groups[g].allocate(n))
        self.num_tokens = max(self.num_tokens, num_tokens)

    def attach(self, pages: dict[str, list[int]], num_tokens: int) -> None:
        """Share a matched prefix (RadixCache.match) of whole pages; empty sequences only.

        Paged groups take a reference on every page (-1 entries stay -1: they lie outside
        the window of every position still to be computed). The recurrent snapshot is not
        taken: copy it into the live slot from `ensure` while the match is locked.
        """
        if self.num_tokens or any(self._pages.values()):
            raise ValueError("attach needs an empty sequence")
        if num_tokens % self.pool.page_size:
            raise ValueError(f"prefix of {num_tokens} tokens is not whole pages")
        for g in self._pages:
            if self.pool.kind(g) != RECURRENT:
                shared = list(pages[g])
                if len(shared) != num_tokens // self.pool.page_size:
                    raise ValueError(f"group {g}: {len(shared)} pages for {num_tokens} tokens")
                self.pool.groups[g].incref(shared)
                self._pages[g] = shared
        self.num_tokens = num_tokens

    def release_out_of_window(self, num_tokens: int) -> int:
        """Drop sliding pages that no query at position >= num_tokens can see. Pass the
        committed length (never one that speculative verification may roll back). The
        window before the last page boundary is kept too (at most one page more), so the
        whole-page prefix stays cacheable (RadixCache.insert); the cache keeps its own
        references. Returns the number of pages dropped."""
        if num_tokens > self.num_tokens:
            raise ValueError(f"{num_tokens} > covered length {self.num_tokens}")
        boundary = num_tokens - num_tokens % self.pool.page_size
        dropped = 0
        for g, pages in self._pages.items():
            end = min(self.pool.first_needed_page(g, boundary), len(pages))
            for i in range(self._released[g], end):
                if pages[i] >= 0:
                    self.pool.groups[g].decref([pages[i]])
                    pages[i] = -1
                    if i < self._mirrored[g]:
                        self._arrays[g][i] = -1
                    dropped += 1
            self._released[g] = max(self._released[g], end)
        return dropped

    def fork(self) -> tuple[SeqPages, list[PageCopy]]:
        """A second sequence with the same content: whole pages are shared; a partial last
        page and the live state get fresh ids and must be copied (the returned list) before
        either sequence runs again. Call it when every covered position is written.
        Snapshots are not inherited. All or nothing (raises OutOfKVPages)."""
        child = SeqPages(self.pool)
        num_whole = self.num_tokens // self.pool.page_size
        need = {}
        for g, pages in self._pages.items():
            if self.pool.kind(g) == RECURRENT:
                need[g] = len(pages)
            else:
                need[g] = 1 if len(pages) > num_whole and self.num_tokens % self.pool.page_size \
                    else 0
        self._check_free(need)
        copies = []
        for g, pages in self._pages.items():
            shared = [] if self.pool.kind(g) == RECURRENT else pages[:num_whole]
            self.pool.groups[g].incref(shared)
            fresh = self.pool.groups[g].allocate(need[g])
            src = pages[len(shared):len(shared) + need[g]]
            copies += [PageCopy(g, s, d) for s, d in zip(src, fresh, strict=True)]
            child._pages[g] = shared + fresh
            child._released[g] = self._released[g]
        child.num_tokens = self.num_tokens
        return child, copies

    def take_snapshot(self, num_tokens: int) -> int:
        """A new recurrent slot to hold the state after `num_tokens` (a page boundary); the
        runner copies the live state into it. Raises OutOfKVPages when none is free."""
        if num_tokens % self.pool.page_size or num_tokens in self._snapshots:
            raise ValueError(f"no snapshot possible at {num_tokens} tokens")
        (slot,) = self.pool.groups[RECURRENT].allocate(1)
        self._snapshots[num_tokens] = slot
        return slot

    def prefix_pages(self, num_tokens: int) -> dict[str, list[int]]:
        """Entries of the first num_tokens // page_size pages, for RadixCache.insert; the
        recurrent group lists the snapshot after each page (or -1)."""
        n = num_tokens // self.pool.page_size
        ps = self.pool.page_size
        return {g: [self._snapshots.get((i + 1) * ps, -1) for i in range(n)]
                if self.pool.kind(g) == RECURRENT else pages[:n]
                for g, pages in self._pages.items()}

    def drop_snapshots(self) -> None:
        """Release this sequence's snapshot references (the cache keeps its own)."""
        if self._snapshots:
            self.pool.groups[RECURRENT].decref(list(self._snapshots.values()))
            self._snapshots.clear()

    def free(self) -> None:
        """Release every reference; the object is empty afterwards (a second call is a no-op)."""
        self.drop_snapshots()
        for g, pages in self._pages.items():
            self.pool.groups[g].decref(pages)
            self._pages[g] = []
            self._mirrored[g] = 0
            self._released[g] = 0
        self.num_tokens = 0

    def _check_free(self, need: dict[str, int]) -> None:
        for g, n in need.items():
            if n > self.pool.groups[g].num_free:
                raise OutOfKVPages(
                    f"group {g}: need {n} pages, {self.pool.groups[g].num_free} free")
