"""RoPE on q and k and the K/V store of a step in one launch (the decoder's attention input).

`rope_qk_store` is `rope_qk` (kernels/fused_rope.py: q and k rotated, after their per-head
RMSNorm when weights are given) followed by `kv_store` (kernels/kv_store.py: the rotated k
and v encoded into the KV planes at the step's slots), with the same bits as those two
launches: the same helpers run the same operations. It returns only q: k's rotated rows
are read back by the attention from the planes (store-then-read,
engine/layers/attention.py).

Programs (t, h): h < H rotates q head h of token t; h = H rotates token t's KVH k heads
into a scratch row, then encodes that row into the K planes (the program's own stores,
read back after a barrier); h = H + 1 encodes token t's v. A decode step's kernel count
drops by one a layer.
"""

from __future__ import annotations

import torch

from engine.errors import InvalidRequest
from kernels.fused_rope import _check, rope_qk_reference
from kernels.kv_store import FORMAT_CODES, _planes, kv_store_reference
from kernels.triton_util import (
    HAS_TRITON,
    await_inputs,
    interpreter_active,
    jit,
    launcher,
    next_pow2,
    tl,
)

__all__ = ["rope_qk_store", "rope_qk_store_reference"]


def rope_qk_store_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cos: torch.Tensor, sin: torch.Tensor, neox: bool,
                            slots: torch.Tensor, k_planes: dict[str, torch.Tensor],
                            v_planes: dict[str, torch.Tensor], k_format: str, v_format: str,
                            q_weight: torch.Tensor | None = None,
                            k_weight: torch.Tensor | None = None,
                            eps: float = 1e-6) -> torch.Tensor:
    """The definition: rope_qk_reference, then kv_store_reference of the rotated k and v."""
    q_out, k_out = rope_qk_reference(q, k, cos, sin, neox, q_weight, k_weight, eps)
    kv_store_reference(k_out, v.float(), slots, k_planes, v_planes, k_format, v_format)
    return q_out


if HAS_TRITON:
    from kernels.fused_rope import _rope_head
    from kernels.kv_store import _encode

    @jit
    def _rope_qk_store_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr, slot_ptr,
        k0_ptr, k1_ptr, v0_ptr, v1_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
        stride_vt, stride_vh, stride_ct, stride_st, eps,
        H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr, HALFP: tl.constexpr,
        NEOX: tl.constexpr, HAS_NORM: tl.constexpr, DV: tl.constexpr, K_FMT: tl.constexpr,
        K_ROT: tl.constexpr, V_FMT: tl.constexpr, V_ROT: tl.constexpr, HP: tl.constexpr,
        DKP: tl.constexpr, DVP: tl.constexpr, RKP: tl.constexpr, RVP: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """Token t (program 0); program 1: a q head, all k heads then their store, or v."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        i = tl.arange(0, HALFP)[None, :]
        await_inputs(PDL)
        if h <= H:
            cos = tl.load(cos_ptr + t * stride_ct + i, mask=i < HALF, other=0.0)  # (1, HALFP)
            sin = tl.load(sin_ptr + t * stride_st + i, mask=i < HALF, other=0.0)
            if h < H:
                _rope_head(q_ptr + t * stride_qt + h * stride_qh,
                           qo_ptr + (t * H + h) * (2 * HALF), cos, sin, qw_ptr, eps, HALF,
                           HALFP, NEOX, HAS_NORM)
            else:
                row = ko_ptr + t * (KVH * 2 * HALF)
                for g in tl.static_range(KVH):
                    _rope_head(k_ptr + t * stride_kt + g * stride_kh, row + g * (2 * HALF),
                               cos, sin, kw_ptr, eps, HALF, HALFP, NEOX, HAS_NORM)
                tl.debug_barrier()  # the row's stores are visible to every thread
                slot = tl.load(slot_ptr + t).to(tl.int64)
                _encode(row, 2 * HALF, slot, k0_ptr, k1_ptr, K_FMT, K_ROT, KVH, 2 * HALF, HP,
                        DKP, RKP)
        else:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            _encode(v_ptr + t * stride_vt, stride_vh, slot, v0_ptr, v1_ptr, V_FMT, V_ROT, KVH,
                    DV, HP, DVP, RVP)


def rope_qk_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, neox: bool, slots: torch.Tensor,
                  k_planes: dict[str, torch.Tensor], v_planes: dict[str, torch.Tensor],
                  k_format: str, v_format: str, q_weight: torch.Tensor | None = None,
                  k_weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """q (T, H, d), k (T, KVH, d), v (T, KVH, dv) float32 (any row and head strides), cos/sin
    (T, d/2) or (T, 1, d/2), slots (T,) distinct -> the contiguous rotated q; the rotated k
    and v stored at `slots` of the planes. One launch on a GPU (or on the CPU when the
    interpreter is active), else the reference."""
    if not (HAS_TRITON and (q.device.type != "cpu" or interpreter_active())):
        return rope_qk_store_reference(q, k, v, cos, sin, neox, slots, k_planes, v_planes,
                                       k_format, v_format, q_weight, k_weight, eps)
    cos, sin = _check(q, k, cos, sin, q_weight, k_weight)
    if v.dim() != 3 or v.shape[:2] != k.shape[:2] or tuple(slots.shape) != (k.shape[0],) \
            or slots.dtype not in (torch.int32, torch.int64):
        raise InvalidRequest(f"rope_qk_store: v (T, KVH, dv) beside k {tuple(k.shape)} and "
                             f"slots (T,) int, got v {tuple(v.shape)}, slots "
                             f"{tuple(slots.shape)} {slots.dtype}")
    (tokens, heads, dim), kv_heads, dim_v = q.shape, k.shape[1], v.shape[2]
    k_rot = torch.empty(tokens, kv_heads, dim, dtype=torch.float32, device=q.device)
    k0, k1 = _planes(k_planes, k_format, k_rot, "K")
    v0, v1 = _planes(v_planes, v_format, v, "V")
    q_out = torch.empty(tokens, heads, dim, dtype=torch.float32, device=q.device)
    if not tokens:
        return q_out
    norm = q_weight is not None
    (k_fmt, k_flag), (v_fmt, v_flag) = FORMAT_CODES[k_format], FORMAT_CODES[v_format]
    launcher(_rope_qk_store_kernel, q.device)[(tokens, heads + 2)](
        q, k, v, cos, sin, q_weight if norm else cos, k_weight if norm else cos, q_out, k_rot,
        slots.to(q.device), k0, k1, v0, v1, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0), float(eps),
        H=heads, KVH=kv_heads, HALF=dim // 2, HALFP=next_pow2(dim // 2), NEOX=bool(neox),
        HAS_NORM=norm, DV=dim_v, K_FMT=k_fmt, K_ROT=k_flag, V_FMT=v_fmt, V_ROT=v_flag,
        HP=next_pow2(kv_heads), DKP=next_pow2(dim), DVP=next_pow2(dim_v),
        RKP=next_pow2(kv_heads * dim // 32), RVP=next_pow2(kv_heads * dim_v // 32),
        num_warps=4)
    return q_out


def aot_specs(spec: type) -> list:
    """kernels/aot.py: Llama 3 8B (32/8 heads of 128, original layout) with f16 and q8 KV,
    and Qwen3-like (neox with q/k norm, 16/8 heads of 128) with q8 K and q4 V."""
    if not HAS_TRITON:
        return []
    plane = {0: "*fp16", 1: "*i8", 2: "*u8"}
    out = []
    for name, heads, neox, norm, k_fmt, v_fmt in (
            ("llama_f16", 32, False, False, "f16", "f16"),
            ("llama_q8", 32, False, False, "q8", "q8"),
            ("qk_norm_k8v4", 16, True, True, "q8", "q4")):
        (kf, kr), (vf, vr) = FORMAT_CODES[k_fmt], FORMAT_CODES[v_fmt]
        consts = {"H": heads, "KVH": 8, "HALF": 64, "HALFP": 64, "NEOX": neox,
                  "HAS_NORM": norm, "DV": 128, "K_FMT": kf, "K_ROT": kr, "V_FMT": vf,
                  "V_ROT": vr, "HP": 8, "DKP": 128, "DVP": 128, "RKP": 32, "RVP": 32}
        sig = {**{n: "*fp32" for n in ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr",
                                       "qw_ptr", "kw_ptr", "qo_ptr", "ko_ptr")},
               "slot_ptr": "*i64", "k0_ptr": plane[kf], "k1_ptr": "*fp16",
               "v0_ptr": plane[vf], "v1_ptr": "*fp16",
               **{n: "i32" for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh",
                                     "stride_vt", "stride_vh", "stride_ct", "stride_st")},
               "eps": "fp32", **{k: "constexpr" for k in consts}}
        out.append(spec(f"rope_qk_store_{name}", _rope_qk_store_kernel, sig, consts, 4, False))
    return out
