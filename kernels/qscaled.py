"""Q4_K's product step with the scales applied to the accumulator, for both qmatmul paths.

The generic step (kernels/qtiles.py) decodes every weight to float (`d * sc * q - dmin *
m`: a conversion and an fma per weight) and rounds it to bf16 before the matrix unit. Here
the matrix unit gets the 4-bit codes themselves, as 128 + q (exact in bf16), one 32-column
sub-block at a time, and the sub-block's scale dl and min ml go to the float32 sums:

    acc = fma(dot(128 + q_s, x_s), dl_s, acc);  acc = fma(-(128 dl_s + ml_s), sum(x_s), acc)

since dl (q + 128) x - (128 dl + ml) x = (dl q - ml) x. sum(x_s) is taken on the matrix
unit too (a tile of ones times x_s, every row the same), so its order of additions is the
instruction's, not the register layout's. Both paths run this sequence with the same
instruction, so a row's bits do not depend on M (qmatmul.py's batch invariance); the codes
are exact and the scales float32, so the result is within float32 rounding of gguf-py's
product (about 1e-7 relative on the H200, against 2e-4 with bf16-rounded weights).

Codes to bf16: with PTX (NVIDIA) four bytes at a time in a few instructions (`_NIB_LO`,
`_NIB_HI`: prmt + lop3 per pair); elsewhere (ROCm, the interpreter) by a float conversion
of the same exact value. Measured on the H200 (bench/RESULTS.md, 2026-11-30): 2-8% faster
than the generic step at 1 and 16 rows (96 registers a thread instead of 128), 6-35%
slower at 64-512 rows (the fmas per output element and sub-block). Weight on the left:
acc is (BN, BM), as for the generic step without X_LEFT.
"""

from __future__ import annotations

from kernels.qtiles import _p32, _scales_k4, dequant_tile, mac, x_tile
from kernels.triton_util import HAS_TRITON, helper, tl


def nibble_asm(high: bool, top: int) -> str:
    """PTX for 4 code bytes in one register -> (top | nibble) of each as 16-bit values in
    two registers (pairs): prmt spreads bytes 0,1 (2,3) into the low bytes of 16-bit halves,
    lop3 keeps the low (`high`: the high) nibble and sets the upper byte to top's. With top
    0x4300 that is bf16 128 + n (here), with 0x6400 f16 1024 + n (kernels/qint.py): exact."""
    pair = f"0x{top:04X}{top:04X}"
    shift = "shr.b32 s, $2, 4;\n" if high else ""
    src = "s" if high else "$2"
    return ("{\n.reg .b32 s, t<2>;\n" + shift
            + f"prmt.b32 t0, {src}, 0, 0x4140;\nprmt.b32 t1, {src}, 0, 0x4342;\n"
            + f"lop3.b32 $0, t0, 0x000F000F, {pair}, 0xEA;\n"
            + f"lop3.b32 $1, t1, 0x000F000F, {pair}, 0xEA;\n}}")


if HAS_TRITON:  # the CPU torch build has no Triton: the module still imports
    _NIB_LO = tl.constexpr(nibble_asm(False, 0x4300))
    _NIB_HI = tl.constexpr(nibble_asm(True, 0x4300))


@helper
def _nibbles(byte, HIGH: tl.constexpr, PTX: tl.constexpr):
    """u8 code bytes -> 128 + their low (high) nibble, in bf16 (exact)."""
    if PTX:
        out = tl.inline_asm_elementwise(_NIB_HI if HIGH else _NIB_LO, "=r,=r,r", [byte],
                                        dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        u = byte.to(tl.uint32)
        n = (u >> 4) if HIGH else (u & 15)
        out = (n.to(tl.float32) + 128.0).to(tl.bfloat16)
    return out


@helper
def _codes_k4(w_ptr, row_off, c0, BN: tl.constexpr, PTX: tl.constexpr):
    """The 64-column group at column c0 (a multiple of 64) of BN Q4_K rows: 128 + the codes
    of its two sub-blocks as (BN, 32) bf16, and their (BN,) scales and mins."""
    g = c0 // 64
    g4 = g % 4
    blk = row_off + (g // 4) * 144  # (BN,) super-block offsets
    t = tl.arange(0, 32)
    byte = tl.load((w_ptr + blk + 16 + g4 * 32)[:, None] + t[None, :])
    lo = _nibbles(byte, False, PTX)
    hi = _nibbles(byte, True, PTX)
    dl0, ml0, dl1, ml1 = _scales_k4(_p32(w_ptr), blk[:, None], g4)
    return (lo, hi, tl.reshape(dl0, (BN,)), tl.reshape(ml0, (BN,)), tl.reshape(dl1, (BN,)),
            tl.reshape(ml1, (BN,)))


@helper
def _sub_dot(a, b, DOT_F64: tl.constexpr):
    """dot(a, b) of bf16 (here) or f16 (kernels/qint.py: integer values, exact) tiles with
    float32 sums; float64 in the interpreter, whose 16-bit dots round (see qtiles.mac)."""
    if DOT_F64:
        out = tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
    else:
        out = tl.dot(a, b)
    return out


@helper
def mac_k4(acc, w_ptr, row_off, k0, x_ptr, rm, m_ok, stride_xm, BN: tl.constexpr,
           BK: tl.constexpr, BM: tl.constexpr, DOT_F64: tl.constexpr, PTX: tl.constexpr):
    """acc (BN, BM) + the product of BN Q4_K rows and x's rows `rm` over columns
    k0 .. k0 + BK (a multiple of 64)."""
    ones = tl.full((BN, 32), 1.0, tl.float32).to(tl.bfloat16)
    for i in tl.static_range(BK // 64):
        c0 = k0 + 64 * i
        lo, hi, dl0, ml0, dl1, ml1 = _codes_k4(w_ptr, row_off, c0, BN, PTX)
        x0 = x_tile(x_ptr, rm, m_ok, stride_xm, c0, 32, False).to(tl.bfloat16)  # (32, BM)
        x1 = x_tile(x_ptr, rm, m_ok, stride_xm, c0 + 32, 32, False).to(tl.bfloat16)
        # sum(x_s) in every row, in acc's layout (no cross-thread reduction)
        s0 = _sub_dot(ones, x0, DOT_F64)
        s1 = _sub_dot(ones, x1, DOT_F64)
        # codes + 128: dl (q + 128) x - (128 dl + ml) x = (dl q - ml) x
        acc = tl.fma(_sub_dot(lo, x0, DOT_F64), dl0[:, None], acc)
        acc = tl.fma(-tl.fma(dl0, 128.0, ml0)[:, None], s0, acc)
        acc = tl.fma(_sub_dot(hi, x1, DOT_F64), dl1[:, None], acc)
        acc = tl.fma(-tl.fma(dl1, 128.0, ml1)[:, None], s1, acc)
    return acc


@helper
def step(acc, QTYPE: tl.constexpr, w_ptr, row_off, k0, lut, x_ptr, rm, m_ok, stride_xm,
         BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, X_LEFT: tl.constexpr,
         DOT_F64: tl.constexpr, PTX: tl.constexpr):
    """One BK-column step of both qmatmul kernels: Q4_K's scaled step, else the generic
    one (kernels/qtiles.py)."""
    if QTYPE == 12:  # Q4_K
        tl.static_assert(not X_LEFT, "Q4_K's scaled step takes the weights on the left")
        acc = mac_k4(acc, w_ptr, row_off, k0, x_ptr, rm, m_ok, stride_xm, BN, BK, BM, DOT_F64,
                     PTX)
    else:
        w = dequant_tile(QTYPE, w_ptr, row_off, k0, lut, BN, BK)
        xt = x_tile(x_ptr, rm, m_ok, stride_xm, k0, BK, X_LEFT)
        acc = mac(acc, xt, w, X_LEFT, DOT_F64)
    return acc
