"""A PlannedBatch keeps the plans and write slots it is given (a positional mix-up once
left decode graphs planning on the host inside the capture)."""

from __future__ import annotations

import torch

from engine.batch import ForwardBatch
from engine.layers.attention import PlannedBatch, _planned


def test_planned_batch_carries_its_plans_and_slots():
    batch = ForwardBatch.build([([5], 3), ([6], 0)], {"full": [[0], [1]]})
    attn = {"full": object()}
    slots = {"full": torch.tensor([3, 16])}
    planned = _planned(batch, attn, slots)
    assert isinstance(planned, PlannedBatch)
    assert planned.attn is attn
    assert planned._write_slots is slots
    assert torch.equal(planned.input_ids, batch.input_ids)
    assert torch.equal(planned.logits_rows, batch.logits_rows)
