"""The ``minillm`` command line.

    minillm generate "Once upon a time" --model PATH [--max-new-tokens 64] [--temperature 0.8]

``PATH`` is a local Hugging Face-format folder (``config.json`` + ``*.safetensors`` +
``tokenizer.json``); it defaults to ``$MINILLM_MODEL``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def cmd_generate(args: argparse.Namespace) -> int:
    from minillm.model import generate, load_model, load_tokenizer

    if not args.model:
        print("minillm generate: no model given: pass --model PATH or set MINILLM_MODEL", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, config = load_model(args.model, device=device)
    tokenizer, _ = load_tokenizer(args.model)
    prompt_ids = tokenizer.encode(args.prompt).ids
    if not prompt_ids:
        print("minillm generate: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    input_ids = torch.tensor([prompt_ids], device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    start = time.perf_counter()
    with torch.inference_mode():
        out = generate(model, input_ids, args.max_new_tokens, greedy=args.temperature == 0,
                       temperature=args.temperature or 1.0,
                       eos_token_id=config.eos_token_ids[0] if config.eos_token_ids else None,
                       generator=generator)
    seconds = time.perf_counter() - start
    # Decode prompt and continuation together: tokenizers put the joining whitespace there.
    print(tokenizer.decode(out[0].tolist()))
    print(f"[{out.shape[1] - len(prompt_ids)} tokens in {seconds:.2f} s on {device}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minillm", description="LLM inference from scratch.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="continue a prompt with a local checkpoint")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=os.environ.get("MINILLM_MODEL"), help="checkpoint folder")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy decoding")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    gen.set_defaults(func=cmd_generate)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
