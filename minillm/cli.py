"""The ``minillm`` command line.

    minillm serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY]   # OpenAI-compatible server
    minillm generate "ROMEO:" ["JULIET:" ...] [--n 2] [--max-new-tokens 64] [--temperature 0.8] [--stop STR]
    minillm bench ...                                  # throughput and serving latency (minillm.experiments.ch09_engine_benchmark)
    minillm route --instances 2 [engine flags]         # prefix-aware router over instances (minillm.router)
    minillm train --preset shakespeare --out PATH      # how the bundled model was made

``PATH`` is a local Hugging Face-format folder (``config.json`` + ``*.safetensors`` +
``tokenizer.json``); it defaults to ``$MINILLM_MODEL``, else to the bundled Shakespeare model
(``minillm/checkpoints/shakespeare``, trained by ``minillm train``). ``serve`` and ``generate``
run the engine (`minillm.engine`); its knobs are the same flags on both (and on ``bench``), built
from `EngineConfig`'s fields and defaults (`ENGINE_FLAGS`). ``python -m minillm`` is the same
command. A checkpoint folder minillm cannot use (`minillm.model.CheckpointError`) ends it with
one line, ``minillm <command>: <file>: <problem>``, and exit status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time
from pathlib import Path

from minillm import BUNDLED_MODEL
from minillm.model.config import CheckpointError



# == the engine's flags, shared by serve, generate and bench ======================================

#: The engine's flags: option strings -> (`EngineConfig` field, ``add_argument`` keywords). Their
#: defaults are not here: they are the dataclass's (`engine_defaults`), the one source.
ENGINE_FLAGS: dict[tuple[str, ...], tuple[str, dict]] = {
    ("--device",): ("device", dict(help="cpu or cuda (default: cuda if available)")),
    ("--dtype",): ("dtype", dict(choices=["float32", "bfloat16", "float16"],
                                 help="compute dtype (default: float32 on the CPU, the checkpoint's on a GPU)")),
    ("--num-blocks",): ("num_blocks", dict(type=int, help="KV pool size in blocks (default: from the memory "
                                                         "budget below)")),
    ("--block-size",): ("block_size", dict(type=int, help="tokens per KV block (default %(default)s)")),
    ("--kv-cache-mb", "--kv-cache-memory-mb"): ("kv_cache_memory_mb", dict(
        type=float, help="on a CPU, the KV pool in MiB (default %(default)s)")),
    ("--gpu-memory-utilization",): ("gpu_memory_utilization", dict(
        type=float, help="on a GPU, the fraction of its memory the engine may use in all (default %(default)s)")),
    ("--max-num-seqs",): ("max_num_seqs", dict(type=int, help="most sequences running at once (default %(default)s)")),
    ("--max-num-batched-tokens",): ("max_num_batched_tokens", dict(
        type=int, help="token budget of one step; longer prompts are prefilled in chunks (default %(default)s)")),
    ("--max-model-len",): ("max_model_len", dict(type=int, help="longest prompt + completion (default: the "
                                                               "model's context, capped by the pool)")),
    ("--no-prefix-caching",): ("enable_prefix_caching", dict(action="store_false",
                                                             help="do not reuse the KV blocks of prompts")),
    ("--attention-backend",): ("attention_backend", dict(
        choices=["auto", "torch", "triton"],
        help="auto (default): the Triton kernels on CUDA in fp16/bf16, torch otherwise")),
    ("--cuda-graphs",): ("cuda_graphs", dict(
        choices=["all", "decode", "off"],
        help="on CUDA with the Triton kernels, replay CUDA graphs for all steps, decode steps only, or none "
             "(default %(default)s)")),
    ("--tensor-parallel-size", "--tensor-parallel"): ("tensor_parallel_size", dict(
        type=int, help="split the model over this many GPUs, one process each (Chapter 13; default %(default)s)")),
    ("--fused-decode",): ("fused_decode", dict(
        choices=["auto", "on", "off"],
        help="Chapter 10's fused kernels and merged projections: auto (default: on CUDA with the Triton "
             "kernels), on, or off")),
    ("--kv-cache",): ("kv_cache", dict(
        choices=["paged", "virtual"],
        help="paged (default): KV blocks and block tables (Chapters 5-6); virtual: each sequence contiguous in "
             "virtual memory, pages mapped as it grows (Chapter 11; on CUDA it needs cuda-bindings)")),
    ("--overlap-decode",): ("overlap_decode", dict(
        choices=["auto", "off"],
        help="launch each decode step before the last one's tokens reach the host, so that scheduling and "
             "sampling overlap the GPU: auto (default: on CUDA with graphs and on-device sampling) or off")),
}


def engine_defaults() -> dict:
    """``{field: default}`` of `EngineConfig` (every field has one)."""
    from minillm.engine.config import EngineConfig

    return {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def add_engine_arguments(parser: argparse.ArgumentParser, defaults: dict | None = None,
                         helps: dict | None = None, exclude: tuple[str, ...] = ()) -> None:
    """Add `ENGINE_FLAGS` to ``parser`` (``dest`` = the field name, default = EngineConfig's).

    ``defaults``/``helps``: per field, a default/help that differs for this command (``minillm
    bench``); ``exclude``: fields the command sets itself.
    """
    values = {**engine_defaults(), **(defaults or {})}
    for options, (name, kwargs) in ENGINE_FLAGS.items():
        if name in exclude:
            continue
        kwargs = {**kwargs, **({"help": helps[name]} if helps and name in helps else {})}
        if len(options) > 1 and "action" not in kwargs and "choices" not in kwargs:
            kwargs.setdefault("metavar", options[0].lstrip("-").upper().replace("-", "_"))  # not the field's name
        parser.add_argument(*options, dest=name, default=values[name], **kwargs)


def engine_flag_values(args: argparse.Namespace) -> dict:
    """``{field: value}`` of the engine flags ``args`` holds."""
    return {name: getattr(args, name) for name, _ in ENGINE_FLAGS.values() if hasattr(args, name)}


def engine_config(args: argparse.Namespace, **overrides):
    """The `EngineConfig` of the parsed flags (and ``overrides``)."""
    from minillm.engine.config import EngineConfig

    return EngineConfig(**{**engine_flag_values(args), **overrides})


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=os.environ.get("MINILLM_MODEL") or str(BUNDLED_MODEL),
                        help="checkpoint folder (default: $MINILLM_MODEL, else the bundled model)")


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
          log_level=args.log_level, max_body_bytes=args.max_body_bytes, shutdown_timeout=args.shutdown_timeout)
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


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``minillm`` parser; ``bench``'s options are added only when ``argv`` asks for it."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="minillm", description="LLM inference from scratch.")
    sub = parser.add_subparsers(dest="command", required=True)

    sv = sub.add_parser("serve", help="serve a checkpoint with an OpenAI-compatible HTTP API")
    add_model_argument(sv)
    add_engine_arguments(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=os.environ.get("MINILLM_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1/* (default: $MINILLM_API_KEY, else none)")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    sv.add_argument("--max-body-bytes", type=int, default=8 * 2**20,
                    help="largest request body accepted; larger ones get 413 before they are read (default 8 MiB)")
    sv.add_argument("--shutdown-timeout", type=float, default=10.0,
                    help="seconds the first Ctrl-C/SIGTERM lets requests in flight finish (a second stops at once)")
    sv.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="complete prompts with a local checkpoint (the offline engine)")
    gen.add_argument("prompt", nargs="+", help="one or more prompts (a progress bar shows for several)")
    add_model_argument(gen)
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

    rt = sub.add_parser("route", help="prefix-aware router over several engine instances (minillm.router)")
    if argv[:1] == ["route"]:  # imported only when asked for
        from minillm.router import command as route_command
        route_command.add_arguments(rt)
        rt.set_defaults(func=route_command.main)

    tr = sub.add_parser("train", help="train a small Llama from scratch (the bundled model's recipe)")
    from minillm import train
    train.add_arguments(tr)
    tr.set_defaults(func=train.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``minillm`` (and ``python -m minillm``): a user error exits 2 with one line on stderr."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return args.func(args)
    except CheckpointError as e:  # a user's checkpoint folder: say what is wrong, no traceback
        print(f"minillm {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
