"""Chapter 10 benchmark: the engine's host time per decode step, with the model taken out.

A decode step of the engine is host work (schedule, take slots, build the step's batch, sample,
check the stop conditions) around the GPU's forward pass. With CUDA graphs the GPU part of a
64-sequence step of the 280M model is about 1.15 ms on an H100; whatever the host adds on top
is time the GPU waits, unless the two overlap. This benchmark measures the host part alone, on
any machine (no GPU needed):

- the engine is built on a 1-layer random Llama (`minillm.testing.tiny_llama`), and its runner
  is replaced by `minillm.experiments.ch10_host_overhead.FreeRunner`, which returns a fixed logits tensor and its argmax without
  running the model: what remains of `LLMEngine._step` is the host's work;
- the tokens come "from the device" as on a GPU (`LLMEngine.sample_on_device`): the engine's
  sampling path is the one a CUDA step takes (`LLMEngine._sample_from_device`);
- ``NUM_SEQS`` greedy requests (``ignore_eos``) of ``PROMPT_LEN`` tokens are admitted and
  prefilled, then ``STEPS`` pure decode steps are timed one by one: ``host_step_ms`` is the
  median wall time of one ``_step``, in both KV-cache modes (``paged``: Chapter 9's block
  manager with the prefix cache on; ``virtual``: Chapter 11's `VirtualBlockManager` over the
  simulated allocator), with the benchmark's ``record_steps`` on, as in Chapter 9's runs.

`minillm.experiments.ch10_host_overhead.profile_steps` gives the cProfile top list of the same steps (``python -m bench.ch10_host_overhead
--profile``). Rows: ``host_step_ms`` per mode (virtual's row has paged as its peer, ``better``
lower), ``host_us_per_seq``.
"""
from __future__ import annotations

import argparse

from bench.common import Results
from minillm.experiments.ch10_host_overhead import MODES, NUM_SEQS, PROMPT_LEN, STEPS, host_step_ms, profile_steps

BENCHMARK = "ch10_host_overhead"
NEEDS_CEILINGS = False


def run(results: Results, device=None) -> None:
    """Measure both modes (on the host: ``device`` is not used) and add the rows."""
    ms = {mode: host_step_ms(mode) for mode in MODES}
    base = {"num_seqs": NUM_SEQS, "prompt_len": PROMPT_LEN, "steps": STEPS, "model": "none (FreeRunner)"}
    for mode in MODES:
        peer = ("paged", ms["paged"]) if mode == "virtual" else (None, None)
        results.add(BENCHMARK, {**base, "kv_cache": mode}, "host_step_ms", ms[mode], *peer, better="lower",
                    note="median wall time of one pure decode step with the model taken out")
        results.add(BENCHMARK, {**base, "kv_cache": mode}, "host_us_per_seq", 1e3 * ms[mode] / NUM_SEQS, better="lower")
        print(f"  [{BENCHMARK}] {mode}: {ms[mode]:.3f} ms per step of {NUM_SEQS} sequences", flush=True)


def summary(results: Results | dict) -> str:
    from minillm.results import rows as select

    data = results.to_dict() if isinstance(results, Results) else results
    return "\n".join(f"{r['params']['kv_cache']:>8}: {r['ours']:.3f} ms of host time per decode step of "
                     f"{r['params']['num_seqs']} sequences" for r in select(data, BENCHMARK, "host_step_ms"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The engine's host time per decode step (no GPU needed).")
    ap.add_argument("--num-seqs", type=int, default=NUM_SEQS)
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--mode", choices=MODES, action="append", help="KV-cache mode (default both)")
    ap.add_argument("--profile", action="store_true", help="print cProfile's top list too")
    args = ap.parse_args(argv)
    for mode in args.mode or MODES:
        ms = host_step_ms(mode, args.num_seqs, args.prompt_len, args.steps)
        print(f"{mode:>8}: {ms:.3f} ms per decode step of {args.num_seqs} sequences "
              f"({1e3 * ms / args.num_seqs:.1f} us per sequence)", flush=True)
        if args.profile:
            print(profile_steps(mode, args.num_seqs, args.prompt_len))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
