"""The ``minillm`` command line.

    minillm serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY]   # OpenAI-compatible server
    minillm generate "ROMEO:" ["JULIET:" ...] [--n 2] [--max-new-tokens 64] [--temperature 0.8] [--stop STR]
    minillm bench ...                                  # throughput and serving latency (minillm.experiments.ch09_engine_benchmark)
    minillm train --preset shakespeare --out PATH      # how the bundled model was made

``PATH`` is a local Hugging Face-format folder (``config.json`` + ``*.safetensors`` +
``tokenizer.json``); it defaults to ``$MINILLM_MODEL``, else to the bundled Shakespeare model
(``minillm/checkpoints/shakespeare``, trained by ``minillm train``). ``serve`` and ``generate``
run the engine (`minillm.engine`); its knobs are the same flags on both.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

from minillm import BUNDLED_MODEL



# == the engine's flags, shared by serve and generate ============================================

def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=os.environ.get("MINILLM_MODEL") or str(BUNDLED_MODEL),
                        help="checkpoint folder (default: $MINILLM_MODEL, else the bundled model)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="compute dtype (default: float32 on the CPU, the checkpoint's on a GPU)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV pool size in blocks (default: from the memory budget below)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--kv-cache-mb", type=float, default=64, help="on a CPU, the KV pool in MiB (default 64)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="on a GPU, the fraction of its memory the engine may use in all (default 0.9)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="most sequences running at once (default 128)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024,
                        help="token budget of one step; longer prompts are prefilled in chunks (default 1024)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + completion (default: the model's context, capped by the pool)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="do not reuse the KV blocks of prompts")


def engine_config(args: argparse.Namespace):
    from minillm.engine import EngineConfig

    return EngineConfig(device=args.device, dtype=args.dtype, block_size=args.block_size, num_blocks=args.num_blocks,
                        kv_cache_memory_mb=args.kv_cache_mb, gpu_memory_utilization=args.gpu_memory_utilization,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching)


def _check_model(args: argparse.Namespace) -> bool:
    if (Path(args.model) / "config.json").is_file():
        return True
    print(f"minillm {args.command}: {args.model} is not a checkpoint folder (no config.json); "
          "pass --model PATH or set MINILLM_MODEL", file=sys.stderr)
    return False


# == commands ====================================================================================

def cmd_serve(args: argparse.Namespace) -> int:
    if not _check_model(args):
        return 2
    from minillm.server import serve

    serve(args.model, engine_config(args), host=args.host, port=args.port, api_key=args.api_key,
          log_level=args.log_level)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if not _check_model(args):
        return 2
    from minillm.engine import LLM, InvalidRequest, SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_new_tokens, seed=args.seed, n=args.n, stop=args.stop or ())
    except ValueError as e:
        print(f"minillm generate: {e}", file=sys.stderr)
        return 2
    llm = LLM(args.model, **vars(engine_config(args)))
    start = time.perf_counter()
    try:
        outputs = llm.generate(args.prompt, params, use_tqdm=len(args.prompt) > 1)
    except InvalidRequest as e:
        print(f"minillm generate: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    completions = [(out.prompt, c) for out in outputs for c in out.outputs]
    for i, (prompt, c) in enumerate(completions):
        if len(completions) > 1:
            print(f"{'' if i == 0 else chr(10)}--- completion {i + 1} of {len(completions)} ({c.finish_reason}) ---")
        print(prompt + c.text)
    tokens = sum(len(c.token_ids) for _, c in completions)
    print(f"[{tokens} tokens in {seconds:.2f} s on {llm.engine.device.type}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="minillm", description="LLM inference from scratch.")
    sub = parser.add_subparsers(dest="command", required=True)

    sv = sub.add_parser("serve", help="serve a checkpoint with an OpenAI-compatible HTTP API")
    add_engine_arguments(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=os.environ.get("MINILLM_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1/* (default: $MINILLM_API_KEY, else none)")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    sv.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="complete prompts with a local checkpoint (the offline engine)")
    gen.add_argument("prompt", nargs="+", help="one or more prompts (a progress bar shows for several)")
    add_engine_arguments(gen)
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8,
                     help="sampling temperature; 0 is greedy decoding (default 0.8: a small model's greedy "
                          "text soon repeats itself)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--stop", action="append", help="a string that ends a completion (repeatable)")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="offline throughput and online serving latency (minillm.experiments.ch09_engine_benchmark)")
    if argv[:1] == ["bench"]:  # imported only when asked for
        try:
            benchmark = importlib.import_module("minillm.experiments.ch09_engine_benchmark")
        except ModuleNotFoundError as e:
            if e.name != "minillm.experiments.ch09_engine_benchmark":
                raise
            parser.error("this installation has no minillm.experiments.ch09_engine_benchmark")
        benchmark.add_arguments(bench)
        bench.set_defaults(func=benchmark.main)

    tr = sub.add_parser("train", help="train a small Llama from scratch (the bundled model's recipe)")
    from minillm import train
    train.add_arguments(tr)
    tr.set_defaults(func=train.main)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
