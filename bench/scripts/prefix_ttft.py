"""Second-turn TTFT with the prefix cache against the same request with the cache cleared.

    python bench/scripts/prefix_ttft.py [MODEL]
Turn 1: a ~600-token user message and a 16-token reply; turn 2: turn 1 + reply + a new
user message. Prints cached_tokens, both TTFTs (median of 3) and their ratio as JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from engine.build import EngineOptions, build_engine
from engine.sampler import SamplingParams
from engine.scheduler.request import Request


def main() -> int:
    model = sys.argv[1] if len(sys.argv) > 1 else "default"
    engine = build_engine(model, EngineOptions(sessions=2, context=2048))
    tok, tpl = engine.loaded.tokenizer, engine.loaded.chat_template
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    text = "Tell me about lighthouses, their lenses and their keepers. " * 60
    ids1 = tok.encode(tpl.render([{"role": "user", "content": text}]), add_special=False)
    reply = [t for c in engine.stream(Request("t1", tuple(ids1), greedy)) for t in c.token_ids]
    ids2 = tuple(ids1 + reply + tok.encode(
        "<end_of_turn>\n<start_of_turn>user\nWho was Fresnel?<end_of_turn>\n"
        "<start_of_turn>model\n", add_special=False, parse_special=True))
    one = SamplingParams(temperature=0.0, max_tokens=1)

    def ttft(rid: str) -> tuple[float, int]:
        start = time.perf_counter()
        chunks = list(engine.stream(Request(rid, ids2, one)))
        return time.perf_counter() - start, chunks[-1].cached_tokens

    warm, cold, cached = [], [], 0
    for i in range(3):
        t, cached = ttft(f"warm{i}")
        warm.append(t)
        engine.core.radix.reset()  # the engine is idle between requests
        t, none = ttft(f"cold{i}")
        assert none == 0
        cold.append(t)
        engine.core.radix.reset()
        # turn 1 again (greedy: the same reply) caches prompt + reply for the next warm run
        list(engine.stream(Request(f"prime{i}", tuple(ids1), greedy)))
    engine.stop()
    w, c = statistics.median(warm), statistics.median(cold)
    print(json.dumps({"prompt_tokens": len(ids2), "shared_prefix": len(ids1) + len(reply),
                      "cached_tokens": cached, "ttft_cached_ms": round(w * 1e3, 1),
                      "ttft_cleared_ms": round(c * 1e3, 1), "ratio": round(w / c, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
