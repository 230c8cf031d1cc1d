"""Appliance settings, read once at the edge: defaults < TOML file < MBUFO_* env < CLI flags.

The TOML file is `--config PATH`, else `$MBUFO_CONFIG`, else /etc/mbufo/config.toml when it
exists (an installed appliance). Keys in the file are the field names below; environment
variables are `MBUFO_` + the upper-cased field name (lists comma-separated).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

SYSTEM_CONFIG = Path("/etc/mbufo/config.toml")
SYSTEM_DATA_DIR = Path("/var/lib/mbufo")
WEIGHT_LAYOUTS = ("auto", "ggml", "q8", "bf16", "hybrid")  # engine/models/weights.py's


class SettingsError(ValueError):
    """A configuration value is missing or malformed (the message names it)."""


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "mbufo"


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    data_dir: Path = field(default_factory=default_data_dir)
    models: tuple[str, ...] = ("default",)  # loaded at start; the first is the default model
    sessions: int = 4  # resident sequences per model
    context: int = 4096  # tokens per session
    kv_quant: str = "f16"
    prefill_chunk: int = 512
    mixed_batch: bool = True
    itl_target_ms: str = "auto"  # "auto" | "off" | a number
    dtype: str = "auto"
    # GPU weight layout: auto (measured at load), ggml, q8, bf16 or hybrid (q8's blocks and
    # bf16 copies for large steps: more memory, more throughput at many sessions)
    weights: str = "auto"
    memory_gb: float | None = None  # budget for loaded models (weights + KV); None = no limit
    no_auth: bool = False  # only allowed on a loopback host
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 8 << 20
    request_timeout_s: float = 600.0
    keep_alive_s: int = 5
    log_level: str = "info"

    @property
    def database_path(self) -> Path:
        return self.data_dir / "mbufo.db"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"


_BOOL = {"1": True, "true": True, "yes": True, "on": True,
         "0": False, "false": False, "no": False, "off": False}


def _coerce(name: str, kind: Any, value: Any) -> Any:
    text = str(kind)
    try:
        if "tuple" in text:
            if isinstance(value, str):
                return tuple(v.strip() for v in value.split(",") if v.strip())
            return tuple(str(v) for v in value)
        if "Path" in text:
            return Path(str(value)).expanduser()
        if "bool" in text:
            if isinstance(value, bool):
                return value
            return _BOOL[str(value).strip().lower()]
        if "float" in text:
            return None if value in (None, "", "none") else float(value)
        if "int" in text:
            return int(value)
        return str(value)
    except (KeyError, TypeError, ValueError) as exc:
        raise SettingsError(f"setting '{name}': cannot use {value!r} ({exc})") from exc


def load_settings(cli: dict[str, Any] | None = None, config: str | os.PathLike | None = None,
                  environ: dict[str, str] | None = None) -> Settings:
    """Merge the sources; `cli` holds only flags the user gave (None values are ignored)."""
    environ = dict(os.environ if environ is None else environ)
    kinds = {f.name: f.type for f in fields(Settings)}
    values: dict[str, Any] = {}
    path = config or environ.get("MBUFO_CONFIG")
    if path is None and SYSTEM_CONFIG.is_file():
        path = SYSTEM_CONFIG
        values["data_dir"] = SYSTEM_DATA_DIR
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SettingsError(f"config file {path}: {exc}") from exc
        for key, value in data.items():
            if key not in kinds:
                raise SettingsError(f"config file {path}: unknown setting '{key}'")
            values[key] = value
    for name in kinds:
        env = environ.get("MBUFO_" + name.upper())
        if env is not None:
            values[name] = env
    for name, value in (cli or {}).items():
        if value is not None:
            if name not in kinds:
                raise SettingsError(f"unknown setting '{name}'")
            values[name] = value
    coerced = {k: _coerce(k, kinds[k], v) for k, v in values.items()}
    settings = replace(Settings(), **coerced)
    validate(settings)
    return settings


def validate(s: Settings) -> None:
    if not 0 < s.port < 65536:
        raise SettingsError(f"port must be in 1..65535, got {s.port}")
    if s.no_auth and s.host not in ("127.0.0.1", "localhost", "::1"):
        raise SettingsError("no_auth is allowed only on a loopback host (127.0.0.1, ::1)")
    if not s.models:
        raise SettingsError("at least one model must be configured")
    for name in ("sessions", "context", "prefill_chunk", "max_body_bytes"):
        if getattr(s, name) < 1:
            raise SettingsError(f"{name} must be >= 1, got {getattr(s, name)}")
    if s.kv_quant not in ("f16", "q8", "k8v4", "k4v8", "k4v4"):
        raise SettingsError(f"kv_quant must be f16, q8, k8v4, k4v8 or k4v4, got {s.kv_quant}")
    if s.weights not in WEIGHT_LAYOUTS:
        raise SettingsError(f"weights must be one of {', '.join(WEIGHT_LAYOUTS)}, "
                            f"got {s.weights}")
    if s.itl_target_ms not in ("auto", "off"):
        try:
            float(s.itl_target_ms)
        except ValueError as exc:
            raise SettingsError(
                f"itl_target_ms must be auto, off or a number, got {s.itl_target_ms}") from exc
