"""Typed errors of the engine. The appliance maps each `code` to an HTTP status."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""

    code = "engine_error"


class GGUFFormatError(EngineError):
    """A model file is malformed; the message names the field or tensor."""

    code = "gguf_format"


class UnsupportedArchitecture(EngineError):
    """`general.architecture` names a family the engine does not implement."""

    code = "unsupported_architecture"


class UnsupportedTensorType(EngineError):
    """A tensor uses a GGML type the engine cannot dequantize."""

    code = "unsupported_tensor_type"


class TokenizerError(EngineError):
    """The GGUF vocabulary cannot be turned into a tokenizer."""

    code = "tokenizer"


class TemplateError(EngineError):
    """A chat template failed to render (syntax, sandbox violation, time or size limit)."""

    code = "chat_template"


class ModelNotFound(EngineError):
    """A model name or path does not resolve to a file."""

    code = "model_not_found"


class InvalidRequest(EngineError):
    """A request's parameters are out of range (the message gives the numbers)."""

    code = "invalid_request"


class ContextOverflow(InvalidRequest):
    """Prompt plus max_tokens exceed the context a session has."""

    code = "context_length_exceeded"


class OutOfKVPages(EngineError):
    """The KV pool has no free page and nothing can be evicted."""

    code = "out_of_kv_pages"


class ClientQuotaExceeded(EngineError):
    """A client has more pending requests than its quota allows."""

    code = "client_quota"


class EngineOverloaded(EngineError):
    """The engine cannot accept more work right now."""

    code = "overloaded"
