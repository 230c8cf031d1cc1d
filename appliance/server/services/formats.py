"""OpenAI's JSON shapes for chat and text completions, streamed and whole.

Engine finish reasons map one to one ("stop", "length"); "abort" never reaches here (the
generation service turns it into an error). Token strings in logprobs are the token's
bytes decoded as UTF-8 with replacement, and `bytes` carries the exact bytes, as OpenAI
does for tokens that split a character.
"""

from __future__ import annotations

from typing import Any

from appliance.server.services.generation import Choice, Format, Job
from appliance.server.services.replies import Parts
from engine.scheduler.request import OutputChunk


def _token(pieces: list[bytes], token_id: int) -> tuple[str, list[int]]:
    piece = pieces[token_id] if 0 <= token_id < len(pieces) else b""
    return piece.decode("utf-8", "replace"), list(piece)


def chat_logprobs(job: Job, entries: Any) -> dict[str, Any]:
    pieces = job.handle.tokenizer.pieces()
    content = []
    for entry in entries:
        if entry is None:
            continue
        text, raw = _token(pieces, entry.token_id)
        top = []
        for token_id, logprob in entry.top[:job.logprobs or 0]:
            t, b = _token(pieces, token_id)
            top.append({"token": t, "logprob": logprob, "bytes": b})
        content.append({"token": text, "logprob": entry.logprob, "bytes": raw,
                        "top_logprobs": top})
    return {"content": content, "refusal": None}


def text_logprobs(job: Job, entries: Any, offset: int,
                  prompt: tuple[tuple[int, ...], tuple] | None = None) -> dict[str, Any]:
    """OpenAI's completion logprobs of `entries` (sampled tokens), their text offsets from
    `offset`; with `prompt` (ids, their entries: echo) the prompt's tokens first, from
    offset 0, its first token (no context) with null logprobs."""
    pieces = job.handle.tokenizer.pieces()
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}

    def add(token_id: int, logprob: float | None, top: Any, at: int) -> int:
        text, _ = _token(pieces, token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        tops: dict[str, float] | None = None
        if top is not None:
            tops = {}
            for tid, value in top[:job.logprobs or 0]:
                tops.setdefault(_token(pieces, tid)[0], value)
        out["top_logprobs"].append(tops)
        out["text_offset"].append(at)
        return at + len(text)

    if prompt is not None:
        at = 0
        for token_id, entry in zip(*prompt, strict=True):
            at = add(token_id, None if entry is None else entry.logprob,
                     None if entry is None else entry.top, at)
    for entry in entries:
        if entry is not None:
            offset = add(entry.token_id, entry.logprob, entry.top, offset)
    return out


class ChatFormat(Format):
    def _head(self, job: Job, obj: str) -> dict[str, Any]:
        return {"id": job.id, "object": obj, "created": job.created, "model": job.model,
                "system_fingerprint": None}

    def event(self, job: Job, choice: Choice, chunk: OutputChunk) -> dict[str, Any] | None:
        parts = _reply_parts(job, choice, chunk)
        logprobs = None
        if job.logprobs is not None and chunk.logprobs is not None:
            logprobs = chat_logprobs(job, chunk.logprobs)
        is_first = choice.num_events == 0
        if not (is_first or parts or logprobs or chunk.finish_reason):
            return None  # markup held back until the next chunk decides it
        delta: dict[str, Any] = {}
        if is_first:
            delta["role"] = "assistant"
        if parts.reasoning:
            delta["reasoning_content"] = parts.reasoning
        if parts.content or is_first:
            delta["content"] = parts.content
        if parts.tool_calls:
            first = choice.num_tool_calls
            delta["tool_calls"] = [{"index": first + i, **call.to_dict()}
                                   for i, call in enumerate(parts.tool_calls)]
            choice.num_tool_calls += len(parts.tool_calls)
        out = self._head(job, "chat.completion.chunk")
        out["choices"] = [{"index": choice.index, "delta": delta, "logprobs": logprobs,
                           "finish_reason": _finish(chunk.finish_reason,
                                                    choice.num_tool_calls)}]
        if job.include_usage:
            out["usage"] = None
        return out

    def usage_event(self, job: Job) -> dict[str, Any]:
        out = self._head(job, "chat.completion.chunk")
        out["choices"] = []
        out["usage"] = job.usage()
        return out

    def response(self, job: Job) -> dict[str, Any]:
        out = self._head(job, "chat.completion")
        choices = []
        for c in job.choices:
            parts = _whole_reply(job, c)
            choices.append({
                "index": c.index, "message": _message(parts),
                "logprobs": chat_logprobs(job, c.logprobs) if job.logprobs is not None else None,
                "finish_reason": _finish(c.finish_reason, len(parts.tool_calls))})
        out["choices"] = choices
        out["usage"] = job.usage()
        return out


def _reply_parts(job: Job, choice: Choice, chunk: OutputChunk) -> Parts:
    """What the chunk settles of the choice's reply (all of it at the reply's end)."""
    if job.reply_parser is None:
        return Parts(content=chunk.text)
    if choice.reply is None:
        choice.reply = job.reply_parser()
    parts = choice.reply.feed(chunk.text)
    if chunk.finish_reason is not None:
        parts.add(choice.reply.finish())
    return parts


def _whole_reply(job: Job, choice: Choice) -> Parts:
    text = "".join(choice.text)
    if job.reply_parser is None:
        return Parts(content=text)
    parser = job.reply_parser()
    return parser.feed(text).add(parser.finish())


def _message(parts: Parts) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parts.content, "refusal": None}
    if parts.reasoning:
        message["reasoning_content"] = parts.reasoning
    if parts.tool_calls:
        message["tool_calls"] = [call.to_dict() for call in parts.tool_calls]
        message["content"] = parts.content or None  # OpenAI's: null beside tool calls
    return message


def _finish(reason: str | None, num_tool_calls: int) -> str | None:
    """A reply that ends by itself after calling tools ends with "tool_calls"."""
    return "tool_calls" if reason == "stop" and num_tool_calls else reason


class TextFormat(Format):
    def _head(self, job: Job) -> dict[str, Any]:
        return {"id": job.id, "object": "text_completion", "created": job.created,
                "model": job.model, "system_fingerprint": None}

    def _echo(self, job: Job, choice: Choice) -> str:
        return job.echo[choice.prompt_index] if job.echo is not None else ""

    def _prompt(self, job: Job, choice: Choice) -> tuple[tuple[int, ...], tuple] | None:
        """The echoed prompt's ids and logprob entries, where logprobs are asked for."""
        if job.echo is None or choice.prompt_logprobs is None:
            return None
        return job.prompts[choice.prompt_index], choice.prompt_logprobs

    def event(self, job: Job, choice: Choice, chunk: OutputChunk) -> dict[str, Any]:
        is_first = choice.num_events == 0
        prefix = self._echo(job, choice) if is_first else ""
        logprobs = None
        if job.logprobs is not None and chunk.logprobs is not None:
            done = len("".join(choice.text)) - len(chunk.text)  # text before this chunk
            logprobs = text_logprobs(job, chunk.logprobs, done + len(self._echo(job, choice)),
                                     self._prompt(job, choice) if is_first else None)
        out = self._head(job)
        out["choices"] = [{"index": choice.index, "text": prefix + chunk.text,
                           "logprobs": logprobs, "finish_reason": chunk.finish_reason}]
        if job.include_usage:
            out["usage"] = None
        return out

    def usage_event(self, job: Job) -> dict[str, Any]:
        out = self._head(job)
        out["choices"] = []
        out["usage"] = job.usage()
        return out

    def response(self, job: Job) -> dict[str, Any]:
        out = self._head(job)
        choices = []
        for c in job.choices:
            echo = self._echo(job, c)
            logprobs = None
            if job.logprobs is not None:
                logprobs = text_logprobs(job, c.logprobs, len(echo), self._prompt(job, c))
            choices.append({"index": c.index, "text": echo + "".join(c.text),
                            "logprobs": logprobs, "finish_reason": c.finish_reason})
        out["choices"] = choices
        out["usage"] = job.usage()
        return out


CHAT = ChatFormat()
TEXT = TextFormat()
