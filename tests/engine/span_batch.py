"""Test helper: one ForwardBatch over paged sequences from (sequence index, new ids) spans."""

from __future__ import annotations

from engine.batch import ForwardBatch


def span_batch(runner, pages, spans) -> ForwardBatch:
    """Each span appends its ids to `pages[i]` (growing its pages) as one row of the batch,
    starting where that sequence left off; page tables for every group of runner.pool."""
    rows, tables = [], {g: [] for g in runner.pool.groups}
    for i, ids in spans:
        start = pages[i].num_tokens
        pages[i].ensure(start + len(ids))
        rows.append((ids, start))
        for g in tables:
            tables[g].append(pages[i].table(g))
    return ForwardBatch.build(rows, tables)
