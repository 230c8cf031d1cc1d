"""Q4_K and Q6_K products with 8-bit activations: exact integer sums per super-block.

The bf16 kernels (kernels/qmatmul.py) must run one matrix instruction family on every path
to keep a row's bits independent of M, because float sums depend on their order. Here x
is quantized per 256-column super-block (the weight's block) to integers, so every
super-block's product is an exact integer and its order of additions does not matter:
CUDA cores at one row, the matrix unit at many, any split of the work, the same bits. The
float part is two fmas per (row, super-block), in K order on every path.

x's quantization (`quantize_x_reference` is the definition): per row and super-block,
a = max |x|, id = 127 / a and dx = a / 127 (float32, correctly rounded; both 0 where
a = 0), q = floor(fma(x, id, 0.5)) in -127 .. 127. Then, with the GGUF codes and scales:
- Q4_K: isum = sum over sub-blocks s of sc_s * dot(q4_s, q_s) and msum = sum of
  m_s * sum(q_s); acc = fma(isum, d * dx, acc); acc = fma(-msum, dmin * dx, acc);
- Q6_K: isum = sum over s of sc_s * (dot(q6_s, q_s) - 32 sum(q_s)) (q6 the unsigned 6-bit
  code); acc = fma(isum, d * dx, acc).
|isum| < 2^29 for both (int32); gguf-py's dequantized weights times dx * q in float64 are
the independent reference.

The x quantization costs accuracy: q carries about 8 bits per element relative to the
block's largest, as llama.cpp's own quantized-activation kernels (q8_1, q8_K).

`_qint_gemv_kernel` is the decode path without the matrix unit: a program owns BLOCK_N
weight rows and one of `split` equal super-block ranges, quantizes the x super-block
itself (every program the same bits, no extra launch) and multiplies on the CUDA cores,
for up to BLOCK_M (a power of two, at most 16) rows of x.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from engine.errors import InvalidRequest
from kernels.qtiles import Q4_K, Q6_K, _bytes, _f16, _f16lo, _p32, _words
from kernels.triton_util import HAS_TRITON, helper, launcher, next_pow2, tl, triton

__all__ = ["QINT_TYPES", "QIntConfig", "default_qint_config", "qint_reference",
           "qint_triton", "quantize_x_reference"]

QINT_TYPES = frozenset({Q4_K, Q6_K})
_TYPE_SIZE = {Q4_K: 144, Q6_K: 210}
QK = 256  # columns per super-block, and per x scale


class QIntConfig(NamedTuple):
    block_n: int
    split: int  # the super-blocks of a row are cut into `split` equal ranges
    num_warps: int = 4
    num_stages: int | None = None


def quantize_x_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (q (M, K) int32 in -127..127, dx (M, K / 256) float32), the definition
    above in float32 arithmetic (the fma through float64, exact for these operands)."""
    m, k = x.shape
    xb = x.to(torch.float32).reshape(m, k // QK, QK)
    a = xb.abs().amax(-1)
    pos = a > 0
    one = torch.ones_like(a)
    inv = torch.where(pos, torch.tensor(127.0) / torch.where(pos, a, one), 0.0)
    dx = torch.where(pos, a / torch.tensor(127.0), 0.0)
    # x * inv is exact in float64 (two 24-bit significands); + 0.5 is exact unless the
    # sum is below 1/2 in magnitude, where any rounding keeps floor() the same.
    v = (xb.double() * inv.double()[..., None] + 0.5).to(torch.float32)
    q = torch.floor(v).clamp(-127, 127).to(torch.int32)
    return q.reshape(m, k), dx


def qint_reference(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int,
                   shape: tuple[int, int]) -> torch.Tensor:
    """The definition in float64: dequantize(blocks) (gguf-py) @ (dx * q).T."""
    from kernels.dequant import dequantize_reference  # needs gguf; the kernels do not

    q, dx = quantize_x_reference(x)
    m, k = q.shape
    xd = (q.double().reshape(m, k // QK, QK) * dx.double()[..., None]).reshape(m, k)
    w = dequantize_reference(blocks.reshape(-1), ggml_type, tuple(shape), torch.float64)
    return xd @ w.t()


if HAS_TRITON:

    @helper
    def _quantize(xa, xb):
        """Two float32 (BM, S, L) parts of the rows' super-block -> their int32 codes and
        the rows' (BM,) dx (the definition in the module docstring)."""
        a = tl.maximum(tl.max(tl.max(tl.abs(xa), axis=2), axis=1),
                       tl.max(tl.max(tl.abs(xb), axis=2), axis=1))
        pos = a > 0
        safe = tl.where(pos, a, 1.0)
        inv = tl.where(pos, tl.math.div_rn(tl.full(a.shape, 127.0, tl.float32), safe), 0.0)
        dx = tl.where(pos, tl.math.div_rn(a, tl.full(a.shape, 127.0, tl.float32)), 0.0)
        inv3 = inv[:, None, None]
        qa = tl.minimum(tl.maximum(tl.floor(tl.fma(xa, inv3, 0.5)), -127.0), 127.0)
        qb = tl.minimum(tl.maximum(tl.floor(tl.fma(xb, inv3, 0.5)), -127.0), 127.0)
        return qa.to(tl.int32), qb.to(tl.int32), dx

    @helper
    def _x_part(x_rows, m_ok, cols):
        """x at (BM, S, L) column offsets `cols` (1, S, L) of each row, as float32."""
        return tl.load(x_rows[:, None, None] + cols, mask=m_ok[:, None, None],
                       other=0.0).to(tl.float32)

    @helper
    def _sb_q4k(acc, w_ptr, row_off, sb, x_rows, m_ok):
        """acc (BN, BM) + super-block sb of BN Q4_K rows times x's rows."""
        blk = row_off + sb * 144  # (BN,) 16-byte aligned super-blocks
        g = tl.arange(0, 4)
        ll = tl.arange(0, 32)
        # 32 code bytes per 64-column group g: low nibbles sub-block 2g, high 2g + 1
        byte = tl.load((w_ptr + blk + 16)[:, None, None] + (g * 32)[None, :, None]
                       + ll[None, None, :]).to(tl.int32)  # (BN, 4, 32)
        lo = byte & 15
        hi = byte >> 4
        cols = (sb * 256 + g * 64)[None, :, None] + ll[None, None, :]
        qa, qb, dx = _quantize(_x_part(x_rows, m_ok, cols), _x_part(x_rows, m_ok, cols + 32))
        dot_a = tl.sum(lo[:, None, :, :] * qa[None, :, :, :], axis=3)  # (BN, BM, 4)
        dot_b = tl.sum(hi[:, None, :, :] * qb[None, :, :, :], axis=3)
        sum_a = tl.sum(qa, axis=2)[None, :, :]  # (1, BM, 4)
        sum_b = tl.sum(qb, axis=2)[None, :, :]
        # head: word 0 = d | dmin << 16, words 1-3 = scales[12] (see qtiles._scales_k4)
        j = tl.arange(0, 4)[None, :]
        head = tl.load((_p32(w_ptr) + blk // 4)[:, None] + j)  # (BN, 4)
        w0 = tl.sum(tl.where(j == 0, head, 0), axis=1)
        w1 = tl.sum(tl.where(j == 1, head, 0), axis=1)[:, None]
        w2 = tl.sum(tl.where(j == 2, head, 0), axis=1)[:, None]
        w3 = tl.sum(tl.where(j == 3, head, 0), axis=1)[:, None]
        s0 = (2 * g).to(tl.uint32)[None, :]
        sh0 = 8 * (s0 % 4)
        sh1 = sh0 + 8
        upper = s0 >= 4
        sc0 = tl.where(upper, ((w3 >> sh0) & 15) | (((w1 >> (sh0 + 6)) & 3) << 4),
                       (w1 >> sh0) & 63).to(tl.int32)
        sc1 = tl.where(upper, ((w3 >> sh1) & 15) | (((w1 >> (sh1 + 6)) & 3) << 4),
                       (w1 >> sh1) & 63).to(tl.int32)
        mn0 = tl.where(upper, ((w3 >> (sh0 + 4)) & 15) | (((w2 >> (sh0 + 6)) & 3) << 4),
                       (w2 >> sh0) & 63).to(tl.int32)
        mn1 = tl.where(upper, ((w3 >> (sh1 + 4)) & 15) | (((w2 >> (sh1 + 6)) & 3) << 4),
                       (w2 >> sh1) & 63).to(tl.int32)
        isum = tl.sum(sc0[:, None, :] * dot_a + sc1[:, None, :] * dot_b, axis=2)  # (BN, BM)
        msum = tl.sum(mn0[:, None, :] * sum_a + mn1[:, None, :] * sum_b, axis=2)
        d = _f16lo(w0)[:, None]
        dmin = _f16lo(w0 >> 16)[:, None]
        acc = tl.fma(isum.to(tl.float32), d * dx[None, :], acc)
        return tl.fma(-msum.to(tl.float32), dmin * dx[None, :], acc)

    @helper
    def _sb_q6k(acc, w_ptr, row_off, sb, x_rows, m_ok):
        """acc (BN, BM) + super-block sb of BN Q6_K rows times x's rows. A 210-byte
        super-block is 2-byte aligned: ql[128], qh[64] are read as aligned u32 words
        (joined from two where the block starts at 2 mod 4), scales[16] int8, d f16."""
        base = row_off + sb * 210  # (BN,) even
        shifted = (base % 4 != 0)[:, None]
        p = _p32(w_ptr) + (base // 4)[:, None]
        ql = _bytes(_words(p + tl.arange(0, 32)[None, :], shifted))  # (BN, 128)
        qh = _bytes(_words(p + 32 + tl.arange(0, 16)[None, :], shifted))  # (BN, 64)
        BN: tl.constexpr = ql.shape[0]
        ql = tl.reshape(ql, (BN, 2, 2, 32)).to(tl.int32)  # [h, a, l] = ql[64 h + 32 a + l]
        qh = tl.reshape(qh, (BN, 2, 1, 32)).to(tl.int32)  # [h, l] = qh[32 h + l]
        a2 = 2 * tl.arange(0, 2)[None, None, :, None]
        # element 128 h + 32 a + l (low) and 128 h + 64 + 32 a + l (high)
        q_lo = tl.reshape((ql & 15) | (((qh >> a2) & 3) << 4), (BN, 8, 16))
        q_hi = tl.reshape((ql >> 4) | (((qh >> (a2 + 4)) & 3) << 4), (BN, 8, 16))
        i = tl.arange(0, 8)
        sub = i + 4 * (i // 4)  # 16-element sub-block of q_lo[:, i]; q_hi's is sub + 4
        jj = tl.arange(0, 16)
        cols = (sb * 256 + sub * 16)[None, :, None] + jj[None, None, :]
        qa, qb, dx = _quantize(_x_part(x_rows, m_ok, cols), _x_part(x_rows, m_ok, cols + 64))
        dot_a = tl.sum(q_lo[:, None, :, :] * qa[None, :, :, :], axis=3)  # (BN, BM, 8)
        dot_b = tl.sum(q_hi[:, None, :, :] * qb[None, :, :, :], axis=3)
        sum_a = tl.sum(qa, axis=2)[None, :, :]
        sum_b = tl.sum(qb, axis=2)[None, :, :]
        sc_ptr = w_ptr + base[:, None] + 192 + sub[None, :]
        sc_a = tl.load(sc_ptr).to(tl.int8, bitcast=True).to(tl.int32)[:, None, :]
        sc_b = tl.load(sc_ptr + 4).to(tl.int8, bitcast=True).to(tl.int32)[:, None, :]
        isum = tl.sum(sc_a * (dot_a - 32 * sum_a) + sc_b * (dot_b - 32 * sum_b), axis=2)
        d = _f16(w_ptr + base + 208)[:, None]
        return tl.fma(isum.to(tl.float32), d * dx[None, :], acc)

    @triton.jit(do_not_specialize=["M", "N"])
    def _qint_gemv_kernel(
        x_ptr, w_ptr, out_ptr, M, N, row_bytes, sb_per_split, stride_xm,
        QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """out[split, m, n] = the product of x's row m and W's row n over the super-blocks
        of range `split` (grid: N tiles, splits)."""
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        row_off = tl.where(rn < N, rn, 0).to(tl.int64) * row_bytes  # past N: row 0
        x_rows = x_ptr + rm.to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        sb0 = split * sb_per_split
        for i in range(0, sb_per_split):
            if QTYPE == 12:  # Q4_K
                acc = _sb_q4k(acc, w_ptr, row_off, sb0 + i, x_rows, m_ok)
            else:
                acc = _sb_q6k(acc, w_ptr, row_off, sb0 + i, x_rows, m_ok)
        offs = split.to(tl.int64) * M * N + rm.to(tl.int64)[None, :] * N + rn[:, None]
        tl.store(out_ptr + offs, acc, mask=m_ok[None, :] & (rn < N)[:, None])


@functools.lru_cache(maxsize=4096)
def default_qint_config(ggml_type: int, m: int, n: int, k: int, num_sms: int = 0) -> QIntConfig:
    """16 rows a program, 4 warps; the super-blocks split while the N tiles alone give
    fewer than 8 programs per compute unit (num_sms 0: no split)."""
    sbs = k // QK
    split = 1
    tiles = -(-n // 16)
    while tiles * split < 8 * num_sms and sbs % (2 * split) == 0 and split < 16:
        split *= 2
    return QIntConfig(16, split)


def qint_triton(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, shape: tuple[int, int],
                config: QIntConfig | None = None) -> torch.Tensor:
    """y = x @ W.T (float32, (M, N)) for up to 16 rows of x (float32 or bf16, rows
    contiguous) with the 8-bit activations of the module docstring."""
    n, k = (int(s) for s in shape)
    m = x.shape[0]
    if int(ggml_type) not in QINT_TYPES:
        raise InvalidRequest(f"qint: no kernel for GGML type {ggml_type}")
    if x.dim() != 2 or x.shape[1] != k or k % QK or not 1 <= m <= 16 or x.stride(1) != 1:
        raise InvalidRequest(f"qint: x must be (1..16, {k}) with K a multiple of 256 and "
                             f"contiguous rows, got {tuple(x.shape)}")
    if tuple(blocks.shape) != (n, k // QK * _TYPE_SIZE[int(ggml_type)]) or blocks.data_ptr() % 4:
        raise InvalidRequest(f"qint: blocks must be ({n}, {k // QK * _TYPE_SIZE[ggml_type]}) "
                             "uint8 at a 4-byte aligned address")
    sms = (torch.cuda.get_device_properties(x.device).multi_processor_count
           if x.device.type == "cuda" else 0)
    cfg = config or default_qint_config(int(ggml_type), m, n, k, sms)
    if (k // QK) % cfg.split:
        raise InvalidRequest(f"qint: {cfg} does not divide {k // QK} super-blocks")
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    out = y if cfg.split == 1 else torch.empty(cfg.split, m, n, dtype=torch.float32,
                                               device=x.device)
    launcher(_qint_gemv_kernel, x.device)[(-(-n // cfg.block_n), cfg.split)](
        x, blocks, out, m, n, blocks.shape[1], k // QK // cfg.split, x.stride(0),
        QTYPE=int(ggml_type), BLOCK_M=next_pow2(m), BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, **({} if cfg.num_stages is None else
                                    {"num_stages": cfg.num_stages}))
    if cfg.split > 1:
        from kernels.qmatmul import sum_splits

        sum_splits(out, y)
    return y


def aot_specs(spec: type) -> list:
    """kernels/aot.py: the decode kernel of each type at one and at 16 rows (bf16 x)."""
    if not HAS_TRITON:
        return []
    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "out_ptr": "*fp32", "M": "i32", "N": "i32",
           "row_bytes": "i32", "sb_per_split": "i32", "stride_xm": "i32"}
    divisible = ("x_ptr", "w_ptr", "out_ptr", "row_bytes", "stride_xm")
    out = []
    for qtype, name in ((Q4_K, "Q4_K"), (Q6_K, "Q6_K")):
        for bm in (1, 16):
            cfg = default_qint_config(qtype, bm, 4096, 4096)
            consts = {"QTYPE": qtype, "BLOCK_M": bm, "BLOCK_N": cfg.block_n}
            out.append(spec(f"qint_{name}_m{bm}", _qint_gemv_kernel,
                            {**sig, **{k: "constexpr" for k in consts}}, consts,
                            cfg.num_warps, False, None, cfg.num_stages, divisible))
    return out
