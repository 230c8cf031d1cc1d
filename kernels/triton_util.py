"""Optional Triton: the one place kernels import it from.

The CPU torch build does not bring Triton, so every kernel module imports `triton` and
`tl` from here and checks `HAS_TRITON` before launching; without Triton the modules still
import (the kernels are then never defined) and the torch references run.

Three ways a kernel runs:
- compiled, when its tensors live on a GPU (`triton.jit` as usual);
- interpreted, when its tensors live on the CPU in a process that imported Triton with
  TRITON_INTERPRET=1: the interpreter executes the same Python source with numpy, which
  is how CI checks kernel logic without a GPU (tests run it in a worker process);
- ahead of time (kernels/aot.py): `triton.compile` for a named target, no device needed.

On NVIDIA GPUs from sm_90 on, kernels with a `PDL` constexpr launch as programmatic
dependent launches inside CUDA graph captures, i.e. in decode steps (`launcher` adds the
flags): such a kernel may start while the one before it in the stream is still running,
and `await_inputs(PDL)` is where it waits for that kernel's results. Before that point a
kernel must write nothing and may read only what the previous kernel does not write:
weights, and what earlier kernels or copies wrote (a kernel starts only once the one
before it has passed its own wait, i.e. once every launch before that one has finished;
except after a kernel named in MBUFO_PDL_RELEASE_FIRST, `release_first`, whose next
kernel is a quantized product that reads only weights before its wait); after it,
everything. So a launch's start-up (and a matmul's first weight loads) overlaps
the previous kernel's tail. Every such kernel must reach `await_inputs` on every path:
the kernel after it waits only for it, and so, through its wait, for all before. ROCm has
no such launch; there `PDL` stays False and the call is nothing. MBUFO_PDL=0 turns it off.

Helpers called from inside kernels are declared with `helper` rather than `triton.jit`:
the interpreter resolves a nested call through the module's globals, where a plain
JITFunction refuses to run on the host; `helper` objects are JITFunctions to the compiler
and interpreted functions when the interpreter calls them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

try:  # pragma: no cover - exercised by whichever build is installed
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    HAS_TRITON = True
except ImportError:  # the CPU torch build: kernels fall back to their references
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "await_inputs",
    "cast_out",
    "SMLimits",
    "carveout_active",
    "carveout_for",
    "carveout_kernels",
    "carveout_setting",
    "takes_carveout",
    "compiled",
    "helper",
    "install_carveout",
    "interpreted",
    "interpreter_active",
    "jit",
    "launcher",
    "resident_programs",
    "next_pow2",
    "num_sms",
    "pdl_enabled",
    "pdl_launches",
    "release_first",
    "thread_flag",
    "tl",
    "triton",
]


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def num_sms(device: torch.device) -> int:
    """The multiprocessors (compute units on ROCm) of a GPU device; 0 for any other."""
    return torch.cuda.get_device_properties(device).multi_processor_count if \
        device.type == "cuda" else 0


if HAS_TRITON:

    class _Helper(JITFunction):
        """A device function that the interpreter can also call (see the module docstring)."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            # Only reached on the host, i.e. from an interpreted kernel (compiled kernels
            # inline helpers through the code generator). The kernel's call already
            # patched triton.language for the interpreter, so the rewritten function runs
            # directly; InterpretedFunction.__call__ would patch it again (milliseconds).
            return _interpreted_fn(self.fn).rewrite()(*args, **kwargs)

    @functools.cache
    def _interpreted_fn(fn: Callable) -> Any:
        _fix_scalar_index()
        return InterpretedFunction(fn)

    @functools.cache
    def _compiled_fn(fn: Callable) -> Any:
        return JITFunction(fn)

    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @_Helper
    def await_inputs(PDL: tl.constexpr, RELEASE_FIRST: tl.constexpr = False):
        """With PDL: wait until the previous kernel has finished and its writes are
        visible, then let the next kernel's programs start (they wait in turn). Nothing
        without (see the module docstring). Letting the next one start before the wait
        measured slower for every kernel (H200, q8 one stream: 311 tok/s against 343
        without PDL and 382 so): the kernels after it pile up, their waiting programs
        placed while the multiprocessors are busy; with no explicit start (only at each
        program's exit) 351. RELEASE_FIRST does that for one kernel (release_first): the
        next kernel's programs start while this one still waits, so that a product's
        programs load weights while the kernel two before runs (the attention before the
        o product's quantize_x). The next kernel must then read nothing before its own
        wait that any kernel still running writes: weights only."""
        if PDL:
            if RELEASE_FIRST:
                gdc_launch_dependents()
                gdc_wait()
            else:
                gdc_wait()
                gdc_launch_dependents()

    @_Helper
    def cast_out(y, ptr):
        """float32 y -> the element type of `ptr`, rounded to nearest even. bf16 is rounded
        on the bits: the interpreter's float32 -> bf16 conversion truncates."""
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = y.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return y.to(ptr.dtype.element_ty)

    @functools.lru_cache(maxsize=1)
    def _fix_scalar_index() -> None:
        """Let interpreted scalars index `range` under numpy >= 2.4.

        The interpreter keeps a scalar as a 1-element array and converts it with int(),
        which numpy 2.4 refuses for arrays with a dimension; `.item()` works for both.
        """
        from triton.runtime import interpreter

        original = interpreter._patch_lang_tensor

        def patch(tensor: Any, scope: Any) -> None:
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

        interpreter._patch_lang_tensor = patch


else:
    await_inputs = cast_out = None  # kernels are never defined without Triton


def kernels_run(device: torch.device) -> bool:
    """Whether a kernel launches for tensors on `device`: with Triton, on a GPU, or on the
    CPU under the interpreter (tests); otherwise the caller runs its torch reference."""
    return HAS_TRITON and (device.type != "cpu" or interpreter_active())


def interpreter_active() -> bool:
    """True when Triton was imported for its interpreter (TRITON_INTERPRET=1 at import).

    Interpreted kernels need Triton's own library functions (tl.zeros, tl.sum, ...) in
    their interpreted form, which Triton builds only at import under that variable;
    compiling (GPU, AOT) needs the opposite, so one process does one or the other.
    """
    return HAS_TRITON and isinstance(tl.zeros, InterpretedFunction)


def helper(fn: Callable) -> Any:
    """Decorator for device functions called from kernels; the identity without Triton."""
    return _Helper(fn) if HAS_TRITON else fn


def jit(fn: Callable | None = None, **options: Any) -> Any:
    """Decorator for kernels (`triton.jit`, `@jit(...)` with its options); the identity
    without Triton.

    Triton builds a kernel variant per class of each int argument (1, a multiple of 16,
    any other) and per pointer alignment, and a build stalls the step that first needs it
    (a second or so). Arguments that vary with the batch (a page table's width, a token
    count, a slice of per-token slots) are kept out of the specialization
    (`do_not_specialize`, `do_not_specialize_on_alignment`), so that the load-time warm-up
    (engine/runner.py) builds every variant a served step takes."""
    if fn is None:
        return lambda f: jit(f, **options)
    return triton.jit(fn, **options) if HAS_TRITON else fn


def interpreted(kernel: Any) -> Any:
    """The interpreted version of a kernel (runs on CPU tensors)."""
    if not interpreter_active():
        raise RuntimeError("Triton kernels run on CPU tensors only in a process that "
                           "imported Triton with TRITON_INTERPRET=1")
    return _interpreted_fn(kernel.fn)


def compiled(kernel: Any) -> Any:
    """The JITFunction of a kernel (for AOT compilation and GPU launches)."""
    if isinstance(kernel, JITFunction):
        return kernel
    return _compiled_fn(kernel.fn)


@functools.lru_cache(maxsize=16)
def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependent launches: CUDA builds of
    torch on sm_90 and later, unless MBUFO_PDL=0."""
    return (HAS_TRITON and device.type == "cuda" and torch.version.hip is None
            and os.environ.get("MBUFO_PDL", "1") != "0"
            and torch.cuda.get_device_capability(device)[0] >= 9)


class _PDLLaunch:
    """kernel[grid](...) with PDL=True and the launch flag added."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        run = self.kernel[grid]
        return lambda *args, **kwargs: run(*args, PDL=True, launch_pdl=True, **kwargs)


_PDL_EAGER = threading.local()  # pdl_launches' switch, per thread


@contextlib.contextmanager
def thread_flag(local: threading.local, name: str) -> Iterator[None]:
    """Within it `local.<name>` is True on this thread; after it, what it was (False when
    unset)."""
    before = getattr(local, name, False)
    setattr(local, name, True)
    try:
        yield
    finally:
        setattr(local, name, before)


def pdl_launches() -> contextlib.AbstractContextManager[None]:
    """Inside, this thread's launches take the programmatic dependent launch as inside a
    graph capture (where `pdl_enabled`): the load-time warm-up builds the PDL variants that
    graph captures of mixed steps would otherwise build while serving."""
    return thread_flag(_PDL_EAGER, "on")


RELEASE_FIRST_KERNELS = ("quantize_x", "gated_act")


def release_first(kernel: str) -> bool:
    """Whether `kernel` (one of RELEASE_FIRST_KERNELS: the kernels right before a
    quantized product, which reads only weights before its wait) lets the next kernel
    start before its own wait (await_inputs' RELEASE_FIRST): named in
    MBUFO_PDL_RELEASE_FIRST (comma-separated; default none)."""
    return kernel in _release_first_names(os.environ.get("MBUFO_PDL_RELEASE_FIRST", ""))


@functools.lru_cache(maxsize=8)
def _release_first_names(value: str) -> frozenset[str]:
    """MBUFO_PDL_RELEASE_FIRST's names, checked; parsed once a value (release_first runs at
    every launch of those kernels)."""
    names = frozenset(n.strip() for n in value.split(",") if n.strip())
    unknown = names - set(RELEASE_FIRST_KERNELS)
    if unknown:
        raise ValueError(f"MBUFO_PDL_RELEASE_FIRST: unknown kernel(s) {sorted(unknown)}; "
                         f"known: {', '.join(RELEASE_FIRST_KERNELS)}")
    return names


def launcher(kernel: Any, device: torch.device) -> Any:
    """What to launch for tensors on `device`: compiled on a GPU, interpreted on the CPU;
    a kernel with a `PDL` parameter launches as a programmatic dependent launch where
    `pdl_enabled`, in CUDA graph captures only (decode steps: eager prefill steps were
    2.4x slower with it on the bf16 layout, whose cuBLAS kernels let ours start early and
    take the multiprocessors they still needed)."""
    if device.type == "cpu":
        return interpreted(kernel)
    install_carveout()
    fn = compiled(kernel)
    if "PDL" in fn.arg_names and pdl_enabled(device) and (
            torch.cuda.is_current_stream_capturing() or getattr(_PDL_EAGER, "on", False)):
        return _PDLLaunch(fn)
    return fn


# The shared-memory carveout (NVIDIA): a multiprocessor splits its on-chip memory between
# L1 and shared memory, and changes the split only when idle. Within a decode graph's
# programmatic dependent launches multiprocessors seldom idle, so a split taken for one
# kernel (the attention's shared memory) can stay for the kernels after it (bench/RESULTS.md,
# 2026-12-02: one stream 377 against 466 tok/s when the o product directly followed the
# attention, 474 with a carveout of 15% for every kernel). MBUFO_CARVEOUT=P (off: the
# driver's; unset: DEFAULT_CARVEOUT) gives the kernels of MBUFO_CARVEOUT_KERNELS (unset:
# DEFAULT_CARVEOUT_KERNELS; `all`: every one) of at most SMALL_SHARED bytes of shared
# memory the preferred carveout P (percent of the most shared memory), raised to what
# their resident programs need: a carveout below that cuts the programs a multiprocessor
# holds. 15% for every small kernel cost 16 streams 3% (3425 against 3538 tok/s), in the
# norm and activation kernels between the matrix-unit products; for the one-row products
# and the attention alone, with the attention quantizing for the o product (which the
# setting turns on at one row: engine/layers/attention.py), one stream gains 1.6% (486.0
# against 477.3 and 479.0) and 16 and 64 streams lose nothing (3551.5 against 3545.1,
# 7988 steady against 7998 and 7939; bench/RESULTS.md, 2026-12-03). The larger kernels
# keep what Triton sets (shared memory preferred).
DEFAULT_CARVEOUT = 15
DEFAULT_CARVEOUT_KERNELS = frozenset({"_qint_gemv_kernel", "_attn_partial_kernel",
                                      "_attn_merge_kernel"})
SMALL_SHARED = 48 * 1024
SHARED_RESERVED = 1024  # the shared memory a program takes besides its own (sm_80 on)


def carveout_kernels(raw: str | None) -> frozenset[str] | None:
    """MBUFO_CARVEOUT_KERNELS: the Triton kernels (comma-separated function names, such as
    `_qint_gemv_kernel,_attn_partial_kernel`) that take MBUFO_CARVEOUT; unset or empty:
    DEFAULT_CARVEOUT_KERNELS (the one-row products and the decode attention); `all`:
    None, every kernel of at most SMALL_SHARED bytes of shared memory. With the carveout on
    every small kernel, 16 streams lose it in the norm and the activation kernels between
    the matrix-unit products (bench/RESULTS.md, 2026-12-03)."""
    if raw is not None and raw.strip().lower() == "all":
        return None
    names = frozenset(n.strip() for n in (raw or "").split(",") if n.strip())
    bad = sorted(n for n in names if not re.fullmatch(r"_[A-Za-z0-9_]+_kernel", n))
    if bad:
        raise ValueError(f"MBUFO_CARVEOUT_KERNELS: {bad} are not Triton kernel names "
                         "(_name_kernel, comma-separated)")
    return names or DEFAULT_CARVEOUT_KERNELS


def takes_carveout(name: str, only: frozenset[str] | None) -> bool:
    """Whether the loaded kernel `name` is one install_carveout sets (carveout_kernels'
    names; None: every one, carveout_for then deciding by its shared memory)."""
    return only is None or name in only


def carveout_setting(raw: str | None) -> int | None:
    """MBUFO_CARVEOUT's value: None for "off" (the driver chooses), DEFAULT_CARVEOUT when
    unset or empty, else a whole percentage 0..100; a clear error for anything else."""
    if raw is None or not raw.strip():
        return DEFAULT_CARVEOUT
    if raw.strip().lower() == "off":
        return None
    raw = raw.strip()
    if not raw.isdigit() or int(raw) > 100:
        raise ValueError(f"MBUFO_CARVEOUT must be off or a whole percentage 0..100 of the "
                         f"most shared memory, got {raw!r}")
    return int(raw)


@dataclass(frozen=True, slots=True)
class SMLimits:
    """What a multiprocessor holds (the H100/H200's by default)."""
    shared: int = 228 * 1024
    regs: int = 65536
    warps: int = 64
    programs: int = 32


def resident_programs(regs: int, num_warps: int, shared: int, sm: SMLimits) -> int:
    """Programs of `num_warps` warps and `regs` registers a thread a multiprocessor holds
    by registers (allocated 256 a warp at a time), warps and program slots, with its
    shared memory all given to shared (`shared` bytes each, SHARED_RESERVED besides)."""
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = (sm.regs // per_warp) // num_warps
    by_shared = sm.shared // (shared + SHARED_RESERVED)
    return max(1, min(sm.programs, sm.warps // num_warps, by_regs, by_shared))


def carveout_for(shared_bytes: int, percent: int | None, regs: int = 0, num_warps: int = 4,
                 sm: SMLimits = SMLimits()) -> int | None:
    """The carveout to set for a kernel of `shared_bytes` shared memory, `regs` registers a
    thread on `num_warps` warps: `percent` for the small ones, raised to the least that
    holds as many of its programs as all of the shared memory would; None (leave it) for
    the others or without a setting."""
    if percent is None or shared_bytes > SMALL_SHARED:
        return None
    need = resident_programs(regs, num_warps, shared_bytes, sm) * (shared_bytes + SHARED_RESERVED)
    return min(100, max(percent, -(-need * 100 // sm.shared)))


def _kernel_meta(metadata_group: dict) -> tuple[int, int]:
    """A loaded kernel's shared memory in bytes and warps, from its metadata file;
    unknown: the most shared memory."""
    import json

    path = next((p for name, p in (metadata_group or {}).items() if name.endswith(".json")),
                None)
    try:
        with open(path) as f:
            meta = json.load(f)
        return int(meta["shared"]), int(meta.get("num_warps", 4))
    except (TypeError, OSError, ValueError, KeyError):
        return 1 << 30, 4


def carveout_active() -> bool:
    """Whether MBUFO_CARVEOUT takes effect here: set (on by default), on NVIDIA (CUDA builds
    of torch with a GPU; ROCm has no carveout)."""
    return torch.cuda.is_available() and torch.version.hip is None and \
        carveout_setting(os.environ.get("MBUFO_CARVEOUT")) is not None


@functools.lru_cache(maxsize=1)
def install_carveout() -> int | None:
    """Sets MBUFO_CARVEOUT on the Triton kernels of MBUFO_CARVEOUT_KERNELS loaded from now
    on (where carveout_active; once a process). Returns the percentage, or None where
    nothing is set."""
    percent = carveout_setting(os.environ.get("MBUFO_CARVEOUT"))
    only = carveout_kernels(os.environ.get("MBUFO_CARVEOUT_KERNELS"))
    if not HAS_TRITON or not carveout_active():
        return None
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    attribute = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    num_regs = 4  # CU_FUNC_ATTRIBUTE_NUM_REGS
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    sm = SMLimits(
        shared=int(getattr(props, "shared_memory_per_multiprocessor", 0) or SMLimits.shared),
        regs=int(getattr(props, "regs_per_multiprocessor", 0) or SMLimits.regs),
        warps=int(getattr(props, "max_threads_per_multi_processor", 0) or 2048) // 32)

    def on_load(module: Any, function: Any, name: str, metadata_group: dict,
                hash: str, **_: Any) -> None:
        if function is None or not takes_carveout(name, only):
            return
        shared, warps = _kernel_meta(metadata_group)
        regs = ctypes.c_int(0)
        if cuda.cuFuncGetAttribute(ctypes.byref(regs), num_regs, ctypes.c_void_p(function)):
            regs.value = 255  # unknown: the most, so the fewest programs
        value = carveout_for(shared, percent, regs.value, warps, sm)
        if value is None:
            return
        err = cuda.cuFuncSetAttribute(ctypes.c_void_p(function), attribute, ctypes.c_int(value))
        if err:
            raise RuntimeError(f"MBUFO_CARVEOUT: cuFuncSetAttribute failed for {name} "
                               f"(CUresult {err})")

    triton.knobs.runtime.kernel_load_end_hook.add(on_load)
    return percent
