"""Prefix cache: a radix tree over token ids at page granularity (SGLang's RadixCache).

Only whole pages are cached. A node's key is a run of tokens (a multiple of page_size)
and, per layer group, one entry per page of the key:
- full: the page id (never -1);
- sliding: the page id, or -1 where the page lies before the window of the node's end
  (the cache keeps only the last window before an inserted boundary);
- recurrent: the state snapshot slot after that page, or -1 (no snapshot there).
Every non-negative entry holds one reference in the KVPool. A prefix ending at page
boundary b is usable only if every group can resume there: full pages all present, the
sliding pages covering positions [b - window + 1, b) present, a snapshot at b.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from engine.kv.pool import FULL, RECURRENT, SLIDING, KVPool


class RadixNode:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...], pages: dict[str, list[int]],
                 parent: RadixNode | None, last_access: int) -> None:
        self.key = key
        self.pages = pages
        self.children: dict[tuple[int, ...], RadixNode] = {}  # by the first page's tokens
        self.parent = parent
        self.lock_ref = 0  # sequences using this node or a descendant
        self.last_access = last_access


class Match(NamedTuple):
    """The longest usable cached prefix: `num_tokens` (whole pages, at least one prompt
    token left to compute). `pages[group]` has one entry per page for full and sliding
    groups (sliding -1 entries are outside every remaining query's window: keep them -1
    in the page table, never read them); for the recurrent group it is [snapshot slot]
    (empty when num_tokens is 0): copy it into the sequence's own slot, never write it.
    The entries are guaranteed only until the next `evict`: lock `node` (and take page
    references, SeqPages.attach) in the same step, unlock when the sequence ends."""

    num_tokens: int
    pages: dict[str, list[int]]
    node: RadixNode


class RadixCache:
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self._clock = itertools.count(1)
        self.num_queries = 0
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.root = RadixNode((), {g: [] for g in pool.groups}, None, 0)

    def _page_key(self, tokens: Sequence[int], page: int) -> tuple[int, ...]:
        return tuple(tokens[page * self.page_size:(page + 1) * self.page_size])

    def _common_pages(self, node: RadixNode, tokens: Sequence[int], start: int,
                      limit: int) -> int:
        """Whole pages shared by node.key and tokens[start pages:], at most limit - start."""
        ps, m = self.page_size, 0
        while (m < len(node.key) // ps and start + m < limit
               and node.key[m * ps:(m + 1) * ps] == self._page_key(tokens, start + m)):
            m += 1
        return m

    def match(self, token_ids: Sequence[int]) -> Match:
        """Longest usable cached prefix of token_ids; refreshes its LRU time."""
        self.num_queries += 1
        self.num_query_tokens += len(token_ids)
        limit = max(0, len(token_ids) - 1) // self.page_size
        path: list[tuple[RadixNode, int]] = []  # nodes walked, pages matched in each
        node, pos = self.root, 0
        while pos < limit and (child := node.children.get(self._page_key(token_ids, pos))):
            m = self._common_pages(child, token_ids, pos, limit)
            path.append((child, m))
            pos += m
            if m < len(child.key) // self.page_size:
                break
            node = child
        entries = {g: [e for c, m in path for e in c.pages[g][:m]] for g in self.pool.groups}
        b = self._longest_usable(entries, pos)
        node, tick, walked = self.root, next(self._clock), 0
        for child, m in path:
            if walked == b:
                break
            take = min(m, b - walked)
            node = self._split(child, take) if take < len(child.key) // self.page_size else child
            node.last_access = tick
            walked += take
        pages = {g: (e[:b] if self.pool.kind(g) != RECURRENT else e[b - 1:b] if b else [])
                 for g, e in entries.items()}
        self.num_hit_tokens += b * self.page_size
        return Match(b * self.page_size, pages, node)

    def _longest_usable(self, entries: dict[str, list[int]], num_pages: int) -> int:
        """The largest boundary b <= num_pages (in pages) where every group can resume."""
        missing: dict[str, list[int]] = {}  # sliding: prefix counts of -1 entries
        for g, e in entries.items():
            if self.pool.kind(g) == SLIDING:
                missing[g] = list(itertools.accumulate((x < 0 for x in e), initial=0))
        for b in range(num_pages, 0, -1):
            if all(self._usable_at(g, e, b, missing.get(g)) for g, e in entries.items()):
                return b
        return 0

    def _usable_at(self, group: str, e: list[int], b: int, missing: list[int] | None) -> bool:
        kind = self.pool.kind(group)
        if kind == RECURRENT:
            return e[b - 1] >= 0
        if kind == SLIDING:
            assert missing is not None
            first = self.pool.first_needed_page(group, b * self.page_size)
            return missing[b] == missing[first]
        return True  # full entries are never -1

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cut node after num_pages pages; returns the new upper part (its parent's child)."""
        assert node.parent is not None
        cut = num_pages * self.page_size
        upper = RadixNode(node.key[:cut], {g: e[:num_pages] for g, e in node.pages.items()},
                          node.parent, node.last_access)
        upper.lock_ref = node.lock_ref
        node.parent.children[node.key[:self.page_size]] = upper
        node.key = node.key[cut:]
        node.pages = {g: e[num_pages:] for g, e in node.pages.items()}
        node.parent = upper
        upper.children[node.key[:self.page_size]] = node
        return upper

    def insert(self, token_ids: Sequence[int], pages: dict[str, list[int]]) -> int:
        """Cache the whole pages of token_ids (SeqPages.prefix_pages gives `pages`); the
        cache takes its own references, the caller keeps its own. Entries already cached
        are kept; -1 holes (sliding, recurrent) are filled. Returns new tokens cached."""
        n = len(token_ids) // self.page_size
        for g in self.pool.groups:
            if len(pages[g]) < n:
                raise ValueError(f"group {g}: {len(pages[g])} entries for {n} pages")
            if self.pool.kind(g) == FULL and min(pages[g][:n], default=0) < 0:
                raise ValueError(f"group {g}: a full group cannot cache a released page")
        # Sliding pages before the window of the inserted boundary are not kept.
        kept = {}
        for g in self.pool.groups:
            first = self.pool.first_needed_page(g, n * self.page_size)
            kept[g] = [-1] * min(first, n) + list(pages[g][first:n])
        node, pos, tick = self.root, 0, next(self._clock)
        while pos < n:
            child = node.children.get(self._page_key(token_ids, pos))
            if child is None:
                leaf = RadixNode(tuple(token_ids[pos * self.page_size:n * self.page_size]),
                                 {g: e[pos:] for g, e in kept.items()}, node, tick)
                for g, e in leaf.pages.items():
                    self.pool.groups[g].incref(e)
                node.children[leaf.key[:self.page_size]] = leaf
                return (n - pos) * self.page_size
            m = self._common_pages(child, token_ids, pos, n)
            if m < len(child.key) // self.page_size:
                child = self._split(child, m)
            for g, e in child.pages.items():
                for i, old in enumerate(e):
                    if old < 0 <= kept[g][pos + i]:
                        e[i] = kept[g][pos + i]
                        self.pool.groups[g].incref([e[i]])
            child.last_access = tick
            node, pos = child, pos + m
        return 0

    def lock(self, node: RadixNode) -> None:
        """Protect node and its ancestors from eviction (counted: lock twice, unlock twice)."""
        while node.parent is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise ValueError("unlock of a node that is not locked")
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_pages: int, group: str | None = None) -> int:
        """Remove least-recently-used unlocked leaves until `num_pages` pages of `group`
        (of any group if None) are free again. A leaf whose removal would free no such page
        (a running sequence still holds them) stays. Returns the pages freed."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._evictable(n, group)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            for g, e in leaf.pages.items():
                got = self.pool.groups[g].decref(e)
                freed += len(got) if group in (None, g) else 0
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[:self.page_size]]
            leaf.parent = None
            if parent.parent is not None and self._evictable(parent, group):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _evictable(self, node: RadixNode, group: str | None) -> bool:
        if node.children or node.lock_ref or node.parent is None:
            return False
        return any(p >= 0 and self.pool.groups[g].refcount(p) == 1
                   for g, e in node.pages.items() if group in (None, g) for p in e)

    def reset(self) -> None:
        """Drop every entry (locks included); sequences keep their own page references."""
        for node in self._nodes():
            for g, e in node.pages.items():
                self.pool.groups[g].decref(e)
        self.root = RadixNode((), {g: [] for g in self.pool.groups}, None, 0)

    def num_cached_pages(self, group: str) -> int:
        return sum(p >= 0 for n in self._nodes() for p in n.pages[group])

    def _nodes(self) -> Iterator[RadixNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def entries(self) -> Iterator[tuple[tuple[int, ...], dict[str, int]]]:
        """(tokens up to the end of a cached page, entry per group) for every cached page;
        for tests and debugging (cost grows with cached tokens times depth)."""
        stack: list[tuple[RadixNode, tuple[int, ...]]] = [
            (c, ()) for c in self.root.children.values()]
        while stack:
            node, prefix = stack.pop()
            for i in range(len(node.key) // self.page_size):
                end = prefix + node.key[:(i + 1) * self.page_size]
                yield end, {g: e[i] for g, e in node.pages.items()}
            stack.extend((c, prefix + node.key) for c in node.children.values())
