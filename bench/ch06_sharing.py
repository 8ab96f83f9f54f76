"""Chapter 6 benchmark: what block sharing saves, on the GPU with the bundled model.

Three measurements, each with and without sharing, in the same run:

============================  ===============================================================
rows                          what
============================  ===============================================================
``peak_blocks``               n = 4 parallel samples and a beam search of width 4 of one
                              prompt on the bundled Shakespeare model (bf16, blocks of 16):
                              the most KV blocks held at once with fork-sharing (``ours``)
                              and what the same sequences would hold alone (peer
                              ``unshared``); ``saving`` rows give the time-averaged and
                              the peak fraction saved (`minillm.experiments.ch06_prefix_workload.
                              decoder_sharing`)
``simulated_saving``          the same bookkeeping over many requests whose lengths follow
                              the Alpaca-like and ShareGPT-like distributions of
                              `minillm.experiments.ch05_fragmentation` (`minillm.experiments.ch06_sharing.
                              sharing_savings`, widths 2, 4, 6; no model involved)
``prefill_ms``, ``hit_rate``  a shared-system-prompt workload (8 requests, system prompts of
                              64, 256 and 512 tokens, 32-token user messages cut from the
                              Shakespeare excerpt), prefilled one request per step with the
                              prefix cache on (``ours``) and off (peer ``no_prefix_cache``);
                              fastest of 3 runs per request; plus the prefix-cache hit rate
                              and the prefill tokens computed
============================  ===============================================================

The model is tiny (6.9M parameters), so on a GPU its prefill times are dominated by fixed
per-step costs (kernel launches, Python), whatever the number of tokens: measured on an H200,
caching saved no time at all (Chapter 6's notebook measures the CPU, where compute dominates
and the time saved follows the tokens saved). The token and block counts do not depend on the
device.
"""
from __future__ import annotations

import torch

from bench.common import Results

BENCHMARK = "ch06_sharing"
BLOCK_SIZE = 16
WIDTHS = (2, 4, 6)
SYSTEM_LENS = (64, 256, 512)


def run(results: Results, device) -> None:
    """Run the three measurements on ``device`` (CUDA) and add the rows to ``results``."""
    from minillm.cli import BUNDLED_MODEL
    from minillm.experiments.ch06_prefix_workload import compare_prefix_caching, decoder_sharing, shakespeare_workload
    from minillm.model.loader import load_model, load_tokenizer
    from minillm.experiments.ch05_fragmentation import ALPACA_LIKE, SHAREGPT_LIKE
    from minillm.experiments.ch06_sharing import sharing_savings

    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError("the Chapter 6 benchmark runs on a CUDA device (the notebook measures on the CPU)")
    model, _ = load_model(BUNDLED_MODEL, device=device, dtype=torch.bfloat16)
    tokenizer, _ = load_tokenizer(BUNDLED_MODEL)
    base = {"model": "shakespeare (bundled)", "dtype": "bfloat16", "block_size": BLOCK_SIZE}

    # 1. Parallel sampling and beam search of one prompt.
    prompt = shakespeare_workload(tokenizer, system_len=64, num_requests=1, suffix_len=16).prompts[0]
    shared = decoder_sharing(model, prompt, n=4, beam_width=4, max_new_tokens=64, block_size=BLOCK_SIZE)
    for row in shared.rows():
        params = {**base, "decoder": row["decoder"], "prompt_len": len(prompt), "max_new_tokens": 64}
        results.add(BENCHMARK, params, "peak_blocks", row["peak_shared"], "unshared", row["peak_unshared"], better="lower",
                    note=f"{row['steps']} steps, {row['copies']} copy-on-write block copies")
        results.add(BENCHMARK, params, "saving", row["saving"], note="time-averaged fraction of blocks saved")
        results.add(BENCHMARK, params, "peak_saving", row["peak_saving"], note="fraction saved at the peak")
        print(f"  [{BENCHMARK}] {row['decoder']}: peak {row['peak_shared']} vs {row['peak_unshared']} blocks, "
              f"{row['saving']:.1%} saved on average", flush=True)

    # 2. The same bookkeeping over length distributions (no model).
    for dist_name, dist in (("alpaca-like", ALPACA_LIKE), ("sharegpt-like", SHAREGPT_LIKE)):
        for kind in ("parallel", "beam"):
            savings = sharing_savings(kind, WIDTHS, dist, block_size=BLOCK_SIZE)["saving"]
            for width, saving in zip(WIDTHS, savings):
                results.add(BENCHMARK, {"distribution": dist_name, "decoder": kind, "width": width,
                                        "block_size": BLOCK_SIZE}, "simulated_saving", float(saving),
                            note="time-averaged fraction of blocks saved over 50 requests (simulated)")

    # 3. Prefix caching on a shared system prompt.
    for system_len in SYSTEM_LENS:
        workload = shakespeare_workload(tokenizer, system_len=system_len, num_requests=8, suffix_len=32)
        cmp = compare_prefix_caching(model, workload, block_size=BLOCK_SIZE, repeats=3)
        params = {**base, "system_len": system_len, "requests": 8, "suffix_len": 32}
        results.add(BENCHMARK, params, "prefill_ms", cmp.on.prefill_seconds * 1e3, "no_prefix_cache",
                    cmp.off.prefill_seconds * 1e3, note="all 8 prefills, one request per step, fastest of 3")
        results.add(BENCHMARK, params, "hit_rate", cmp.hit_rate, note="fraction of prompt tokens found cached")
        results.add(BENCHMARK, params, "prefill_tokens", cmp.on.computed_tokens, "no_prefix_cache",
                    cmp.off.computed_tokens, better="lower")
        results.add(BENCHMARK, params, "kv_blocks", cmp.on.blocks_held, "no_prefix_cache", cmp.off.blocks_held,
                    better="lower", note="blocks held with all 8 requests live")
        print(f"  [{BENCHMARK}] system prompt {system_len}: hit rate {cmp.hit_rate:.1%}, prefill "
              f"{cmp.on.prefill_seconds * 1e3:.2f} ms vs {cmp.off.prefill_seconds * 1e3:.2f} ms "
              f"({cmp.time_saved:.1%} saved)", flush=True)


def summary(results: Results | dict) -> str:
    from minillm.results import rows as select

    data = results.to_dict() if isinstance(results, Results) else results
    lines = []
    for r in select(data, BENCHMARK, "peak_blocks"):
        lines.append(f"{r['params']['decoder']:>26}: peak {r['ours']} blocks shared vs {r['peer_value']} alone")
    for r in select(data, BENCHMARK, "simulated_saving"):
        p = r["params"]
        lines.append(f"{'simulated ' + p['distribution'] + ' ' + p['decoder']:>36} width {p['width']}: "
                     f"{r['ours']:.1%} saved")
    hits = {r["params"]["system_len"]: r["ours"] for r in select(data, BENCHMARK, "hit_rate")}
    for r in select(data, BENCHMARK, "prefill_ms"):
        s = r["params"]["system_len"]
        lines.append(f"system prompt {s:>4}: hit rate {hits.get(s, 0):.1%}, prefill {r['ours']:.2f} ms cached vs "
                     f"{r['peer_value']:.2f} ms uncached ({r['ratio']:.2f}x)")
    return "\n".join(lines)


if __name__ == "__main__":
    from bench.run import main

    raise SystemExit(main(["--only", BENCHMARK]))
