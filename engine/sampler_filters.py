"""The sampler's support filters (steps 3-6 of engine/sampler.py's chain): temperature,
top-k, top-p and min-p on float64 adjusted logits -> unnormalised weights, 0 outside the
support.

Top-k/top-p keep a prefix of the (weight desc, id asc) order. A CPU sorts 262K float64 in
~40 ms a row but 1K in ~70 us, so from 512 ids on the CPU first looks at the largest
min(256, vocab/8) weights (the candidates) and takes the full sort only for the rows that
the candidates cannot decide.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling_params import SamplingParams

__all__ = ["filtered_weights", "top_k_top_p"]

_CANDIDATES, _MIN_VOCAB = 256, 512  # CPU top-k/top-p, vocab >= 512: min(256, vocab/8) first


def filtered_weights(
    x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, params: Sequence[SamplingParams],
) -> torch.Tensor:
    """x (rows, vocab) float64 adjusted logits -> unnormalised weights, 0 outside the support.

    temperature, top_k (a count, vocab when off), top_p and min_p are (rows, 1) float64.
    The weights are exp(l/T - max): the top token has weight 1, so min-p is `w >= min_p`.
    `params` (host side) only decides which filters any row needs.
    """
    vocab = x.shape[-1]
    scaled = x / temperature
    w = torch.exp(scaled - scaled.amax(dim=-1, keepdim=True))
    if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
        w = top_k_top_p(w, top_k, top_p)
    if any(p.min_p > 0.0 for p in params):
        w = w.masked_fill(w < min_p, 0.0)
    return w


def top_k_top_p(w: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                full_sort: bool = False) -> torch.Tensor:
    """w (rows, vocab) weights; top_k (rows, 1) count (vocab = off); top_p (rows, 1) (1 = off)."""
    if not full_sort and w.device.type == "cpu" and w.shape[-1] >= _MIN_VOCAB:
        return _top_k_top_p_candidates(w, top_k, top_p)
    # Stable descending sort: equal weights stay in id order, so ties go to the lower id.
    sorted_w, order = w.sort(dim=-1, descending=True, stable=True)
    return torch.zeros_like(w).scatter_(-1, order, _kept(sorted_w, top_k, top_p, None))


def _kept(sorted_w: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
          total: torch.Tensor | None) -> torch.Tensor:
    """Weights in (weight desc, id asc) order, filtered ones zeroed; total (rows, 1): the
    top-k mass when sorted_w is a prefix of the order (None: all of it)."""
    rank = torch.arange(sorted_w.shape[-1], device=sorted_w.device, dtype=sorted_w.dtype)
    sorted_w = sorted_w.masked_fill(rank >= top_k, 0.0)
    cum = sorted_w.cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # mass ahead
    total = cum[:, -1:] if total is None else total
    return sorted_w.masked_fill(~((before < top_p * total) | (top_p >= 1.0)), 0.0)


def _top_k_top_p_candidates(w: torch.Tensor, top_k: torch.Tensor,
                            top_p: torch.Tensor) -> torch.Tensor:
    """top_k_top_p among the c largest weights: exact when a row's kept weights all exceed
    the smallest candidate (all above it are candidates) and its top-k mass is known; other
    rows take the full sort."""
    vocab, c = w.shape[-1], min(_CANDIDATES, w.shape[-1] // 8)
    vals, ids = w.topk(c, dim=-1)  # (rows, c) descending, equal weights in any order
    ids, perm = ids.sort(dim=-1)
    vals, perm = vals.gather(-1, perm).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, perm)  # ties: the lower id first
    head = vals.masked_fill(torch.arange(c, dtype=vals.dtype) >= top_k, 0.0).cumsum(-1)
    total = torch.where(top_k >= vocab, w.sum(-1, keepdim=True),
                        head.gather(-1, (top_k.clamp(max=c) - 1).long()))
    kept = _kept(vals, top_k, top_p, total)
    last = vals.gather(-1, (kept > 0).sum(-1, keepdim=True) - 1)
    off = (top_k >= vocab) & (top_p >= 1.0)
    exact = off | (((top_k <= c) | (top_k >= vocab)) & (last > vals[:, -1:]))
    out = torch.where(off, w, torch.zeros_like(w).scatter_(-1, ids, kept))
    redo = (~exact).squeeze(-1).nonzero().squeeze(-1)
    if redo.numel():
        out[redo] = top_k_top_p(w[redo], top_k[redo], top_p[redo], full_sort=True)
    return out
