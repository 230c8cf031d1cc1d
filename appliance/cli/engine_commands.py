"""Engine commands on raw text: generate, perplexity, inspect (no chat template)."""

from __future__ import annotations

import argparse
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a raw prompt (no chat template)")
    _model_args(p)
    p.add_argument("--prompt", required=True, help="raw prompt text (BOS per the model)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation")
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    p.set_defaults(handler=cmd_generate)

    p = sub.add_parser("perplexity", help="teacher-forced NLL and perplexity of a text file")
    _model_args(p)
    p.add_argument("--file", required=True, help="UTF-8 text file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_perplexity)

    p = sub.add_parser("inspect", help="architecture, sizes, tensor types, KV bytes per token")
    p.add_argument("model", help="GGUF path or 'default'")
    p.add_argument("--device", default="cpu",
                   help="cpu (default: the file only) or a GPU (cuda, auto): also time both "
                   "weight layouts there and show which `--weights auto` picks")
    p.add_argument("--sessions", type=int, default=4, help="with a GPU: sessions to fit")
    p.add_argument("-c", "--context", type=int, default=4096, help="with a GPU: tokens each")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_inspect)
    register_plan(sub)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="GGUF path or 'default' (Gemma 3 270M Q4_K_M, embedded)")
    p.add_argument("--dtype", choices=("auto", "bf16", "f32", "int8"), default="auto",
                   help="weights: auto (int8 on CPU, bf16 on GPU; default), bf16, "
                   "f32 (exact, parity checks), int8 (per-row int8 codes, CPU)")
    p.add_argument("-c", "--context", type=int, default=4096, help="context tokens (default 4096)")
    p.add_argument("--kv-quant", choices=("f16", "q8", "k8v4", "k4v8", "k4v4"), default="f16")
    p.add_argument("--device", default="auto", help="auto (GPU when present, default), cpu, cuda")


def _llm(args: argparse.Namespace):
    from engine.llm import LLM

    return LLM(args.model, dtype=args.dtype, context=args.context, kv_quant=args.kv_quant,
               device=args.device)


def cmd_generate(args: argparse.Namespace) -> int:
    from appliance.cli.main import emit_json
    from engine.sampler import SamplingParams

    llm = _llm(args)
    prompt_ids = llm.encode(args.prompt)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens,
                            ignore_eos=args.ignore_eos)
    start = time.perf_counter()
    ids, parts, finish, first = [], [], None, None
    for step in llm.generate(prompt_ids, params):
        first = first or time.perf_counter()
        ids.append(step.token_id)
        parts.append(step.text)
        finish = step.finish_reason
        if not args.json:
            sys.stdout.write(step.text)
            sys.stdout.flush()
    end = time.perf_counter()
    decode_tps = (len(ids) - 1) / (end - first) if len(ids) > 1 and first else 0.0
    if args.json:
        emit_json({"text": "".join(parts), "token_ids": ids, "prompt_tokens": len(prompt_ids),
                   "completion_tokens": len(ids), "finish_reason": finish,
                   "ttft_ms": round(((first or end) - start) * 1000, 2),
                   "decode_tok_s": round(decode_tps, 2)})
    else:
        sys.stdout.write("\n")
        print(f"[{len(prompt_ids)} prompt tokens, {len(ids)} generated, {decode_tps:.1f} tok/s,"
              f" finish: {finish}]", file=sys.stderr)
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    from appliance.cli.main import emit_json

    with open(args.file, encoding="utf-8") as fh:
        text = fh.read()
    result = _llm(args).perplexity(text)
    if args.json:
        emit_json({"num_tokens": result.num_tokens, "mean_nll": result.mean_nll,
                   "ppl": result.ppl, "argmax_ids": result.argmax_ids})
    else:
        print(f"tokens {result.num_tokens}  mean NLL {result.mean_nll:.4f}  "
              f"perplexity {result.ppl:.3f}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from appliance.cli.main import emit_json
    from engine.inspect import inspect_model

    info = inspect_model(args.model, args.device, sessions=args.sessions, context=args.context)
    if args.json:
        emit_json(info)
    else:
        for key, value in info.items():
            print(f"{key:24} {value}")
    return 0


def register_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="memory plan: weights, KV per token/session, what fits")
    p.add_argument("model", help="GGUF path or 'default'")
    p.add_argument("--sessions", type=int, default=4, help="resident sessions (default 4)")
    p.add_argument("-c", "--context", type=int, default=4096, help="tokens per session")
    p.add_argument("--kv-quant", choices=("f16", "q8", "k8v4", "k4v8", "k4v4", "all"),
                   default="all", help="KV format (default: a row for each)")
    p.add_argument("--memory-gb", type=float, default=None, help="memory to plan for")
    p.add_argument("--backend", choices=("cpu", "gpu", "hybrid"), default="cpu",
                   help="cpu: weights as bf16; gpu: weights in their GGML blocks; hybrid: "
                        "the blocks and a bf16 copy of every linear (--weights hybrid)")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from appliance.cli.main import emit_json
    from engine.gguf import ModelFile
    from engine.kv.formats import KV_QUANT_CHOICES
    from engine.loader import resolve_model_path
    from engine.models.registry import read_config
    from engine.planner import plan

    choices = list(KV_QUANT_CHOICES) if args.kv_quant == "all" else [args.kv_quant]
    with ModelFile.open(resolve_model_path(args.model)) as mf:
        cfg = read_config(mf)
        plans = [plan(mf, cfg, sessions=args.sessions, context=args.context, kv_quant=q,
                      prefill_chunk=args.prefill_chunk, backend=args.backend,
                      memory_gb=args.memory_gb) for q in choices]
    if args.json:
        out = plans[0].to_dict() if len(plans) == 1 else {"plans": [p.to_dict() for p in plans]}
        emit_json(out)
        return 0
    mib = 1 << 20
    print(f"{cfg.architecture}: {cfg.num_layers} layers ({cfg.num_sliding_layers} sliding), "
          f"{args.sessions} sessions x {args.context} tokens, weights "
          f"{plans[0].weights_bytes / mib:.0f} MiB ({args.backend})")
    head = f"{'kv':6} {'B/token':>8} {'MiB/session':>12} {'KV MiB':>9} {'total MiB':>10}"
    if args.memory_gb is not None:
        head += f" {'fits':>5} {'max sessions':>13} {'max ctx':>8}"
    print(head)
    for p in plans:
        row = (f"{p.kv_quant:6} {p.kv_bytes_per_token:8d} {p.kv_bytes_per_session / mib:12.1f} "
               f"{p.kv_bytes_total / mib:9.1f} {p.total_bytes / mib:10.1f}")
        if args.memory_gb is not None:
            row += (f" {str(p.fits):>5} {p.max_sessions_at_context:13d}"
                    f" {p.max_context_at_sessions:8d}")
        print(row)
    return 0
