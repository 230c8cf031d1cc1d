"""Device functions that decode one weight tile of a GGML block type, for kernels/qmatmul.py.

A tile is `(BN, BK)` float32 values of BN weight rows (`rows`: (BN,) pointers to each
row's first byte, in the GGUF bytes) over the BK columns starting at `k0`. Bytes are read
in their natural order and expanded with `tl.join`, so a tile's columns come out in a
type-specific order; `tile_kmap` gives, for each tile column, its offset from `k0`, and the
matmul loads x in that same order (a dot product does not care about the order of its
terms, and permuting the small x tile is cheaper than permuting the weight tile).

The float32 operations follow gguf-py's order (scale * sub-block scale first, then the
code, then the min), see kernels/dequant_kquants.py for the layouts. BK is a multiple of
the type's step: 32 for 32-element blocks and IQ4_XS, 64 for Q4_K/Q5_K, exactly 128 for
Q6_K. Every f16 field is read as two bytes, so no load assumes more than byte alignment.
"""

from __future__ import annotations

from kernels.triton_util import helper, tl

# GGML type ids (ggml.h); kernels/dequant.py names them through gguf, which the kernels
# do not need at run time.
Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, MXFP4 = 2, 6, 8, 12, 13, 14, 23, 39
# (elements per block, bytes per block, columns per tile step)
GEOMETRY: dict[int, tuple[int, int, int]] = {
    Q4_0: (32, 18, 32), Q5_0: (32, 22, 32), Q8_0: (32, 34, 32), IQ4_XS: (256, 136, 32),
    MXFP4: (32, 17, 32), Q4_K: (256, 144, 64), Q5_K: (256, 176, 64), Q6_K: (256, 210, 128),
}
NAMES = {Q4_0: "Q4_0", Q5_0: "Q5_0", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
         Q6_K: "Q6_K", IQ4_XS: "IQ4_XS", MXFP4: "MXFP4"}


@helper
def _f16(p):
    """Pointers to little-endian f16 fields -> float32 (two byte loads, any alignment)."""
    lo = tl.load(p).to(tl.uint16)
    hi = tl.load(p + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@helper
def _u32(p):
    b0 = tl.load(p).to(tl.uint32)
    b1 = tl.load(p + 1).to(tl.uint32)
    b2 = tl.load(p + 2).to(tl.uint32)
    b3 = tl.load(p + 3).to(tl.uint32)
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)


@helper
def _blocks32(rows, k0, TS: tl.constexpr, BK: tl.constexpr):
    """(BN, BK // 32, 1) pointers to the 32-element blocks of the tile."""
    b = (k0 // 32 + tl.arange(0, BK // 32)) * TS
    return rows[:, None, None] + b[None, :, None]


@helper
def _tile_q8_0(rows, k0, BN: tl.constexpr, BK: tl.constexpr):
    base = _blocks32(rows, k0, 34, BK)
    q = tl.load(base + 2 + tl.arange(0, 32)[None, None, :]).to(tl.int8, bitcast=True)
    return tl.reshape(_f16(base) * q.to(tl.float32), (BN, BK))


@helper
def _tile_q4_0(rows, k0, BN: tl.constexpr, BK: tl.constexpr):
    base = _blocks32(rows, k0, 18, BK)
    byte = tl.load(base + 2 + tl.arange(0, 16)[None, None, :])  # (BN, NB, 16)
    q = tl.join(byte & 15, byte >> 4).to(tl.float32) - 8.0  # (BN, NB, 16, 2)
    return tl.reshape(_f16(base)[:, :, :, None] * q, (BN, BK))


@helper
def _tile_q5_0(rows, k0, BN: tl.constexpr, BK: tl.constexpr):
    base = _blocks32(rows, k0, 22, BK)
    t = tl.arange(0, 16)[None, None, :]
    byte = tl.load(base + 6 + t).to(tl.uint32)  # (BN, NB, 16)
    qh = _u32(base + 2)  # (BN, NB, 1): bit j is the 5th bit of element j
    lo = (byte & 15) | (((qh >> t) & 1) << 4)
    hi = (byte >> 4) | (((qh >> (t + 16)) & 1) << 4)
    q = tl.join(lo, hi).to(tl.float32) - 16.0
    return tl.reshape(_f16(base)[:, :, :, None] * q, (BN, BK))


@helper
def _tile_mxfp4(rows, k0, lut, BN: tl.constexpr, BK: tl.constexpr):
    base = _blocks32(rows, k0, 17, BK)
    byte = tl.load(base + 1 + tl.arange(0, 16)[None, None, :])
    v = tl.load(lut + tl.join(byte & 15, byte >> 4))  # (BN, NB, 16, 2) doubled E2M1 values
    e = tl.load(base).to(tl.int32)  # e8m0 exponent; 2**(e - 128), subnormal below 2
    bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    scale = bits.to(tl.float32, bitcast=True)
    return tl.reshape(scale[:, :, :, None] * v, (BN, BK))


@helper
def _tile_iq4_xs(rows, k0, lut, BN: tl.constexpr, BK: tl.constexpr):
    sg = k0 // 32 + tl.arange(0, BK // 32)  # global 32-element sub-block index
    s = sg % 8
    blk = rows[:, None] + ((sg // 8) * 136)[None, :]  # (BN, NS)
    byte = tl.load(blk[:, :, None] + 8 + (s * 16)[None, :, None] + tl.arange(0, 16)[None, None, :])
    v = tl.load(lut + tl.join(byte & 15, byte >> 4))  # (BN, NS, 16, 2)
    low = (tl.load(blk + 4 + s[None, :] // 2).to(tl.int32) >> (4 * (s[None, :] % 2))) & 15
    high = (_u32(blk + 2) >> (2 * s[None, :]).to(tl.uint32)) & 3  # u16 read as u32: bits < 16
    dl = _f16(blk) * ((low | (high.to(tl.int32) << 4)) - 32).to(tl.float32)  # (BN, NS)
    return tl.reshape(dl[:, :, None, None] * v, (BN, BK))


@helper
def _scale_min_k4(p, s):
    """Q4_K/Q5_K 6-bit scale and min of sub-blocks `s` (0..7); `p` points at scales[0]."""
    a = tl.load(p + s)
    b = tl.load(p + s + 4)
    c = tl.load(p + s % 4)
    lo = s < 4
    sc = tl.where(lo, a & 63, (b & 15) | ((c >> 6) << 4))
    mn = tl.where(lo, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@helper
def _tile_k4(rows, k0, HAS_QH: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Q4_K (HAS_QH false, 144-byte blocks) and Q5_K (176-byte blocks with qh)."""
    TS: tl.constexpr = 176 if HAS_QH else 144
    gg = k0 // 64 + tl.arange(0, BK // 64)  # global 64-element group: sub-blocks 2g, 2g + 1
    g4 = (gg % 4)[None, :, None]
    blk = (rows[:, None] + ((gg // 4) * TS)[None, :])[:, :, None]  # (BN, NG, 1)
    t = tl.arange(0, 32)[None, None, :]
    byte = tl.load(blk + (48 if HAS_QH else 16) + g4 * 32 + t)  # (BN, NG, 32)
    lo = byte & 15
    hi = byte >> 4
    if HAS_QH:
        qh = tl.load(blk + 16 + t)  # bit s of qh[t]: 5th bit of sub-block s, element t
        lo = lo | (((qh >> (2 * g4)) & 1) << 4).to(tl.uint8)
        hi = hi | (((qh >> (2 * g4 + 1)) & 1) << 4).to(tl.uint8)
    s = 2 * g4 + tl.arange(0, 2)[None, None, :]  # (1, NG, 2)
    sc, mn = _scale_min_k4(blk + 4, s)  # (BN, NG, 2)
    dl = _f16(blk) * sc
    ml = _f16(blk + 2) * mn
    q = tl.join(lo, hi).to(tl.float32)  # (BN, NG, 32, 2)
    return tl.reshape(dl[:, :, None, :] * q - ml[:, :, None, :], (BN, BK))


@helper
def _tile_q6_k(rows, k0, BN: tl.constexpr):
    """128 columns (half a super-block); tile dims (BN, pl, tq, tr, nib), t = tq * 16 + tr."""
    h = (k0 // 128) % 2
    blk = rows + (k0 // 256) * 210
    pl = tl.arange(0, 2)[:, None, None]
    t = tl.arange(0, 2)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]  # (1, 2, 16)
    p4 = blk[:, None, None, None]
    ql = tl.load(p4 + h * 64 + pl * 32 + t).to(tl.int32)  # (BN, 2, 2, 16)
    qh = tl.load(p4 + 128 + h * 32 + t).to(tl.int32)  # (BN, 1, 2, 16)
    lo = (ql & 15) | (((qh >> (2 * pl)) & 3) << 4)  # plane p = pl
    hi = (ql >> 4) | (((qh >> (2 * pl + 4)) & 3) << 4)  # plane p = pl + 2
    q = tl.join(lo, hi).to(tl.float32) - 32.0  # (BN, 2, 2, 16, 2)
    # Scale of 16 elements: index h * 8 + p * 2 + tq with p = pl + 2 * nib.
    nib = tl.arange(0, 2)[None, None, None, :]
    sidx = h * 8 + (tl.arange(0, 2)[:, None, None, None] + 2 * nib) * 2
    sidx = sidx + tl.arange(0, 2)[None, :, None, None]  # (2, 2, 1, 2)
    sc = tl.load(p4[:, :, :, :, None] + 192 + sidx[None]).to(tl.int8, bitcast=True)
    dl = _f16(blk + 208)[:, None, None, None, None] * sc.to(tl.float32)
    return tl.reshape(dl * q, (BN, 128))


@helper
def dequant_tile(QTYPE: tl.constexpr, rows, k0, lut, BN: tl.constexpr, BK: tl.constexpr):
    """(BN, BK) float32 weights; column j is k0 + tile_kmap(QTYPE, BK)[j]."""
    if QTYPE == 8:
        w = _tile_q8_0(rows, k0, BN, BK)
    elif QTYPE == 2:
        w = _tile_q4_0(rows, k0, BN, BK)
    elif QTYPE == 6:
        w = _tile_q5_0(rows, k0, BN, BK)
    elif QTYPE == 39:
        w = _tile_mxfp4(rows, k0, lut, BN, BK)
    elif QTYPE == 23:
        w = _tile_iq4_xs(rows, k0, lut, BN, BK)
    elif QTYPE == 12:
        w = _tile_k4(rows, k0, False, BN, BK)
    elif QTYPE == 13:
        w = _tile_k4(rows, k0, True, BN, BK)
    else:
        tl.static_assert(QTYPE == 14, "unsupported GGML type")
        w = _tile_q6_k(rows, k0, BN)
    return w


@helper
def tile_kmap(QTYPE: tl.constexpr, BK: tl.constexpr):
    """(BK,) offset from k0 of each tile column (the order dequant_tile emits)."""
    j = tl.arange(0, BK)
    if QTYPE == 8:
        k = j
    elif QTYPE == 14:  # (pl, tq, tr, nib) -> (pl + 2 * nib) * 32 + tq * 16 + tr
        k = (j // 64 + 2 * (j % 2)) * 32 + (j % 64) // 2
    elif QTYPE == 12 or QTYPE == 13:  # (group, t, nib) -> group * 64 + nib * 32 + t
        k = (j // 64) * 64 + (j % 2) * 32 + (j % 64) // 2
    else:  # (block, t, nib) -> block * 32 + nib * 16 + t
        k = (j // 32) * 32 + (j % 2) * 16 + (j % 32) // 2
    return k
