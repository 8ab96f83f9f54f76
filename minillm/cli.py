"""The ``minillm`` command line.

    minillm generate "ROMEO:" [--model PATH] [--max-new-tokens 64] [--temperature 0.8]
    minillm train --preset shakespeare --out PATH     # how the bundled model was made

``PATH`` is a local Hugging Face-format folder (``config.json`` + ``*.safetensors`` +
``tokenizer.json``); it defaults to ``$MINILLM_MODEL``, else to the bundled Shakespeare model
(``minillm/checkpoints/shakespeare``, trained by ``minillm train``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

#: The model shipped in the repository (see minillm/checkpoints/shakespeare/README.md).
BUNDLED_MODEL = Path(__file__).resolve().parent / "checkpoints" / "shakespeare"


def cmd_generate(args: argparse.Namespace) -> int:
    from minillm.model import generate, load_model, load_tokenizer

    if not (Path(args.model) / "config.json").is_file():
        print(f"minillm generate: {args.model} is not a checkpoint folder (no config.json); "
              "pass --model PATH or set MINILLM_MODEL", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # CPUs have no fast bf16/fp16 matmul: compute in float32 there, the saved dtype on a GPU.
    dtype = args.dtype or ("float32" if device == "cpu" else None)
    model, config = load_model(args.model, device=device, dtype=dtype)
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
    gen.add_argument("--model", default=os.environ.get("MINILLM_MODEL") or str(BUNDLED_MODEL),
                     help="checkpoint folder (default: $MINILLM_MODEL, else the bundled model)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8,
                     help="sampling temperature; 0 is greedy decoding (default 0.8: a small model's greedy "
                          "text soon repeats itself)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    gen.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                     help="compute dtype (default: float32 on the CPU, the checkpoint's on a GPU)")
    gen.set_defaults(func=cmd_generate)
    tr = sub.add_parser("train", help="train a small Llama from scratch (the bundled model's recipe)")
    from minillm import train
    train.add_arguments(tr)
    tr.set_defaults(func=train.main)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
