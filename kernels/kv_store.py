"""KV store: encode a step's K and V into engine/kv/formats.py's planes at their slots, one
launch per layer for both.

Formats (see formats.py for the byte contracts): `f16` (one plane of halves), `q8`/`q4`
(codes and f16 scales per 32-block; symmetric absmax for q8, GGML Q4_0's signed absmax
for q4, round half to even) and their unrotated `_plain` variants. The rotated formats
multiply every 32-block by the normalized Hadamard matrix H first. Here that product is
computed exactly up to one final rounding: a fast Walsh-Hadamard butterfly in float64
(stages of distance 1, 2, 4, 8, 16; float32 inputs, so every add is exact unless a
block spans more than 2^29 in magnitude), times 1/sqrt(32) in float64, rounded to
float32. The kernel (kernels/rotate.py's hadamard_blocks) and `rotate_exact` (the
reference) run the same operations in the same order, so their planes are bit-identical;
formats.py's float32 matmul rotation differs from it by float32 rounding, which flips a
code in about one element in 10^5.

Divisions use div_rn: a compiled `/` may be approximate on the GPU, and a code or scale
that differs in its last bit would break bit-identity with the reference.
"""

from __future__ import annotations

import functools

import torch

from engine.errors import InvalidRequest
from engine.kv.formats import FORMATS
from engine.kv.hadamard import rotate_exact
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

__all__ = ["kv_encode_reference", "kv_store", "kv_store_reference", "rotate_exact",
           "store_args"]

# Format name -> the kernel's (FMT, ROTATE) constexprs: FMT 0 f16, 1 q8, 2 q4.
FORMAT_CODES = {"f16": (0, False), "q8": (1, True), "q4": (2, True), "q8_plain": (1, False),
                "q4_plain": (2, False)}


def kv_encode_reference(x: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """(n, kv_heads, d) float -> the planes of format `fmt`, rotation by rotate_exact."""
    if fmt not in FORMAT_CODES:
        raise InvalidRequest(f"kv_store: unknown KV format {fmt!r}")
    if fmt in ("q8", "q4"):
        return FORMATS[fmt + "_plain"].encode(rotate_exact(x.to(torch.float32)))
    return FORMATS[fmt].encode(x)


def kv_store_reference(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                       k_planes: dict[str, torch.Tensor], v_planes: dict[str, torch.Tensor],
                       k_format: str, v_format: str) -> None:
    """Store k (n, kv_heads, dk) and v (n, kv_heads, dv) at `slots` (n,) in place."""
    for planes, fmt, x in ((k_planes, k_format, k), (v_planes, v_format, v)):
        for name, enc in kv_encode_reference(x, fmt).items():
            planes[name][slots] = enc


if HAS_TRITON:
    from kernels.rotate import hadamard_blocks

    @helper
    def _round_half_even(v):
        """float32 v with |v| < 2^23 -> nearest integer, ties to even (torch.round)."""
        f = tl.floor(v)
        d = v - f
        odd = f - 2.0 * tl.floor(f * 0.5) != 0.0
        return f + ((d > 0.5) | ((d == 0.5) & odd)).to(tl.float32)

    @helper
    def _quantize(b, s, LO: tl.constexpr, HI: tl.constexpr):
        """Blocks b (R, 32) float32, scales s (R, 1) float32 -> codes (R, 32) float32."""
        q = tl.where(s != 0.0, tl.math.div_rn(b, tl.where(s != 0.0, s, 1.0)), 0.0)
        # clamped to one past the range first: rounding is monotonic, so this is
        # round-then-clamp, with |q| small enough for _round_half_even
        q = tl.minimum(tl.maximum(q, LO - 1.0), HI + 1.0)
        return tl.minimum(tl.maximum(_round_half_even(q), LO * 1.0), HI * 1.0)

    @helper
    def _encode(x_ptr, stride_h, slot, p0, p1, FMT: tl.constexpr, ROTATE: tl.constexpr,
                H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
                RP: tl.constexpr):
        """One token's (H, D) vectors (heads at stride_h) -> the planes at `slot` (int64)."""
        if FMT == 0:
            h = tl.arange(0, HP)[:, None]
            d = tl.arange(0, DP)[None, :]
            ok = (h < H) & (d < D)
            x = tl.load(x_ptr + h * stride_h + d, mask=ok)
            tl.store(p0 + slot * (H * D) + h * D + d, x.to(tl.float16), mask=ok)
        else:
            NB = D // 32
            r = tl.arange(0, RP)[:, None]  # block r = head * NB + block within the head
            j = tl.arange(0, 32)[None, :]
            ok = r < H * NB
            b = tl.load(x_ptr + (r // NB) * stride_h + (r % NB) * 32 + j, mask=ok, other=0.0)
            if ROTATE:
                b = hadamard_blocks(b, RP)
            if FMT == 1:  # scale = amax / 127
                amax = tl.max(tl.abs(b), 1)
                scale = tl.minimum(tl.math.div_rn(amax, 127.0), 65504.0).to(tl.float16)
                codes = _quantize(b, scale.to(tl.float32)[:, None], -127, 127)
                tl.store(p0 + slot * (H * D) + r * 32 + j, codes.to(tl.int8), mask=ok)
            else:  # scale = m / -8, m the first element of largest magnitude
                first = tl.argmax(tl.abs(b), 1, tie_break_left=True)
                m = tl.max(tl.where(j == first[:, None], b, float("-inf")), 1)
                scale = tl.minimum(tl.maximum(tl.math.div_rn(m, -8.0), -65504.0), 65504.0)
                scale = scale.to(tl.float16)
                q = (_quantize(b, scale.to(tl.float32)[:, None], -8, 7) + 8.0).to(tl.int32)
                lo, hi = tl.split(tl.reshape(q, (RP, 16, 2)))  # elements 2i and 2i + 1
                jj = tl.arange(0, 16)[None, :]
                tl.store(p0 + slot * (H * D // 2) + r * 16 + jj, (lo | (hi << 4)).to(tl.uint8),
                         mask=ok)
            rb = tl.arange(0, RP)
            tl.store(p1 + slot * (H * NB) + rb, scale, mask=rb < H * NB)

    # the slots are a slice of the step's slot buffer, at any offset
    @jit(do_not_specialize_on_alignment=["slot_ptr"])
    def _kv_store_kernel(
        k_ptr, v_ptr, slot_ptr, k0_ptr, k1_ptr, v0_ptr, v1_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        KVH: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K_FMT: tl.constexpr,
        K_ROT: tl.constexpr, V_FMT: tl.constexpr, V_ROT: tl.constexpr, HP: tl.constexpr,
        DKP: tl.constexpr, DVP: tl.constexpr, RKP: tl.constexpr, RVP: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """Program (t, 0) stores token t's K, (t, 1) its V."""
        t = tl.program_id(0).to(tl.int64)
        await_inputs(PDL)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if tl.program_id(1) == 0:
            _encode(k_ptr + t * stride_kt, stride_kh, slot, k0_ptr, k1_ptr, K_FMT, K_ROT, KVH,
                    DK, HP, DKP, RKP)
        else:
            _encode(v_ptr + t * stride_vt, stride_vh, slot, v0_ptr, v1_ptr, V_FMT, V_ROT, KVH,
                    DV, HP, DVP, RVP)


def _planes(planes: dict[str, torch.Tensor], fmt: str, x: torch.Tensor,
            what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (first, last) planes of `fmt` for rows like x (n, kv_heads, d), checked."""
    n, heads, dim = x.shape
    if fmt not in FORMAT_CODES or dim % 32:
        raise InvalidRequest(f"kv_store: {what} format {fmt!r}, head dim {dim}")
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        raise InvalidRequest(f"kv_store: {what} must be float32 (n, heads, d) with a "
                             f"contiguous last dim, got {x.dtype} {tuple(x.shape)}")
    tensors = []
    for name, (dtype, tail) in _plane_shapes(fmt, heads, dim).items():
        p = planes.get(name)
        if p is None or p.dtype != dtype or tuple(p.shape[1:]) != tail \
                or not p.is_contiguous() or p.device != x.device:
            got = None if p is None else (p.dtype, tuple(p.shape), p.device)
            raise InvalidRequest(f"kv_store: {what} plane {name!r} must be contiguous "
                                 f"{dtype} (slots, *{tail}) on {x.device}, got {got}")
        tensors.append(p)
    return tensors[0], tensors[-1]


@functools.lru_cache(maxsize=64)
def _plane_shapes(fmt: str, heads: int, dim: int) -> dict[str, tuple[torch.dtype, tuple]]:
    """{plane: (dtype, shape after the slot dim)} of `fmt` (from its allocator, once)."""
    return {name: (p.dtype, tuple(p.shape[1:]))
            for name, p in FORMATS[fmt].allocate(0, heads, dim, "meta").items()}


def kv_store(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
             k_planes: dict[str, torch.Tensor], v_planes: dict[str, torch.Tensor],
             k_format: str, v_format: str) -> None:
    """Store k (n, kv_heads, dk) and v (n, kv_heads, dv) float32 (any row and head strides)
    at `slots` (n,) of the planes, in place: one launch on a GPU (or on the CPU when the
    interpreter is active), else the reference. Slots must be distinct (as a step's are)."""
    if not kernels_run(k.device):
        kv_store_reference(k, v, slots, k_planes, v_planes, k_format, v_format)
        return
    planes, consts = store_args(k, v, slots, k_planes, v_planes, k_format, v_format)
    if k.shape[0] == 0:
        return
    launcher(_kv_store_kernel, k.device)[(k.shape[0], 2)](
        k, v, slots.to(k.device), *planes, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), **consts, num_warps=4)


def store_args(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               k_planes: dict[str, torch.Tensor], v_planes: dict[str, torch.Tensor],
               k_format: str, v_format: str) -> tuple[tuple[torch.Tensor, ...], dict[str, int]]:
    """The planes (k0, k1, v0, v1) and constexprs of a store of k (n, kv_heads, dk) and v
    (n, kv_heads, dv) at slots (n,), all checked: _encode's arguments (here and in
    kernels/fused_rope.py)."""
    if k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2] or \
            tuple(slots.shape) != (k.shape[0],) or slots.dtype not in (torch.int32, torch.int64):
        raise InvalidRequest(f"kv_store: k (n, h, dk), v (n, h, dv), slots (n,) int, got "
                             f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(slots.shape)}")
    k0, k1 = _planes(k_planes, k_format, k, "K")
    v0, v1 = _planes(v_planes, v_format, v, "V")
    (_, heads, dk), dv = k.shape, v.shape[2]
    (k_fmt, k_rot), (v_fmt, v_rot) = FORMAT_CODES[k_format], FORMAT_CODES[v_format]
    return (k0, k1, v0, v1), dict(
        KVH=heads, DK=dk, DV=dv, K_FMT=k_fmt, K_ROT=k_rot, V_FMT=v_fmt, V_ROT=v_rot,
        HP=next_pow2(heads), DKP=next_pow2(dk), DVP=next_pow2(dv),
        RKP=next_pow2(heads * dk // 32), RVP=next_pow2(heads * dv // 32))


def aot_specs(spec: type) -> list:
    """kernels/aot.py: every --kv-quant pair at Llama 3 8B's shape (8 KV heads of 128)."""
    if not HAS_TRITON:
        return []
    plane = {0: "*fp16", 1: "*i8", 2: "*u8"}
    out = []
    for name, k_fmt, v_fmt in (("f16", "f16", "f16"), ("q8", "q8", "q8"),
                               ("k8v4", "q8", "q4"), ("k4v4", "q4", "q4")):
        (kf, kr), (vf, vr) = FORMAT_CODES[k_fmt], FORMAT_CODES[v_fmt]
        consts = {"KVH": 8, "DK": 128, "DV": 128, "K_FMT": kf, "K_ROT": kr, "V_FMT": vf,
                  "V_ROT": vr, "HP": 8, "DKP": 128, "DVP": 128, "RKP": 32, "RVP": 32}
        sig = {"k_ptr": "*fp32", "v_ptr": "*fp32", "slot_ptr": "*i64", "k0_ptr": plane[kf],
               "k1_ptr": "*fp16", "v0_ptr": plane[vf], "v1_ptr": "*fp16",
               **{n: "i32" for n in ("stride_kt", "stride_kh", "stride_vt", "stride_vh")},
               **{k: "constexpr" for k in consts}}
        out.append(spec(f"kv_store_{name}", _kv_store_kernel, sig, consts, 4, False))
    return out
