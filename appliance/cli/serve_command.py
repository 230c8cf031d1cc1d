"""`mbufo serve` (the server) and `mbufo models load|unload` (a running server's admin API).

Settings are read once: defaults < TOML (--config / $MBUFO_CONFIG) < MBUFO_* env < flags.
The first start prints the admin key once (stdout). SIGINT/SIGTERM shut down gracefully:
the listener closes, new requests get 503, running ones get SHUTDOWN_GRACE_S to finish,
then the engines stop (the rest end with a 'shutting down' error) and usage is flushed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

from appliance.settings import WEIGHT_LAYOUTS

SHUTDOWN_GRACE_S = 30.0
MAX_HEADER_BYTES = 64 << 10  # h11's limit on an incomplete request head


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API, admin API and metrics")
    p.add_argument("--config", help="settings TOML file (default: $MBUFO_CONFIG)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8080)")
    p.add_argument("--data-dir", help="database and models directory")
    p.add_argument("--model", dest="models", action="append", metavar="NAME|PATH",
                   help="model to load at start (repeat; the first is the default; "
                        "default: 'default', the embedded model)")
    p.add_argument("--sessions", type=int, help="resident sessions per model (default 4)")
    p.add_argument("-c", "--context", type=int, help="tokens per session (default 4096)")
    p.add_argument("--kv-quant", choices=("f16", "q8", "k8v4", "k4v8", "k4v4"))
    p.add_argument("--prefill-chunk", type=int, help="prefill chunk tokens (default 512)")
    p.add_argument("--mixed-batch", choices=("on", "off"))
    p.add_argument("--itl-target-ms", help="auto | off | milliseconds")
    p.add_argument("--dtype", choices=("auto", "bf16", "f32", "int8"))
    p.add_argument("--weights", choices=WEIGHT_LAYOUTS,
                   help="GPU weight layout (default auto: measured at load); hybrid keeps "
                        "bf16 copies beside the blocks for large steps (more memory, more "
                        "throughput with many sessions)")
    p.add_argument("--memory-gb", type=float, help="memory budget for loaded models")
    p.add_argument("--no-auth", action="store_const", const=True,
                   help="no API keys (loopback hosts only)")
    p.add_argument("--cors-origin", dest="cors_origins", action="append", metavar="ORIGIN",
                   help="allow this browser origin (repeat; default: CORS off)")
    p.add_argument("--max-body-bytes", type=int, help="request body limit (default 8 MiB)")
    p.add_argument("--keep-alive-s", type=int, help="idle keep-alive timeout (default 5 s)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    p.set_defaults(handler=cmd_serve)
    _register_models(sub)


def _register_models(sub: argparse._SubParsersAction) -> None:
    """Add `load` and `unload` under `mbufo models`, beside the registry commands when
    another module registered `models` first."""
    parser = sub.choices.get("models")
    if parser is None:
        parser = sub.add_parser("models", help="models: load, unload")
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    msub = actions[0] if actions else parser.add_subparsers(
        dest="models_command", required=True, metavar="ACTION")
    p = msub.add_parser("load", help="load a model into the running server")
    p.add_argument("name", help="registered name, 'default' or a GGUF path (on the server)")
    p.add_argument("--sessions", type=int)
    p.add_argument("-c", "--context", type=int)
    p.add_argument("--kv-quant", choices=("f16", "q8", "k8v4", "k4v8", "k4v4"))
    _client_args(p)
    p.set_defaults(handler=cmd_models_load)
    p = msub.add_parser("unload", help="unload a model from the running server")
    p.add_argument("name")
    _client_args(p)
    p.set_defaults(handler=cmd_models_unload)


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="server URL (default: http://<host>:<port> from settings)")
    p.add_argument("--api-key", help="admin API key (default: $MBUFO_API_KEY)")
    p.add_argument("--config", help="settings TOML file (for the default URL)")
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")


# -- serve -------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from appliance.settings import SettingsError, load_settings

    cli: dict[str, Any] = {k: getattr(args, k) for k in (
        "host", "port", "data_dir", "models", "sessions", "context", "kv_quant",
        "prefill_chunk", "itl_target_ms", "dtype", "weights", "memory_gb", "no_auth",
        "cors_origins",
        "max_body_bytes", "keep_alive_s", "log_level")}
    if args.mixed_batch is not None:
        cli["mixed_batch"] = args.mixed_batch == "on"
    try:
        settings = load_settings(cli, config=args.config)
    except SettingsError as exc:
        print(f"mbufo: error: {exc}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(settings.log_level.upper())
    from appliance.server import create_app, open_state

    state = open_state(settings)
    if not settings.no_auth:
        key = state.keys.ensure_admin_key()
        if key is not None:
            print(f"First start: the admin API key is\n\n    {key}\n\nIt is shown only "
                  f"this once; store it now (it authorizes /admin/api).", flush=True)
    app = create_app(state)
    server = build_server(app, state, settings.host, settings.port, settings.keep_alive_s,
                          settings.log_level)
    # uvicorn re-raises the signal it shut down on once its own handlers are gone: a no-op
    # handler makes a SIGTERM-initiated graceful shutdown end with status 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    except SystemExit:  # uvicorn's own exit when the startup failed
        if state.startup_error is None:
            raise
    if state.startup_error is not None:
        print(f"mbufo: error: {state.startup_error}", file=sys.stderr)
        return 2
    return 0 if server.started else 1


def build_server(app: Any, state: Any, host: str, port: int, keep_alive_s: int = 5,
                 log_level: str = "info", grace_s: float = SHUTDOWN_GRACE_S) -> Any:
    """A uvicorn server whose shutdown drains the app first (also used by tests)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: list | None = None) -> None:
            for listener in self.servers:
                listener.close()  # stop accepting before the drain
            await state.drain(grace_s)
            await super().shutdown(sockets)

    config = uvicorn.Config(app, host=host, port=port, lifespan="on", log_level=log_level,
                            timeout_keep_alive=keep_alive_s, server_header=False,
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                            timeout_graceful_shutdown=int(grace_s) + 5, access_log=False,
                            log_config=None)
    return DrainingServer(config)


# -- models load / unload ----------------------------------------------------------------
def cmd_models_load(args: argparse.Namespace) -> int:
    body = {"name": args.name, "sessions": args.sessions, "context": args.context,
            "kv_quant": args.kv_quant}
    return _admin_call(args, "/admin/api/models/load",
                       {k: v for k, v in body.items() if v is not None},
                       lambda r: f"loaded {r['name']} ({r['architecture']}, {r['sessions']} "
                                 f"sessions x {r['context']} tokens, kv {r['kv_quant']})")


def cmd_models_unload(args: argparse.Namespace) -> int:
    return _admin_call(args, "/admin/api/models/unload", {"name": args.name},
                       lambda r: f"unloaded {r['name']}")


def _admin_call(args: argparse.Namespace, path: str, body: dict, describe: Any) -> int:
    import httpx

    from appliance.cli.main import emit_json

    url, key = _endpoint(args)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        resp = httpx.post(url + path, json=body, headers=headers,
                          timeout=httpx.Timeout(10.0, read=None))
    except httpx.HTTPError as exc:
        print(f"mbufo: cannot reach the server at {url}: {exc}", file=sys.stderr)
        return 1
    try:
        data = resp.json()
    except json.JSONDecodeError:
        data = {"error": {"message": resp.text[:300], "code": None}}
    if resp.status_code != 200:
        err = data.get("error", {}) if isinstance(data, dict) else {}
        print(f"mbufo: error {resp.status_code} ({err.get('code')}): {err.get('message')}",
              file=sys.stderr)
        return 1
    if args.json:
        emit_json(data)
    else:
        print(describe(data))
    return 0


def _endpoint(args: argparse.Namespace) -> tuple[str, str | None]:
    key = args.api_key or os.environ.get("MBUFO_API_KEY")
    if args.url:
        return args.url.rstrip("/"), key
    from appliance.settings import load_settings

    settings = load_settings(config=args.config)
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{settings.port}", key
