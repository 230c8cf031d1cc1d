"""Memory planner: weights + KV for N sessions of C tokens + prefill working memory.

KV bytes per token are the contract of engine/kv/formats.py summed over attention layers.
A sliding layer keeps at most its window (plus one page of slack) per session, a full
layer every position; both round up to whole pages. Weights are counted as the backend
holds them: dequantized to bf16 on CPU, in their GGML blocks on a GPU ("gpu"), and there
with a bf16 copy of every linear beside them in the hybrid layout ("hybrid").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.gguf import ModelFile
from engine.kv.formats import KV_QUANT_CHOICES, kv_bytes_per_token
from engine.models.config import ModelConfig
from kernels.qtiles import FLOAT_TYPES

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    kv_quant: str
    sessions: int
    context: int
    page_size: int
    weights_bytes: int
    kv_bytes_per_token: int  # every layer, one token (the contract)
    kv_bytes_per_session: int  # at `context`, sliding layers capped at their window
    kv_bytes_total: int
    prefill_working_bytes: int  # activations of one prefill chunk
    total_bytes: int
    memory_bytes: int | None = None
    fits: bool | None = None
    max_sessions_at_context: int | None = None
    max_context_at_sessions: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


BACKENDS = ("cpu", "gpu", "hybrid")


def linear_tensors(mf: ModelFile) -> list:
    """The 2-D weights a forward multiplies by (TensorInfo): every `*.weight` matrix but the
    token table, which counts only when the file has no `output.weight` (a tied head)."""
    tied = "output.weight" not in mf.tensors
    return [info for name, info in mf.tensors.items()
            if len(info.shape) == 2 and name.endswith(".weight")
            and (name != "token_embd.weight" or tied)]


def dense_copy_bytes(mf: ModelFile) -> int:
    """The hybrid layout's bf16 copies: every linear's matrix (linear_tensors) but the
    float ones, which the GPU holds in bf16 already (the copy is that tensor)."""
    return sum(2 * t.n_elements for t in linear_tensors(mf) if t.ggml_type not in FLOAT_TYPES)


def _gpu_bytes(t) -> int:
    """A tensor as a GPU holds it: its blocks, a float matrix in bf16
    (engine/layers/ggml_linear.py), vectors as the file has them."""
    return 2 * t.n_elements if len(t.shape) == 2 and t.ggml_type in FLOAT_TYPES else t.n_bytes


def weights_bytes(mf: ModelFile, cfg: ModelConfig, backend: str) -> int:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    if backend == "hybrid":
        return weights_bytes(mf, cfg, "gpu") + dense_copy_bytes(mf)
    if backend == "gpu":
        return sum(_gpu_bytes(t) for t in mf.tensors.values())
    matrices = sum(t.n_elements for t in mf.tensors.values() if len(t.shape) > 1)
    vectors = sum(t.n_elements for t in mf.tensors.values() if len(t.shape) == 1)
    return matrices * 2 + vectors * 4


def kv_bytes_per_session(cfg: ModelConfig, kv_quant: str, context: int, page_size: int) -> int:
    per_layer = kv_bytes_per_token(1, cfg.num_kv_heads, cfg.head_dim, kv_quant)
    pages_full = -(-context // page_size)
    kept_sliding = min(context, (cfg.sliding_window or context) + page_size)
    pages_sliding = -(-kept_sliding // page_size)
    sliding = cfg.num_sliding_layers
    return per_layer * page_size * (
        (cfg.num_layers - sliding) * pages_full + sliding * pages_sliding)


def decode_read_bytes(mf: ModelFile, cfg: ModelConfig, context: int, kv_quant: str) -> int:
    """The bytes one decode token of one stream reads at `context` keys, as the file holds
    them: every linear (linear_tensors) and a MoE block's experts_used of its experts (and
    of their biases), every
    1-D tensor (norms, biases), one row of the token table (when the head is not that
    table), and the K and V of `context` positions in each layer (a sliding layer's window
    at most). The bandwidth bound of one stream is
    a device's memory rate over these bytes (engine/bench/bound.py)."""
    if context < 1:
        raise ValueError(f"context must be at least 1, not {context}")
    weights = sum(t.n_bytes for t in linear_tensors(mf))
    if cfg.num_experts:  # (E, N, K) experts and their (E, N) biases: experts_used of E
        weights += sum(t.n_bytes for name, t in mf.tensors.items()
                       if len(t.shape) == 3 or name.endswith("_exps.bias")
                       ) * cfg.experts_used // cfg.num_experts
    vectors = sum(t.n_bytes for t in mf.tensors.values() if len(t.shape) == 1)
    table = mf.tensors.get("token_embd.weight")
    row = 0
    if table is not None and "output.weight" in mf.tensors:
        row = table.n_bytes // int(table.shape[0])  # (vocab, hidden): one token's row
    per_layer_token = kv_bytes_per_token(1, cfg.num_kv_heads, cfg.head_dim, kv_quant)
    window = cfg.sliding_window or context
    positions = sum(min(context, window) if cfg.is_sliding(i) else context
                    for i in range(cfg.num_layers))
    return weights + vectors + row + per_layer_token * positions


def prefill_working_bytes(cfg: ModelConfig, chunk: int) -> int:
    """f32 activations of one chunk: residual, qkv, attention out, gate+up, one logits row;
    a MoE block's for each of a token's experts_used (expert, token) pairs: gate+up, the
    activation and the expert's output."""
    q = cfg.num_heads * cfg.head_dim
    kv = 2 * cfg.num_kv_heads * cfg.head_dim
    mlp = cfg.ffn_size * 3
    if cfg.num_experts:
        mlp = cfg.experts_used * (cfg.ffn_size * 3 + cfg.hidden_size) + cfg.num_experts
    per_token = cfg.hidden_size * 3 + q * 2 + kv + mlp
    return 4 * (chunk * per_token + cfg.vocab_size)


def plan(mf: ModelFile, cfg: ModelConfig, *, sessions: int, context: int, kv_quant: str,
         page_size: int = 16, prefill_chunk: int = 512, backend: str = "cpu",
         memory_gb: float | None = None) -> MemoryPlan:
    if kv_quant not in KV_QUANT_CHOICES:
        raise ValueError(f"kv_quant must be one of {sorted(KV_QUANT_CHOICES)}")
    w = weights_bytes(mf, cfg, backend)
    per_session = kv_bytes_per_session(cfg, kv_quant, context, page_size)
    work = prefill_working_bytes(cfg, prefill_chunk)
    total = w + per_session * sessions + work
    fields: dict = {}
    if memory_gb is not None:
        budget = int(memory_gb * GIB)
        free = budget - w - work
        max_ctx = 0
        if sessions > 0 and free > 0:
            lo, hi = 0, cfg.context_length
            while lo < hi:  # largest context whose KV for `sessions` fits
                mid = (lo + hi + 1) // 2
                if kv_bytes_per_session(cfg, kv_quant, mid, page_size) * sessions <= free:
                    lo = mid
                else:
                    hi = mid - 1
            max_ctx = lo
        fields = dict(memory_bytes=budget, fits=total <= budget,
                      max_sessions_at_context=max(0, free // per_session) if per_session else 0,
                      max_context_at_sessions=max_ctx)
    return MemoryPlan(kv_quant, sessions, context, page_size, w,
                      kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                         kv_quant),
                      per_session, per_session * sessions, work, total, **fields)
