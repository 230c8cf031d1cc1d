"""/tokenize and /detokenize (vLLM's shapes): what a prompt costs before it is sent.

A text is tokenized as /v1/completions tokenizes it (the model's BOS unless
add_special_tokens is false, special tokens parsed); messages as /v1/chat/completions
renders them, through the model's chat template.
"""

from __future__ import annotations

import asyncio
from typing import Any

from appliance.auth import Principal, check_model_allowed
from appliance.server.errors import BadRequest
from appliance.server.schemas import DetokenizeRequest, TokenizeRequest
from appliance.server.services.completions import chat_prompt


async def tokenize(router: Any, principal: Principal, body: TokenizeRequest) -> dict[str, Any]:
    handle = router.get(body.model)
    check_model_allowed(principal, handle.name)
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("give either prompt or messages", param="prompt")
    if body.messages is not None:
        ids, _ = await asyncio.to_thread(chat_prompt, handle, body, bool(body.tools),
                                         body.add_generation_prompt)
    else:
        ids = await asyncio.to_thread(handle.tokenizer.encode, body.prompt,
                                      add_special=body.add_special_tokens, parse_special=True)
    return {"count": len(ids), "max_model_len": handle.context, "tokens": list(ids)}


async def detokenize(router: Any, principal: Principal, body: DetokenizeRequest
                     ) -> dict[str, Any]:
    handle = router.get(body.model)
    check_model_allowed(principal, handle.name)
    vocab = handle.tokenizer.vocab_size
    if any(t >= vocab for t in body.tokens):
        raise BadRequest(f"token ids must lie in [0, {vocab})", param="tokens")
    text = await asyncio.to_thread(handle.tokenizer.decode, list(body.tokens))
    return {"prompt": text}
