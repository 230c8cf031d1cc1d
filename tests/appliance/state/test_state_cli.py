"""`mbufo db|keys|models` end to end through appliance.cli.state_commands on a temporary
data directory (the first command finds it missing)."""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from appliance.auth import AuthError, KeyService
from appliance.cli import state_commands
from appliance.db import open_database
from appliance.settings import Settings

Capture = pytest.CaptureFixture[str]
KEY_FORMAT = re.compile(r"mbufo_[A-Za-z0-9]{8,12}_[A-Za-z0-9]{43,}")


@pytest.fixture(autouse=True)
def no_ambient_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MBUFO_CONFIG", "MBUFO_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)


def run(capsys: Capture, *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="mbufo")
    sub = parser.add_subparsers(dest="command", required=True)
    state_commands.register(sub)
    args = parser.parse_args(list(argv))
    code = args.handler(args)
    out, err = capsys.readouterr()
    return code, out, err


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_keys_lifecycle_on_an_empty_data_dir(tmp_path: Path, capsys: Capture) -> None:
    data = str(tmp_path / "new" / "data")
    code, out, _ = run(capsys, "keys", "create", "--name", "laptop", "--role", "user",
                       "--user", "alice", "--max-pending", "3", "--max-concurrent", "2",
                       "--rpm", "10", "--tpm", "1000", "--tpd", "9000", "--models", "a, b",
                       "--expires-days", "7", "--data-dir", data, "--json")
    assert code == 0
    assert stat.S_IMODE(Path(data).stat().st_mode) == 0o700
    created = last_json(out)
    key = created["key"]
    assert KEY_FORMAT.fullmatch(key) and key in out.splitlines()[:-1]  # printed for humans
    assert created["quota"] == {"allowed_models": ["a", "b"], "max_pending": 3,
                                "max_concurrent_streams": 2, "requests_per_min": 10,
                                "tokens_per_min": 1000, "tokens_per_day": 9000,
                                "expires_at": created["expires_at"]}
    key_id = created["id"]

    code, out, _ = run(capsys, "keys", "list", "--data-dir", data, "--json")
    assert code == 0
    listed = last_json(out)["keys"]
    assert [(k["id"], k["user"], k["role"], k["status"]) for k in listed] == [
        (key_id, "alice", "user", "active")]
    secret = key.rsplit("_", 1)[1]
    assert secret not in out and "sha256" not in out

    code, out, _ = run(capsys, "keys", "quota", key_id, "--rpm", "0", "--models", "all",
                       "--data-dir", data, "--json")
    assert code == 0
    quota = last_json(out)["quota"]
    assert (quota["requests_per_min"], quota["allowed_models"], quota["tokens_per_min"]) == (
        None, None, 1000)

    db = open_database(Settings(data_dir=Path(data)))
    try:
        assert KeyService(db).authenticate(f"Bearer {key}").user == "alice"
        assert run(capsys, "keys", "revoke", key_id, "--data-dir", data)[0] == 0
        assert run(capsys, "keys", "revoke", key_id, "--data-dir", data)[0] == 1
        with pytest.raises(AuthError, match="revoked"):
            KeyService(db).authenticate(f"Bearer {key}")
    finally:
        db.close()


def test_invalid_input_exits_2(tmp_path: Path, capsys: Capture) -> None:
    data = str(tmp_path / "data")
    code, _, err = run(capsys, "keys", "create", "--name", "x", "--role", "user",
                       "--max-pending", "0", "--data-dir", data)
    assert code == 2 and "max_pending" in err
    with pytest.raises(SystemExit):
        run(capsys, "keys", "create", "--name", "x", "--role", "root", "--data-dir", data)
    assert run(capsys, "keys", "quota", "NoSuchKey1", "--rpm", "1", "--data-dir", data)[0] == 1


def test_data_dir_from_environment_and_config(tmp_path: Path, capsys: Capture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    env_dir, toml_dir = tmp_path / "env", tmp_path / "toml"
    monkeypatch.setenv("MBUFO_DATA_DIR", str(env_dir))
    assert run(capsys, "keys", "create", "--name", "e", "--role", "admin")[0] == 0
    assert (env_dir / "mbufo.db").is_file()
    config = tmp_path / "config.toml"
    config.write_text(f'data_dir = "{toml_dir}"\n')
    monkeypatch.delenv("MBUFO_DATA_DIR")
    assert run(capsys, "keys", "list", "--config", str(config))[0] == 0
    assert (toml_dir / "mbufo.db").is_file()


def test_models_add_list_rm(tmp_path: Path, capsys: Capture,
                            tiny_gguf: Callable[..., Path]) -> None:
    data, path = str(tmp_path / "data"), tiny_gguf()
    code, out, _ = run(capsys, "models", "add", str(path), "--name", "tiny", "--sessions", "2",
                       "-c", "2048", "--kv-quant", "q8", "--data-dir", data, "--json")
    assert code == 0
    added = last_json(out)
    assert (added["name"], added["architecture"], added["context"], added["kv_quant"]) == (
        "tiny", "llama", 2048, "q8")
    code, out, _ = run(capsys, "models", "list", "--data-dir", data, "--json")
    assert [m["name"] for m in last_json(out)["models"]] == ["tiny"]
    assert run(capsys, "models", "add", str(path), "--name", "tiny", "--data-dir", data)[0] == 2
    assert run(capsys, "models", "rm", "tiny", "--data-dir", data)[0] == 0
    assert run(capsys, "models", "rm", "tiny", "--data-dir", data)[0] == 1
    code, out, _ = run(capsys, "models", "list", "--data-dir", data, "--json")
    assert last_json(out) == {"models": []}


def test_db_upgrade_downgrade_current(tmp_path: Path, capsys: Capture) -> None:
    data = tmp_path / "data"
    code, out, _ = run(capsys, "db", "upgrade", "--data-dir", str(data), "--json")
    head = last_json(out)["head"]
    assert code == 0 and last_json(out)["revision"] == head
    code, out, _ = run(capsys, "db", "downgrade", "base", "--data-dir", str(data), "--json")
    assert code == 0 and last_json(out)["revision"] is None
    with sqlite3.connect(data / "mbufo.db") as conn:
        assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name='api_keys'"
                            ).fetchone() == (0,)
    code, out, _ = run(capsys, "db", "current", "--data-dir", str(data), "--json")
    assert last_json(out)["revision"] is None  # `db current` does not upgrade
    assert run(capsys, "db", "downgrade", "nonexistent", "--data-dir", str(data))[0] == 2
    code, out, _ = run(capsys, "db", "upgrade", "--data-dir", str(data), "--json")
    assert last_json(out)["revision"] == head
