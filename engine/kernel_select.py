"""One switch for the kernel path: Triton kernels (kernels/) or their torch references.

`MBUFO_KERNELS=auto|triton|torch`, read once per process (the first call):
- auto (default): Triton on a GPU when Triton imports; the torch references on the CPU;
- triton: always the Triton kernels; on the CPU only in a process that imported Triton
  for its interpreter (TRITON_INTERPRET=1), which is how CI runs them without a GPU;
- torch: always the references (the GPU then runs torch matmuls and the per-row
  reference attention, which synchronizes with the host, so no CUDA graphs either).
"""

from __future__ import annotations

import functools
import os

import torch

from engine.errors import InvalidRequest
from kernels.triton_util import HAS_TRITON, interpreter_active

ENV_VAR = "MBUFO_KERNELS"
MODES = ("auto", "triton", "torch")


_forced: list[str] = []  # set_mode's override, if any


@functools.cache
def _env_mode() -> str:
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise InvalidRequest(f"{ENV_VAR}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def kernel_mode() -> str:
    """The mode in force: set_mode's, else the environment's (read once); raises
    InvalidRequest for an unknown value."""
    return _forced[-1] if _forced else _env_mode()


def set_mode(mode: str | None) -> None:
    """Force `mode` in this process (tests, benchmarks); None: the environment's again,
    read anew."""
    if mode is not None and mode not in MODES:
        raise InvalidRequest(f"kernel mode {mode!r}: expected one of {', '.join(MODES)}")
    _forced.clear()
    _env_mode.cache_clear()
    if mode is not None:
        _forced.append(mode)


def use_triton(device: torch.device) -> bool:
    """Whether kernels on tensors of `device` run the Triton kernels.

    Raises InvalidRequest when `triton` is forced where no kernel can run.
    """
    mode = kernel_mode()
    if mode == "torch":
        return False
    if mode == "auto":
        return HAS_TRITON and device.type == "cuda"
    if not HAS_TRITON or (device.type == "cpu" and not interpreter_active()):
        raise InvalidRequest(f"{ENV_VAR}=triton needs Triton and a GPU, or TRITON_INTERPRET=1 "
                             f"on the CPU (device {device}, Triton "
                             f"{'present' if HAS_TRITON else 'absent'})")
    return True
