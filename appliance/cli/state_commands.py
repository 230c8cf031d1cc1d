"""State commands: `mbufo db`, `mbufo keys`, `mbufo models` (the local registry).

Every command takes --data-dir and --config, resolves Settings like `mbufo serve` does
(so both agree on the database), and opens the database, migrating it to head first.
Errors in the arguments exit with status 2; "no such key/model" exits with status 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

Handler = Callable[[argparse.Namespace], int]


def register(sub: argparse._SubParsersAction) -> dict[str, argparse._SubParsersAction]:
    """Add `db`, `keys`, `models`; returns their action groups by name so that other
    modules can add actions (the server's `models load|unload`)."""
    db = sub.add_parser("db", help="database schema: upgrade, downgrade, current")
    dsub = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    p = _leaf(dsub, "upgrade", "migrate the database to a revision (default head)", cmd_db_upgrade)
    p.add_argument("revision", nargs="?", default="head")
    p = _leaf(dsub, "downgrade", "migrate the database down to REVISION ('base' = empty)",
              cmd_db_downgrade)
    p.add_argument("revision")
    _leaf(dsub, "current", "print the database's schema revision and the newest", cmd_db_current)

    keys = sub.add_parser("keys", help="API keys: create, list, revoke, quota")
    ksub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    p = _leaf(ksub, "create", "create an API key and print it (shown only once)", cmd_keys_create)
    p.add_argument("--name", required=True, help="what the key is for, e.g. 'laptop'")
    p.add_argument("--role", required=True, choices=("admin", "user"))
    p.add_argument("--user", help="owner (created if new; default: the key's name)")
    _quota_args(p)
    _leaf(ksub, "list", "list keys with their quotas (never the secrets)", cmd_keys_list)
    p = _leaf(ksub, "revoke", "revoke a key by its id", cmd_keys_revoke)
    p.add_argument("key_id", metavar="ID")
    p = _leaf(ksub, "quota", "change a key's quota (only the flags given)", cmd_keys_quota)
    p.add_argument("key_id", metavar="ID")
    _quota_args(p)

    models = sub.add_parser("models", help="the model registry: add, list, rm")
    msub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    p = _leaf(msub, "add", "check a GGUF file, hash it and register it", cmd_models_add)
    p.add_argument("path", metavar="PATH|default")
    p.add_argument("--name", help="name clients use (default: the file name, or 'default')")
    p.add_argument("--sessions", type=int, help="resident sessions (default: server setting)")
    p.add_argument("-c", "--context", type=int, help="tokens per session")
    p.add_argument("--kv-quant", choices=("f16", "q8", "k8v4", "k4v8", "k4v4"))
    _leaf(msub, "list", "list registered models", cmd_models_list)
    p = _leaf(msub, "rm", "remove a model from the registry (the file stays)", cmd_models_rm)
    p.add_argument("name")
    return {"db": dsub, "keys": ksub, "models": msub}


def _leaf(sub: argparse._SubParsersAction, name: str, help_text: str,
          handler: Handler) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text)
    p.add_argument("--data-dir", help="data directory (default: $MBUFO_DATA_DIR or settings)")
    p.add_argument("--config", help="settings TOML file (default: $MBUFO_CONFIG)")
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    p.set_defaults(handler=_guarded(handler))
    return p


def _quota_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-pending", type=int, help="queued requests at once (default 16)")
    p.add_argument("--max-concurrent", type=int, help="streams at once (default 4)")
    p.add_argument("--rpm", type=int, help="requests per minute (0 = unlimited)")
    p.add_argument("--tpm", type=int, help="tokens per minute (0 = unlimited)")
    p.add_argument("--tpd", type=int, help="tokens per day (0 = unlimited)")
    p.add_argument("--models", help="allowed models, comma-separated ('all' = every model)")
    p.add_argument("--expires-days", type=float, help="expire after N days (0 = never)")


def _guarded(handler: Handler) -> Handler:
    def run(args: argparse.Namespace) -> int:
        from appliance.auth import AuthError
        from appliance.db import StateError
        from appliance.settings import SettingsError

        try:
            return handler(args)
        except (StateError, AuthError) as exc:
            print(f"mbufo: error ({exc.code}): {exc.message}", file=sys.stderr)
            return 2
        except SettingsError as exc:
            print(f"mbufo: error (settings): {exc}", file=sys.stderr)
            return 2
    return run


def _open(args: argparse.Namespace, *, upgrade: bool = True):
    from appliance.db import open_database
    from appliance.settings import load_settings

    settings = load_settings({"data_dir": args.data_dir}, config=args.config)
    return open_database(settings, upgrade=upgrade)


def _emit(args: argparse.Namespace, obj: dict[str, Any], lines: list[str]) -> None:
    from appliance.cli.main import emit_json

    for line in lines:
        print(line)
    if args.json:
        emit_json(obj)


def _now() -> datetime:
    return datetime.now(UTC)


# -- db ------------------------------------------------------------------------------------

def _migrate(args: argparse.Namespace, direction: str) -> int:
    from appliance.db import migrate

    with _open(args, upgrade=False) as db:
        getattr(migrate, direction)(db, args.revision)
        return _print_revision(args, db)


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    return _migrate(args, "upgrade")


def cmd_db_downgrade(args: argparse.Namespace) -> int:
    return _migrate(args, "downgrade")


def cmd_db_current(args: argparse.Namespace) -> int:
    with _open(args, upgrade=False) as db:
        return _print_revision(args, db)


def _print_revision(args: argparse.Namespace, db) -> int:
    from appliance.db import migrate

    current, head = migrate.current_revision(db), migrate.head_revision()
    _emit(args, {"database": str(db.path), "revision": current, "head": head},
          [f"{db.path}: revision {current or 'base (empty)'} (newest: {head})"])
    return 0


# -- keys ----------------------------------------------------------------------------------

def _quota_from(args: argparse.Namespace, base):
    """`base` (a Quota) with the flags the user gave applied; 0 = unlimited / never."""
    from dataclasses import replace

    changes: dict[str, Any] = {}
    for flag, name in (("max_pending", "max_pending"),
                       ("max_concurrent", "max_concurrent_streams")):
        if getattr(args, flag) is not None:
            changes[name] = getattr(args, flag)
    for flag, name in (("rpm", "requests_per_min"), ("tpm", "tokens_per_min"),
                       ("tpd", "tokens_per_day")):
        value = getattr(args, flag)
        if value is not None:
            changes[name] = value or None
    if args.models is not None:
        names = tuple(m.strip() for m in args.models.split(",") if m.strip())
        changes["allowed_models"] = None if names == ("all",) else names
    if args.expires_days is not None:
        changes["expires_at"] = (_now() + timedelta(days=args.expires_days)
                                 if args.expires_days else None)
    return replace(base, **changes)


def cmd_keys_create(args: argparse.Namespace) -> int:
    from appliance.auth import KeyService, Quota

    with _open(args) as db:
        key, info = KeyService(db).create(name=args.name, user=args.user or args.name,
                                          role=args.role, quota=_quota_from(args, Quota()))
    obj = {"key": key, **info.to_dict(_now())}
    _emit(args, obj, [f"created {info.role} key {info.key_id} ({info.name}) for {info.user}:",
                      key, "store it now: it is shown only once"])
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from appliance.auth import KeyService

    with _open(args) as db:
        infos = KeyService(db).list()
    now = _now()
    rows = [info.to_dict(now) for info in infos]
    lines = [f"{'ID':<12} {'NAME':<16} {'USER':<12} {'ROLE':<5} {'STATUS':<7} "
             f"{'CREATED':<16} {'EXPIRES':<16} {'LAST USED':<16} QUOTA"]
    for info, row in zip(infos, rows, strict=True):
        lines.append(f"{info.key_id:<12} {info.name[:16]:<16} {info.user[:12]:<12} "
                     f"{info.role:<5} {row['status']:<7} {_day(info.created_at):<16} "
                     f"{_day(info.expires_at):<16} {_day(info.last_used_at):<16} "
                     f"{_quota_text(info.quota)}")
    if not infos:
        lines = ["no API keys (create one with: mbufo keys create --name NAME --role admin)"]
    _emit(args, {"keys": rows}, lines)
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from appliance.auth import KeyService

    with _open(args) as db:
        revoked = KeyService(db).revoke(args.key_id)
    text = (f"revoked key {args.key_id}" if revoked
            else f"no active key with id {args.key_id} (unknown or already revoked)")
    _emit(args, {"id": args.key_id, "revoked": revoked}, [text])
    return 0 if revoked else 1


def cmd_keys_quota(args: argparse.Namespace) -> int:
    from appliance.auth import KeyService

    with _open(args) as db:
        service = KeyService(db)
        info = service.get(args.key_id)
        if info is None:
            _emit(args, {"id": args.key_id, "updated": False}, [f"no key with id {args.key_id}"])
            return 1
        quota = _quota_from(args, info.quota)
        service.set_quota(args.key_id, quota)
    _emit(args, {"id": args.key_id, "updated": True, "quota": quota.to_dict()},
          [f"key {args.key_id}: {_quota_text(quota)}"])
    return 0


def _day(value: datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M")


def _quota_text(q) -> str:
    def limit(v: int | None) -> str:
        return "-" if v is None else str(v)

    models = "all" if q.allowed_models is None else ",".join(q.allowed_models) or "none"
    return (f"pending {q.max_pending}, streams {q.max_concurrent_streams}, "
            f"rpm {limit(q.requests_per_min)}, tpm {limit(q.tokens_per_min)}, "
            f"tpd {limit(q.tokens_per_day)}, models {models}")


# -- models --------------------------------------------------------------------------------

def cmd_models_add(args: argparse.Namespace) -> int:
    from appliance.registry import ModelRegistry

    with _open(args) as db:
        record = ModelRegistry(db).add(args.path, name=args.name, sessions=args.sessions,
                                       context=args.context, kv_quant=args.kv_quant)
    _emit(args, record.to_dict(),
          [f"added {record.name}: {record.architecture} {record.file_type}, "
           f"{record.size_bytes / 2**20:.1f} MiB, sha256 {record.sha256[:16]}…",
           f"  {record.path}"])
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from appliance.registry import ModelRegistry

    with _open(args) as db:
        records = ModelRegistry(db).list()
    lines = [f"{'NAME':<24} {'ARCH':<10} {'TYPE':<8} {'MIB':>9} {'SESS':>4} {'CTX':>7} "
             f"{'KV':<5} PATH"]
    for r in records:
        lines.append(f"{r.name[:24]:<24} {r.architecture[:10]:<10} {r.file_type[:8]:<8} "
                     f"{r.size_bytes / 2**20:>9.1f} {r.sessions or '-':>4} {r.context or '-':>7} "
                     f"{r.kv_quant or '-':<5} {r.path}")
    if not records:
        lines = ["no models registered (add one with: mbufo models add PATH|default)"]
    _emit(args, {"models": [r.to_dict() for r in records]}, lines)
    return 0


def cmd_models_rm(args: argparse.Namespace) -> int:
    from appliance.registry import ModelRegistry

    with _open(args) as db:
        removed = ModelRegistry(db).remove(args.name)
    _emit(args, {"name": args.name, "removed": removed},
          [f"removed {args.name}" if removed else f"no model named {args.name}"])
    return 0 if removed else 1
