"""bench/gpu/env_sweep.py: one engine_bench process per environment setting, its figures
merged into sweep.json after each run; here against a stand-in for engine_bench.py that
writes figures from its environment and arguments (or fails)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))
import env_sweep  # noqa: E402

FAKE = '''
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
if os.environ.get("FAKE_FAIL"):
    print("Traceback: boom", file=sys.stderr)
    sys.exit(1)
out = Path(args[args.index("--out") + 1])
out.mkdir(parents=True)
c = args[args.index("--concurrency") + 1]
tps = float(os.environ.get("FAKE_TPS", "1"))
fig = {"decode_tps": {c: tps}, "prefill_tps": {"512": tps * 20},
       "decode": {c: {"total_tok_s": tps, "steady_tok_s": tps * 1.25 if c != "1" else None}}}
if "--graph-profile" in args:
    fig["graph_profile"] = {c: {"step_shares": [["_k", 5.0, 2]], "kernels_per_step": 2}}
(out / "engine_bench.json").write_text(json.dumps(
    {"variants": {"q8+graphs": fig}, "argv": args}))
'''


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    path = tmp_path / "fake_bench.py"
    path.write_text(FAKE)
    return path


def test_each_run_in_its_own_environment(tmp_path, fake, capsys):
    out = tmp_path / "out"
    assert env_sweep.main(["--vocab", "v.gguf", "--out", str(out), "--bench", str(fake),
                           "--run", "base:1", "--run", "fast+profile:16:FAKE_TPS=470.5",
                           "--run", "broken:1:FAKE_FAIL=1,FAKE_TPS=2",
                           "--", "--tokens", "64"]) == 0
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["engine_bench_args"] == ["--tokens", "64"]
    base, fast, broken = sweep["runs"]
    assert base["env"] == {} and base["variants"]["q8+graphs"]["decode_tps"] == {"1": 1.0}
    assert fast["env"] == {"FAKE_TPS": "470.5"} and fast["concurrency"] == 16
    row = fast["variants"]["q8+graphs"]
    assert row["decode_tps"] == {"16": 470.5} and row["prefill_tps"] == {"512": 9410.0}
    assert row["step_shares"] == [["_k", 5.0, 2]]
    assert row["steady_tok_s"] == {"16": 588.125}  # every stream decoding
    assert "step_shares" not in base["variants"]["q8+graphs"]
    assert "steady_tok_s" not in base["variants"]["q8+graphs"]  # one stream: none
    assert broken["error"] == "no engine_bench.json"
    assert any("boom" in text for text in broken["log_tail"])
    assert (out / "sweep.log").read_text().count("boom") == 1
    assert fast["engine_bench"]["argv"][-2:] == ["--graph-profile", "16"]
    assert sorted(p.name for p in out.iterdir()) == ["sweep.json", "sweep.log"]
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].startswith("fast+profile [FAKE_TPS=470.5] q8+graphs decode {16: 470.5} "
                                 "steady {16: 588.1}")
    assert printed[2].startswith("broken: FAILED")


def test_a_value_may_be_a_list():
    assert env_sweep.parse_run("k:1:A=1,MBUFO_CARVEOUT_KERNELS=_a_kernel,_b_kernel,B=2") == (
        "k", 1, {"A": "1", "MBUFO_CARVEOUT_KERNELS": "_a_kernel,_b_kernel", "B": "2"})


@pytest.mark.parametrize("text", ["base", "base:0", "base:x", "a b:1", "base:1:lower=1",
                                  "base:1:NOEQUALS", "base:1:A=1,lower=2"])
def test_bad_runs_are_refused(text):
    with pytest.raises(ValueError, match="--run"):
        env_sweep.parse_run(text)


def test_run_names_must_differ(tmp_path, fake):
    with pytest.raises(SystemExit):
        env_sweep.main(["--vocab", "v", "--out", str(tmp_path), "--bench", str(fake),
                        "--run", "a:1", "--run", "a:16"])
    assert not (tmp_path / "sweep.json").exists()
