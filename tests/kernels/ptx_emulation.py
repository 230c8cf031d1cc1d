"""kernels/qint.py's NVIDIA (PTX) branch of the one-row product run in the interpreter:
its inline dp4a instructions evaluated with numpy. CI has no NVIDIA GPU and Triton's
interpreter refuses inline assembly, so without this the branch that the H200 runs (the
dp4a chains through their accumulators, the high nibbles multiplied in place) would only
be checked on a device. Called in the interpreter's worker (tests/kernels/kernel_worker.py).
"""

from __future__ import annotations

import numpy as np

# the instructions the one-row product's PTX branch emits, and the signedness of a's bytes
DP4A = {"dp4a.s32.s32 $0, $1, $2, $3;": True, "dp4a.u32.s32 $0, $1, $2, $3;": False}


def _bytes(v: np.ndarray, signed: bool) -> list[np.ndarray]:
    u = v.astype(np.int64) & 0xFFFFFFFF
    out = [(u >> (8 * i)) & 0xFF for i in range(4)]
    return [(b ^ 0x80) - 0x80 for b in out] if signed else out


def dp4a(asm: str, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """The int32 result of `asm` (one of DP4A) on int32 arrays: c plus the sum of the
    products of a's bytes (signed or not, as the instruction says) and b's signed bytes,
    wrapped to 32 bits."""
    total = sum(x * y for x, y in zip(_bytes(a, DP4A[asm]), _bytes(b, True), strict=True))
    total = total + c.astype(np.int64)
    return ((total + 2**31) % 2**32 - 2**31).astype(np.int32)


def _inline_asm(self, inlineAsm, constraints, values, type, isPure, pack):  # noqa: A002
    from triton.runtime.interpreter import TensorHandle

    asm = " ".join(inlineAsm.split())
    if asm not in DP4A:
        raise NotImplementedError(f"no emulation of inline asm {asm!r}")
    data = [v.data for v in values]
    out = dp4a(asm, *data)
    ty = type[0]  # one result
    return _Call(TensorHandle(np.broadcast_to(out, data[0].shape).copy(),
                              getattr(ty, "scalar", ty)))


class _Call:
    """What the interpreter's inline_asm_elementwise takes from the builder: results."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def get_result(self, i: int):
        assert i == 0
        return self.handle


def qint_with_ptx(*args, **kwargs):
    """kernels.qint.qint_triton(*args, **kwargs) down its NVIDIA branch (PTX=True)."""
    from triton.runtime import interpreter

    from kernels import qint

    builder, chooser = interpreter.InterpreterBuilder.create_inline_asm, qint.ptx
    interpreter.InterpreterBuilder.create_inline_asm = _inline_asm
    qint.ptx = lambda device: True
    try:
        return qint.qint_triton(*args, **kwargs)
    finally:
        interpreter.InterpreterBuilder.create_inline_asm = builder
        qint.ptx = chooser
