"""`mbufo serve` as a process: first start prints the admin key once and serves with it;
SIGTERM shuts down cleanly; SIGKILL loses no finished request's usage and no state;
--no-auth off loopback is refused."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx

# Runs the CLI with the serve command registered, whether or not main.py lists it yet.
RUN = ("import sys; from appliance.cli import main, serve_command as s\n"
       "if s not in main.COMMAND_MODULES: main.COMMAND_MODULES.append(s)\n"
       "sys.exit(main.main(sys.argv[1:]))")


def _env(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MBUFO_")}
    env["XDG_DATA_HOME"] = str(tmp_path / "xdg")
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_serve_prints_the_admin_key_once_and_stops_on_sigterm(tmp_path, tiny_gguf):
    port = _free_port()
    cmd = [sys.executable, "-c", RUN, "serve", "--port", str(port), "--data-dir",
           str(tmp_path / "data"), "--model", str(tiny_gguf), "--sessions", "1", "-c", "128"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(tmp_path))
    try:
        _wait_healthy(proc, port)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    keys = re.findall(r"mbufo_[A-Za-z0-9]+_[A-Za-z0-9]+", out)
    assert len(keys) == 1, out
    assert keys[0].split("_")[2] not in err  # the secret is not in the logs
    from appliance.auth import KeyService
    from appliance.db import open_database
    from appliance.settings import load_settings

    db = open_database(load_settings({"data_dir": str(tmp_path / "data")}, environ={}))
    try:
        keys_service = KeyService(db)
        assert keys_service.authenticate(f"Bearer {keys[0]}").role == "admin"
        assert keys_service.ensure_admin_key() is None  # a second start prints nothing
    finally:
        db.close()


def test_no_auth_off_loopback_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-c", RUN, "serve", "--no-auth", "--host", "0.0.0.0",
                           "--data-dir", str(tmp_path)], capture_output=True, text=True,
                          env=_env(tmp_path), timeout=120)
    assert proc.returncode == 2
    assert "no_auth" in proc.stderr and "loopback" in proc.stderr


def test_a_model_that_does_not_load_ends_serve_with_its_reason(tmp_path):
    proc = subprocess.run([sys.executable, "-c", RUN, "serve", "--model",
                           str(tmp_path / "missing.gguf"), "--data-dir", str(tmp_path),
                           "--port", "18931"], capture_output=True, text=True,
                          env=_env(tmp_path), timeout=120)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mbufo: error: model ") and "missing.gguf" in last
    assert "did not load" in last and "readable GGUF" in last


def _start(tmp_path, tiny_gguf, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-c", RUN, "serve", "--port", str(port), "--data-dir",
           str(tmp_path / "data"), "--model", str(tiny_gguf), "--sessions", "2", "-c", "512"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=_env(tmp_path))


def test_a_killed_server_keeps_its_state_and_restarts(tmp_path, tiny_gguf):
    """SIGKILL in the middle of a stream, 0.2 s after a finished request: the restarted
    server accepts the same admin key without printing a new one, the finished request's
    usage row was written (the writer commits every 50 ms), and the database is intact."""
    import sqlite3

    port = _free_port()
    proc = _start(tmp_path, tiny_gguf, port)
    try:
        key = None
        deadline = time.monotonic() + 120
        while key is None:  # the first start prints the admin key before serving
            assert time.monotonic() < deadline
            match = re.search(r"mbufo_[A-Za-z0-9]+_[A-Za-z0-9]+", proc.stdout.readline())
            key = match.group(0) if match else None
        _wait_healthy(proc, port)
        url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}
        done = httpx.post(f"{url}/v1/completions", headers=auth, timeout=60, json={
            "prompt": "one two", "max_tokens": 2, "ignore_eos": True})
        assert done.status_code == 200, done.text
        time.sleep(0.2)
        with httpx.stream("POST", f"{url}/v1/completions", headers=auth, timeout=60, json={
                "prompt": "three", "max_tokens": 400, "ignore_eos": True, "stream": True}) as s:
            next(s.iter_lines())  # streaming
            proc.kill()
            proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    db = tmp_path / "data" / "mbufo.db"
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        rows = conn.execute("SELECT prompt_tokens, completion_tokens, status FROM usage").fetchall()
    assert (2, "ok") in [(c, st) for _, c, st in rows], rows
    again = _start(tmp_path, tiny_gguf, port)
    try:
        _wait_healthy(again, port)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=auth, timeout=10)
        assert models.status_code == 200 and models.json()["data"], models.text
    finally:
        again.send_signal(signal.SIGTERM)
        out, _ = again.communicate(timeout=60)
    assert "mbufo_" not in out  # no second admin key
