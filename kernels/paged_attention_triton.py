"""The Triton side of kernels/paged_attention.py: the kernels, their launch and their AOT
specs. paged_attention() checks the inputs and picks this path or the float64 reference.

The partial kernel runs one work item (kernels/paged_attention_plan.py) per program and
one KV head per program along the second axis: the item's query tokens times the group's
query heads fill the MMA's M side, keys stream in BLOCK_N blocks with an online softmax in
base 2. It writes unnormalized partials (max, sum, acc) to the item's split slots; the
merge kernel combines each token's splits per head (BLOCK_S of them a load, in an order
fixed by their count) and applies the sinks. When every
token has one split and there are no sinks (short decode rows, prefill), the partial
kernel writes the output itself and the merge is not launched.

Rotated V formats (q8, q4: each 32-block of V stored times the Hadamard matrix H,
engine/kv/hadamard.py): with ROT_OUT whichever kernel writes the output (the partial one
when DIRECT, else the merge) rotates it back as it stores it (H is its own inverse), with
kernels/rotate.py's float64 butterfly on the float32 values, rounded once: the bits of
`rotate_exact`, row by row, no launch of its own, and no register more in the sm_90 or
gfx1151 builds (`python -m kernels.aot`). A rotated K's q arrives rotated (by
kernels/fused_rope.py as it stores K, else by kernels/paged_attention.py's launch):
rotating the loaded q tile in the partial kernel, in float64 or float32, took the sm_90
decode build from 185 registers to 255 and 32 bytes of spills, and the float64 one
spilled 20-28 VGPRs on gfx1151.
"""

from __future__ import annotations

import itertools

import torch

from engine.errors import InvalidRequest
from kernels.paged_attention_plan import FORMAT_IDS, AttnConfig, AttnPlan
from kernels.triton_util import HAS_TRITON, await_inputs, helper, jit, launcher, next_pow2, tl

if HAS_TRITON:
    from kernels.quant_x import QuantX, quantize_store
    from kernels.rotate import hadamard_blocks
else:
    from kernels.quant_x import QuantX

__all__ = ["aot_specs", "launch", "merge"]

_LOG2E = 1.4426950408889634
# The merge on a GPU: heads of one token a program, and splits a load
MERGE_HEADS, MERGE_SPLITS = 4, 8

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

    # the page table's width varies with the batch's longest row (engine_bench's build
    # log: a variant per class of it built while serving)
    @jit(do_not_specialize=["stride_pt"])
    def _attn_partial_kernel(
        q_ptr, k0_ptr, k1_ptr, v0_ptr, v1_ptr, pt_ptr, pos_ptr, work_ptr, tok_base_ptr,
        m_ptr, l_ptr, acc_ptr, stride_qt, stride_qh, stride_pt, qk_scale, softcap, window,
        xq_ptr, xdx_ptr, xbs_ptr,
        K_FMT: tl.constexpr, V_FMT: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr,
        D: tl.constexpr, DV: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
        PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DIRECT: tl.constexpr = False, PDL: tl.constexpr = False, QUANT: tl.constexpr = False,
        ROT_OUT: tl.constexpr = False,
    ):
        """Partials of one work item (program 0) and KV head (program 1); base-2 logits.
        DIRECT (every token in one split, no sinks): the output acc / l itself into acc_ptr,
        the merge's bits (its weights are exp2(0) = 1), and no merge launch; with QUANT
        (G * DV a multiple of 256) also quantized for kernels/qint.py (_quantize_out).
        ROT_OUT (with DIRECT): the output rotated as stored."""
        item = work_ptr + tl.program_id(0) * 6
        kvh = tl.program_id(1)
        # The work item and positions are the step's inputs, written before the kernels
        # before this one: read while the previous kernel (the K/V store) runs. (Reading
        # the pages a block ahead too cost the sm_90 build 176 bytes of spills.)
        row, q_begin, q_count = tl.load(item), tl.load(item + 1), tl.load(item + 2)
        key_lo, key_hi, split = tl.load(item + 3), tl.load(item + 4), tl.load(item + 5)
        r = tl.arange(0, BLOCK_M)
        ok = (r // G < q_count) & (r // G < BLOCK_M // G)  # row r: token r // G, head r % G
        t = q_begin + tl.where(ok, r // G, 0)
        h = kvh * G + r % G
        d = tl.arange(0, DP)
        pos = tl.load(pos_ptr + t, mask=ok, other=-1)
        pages = pt_ptr + row * stride_pt
        await_inputs(PDL)
        q = tl.load(q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                    mask=ok[:, None] & (d < D)[None, :], other=0.0).to(tl.float16)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
        acc = tl.full((BLOCK_M, DVP), 0.0, tl.float32)
        for start in range(key_lo, key_hi, BLOCK_N):
            kp = start + tl.arange(0, BLOCK_N)
            k_ok = kp < key_hi
            page = tl.load(pages + kp // PAGE, mask=k_ok, other=0)
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
        dv = tl.arange(0, DVP)
        if DIRECT:  # slot t: the token's row of out (T, H, Dv)
            acc = acc / tl.where(ok, l_i, 1.0)[:, None]
            if ROT_OUT:
                acc = _rotated(acc, BLOCK_M, DVP)
        else:
            tl.store(m_ptr + out, m_i, mask=ok)
            tl.store(l_ptr + out, l_i, mask=ok)
        tl.store(acc_ptr + out[:, None] * DV + dv[None, :], acc,
                 mask=ok[:, None] & (dv < DV)[None, :])
        if DIRECT and QUANT:  # the item's tokens' columns of this KV head
            for i in range(0, q_count):
                _quantize_out(acc_ptr, q_begin + i, kvh * (G * DV // 256), G * DV // 256,
                              xq_ptr, xdx_ptr, xbs_ptr, KVH * G * DV)

    @helper
    def _rotated(x, R: tl.constexpr, C: tl.constexpr):
        """(R, C) rows -> each 32-column block times H (float64, rounded to float32 once)."""
        blocks = tl.reshape(x.to(tl.float32), (R * C // 32, 32))
        return tl.reshape(hadamard_blocks(blocks, R * C // 32), (R, C))

    @helper
    def _quantize_out(out_ptr, tok, b0, NB: tl.constexpr, q_ptr, dx_ptr, bs_ptr,
                      K: tl.constexpr):
        """Super-blocks b0 .. b0 + NB - 1 of token tok's row of out (T, K), written by this
        program, quantized as kernels/quant_x.py's quantize_x (quantize_store): after the
        program's barrier, read back (L1) in 256-column blocks, no layout change of the
        accumulator in registers (which cost the decode build 168 registers against 96)."""
        tl.debug_barrier()
        b = b0 + tl.arange(0, NB)
        row = tok.to(tl.int64)
        x = tl.load(out_ptr + row * K + b[:, None] * 256 + tl.arange(0, 256)[None, :],
                    mask=(b < K // 256)[:, None], other=0.0)  # padded heads: no block
        quantize_store(x, b, b < K // 256, row, q_ptr, dx_ptr, bs_ptr, K)

    @jit(do_not_specialize=["num_tokens"])
    def _attn_merge_kernel(
        m_ptr, l_ptr, acc_ptr, tok_base_ptr, tok_splits_ptr, sink_ptr, out_ptr, num_tokens,
        xq_ptr, xdx_ptr, xbs_ptr,
        H: tl.constexpr, HB: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
        HAS_SINKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
        PDL: tl.constexpr = False, QUANT: tl.constexpr = False, ROT_OUT: tl.constexpr = False,
    ):
        """out[t, h] = the merge of token t's splits of head h, for BLOCK_T tokens times
        HB heads a program (row r: token r // HB, head r % HB). A row's splits are read
        BLOCK_S at a time (one load of their (BLOCK_S, Dv) partials, not one per split):
        the largest logit first, then the weighted sums. QUANT (HB * DV a multiple of
        256): also the program's columns of each token quantized for kernels/qint.py.
        ROT_OUT: out rotated (each 32-block times H) as stored, before the quantization."""
        r = tl.arange(0, BLOCK_T * HB)
        t = tl.program_id(0) * BLOCK_T + r // HB
        h = tl.program_id(1) * HB + r % HB
        ok = (t < num_tokens) & (h < H)
        await_inputs(PDL)
        base = tl.load(tok_base_ptr + t, mask=ok, other=0).to(tl.int64)
        num = tl.load(tok_splits_ptr + t, mask=ok, other=0)
        sp = tl.arange(0, BLOCK_S)
        dv = tl.arange(0, DVP)
        mx = tl.full((BLOCK_T * HB,), float("-inf"), tl.float32)
        for s0 in range(0, tl.max(num, 0), BLOCK_S):
            live = ok[:, None] & (s0 + sp[None, :] < num[:, None])  # (R, BS)
            idx = (base[:, None] + s0 + sp[None, :]) * H + h[:, None]
            mx = tl.maximum(mx, tl.max(tl.load(m_ptr + idx, mask=live, other=float("-inf")), 1))
        if HAS_SINKS:  # sink logits arrive in log2 units
            sink = tl.load(sink_ptr + h, mask=h < H, other=float("-inf"))
            mx = tl.maximum(mx, sink)
        mx = tl.where(mx == float("-inf"), 0.0, mx)  # padding only: a query sees itself
        den = tl.full((BLOCK_T * HB,), 0.0, tl.float32)
        acc = tl.full((BLOCK_T * HB, DVP), 0.0, tl.float32)
        for s0 in range(0, tl.max(num, 0), BLOCK_S):
            live = ok[:, None] & (s0 + sp[None, :] < num[:, None])
            idx = (base[:, None] + s0 + sp[None, :]) * H + h[:, None]
            w = tl.exp2(tl.load(m_ptr + idx, mask=live, other=float("-inf")) - mx[:, None])
            den += tl.sum(tl.load(l_ptr + idx, mask=live, other=0.0) * w, 1)
            a = tl.load(acc_ptr + idx[:, :, None] * DV + dv[None, None, :],
                        mask=live[:, :, None] & (dv < DV)[None, None, :], other=0.0)
            acc += tl.sum(a * w[:, :, None], 1)
        if HAS_SINKS:
            den += tl.exp2(sink - mx)
        den = tl.where(ok, den, 1.0)
        out = (t.to(tl.int64) * H + h)[:, None] * DV + dv[None, :]
        res = acc / den[:, None]
        if ROT_OUT:
            res = _rotated(res, BLOCK_T * HB, DVP)
        tl.store(out_ptr + out, res, mask=ok[:, None] & (dv < DV)[None, :])
        if QUANT:  # the program's heads: whole 256-column blocks of each of its tokens
            for i in tl.static_range(BLOCK_T):
                tok = tl.program_id(0) * BLOCK_T + i
                if tok < num_tokens:
                    _quantize_out(out_ptr, tok, tl.program_id(1) * (HB * DV // 256),
                                  HB * DV // 256, xq_ptr, xdx_ptr, xbs_ptr, H * DV)


def launch(q: torch.Tensor, planes: tuple[torch.Tensor, ...], formats: tuple[int, int],
           positions: torch.Tensor, page_table: torch.Tensor, page_size: int,
           params: tuple[float, int | None, float | None], sinks: torch.Tensor | None,
           plan: AttnPlan, cfg: AttnConfig, out: torch.Tensor,
           xq: QuantX | None = None, decode_cfg: AttnConfig | None = None,
           rotate_out: bool = False) -> None:
    """Both kernels (the partial one alone when every token has one split and there are no
    sinks), writing out (T, H, Dv) float32; planes are (k0, k1, v0, v1), formats the
    FORMAT_IDS of K and V, params (scale, window, softcap). Partial buffers are (slots, H)
    and (slots, H, Dv) float32. `xq` (G Dv a multiple of 256): also out quantized into it
    by the kernel that writes out. The plan's decode_work, if any, runs as a second partial
    launch with `decode_cfg` (into the same slots; one merge after both). `rotate_out`:
    out rotated back (a rotated V) by the kernel that writes it."""
    (num_tokens, num_heads, dim), dim_v, dev = q.shape, out.shape[2], q.device
    kv_heads = planes[0].shape[1]
    scale, window, softcap = params
    # one split a token and no sinks: the partial kernel writes out itself (no merge)
    direct = plan.num_slots == num_tokens and sinks is None and out.is_contiguous()
    if direct:
        m_part = l_part = acc_part = out
    else:
        m_part = torch.empty(plan.num_slots, num_heads, dtype=torch.float32, device=dev)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(plan.num_slots, num_heads, dim_v, dtype=torch.float32,
                               device=dev)
    table = page_table.to(device=dev, dtype=torch.int32).contiguous()
    pos32 = positions.to(device=dev, dtype=torch.int32)
    quant = (xq.q, xq.dx, xq.bs) if xq is not None else (out, out, out)
    parts = [(plan.work, cfg)]
    if plan.decode_work is not None:
        if decode_cfg is None:
            raise InvalidRequest("paged_attention: a plan with decode_work needs decode_cfg")
        parts.append((plan.decode_work, decode_cfg))
    for work, c in parts:
        if work.shape[0] == 0:
            continue
        launcher(_attn_partial_kernel, dev)[(work.shape[0], kv_heads)](
            q, *planes, table, pos32, work,
            plan.tok_base, m_part, l_part, acc_part, q.stride(0), q.stride(1), table.stride(0),
            scale * _LOG2E, float(softcap or 1.0), int(window or 0), *quant,
            K_FMT=formats[0], V_FMT=formats[1], KVH=kv_heads, G=num_heads // kv_heads, D=dim,
            DV=dim_v, DP=next_pow2(dim), DVP=next_pow2(dim_v), PAGE=page_size,
            HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, DIRECT=direct,
            QUANT=direct and xq is not None, ROT_OUT=direct and rotate_out,
            num_warps=c.num_warps,
            **({} if c.num_stages is None else {"num_stages": c.num_stages}),
        )
    if direct:
        return
    merge(m_part, l_part, acc_part, plan.tok_base, plan.tok_splits,
          None if sinks is None else (sinks.float() * _LOG2E).contiguous(), out, xq=xq,
          rotate_out=rotate_out)


def merge(m_part: torch.Tensor, l_part: torch.Tensor, acc_part: torch.Tensor,
          tok_base: torch.Tensor, tok_splits: torch.Tensor, sinks_log2: torch.Tensor | None,
          out: torch.Tensor, geometry: tuple[int, int] | None = None,
          xq: QuantX | None = None, rotate_out: bool = False) -> None:
    """The merge kernel: token t's partials at slots tok_base[t] .. + tok_splits[t] - 1 of
    m_part, l_part (slots, H) (log2 units) and acc_part (slots, H, Dv) -> out (T, H, Dv),
    with the sink logits (H,) in log2 units. `geometry` (tokens, heads) a program: by
    default on a GPU (1, MERGE_HEADS), a one-stream step's merge on many multiprocessors
    rather than one; the interpreter pays per program, so there it takes many. `xq`: out
    also quantized into it (each program's heads whole 256-column blocks); `rotate_out`:
    out's 32-blocks times H (rotated V)."""
    num_tokens, num_heads, dim_v = out.shape
    if geometry is None:
        geometry = ((16, next_pow2(num_heads)) if out.device.type == "cpu"
                    else (1, MERGE_HEADS))
    block_t, heads = geometry
    if xq is not None and (heads * dim_v) % 256:
        raise InvalidRequest(f"attention merge: {heads} heads of {dim_v} columns a program "
                             "are not whole 256-column blocks to quantize")
    quant = (xq.q, xq.dx, xq.bs) if xq is not None else (out, out, out)
    launcher(_attn_merge_kernel, out.device)[(-(-num_tokens // block_t),
                                              -(-num_heads // heads))](
        m_part, l_part, acc_part, tok_base, tok_splits,
        m_part if sinks_log2 is None else sinks_log2, out, num_tokens, *quant,
        H=num_heads, HB=heads, DV=dim_v, DVP=next_pow2(dim_v),
        HAS_SINKS=sinks_log2 is not None, BLOCK_T=block_t, BLOCK_S=MERGE_SPLITS,
        QUANT=xq is not None, ROT_OUT=rotate_out,
    )


def aot_specs(spec: type) -> list:
    """kernels/aot.py: every K/V format pair's loader at Llama-like shapes (GQA 4:1,
    head dim 128), one with window and softcap, decode steps'
    config (on "hip" the default's), also writing out quantized (and rotated back for a
    rotated V); the merge with and without sinks, and quantizing (rotated and not)."""
    if not HAS_TRITON:
        return []
    plane = {"f16": "*fp16", "q8": "*i8", "q4": "*u8"}
    sig = {"q_ptr": "*fp32", "k0_ptr": "", "k1_ptr": "*fp16", "v0_ptr": "", "v1_ptr": "*fp16",
           **{n: "*i32" for n in ("pt_ptr", "pos_ptr", "work_ptr", "tok_base_ptr")},
           **{n: "*fp32" for n in ("m_ptr", "l_ptr", "acc_ptr")},
           "stride_qt": "i32", "stride_qh": "i32", "stride_pt": "i32", "qk_scale": "fp32",
           "softcap": "fp32", "window": "i32", "xq_ptr": "*i8", "xdx_ptr": "*fp32",
           "xbs_ptr": "*i32"}
    out = []
    for (k_fmt, v_fmt, extras, decode), backend in itertools.product(
            (("f16", "f16", False, False), ("q8", "q8", True, False), ("q4", "q4", False, False),
             ("q8", "q4", False, False), ("f16", "f16", False, True), ("q8", "q8", False, True)),
            ("hip", "cuda")):
        cfg = (AttnConfig.decode if decode else AttnConfig.default)(4, 128, 128, backend)
        consts = {"K_FMT": FORMAT_IDS[k_fmt], "V_FMT": FORMAT_IDS[v_fmt], "KVH": 8, "G": 4,
                  "D": 128, "DV": 128, "DP": 128, "DVP": 128, "PAGE": 16,
                  "HAS_WINDOW": extras, "HAS_SOFTCAP": extras, "BLOCK_M": cfg.block_m,
                  "BLOCK_N": cfg.block_n, "PDL": backend == "cuda"}
        signature = {**sig, "k0_ptr": plane[k_fmt], "v0_ptr": plane[v_fmt],
                     **{k: "constexpr" for k in consts}}
        name = (f"paged_attention{'_decode' if decode else ''}_k{k_fmt}_v{v_fmt}"
                + ("_window_softcap" if extras else ""))
        out.append(spec(name, _attn_partial_kernel, signature, consts, cfg.num_warps, True,
                        backend, cfg.num_stages))
        if decode:  # the q8 layout's decode step: out quantized for o
            q_consts = {**consts, "DIRECT": True, "QUANT": True, "ROT_OUT": v_fmt != "f16"}
            out.append(spec(name + "_direct_q8", _attn_partial_kernel,
                            {**signature, **{k: "constexpr" for k in q_consts}},
                            q_consts, cfg.num_warps, True, backend, cfg.num_stages))
    for sinks in (False, True):
        consts = {"H": 32, "HB": MERGE_HEADS, "DV": 128, "DVP": 128, "HAS_SINKS": sinks,
                  "BLOCK_T": 1, "BLOCK_S": MERGE_SPLITS}
        signature = {**{n: "*fp32" for n in ("m_ptr", "l_ptr", "acc_ptr")},
                     "tok_base_ptr": "*i32", "tok_splits_ptr": "*i32", "sink_ptr": "*fp32",
                     "out_ptr": "*fp32", "num_tokens": "i32", "xq_ptr": "*i8",
                     "xdx_ptr": "*fp32", "xbs_ptr": "*i32", **{k: "constexpr" for k in consts}}
        out.append(spec(f"paged_attention_merge{'_sinks' if sinks else ''}", _attn_merge_kernel,
                        signature, consts, 4, False))
    for rot in (False, True):
        consts = {"H": 32, "HB": MERGE_HEADS, "DV": 128, "DVP": 128, "HAS_SINKS": False,
                  "BLOCK_T": 1, "BLOCK_S": MERGE_SPLITS, "QUANT": True, "ROT_OUT": rot}
        out.append(spec(f"paged_attention_merge{'_rot' if rot else ''}_q8", _attn_merge_kernel,
                        {**signature, "QUANT": "constexpr", "ROT_OUT": "constexpr"}, consts, 4,
                        False))
    return out
