"""`mbufo inspect`: what a GGUF holds and what serving it costs, without loading weights."""

from __future__ import annotations

import hashlib
import os
from collections import Counter

import gguf

from engine.gguf import ModelFile
from engine.kv.formats import KV_QUANT_CHOICES, kv_bytes_per_token
from engine.loader import resolve_device, resolve_model_path
from engine.models.registry import read_config


def inspect_model(name: str | os.PathLike, device: str = "cpu", *, sessions: int = 4,
                  context: int = 4096, kv_quant: str = "f16") -> dict:
    """What `name` holds; on a GPU `device` also the weight layout `--weights auto` picks
    there for `sessions` x `context` (engine/layout_tune.py: the layouts are timed) and the
    threshold `--weights hybrid` would take."""
    path = resolve_model_path(name)
    with ModelFile.open(path) as mf:
        cfg = read_config(mf)
        types = Counter(gguf.GGMLQuantizationType(t.ggml_type).name for t in mf.tensors.values())
        params = sum(t.n_elements for t in mf.tensors.values())
        template = mf.get("tokenizer.chat_template")
        sliding = cfg.num_sliding_layers
        full = cfg.num_layers - sliding
        kv = {}
        for choice in KV_QUANT_CHOICES:
            per_layer = kv_bytes_per_token(1, cfg.num_kv_heads, cfg.head_dim, choice)
            kv[choice] = per_layer * cfg.num_layers
        info = {
            "path": str(path),
            "architecture": cfg.architecture,
            "name": mf.get("general.name"),
            "file_bytes": path.stat().st_size,
            "parameters": params,
            "tensor_types": dict(sorted(types.items())),
            "context_length": cfg.context_length,
            "layers": cfg.num_layers,
            "sliding_layers": sliding,
            "full_layers": full,
            "sliding_window": cfg.sliding_window,
            "hidden_size": cfg.hidden_size,
            "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "head_dim_v": cfg.head_dim_v,
            "ffn_size": cfg.ffn_size,  # a MoE model's: each expert's
            "experts": cfg.num_experts or None,
            "experts_used": cfg.experts_used or None,
            "rope_scaling": _rope_scaling(cfg),
            # gpt-oss: a logit a head in every attention softmax
            "attention_sinks": "blk.0.attn_sinks.weight" in mf.tensors or None,
            # an embedding model's pooling (/v1/embeddings): mean, cls or last
            "pooling": cfg.pooling,
            "vocab_size": cfg.vocab_size,
            "tokenizer": mf.get("tokenizer.ggml.model"),
            "tokenizer_pre": mf.get("tokenizer.ggml.pre"),
            "chat_template": ("sha256:" + hashlib.sha256(template.encode()).hexdigest()
                              if isinstance(template, str) else "none (built-in used)"),
            # every layer stores each token it keeps; sliding layers keep at most the window
            "kv_bytes_per_token": kv,
        }
        dev = resolve_device(device)
        if dev.type != "cpu":  # "auto" without a GPU: the file only
            info["weight_layout"] = _layout(mf, cfg, dev, device, sessions, context, kv_quant)
        return info


def _rope_scaling(cfg) -> dict | None:
    """YaRN's factor and trained context, or linear scaling's factor; None without."""
    factor = round(1.0 / cfg.rope_freq_scale, 6)
    if cfg.rope_yarn is not None:
        return {"type": "yarn", "factor": factor,
                "original_context": cfg.rope_yarn.original_context}
    return {"type": "linear", "factor": factor} if cfg.rope_freq_scale != 1.0 else None


def _layout(mf: ModelFile, cfg, dev, device: str, sessions: int, context: int,
            kv_quant: str) -> dict:
    import torch

    from engine.errors import InvalidRequest
    from engine.kernel_select import use_triton
    from engine.layout_tune import measure_layout

    if dev.type != "cuda" or not torch.cuda.is_available():
        raise InvalidRequest(f"--device {device}: the weight layout is measured on a GPU, "
                             "and torch sees none")
    if not use_triton(dev):
        return {"layout": "bf16", "reason": "no Triton kernels (MBUFO_KERNELS or no triton)"}
    out = measure_layout(mf, cfg, dev, sessions=sessions, context=context,
                         kv_quant=kv_quant).as_dict()
    # what `--weights hybrid` would load there: its threshold and both layouts' timings
    out["hybrid"] = measure_layout(mf, cfg, dev, sessions=sessions, context=context,
                                   kv_quant=kv_quant, hybrid=True).as_dict()
    if out["layout"] == "q8":  # and the tiles its load would take
        from engine.tile_tune import tune_tiles

        tiles = tune_tiles(mf, dev)
        if tiles is not None:
            out["q8_tiles"] = tiles.as_dict()
    return out
