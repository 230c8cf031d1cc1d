"""RadixCache: match/insert, LRU eviction order, locks, sliding and recurrent groups."""

from __future__ import annotations

import pytest

from engine.kv.pool import KVPool, SeqPages
from engine.kv.radix import RadixCache

PS = 4


def cached_seq(pool: KVPool, cache: RadixCache, tokens: list[int]) -> SeqPages:
    """A sequence that computed `tokens` and put its whole pages into the cache."""
    seq = SeqPages(pool)
    seq.ensure(len(tokens))
    cache.insert(tokens, seq.prefix_pages(len(tokens)))
    return seq


def make(num_pages: int = 32) -> tuple[KVPool, RadixCache]:
    pool = KVPool({"full": num_pages}, PS)
    return pool, RadixCache(pool)


def test_match_whole_pages_and_leaves_one_token() -> None:
    pool, cache = make()
    seq = cached_seq(pool, cache, list(range(14)))  # 3 whole pages cached, 2 tokens not
    pages = seq.table("full")
    assert cache.match(list(range(14)) + [99]).pages["full"] == pages[:3]
    assert cache.match(list(range(12))).num_tokens == 8  # one token must remain
    assert cache.match(list(range(13))).num_tokens == 12
    assert cache.match(list(range(11))).num_tokens == 8
    assert cache.match([0, 1, 2, 3, 4, 5, 6, 99, 8]).num_tokens == 4  # diverges in page 1
    assert cache.match([5, 1, 2, 3, 4]).num_tokens == 0
    assert cache.match([]).num_tokens == 0
    assert (cache.num_queries, cache.num_hit_tokens) == (7, 12 + 8 + 12 + 8 + 4)
    assert cache.num_query_tokens == 15 + 12 + 13 + 11 + 9 + 5


def test_insert_splits_and_keeps_existing_pages() -> None:
    pool, cache = make()
    a = cached_seq(pool, cache, [1] * 12)
    b = cached_seq(pool, cache, [1] * 8 + [2] * 8)  # shares two pages with a
    assert cache.num_cached_pages("full") == 3 + 2
    m = cache.match([1] * 8 + [2] * 8 + [0])
    assert m.pages["full"] == a.table("full")[:2] + b.table("full")[2:4]
    # b's own first two pages were not adopted: only b holds them
    assert [pool.groups["full"].refcount(p) for p in b.table("full")] == [1, 1, 2, 2]
    assert cache.insert([1] * 12, a.prefix_pages(12)) == 0
    assert cache.insert([1] * 16, {"full": a.table("full") + pool.groups["full"].allocate(1)}) \
        == 4


def test_evict_is_lru_over_unlocked_leaves() -> None:
    pool, cache = make()
    seqs = {k: cached_seq(pool, cache, [k] * 8) for k in (1, 2, 3)}
    for s in seqs.values():
        s.free()  # only the cache holds the pages now
    cache.match([1] * 8 + [0])  # 1 becomes the most recent; 2 is now the oldest
    free0 = pool.groups["full"].num_free
    assert cache.evict(1) == 2  # a whole leaf (two pages) goes
    assert cache.match([2] * 8 + [0]).num_tokens == 0
    assert cache.match([3] * 8 + [0]).num_tokens == 8  # refreshes 3; 1 is now the oldest
    node = cache.match([1] * 8 + [0]).node
    cache.lock(node)
    assert cache.evict(1) == 2  # 1 is locked, so 3 goes
    assert cache.match([3] * 8 + [0]).num_tokens == 0
    assert cache.evict(10) == 0 and pool.groups["full"].num_free == free0 + 4
    cache.unlock(node)
    with pytest.raises(ValueError):
        cache.unlock(node)
    assert cache.evict(10) == 2 and pool.groups["full"].num_free == pool.groups["full"].num_pages


def test_evict_goes_up_to_parents_and_skips_pages_still_in_use() -> None:
    pool, cache = make()
    base = cached_seq(pool, cache, [7] * 8)
    base.free()
    tail = cached_seq(pool, cache, [7] * 8 + [8] * 4)  # a child under the [7]*8 node
    assert cache.evict(5) == 0  # every leaf's pages are still held by `tail`
    tail.free()
    lock = cache.match([7] * 4 + [0]).node  # splits: [7]*4 / [7]*4 / [8]*4
    cache.lock(lock)
    assert cache.evict(5) == 2  # the child, then its parent; the locked top part stays
    assert cache.match([7] * 8 + [8] * 4 + [0]).num_tokens == 4
    cache.unlock(lock)
    assert cache.evict(5) == 1 and pool.groups["full"].num_free == 32


def test_evict_counts_the_asked_group() -> None:
    pool = KVPool({"full": 8, "sliding": 8}, PS, {"sliding": 6})
    cache = RadixCache(pool)
    cached_seq(pool, cache, list(range(16))).free()
    assert cache.num_cached_pages("full") == 4 and cache.num_cached_pages("sliding") == 2
    assert cache.evict(1, group="sliding") == 2  # one leaf: 4 full + 2 sliding pages
    assert pool.groups["full"].num_free == 8


def test_sliding_keeps_last_window_and_match_backs_off() -> None:
    pool = KVPool({"full": 32, "sliding": 32}, PS, {"sliding": 6})
    cache = RadixCache(pool)
    seq = SeqPages(pool)
    seq.ensure(24)
    cache.insert(list(range(24)), seq.prefix_pages(24))
    entries = dict(cache.entries())
    # resuming at 24 needs keys at positions >= 19: pages 4 and 5
    assert [entries[tuple(range(i))]["sliding"] >= 0 for i in range(4, 25, 4)] == [
        False, False, False, False, True, True]
    m = cache.match(list(range(30)))
    assert m.num_tokens == 24 and m.pages["sliding"][:4] == [-1] * 4
    assert m.pages["sliding"][4:] == seq.table("sliding")[4:6]
    assert cache.match(list(range(21))).num_tokens == 0  # boundaries 20, 16, ... lack pages
    cache.insert(list(range(12)), seq.prefix_pages(12))  # fills the holes before 12
    assert cache.match(list(range(21))).num_tokens == 12
    seq.free()
    cache.reset()
    assert pool.groups["sliding"].num_free == 32 and pool.groups["full"].num_free == 32


def test_recurrent_match_only_at_snapshots() -> None:
    pool = KVPool({"full": 16, "recurrent": 8}, PS)
    cache = RadixCache(pool)
    seq = SeqPages(pool)
    seq.ensure(20)
    s8 = seq.take_snapshot(8)
    cache.insert(list(range(20)), seq.prefix_pages(20))
    m = cache.match(list(range(25)))
    assert m.num_tokens == 8 and m.pages["recurrent"] == [s8] and len(m.pages["full"]) == 2
    assert cache.match(list(range(8))).pages["recurrent"] == []
    s16 = seq.take_snapshot(16)
    cache.insert(list(range(20)), seq.prefix_pages(20))  # fills the hole at 16
    assert cache.match(list(range(25))).pages["recurrent"] == [s16]
    seq.free()
    assert pool.groups["recurrent"].refcount(s8) == 1 == pool.groups["recurrent"].refcount(s16)
    cache.reset()
    assert pool.groups["recurrent"].num_free == 8


def test_insert_rejects_bad_pages() -> None:
    pool, cache = make()
    with pytest.raises(ValueError):
        cache.insert(list(range(8)), {"full": [0]})
    with pytest.raises(ValueError):
        cache.insert(list(range(8)), {"full": [0, -1]})
