"""bench/gpu/device_call.sh's plans, printed (DRY=1): every command names a script of the
tree and only options that script declares, so a call planned here does not fail there."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

from appliance.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "device_call.sh"


def dry(*plans: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *plans], capture_output=True, text=True,
                          env={**os.environ, "DRY": "1", **env}, timeout=60)


def test_every_plan_names_real_scripts_and_options():
    run = dry("tests", "engine", "long", "attn", "fair", "capture", "busy",
              PROMPTS="8192 16384", CAPTURES="2 off 8:step")
    assert run.returncode == 0, run.stderr
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines())
    assert list(lines) == ["tests", "engine", "peer", "long8192", "long16384", "attn_decode",
                           "attn_chunk", "fair_cut0", "fair_cut1", "capture_2_idle",
                           "capture_off_idle", "capture_8_step", "busy_2_idle", "busy_off_idle",
                           "busy_8_step"]
    check_commands(lines)
    tests = shlex.split(lines["tests"])
    assert "gpu" in tests and all((ROOT / p).exists() for p in tests[tests.index("gpu") + 3:])
    assert "--prompt 8192" in lines["long8192"] and "--fill 0,33" in lines["attn_chunk"]
    assert lines["fair_cut0"].startswith("env MBUFO_PREFILL_CUT=0 ")
    assert lines["capture_off_idle"].startswith("env MBUFO_MIXED_CAPTURE_AT=off ")
    assert "MBUFO_MIXED_CAPTURE_WHEN=step " in lines["capture_8_step"]
    assert "bench clients" in lines["busy_8_step"] and "WHEN=step " in lines["busy_8_step"]


def check_commands(lines: dict[str, str]) -> None:
    """Each command's scripts exist and its options are its script's (after `env`'s
    settings)."""
    for name, command in lines.items():
        words = shlex.split(command)
        if words[0] == "env":
            words = words[1:]
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                words = words[1:]
        scripts = [w for w in words if w.endswith((".py", ".sh")) and "/" in w]
        for script in scripts:
            assert (ROOT / script).is_file(), (name, script)
        if "appliance.cli.main" in words:  # the CLI's own parser takes the arguments
            build_parser().parse_args(words[words.index("appliance.cli.main") + 1:])
        elif words[0] == "python3" and words[1] != "-m":
            source = (ROOT / words[1]).read_text()
            declared = set(re.findall(r'add_argument\(\s*"(--[a-z0-9-]+)"', source))
            used = {w.split("=")[0].replace("--no-", "--") for w in words[2:]
                    if w.startswith("--")}  # BooleanOptionalAction: --no-X is --X
            assert used <= declared, (name, used - declared)


def test_moe_plans():
    """moe at three concurrencies; moe_ab the MoE block's routing and activation launched
    separately, then fused one and both, each with the kernel timeline; moe_peer llama.cpp
    on the file moe writes; oss the synthetic gpt-oss-20b, then llama.cpp on its file."""
    run = dry("moe", "moe_ab", "moe_peer", "oss")
    assert run.returncode == 0, run.stderr
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines())
    assert list(lines) == ["moe", "moe_route0_act0", "moe_route1_act0", "moe_route1_act1",
                           "moe_peer", "oss", "oss_peer"]
    assert "gpt-oss-20b:MXFP4" in lines["oss"]
    assert "/tmp/gpt-oss-20b_MXFP4.gguf" in lines["oss_peer"]
    check_commands(lines)
    assert "--concurrency 1,16,64" in lines["moe"]
    for route, act in ("00", "10", "11"):
        line = lines[f"moe_route{route}_act{act}"]
        assert line.startswith(f"env MBUFO_MOE_FUSED_ROUTE={route} MBUFO_MOE_FUSED_ACT={act} ")
        assert "--graph-profile 1" in line and "qwen3-30b-a3b" in line


def test_unknown_plan_and_no_plan_fail():
    bad = dry("nope")
    assert bad.returncode == 1 and "unknown plan nope" in bad.stderr
    usage = dry()
    assert usage.returncode == 2 and "PLAN" in usage.stdout


def test_floats_plan_times_bf16_at_gpt_oss_shapes():
    """floats: qmatmul_bench on BF16 only, at gpt-oss-20b's fused q|k|v, output and head
    shapes and Llama's 4096^2; the bench parses the shapes it is given."""
    run = dry("floats")
    assert run.returncode == 0, run.stderr
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines())
    assert list(lines) == ["floats"]
    check_commands(lines)
    words = shlex.split(lines["floats"])
    assert words[words.index("--types") + 1] == "BF16"
    assert words[words.index("--shapes") + 1] == "5120:2880,2880:4096,201088:2880,4096:4096"


def test_kvq_plan_runs_each_kv_format():
    """kvq: the engine at 1 and 16 streams once for each KV format, with the timeline."""
    run = dry("kvq", KVQ="f16 k8v4 q8")
    assert run.returncode == 0, run.stderr
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines())
    assert list(lines) == ["kv_f16", "kv_k8v4", "kv_q8"]
    check_commands(lines)
    for q in ("f16", "k8v4", "q8"):
        words = shlex.split(lines[f"kv_{q}"])
        assert words[words.index("--kv-quant") + 1] == q and "--graph-profile" in words
