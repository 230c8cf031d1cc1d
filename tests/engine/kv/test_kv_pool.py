"""PagePool, KVPool and SeqPages: allocation, sharing, sliding release, recurrent slots."""

from __future__ import annotations

import pytest

from engine.errors import OutOfKVPages
from engine.kv.pool import KVPool, PageCopy, PagePool, SeqPages
from engine.kv.radix import RadixCache


def test_page_pool_counts_and_free_list() -> None:
    pool = PagePool(4)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free == 1
    pool.incref([a[0], -1])  # -1 entries are ignored
    assert pool.refcount(a[0]) == 2
    assert pool.decref([a[0], a[1], -1]) == [a[1]]
    assert pool.num_free == 2 and pool.refcount(a[0]) == 1 and pool.refcount(a[1]) == 0
    assert sorted(pool.allocate(2)) == sorted([a[1], 3])
    assert pool.num_free == 0


def test_page_pool_all_or_nothing_and_misuse() -> None:
    pool = PagePool(3)
    pool.allocate(2)
    with pytest.raises(OutOfKVPages):
        pool.allocate(2)
    assert pool.num_free == 1
    (p,) = pool.allocate(1)
    assert pool.decref([p]) == [p]
    with pytest.raises(ValueError):
        pool.decref([p])  # double free
    with pytest.raises(ValueError):
        pool.incref([p])  # sharing a free page
    assert pool.num_free == 1


def test_kv_pool_kinds_and_validation() -> None:
    pool = KVPool({"full": 2, "sliding": 2, "recurrent": 2}, 16, {"sliding": 100})
    assert [pool.kind(g) for g in ("full", "sliding", "recurrent")] == [
        "full", "sliding", "recurrent"]
    assert pool.pages_for(0) == 0 and pool.pages_for(16) == 1 and pool.pages_for(17) == 2
    for windows in ({"recurrent": 8}, {"other": 8}, {"sliding": 0}):
        with pytest.raises(ValueError):
            KVPool({"full": 1, "sliding": 1, "recurrent": 1}, 16, windows)


def test_ensure_is_all_or_nothing_across_groups() -> None:
    pool = KVPool({"full": 8, "sliding": 2}, 4, {"sliding": 4})
    seq = SeqPages(pool)
    assert seq.pages_needed(9) == {"full": 3, "sliding": 3}
    with pytest.raises(OutOfKVPages):
        seq.ensure(9)
    assert pool.groups["full"].num_free == 8 and seq.table("full") == []
    seq.ensure(8)
    assert len(seq.table("full")) == 2 and seq.num_tokens == 8
    seq.ensure(5)  # never shrinks
    assert seq.num_tokens == 8 and len(seq.table("sliding")) == 2


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 3, 4, 16, 37])
def test_sliding_release_matches_position_rule(page_size: int, window: int) -> None:
    # Brute force: a page is needed if a query at a position >= the last page boundary
    # b attends to one of its positions q, i.e. q > b - window.
    pool = KVPool({"sliding": 64}, page_size, {"sliding": window})
    seq = SeqPages(pool)
    for length in range(0, 120, 7):
        seq.ensure(length)
        seq.release_out_of_window(length)
        b = length - length % page_size
        for i, page in enumerate(seq.table("sliding")):
            needed = any(q > b - window for q in range(i * page_size, (i + 1) * page_size))
            assert (page >= 0) == needed, (length, i)
    held = sum(p >= 0 for p in seq.table("sliding"))
    assert pool.groups["sliding"].num_free == 64 - held
    seq.free()
    assert pool.groups["sliding"].num_free == 64


def test_sliding_release_keeps_pages_the_cache_holds() -> None:
    pool = KVPool({"full": 8, "sliding": 8}, 4, {"sliding": 5})
    cache = RadixCache(pool)
    seq = SeqPages(pool)
    seq.ensure(8)
    cache.insert(list(range(8)), seq.prefix_pages(8))  # the cache holds both pages
    seq.ensure(20)
    assert seq.release_out_of_window(20) == 4  # positions < 16 are out of every window
    refcount = pool.groups["sliding"].refcount
    assert seq.table("sliding") == [-1, -1, -1, -1, 4]
    # pages 0 and 1 stay allocated for the cache (window 5 before boundary 8: page 1 only)
    cached = [e["sliding"] for _, e in cache.entries()]
    assert sorted(p for p in cached if p >= 0) == [1]
    assert refcount(1) == 1 and refcount(0) == 0
    with pytest.raises(ValueError):
        seq.release_out_of_window(21)


def test_fork_shares_whole_pages_and_copies_the_partial_one() -> None:
    pool = KVPool({"full": 8, "sliding": 8, "recurrent": 4}, 4, {"sliding": 4})
    seq = SeqPages(pool)
    seq.ensure(10)
    seq.release_out_of_window(10)
    child, copies = seq.fork()
    full, slide, (live,) = seq.table("full"), seq.table("sliding"), seq.table("recurrent")
    assert child.num_tokens == 10
    assert child.table("full")[:2] == full[:2] and child.table("full")[2] != full[2]
    assert child.table("sliding")[:2] == slide[:2] == [-1, 1]
    assert [pool.groups["full"].refcount(p) for p in full] == [2, 2, 1]
    (child_live,) = child.table("recurrent")
    assert child_live != live
    assert sorted(copies) == sorted([PageCopy("full", full[2], child.table("full")[2]),
                                     PageCopy("sliding", slide[2], child.table("sliding")[2]),
                                     PageCopy("recurrent", live, child_live)])
    seq.free()
    child.free()
    assert all(g.num_free == g.num_pages for g in pool.groups.values())


def test_fork_at_page_boundary_copies_nothing_and_is_all_or_nothing() -> None:
    pool = KVPool({"full": 3}, 4)
    seq = SeqPages(pool)
    seq.ensure(8)
    child, copies = seq.fork()
    assert copies == [] and child.table("full") == seq.table("full")
    seq.ensure(10)
    child2 = SeqPages(pool)
    child2.attach({"full": seq.table("full")[:2]}, 8)
    with pytest.raises(OutOfKVPages):  # the partial page needs a fresh one, none free
        seq.fork()
    assert [pool.groups["full"].refcount(p) for p in seq.table("full")] == [3, 3, 1]


def test_recurrent_slots_and_snapshots() -> None:
    pool = KVPool({"full": 8, "recurrent": 3}, 4)
    seq = SeqPages(pool)
    seq.ensure(3)
    seq.ensure(11)
    assert len(seq.table("recurrent")) == 1 and pool.groups["recurrent"].num_free == 2
    s4, s8 = seq.take_snapshot(4), seq.take_snapshot(8)
    assert pool.groups["recurrent"].num_free == 0
    for bad in (8, 6):
        with pytest.raises(ValueError):
            seq.take_snapshot(bad)
    assert seq.prefix_pages(11)["recurrent"] == [s4, s8]
    assert seq.prefix_pages(12)["recurrent"] == [s4, s8, -1]
    seq.drop_snapshots()
    assert pool.groups["recurrent"].num_free == 2
    seq.free()
    seq.free()  # a second free is a no-op
    assert pool.groups["recurrent"].num_free == 3 and pool.groups["full"].num_free == 8


def test_attach_validates_and_takes_references() -> None:
    pool = KVPool({"full": 8, "recurrent": 2}, 4)
    donor = SeqPages(pool)
    donor.ensure(8)
    seq = SeqPages(pool)
    with pytest.raises(ValueError):
        seq.attach({"full": donor.table("full")}, 6)
    seq.attach({"full": donor.table("full"), "recurrent": [0]}, 8)
    assert seq.table("full") == donor.table("full") and seq.table("recurrent") == []
    assert pool.groups["full"].refcount(donor.table("full")[0]) == 2
    with pytest.raises(ValueError):
        seq.attach({"full": []}, 0)  # not empty any more
    donor.free()
    seq.free()
    assert pool.groups["full"].num_free == 8


def test_table_array_follows_growth_releases_and_resets() -> None:
    """The int64 copy of a table grows past its capacity (64, then doubled), takes the
    sliding window's releases (-1) whether or not it was read before them, and starts over
    after free and attach."""
    pool = KVPool({"full": 300, "sliding": 300}, 4, {"sliding": 10})
    seq = SeqPages(pool)
    for n in (3, 200, 201, 260, 900):  # 1, 50, 51, 65, 225 pages
        seq.ensure(n)
        for g in ("full", "sliding"):
            got = seq.table_array(g)
            assert got.dtype.name == "int64" and got.tolist() == seq.table(g), (n, g)
    seq.ensure(1000)
    assert seq.release_out_of_window(1000) > 0  # the array holds fewer entries than the table
    assert seq.table_array("sliding").tolist() == seq.table("sliding")
    assert seq.release_out_of_window(1000) == 0
    seq.ensure(1100)
    read = seq.table_array("sliding").tolist()
    assert seq.release_out_of_window(1100) > 0  # now entries the array already holds
    assert seq.table_array("sliding").tolist() == seq.table("sliding") != read
    seq.free()
    assert seq.table_array("full").tolist() == []
    seq.ensure(8)
    assert seq.table_array("full").tolist() == seq.table("full")
    seq.free()
    other = SeqPages(pool)
    other.ensure(16)
    seq.attach({"full": other.table("full"), "sliding": other.table("sliding")}, 16)
    assert seq.table_array("full").tolist() == other.table("full")
