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
and the output once after (engine/kv/hadamard.py), never a key or a value.

Work items (kernels/paged_attention_plan.py) are a block of query tokens of one row (all
query heads of one KV head, GQA packed into the MMA's M side) times a range of key
positions. Rows of one query block (decode, verify) have their keys cut into fixed,
position-aligned splits (flash-decoding), so a long context still fills the GPU. Items
write unnormalized partials (max, sum, acc); a second kernel merges each token's splits in
split order and applies the sinks. Nothing depends on the other rows, so a row's output
is bit-equal whatever else is in the batch. Dots take f16 operands, accumulate in f32.
"""

from __future__ import annotations

import functools
import itertools

import torch

from engine.errors import InvalidRequest
from kernels.paged_attention_plan import FORMAT_IDS, AttnConfig, AttnPlan, plan_attention
from kernels.triton_util import (
    HAS_TRITON,
    helper,
    interpreter_active,
    jit,
    launcher,
    next_pow2,
    tl,
)

__all__ = ["AttnConfig", "AttnPlan", "paged_attention", "paged_attention_reference",
           "plan_attention"]

_LOG2E = 1.4426950408889634
_PLANES = {"f16": {"data": (torch.float16, 1)},
           "q8": {"codes": (torch.int8, 1), "scales": (torch.float16, 32)},
           "q4": {"codes": (torch.uint8, 2), "scales": (torch.float16, 32)}}


@functools.lru_cache(maxsize=8)
def hadamard32(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(32, 32) normalized Sylvester Hadamard matrix (symmetric, its own inverse)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 32:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / 32**0.5).to(device=device, dtype=dtype)


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """(..., d) -> every 32-block of the last dim times H, in x's float precision."""
    x = x if x.dtype == torch.float64 else x.float()
    h = hadamard32(x.device, x.dtype)
    return (x.reshape(*x.shape[:-1], -1, 32) @ h).reshape(x.shape)


def _decode64(planes: dict[str, torch.Tensor], fmt: str, slots: torch.Tensor) -> torch.Tensor:
    """Planes at `slots` (n,) -> (n, kv_heads, dim) float64, rotated back where stored so."""
    if fmt.startswith("f16"):
        return planes["data"][slots].double()
    scales = planes["scales"][slots].double()  # (n, h, nb)
    codes = planes["codes"][slots]
    if fmt.startswith("q4"):  # byte j: element 2j low nibble, 2j + 1 high, stored as code + 8
        codes = torch.stack([codes & 15, codes >> 4], -1).flatten(-2).double() - 8
    x = codes.double().reshape(*scales.shape, 32) * scales[..., None]
    x = _rotate(x.flatten(-2)) if fmt in ("q8", "q4") else x.flatten(-2)
    return x


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


if HAS_TRITON:

    @helper
    def _load_kv(p0, p1, slot, kvh, FMT: tl.constexpr, KVH: tl.constexpr, DIM: tl.constexpr,
                 DP: tl.constexpr, BN: tl.constexpr):
        """(BN, DP) f16 rows at `slot` (BN,) of KV head kvh; columns >= DIM are zero.

        Offsets stay int32 (the wrapper checks the plane sizes) so that AMD can use buffer
        loads; a scale is loaded once per 32-block and broadcast.
        """
        if FMT == 0:
            d = tl.arange(0, DP)
            row = (slot * (KVH * DIM) + kvh * DIM)[:, None]
            x = tl.load(p0 + row + d[None, :], mask=(d < DIM)[None, :], other=0.0)
        else:
            nb = DIM // 32
            b = tl.arange(0, DP // 32)
            b_ok = (b < nb)[None, :]
            sc = tl.load(p1 + (slot * (KVH * nb) + kvh * nb)[:, None] + b[None, :], mask=b_ok,
                         other=0.0).to(tl.float32)  # (BN, NB)
            if FMT == 1:
                row = (slot * (KVH * DIM) + kvh * DIM)[:, None, None]
                e = tl.arange(0, 32)[None, None, :]
                c = tl.load(p0 + row + (b * 32)[None, :, None] + e, mask=b_ok[:, :, None],
                            other=0).to(tl.float32)  # (BN, NB, 32)
            else:  # byte j of a block: element 2j in the low nibble, 2j + 1 in the high
                row = (slot * (KVH * DIM // 2) + kvh * (DIM // 2))[:, None, None]
                j = tl.arange(0, 16)[None, None, :]
                byte = tl.load(p0 + row + (b * 16)[None, :, None] + j, mask=b_ok[:, :, None],
                               other=0)
                c = tl.join(byte & 15, byte >> 4).to(tl.float32) - 8.0  # (BN, NB, 16, 2)
                c = tl.reshape(c, (BN, DP // 32, 32))
            x = tl.reshape(c * sc[:, :, None], (BN, DP))
        return x.to(tl.float16)

    @jit
    def _attn_partial_kernel(
        q_ptr, k0_ptr, k1_ptr, v0_ptr, v1_ptr, pt_ptr, pos_ptr, work_ptr, tok_base_ptr,
        m_ptr, l_ptr, acc_ptr, stride_qt, stride_qh, stride_pt, qk_scale, softcap, window,
        K_FMT: tl.constexpr, V_FMT: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr,
        D: tl.constexpr, DV: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
        PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """Partials of one work item (program 0) and KV head (program 1); base-2 logits."""
        item = work_ptr + tl.program_id(0) * 6
        kvh = tl.program_id(1)
        row, q_begin, q_count = tl.load(item), tl.load(item + 1), tl.load(item + 2)
        key_lo, key_hi, split = tl.load(item + 3), tl.load(item + 4), tl.load(item + 5)
        r = tl.arange(0, BLOCK_M)
        ok = (r // G < q_count) & (r // G < BLOCK_M // G)  # row r: token r // G, head r % G
        t = q_begin + tl.where(ok, r // G, 0)
        h = kvh * G + r % G
        d = tl.arange(0, DP)
        q = tl.load(q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                    mask=ok[:, None] & (d < D)[None, :], other=0.0).to(tl.float16)
        pos = tl.load(pos_ptr + t, mask=ok, other=-1)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
        acc = tl.full((BLOCK_M, DVP), 0.0, tl.float32)
        for start in range(key_lo, key_hi, BLOCK_N):
            kp = start + tl.arange(0, BLOCK_N)
            k_ok = kp < key_hi
            page = tl.load(pt_ptr + row * stride_pt + kp // PAGE, mask=k_ok, other=0)
            slot = page * PAGE + kp % PAGE  # int32, see _load_kv
            k = _load_kv(k0_ptr, k1_ptr, slot, kvh, K_FMT, KVH, D, DP, BLOCK_N)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # (BM, BN) in log2 units
            if HAS_SOFTCAP:  # c * tanh(s / c), tanh(x) = 1 - 2 / (exp(2x) + 1)
                c = softcap * 1.4426950408889634
                s = c * (1.0 - 2.0 / (tl.exp(2.0 * s / c) + 1.0))
            vis = (kp[None, :] <= pos[:, None]) & k_ok[None, :]
            if HAS_WINDOW:
                vis = vis & (pos[:, None] - kp[None, :] < window)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_kv(v0_ptr, v1_ptr, slot, kvh, V_FMT, KVH, DV, DVP, BLOCK_N)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
            m_i = m_new
        out = (tl.load(tok_base_ptr + t, mask=ok, other=0) + split).to(tl.int64) * (KVH * G) + h
        tl.store(m_ptr + out, m_i, mask=ok)
        tl.store(l_ptr + out, l_i, mask=ok)
        dv = tl.arange(0, DVP)
        tl.store(acc_ptr + out[:, None] * DV + dv[None, :], acc,
                 mask=ok[:, None] & (dv < DV)[None, :])

    @jit
    def _attn_merge_kernel(
        m_ptr, l_ptr, acc_ptr, tok_base_ptr, tok_splits_ptr, sink_ptr, out_ptr, num_tokens,
        H: tl.constexpr, HP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
        HAS_SINKS: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        """out[t] = merge of token t's splits in split order, for BLOCK_T tokens."""
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < num_tokens
        base = tl.load(tok_base_ptr + t, mask=t_ok, other=0).to(tl.int64)
        num = tl.load(tok_splits_ptr + t, mask=t_ok, other=0)
        h = tl.arange(0, HP)
        dv = tl.arange(0, DVP)[None, None, :]
        mx = tl.full((BLOCK_T, HP), float("-inf"), tl.float32)
        for s in range(0, tl.max(num, 0)):
            idx = (base + s)[:, None] * H + h[None, :]  # (BT, HP) partial row
            live = (s < num)[:, None] & (h < H)[None, :]
            mx = tl.maximum(mx, tl.load(m_ptr + idx, mask=live, other=float("-inf")))
        if HAS_SINKS:  # sink logits arrive in log2 units
            sink = tl.load(sink_ptr + h, mask=h < H, other=float("-inf"))[None, :]
            mx = tl.maximum(mx, sink)
        mx = tl.where(mx == float("-inf"), 0.0, mx)  # padding only: a query sees itself
        den = tl.full((BLOCK_T, HP), 0.0, tl.float32)
        acc = tl.full((BLOCK_T, HP, DVP), 0.0, tl.float32)
        for s in range(0, tl.max(num, 0)):
            idx = (base + s)[:, None] * H + h[None, :]
            live = (s < num)[:, None] & (h < H)[None, :]
            w = tl.exp2(tl.load(m_ptr + idx, mask=live, other=float("-inf")) - mx)
            den += tl.load(l_ptr + idx, mask=live, other=0.0) * w
            a = tl.load(acc_ptr + idx[:, :, None] * DV + dv, mask=live[:, :, None] & (dv < DV),
                        other=0.0)
            acc += a * w[:, :, None]
        if HAS_SINKS:
            den += tl.exp2(sink - mx)
        ok = t_ok[:, None] & (h < H)[None, :]
        den = tl.where(ok, den, 1.0)
        out = (t.to(tl.int64)[:, None] * H + h[None, :])[:, :, None] * DV + dv
        tl.store(out_ptr + out, acc / den[:, :, None], mask=ok[:, :, None] & (dv < DV))

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
) -> torch.Tensor:
    """q (T, H, D) -> (T, H * Dv) float32.

    Runs the kernels on a GPU (or on the CPU when the interpreter is active), else the
    reference. `plan` (plan_attention, built from the host copies of query_start and
    seq_lens) may be shared by every layer of a step with the same window and config.
    """
    kwargs = dict(query_start=query_start, seq_lens=seq_lens, positions=positions,
                  page_table=page_table, page_size=page_size, scale=scale, window=window,
                  softcap=softcap, sinks=sinks)
    if not (HAS_TRITON and (q.device.type != "cpu" or interpreter_active())):
        return paged_attention_reference(q, k_planes, v_planes, k_format, v_format,
                                         **kwargs).float()
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
    if k_format in ("q8", "q4"):
        q = _rotate(q)
    out = torch.empty(num_tokens, num_heads, dim_v, dtype=torch.float32, device=q.device)
    if num_tokens:
        _launch(q, (k0, k1, v0, v1), (FORMAT_IDS[k_format], FORMAT_IDS[v_format]), positions,
                page_table, page_size, (scale, window, softcap), sinks, plan, cfg, out)
    if v_format in ("q8", "q4"):
        out = _rotate(out)
    return out.reshape(num_tokens, num_heads * dim_v)


def _launch(q, planes, formats, positions, page_table, page_size, params, sinks, plan, cfg,
            out) -> None:
    """Both kernels; partial buffers are (slots, H) and (slots, H, Dv) float32."""
    (num_tokens, num_heads, dim), dim_v, dev = q.shape, out.shape[2], q.device
    kv_heads = planes[0].shape[1]
    scale, window, softcap = params
    m_part = torch.empty(plan.num_slots, num_heads, dtype=torch.float32, device=dev)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(plan.num_slots, num_heads, dim_v, dtype=torch.float32, device=dev)
    table = page_table.to(device=dev, dtype=torch.int32).contiguous()
    launcher(_attn_partial_kernel, dev)[(plan.work.shape[0], kv_heads)](
        q, *planes, table, positions.to(device=dev, dtype=torch.int32), plan.work,
        plan.tok_base, m_part, l_part, acc_part, q.stride(0), q.stride(1), table.stride(0),
        scale * _LOG2E, float(softcap or 1.0), int(window or 0),
        K_FMT=formats[0], V_FMT=formats[1], KVH=kv_heads, G=num_heads // kv_heads, D=dim,
        DV=dim_v, DP=next_pow2(dim), DVP=next_pow2(dim_v), PAGE=page_size,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        **({} if cfg.num_stages is None else {"num_stages": cfg.num_stages}),
    )
    sink = m_part if sinks is None else (sinks.float() * _LOG2E).contiguous()
    # One token per program on a GPU (its (H, Dv) accumulator fills the registers); the
    # interpreter pays per program, so it takes many.
    block_t = 16 if dev.type == "cpu" else 1
    launcher(_attn_merge_kernel, dev)[(-(-num_tokens // block_t),)](
        m_part, l_part, acc_part, plan.tok_base, plan.tok_splits, sink, out, num_tokens,
        H=num_heads, HP=next_pow2(num_heads), DV=dim_v, DVP=next_pow2(dim_v),
        HAS_SINKS=sinks is not None, BLOCK_T=block_t,
    )


def aot_specs(spec: type) -> list:
    """kernels/aot.py: every K/V format pair's loader at Llama-like shapes (GQA 4:1,
    head dim 128), one with window and softcap; the merge with and without sinks."""
    if not HAS_TRITON:
        return []
    plane = {"f16": "*fp16", "q8": "*i8", "q4": "*u8"}
    sig = {"q_ptr": "*fp32", "k0_ptr": "", "k1_ptr": "*fp16", "v0_ptr": "", "v1_ptr": "*fp16",
           **{n: "*i32" for n in ("pt_ptr", "pos_ptr", "work_ptr", "tok_base_ptr")},
           **{n: "*fp32" for n in ("m_ptr", "l_ptr", "acc_ptr")},
           "stride_qt": "i32", "stride_qh": "i32", "stride_pt": "i32", "qk_scale": "fp32",
           "softcap": "fp32", "window": "i32"}
    out = []
    for (k_fmt, v_fmt, extras), backend in itertools.product(
            (("f16", "f16", False), ("q8", "q8", True), ("q4", "q4", False),
             ("q8", "q4", False)), ("hip", "cuda")):
        cfg = AttnConfig.default(4, 128, 128, backend)
        consts = {"K_FMT": FORMAT_IDS[k_fmt], "V_FMT": FORMAT_IDS[v_fmt], "KVH": 8, "G": 4,
                  "D": 128, "DV": 128, "DP": 128, "DVP": 128, "PAGE": 16,
                  "HAS_WINDOW": extras, "HAS_SOFTCAP": extras, "BLOCK_M": cfg.block_m,
                  "BLOCK_N": cfg.block_n}
        signature = {**sig, "k0_ptr": plane[k_fmt], "v0_ptr": plane[v_fmt],
                     **{k: "constexpr" for k in consts}}
        name = f"paged_attention_k{k_fmt}_v{v_fmt}" + ("_window_softcap" if extras else "")
        out.append(spec(name, _attn_partial_kernel, signature, consts, cfg.num_warps, True,
                        backend, cfg.num_stages))
    for sinks in (False, True):
        consts = {"H": 32, "HP": 32, "DV": 128, "DVP": 128, "HAS_SINKS": sinks, "BLOCK_T": 1}
        signature = {**{n: "*fp32" for n in ("m_ptr", "l_ptr", "acc_ptr")},
                     "tok_base_ptr": "*i32", "tok_splits_ptr": "*i32", "sink_ptr": "*fp32",
                     "out_ptr": "*fp32", "num_tokens": "i32", **{k: "constexpr" for k in consts}}
        out.append(spec(f"paged_attention_merge{'_sinks' if sinks else ''}", _attn_merge_kernel,
                        signature, consts, 4, False))
    return out
