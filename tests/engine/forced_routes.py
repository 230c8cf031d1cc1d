"""Test helper: the CPU path's MoE blocks take the routing that the GPU path chose.

A tiny random model's router is ill-conditioned. In test_gpu_paths' gpt-oss file, top-k
logits lie 0.038 apart in a spread of about 8, and a GPU layout's ordinary rounding (8-bit
or bf16 activations, bf16 weights) flips some of them: one flipped expert moves the logits
by about 0.2 relative. Where no expert flips, a 1% change of a block's input still moves
two chosen experts' weights from 0.63 / 0.37 to 0.80 / 0.20 (bench/RESULTS.md,
2026-12-05). Compared as they stand, the two paths' logits then measure the router's
conditioning, not the kernels; given the same routing they measure the kernels. The
routing itself (route_group's launches against route_reference) is tested in
tests/kernels/test_moe.py.

`ForcedRoutes` records each MoE block's experts and weights as the GPU path's route_group
returns them, in call order (an eager forward: a graph replay runs no Python). The CPU
path's route_reference then returns them in the same order.
"""

from __future__ import annotations

import pytest
import torch

import engine.layers.moe as moe_layer
from kernels.moe_route import route_group


class ForcedRoutes:
    """Patches engine.layers.moe for the test's lifetime (monkeypatch): route_group
    records, route_reference replays. Load both models first (a layout's load may run
    forwards), or `clear` after; then a GPU forward and the CPU forward of the same batch,
    after which `pending` is empty."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # a block a call: weights (T, k) float32 and experts (T, k) int64, on the CPU
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_recorded = 0

        def recording(h, *args, **kwargs):
            routed = route_group(h, *args, **kwargs)
            t = h.shape[0]
            self.pending.append((routed.weights[:t].to("cpu", torch.float32),
                                 routed.experts[:t].to("cpu", torch.int64)))
            self.num_recorded += 1
            return routed

        def forced(h, router, k, normalize, scale, bias=None):
            if not self.pending:
                raise AssertionError("the CPU path routed a block the GPU path did not")
            weights, experts = self.pending.pop(0)
            if experts.shape != (h.shape[0], k):
                raise AssertionError(f"recorded routes {tuple(experts.shape)}, the CPU path "
                                     f"routes ({h.shape[0]}, {k})")
            return weights.to(h.device), experts.to(h.device)

        monkeypatch.setattr(moe_layer, "route_group", recording)
        monkeypatch.setattr(moe_layer, "route_reference", forced)

    def clear(self) -> None:
        self.pending.clear()
