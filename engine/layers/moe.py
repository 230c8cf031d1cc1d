"""The mixture-of-experts MLP (qwen3moe): a softmax router picks `k` of E gated-MLP experts
a token; the block's output is their outputs weighted by the picked probabilities.

Two layouts of the expert weights (engine/models/weights.py picks):
- `GroupedExperts`: the file's GGML blocks (or dense bf16/f32 rows as F32/BF16 "blocks"),
  (E, N, row bytes) on the device; on the Triton path the whole block is three launches
  of fixed shapes for T in a decode step (routing and grouping; gate|up with the
  activation; down: kernels/moe.py, kernels/moe_route.py), four in a prefill chunk (the
  activation its own), and the combine inside the next norm's launch (`deferred`),
  captured in graphs like the dense MLP; elsewhere each expert's blocks are dequantized
  per call (the reference);
- `DenseExperts`: one dense linear an expert (the CPU layouts: f32, bf16, int8), run
  expert by expert over the tokens that picked it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kernel_select import use_triton
from engine.layers.activation import ACTIVATIONS
from engine.layers.linear import Int8Linear, Linear
from kernels.gated_act import gated_act
from kernels.moe import moe_matmul, plan_for
from kernels.moe_route import (
    Combined,
    RouteCounters,
    combine,
    combine_reference,
    route_group,
    route_reference,
)
from kernels.qmatmul import qmatmul_reference

__all__ = ["DenseExperts", "GroupedExperts", "MoE"]


class GroupedExperts:
    """E experts' (N, K) weights of one GGML type: blocks (E, N, row bytes) uint8; bias
    (E, N) float32 or None (gpt-oss's experts have one)."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, shape: tuple[int, int],
                 bias: torch.Tensor | None = None) -> None:
        self.blocks, self.ggml_type, self.shape = blocks, int(ggml_type), shape
        self.bias = None if bias is None else bias.float().contiguous()
        self.plan = plan_for(self.ggml_type, shape, blocks.device)

    def block_m(self, pairs: int) -> int:
        """The tile height of a call of `pairs` rows (group_tiles cuts them so)."""
        return self.plan.config(pairs, self.blocks.shape[0]).block_m

    def grouped(self, x: torch.Tensor, tokens: torch.Tensor | None, tiles: torch.Tensor,
                pairs: int, gated: str | None = None,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return moe_matmul(x, self.blocks, self.ggml_type, self.shape, tokens, tiles, pairs,
                          gated, out_dtype, self.bias)

    def one(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x (rows, K) @ expert e's weights.T (+ its bias), dequantized for this call."""
        y = qmatmul_reference(x, self.blocks[e], self.ggml_type, self.shape).float()
        return y if self.bias is None else y + self.bias[e]


class DenseExperts:
    """One dense linear an expert (rows (N, K))."""

    def __init__(self, linears: Sequence[Linear | Int8Linear]) -> None:
        self.linears = list(linears)

    def one(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.linears[e](x)


Experts = GroupedExperts | DenseExperts


class MoE:
    """h (T, hidden) float32 -> (T, hidden) float32."""

    def __init__(self, router: torch.Tensor, gate_up: Sequence[Experts], down: Experts,
                 experts_used: int, normalize: bool, scale: float | None,
                 activation: str, router_bias: torch.Tensor | None = None) -> None:
        """gate_up: parts whose outputs, side by side, are each expert's gate then up rows
        (one part where both have one GGML type); router_bias (E,): added to the router's
        logits (gpt-oss)."""
        self.router = router.float().contiguous()
        self.router_bias = None if router_bias is None else router_bias.float().contiguous()
        self.gate_up, self.down = list(gate_up), down
        self.k, self.normalize, self.scale = experts_used, normalize, scale
        self.activation = activation
        self.num_experts = self.router.shape[0]
        self.grouped = all(isinstance(p, GroupedExperts) for p in (*self.gate_up, down))
        self.counters = RouteCounters()  # route_group's, this block's own

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        out = self.deferred(h)
        return combine(*out) if isinstance(out, Combined) else out

    def deferred(self, h: torch.Tensor) -> torch.Tensor | Combined:
        """The block's output, or on the Triton path its Combined: the next norm
        (kernels/fused_norm.py) combines it in its own launch."""
        if self.grouped and use_triton(h.device):
            return self._grouped(h)
        return self._per_expert(h)

    def _grouped(self, h: torch.Tensor) -> Combined:
        """Three or four launches: routing and grouping (kernels/moe_route.route_group,
        which also rounds h to bf16 for the products on a GPU), gate|up with the
        activation in it (where GroupedExperts' plan says; else a launch of its own), down.
        The next norm combines."""
        pairs = h.shape[0] * self.k
        parts = [*self.gate_up, self.down]
        heights = [p.block_m(pairs) for p in parts]
        r = route_group(h, self.router, self.k, self.normalize, self.scale, heights,
                        self.counters, x_bf16=h.device.type != "cpu", bias=self.router_bias)
        x = h if r.x_bf16 is None else r.x_bf16
        # the grouped product rounds x to bf16 on a GPU: the activation is written so
        act_dtype = torch.float32 if h.device.type == "cpu" else torch.bfloat16
        one = self.gate_up[0]
        if len(self.gate_up) == 1 and one.plan.gated_in_product(pairs, self.num_experts):
            act = one.grouped(x, r.tokens, r.tiles[heights[0]], pairs, self.activation,
                              act_dtype)
        else:
            gu = [p.grouped(x, r.tokens, r.tiles[m], pairs)
                  for p, m in zip(self.gate_up, heights[:-1], strict=True)]
            act = gated_act(gu[0] if len(gu) == 1 else torch.cat(gu, 1), self.activation,
                            act_dtype)
        down = self.down.grouped(act, None, r.tiles[heights[-1]], pairs)
        return Combined(down, r.rows, r.weights)

    def _per_expert(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[0]
        weights, experts = route_reference(h, self.router, self.k, self.normalize, self.scale,
                                           self.router_bias)
        per_pair = torch.zeros(t, self.k, h.shape[1], dtype=torch.float32, device=h.device)
        act = ACTIVATIONS[self.activation]
        for e in torch.unique(experts).tolist():
            rows, slots = (experts == e).nonzero(as_tuple=True)
            x = h[rows]
            gate_up = torch.cat([p.one(e, x) for p in self.gate_up], 1)
            gate, up = gate_up.chunk(2, dim=1)
            per_pair[rows, slots] = self.down.one(e, act(gate, up)).float()
        in_order = torch.arange(t * self.k, device=h.device)  # per_pair's rows: pair order
        return combine_reference(per_pair.view(t * self.k, -1), in_order, weights)
