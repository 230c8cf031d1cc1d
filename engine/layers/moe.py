"""The mixture-of-experts MLP (qwen3moe): a softmax router picks `k` of E gated-MLP experts
a token; the block's output is their outputs weighted by the picked probabilities.

Two layouts of the expert weights (engine/models/weights.py picks):
- `GroupedExperts`: the file's GGML blocks (or dense bf16/f32 rows as F32/BF16 "blocks"),
  (E, N, row bytes) on the device; on the Triton path the whole block is seven launches
  of fixed shapes for T (router logits, top-k, grouping, gate|up, activation, down,
  combine: kernels/moe.py, kernels/moe_route.py), captured in graphs like the dense MLP;
  elsewhere each expert's blocks are dequantized per call (the reference);
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
from kernels.moe_route import combine, combine_reference, group_tiles, route, route_reference
from kernels.qmatmul import qmatmul_reference

__all__ = ["DenseExperts", "GroupedExperts", "MoE"]


class GroupedExperts:
    """E experts' (N, K) weights of one GGML type: blocks (E, N, row bytes) uint8."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, shape: tuple[int, int]) -> None:
        self.blocks, self.ggml_type, self.shape = blocks, int(ggml_type), shape
        self.plan = plan_for(self.ggml_type, shape, blocks.device)

    def block_m(self, pairs: int) -> int:
        """The tile height of a call of `pairs` rows (group_tiles cuts them so)."""
        return self.plan.config(pairs, self.blocks.shape[0]).block_m

    def grouped(self, x: torch.Tensor, tokens: torch.Tensor | None, tiles: torch.Tensor,
                pairs: int) -> torch.Tensor:
        return moe_matmul(x, self.blocks, self.ggml_type, self.shape, tokens, tiles, pairs)

    def one(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x (rows, K) @ expert e's weights.T, dequantized for this call."""
        return qmatmul_reference(x, self.blocks[e], self.ggml_type, self.shape).float()


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
                 activation: str) -> None:
        """gate_up: parts whose outputs, side by side, are each expert's gate then up rows
        (one part where both have one GGML type)."""
        self.router = router.float().contiguous()
        self.gate_up, self.down = list(gate_up), down
        self.k, self.normalize, self.scale = experts_used, normalize, scale
        self.activation = activation
        self.num_experts = self.router.shape[0]
        self.grouped = all(isinstance(p, GroupedExperts) for p in (*self.gate_up, down))

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.grouped and use_triton(h.device):
            return self._grouped(h)
        return self._per_expert(h)

    def _grouped(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[0]
        weights, experts = route(h, self.router, self.k, self.normalize, self.scale)
        pairs = t * self.k
        tables: dict[int, tuple] = {}  # block_m -> group_tiles (types differ in tile height)

        def tiles(part: GroupedExperts) -> tuple:
            block_m = part.block_m(pairs)
            if block_m not in tables:
                tables[block_m] = group_tiles(experts, self.num_experts, block_m)
            return tables[block_m]

        gu = [p.grouped(h, tiles(p)[1], tiles(p)[2], pairs) for p in self.gate_up]
        gate_up = gu[0] if len(gu) == 1 else torch.cat(gu, 1)
        # the grouped product rounds x to bf16 on a GPU: the activation writes it so
        act = gated_act(gate_up, self.activation,
                        torch.float32 if h.device.type == "cpu" else torch.bfloat16)
        down = self.down.grouped(act, None, tiles(self.down)[2], pairs)
        return combine(down, tiles(self.down)[0], weights)

    def _per_expert(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[0]
        weights, experts = route_reference(h, self.router, self.k, self.normalize, self.scale)
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
