"""Paged attention over the f16/q8/q4 KV planes: every row of a batch in one launch.

Rows are prefill chunks, decode rows and verify rows alike: row r's new tokens are
`q[query_start[r]:query_start[r + 1]]` at `positions`, and a query at position p sees the
keys at positions (p - window, p] of its row's pages (`page_table[r]`, slot = page *
page_size + offset), which already hold this step's keys (store-then-read, as in
engine/layers/attention.py). Scores are `scale * q.k`, soft-capped to
`softcap * tanh(s / softcap)` when asked; a head's sink logit (gpt-oss) joins the softmax
denominator and contributes no value. K and V planes are engine/kv/formats.py's and are
dequantized inside the kernel. q8/q4 store Hadamard-rotated 32-blocks: since
q . (H k') = (H q) . k' and sum p (H v') = H sum p v', q is rotated once before the kernel
(by kernels/fused_rope.py as it stores the K, `q_rotated`, else by kernels/rotate.py's
exact launch: a GPU matmul's bits may depend on its row count) and the output by the
kernel that stores it (engine/kv/hadamard.py), never a key or a value.
The kernels, their launch and AOT specs are in kernels/paged_attention_triton.py.

Work items (kernels/paged_attention_plan.py) are a block of query tokens of one row (all
query heads of one KV head, GQA packed into the MMA's M side) times a range of key
positions. Rows of one query block (decode, verify) have their keys cut into fixed,
position-aligned splits (flash-decoding), so a long context still fills the GPU. Items
write unnormalized partials (max, sum, acc); a second kernel merges each token's splits
(per head, in an order fixed by their count) and applies the sinks. Nothing depends on the
other rows, so a row's output is bit-equal whatever else is in the batch. A plan may also
hold one-token rows' items apart (`decode_work`, plan_attention's `decode_keys`): they run
in a second launch with the decode config (AttnConfig.decode), as in a decode-only step,
into the same partial slots. Dots take f16 operands, accumulate in f32.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.errors import InvalidRequest
from engine.kv.hadamard import rotate_blocks
from kernels.kv_store import FORMAT_CODES
from kernels.paged_attention_plan import FORMAT_IDS, AttnConfig, AttnPlan, plan_attention
from kernels.paged_attention_triton import MERGE_HEADS, aot_specs, launch
from kernels.quant_x import QK, QuantX, empty_quant_x
from kernels.rotate import rotate, rotate_exact
from kernels.triton_util import kernels_run

# formats that store K or V blocks times H (the K/V store's table says which)
ROTATED = frozenset(name for name, (_, rotated) in FORMAT_CODES.items() if rotated)

# aot_specs: kernels/aot.py collects every module's specs from here.
__all__ = ["AttnConfig", "AttnPlan", "aot_specs", "paged_attention", "paged_attention_q8",
           "paged_attention_reference",
           "plan_attention"]

_PLANES = {"f16": {"data": (torch.float16, 1)},
           "q8": {"codes": (torch.int8, 1), "scales": (torch.float16, 32)},
           "q4": {"codes": (torch.uint8, 2), "scales": (torch.float16, 32)}}


def _decode64(planes: dict[str, torch.Tensor], fmt: str, slots: torch.Tensor) -> torch.Tensor:
    """Planes at `slots` (n,) -> (n, kv_heads, dim) float64, rotated back where stored so."""
    if fmt.startswith("f16"):
        return planes["data"][slots].double()
    scales = planes["scales"][slots].double()  # (n, h, nb)
    codes = planes["codes"][slots]
    if fmt.startswith("q4"):  # byte j: element 2j low nibble, 2j + 1 high, stored as code + 8
        codes = torch.stack([codes & 15, codes >> 4], -1).flatten(-2).double() - 8
    x = codes.double().reshape(*scales.shape, 32) * scales[..., None]
    return (rotate_blocks(x) if fmt in ("q8", "q4") else x).flatten(-2)


def paged_attention_reference(
    q: torch.Tensor, k_planes: dict[str, torch.Tensor], v_planes: dict[str, torch.Tensor],
    k_format: str, v_format: str, *, query_start: torch.Tensor, seq_lens: torch.Tensor,
    positions: torch.Tensor, page_table: torch.Tensor, page_size: int, scale: float,
    window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The definition, in float64: q (T, H, D) -> (T, H * Dv)."""
    num_tokens, num_heads, dim = q.shape
    starts, lens = query_start.tolist(), seq_lens.tolist()
    out = []
    for row in range(len(lens)):
        qs, qe = starts[row], starts[row + 1]
        if qe == qs:
            continue
        q_pos = positions[qs:qe].long().cpu()  # (ql,)
        lo = 0 if window is None else max(0, int(q_pos.min()) - window + 1)
        k_pos = torch.arange(lo, lens[row])  # (L,)
        pages = page_table[row].long().cpu()[k_pos // page_size]
        slots = (pages * page_size + k_pos % page_size).to(q.device)
        keys = _decode64(k_planes, k_format, slots)  # (L, KVH, D)
        values = _decode64(v_planes, v_format, slots)  # (L, KVH, Dv)
        group = num_heads // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe].double(), keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        visible = (k_pos[None, :] <= q_pos[:, None]).to(q.device)
        if window is not None:
            visible &= ((q_pos[:, None] - k_pos[None, :]) < window).to(q.device)
        scores = scores.masked_fill(~visible, float("-inf"))  # (H, ql, L)
        if sinks is not None:  # one more logit per head, with no value behind it
            sink = sinks.double().view(-1, 1, 1).expand(-1, qe - qs, 1)
            scores = torch.cat([scores, sink], -1)
        probs = torch.softmax(scores, -1)[..., : len(k_pos)]
        out.append(torch.einsum("hqk,khd->qhd", probs, values).reshape(qe - qs, -1))
    if not out:
        return torch.empty(0, num_heads * v_planes_dim(v_planes, v_format), dtype=torch.float64)
    return torch.cat(out)


def v_planes_dim(planes: dict[str, torch.Tensor], fmt: str) -> int:
    """Head dim stored in a format's planes."""
    first = planes["data" if fmt.startswith("f16") else "codes"]
    return first.shape[-1] * (2 if fmt.startswith("q4") else 1)


def _planes(planes: dict[str, torch.Tensor], fmt: str, dim: int, kv_heads: int,
            device: torch.device, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (first, last) plane tensors the kernel reads, after checking them."""
    want = _PLANES.get(fmt.removesuffix("_plain")) if fmt in FORMAT_IDS else None
    if want is None or dim % 32:
        raise InvalidRequest(f"paged_attention: {what} format {fmt!r}, head dim {dim}")
    tensors = []
    for name, (dtype, per) in want.items():
        p = planes.get(name)
        shape = (kv_heads, dim // per)
        if p is None or p.dtype != dtype or p.dim() != 3 or tuple(p.shape[1:]) != shape:
            got = None if p is None else (p.dtype, tuple(p.shape))
            raise InvalidRequest(f"paged_attention: {what} plane {name!r} must be {dtype} "
                                 f"(slots, *{shape}), got {got}")
        if not p.is_contiguous() or p.device != device or p.numel() >= 2**31:
            raise InvalidRequest(f"paged_attention: {what} plane {name!r} must be contiguous "
                                 f"on {device}, under 2**31 elements (int32 offsets)")
        tensors.append(p)
    if tensors[0].shape[0] != tensors[-1].shape[0]:
        raise InvalidRequest(f"paged_attention: {what} planes differ in slot count")
    return tensors[0], tensors[-1]


def paged_attention(
    q: torch.Tensor,
    k_planes: dict[str, torch.Tensor],
    v_planes: dict[str, torch.Tensor],
    k_format: str,
    v_format: str,
    *,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    plan: AttnPlan | None = None,
    config: AttnConfig | None = None,
    q_rotated: bool = False,
) -> torch.Tensor:
    """q (T, H, D) -> (T, H * Dv) float32.

    Runs the kernels on a GPU (or on the CPU when the interpreter is active), else the
    reference. `plan` (plan_attention, built from the host copies of query_start and
    seq_lens) may be shared by every layer of a step with the same window and config.
    `q_rotated`: q's 32-blocks are times H already (kernels/fused_rope.py rotates q as it
    stores a rotated K), so a rotated K needs no rotation launch here.
    """
    return _attention(q, k_planes, v_planes, k_format, v_format, False, query_start=query_start,
                      seq_lens=seq_lens, positions=positions, page_table=page_table,
                      page_size=page_size, scale=scale, window=window, softcap=softcap,
                      sinks=sinks, plan=plan, config=config, q_rotated=q_rotated)[0]


def paged_attention_q8(q: torch.Tensor, k_planes: dict[str, torch.Tensor],
                       v_planes: dict[str, torch.Tensor], k_format: str, v_format: str,
                       **kwargs: Any) -> tuple[torch.Tensor, QuantX | None]:
    """paged_attention's output, and it quantized for a q8 product (kernels/quant_x.py's
    quantize_x bits) by the kernel that writes it, where it can: the kernels run and each
    KV head's query heads hold whole 256-column super-blocks (G Dv a multiple of 256); else
    None (the product quantizes for itself). No launch of its own."""
    return _attention(q, k_planes, v_planes, k_format, v_format, True, **kwargs)


def _attention(q: torch.Tensor, k_planes: dict[str, torch.Tensor],
               v_planes: dict[str, torch.Tensor], k_format: str, v_format: str,
               quantize: bool, plan: AttnPlan | None = None, config: AttnConfig | None = None,
               q_rotated: bool = False, **kwargs: Any) -> tuple[torch.Tensor, QuantX | None]:
    """paged_attention (kwargs: its query_start .. sinks), and with `quantize` the output
    quantized where it can be (paged_attention_q8)."""
    names = ("query_start", "seq_lens", "positions", "page_table", "page_size", "scale",
             "window", "softcap", "sinks")
    kwargs = {"window": None, "softcap": None, "sinks": None, **kwargs}
    if set(kwargs) != set(names):
        raise TypeError(f"paged_attention: arguments {sorted(set(kwargs) ^ set(names))} "
                        "missing or unknown")
    query_start, seq_lens, positions, page_table, page_size, scale, window, softcap, sinks = (
        kwargs[k] for k in names)
    rotated_q = q_rotated and k_format in ROTATED  # q in the stored K's basis
    if not kernels_run(q.device):
        if rotated_q:  # the reference reads K rotated back: q too (H is its own inverse)
            q = rotate_exact(q)
        return paged_attention_reference(q, k_planes, v_planes, k_format, v_format,
                                         **kwargs).float(), None
    if q.dim() != 3 or q.stride(-1) != 1 or not q.dtype.is_floating_point:
        raise InvalidRequest(f"paged_attention: q must be (T, H, D) float, last dim "
                             f"contiguous, got {q.dtype} {tuple(q.shape)}")
    num_tokens, num_heads, dim = q.shape
    kv_heads = next(iter(k_planes.values())).shape[1]
    dim_v = v_planes_dim(v_planes, v_format)
    k0, k1 = _planes(k_planes, k_format, dim, kv_heads, q.device, "K")
    v0, v1 = _planes(v_planes, v_format, dim_v, kv_heads, q.device, "V")
    if num_heads % kv_heads or (sinks is not None and tuple(sinks.shape) != (num_heads,)):
        raise InvalidRequest(f"paged_attention: {num_heads} heads, {kv_heads} KV heads, "
                             f"sinks {None if sinks is None else tuple(sinks.shape)}")
    group = num_heads // kv_heads
    backend = "hip" if q.device.type == "cuda" and torch.version.hip else "cuda"
    cfg = config or AttnConfig.default(group, dim, dim_v, backend)
    if plan is None:
        plan = plan_attention(query_start, seq_lens, group=group, window=window, config=cfg,
                              device=q.device)
    if plan.num_tokens != num_tokens:
        raise InvalidRequest(f"paged_attention: plan has {plan.num_tokens} tokens, q {num_tokens}")
    if k_format in ROTATED and not rotated_q:
        q = rotate(q)
    out = torch.empty(num_tokens, num_heads, dim_v, dtype=torch.float32, device=q.device)
    xq = None
    # whole 256-column blocks in every program that writes out: a KV head's query heads
    # (the partial kernel) and MERGE_HEADS heads (the merge on a GPU)
    if quantize and (group * dim_v) % QK == 0 and (MERGE_HEADS * dim_v) % QK == 0:
        xq = empty_quant_x(num_tokens, num_heads * dim_v, q.device)
    if num_tokens:
        decode_cfg = (AttnConfig.decode(group, dim, dim_v, backend)
                      if plan.decode_work is not None else None)
        launch(q, (k0, k1, v0, v1), (FORMAT_IDS[k_format], FORMAT_IDS[v_format]), positions,
               page_table, page_size, (scale, window, softcap), sinks, plan, cfg, out, xq,
               decode_cfg, v_format in ROTATED)
    return out.reshape(num_tokens, num_heads * dim_v), xq
