"""llama.cpp as a peer server: `python -m llama_cpp.server` (llama-cpp-python's
OpenAI-compatible server) in a subprocess on the same GGUF file, measured over HTTP.

The server is started with the flags that make it comparable to the in-process engine:
- `--interrupt_requests False`: by default a new request cancels the running one; with it
  off, requests wait on the server's model lock (it serves one request at a time, so the
  target is serial: concurrent requests queue, their TTFT includes the wait);
- `--n_threads`/`--n_threads_batch` equal to the engine's CPU threads, `--n_ctx` large
  enough for the longest single request (one sequence at a time), `--cache False`
  (no prompt-state cache; llama.cpp still reuses the longest common prefix with the
  previous prompt, which the benchmarks' salted prompts keep to the BOS and, rarely, one
  leading piece);
- `--verbose True`: its log (a temporary file) records each prefix reuse
  ("N prefix-match hit"), reported as `max_prefix_reuse_tokens` since the stream carries
  no usage (prompts are counted with /extras/tokenize/count, which reuses nothing).

Requests carry what makes the server greedy and EOS-blind like llama-server's
`ignore_eos`: `repeat_penalty` 1 (its default is 1.1) and a -1e9 logit bias on every
end-of-generation token of llama.cpp's own vocabulary.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.bench.target import HttpTarget
from engine.errors import EngineError, InvalidRequest

log = logging.getLogger(__name__)

SERVER_MODULES = ("fastapi", "uvicorn", "sse_starlette", "starlette_context",
                  "pydantic_settings", "yaml")
EOG_BIAS = -1e9  # JSON has no -inf; far below any logit
_REUSE = re.compile(r"Llama\.generate: (\d+) prefix-match hit")


@dataclass(frozen=True, slots=True)
class PeerServerConfig:
    model_path: str
    n_ctx: int
    n_threads: int
    n_batch: int = 512  # llama-cpp-python's default, the engine's default prefill chunk
    host: str = "127.0.0.1"
    startup_timeout_s: float = 120.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it; a rare race is caught at startup)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def server_command(config: PeerServerConfig, port: int) -> list[str]:
    threads = str(config.n_threads)
    return [sys.executable, "-m", "llama_cpp.server", "--model", config.model_path,
            "--host", config.host, "--port", str(port), "--n_ctx", str(config.n_ctx),
            "--n_batch", str(config.n_batch), "--n_threads", threads,
            "--n_threads_batch", threads, "--interrupt_requests", "False",
            "--cache", "False", "--verbose", "True"]


def check_server_installed() -> None:
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if importlib.util.find_spec("llama_cpp") is None or missing:
        raise InvalidRequest("the llama.cpp peer server needs llama-cpp-python's server extra "
                             f"(pip install 'llama-cpp-python[server]'); missing: {missing}")


class PeerServer:
    """One `python -m llama_cpp.server` subprocess. `start` returns once GET /v1/models
    answers; `stop` terminates it (kills it after a grace period) and is idempotent."""

    def __init__(self, config: PeerServerConfig) -> None:
        self.config = config
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        fd, name = tempfile.mkstemp(prefix="llama-cpp-server-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)

    @property
    def url(self) -> str:
        if self.port is None:
            raise EngineError("the peer server has not been started")
        return f"http://{self.config.host}:{self.port}"

    def start(self) -> str:
        import httpx

        check_server_installed()
        self.port = free_port(self.config.host)
        with self.log_path.open("wb") as out:  # the child keeps its own descriptor
            self.process = subprocess.Popen(server_command(self.config, self.port),
                                            stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.config.startup_timeout_s
        try:
            while True:
                if self.process.poll() is not None:
                    raise EngineError(f"the llama.cpp server exited with {self.process.returncode}"
                                      f" during startup:\n{self.log_tail()}")
                try:
                    if httpx.get(f"{self.url}/v1/models", timeout=2.0).status_code == 200:
                        log.info("llama.cpp server ready at %s", self.url)
                        return self.url
                except httpx.TransportError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise EngineError(f"the llama.cpp server did not answer within "
                                      f"{self.config.startup_timeout_s:.0f} s:\n{self.log_tail()}")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace_s: float = 10.0) -> None:
        """Terminate the server (kill it after `grace_s`) and delete its log."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.log_path.unlink(missing_ok=True)

    def log_tail(self, num_lines: int = 20) -> str:
        text = self.log_path.read_text("utf-8", "replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-num_lines:])

    def max_prefix_reuse(self) -> int:
        """The most prompt tokens llama.cpp reused from a previous prompt, per its log."""
        text = self.log_path.read_text("utf-8", "replace") if self.log_path.exists() else ""
        return max((int(n) for n in _REUSE.findall(text)), default=0)

    def __enter__(self) -> PeerServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def llama_cpp_eog_ids(model_path: str) -> list[int]:
    """End-of-generation tokens as llama.cpp's vocabulary marks them (a vocab-only load)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path, vocab_only=True, verbose=False)
    try:
        vocab = llm._model.vocab
        return [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    finally:
        llm.close()


class LlamaCppServerTarget(HttpTarget):
    """The peer server as a benchmark target; `aclose` stops the server."""

    is_serial = True

    def __init__(self, server: PeerServer, eog_ids: list[int],
                 name: str = "llama-cpp-server") -> None:
        super().__init__(server.url, name=name)
        self.server = server
        self.eog_ids = list(eog_ids)

    async def _body(self, text: str, max_tokens: int, stream: bool) -> dict[str, Any]:
        body = await super()._body(text, max_tokens, stream)
        body["repeat_penalty"] = 1.0
        body["logit_bias"] = {str(i): EOG_BIAS for i in self.eog_ids}
        return body

    async def count_tokens(self, text: str) -> int:
        """The server's own count, BOS included, as its completions tokenize prompts; unlike
        a 1-token completion it leaves llama.cpp's KV (and the prefix reuse it logs) alone."""
        resp = await self._client.post(f"{self.base}/extras/tokenize/count",
                                       json={"input": text})
        if resp.status_code != 200:
            raise EngineError(f"{self.base} answered {resp.status_code}: {resp.text[:300]}")
        return int(resp.json()["count"])

    def describe(self) -> dict[str, Any]:
        import llama_cpp

        config = self.server.config
        return {"name": self.name, "kind": "llama_cpp.server", "version": llama_cpp.__version__,
                "url": self.base, "model": config.model_path, "n_threads": config.n_threads,
                "n_ctx": config.n_ctx, "n_batch": config.n_batch, "serial": True,
                "interrupt_requests": False,
                "max_prefix_reuse_tokens": self.server.max_prefix_reuse()}

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            await asyncio.to_thread(self.server.stop)


async def open_llama_cpp_server(model_path: str | os.PathLike, *, n_ctx: int,
                                n_threads: int | None = None) -> LlamaCppServerTarget:
    """Start the peer server on `model_path` and return it as a target (close it after).
    `n_threads` defaults to torch's intra-op threads, i.e. the engine's once
    engine.loader.load has configured them."""
    if n_threads is None:
        import torch

        n_threads = torch.get_num_threads()
    config = PeerServerConfig(str(model_path), n_ctx=n_ctx, n_threads=n_threads)
    check_server_installed()
    server = PeerServer(config)
    starting = asyncio.ensure_future(asyncio.to_thread(server.start))
    try:  # the vocabulary scan (~1 s) overlaps the server's start
        eog_ids = await asyncio.to_thread(llama_cpp_eog_ids, config.model_path)
        await starting
    except BaseException:
        await asyncio.gather(starting, return_exceptions=True)
        server.stop()
        raise
    return LlamaCppServerTarget(server, eog_ids)
