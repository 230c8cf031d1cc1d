"""Device functions that decode one weight tile of a GGML block type, for the qmatmul kernels.

A tile is `(BN, BK)` float32 values of BN weight rows (`row_off`: (BN,) byte offsets of
each row in the GGUF bytes at `w_ptr`) over the BK columns `k0 .. k0 + BK`, in column
order. The kernels in kernels/qmatmul.py (tiled) and kernels/qgemv.py (skinny) share these
functions (through kernels/qscaled.py's `step`, which takes Q4_K its own way), so a weight
element has the same bits, at the same place in the K order, on every path (the
batch-invariance premise, see qmatmul.py).

How the bytes are read: each field of a block is loaded as one contiguous run per (row,
block); the two nibbles of a byte are split, scaled, joined on a new minor axis and
transposed back to column order (a register relabelling); scales are decoded once per
(row, sub-block) and broadcast. Triton software-pipelines (as async copies, issued stages
ahead) only loads of 4 aligned bytes or more; a narrower load waits for memory in every
iteration. So the types whose blocks allow it read every field as such: Q4_K/Q5_K (16-byte
aligned super-blocks: codes as 16-byte runs, the 16-byte head as words, picked apart by
sums so that the scales are decoded once per (row, group) rather than in every thread
holding the group's codes), IQ4_XS (8-byte aligned) and Q6_K (210 bytes, 2-byte aligned:
aligned u32 words, the halves of two words joined where needed, four codes decoded per
word). The 32-element block types (34, 18, 22 and 17 bytes) are read bytewise, f16 fields
as u16 (the kernels require 4-byte aligned blocks; wider loads where the launch finds
more alignment). The 16-entry code books of IQ4_XS and MXFP4 are gathered on chip.
Codes are converted to float as unsigned 32-bit integers (I2FP.U32 on sm_90, one
instruction; a signed or 8-bit source compiles to the slower I2F): a signed code is offset
into an unsigned one and the offset is taken back in the fma.

The float32 operations follow gguf-py's formulas; an offset code is scaled as
`fma(d, q, -o * d)`, which is exact where gguf-py rounds `d * (q - o)` once (o is a power
of two, so o * d is exact), and the K-quants' `dl * q - ml` is one fma (gguf-py rounds
twice: at most one float32 ulp apart, far below the bf16 rounding that follows).
BK is a multiple of the type's step: 32 for the 32-element blocks and IQ4_XS, 64 for
Q4_K/Q5_K, 128 for Q6_K, 16 for BF16 (see GEOMETRY).

Float matrices (F32, F16, BF16: one element a "block") are tiles of plain loads. Of them
only BF16 is in GEOMETRY, the qmatmul kernels' types: a linear's float matrix is held in
bf16 (engine/layers/ggml_linear.py), the precision the matrix unit multiplies in anyway;
the MoE kernel (kernels/moe.py) reads all three.
"""

from __future__ import annotations

from kernels.triton_util import helper, tl

# GGML type ids (ggml.h); kernels/dequant.py names them through gguf, which the kernels
# do not need at run time.
Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, MXFP4 = 2, 6, 8, 12, 13, 14, 23, 39
F32, F16, BF16 = 0, 1, 30
FLOAT_TYPES = {F32: 4, F16: 2, BF16: 2}  # ggml type -> bytes an element
# (elements per block, bytes per block, columns per tile step)
GEOMETRY: dict[int, tuple[int, int, int]] = {
    Q4_0: (32, 18, 32), Q5_0: (32, 22, 32), Q8_0: (32, 34, 32), IQ4_XS: (256, 136, 32),
    MXFP4: (32, 17, 32), Q4_K: (256, 144, 64), Q5_K: (256, 176, 64), Q6_K: (256, 210, 128),
    BF16: (1, 2, 16),
}
NAMES = {Q4_0: "Q4_0", Q5_0: "Q5_0", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
         Q6_K: "Q6_K", IQ4_XS: "IQ4_XS", MXFP4: "MXFP4", F32: "F32", F16: "F16", BF16: "BF16"}


@helper
def _float(u):
    """uint32 codes (< 2^24) -> float32, exactly."""
    return u.to(tl.float32)


@helper
def _u16(p):
    """u8 pointers at even addresses -> the little-endian u16 there, as int32."""
    return tl.load(p.to(tl.pointer_type(tl.uint16), bitcast=True)).to(tl.int32)


@helper
def _f16(p):
    """u8 pointers at even addresses -> the f16 there, as float32."""
    h = tl.load(p.to(tl.pointer_type(tl.uint16), bitcast=True))
    return h.to(tl.float16, bitcast=True).to(tl.float32)


@helper
def _f16lo(w):
    """The f16 in the low half of uint32 words, as float32."""
    return (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@helper
def _p32(w_ptr):
    """The (4-byte aligned) weight bytes as u32 words."""
    return w_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)


@helper
def _words(p, shifted):
    """u32 words at u32 pointers `p`, or (where `shifted`) the word 2 bytes further on,
    joined from the halves of two aligned words (for fields at offsets 2 mod 4)."""
    w0 = tl.load(p)
    w1 = tl.load(p + 1, mask=shifted, other=0)
    return tl.where(shifted, (w0 >> 16) | (w1 << 16), w0)


@helper
def _bytes(w):
    """(..., W) u32 words -> (..., W * 4) their bytes in memory order, as uint32."""
    half = tl.join(w & 0xFFFF, w >> 16)
    b = tl.join(half & 255, half >> 8)  # (..., W, 2, 2)
    return tl.reshape(b, b.shape[:-3] + (b.shape[-3] * 4,))


@helper
def _lookup(lut, idx):
    """Code-book values lut[idx] for int idx in 0..15 (any shape): a gather from the 16
    values held on chip (a shared-memory read per element), not one global load each."""
    table = tl.load(lut + tl.arange(0, 16))
    flat = tl.gather(table, tl.reshape(idx, (idx.numel,)), 0)
    return tl.reshape(flat, idx.shape)


@helper
def _columns(lo, hi, BN: tl.constexpr, BK: tl.constexpr):
    """(BN, NB, T) values of the low and the high nibbles of each block's T bytes ->
    (BN, BK) in column order: per block, the T low-nibble elements, then the T high."""
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 3, 2)), (BN, BK))


@helper
def _blocks32p(rows, k0, TS: tl.constexpr, BK: tl.constexpr):
    """(BN, BK // 32) pointers to the 32-element blocks of the tile."""
    return rows[:, None] + ((k0 // 32 + tl.arange(0, BK // 32)) * TS)[None, :]


@helper
def _tile_float(QTYPE: tl.constexpr, rows, k0, BK: tl.constexpr):
    """F32 / F16 / BF16 rows (byte pointers `rows`, (BN,)): columns k0 .. k0 + BK."""
    k = k0 + tl.arange(0, BK)
    if QTYPE == 0:
        p = rows.to(tl.pointer_type(tl.float32), bitcast=True)
    elif QTYPE == 1:
        p = rows.to(tl.pointer_type(tl.float16), bitcast=True)
    else:
        p = rows.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    return tl.load(p[:, None] + k[None, :]).to(tl.float32)


@helper
def _tile_q8_0(rows, k0, BN: tl.constexpr, BK: tl.constexpr):
    base = _blocks32p(rows, k0, 34, BK)
    q = tl.load(base[:, :, None] + 2 + tl.arange(0, 32)[None, None, :])  # (BN, NB, 32) u8
    d = _f16(base)[:, :, None]
    # int8 code c = u - 128 with u = byte ^ 0x80: d * c == fma(d, u, -128 d) exactly.
    return tl.reshape(tl.fma(d, _float((q ^ 0x80).to(tl.uint32)), -128.0 * d), (BN, BK))


@helper
def _tile_q4_0(rows, k0, BN: tl.constexpr, BK: tl.constexpr):
    base = _blocks32p(rows, k0, 18, BK)
    byte = tl.load(base[:, :, None] + 2 + tl.arange(0, 16)[None, None, :])  # (BN, NB, 16)
    d = _f16(base)[:, :, None]
    byte = byte.to(tl.uint32)
    lo = tl.fma(d, _float(byte & 15), -8.0 * d)
    hi = tl.fma(d, _float(byte >> 4), -8.0 * d)
    return _columns(lo, hi, BN, BK)


@helper
def _tile_q5_0(rows, k0, BN: tl.constexpr, BK: tl.constexpr):
    base = _blocks32p(rows, k0, 22, BK)
    t = tl.arange(0, 16)[None, None, :]
    byte = tl.load(base[:, :, None] + 6 + t).to(tl.uint32)  # (BN, NB, 16)
    qh = (_u16(base + 2) | (_u16(base + 4) << 16))[:, :, None]  # bit j: 5th bit of elem j
    lo = (byte & 15) | (((qh >> t) & 1) << 4)
    hi = (byte >> 4) | (((qh >> (t + 16)) & 1) << 4)
    d = _f16(base)[:, :, None]
    return _columns(tl.fma(d, _float(lo), -16.0 * d), tl.fma(d, _float(hi), -16.0 * d), BN, BK)


@helper
def _tile_mxfp4(rows, k0, lut, BN: tl.constexpr, BK: tl.constexpr):
    base = _blocks32p(rows, k0, 17, BK)
    byte = tl.load(base[:, :, None] + 1 + tl.arange(0, 16)[None, None, :]).to(tl.int32)
    e = tl.load(base).to(tl.int32)  # e8m0 exponent; 2**(e - 128), subnormal below 2
    scale = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    scale = scale[:, :, None]  # halves the doubled E2M1 values of the code book
    return _columns(scale * _lookup(lut, byte & 15), scale * _lookup(lut, byte >> 4), BN, BK)


@helper
def _tile_iq4_xs(w_ptr, row_off, k0, lut, BN: tl.constexpr, BK: tl.constexpr):
    """136-byte super-blocks (8-byte aligned): d f16 and scales_h u16 in word 0, scales_l
    in word 1, qs[128] from byte 8; 32-element sub-block s has 16 code bytes."""
    sg = k0 // 32 + tl.arange(0, BK // 32)  # global 32-element sub-block index
    s = (sg % 8)[None, :]
    blk = row_off[:, None] + ((sg // 8) * 136)[None, :]  # (BN, NS)
    byte = tl.load((w_ptr + blk + 8 + s * 16)[:, :, None] + tl.arange(0, 16)[None, None, :])
    w0 = tl.load(_p32(w_ptr) + blk // 4)
    w1 = tl.load(_p32(w_ptr) + blk // 4 + 1)
    low = (w1 >> (4 * s).to(tl.uint32)) & 15  # nibble s % 2 of scales_l[s // 2]
    high = (w0 >> (16 + 2 * s).to(tl.uint32)) & 3  # bits 2 s of scales_h
    d = _f16lo(w0)
    dl = tl.fma(d, _float(low | (high << 4)), -32.0 * d)[:, :, None]
    byte = byte.to(tl.int32)
    return _columns(dl * _lookup(lut, byte & 15), dl * _lookup(lut, byte >> 4), BN, BK)


@helper
def _scales_k4(p32, blk, g4):
    """Q4_K/Q5_K: (d * sc, dmin * m) of sub-blocks 2 g4 and 2 g4 + 1 (g4: 64-column group
    in its super-block, 0..3; each (BN, G)), from the super-block's 16-byte aligned head:
    word 0 = d | dmin << 16, words 1-3 = scales[12]. Sub-block s < 4: sc = scales[s] & 63,
    m = scales[s + 4] & 63; s >= 4: the nibbles of scales[s + 4], the top two bits from
    scales[s - 4] and scales[s]."""
    j = tl.arange(0, 4)[None, None, :]
    head = tl.load((p32 + blk // 4)[:, :, None] + j)  # (BN, G, 4): one 16-byte load
    # Picked out by sums (a reduction is computed once, where its input lives, instead of
    # in every thread that holds the group's codes).
    wd = tl.sum(tl.where(j == 0, head, 0), axis=2)
    w1 = tl.sum(tl.where(j == 1, head, 0), axis=2)
    w2 = tl.sum(tl.where(j == 2, head, 0), axis=2)
    w3 = tl.sum(tl.where(j == 3, head, 0), axis=2)
    d = _f16lo(wd)
    dmin = _f16lo(wd >> 16)
    s0 = (2 * g4).to(tl.uint32)
    sh0 = 8 * (s0 % 4)  # bit offset of byte s % 4 in its word, for s = 2 g4 and 2 g4 + 1
    sh1 = sh0 + 8
    upper = s0 >= 4
    sc0 = tl.where(upper, ((w3 >> sh0) & 15) | (((w1 >> (sh0 + 6)) & 3) << 4), (w1 >> sh0) & 63)
    sc1 = tl.where(upper, ((w3 >> sh1) & 15) | (((w1 >> (sh1 + 6)) & 3) << 4), (w1 >> sh1) & 63)
    mn0 = tl.where(upper, ((w3 >> (sh0 + 4)) & 15) | (((w2 >> (sh0 + 6)) & 3) << 4),
                   (w2 >> sh0) & 63)
    mn1 = tl.where(upper, ((w3 >> (sh1 + 4)) & 15) | (((w2 >> (sh1 + 6)) & 3) << 4),
                   (w2 >> sh1) & 63)
    return d * _float(sc0), dmin * _float(mn0), d * _float(sc1), dmin * _float(mn1)


@helper
def _tile_k4(w_ptr, row_off, k0, HAS_QH: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Q4_K (144-byte blocks) and Q5_K (176 bytes, with qh), both 16-byte aligned. Per
    64-column group g of a super-block: 32 code bytes, low nibbles = sub-block 2g, high
    nibbles = 2g + 1."""
    TS: tl.constexpr = 176 if HAS_QH else 144
    gg = k0 // 64 + tl.arange(0, BK // 64)  # global 64-column group
    g4 = (gg % 4)[None, :]
    blk = row_off[:, None] + ((gg // 4) * TS)[None, :]  # (BN, G) super-block offsets
    t = tl.arange(0, 32)[None, None, :]
    codes = w_ptr + blk + (48 if HAS_QH else 16) + g4 * 32
    byte = tl.load(codes[:, :, None] + t).to(tl.uint32)
    lo = byte & 15
    hi = byte >> 4
    if HAS_QH:  # bit s of qh[t]: the 5th bit of sub-block s, element t
        qh = tl.load((w_ptr + blk + 16)[:, :, None] + t).to(tl.uint32)
        qh = qh >> (2 * g4).to(tl.uint32)[:, :, None]
        lo = lo | ((qh & 1) << 4)
        hi = hi | ((qh & 2) << 3)
    dl0, ml0, dl1, ml1 = _scales_k4(_p32(w_ptr), blk, g4)
    w0 = tl.fma(dl0[:, :, None], _float(lo), -ml0[:, :, None])
    w1 = tl.fma(dl1[:, :, None], _float(hi), -ml1[:, :, None])
    return _columns(w0, w1, BN, BK)


@helper
def _tile_q6_k(w_ptr, row_off, k0, BN: tl.constexpr, BK: tl.constexpr):
    """128-column halves of 210-byte super-blocks (only 2-byte aligned: read as u32 words,
    see _words). In half h, element p * 32 + t (plane p = 0..3) has its low 4 bits in
    nibble p // 2 of ql[64 h + 32 (p % 2) + t] and its top 2 bits at bit 2 p of
    qh[32 h + t]; its 16-element sub-block 8 h + (p * 32 + t) // 16 has scale i8
    scales[...]. Four codes are assembled per word: byte j of word i holds t = 4 i + j."""
    NH: tl.constexpr = BK // 128
    if NH % 2 == 0:  # whole super-blocks: k0 // 128 is even, the halves alternate
        hg = (k0 // 256) * 2 + tl.arange(0, NH)  # global half index
    else:
        hg = k0 // 128 + tl.arange(0, NH)
    sb = row_off[:, None] + ((hg // 2) * 210)[None, :]  # (BN, NH) super-block offsets
    h = (hg % 2)[None, :]
    # u32 pointer to the aligned word at or before each super-block, and whether the
    # super-block starts 2 bytes into it (w_ptr is 4-byte aligned, offsets are even).
    p32 = _p32(w_ptr) + sb // 4
    shifted = (sb % 4) != 0
    pl = tl.arange(0, 2)[None, None, :, None]
    i = tl.arange(0, 8)[None, None, None, :]
    p4 = p32[:, :, None, None]  # (BN, NH, 2 planes, 8 words)
    s4 = shifted[:, :, None, None]
    wl = _words(p4 + (h * 16)[:, :, None, None] + pl * 8 + i, s4)  # ql[64 h + 32 pl + 4 i]
    wh = _words(p4 + (32 + h * 8)[:, :, None, None] + i, s4)  # qh[32 h + 4 i]
    c_lo = (wl & 0x0F0F0F0F) | (((wh >> (2 * pl)) & 0x03030303) << 4)  # plane pl
    c_hi = ((wl >> 4) & 0x0F0F0F0F) | (((wh >> (2 * pl + 4)) & 0x03030303) << 4)  # pl + 2
    c = tl.permute(tl.join(c_lo, c_hi), (0, 1, 4, 2, 3))  # (BN, NH, nibble, pl, word)
    q = tl.reshape(_float(_bytes(c)), (BN, NH, 8, 16))  # 16-element sub-blocks in order
    sw = p32[:, :, None] + (48 + h * 2)[:, :, None] + tl.arange(0, 2)[None, None, :]
    sc = _bytes(_words(sw, shifted[:, :, None]))  # (BN, NH, 8): scales[8 h ...]
    d = _f16lo(_words(p32 + 52, shifted))[:, :, None]  # the f16 at byte 208
    dl = tl.fma(d, _float(sc ^ 0x80), -128.0 * d)  # d * (i8 scale), exactly
    ndl = -32.0 * dl  # codes are q - 32
    return tl.reshape(tl.fma(dl[:, :, :, None], q, ndl[:, :, :, None]), (BN, BK))


@helper
def dequant_tile(QTYPE: tl.constexpr, w_ptr, row_off, k0, lut, BN: tl.constexpr,
                 BK: tl.constexpr):
    """(BN, BK) float32 weights of columns k0 .. k0 + BK of the rows at byte offsets
    `row_off` ((BN,) int64) from w_ptr (`lut`: the code book of IQ4_XS and MXFP4 as
    float32, unused by the other types)."""
    if QTYPE == 0 or QTYPE == 1 or QTYPE == 30:
        w = _tile_float(QTYPE, w_ptr + row_off, k0, BK)
    elif QTYPE == 8:
        w = _tile_q8_0(w_ptr + row_off, k0, BN, BK)
    elif QTYPE == 2:
        w = _tile_q4_0(w_ptr + row_off, k0, BN, BK)
    elif QTYPE == 6:
        w = _tile_q5_0(w_ptr + row_off, k0, BN, BK)
    elif QTYPE == 39:
        w = _tile_mxfp4(w_ptr + row_off, k0, lut, BN, BK)
    elif QTYPE == 23:
        w = _tile_iq4_xs(w_ptr, row_off, k0, lut, BN, BK)
    elif QTYPE == 12:
        w = _tile_k4(w_ptr, row_off, k0, False, BN, BK)
    elif QTYPE == 13:
        w = _tile_k4(w_ptr, row_off, k0, True, BN, BK)
    else:
        tl.static_assert(QTYPE == 14, "unsupported GGML type")
        w = _tile_q6_k(w_ptr, row_off, k0, BN, BK)
    return w


# The product step both qmatmul paths share. X_LEFT (per type, see qgemv.x_left): x is the
# matrix unit's left operand and the decoded weight tile the right one, which the compiler
# stores once per step to shared memory as is; otherwise the weight tile is the left
# operand, which on sm_90 reaches the unit's register layout through a shared-memory
# shuffle with two barriers per 16 columns. The accumulator is (BM, BN) with X_LEFT,
# else (BN, BM); every path of one type takes the same side, so a row's bits stay the same.

@helper
def acc_zeros(BM: tl.constexpr, BN: tl.constexpr, X_LEFT: tl.constexpr):
    if X_LEFT:
        acc = tl.full((BM, BN), 0.0, tl.float32)
    else:
        acc = tl.full((BN, BM), 0.0, tl.float32)
    return acc


@helper
def x_tile(x_ptr, rm, m_ok, stride_xm, k0, BK: tl.constexpr, X_LEFT: tl.constexpr):
    """x's rows `rm` over columns k0 .. k0 + BK: (BM, BK) with X_LEFT, else (BK, BM)."""
    k = k0 + tl.arange(0, BK)
    rows = x_ptr + rm.to(tl.int64) * stride_xm
    if X_LEFT:
        xt = tl.load(rows[:, None] + k[None, :], mask=m_ok[:, None], other=0.0)
    else:
        xt = tl.load(rows[None, :] + k[:, None], mask=m_ok[None, :], other=0.0)
    return xt


@helper
def mac(acc, xt, w, X_LEFT: tl.constexpr, DOT_F64: tl.constexpr):
    """acc + the product of the x tile and the (BN, BK) weight tile, in bf16 on the
    matrix unit with float32 sums. DOT_F64 (the interpreter, whose bf16 dot is wrong and
    whose float32 matmul sums in a tile-shape-dependent order): bf16 products have 16
    significant bits, so float64 sums them exactly, in any order."""
    wb = w.to(tl.bfloat16)
    xb = xt.to(tl.bfloat16)
    if DOT_F64:
        if X_LEFT:
            acc += tl.dot(xb.to(tl.float64), tl.trans(wb.to(tl.float64))).to(tl.float32)
        else:
            acc += tl.dot(wb.to(tl.float64), xb.to(tl.float64)).to(tl.float32)
    elif X_LEFT:
        acc += tl.dot(xb, tl.trans(wb))
    else:
        acc += tl.dot(wb, xb)
    return acc


@helper
def out_offsets(rm, rn, m_ok, N, X_LEFT: tl.constexpr):
    """Element offsets in the (M, N) output and the store mask, shaped like the
    accumulator."""
    if X_LEFT:
        offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
        mask = m_ok[:, None] & (rn < N)[None, :]
    else:
        offs = rm.to(tl.int64)[None, :] * N + rn[:, None]
        mask = m_ok[None, :] & (rn < N)[:, None]
    return offs, mask

