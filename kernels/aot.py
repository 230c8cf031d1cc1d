"""Ahead-of-time compilation of every kernel for the appliance's chip and the lent GPU.

`triton.compile` needs no device: each kernel is built for `hip:gfx1151` (Strix Halo,
wave32) down to the hsaco and for `cuda:90` (Hopper) down to the cubin, with the
constexpr values the wrappers launch. A kernel that cannot build for a target fails here
instead of on the box. For gfx1151 the bf16/f16 `tl.dot` must lower to the RDNA 3.5 WMMA
instructions (`v_wmma_*` in the amdgcn), for sm_90 to tensor-core MMA (`mma`/`wgmma` in
the PTX); a silent fallback to scalar FMAs would cost 10x.

Run as `python -m kernels.aot [--target hip:gfx1151] [--only NAME]`: prints one JSON object.
It must run in a process that did not import Triton with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, NamedTuple

from kernels.triton_util import HAS_TRITON, compiled, interpreter_active, triton

__all__ = ["TARGETS", "KernelSpec", "build", "check_asm", "kernel_specs", "main"]

TARGETS = ("hip:gfx1151", "cuda:90")


class KernelSpec(NamedTuple):
    name: str
    kernel: Any  # the @triton.jit function
    signature: dict[str, str]  # argument -> Triton type ("*fp32", "i32", "constexpr")
    constexprs: dict[str, Any]
    num_warps: int
    uses_dot: bool  # expects tensor-core instructions in the output
    backend: str | None = None  # "hip" or "cuda": the config is that backend's; None: both
    num_stages: int | None = None
    divisible: tuple[str, ...] = ()  # arguments assumed 16-divisible, as the JIT specializes
    max_regs: int | None = None  # maxnreg of the cuda build (NVIDIA's register cap a thread)


def kernel_specs(quick: bool = False) -> list[KernelSpec]:
    """Every kernel at the configurations its wrapper launches. `quick` (CI) builds qmatmul's
    tiled kernel for every type, plus the skinny ones (kernels/qgemv.py) of Q4_K and Q6_K
    (the two operand sides): comparing their instructions checks the batch-invariance
    premise."""
    from kernels import (
        fused_norm,
        fused_rope,
        gated_act,
        gather_rows,
        kv_store,
        moe,
        moe_route,
        paged_attention,
        qgemv,
        qint,
        qint_mma,
        qmatmul,
        rotate,
    )

    specs = [*qgemv.aot_specs(KernelSpec), *qmatmul.aot_specs(KernelSpec),
             *paged_attention.aot_specs(KernelSpec), *qint.aot_specs(KernelSpec),
             *qint_mma.aot_specs(KernelSpec), *moe.aot_specs(KernelSpec),
             *moe_route.aot_specs(KernelSpec)]
    if not quick:  # CI builds these in tests/kernels/test_fused_aot.py (no dots to check)
        specs += [*fused_norm.aot_specs(KernelSpec), *fused_rope.aot_specs(KernelSpec),
                  *kv_store.aot_specs(KernelSpec), *gated_act.aot_specs(KernelSpec),
                  *gather_rows.aot_specs(KernelSpec), *rotate.aot_specs(KernelSpec)]
    if quick:  # q8 K and q4 V are each built in their own pair
        specs = [s for s in specs if not (s.name.endswith("_m16") and "Q4_K" not in s.name
                                          and "Q6_K" not in s.name
                                          or "_fma_" in s.name and "Q4_K" not in s.name)
                 and s.name != "paged_attention_kq8_vq4"]
    return specs


def _target(name: str) -> Any:
    from triton.backends.compiler import GPUTarget

    backend, arch = name.split(":")
    return GPUTarget(backend, int(arch) if backend == "cuda" else arch, 32)


def build(spec: KernelSpec, target: str) -> Any:
    """The CompiledKernel of `spec` for `target` (every stage, to the binary)."""
    names = list(spec.signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in spec.divisible}
    fn = compiled(spec.kernel)
    if getattr(fn, "is_gluon", lambda: False)():  # kernels/qint_mma.py (NVIDIA only)
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn, spec.signature, spec.constexprs, attrs)
    else:
        src = triton.compiler.ASTSource(fn, spec.signature, spec.constexprs, attrs)
    options: dict[str, int] = {"num_warps": spec.num_warps}
    if spec.num_stages is not None:
        options["num_stages"] = spec.num_stages
    if spec.max_regs is not None and target.startswith("cuda"):
        options["maxnreg"] = spec.max_regs
    return triton.compile(src, target=_target(target), options=options)


def check_asm(spec: KernelSpec, target: str, kernel: Any) -> dict[str, Any]:
    """What the build produced: stages, binary size, tensor-core instruction counts."""
    asm = kernel.asm
    info: dict[str, Any] = {"stages": sorted(asm), "problems": []}
    binary = asm.get("hsaco" if target.startswith("hip") else "cubin")
    info["binary_bytes"] = len(binary) if binary else 0
    if not binary:
        info["problems"].append("no binary")
    if target.startswith("hip"):
        amdgcn = asm.get("amdgcn", "")
        ops = re.findall(r"\bv_wmma_\w+", amdgcn)
        info["wmma"] = len(ops)
        info["ops"] = sorted(set(ops))
        # Spilled registers go to scratch memory: a performance problem, not an error.
        info["vgpr_spills"] = sum(int(n) for n in re.findall(r"vgpr_spill_count:\s+(\d+)", amdgcn))
        found = info["wmma"]
    else:
        ops = re.findall(r"\b(?:mma\.sync|wgmma\.mma_async)\.[\w.]+", asm.get("ptx", ""))
        # programmatic dependent launch (kernels/triton_util.py): the wait before the inputs
        info["gdc_waits"] = asm.get("ptx", "").count("griddepcontrol.wait")
        info["mma"] = len(ops)
        info["ops"] = sorted(set(ops))
        info.update(_cubin_resources(binary))
        found = info["mma"]
    if spec.uses_dot and not found:
        info["problems"].append("tl.dot did not lower to tensor-core instructions")
    return info


def cuobjdump(cubin: bytes | None, *args: str) -> str | None:
    """Triton's cuobjdump run with `args` on a cubin: its output, or None where it cannot
    run (no cubin, no tool, an error)."""
    try:
        tool = triton.knobs.nvidia.cuobjdump.path
    except Exception:  # an older Triton without the knob
        return None
    if not cubin or not tool or not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([tool, *args, f.name], capture_output=True, text=True,
                             timeout=60)
    return None if run.returncode else run.stdout


def _cubin_resources(cubin: bytes | None) -> dict[str, int]:
    """Registers a thread and stack bytes (spills) of a cubin, by Triton's cuobjdump; {}
    where it cannot tell."""
    out = cuobjdump(cubin, "--dump-resource-usage") or ""
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    if not regs or not stack:
        return {}
    return {"regs": int(regs.group(1)), "stack_bytes": int(stack.group(1))}


def _compile_one(index: int, target: str, quick: bool) -> dict[str, Any]:
    spec = kernel_specs(quick)[index]
    start = time.perf_counter()
    try:
        info = check_asm(spec, target, build(spec, target))
    except Exception as exc:  # report every failure, not only the first
        info = {"error": f"{type(exc).__name__}: {exc}"[:2000], "problems": ["error"]}
    info["seconds"] = round(time.perf_counter() - start, 2)
    return info


def compile_all(targets: tuple[str, ...] = TARGETS, only: str | None = None, *,
                quick: bool = False, jobs: int = 1,
                log: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """{kernel name: {target: check_asm(...) plus seconds, or an "error"}}; `jobs` > 1
    compiles in that many forked processes (compilation is single-threaded)."""
    specs = kernel_specs(quick)
    todo = [(i, t) for i, spec in enumerate(specs) for t in targets
            if (not only or only in spec.name) and (spec.backend is None
                                                    or t.startswith(spec.backend))]
    if jobs > 1:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            indices, names = [i for i, _ in todo], [t for _, t in todo]
            infos = list(pool.map(_compile_one, indices, names, [quick] * len(todo)))
    else:
        infos = [_compile_one(i, t, quick) for i, t in todo]
    out: dict[str, dict[str, Any]] = {}
    for (i, target), info in zip(todo, infos, strict=True):
        out.setdefault(specs[i].name, {})[target] = info
        if log:
            log(f"{specs[i].name} {target}: {info['problems'] or 'ok'} {info['seconds']}s")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", choices=TARGETS)
    parser.add_argument("--only", help="compile only kernels whose name contains this")
    parser.add_argument("--quick", action="store_true",
                        help="one block size per kernel and target (what CI compiles)")
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args(argv)
    if not HAS_TRITON or interpreter_active():
        print(json.dumps({"error": "needs Triton imported without TRITON_INTERPRET=1"}))
        return 2
    result = compile_all(tuple(args.target or TARGETS), args.only, quick=args.quick,
                         jobs=args.jobs, log=lambda line: print(line, file=sys.stderr))
    print(json.dumps(result))
    return 0 if not any(i["problems"] for t in result.values() for i in t.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
