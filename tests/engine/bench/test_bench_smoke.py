"""A real in-process run: `mbufo bench decode default --concurrency 1,2 --tokens 4 --json`."""

from __future__ import annotations

import json

import pytest
from bench_fakes import parse_cli


@pytest.mark.slow
def test_decode_on_the_default_model(capsys):
    args = parse_cli(["bench", "decode", "default", "--concurrency", "1,2", "--tokens", "4",
                  "--prompt-tokens", "16", "-c", "256", "--json"])
    assert args.handler(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    levels = out["results"]["mbufo"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    assert [lv["completion_tokens"] for lv in levels] == [4, 8]
    for lv in levels:
        assert lv["total_tok_s"] > 0 and lv["per_session_tok_s"] > 0
        assert set(lv["itl_ms"]) == {"mean", "p95", "max"}
        assert 0 < lv["itl_ms"]["mean"] <= lv["itl_ms"]["max"]
    assert out["targets"][0]["options"]["sessions"] >= 2
    # one stream against its bytes' bound: the default file's bytes at the streams' context
    from engine.gguf import ModelFile
    from engine.loader import resolve_model_path
    from engine.models.registry import read_config
    from engine.planner import decode_read_bytes

    bound = out["bounds"]["mbufo"]
    with ModelFile.open(resolve_model_path("default")) as mf:
        assert bound["token_bytes"] == decode_read_bytes(mf, read_config(mf), 16 + 4, "f16")
    assert bound["copy_gb_s"] > 0
    assert abs(bound["one_stream_pct"] - 100 * levels[0]["per_session_tok_s"]
               / bound["bound_tok_s"]) < 0.06
