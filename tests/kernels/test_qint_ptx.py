"""The PTX that decodes Q6_K codes four to a word (kernels/qint.py's `_q6_codes_asm`:
qint's Triton tile takes the signed codes, kernels/qint_mma.py's Gluon kernels the
unsigned ones), evaluated here instruction by instruction on the CPU and held against
gguf-py's dequantization of the same super-blocks: CI runs neither the NVIDIA build nor
Gluon, so this is where a wrong shift or mask in the assembly shows before a GPU run."""

from __future__ import annotations

import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from kernels import qint_mm

MASK = 0xFFFFFFFF


def run_ptx(asm: str, args: list[int]) -> int:
    """Evaluates a `{ .reg .b32 ...; op d, s, t; ... }` block of 32-bit logic, shifts,
    moves and low multiplies; $1.. are `args`, the result is $0."""
    regs = {f"${i + 1}": v & MASK for i, v in enumerate(args)}
    body = asm.strip().removeprefix("{").removesuffix("}")
    for stmt in (s.strip() for s in body.split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        dst, *src = (t.strip() for t in rest.split(","))
        vals = [int(s, 0) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", s) else regs[s]
                for s in src]
        name = op.split(".")[0]
        if name == "and":
            out = vals[0] & vals[1]
        elif name == "or":
            out = vals[0] | vals[1]
        elif name == "xor":
            out = vals[0] ^ vals[1]
        elif name == "shr":  # .b32 / .u32: logical
            assert op in ("shr.b32", "shr.u32"), op
            out = vals[0] >> vals[1]
        elif name == "shl":
            out = vals[0] << vals[1]
        elif name == "mov":
            out = vals[0]
        elif name == "mul":
            assert op == "mul.lo.u32", op
            out = vals[0] * vals[1]
        else:
            raise AssertionError(f"no evaluation of {op}")
        regs[dst] = out & MASK
    return regs["$0"]


def word(b: np.ndarray) -> int:
    return int(b.astype(np.uint32) @ (1 << (8 * np.arange(4, dtype=np.uint32))))


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_q6k_code_words_match_gguf_py(signed):
    """Random Q6_K super-blocks with d = 1 and every scale 1 dequantize to q - 32; each run
    j of each half h: the word of ql bytes 64 h + 32 (j % 2) + l and qh bytes 32 h + l (l
    four at a time) decodes to the codes of elements 128 h + 32 j + l, minus 32 when
    signed (as int8 bytes)."""
    rng = np.random.default_rng(5)
    block = rng.integers(0, 256, (4, 210), dtype=np.uint8)
    block[:, 192:208] = 1  # the 16 int8 scales
    block[:, 208:210] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    q = dequantize(block, T.Q6_K).reshape(4, 256).astype(np.int64) + 32  # 0..63
    assert q.min() >= 0 and q.max() <= 63
    for b in range(4):
        ql, qh = block[b, :128], block[b, 128:192]
        for h in range(2):
            for j in range(4):
                asm = qint_mm._q6_codes_asm(j, signed)
                for l0 in range(0, 32, 4):
                    lo = ql[64 * h + 32 * (j % 2) + l0:][:4]
                    hi = qh[32 * h + l0:][:4]
                    out = run_ptx(asm, [word(lo), word(hi)])
                    got = np.array([(out >> (8 * i)) & 255 for i in range(4)], np.int64)
                    want = q[b, 128 * h + 32 * j + l0:][:4] - 32 * signed
                    assert (got == want % 256).all(), (b, h, j, l0, got, want)
