"""/v1/embeddings: an embedding model's vectors (engine/embed.py), as OpenAI returns them.

Texts are tokenized with the model's BOS/EOS and their special tokens left as text (an
input is data). Each vector is the model's pooled state scaled to unit length; with
`dimensions` (Matryoshka models such as Qwen3-Embedding) its first components, scaled to
unit length again. Usage counts the inputs' tokens against the key's quota.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
import torch

from appliance.auth import Principal, check_model_allowed
from appliance.server.errors import BadRequest, Unsupported
from appliance.server.schemas import EmbeddingRequest
from appliance.server.services.streams import until_disconnect


class EmbeddingService:
    def __init__(self, router: Any, generation: Any, limiter: Any, metrics: Any) -> None:
        self.router = router
        self.generation = generation  # its serving checks and the keys' concurrency caps
        self.limiter = limiter
        self.metrics = metrics

    async def create(self, principal: Principal, body: EmbeddingRequest,
                     receive: Any) -> dict[str, Any]:
        handle = self.router.get(body.model)
        check_model_allowed(principal, handle.name)
        config = handle.engine.loaded.config
        if config.pooling is None:
            raise Unsupported(f"the model '{handle.name}' does not support embeddings: its "
                              f"GGUF sets no pooling_type (load an embedding model such as "
                              f"Qwen3-Embedding)", code="model_not_supported", param="model")
        if body.dimensions is not None and body.dimensions > config.hidden_size:
            raise BadRequest(f"dimensions must be at most {config.hidden_size}",
                             param="dimensions")
        self.generation.check_serving(handle)
        inputs = await asyncio.to_thread(_token_ids, handle, body.input)
        total = sum(len(ids) for ids in inputs)
        self.generation.check_key_cap(principal)
        self.limiter.check_request(principal, total)
        status = "error"
        handle.num_in_flight += 1
        self.generation.hold_key(principal.key_id)
        try:  # the key's inputs take turns with other keys' on the engine thread
            vectors = await until_disconnect(
                receive, handle.engine.embed(inputs, principal.key_id))
            status = "ok"
        finally:
            handle.num_in_flight -= 1
            self.generation.release_key(principal.key_id)
            self.limiter.record(principal, handle.name, total, 0, 0, status)
            labels = (handle.name, principal.key_id)
            self.metrics.prompt_tokens.labels(*labels).inc(total)
            self.metrics.requests.labels(*labels, "embedding" if status == "ok" else status
                                         ).inc()
        data = [{"object": "embedding", "index": i,
                 "embedding": _encode(_unit(v, body.dimensions), body.encoding_format)}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": handle.name,
                "usage": {"prompt_tokens": total, "total_tokens": total}}


def _token_ids(handle: Any, value: str | list[Any]) -> list[list[int]]:
    tok, limit = handle.tokenizer, handle.context
    if isinstance(value, str):
        items: list[Any] = [value]
    elif all(type(t) is int for t in value):
        items = [value]
    elif all(isinstance(t, str) for t in value) or all(isinstance(t, list) for t in value):
        items = value
    else:
        raise BadRequest("input must be a string, a list of strings, a list of token ids, "
                         "or a list of token-id lists (not a mix)", param="input")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            ids = tok.encode(item, add_special=True, parse_special=False)
        elif isinstance(item, list) and all(type(t) is int and 0 <= t < tok.vocab_size
                                            for t in item):
            ids = list(item)
        else:
            raise BadRequest("input must be a string, a list of strings, token ids in "
                             f"[0, {tok.vocab_size}), or a list of such lists", param="input")
        if not ids:
            raise BadRequest(f"input {i} is empty", param="input")
        if len(ids) > limit:
            raise BadRequest(f"input {i} has {len(ids)} tokens; this model embeds at most "
                             f"{limit}", code="context_length_exceeded", param="input")
        out.append(ids)
    return out


def _unit(vector: torch.Tensor, dimensions: int | None) -> np.ndarray:
    v = vector.double().numpy()[:dimensions]
    norm = float(np.linalg.norm(v))
    return (v / norm if norm > 0 else v).astype(np.float32)


def _encode(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
