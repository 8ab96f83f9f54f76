"""A tuning sweep for Chapter 8's kernels (a tool, not part of `bench.run`).

For each Llama-2-7B linear shape and M in ``MS``: cuBLAS (``F.linear``) and every candidate
tile of `gemv` and `flat_gemm` (both orientations of the flat GEMM) at several splits of K,
timed as CUDA graphs that cycle over enough copies of the weights to defeat the L2
(`bench.common.graph_time_ms`); then the best of each kernel, and cuBLAS, timed eagerly too
(`bench.common.time_ms`, L2 flushed). Prints TB/s of weights. Usage on a GPU::

    PYTHONPATH=. python bench/ch08_tune_flat_gemm.py [M ...]
"""
import sys
import time

import torch
import torch.nn.functional as F

from minillm.kernels import ch08_flat_gemm as fg
from minillm.kernels.ch08_flat_gemm import TileConfig, _launch
from bench.common import graph_time_ms, time_ms

SHAPES = [("qkv", 12288, 4096), ("o", 4096, 4096), ("up", 11008, 4096), ("down", 4096, 11008)]
MS = [int(a) for a in sys.argv[1:]] or [1, 2, 4, 8, 16]
GEMV = [(4, 1024, 4, 1), (8, 512, 4, 1), (8, 1024, 8, 1), (16, 512, 8, 1), (16, 256, 4, 1), (8, 512, 4, 3),
        (2, 1024, 4, 1)]
FLAT = [(16, 64, 128, 4, 4, True), (16, 64, 128, 4, 6, True), (16, 64, 256, 4, 3, True), (16, 64, 256, 4, 4, True),
        (16, 128, 128, 4, 4, True), (16, 128, 256, 4, 3, True), (16, 128, 128, 8, 4, True),
        (16, 64, 128, 4, 4, False), (16, 64, 256, 4, 3, False), (16, 32, 256, 4, 4, False), (16, 32, 128, 4, 6, False)]
SPLITS = {"gemv": (1, 2, 4), "flat_gemm": (1, 2, 4, 8, 16)}


def main():
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for name, n, k in SHAPES:
        copies = fg_copies = max(1, -(-256_000_000 // (2 * n * k)))
        ws = [(torch.randn(n, k, device=dev) / k ** 0.5).half() for _ in range(copies)]
        wbytes = 2 * n * k
        for m in MS:
            x = torch.randn(m, k, device=dev).half()
            ref = F.linear(x.float(), ws[0].float())
            tb = lambda ms: wbytes / (ms * 1e-3) / 1e12  # noqa: E731
            cub_g = graph_time_ms([lambda w=w: F.linear(x, w) for w in ws])
            res = {"gemv": [], "flat_gemm": []}
            for kind, tiles in (("gemv", GEMV), ("flat_gemm", FLAT)):
                if kind == "gemv" and m > 16:
                    continue
                for t in tiles:
                    for split in SPLITS[kind]:
                        if kind == "gemv":
                            cfg = TileConfig(m, *t, split_k=split)
                        else:
                            cfg = TileConfig(*t[:5], split_k=split, w_as_a=t[5])
                        outs = [torch.empty(m, n, device=dev, dtype=torch.half) for _ in ws]
                        try:
                            _launch(kind, x, ws[0], None, outs[0], cfg)
                            err = float((outs[0].float() - ref).norm() / ref.norm())
                            g = graph_time_ms([lambda w=w, o=o, c=cfg: _launch(kind, x, w, None, o, c)
                                               for w, o in zip(ws, outs)])
                        except Exception as e:  # noqa: BLE001
                            print(f"  {kind} {cfg.describe()}: {type(e).__name__} {str(e)[:80]}")
                            continue
                        if err > 1e-2:
                            print(f"  WRONG {kind} {cfg.describe()} rel_err {err:.2e}")
                        res[kind].append((g, cfg))
            line = f"{name:5s} M={m:3d} cublas g {tb(cub_g):.2f}"
            cub_e = time_ms(lambda: F.linear(x, ws[0]), warmup=5, rep=20)
            line += f" e {tb(cub_e):.2f} |"
            for kind in ("gemv", "flat_gemm"):
                if not res[kind]:
                    continue
                res[kind].sort(key=lambda r: r[0])
                g, cfg = res[kind][0]
                out = torch.empty(m, n, device=dev, dtype=torch.half)
                e = time_ms(lambda: _launch(kind, x, ws[0], None, out, cfg), warmup=5, rep=20)
                e_api = time_ms(lambda: (fg.gemv if kind == "gemv" else fg.flat_gemm)(x, ws[0], config=cfg),
                                warmup=5, rep=20)
                line += f" {kind} g {tb(g):.2f} e {tb(e):.2f} api {tb(e_api):.2f} [{cfg.describe()}] |"
            print(line, flush=True)
            for kind in ("gemv", "flat_gemm"):
                top = ", ".join(f"{c.describe()}:{tb(g):.2f}" for g, c in res[kind][:6])
                if top:
                    print(f"      top {kind}: {top}", flush=True)
        del ws
        torch.cuda.empty_cache()
        print(f"# {name} done at {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
