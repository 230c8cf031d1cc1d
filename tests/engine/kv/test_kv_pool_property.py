"""10,000 random pool and prefix-cache operations, checked against a model kept by the test.

The model is a flat dict {tokens through the end of a cached page: entry per group},
updated by the insert rules written out here; page holders are counted from the
sequences' tables, the snapshots the test saw being taken, and that model; a sequence's
table array (SeqPages.table_array, read now and then) always equals its table.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from engine.errors import OutOfKVPages
from engine.kv.pool import KVPool, SeqPages
from engine.kv.radix import RadixCache, RadixNode

PS, WINDOW = 4, 10
HYBRID = {"full": 48, "sliding": 48, "recurrent": 16}  # gemma3 + qwen35 layer groups at once
MAX_LEN, MAX_SEQS = 64, 6


def needed(page: int, boundary: int) -> bool:
    """Is a key in this page visible to some query at a position >= boundary?"""
    return any(q > boundary - WINDOW for q in range(page * PS, (page + 1) * PS))


@dataclass
class Live:
    seq: SeqPages
    tokens: list[int]
    node: RadixNode
    locked_key: tuple[int, ...]  # prefix the lock must keep in the cache
    snapshots: dict[int, int] = field(default_factory=dict)


class Harness:
    def __init__(self, seed: int, sizes: dict[str, int]) -> None:
        self.rng = random.Random(seed)
        self.array_rng = random.Random(seed + 1)  # when check() reads SeqPages.table_array
        self.sizes = sizes
        self.paged = [g for g in sizes if g != "recurrent"]
        self.pool = KVPool(dict(sizes), PS, {"sliding": WINDOW} if "sliding" in sizes else {})
        self.cache = RadixCache(self.pool)
        self.model: dict[tuple[int, ...], dict[str, int]] = {}
        self.live: list[Live] = []
        self.bases = [[self.rng.randrange(10) for _ in range(40)] for _ in range(4)]
        self.queries = self.hit_tokens = 0

    # --- the model's own rules -------------------------------------------------------
    def expected_match(self, tokens: list[int]) -> tuple[int, list[dict[str, int]]]:
        limit, avail = max(0, len(tokens) - 1) // PS, 0
        while avail < limit and tuple(tokens[:(avail + 1) * PS]) in self.model:
            avail += 1
        entries = [self.model[tuple(tokens[:(i + 1) * PS])] for i in range(avail)]
        for b in range(avail, 0, -1):
            if entries[b - 1].get("recurrent", 0) >= 0 and all(
                    entries[i].get("sliding", 0) >= 0 for i in range(b) if needed(i, b * PS)):
                return b, entries[:b]
        return 0, []

    def model_insert(self, tokens: list[int], pages: dict[str, list[int]]) -> int:
        n, added = len(tokens) // PS, 0
        for i in range(n):
            new = {g: pages[g][i] for g in self.sizes}
            if "sliding" in new and not needed(i, n * PS):
                new["sliding"] = -1
            key = tuple(tokens[:(i + 1) * PS])
            if key not in self.model:
                self.model[key], added = new, added + PS
            for g, e in new.items():
                if self.model[key][g] < 0 <= e:
                    self.model[key][g] = e
        return added

    def can_snapshot(self) -> bool:
        return "recurrent" in self.sizes and self.pool.groups["recurrent"].num_free > 0

    # --- operations ------------------------------------------------------------------
    def prompt(self) -> list[int]:
        base = self.rng.choice(self.bases)[:self.rng.randint(1, 40)]
        return base + [self.rng.randrange(10) for _ in range(self.rng.randint(0, 8))]

    def match(self, tokens: list[int]):
        m = self.cache.match(tokens)
        b, entries = self.expected_match(tokens)
        self.queries, self.hit_tokens = self.queries + 1, self.hit_tokens + b * PS
        assert m.num_tokens == b * PS, (tokens, m.num_tokens, b)
        for g in self.paged:
            assert m.pages[g] == [e[g] for e in entries]
        if "recurrent" in self.sizes:
            assert m.pages["recurrent"] == ([entries[-1]["recurrent"]] if b else [])
        return m

    def evict(self, num_pages: int, group: str | None) -> None:
        free_before = {g: p.num_free for g, p in self.pool.groups.items()}
        got = self.cache.evict(num_pages, group)
        now = dict(self.cache.entries())
        assert all(self.model[k] == e for k, e in now.items())
        assert all(k[:-PS] in now for k in now if len(k) > PS)  # still prefix-closed
        for lv in self.live:
            assert all(lv.locked_key[:i] in now for i in range(PS, len(lv.locked_key) + 1, PS))
        self.model = {k: self.model[k] for k in now}
        gained = {g: p.num_free - free_before[g] for g, p in self.pool.groups.items()}
        assert got == (sum(gained.values()) if group is None else gained[group])

    def ensure(self, lv: Live, num_tokens: int) -> None:
        for g, n in lv.seq.pages_needed(num_tokens).items():
            if n > self.pool.groups[g].num_free:
                self.evict(n - self.pool.groups[g].num_free, g)
        before = {g: lv.seq.table(g) for g in self.sizes}
        try:
            lv.seq.ensure(num_tokens)
        except OutOfKVPages:
            assert {g: lv.seq.table(g) for g in self.sizes} == before  # all or nothing
            raise

    def end(self, lv: Live) -> None:
        lv.seq.free()
        self.cache.unlock(lv.node)
        self.live.remove(lv)

    def op_new(self) -> None:
        tokens = self.prompt()
        m = self.match(tokens)
        self.cache.lock(m.node)
        seq = SeqPages(self.pool)
        seq.attach(m.pages, m.num_tokens)
        lv = Live(seq, tokens, m.node, tuple(tokens[:m.num_tokens]))
        self.live.append(lv)
        try:
            self.ensure(lv, len(tokens))
        except OutOfKVPages:
            self.end(lv)
            return
        for b in range(m.num_tokens + PS, len(tokens) + 1, PS):  # snapshots at chunk ends
            if self.can_snapshot() and self.rng.random() < 0.5:
                lv.snapshots[b] = seq.take_snapshot(b)

    def op_extend(self, lv: Live) -> None:
        k = self.rng.randint(1, 6)
        if len(lv.tokens) + k > MAX_LEN:
            return
        try:
            self.ensure(lv, len(lv.tokens) + k)
        except OutOfKVPages:  # evict-and-recompute: the sequence gives its pages back
            self.end(lv)
            return
        lv.tokens += [self.rng.randrange(10) for _ in range(k)]
        if "sliding" in self.sizes and self.rng.random() < 0.5:
            n = len(lv.tokens)
            lv.seq.release_out_of_window(n)
            table = lv.seq.table("sliding")
            assert [p < 0 for p in table] == [not needed(i, n - n % PS) for i in range(len(table))]

    def op_snapshot(self, lv: Live) -> None:
        b = len(lv.tokens) - len(lv.tokens) % PS
        if b and b not in lv.snapshots and self.can_snapshot():
            lv.snapshots[b] = lv.seq.take_snapshot(b)

    def op_insert(self, lv: Live) -> None:
        n = len(lv.tokens)
        pages = {g: lv.seq.table(g)[:n // PS] for g in self.paged}
        if "recurrent" in self.sizes:
            pages["recurrent"] = [lv.snapshots.get((i + 1) * PS, -1) for i in range(n // PS)]
        assert lv.seq.prefix_pages(n) == pages
        added = self.model_insert(lv.tokens, pages)
        assert self.cache.insert(lv.tokens, pages) == added

    def op_fork(self, lv: Live) -> None:
        if len(self.live) >= MAX_SEQS:
            return
        try:
            child, copies = lv.seq.fork()
        except OutOfKVPages:
            return
        n, whole = len(lv.tokens), len(lv.tokens) // PS
        expected = []
        for g in self.paged:
            mine, theirs = lv.seq.table(g), child.table(g)
            assert theirs[:whole] == mine[:whole] and len(theirs) == -(-n // PS)
            if n % PS:
                expected.append((g, mine[whole], theirs[whole]))
        if "recurrent" in self.sizes:
            expected.append(("recurrent", lv.seq.table("recurrent")[0],
                             child.table("recurrent")[0]))
        assert sorted(copies) == sorted(expected)
        self.cache.lock(lv.node)
        self.live.append(Live(child, list(lv.tokens), lv.node, lv.locked_key))

    def step(self) -> None:
        r = self.rng.random()
        lv = self.rng.choice(self.live) if self.live else None
        if r < 0.15 or lv is None:
            if len(self.live) < MAX_SEQS:
                self.op_new()
        elif r < 0.42:
            self.op_extend(lv)
        elif r < 0.50:
            self.op_snapshot(lv)
        elif r < 0.60:
            self.op_insert(lv)
        elif r < 0.65:
            self.op_fork(lv)
        elif r < 0.73:
            self.op_insert(lv)
            self.end(lv)  # finish
        elif r < 0.78:
            self.end(lv)  # abort
        elif r < 0.86:
            self.evict(self.rng.randint(1, 12), self.rng.choice([None, *self.sizes]))
        elif r < 0.94:
            self.match(self.prompt())  # a query that is not used
        elif r < 0.98:
            lv.seq.drop_snapshots()
            lv.snapshots.clear()
        elif r < 0.99:
            self.cache.reset()
            self.model = {}
            for other in self.live:
                other.locked_key = ()

    # --- invariants --------------------------------------------------------------------
    def check(self) -> None:
        holders = {g: Counter() for g in self.sizes}
        for lv in self.live:
            n = len(lv.tokens)
            assert lv.seq.num_tokens == n
            for g in self.sizes:
                table = lv.seq.table(g)
                if self.array_rng.random() < 0.3:  # the array kept in step, read now and then
                    assert lv.seq.table_array(g).tolist() == table
                holders[g].update(p for p in table if p >= 0)
                if g == "recurrent":
                    assert len(table) == 1 and self.pool.groups[g].refcount(table[0]) == 1
                    continue
                assert len(table) == -(-n // PS)
                # a page the sequence writes next is its alone
                assert all(self.pool.groups[g].refcount(p) == 1 for p in table[n // PS:])
                assert g == "sliding" or min(table, default=0) >= 0
            if lv.snapshots:
                holders["recurrent"].update(lv.snapshots.values())
        for entry in self.model.values():
            for g, p in entry.items():
                if p >= 0:
                    holders[g][p] += 1
        for g, pool in self.pool.groups.items():
            refs = [pool.refcount(p) for p in range(pool.num_pages)]
            assert refs == [holders[g][p] for p in range(pool.num_pages)], g
            assert pool.num_free == refs.count(0)
        assert dict(self.cache.entries()) == self.model
        assert (self.cache.num_queries, self.cache.num_hit_tokens) == (
            self.queries, self.hit_tokens)


@pytest.mark.parametrize(("sizes", "num_ops"), [(HYBRID, 10_000), ({"full": 40}, 4_000)])
def test_random_operations_conserve_pages(sizes: dict[str, int], num_ops: int) -> None:
    h = Harness(1234, sizes)
    counts = Counter()
    for _ in range(num_ops):
        h.step()
        h.check()
        counts["live"] += len(h.live)
        counts["cached"] += len(h.model)
    assert h.hit_tokens > 0 and counts["cached"] > 0  # the cache was exercised
    while h.live:
        h.end(h.live[0])
    h.cache.reset()
    assert all(p.num_free == p.num_pages for p in h.pool.groups.values())
