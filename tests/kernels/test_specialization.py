"""Kernel variants by batch: Triton builds a variant per class of each int argument (1, a
multiple of 16, other) and per pointer alignment, and a build while serving stalls a step
for about a second. Arguments that vary with the batch are kept out of the
specialization (kernels/triton_util.py's `jit`), so the load-time warm-up builds every
variant a served step takes. Checked with Triton's own binder (the function a launch
computes its variant key with), which needs no GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.triton_util import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="the CPU torch build has no Triton")


def variant(kernel, **changed):
    """Triton's specialization of a launch of `kernel` (pointers: CPU tensors at 256-byte
    aligned addresses, ints 4096, floats 0.5, constexprs 1) with `changed` arguments."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import create_function_from_signature

    from kernels.triton_util import compiled

    fn = compiled(kernel)
    binder = create_function_from_signature(fn.signature, fn.params, BaseBackend)
    args = {}
    for p in fn.params:
        if p.is_constexpr:
            args[p.name] = 1
        elif p.name.endswith("_ptr"):
            args[p.name] = torch.zeros(64, dtype=torch.int32)
        elif p.name in ("qk_scale", "softcap", "eps"):
            args[p.name] = 0.5
        else:
            args[p.name] = 4096
    return binder(**{**args, **changed})[1]


def test_attention_variant_independent_of_page_table_width():
    from kernels.paged_attention_triton import _attn_merge_kernel, _attn_partial_kernel

    base = variant(_attn_partial_kernel, stride_pt=32)
    for width in (1, 17, 48, 1000):
        assert variant(_attn_partial_kernel, stride_pt=width) == base, width
    # the control: a query stride off 16 is another variant (the binder sees the classes)
    assert variant(_attn_partial_kernel, stride_qt=4097) != base
    merge = variant(_attn_merge_kernel, num_tokens=16)
    for tokens in (1, 17, 529):
        assert variant(_attn_merge_kernel, num_tokens=tokens) == merge, tokens


def test_kv_store_variant_independent_of_the_slots_offset():
    from kernels.kv_store import _kv_store_kernel

    slots = torch.zeros(64, dtype=torch.int64)
    base = variant(_kv_store_kernel, slot_ptr=slots)
    for offset in (1, 3, 17):
        assert variant(_kv_store_kernel, slot_ptr=slots[offset:]) == base, offset
    assert variant(_kv_store_kernel, k_ptr=torch.zeros(64)[1:]) != base  # the control
