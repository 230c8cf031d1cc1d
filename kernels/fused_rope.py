"""RoPE on q and k in one launch, optionally after their per-head RMSNorm (Qwen3, Gemma 3).

For each token t and head, with cos/sin (T, d/2) of the token's position (engine/layers/
rope.py's Rope.cos_sin, computed once per step and shared by every layer):

    x  = rmsnorm(x) * w                       (only with q/k norm weights, over the head)
    x0, x1 = the pairs (x[i], x[i + d/2]) (neox) or (x[2i], x[2i + 1]) (original layout)
    out0 = x0 cos - x1 sin,  out1 = x0 sin + x1 cos

One program per (token, head) rotates one q or k head (GQA: fewer k heads), reading q and
k in place from the fused qkv projection (any row and head
strides) and writing new contiguous (T, heads, d) tensors. Float32 throughout.

With the K/V store into a rotated K format (q8, q4: each 32-block stored times the Hadamard
matrix H), the q heads come out rotated too, in the basis the attention multiplies them
with the stored K (kernels/paged_attention.py's `q_rotated`): kernels/rotate.py's
butterfly on the roped float32 head, read back after the program's barrier, the bits of
`rotate_exact`; the attention's own rotation launch is saved.

`rope_cos_sin` makes a step's cos/sin in one launch (torch takes four: the positions'
conversion, the product with the frequencies, cos, sin), with torch's float32 operations:
the angle pos * inv_freq rounded once, then tl.cos / tl.sin, which lower to the math
library's fully range-reduced cosf / sinf (libdevice on NVIDIA, as torch's CUDA kernels
call them, no approximate instruction; ocml on ROCm).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.errors import InvalidRequest
from kernels.kv_store import FORMAT_CODES, kv_store, store_args
from kernels.rotate import rotate_exact
from kernels.triton_util import (
    HAS_TRITON,
    await_inputs,
    helper,
    jit,
    kernels_run,
    launcher,
    next_pow2,
    tl,
)

__all__ = ["KVStore", "q_rotates", "rope_cos_sin", "rope_cos_sin_reference", "rope_qk",
           "rope_qk_reference"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x (T, heads, d), cos/sin (T, 1, d/2) -> rotated (T, heads, d)."""
    half = x.shape[-1] // 2
    if neox:
        x0, x1 = x[..., :half], x[..., half:]
        return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def rope_qk_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      neox: bool, q_weight: torch.Tensor | None = None,
                      k_weight: torch.Tensor | None = None,
                      eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, d), k (T, KVH, d), cos/sin (T, d/2) or (T, 1, d/2) -> rotated q, k."""
    cos, sin = (c.reshape(c.shape[0], 1, -1) for c in (cos, sin))
    out = []
    for x, w in ((q, q_weight), (k, k_weight)):
        x = x.float()
        if w is not None:
            x = F.rms_norm(x, (x.shape[-1],), w, eps)
        out.append(_rotate(x, cos, sin, neox))
    return out[0], out[1]


def rope_cos_sin_reference(positions: torch.Tensor,
                           inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (T,) int, inv_freq (d/2,) float32 -> cos, sin (T, 1, d/2) float32."""
    angles = positions.to(torch.float32)[:, None] * inv_freq
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


if HAS_TRITON:
    @jit
    def _cos_sin_kernel(pos_ptr, inv_ptr, out_ptr, tokens, stride_pos, HALF: tl.constexpr,
                        HALFP: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr = False):
        """Tokens [BLOCK_T j, BLOCK_T (j + 1)): out[t, 0] = cos, out[t, 1] = sin of
        pos[t * stride_pos] * inv (out (T, 2, HALF))."""
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        i = tl.arange(0, HALFP)
        inv = tl.load(inv_ptr + i, mask=i < HALF, other=0.0)
        await_inputs(PDL)
        pos = tl.load(pos_ptr + t.to(tl.int64) * stride_pos, mask=t < tokens,
                      other=0).to(tl.float32)
        angle = pos[:, None] * inv[None, :]
        ok = (t < tokens)[:, None] & (i < HALF)[None, :]
        at = out_ptr + t.to(tl.int64)[:, None] * (2 * HALF) + i[None, :]
        tl.store(at, tl.cos(angle), mask=ok)
        tl.store(at + HALF, tl.sin(angle), mask=ok)

    from kernels.kv_store import _encode
    from kernels.rotate import hadamard_blocks

    @helper
    def _rotate_head(x_ptr, NB: tl.constexpr, NBP: tl.constexpr):
        """The NB 32-blocks at x_ptr (this program's own writes) times H, in place."""
        tl.debug_barrier()  # the program's writes of the head, visible to all its threads
        r = tl.arange(0, NBP)[:, None]
        at = x_ptr + r * 32 + tl.arange(0, 32)[None, :]
        b = tl.load(at, mask=r < NB, other=0.0)
        # every thread has read the head before any overwrites it (a small head is held
        # by several threads at once, and a warp may run ahead of another)
        tl.debug_barrier()
        tl.store(at, hadamard_blocks(b, NBP), mask=r < NB)

    @helper
    def _rope_head(src, dst, cos, sin, w_ptr, eps, HALF: tl.constexpr, HALFP: tl.constexpr,
                   NEOX: tl.constexpr, HAS_NORM: tl.constexpr):
        """One head of one token: src (2 HALF values) -> dst, with cos/sin (1, HALFP)."""
        i = tl.arange(0, HALFP)[None, :]
        ok = i < HALF
        if NEOX:
            i0, i1 = i, i + HALF
        else:
            i0, i1 = 2 * i, 2 * i + 1
        x0 = tl.load(src + i0, mask=ok, other=0.0)
        x1 = tl.load(src + i1, mask=ok, other=0.0)
        if HAS_NORM:  # over the head's 2 HALF elements
            inv = tl.rsqrt((tl.sum(x0 * x0, 1) + tl.sum(x1 * x1, 1)) / (2 * HALF) + eps)
            x0 = x0 * inv[:, None] * tl.load(w_ptr + i0, mask=ok, other=0.0)
            x1 = x1 * inv[:, None] * tl.load(w_ptr + i1, mask=ok, other=0.0)
        tl.store(dst + i0, x0 * cos - x1 * sin, mask=ok)
        tl.store(dst + i1, x0 * sin + x1 * cos, mask=ok)

    # the slots are a slice of the step's slot buffer, at any offset
    @jit(do_not_specialize_on_alignment=["slot_ptr"])
    def _rope_qk_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, qo_ptr, ko_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st, eps,
        v_ptr, slot_ptr, k0_ptr, k1_ptr, v0_ptr, v1_ptr, stride_vt, stride_vh,
        H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr, HALFP: tl.constexpr,
        NEOX: tl.constexpr, HAS_NORM: tl.constexpr, STORE: tl.constexpr = False,
        DV: tl.constexpr = 0, K_FMT: tl.constexpr = 0, K_ROT: tl.constexpr = False,
        V_FMT: tl.constexpr = 0, V_ROT: tl.constexpr = False, HP: tl.constexpr = 1,
        DKP: tl.constexpr = 1, DVP: tl.constexpr = 1, RKP: tl.constexpr = 1,
        RVP: tl.constexpr = 1, PDL: tl.constexpr = False,
    ):
        """Token t (program 0), head h (program 1: the q heads, then the k heads), with
        the token's cos/sin row: a decode step's few tokens still spread over the device.
        With STORE, program H rotates every k head of the token, then stores them into the
        KV planes at the token's slot (kernels/kv_store.py's _encode), and program H + 1
        stores its v: the step's K/V store without a launch of its own; with K_ROT the q
        programs rotate their head as the stored K is."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        i = tl.arange(0, HALFP)[None, :]
        await_inputs(PDL)
        cos = tl.load(cos_ptr + t * stride_ct + i, mask=i < HALF, other=0.0)  # (1, HALFP)
        sin = tl.load(sin_ptr + t * stride_st + i, mask=i < HALF, other=0.0)
        if h < H:
            q_row = qo_ptr + (t * H + h) * (2 * HALF)
            _rope_head(q_ptr + t * stride_qt + h * stride_qh, q_row, cos, sin, qw_ptr, eps,
                       HALF, HALFP, NEOX, HAS_NORM)
            if STORE and K_ROT:
                _rotate_head(q_row, 2 * HALF // 32, 2 * HALFP // 32)
        elif not STORE:
            _rope_head(k_ptr + t * stride_kt + (h - H) * stride_kh,
                       ko_ptr + (t * KVH + h - H) * (2 * HALF), cos, sin, kw_ptr, eps, HALF,
                       HALFP, NEOX, HAS_NORM)
        elif h == H:
            k_row = ko_ptr + t * KVH * (2 * HALF)
            for j in tl.static_range(KVH):
                _rope_head(k_ptr + t * stride_kt + j * stride_kh, k_row + j * (2 * HALF), cos,
                           sin, kw_ptr, eps, HALF, HALFP, NEOX, HAS_NORM)
            tl.debug_barrier()  # the program's own writes of k_row, visible to all its threads
            slot = tl.load(slot_ptr + t).to(tl.int64)
            _encode(k_row, 2 * HALF, slot, k0_ptr, k1_ptr, K_FMT, K_ROT, KVH, 2 * HALF, HP, DKP,
                    RKP)
        else:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            _encode(v_ptr + t * stride_vt, stride_vh, slot, v0_ptr, v1_ptr, V_FMT, V_ROT, KVH,
                    DV, HP, DVP, RVP)


def _check(q, k, cos, sin, q_weight, k_weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The (T, d/2) views of cos and sin, after checking every input."""
    ok = q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and \
        q.shape[2] == k.shape[2] and q.shape[2] % 2 == 0
    tensors = [q, k, cos, sin, q_weight, k_weight]
    ok = ok and all(t.dtype == torch.float32 and t.device == q.device and t.stride(-1) == 1
                    for t in tensors if t is not None)
    if not ok:
        raise InvalidRequest(f"rope_qk: q (T, H, d) and k (T, KVH, d) float32 with contiguous "
                             f"last dims on one device, got q {q.dtype} {tuple(q.shape)}, "
                             f"k {k.dtype} {tuple(k.shape)}")
    tokens, half = q.shape[0], q.shape[2] // 2
    cos, sin = (c.reshape(c.shape[0], -1) if c.dim() == 3 else c for c in (cos, sin))
    if cos.shape != (tokens, half) or sin.shape != (tokens, half):
        raise InvalidRequest(f"rope_qk: cos/sin must be ({tokens}, {half}), got "
                             f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    if (q_weight is None) != (k_weight is None) or any(
            w is not None and tuple(w.shape) != (2 * half,) for w in (q_weight, k_weight)):
        raise InvalidRequest("rope_qk: q and k norm weights come together, each (d,)")
    return cos, sin


def q_rotates(store: KVStore | None) -> bool:
    """Whether rope_qk with `store` returns q rotated (a K format stored times H)."""
    return store is not None and FORMAT_CODES[store.k_format][1]


class KVStore(NamedTuple):
    """Where rope_qk also stores the step's K (rotated) and V: kernels/kv_store.py's
    arguments besides k."""

    v: torch.Tensor  # (T, KVH, dv) float32, any row and head strides
    slots: torch.Tensor  # (T,) int, distinct
    k_planes: dict[str, torch.Tensor]
    v_planes: dict[str, torch.Tensor]
    k_format: str
    v_format: str


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            neox: bool, q_weight: torch.Tensor | None = None,
            k_weight: torch.Tensor | None = None, eps: float = 1e-6,
            store: KVStore | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, d), k (T, KVH, d) float32 (any row/head strides), cos/sin (T, d/2) or
    (T, 1, d/2) -> contiguous rotated (q, k), after their RMSNorm when weights are given;
    with `store`, the rotated k and store.v also stored at store.slots of the KV planes
    (kv_store's bits) by the same launch, and into a rotated K format (q_rotates) q's
    32-blocks come out times H (rotate_exact's bits).

    One launch on a GPU (or on the CPU when the interpreter is active), else the references.
    """
    if not kernels_run(q.device):
        q_out, k_out = rope_qk_reference(q, k, cos, sin, neox, q_weight, k_weight, eps)
        if store is not None:
            kv_store(k_out, *store)
            if q_rotates(store):
                q_out = rotate_exact(q_out)
        return q_out, k_out
    cos, sin = _check(q, k, cos, sin, q_weight, k_weight)
    (tokens, heads, dim), kv_heads = q.shape, k.shape[1]
    q_out = torch.empty(tokens, heads, dim, dtype=torch.float32, device=q.device)
    k_out = torch.empty(tokens, kv_heads, dim, dtype=torch.float32, device=q.device)
    args, consts, warps = (cos,) * 6 + (0, 0), {}, 1  # no store: placeholders
    if store is not None:
        v, slots = store.v, store.slots
        planes, consts = store_args(k_out, *store)  # v and slots checked against k
        consts = {n: c for n, c in consts.items() if n not in ("KVH", "DK")}
        args = (v, slots.to(q.device), *planes, v.stride(0), v.stride(1))
        # f16 planes take a copy a thread; the quantized ones kv_store's warps
        warps = 1 if consts["K_FMT"] == consts["V_FMT"] == 0 else 4
    if tokens:
        norm = q_weight is not None
        launcher(_rope_qk_kernel, q.device)[(tokens, heads + (2 if store else kv_heads))](
            q, k, cos, sin, q_weight if norm else cos, k_weight if norm else cos, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
            float(eps), *args, H=heads, KVH=kv_heads, HALF=dim // 2,
            HALFP=next_pow2(dim // 2), NEOX=bool(neox), HAS_NORM=norm,
            STORE=store is not None, **consts, num_warps=warps)
    return q_out, k_out


_COS_SIN_ELEMENTS = 256  # angles a program (one warp) of _cos_sin_kernel: 8 a thread


def _cos_sin_tokens(half: int) -> int:
    """Tokens a program of _cos_sin_kernel takes (a power of two, at least 1)."""
    return max(1, _COS_SIN_ELEMENTS // next_pow2(half))


def rope_cos_sin(positions: torch.Tensor,
                 inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_cos_sin_reference's cos, sin (T, 1, d/2) float32 (views into one (T, 2, d/2)
    buffer) of positions with any stride, one launch on a GPU (or on the CPU when the
    interpreter is active), else the reference."""
    if not kernels_run(positions.device):
        return rope_cos_sin_reference(positions, inv_freq)
    if positions.dim() != 1 or positions.dtype.is_floating_point or inv_freq.dim() != 1 or \
            inv_freq.dtype != torch.float32 or inv_freq.device != positions.device:
        raise InvalidRequest(f"rope_cos_sin: positions (T,) integers and inv_freq (d/2,) "
                             f"float32 on one device, got {positions.dtype} "
                             f"{tuple(positions.shape)}, {inv_freq.dtype} {tuple(inv_freq.shape)}")
    tokens, half = positions.shape[0], inv_freq.shape[0]
    out = torch.empty(tokens, 2, half, dtype=torch.float32, device=positions.device)
    if tokens and half:
        block = _cos_sin_tokens(half)
        launcher(_cos_sin_kernel, positions.device)[(-(-tokens // block),)](
            positions, inv_freq.contiguous(), out, tokens, positions.stride(0), HALF=half,
            HALFP=next_pow2(half), BLOCK_T=block, num_warps=1)
    return out[:, 0:1], out[:, 1:2]


def aot_specs(spec: type) -> list:
    """kernels/aot.py: Llama 3 8B (32/8 heads of 128, original layout) and Qwen3-like
    (neox with q/k norm, 16/8 heads of 128); Llama's with the K/V store into f16 and into
    q8 K with q4 V planes."""
    if not HAS_TRITON:
        return []
    sig = {**{n: "*fp32" for n in ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "qw_ptr", "kw_ptr",
                                   "qo_ptr", "ko_ptr", "v_ptr", "slot_ptr", "k0_ptr", "k1_ptr",
                                   "v0_ptr", "v1_ptr")},
           **{n: "i32" for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh",
                                 "stride_ct", "stride_st", "stride_vt", "stride_vh")},
           "eps": "fp32"}
    out = [spec(f"rope_cos_sin_{half}", _cos_sin_kernel,
                {"pos_ptr": "*i64", "inv_ptr": "*fp32", "out_ptr": "*fp32", "tokens": "i32",
                 "stride_pos": "i32", "HALF": "constexpr", "HALFP": "constexpr",
                 "BLOCK_T": "constexpr"},
                {"HALF": half, "HALFP": next_pow2(half), "BLOCK_T": _cos_sin_tokens(half)}, 1,
                False)
           for half in (64, 128)]  # head dims 128 (Llama) and 256 (Gemma 3 27B)
    for name, heads, neox, norm in (("llama", 32, False, False), ("qk_norm", 16, True, True)):
        consts = {"H": heads, "KVH": 8, "HALF": 64, "HALFP": 64, "NEOX": neox,
                  "HAS_NORM": norm}
        out.append(spec(f"rope_qk_{name}", _rope_qk_kernel,
                        {**sig, **{k: "constexpr" for k in consts}}, consts, 1, False))
    plane = {0: "*fp16", 1: "*i8", 2: "*u8"}
    for name, (kf, kr), (vf, vr), warps in (("f16", (0, False), (0, False), 1),
                                            ("k8v4", (1, True), (2, True), 4)):
        consts = {"H": 32, "KVH": 8, "HALF": 64, "HALFP": 64, "NEOX": False,
                  "HAS_NORM": False, "STORE": True, "DV": 128, "K_FMT": kf, "K_ROT": kr,
                  "V_FMT": vf, "V_ROT": vr, "HP": 8, "DKP": 128, "DVP": 128, "RKP": 32,
                  "RVP": 32}
        store_sig = {**sig, "slot_ptr": "*i64", "k0_ptr": plane[kf], "k1_ptr": "*fp16",
                     "v0_ptr": plane[vf], "v1_ptr": "*fp16"}
        out.append(spec(f"rope_qk_llama_store_{name}", _rope_qk_kernel,
                        {**store_sig, **{k: "constexpr" for k in consts}}, consts, warps,
                        False))
    return out
