"""Chapter 7 tuning sweeps (a tool, not part of `bench.run`): stage 1's launch config, the
split count, the asynchronized softmax's variants and the host overhead of one call.

Run on a GPU: ``python -m bench.ch07_tune_flash_decoding [part ...]`` (parts: overhead, config,
async, splits, fused, hopper, hopper2, gluon, gluon_balance, gluon_layout,
gluon_placement, gluon_fixed_cost, gluon_fixed_breakdown, gluon_grid, gluon_pipeline,
gluon_contiguous, gluon_occupancy, gluon_merge, gluon_short_calls, gluon_ncu_target,
gluon_timeline, gluon_timeline_repeats, gluon_timeline_merges, gluon_claim, gluon_timeline_claims,
gluon_steal, gluon_timeline_steals, gluon_pdl, gluon_turns; default all but the sm_90 parts). Prints
compact tables; times are per call replaying a CUDA graph of 16 calls
(`bench.common.graph_time_ms`) unless marked eager."""
from __future__ import annotations

import math
import statistics
import sys
import time

import torch

from minillm.costs import paged_decode_attention_bytes
from minillm.kernels import ch07_flash_decoding as fd
from minillm.kernels.ch05_paged_attention import decode_outputs

from bench.common import graph_time_ms, paged_cache, time_ms

DEV = torch.device("cuda")
HQ, D, BS, DT = 32, 128, 16, torch.bfloat16
COPY_TBPS = 4.25


def timer(fn):
    return time_ms(fn, warmup=10, rep=40)


def host_us(fn, n: int) -> float:
    """CPU-side microseconds per call of ``fn`` over ``n`` calls after a warm-up call (the
    clock stops before the final synchronize: the host's cost, not the GPU's)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def inputs(batch, hkv, ctx):
    gen = torch.Generator(device=DEV)
    gen.manual_seed(0)
    k, v, tables = paged_cache(3, batch, hkv, ctx, D, BS, DT, DEV, gen)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=DT)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    return q, k, v, tables, lens


def caller(inp, splits, block_n=None, phi=None, config=None, fused=None):
    q, k, v, tables, lens = inp
    out, lse = decode_outputs(q, None, None)
    ws = ((*fd.split_workspace(q.shape[0], HQ, splits, D, DEV), fd.split_counters(q.shape[0], HQ, DEV))
          if splits > 1 else None)
    return lambda: fd.flash_decode_attention(q, k, v, tables, lens, out=out, lse=lse, num_splits=splits,
                                             block_n=block_n, phi=phi, config=config, workspace=ws, fused_merge=fused)


def frac(batch, hkv, ctx, ms):
    return paged_decode_attention_bytes([ctx] * batch, HQ, hkv, D, 2, BS) / (ms * 1e-3) / 1e12 / COPY_TBPS


def overhead():
    print("\n== host overhead, B=1 Hkv=8 L=4k (us per call) ==")
    inp = inputs(1, 8, 4096)
    q, k, v, tables, lens = inp
    for s in (1, 8, 32):
        fn = caller(inp, s)
        cpu = host_us(fn, 300)
        print(f"S={s:3}: cpu-side {cpu:6.1f}  eager {timer(fn) * 1e3:6.1f}  graph {graph_time_ms(fn, 16, timer) * 1e3:6.1f}")
    parts = {
        "_plan": lambda: fd._plan(q, k, v, tables, lens, None, None, None),
        "num_sms": lambda: fd.num_sms(q.device),
        "split_workspace S=32": lambda: fd.split_workspace(1, HQ, 32, D, DEV),
        "torch.empty out+lse": lambda: (torch.empty(1, HQ, D, device=DEV, dtype=DT),
                                        torch.empty(1, HQ, device=DEV, dtype=torch.float32)),
    }
    ws = fd.split_workspace(1, HQ, 32, D, DEV)
    out = torch.empty(1, HQ, D, device=DEV, dtype=DT)
    lse = torch.empty(1, HQ, device=DEV, dtype=torch.float32)
    dims = fd._plan(q, k, v, tables, lens, None, None, None)[0]
    parts["stage-1 launch"] = lambda: fd.split_attention(q, k, v, tables, lens, ws[0], ws[1], dims=dims)
    parts["stage-2 launch"] = lambda: fd.reduce_splits(ws[0], ws[1], out, lse)
    for name, fn in parts.items():
        print(f"  {name:22} {host_us(fn, 2000):6.1f} us")


CONFIG_POINTS = {(1, 8, 4096): (4, 8, 16, 32), (1, 8, 32768): (16, 33, 66), (1, 32, 32768): (8, 16, 33),
                 (8, 8, 32768): (4, 8, 16), (1, 8, 131072): (33, 66), (32, 8, 32768): (1, 2)}


def config():
    print("\n== stage-1 config (graph ms; best per point marked *) ==")
    configs = [(bn, w, st) for bn in (64, 128) for w in (4, 8) for st in (2, 3, 4)]
    for pt, splits in CONFIG_POINTS.items():
        inp = inputs(*pt)
        res = {}
        for bn, w, st in configs:
            for s in splits:
                try:
                    fn = caller(inp, s, bn, config=dict(num_warps=w, num_stages=st))
                    fn()
                    res[(bn, w, st, s)] = graph_time_ms(fn, 16, timer)
                except Exception as e:  # noqa: BLE001
                    res[(bn, w, st, s)] = None
                    print(f"  {pt} bn={bn} w={w} st={st} S={s}: {type(e).__name__}: {str(e)[:80]}")
        best = min((x for x in res.values() if x), default=None)
        print(f"B,Hkv,L={pt}")
        for bn, w, st in configs:
            cells = []
            for s in splits:
                t = res[(bn, w, st, s)]
                cells.append(f"S={s}:" + ("   --  " if t is None else f"{t:.4f}{'*' if t == best else ' '}"
                                          f"({frac(*pt, t):.0%})"))
            print(f"  bn={bn:3} w={w} st={st}  " + "  ".join(cells))
        del inp
        torch.cuda.empty_cache()
    # registers / spills / shared memory of each config
    inp = inputs(1, 8, 4096)
    q, k, v, tables, lens = inp
    ws = fd.split_workspace(1, HQ, 8, D, DEV)
    for bn, w, st in configs:
        for phi, lanes in ((None, True), (0.0, True), (0.0, False)):
            try:
                kern = fd.split_attention(q, k, v, tables, lens, ws[0], ws[1], phi=phi, block_n=bn,
                                          config=dict(num_warps=w, num_stages=st, ASYNC_LANES=lanes))
                print(f"  bn={bn:3} w={w} st={st} {'exact' if phi is None else 'async lanes' if lanes else 'async rows'}: "
                      f"regs {kern.n_regs} spills {kern.n_spills} smem {kern.metadata.shared}")
            except Exception as e:  # noqa: BLE001
                print(f"  bn={bn} w={w} st={st}: {type(e).__name__}")


ASYNC_POINTS = {(1, 8, 32768): 33, (8, 8, 32768): 4, (32, 8, 32768): 1, (32, 32, 32768): 1}


def async_variants():
    print("\n== async variants (graph ms; exact/variant > 1 = variant faster) ==")
    variants = {"lanes+fb": dict(ASYNC_LANES=True, FALLBACK=True), "rows+fb": dict(ASYNC_LANES=False, FALLBACK=True),
                "lanes nofb": dict(ASYNC_LANES=True, FALLBACK=False), "rows nofb": dict(ASYNC_LANES=False, FALLBACK=False)}
    for w in (8, 4):
        for pt, s in ASYNC_POINTS.items():
            inp = inputs(*pt)
            base = dict(num_warps=w, num_stages=3)
            fn = caller(inp, s, config=base)
            fn()
            exact = graph_time_ms(fn, 16, timer)
            cells = []
            for name, cfg in variants.items():
                fn = caller(inp, s, phi=0.0, config={**base, **cfg})
                fn()
                t = graph_time_ms(fn, 16, timer)
                cells.append(f"{name} {t:.4f} ({exact / t:.3f})")
            print(f"  w={w} {pt} S={s}: exact {exact:.4f} ({frac(*pt, exact):.0%}) | " + " | ".join(cells))
            del inp
            torch.cuda.empty_cache()


SPLIT_POINTS = [(1, 8), (2, 8), (4, 8), (8, 8), (16, 8), (1, 32), (2, 32), (4, 32)]
SPLITS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 16, 17, 22, 24, 32, 33, 48, 66, 99, 132)


def splits(cfg=None):
    print(f"\n== split count, L=32k (graph ms, fraction of copy), config {cfg} ==")
    for b, hkv in SPLIT_POINTS:
        inp = inputs(b, hkv, 32768)
        cells = []
        for s in SPLITS:
            if b * hkv * s > 1100:
                break
            fn = caller(inp, s, config=cfg)
            fn()
            t = graph_time_ms(fn, 16, timer)
            cells.append(f"{s}:{t:.4f}({frac(b, hkv, 32768, t):.0%})")
        print(f"  B={b:2} Hkv={hkv:2} base={b * hkv:3}: " + " ".join(cells), flush=True)
        del inp
        torch.cuda.empty_cache()


FUSED_POINTS = [(b, hkv, ctx) for ctx in (4096, 32768) for hkv in (8, 32) for b in (1, 8, 32)]


def fused():
    """The one-launch merge (stage 1's last program) against the two-launch path, at the
    default heuristic's S: eager and graph ms, host (CPU-side) us per call, and the stage-2
    launch's share of the two-launch time."""
    print("\n== fused merge vs two launches (default S; ratio = two_launch / fused, > 1: fused faster) ==")
    sms = fd.num_sms(DEV)
    for pt in FUSED_POINTS:
        b, hkv, ctx = pt
        s = fd.num_splits_heuristic(b, hkv, ctx, sms, 128)
        inp = inputs(*pt)
        row = {}
        for name, flag in (("fused", True), ("two", False)):
            fn = caller(inp, s, fused=flag)
            cpu = host_us(fn, 200)
            row[name] = (timer(fn), graph_time_ms(fn, 16, timer), cpu)
        q = inp[0]
        ws = fd.split_workspace(b, HQ, s, D, DEV) if s > 1 else None
        red = 0.0
        if ws is not None:
            out, lse = decode_outputs(q, None, None)
            caller(inp, s, fused=False)()
            red = timer(lambda: fd.reduce_splits(ws[0], ws[1], out, lse))
        (fe, fg, fc), (te, tg, tc) = row["fused"], row["two"]
        print(f"  B={b:2} Hkv={hkv:2} L={ctx:5} S={s:3}: eager fused {fe:.4f} two {te:.4f} ({te / fe:.3f}) | "
              f"graph fused {fg:.4f} two {tg:.4f} ({tg / fg:.3f}) | host us fused {fc:5.1f} two {tc:5.1f} | "
              f"reduce {red:.4f} = {red / te:.0%} of two-launch eager", flush=True)
        del inp
        torch.cuda.empty_cache()
    inp = inputs(1, 8, 4096)
    q, k, v, tables, lens = inp
    ws = fd.split_workspace(1, HQ, 16, D, DEV)
    out, lse = decode_outputs(q, None, None)
    cnt = fd.split_counters(1, HQ, DEV)
    for phi in (None, 0.0):
        for merge in (None, (out, lse, cnt)):
            kern = fd.split_attention(q, k, v, tables, lens, ws[0], ws[1], phi=phi, merge_into=merge)
            print(f"  stage 1 {'exact' if phi is None else 'async'} {'fused' if merge else 'plain'}: regs "
                  f"{kern.n_regs} spills {kern.n_spills} smem {kern.metadata.shared}")


HOPPER_POINTS = [(1, 8, 4096), (1, 8, 32768), (1, 8, 131072), (8, 8, 4096), (1, 32, 4096), (8, 8, 32768),
                 (32, 8, 4096)]


def contiguous_inputs(batch, hkv, ctx, extra=128):
    """A contiguous cache ``[batch, ctx + extra, hkv, D]`` seen as one block per sequence
    (Chapter 11's layout; ``extra`` free slots, so the block is a multiple of the tile)."""
    from minillm.kernels.ch05_paged_attention import contiguous_as_paged

    k = torch.randn(batch, ctx + extra, hkv, D, device=DEV, dtype=DT)
    v = torch.randn_like(k)
    kp, tables = contiguous_as_paged(k)
    vp, _ = contiguous_as_paged(v)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=DT)
    return q, kp, vp, tables, torch.full((batch,), ctx, dtype=torch.int32, device=DEV)


def hopper():
    """Bulk (TMA) loads and the eviction hint on sm_90: eager do_bench ms (cold L2, the
    benchmark's timing) of each variant, paged 16-token blocks (the Chapter 7 grid; TMA does
    not apply) and one block per sequence (Chapter 11; TMA applies), with SDPA cuDNN on the
    same values as the yardstick (ratio = cudnn / variant, > 1: variant faster)."""
    from torch.nn.attention import SDPBackend

    from bench.common import time_sdpa

    print("\n== hopper: eager ms (ratio cudnn/variant) ==")
    sms = fd.num_sms(DEV)
    for pt in HOPPER_POINTS:
        b, hkv, ctx = pt
        h = fd.num_splits_heuristic(b, hkv, ctx, sms, 128)
        paged = inputs(*pt)
        q = paged[0]
        ks = torch.randn(b, hkv, ctx, D, device=DEV, dtype=DT)
        cudnn = time_sdpa(q, ks, torch.randn_like(ks), SDPBackend.CUDNN_ATTENTION, timer)[0]
        del ks
        torch.cuda.empty_cache()
        cells = []
        variants = {"evict_first": dict(KV_EVICT="evict_first"), "no hint": dict(KV_EVICT=""),
                    "evict_first st4": dict(KV_EVICT="evict_first", num_stages=4)}
        for name, cfg in variants.items():
            fn = caller(paged, h, config=cfg)
            fn()
            t = timer(fn)
            cells.append(f"{name} {t:.4f}({cudnn / t:.3f})")
        if h < 128 and b * hkv * h * 2 <= 1100:
            fn = caller(paged, 2 * h, config=dict(KV_EVICT="evict_first"))
            fn()
            t = timer(fn)
            cells.append(f"S={2 * h} {t:.4f}({cudnn / t:.3f})")
        print(f"  paged  B={b:2} Hkv={hkv:2} L={ctx:6} S={h:3} cudnn {cudnn:.4f}: " + " | ".join(cells), flush=True)
        del paged
        torch.cuda.empty_cache()
        contig = contiguous_inputs(b, hkv, ctx)
        cells = []
        variants = {"tma": (None, dict(TMA=True)), "ptr evict": (None, dict(TMA=False, KV_EVICT="evict_first")),
                    "ptr": (None, dict(TMA=False, KV_EVICT="")), "tma st4": (None, dict(TMA=True, num_stages=4)),
                    "tma st2": (None, dict(TMA=True, num_stages=2)), "tma w8": (None, dict(TMA=True, num_warps=8)),
                    "tma bn64": (64, dict(TMA=True)), "tma bn64 st4": (64, dict(TMA=True, num_stages=4)),
                    "tma bn256 st2": (256, dict(TMA=True, num_stages=2))}
        for name, (bn, cfg) in variants.items():
            hs = fd.num_splits_heuristic(b, hkv, ctx, sms, bn or 128)
            try:
                fn = caller(contig, hs, block_n=bn, config=cfg)
                fn()
                t = timer(fn)
                cells.append(f"{name} {t:.4f}({cudnn / t:.3f})")
            except Exception as e:  # noqa: BLE001
                cells.append(f"{name} {type(e).__name__}: {str(e)[:160]}")
        if h < 128 and b * hkv * h * 2 <= 1100:
            fn = caller(contig, 2 * h, config=dict(TMA=True))
            fn()
            t = timer(fn)
            cells.append(f"tma S={2 * h} {t:.4f}({cudnn / t:.3f})")
        print(f"  contig B={b:2} Hkv={hkv:2} L={ctx:6} S={h:3} cudnn {cudnn:.4f}: " + " | ".join(cells), flush=True)
        if pt == (1, 8, 4096):
            for name, cfg in (("tma", dict(TMA=True)), ("ptr", dict(TMA=False))):
                print(f"    host us per call, {name}: {host_us(caller(contig, h, config=cfg), 300):.1f}")
            qq, kp, vp, tables, lens = contig
            ws = fd.split_workspace(b, HQ, h, D, DEV)
            for name, cfg in (("tma", dict(TMA=True)), ("ptr", dict(TMA=False))):
                kern = fd.split_attention(qq, kp, vp, tables, lens, ws[0], ws[1], config=cfg)
                print(f"    stage 1 {name}: regs {kern.n_regs} spills {kern.n_spills} smem {kern.metadata.shared}")
        del contig
        torch.cuda.empty_cache()


def hopper2():
    """Second pass: host cost and GPU time (CUDA graph over 4 copies of the cache, so the L2
    holds none of it) of bulk against pointer loads on one block per sequence, and tile /
    warp variants on the paged pool."""
    from bench.common import interleaved_times

    print("\n== hopper2: contiguous, tma vs pointer (eager do_bench x3 interleaved | graph over 4 copies) ==")
    sms = fd.num_sms(DEV)
    for pt in [(1, 8, 4096), (1, 32, 4096), (8, 8, 4096), (1, 8, 32768), (8, 8, 32768)]:
        b, hkv, ctx = pt
        h = fd.num_splits_heuristic(b, hkv, ctx, sms, 128)
        copies = [contiguous_inputs(b, hkv, ctx) for _ in range(4 if b * hkv * ctx <= 8 * 32768 else 1)]
        cfgs = {"ptr": dict(TMA=False), "tma": dict(TMA=True), "tma st4": dict(TMA=True, num_stages=4),
                "ptr bn64": dict(TMA=False), "tma bn64": dict(TMA=True)}
        fns = {name: [caller(c, fd.num_splits_heuristic(b, hkv, ctx, sms, 64 if "bn64" in name else 128),
                             64 if "bn64" in name else None, config=cfg) for c in copies]
               for name, cfg in cfgs.items()}
        eager = interleaved_times({n: f[0] for n, f in fns.items()}, timer)
        graph = {n: graph_time_ms(f, 16, timer) for n, f in fns.items()}
        host = {n: host_us(fns[n][0], 200) for n in ("ptr", "tma")}
        print(f"  B={b:2} Hkv={hkv:2} L={ctx:6} S={h:3}: " + " | ".join(
            f"{n} {eager[n]:.4f}/{graph[n]:.4f}" for n in cfgs)
            + f" | host us ptr {host['ptr']:.1f} tma {host['tma']:.1f}",
            flush=True)
        del copies, fns
        torch.cuda.empty_cache()
    print("\n== hopper2: paged 16-token blocks, tile variants (eager do_bench x3 interleaved) ==")
    for pt in [(1, 8, 32768), (1, 8, 131072), (8, 8, 32768), (32, 8, 4096), (1, 32, 32768)]:
        b, hkv, ctx = pt
        paged = inputs(*pt)
        variants = {"bn128 w4": (128, dict()), "bn64 w4": (64, dict()), "bn64 w4 st4": (64, dict(num_stages=4)),
                    "bn128 w8": (128, dict(num_warps=8)), "bn128 evict": (128, dict(KV_EVICT="evict_first"))}
        fns = {n: caller(paged, fd.num_splits_heuristic(b, hkv, ctx, sms, bn), bn, config=cfg)
               for n, (bn, cfg) in variants.items()}
        eager = interleaved_times(fns, timer)
        print(f"  B={b:2} Hkv={hkv:2} L={ctx:6}: " + " | ".join(f"{n} {t:.4f}" for n, t in eager.items()), flush=True)
        del paged, fns
        torch.cuda.empty_cache()


def gluon():
    """The Gluon kernel (`minillm.kernels.ch07_flash_decoding_gluon`) against the Triton kernel,
    CUDA-graph times (the GPU's time): tile and ring variants on the 16-token paged pool, and
    both kernels on a pool of 128-token blocks (one TMA box per tile instead of 8), which
    separates the box size from the rest of the kernel."""
    from minillm.kernels.ch07_flash_decoding_gluon import flash_decode_attention_gluon, plan_splits

    print("\n== gluon: graph us (16 calls per graph; 4 copies of caches up to 64 MB) ==")
    sms = fd.num_sms(DEV)
    for pt in [(1, 8, 4096), (1, 32, 4096), (8, 8, 4096), (1, 8, 32768), (8, 32, 32768), (32, 8, 32768)]:
        b, hkv, ctx = pt
        rows = {}
        for bs in (16, 128):
            gen = torch.Generator(device=DEV)
            gen.manual_seed(0)
            n_copies = 4 if b * hkv * ctx <= 8 * 32768 else 1
            copies = []
            for _ in range(n_copies):
                k, v, tables = paged_cache(3, b, hkv, ctx, D, bs, DT, DEV, gen)
                copies.append((torch.randn(b, HQ, D, device=DEV, dtype=DT), k, v, tables,
                               torch.full((b,), ctx, dtype=torch.int32, device=DEV)))
            wave = fd.num_splits_heuristic(b, hkv, ctx, sms, 128)

            def glu(bn=128, st=3, splits=None):
                return [lambda c=c: flash_decode_attention_gluon(*c, block_n=bn, num_stages=st,
                                                                 num_splits=splits or plan_splits(b, hkv, ctx, sms, bn))
                        for c in copies]
            variants = {"triton": [lambda c=c: fd.flash_decode_attention(*c, num_splits=wave) for c in copies],
                        "gl bn128 st3": glu(), "gl bn128 st2": glu(st=2), "gl bn64 st3": glu(64, 3),
                        "gl bn64 st4": glu(64, 4), "gl bn64 st6": glu(64, 6), "gl wave S": glu(splits=wave)}
            if bs == 128:
                variants = {n: variants[n] for n in ("triton", "gl bn128 st3")}
            for name, fns in variants.items():
                rows[f"bs{bs} {name}"] = graph_time_ms(fns, 16, timer) * 1e3
            del copies
            torch.cuda.empty_cache()
        base = rows["bs16 triton"]
        print(f"  B={b:2} Hkv={hkv:2} L={ctx:6} S plan {plan_splits(b, hkv, ctx, sms)} wave {wave}: "
              + " | ".join(f"{n} {t:.1f} ({base / t:.3f})" for n, t in rows.items()), flush=True)


def gluon_balance():
    """The Gluon kernel's schedules at every decode point: units with `plan_splits`'s count (one
    unit per program where the batch allows) and with twice that count (the same tiles in
    twice the pieces: what a piece costs), the balanced work line, and the line with a ring of
    4 slots; against the Triton kernel. Small caches in CUDA-graph time (4
    copies), the others eager, the variants taking turns (`interleaved_times`, median of 3).
    Also the host's microseconds per call of each launcher (eager calls of small caches are
    the host's time)."""
    from bench.common import interleaved_times
    from minillm.kernels.ch07_flash_decoding_gluon import flash_decode_attention_gluon, plan_splits

    print("\n== gluon_balance: us per call (graph for caches up to 64 MB, else eager); ratio = triton / variant ==")
    sms = fd.num_sms(DEV)
    for hkv in (8, 32):
        for b in (1, 8, 32):
            for ctx in (4096, 32768, 131072):
                small = b * hkv * ctx <= 8 * 32768
                copies = [inputs(b, hkv, ctx) for _ in range(4 if small else 1)]
                outs = [decode_outputs(c[0], None, None) for c in copies]
                wave = fd.num_splits_heuristic(b, hkv, ctx, sms, 128)
                plan = plan_splits(b, hkv, ctx, sms)

                def glu(**kw):
                    return [lambda c=c, o=o: flash_decode_attention_gluon(*c, out=o[0], lse=o[1], **kw)
                            for c, o in zip(copies, outs)]
                variants = {"triton": [lambda c=c, o=o: fd.flash_decode_attention(*c, num_splits=wave, out=o[0],
                                                                                  lse=o[1])
                                       for c, o in zip(copies, outs)],
                            "units": glu(num_splits=plan), "units 2S": glu(num_splits=2 * plan),
                            "line": glu(schedule="line"), "line st4": glu(schedule="line", num_stages=4)}
                if small:
                    t = {n: graph_time_ms(fns, 16, timer) * 1e3 for n, fns in variants.items()}
                else:
                    t = {n: ms * 1e3 for n, ms in interleaved_times({n: f[0] for n, f in variants.items()}, timer,
                                                                      3).items()}
                host = {n: host_us(variants[n][0], 200) for n in ("triton", "units")} if small else {}
                print(f"  B={b:2} Hkv={hkv:2} L={ctx:6} {'graph' if small else 'eager'} S plan {plan}: "
                      + " | ".join(f"{n} {v:.1f} ({t['triton'] / v:.3f})" for n, v in t.items())
                      + ("  host us: " + " ".join(f"{n} {v:.1f}" for n, v in host.items()) if host else ""),
                      flush=True)
                del copies, outs, variants
                torch.cuda.empty_cache()


LAYOUT_POINTS = [(1, 8, 4096), (1, 32, 4096), (8, 8, 4096), (1, 8, 32768), (1, 8, 131072), (8, 8, 32768),
                 (8, 32, 32768), (32, 8, 32768), (32, 32, 32768)]


def _gluon_variants(title: str, points, variants_of, base: str, hnd: bool = False):
    """Time the Gluon kernel's ``variants_of(glu, b, hkv, ctx)`` (``{name: [callable per copy]}``,
    ``glu(layout="NHD", **kw)`` building one) at ``points``: small caches in CUDA-graph time on 4
    copies, the others eager, taking turns (median of 3); ratio = ``base`` / variant. ``hnd``:
    also build each copy's head-major pool."""
    from bench.common import interleaved_times
    from minillm.kernels.ch07_flash_decoding_gluon import flash_decode_attention_gluon, plan_splits, to_head_major

    print(f"\n== {title}: us per call (graph for caches up to 64 MB, else eager); ratio = {base} / variant ==")
    sms = fd.num_sms(DEV)
    for b, hkv, ctx in points:
        small = b * hkv * ctx <= 8 * 32768
        copies = []
        for _ in range(4 if small else 1):
            q, k, v, tables, lens = inputs(b, hkv, ctx)
            head_major = (to_head_major(k), to_head_major(v)) if hnd else None
            copies.append((q, {"NHD": (k, v), "HND": head_major}, tables, lens,
                           *decode_outputs(q, None, None)))

        def glu(layout="NHD", block_n=64, programs=None, splits=None, **kw):
            splits = splits or plan_splits(b, hkv, ctx, programs or sms, block_n)
            return [lambda c=c: flash_decode_attention_gluon(c[0], *c[1][layout], c[2], c[3], num_splits=splits,
                                                             block_n=block_n, programs=programs, out=c[4], lse=c[5],
                                                             kv_layout=layout, **kw) for c in copies]
        variants = variants_of(glu, b, hkv, ctx)
        if small:
            t = {n: graph_time_ms(fns, 16, timer) * 1e3 for n, fns in variants.items()}
        else:
            t = {n: ms * 1e3 for n, ms in interleaved_times({n: f[0] for n, f in variants.items()}, timer, 3).items()}
        print(f"  B={b:2} Hkv={hkv:2} L={ctx:6} {'graph' if small else 'eager'} S plan {plan_splits(b, hkv, ctx, sms)}: "
              + " | ".join(f"{n} {v:.1f} ({t[base] / v:.3f})" for n, v in t.items())
              + f"  {base} at {frac(b, hkv, ctx, t[base] * 1e-3):.2f} of copy", flush=True)
        del copies, variants
        torch.cuda.empty_cache()


def gluon_layout():
    """The Gluon kernel on the two pool layouts of the same values (``kv_layout`` NHD, the
    chapters' ``[blocks, block_size, kv_heads, head_dim]``, and HND, ``[blocks, kv_heads,
    block_size, head_dim]``), with the planned splits, and on HND with 4 ring slots and with
    128-key tiles (deeper rings and larger tiles lost on NHD: do they once a box is one run of
    memory?)."""
    _gluon_variants("gluon_layout", LAYOUT_POINTS, lambda glu, *_: {
        "NHD": glu(), "HND": glu("HND"), "HND st4": glu("HND", num_stages=4), "HND bn128": glu("HND", 128)},
        "NHD", hnd=True)


def gluon_pipeline():
    """The consumer's two orders: each tile's S = Q Kᵀ, softmax and P·V in turn (the default),
    and pipelined (tile j's scores started before tile j-1's P·V, FlashAttention-3's overlap
    inside the warpgroup), also with 4 ring slots and with 128-key tiles."""
    points = LAYOUT_POINTS + [(8, 32, 131072), (32, 8, 131072), (1, 32, 131072)]
    _gluon_variants("gluon_pipeline", points, lambda glu, *_: {
        "in turn": glu(), "pipelined": glu(pipeline=True), "pipelined st4": glu(pipeline=True, num_stages=4),
        "pipelined bn128": glu(block_n=128, pipeline=True)}, "in turn")


def gluon_occupancy():
    """Bytes in flight per SM: one program per SM with 3 ring slots (the default), with 2, and
    two programs per SM (``programs = 2 · SMs``, splits planned for that many) with 2 slots.
    Deeper rings of one program ran 1-3 % slower (`gluon_pipeline`); two programs double the
    loaders and the consumers instead of the slots. (Two programs of 3 slots, 2 x 123 KB of
    shared memory at head dim 128 under Triton 3.6, do not fit in an SM's 228 KB; two of 2
    slots, 2 x 90 KB, do.) Also each variant's shared memory and registers."""
    from minillm.kernels.ch07_flash_decoding_gluon import flash_decode_attention_gluon

    sms = fd.num_sms(DEV)
    q, k, v, tables, lens = inputs(1, 8, 4096)
    for name, kw in (("st3", {}), ("st2", {"num_stages": 2})):
        kernel = flash_decode_attention_gluon(q, k, v, tables, lens, compile_only=True, **kw)
        getattr(kernel, "_init_handles", lambda: None)()  # (registers and spills are read when it loads)
        print(f"  {name}: shared {kernel.metadata.shared} B, {getattr(kernel, 'n_regs', '?')} registers, "
              f"{getattr(kernel, 'n_spills', '?')} spills", flush=True)
    points = LAYOUT_POINTS + [(8, 32, 131072), (32, 8, 131072), (1, 32, 131072)]
    _gluon_variants("gluon_occupancy", points, lambda glu, *_: {
        "st3": glu(), "st2": glu(num_stages=2), "2/SM st2": glu(programs=2 * sms, num_stages=2)}, "st3")


#: The decode points where the plan splits (batch 1 everywhere, batch 8 with 8 KV heads): where
#: the merges and the ways of sharing a unit's tiles are compared.
SPLIT_POINTS = [(1, 8, 4096), (1, 32, 4096), (8, 8, 4096), (1, 8, 32768), (1, 32, 32768), (1, 8, 131072),
                (8, 8, 32768), (1, 32, 131072), (8, 8, 131072)]


def gluon_merge():
    """Where the splits are merged: by the last program of each unit in the decode launch (the
    counter), by the program of each unit's last split once the other partials are in place
    (``poll``), by a second launch (Chapter 7's stage 2), and by that launch as a programmatic
    dependent launch, at the points where the plan splits. (A fourth variant was measured
    once and not kept: the loader fetching a piece's first table entries before its length
    arrived, from where the split would start in a full table; 1.000-1.013x the default,
    ``bench/results/raw/nvidia-h200.ch07_tune_gluon_merge_speculate.log``.)"""
    _gluon_variants("gluon_merge", SPLIT_POINTS, lambda glu, *_: {
        "last": glu(merge="last"), "poll": glu(merge="poll"), "launch": glu(merge="launch"),
        "launch pdl": glu(merge="launch_pdl")}, "last")


def gluon_claim():
    """A unit's tiles in fixed runs, one per split (the default), or claimed by the unit's
    programs from a counter of its own as they go (``schedule="claim"``), after 2 tiles of their
    own (the default ``claim_first``), none, or 4, at the points where the plan splits; and
    "claim own run": the claimed kernel with ``claim_first`` = the units' run of tiles per split,
    so that every program takes exactly the units' tiles in the units' order through the claimed
    kernel's code (the tile indices through shared memory, the closing slot) and claims none:
    it tells the code's cost from the cost of the order the claims hand tiles out in."""
    from minillm.kernels.ch07_flash_decoding_gluon import BLOCK_N, plan_splits

    sms = fd.num_sms(DEV)

    def variants(glu, b, hkv, ctx):
        run = math.ceil(math.ceil(ctx / BLOCK_N) / plan_splits(b, hkv, ctx, sms))  # a split's tiles
        return {"units": glu(), "claim": glu(schedule="claim"), "claim first 0": glu(schedule="claim", claim_first=0),
                "claim first 4": glu(schedule="claim", claim_first=4),
                "claim own run": glu(schedule="claim", claim_first=run)}
    _gluon_variants("gluon_claim", SPLIT_POINTS, variants, "units")


def gluon_steal():
    """A unit's tiles in fixed runs (the default), or the same runs with work stealing
    (``schedule="steal"``: a program whose run is done takes tiles from the back of its unit's
    run with the most left), with the default 2 tiles of each run kept for its owner, none, and
    8; beside them the claims (``schedule="claim"``), at the points where the plan splits."""
    _gluon_variants("gluon_steal", SPLIT_POINTS, lambda glu, *_: {
        "units": glu(), "steal": glu(schedule="steal"), "steal first 0": glu(schedule="steal", claim_first=0),
        "steal first 8": glu(schedule="steal", claim_first=8), "claim": glu(schedule="claim")}, "units")


def gluon_short_calls():
    """The calls whose plan splits, where fixed costs weigh: the ring's depth (2 slots against
    3), the merge (in the kernel or a second launch) and half the planned splits, alone and
    combined; CUDA-graph times on 4 copies for the small caches, else eager."""
    from minillm.kernels.ch07_flash_decoding_gluon import plan_splits

    def variants(glu, b, hkv, ctx):
        plan = plan_splits(b, hkv, ctx, fd.num_sms(DEV))
        out = {"default": glu(), "launch": glu(merge="launch"), "st2": glu(num_stages=2),
               "st2 launch": glu(num_stages=2, merge="launch")}
        if plan >= 4:
            out |= {"S/2": glu(splits=plan // 2), "S/2 launch": glu(splits=plan // 2, merge="launch"),
                    "S/2 st2 launch": glu(splits=plan // 2, num_stages=2, merge="launch")}
        return out

    points = [(1, 8, 4096), (1, 8, 32768), (1, 8, 131072), (1, 32, 4096), (1, 32, 32768), (8, 8, 4096),
              (8, 8, 32768)]
    _gluon_variants("gluon_short_calls", points, variants, "default")


#: Nsight Compute's points (batch, KV heads, context): batch 1 at 4k and 32k keys, and one
#: where the batch fills the GPU (two units per program).
NCU_POINTS = [(1, 8, 4096), (1, 8, 32768), (32, 8, 32768)]


def gluon_ncu_target():
    """Calls for Nsight Compute to time kernel by kernel: at each of `NCU_POINTS`, two calls
    each of the Gluon kernel, the Triton kernel and SDPA cuDNN on a contiguous cache. Run as
    ``ncu --target-processes all --clock-control none --kernel-name-base function
    --kernel-name 'regex:_decode_kernel|_split_kernel|_merge|cudnn|fmha|sdpa|flash|attn|Attn|Fmha|sm90'
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,
    dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__block_size,
    launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active --csv
    --print-units base python -m bench.ch07_tune_flash_decoding gluon_ncu_target`` (the metrics
    one comma-separated list; ncu empties the caches before each kernel)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench.common import contiguous_cache
    from minillm.kernels.ch07_flash_decoding_gluon import flash_decode_attention_gluon, plan_splits

    sms = fd.num_sms(DEV)
    for b, hkv, ctx in NCU_POINTS:
        q, k, v, tables, lens = inputs(b, hkv, ctx)
        out, lse = decode_outputs(q, None, None)
        plan, wave = plan_splits(b, hkv, ctx, sms), fd.num_splits_heuristic(b, hkv, ctx, sms, 128)
        k_c, v_c = contiguous_cache(3, b, hkv, ctx, D, DT, DEV)
        q4 = q[:, :, None]
        for _ in range(2):
            flash_decode_attention_gluon(q, k, v, tables, lens, num_splits=plan, out=out, lse=lse)
            fd.flash_decode_attention(q, k, v, tables, lens, num_splits=wave, out=out, lse=lse)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(q4, k_c, v_c, enable_gqa=True)
        torch.cuda.synchronize()
        print(f"  B={b} Hkv={hkv} L={ctx}: done (S plan {plan}, wave {wave})", flush=True)


def placement_tables(tables: torch.Tensor, run: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A placement of the pool's blocks that keeps runs of ``run`` consecutive blocks of a
    sequence together: ``(order, new_tables)``, where ``pool[order]`` is the re-placed pool and
    ``new_tables`` its tables. ``run = 1`` shuffles every block; ``run`` = all blocks sorts them
    (each sequence's blocks in order, one sequence after another)."""
    flat = tables.reshape(-1).long()  # sequence-major: slot i holds the i-th block in order
    run = math.gcd(run, flat.numel())  # whole runs only
    perm = torch.randperm(flat.numel() // run, generator=gen, device="cpu").to(flat.device)
    i = torch.arange(flat.numel(), device=flat.device)
    new_pos = perm[i // run] * run + i % run
    order = torch.empty_like(flat)
    order[new_pos] = flat
    return order, new_pos.view(tables.shape).to(torch.int32)


def cudnn_then_pool(b: int, hkv: int, ctx: int):
    """``(q, cudnn_ms, (k_pool, v_pool, tables, lens))``: SDPA cuDNN timed on a contiguous cache
    of the point's values (median of 3, the cache freed before the pool is built), then the
    shuffled 16-token pool of the same values."""
    from torch.nn.attention import SDPBackend

    from bench.common import contiguous_cache, time_sdpa

    k_c, v_c = contiguous_cache(3, b, hkv, ctx, D, DT, DEV)
    q = torch.randn(b, HQ, D, device=DEV, dtype=DT)
    cudnn_ms = statistics.median(time_sdpa(q, k_c, v_c, SDPBackend.CUDNN_ATTENTION, timer)[0] for _ in range(3))
    del k_c, v_c
    torch.cuda.empty_cache()
    gen = torch.Generator(device=DEV)
    gen.manual_seed(0)
    k, v, tables = paged_cache(3, b, hkv, ctx, D, BS, DT, DEV, gen)
    return q, cudnn_ms, (k, v, tables, torch.full((b,), ctx, dtype=torch.int32, device=DEV))


def gluon_placement():
    """Where the blocks lie, with the kernels unchanged: at the batch-filling points and the
    long batch-1 one, the Gluon and Triton kernels on the same values placed three ways in the
    pool (every block shuffled, as the benchmarks; shuffled in runs of 2 MiB of one pool, the
    GPU's large page; each sequence's blocks in order), against SDPA cuDNN on a contiguous
    cache of the same values; eager, taking turns, median of 3; ratio = cuDNN / variant."""
    from bench.common import interleaved_times
    from minillm.kernels.ch07_flash_decoding_gluon import flash_decode_attention_gluon, plan_splits

    print("\n== gluon_placement: eager us per call; ratio = SDPA cuDNN (contiguous) / variant ==")
    sms = fd.num_sms(DEV)
    for b, hkv, ctx in [(8, 32, 32768), (32, 8, 32768), (8, 8, 131072), (1, 8, 131072), (32, 32, 32768),
                        (8, 32, 131072)]:
        q, cudnn_ms, (k, v, tables, lens) = cudnn_then_pool(b, hkv, ctx)
        block_bytes = BS * hkv * D * k.element_size()
        cpu_gen = torch.Generator()
        cpu_gen.manual_seed(1)
        placed = {"shuffled": (k, v, tables)}
        for name, run in (("2MiB runs", max(1, (2 << 20) // block_bytes)), ("in order", tables.numel())):
            order, new_tables = placement_tables(tables, run, cpu_gen)
            placed[name] = (k[order], v[order], new_tables)
        out, lse = decode_outputs(q, None, None)
        plan, wave = plan_splits(b, hkv, ctx, sms), fd.num_splits_heuristic(b, hkv, ctx, sms, 128)
        calls = {}
        for name, (kp, vp, tb) in placed.items():
            calls[f"gluon {name}"] = lambda kp=kp, vp=vp, tb=tb: flash_decode_attention_gluon(
                q, kp, vp, tb, lens, num_splits=plan, out=out, lse=lse)
            calls[f"triton {name}"] = lambda kp=kp, vp=vp, tb=tb: fd.flash_decode_attention(
                q, kp, vp, tb, lens, num_splits=wave, out=out, lse=lse)
        t = interleaved_times(calls, timer, 3)
        print(f"  B={b:2} Hkv={hkv:2} L={ctx:6}: cuDNN {cudnn_ms * 1e3:.1f} | "
              + " | ".join(f"{n} {ms * 1e3:.1f} ({cudnn_ms / ms:.3f})" for n, ms in t.items()), flush=True)
        del placed, calls, k, v
        torch.cuda.empty_cache()


def gluon_fixed_cost():
    """A decode call's fixed cost and streaming rate: at batch 1 with 8 KV heads, CUDA-graph
    times of the Gluon kernel (planned splits), the Triton kernel and SDPA cuDNN (contiguous)
    over contexts 1k-64k, each call on its own copy of the cache (enough copies to pass 128 MB,
    so no call finds its cache in L2), and the straight line t = t0 + bytes / rate fitted to
    each: t0 is what a call costs before and after its bytes, the rate what it streams at."""
    import numpy as np
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench.common import contiguous_cache
    from minillm.kernels.ch07_flash_decoding_gluon import flash_decode_attention_gluon, plan_splits

    print("\n== gluon_fixed_cost: B=1 Hkv=8, graph us per call (copies past 128 MB) ==")
    sms = fd.num_sms(DEV)
    b, hkv = 1, 8
    contexts = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
    times: dict[str, list[float]] = {"gluon": [], "triton": [], "cudnn": []}
    n_bytes = []
    for ctx in contexts:
        cache_bytes = b * ctx * hkv * D * 2 * 2
        n_copies = max(1, min(32, -(-(128 << 20) // cache_bytes)))
        copies = [inputs(b, hkv, ctx) for _ in range(n_copies)]
        outs = [decode_outputs(c[0], None, None) for c in copies]
        plan, wave = plan_splits(b, hkv, ctx, sms), fd.num_splits_heuristic(b, hkv, ctx, sms, 128)
        gluon = [lambda c=c, o=o: flash_decode_attention_gluon(*c, num_splits=plan, out=o[0], lse=o[1])
                 for c, o in zip(copies, outs)]
        triton_ = [lambda c=c, o=o: fd.flash_decode_attention(*c, num_splits=wave, out=o[0], lse=o[1])
                   for c, o in zip(copies, outs)]
        row = {"gluon": graph_time_ms(gluon, 32, timer), "triton": graph_time_ms(triton_, 32, timer)}
        del copies, outs, gluon, triton_
        torch.cuda.empty_cache()
        contiguous = [contiguous_cache(3 + i, b, hkv, ctx, D, DT, DEV) for i in range(n_copies)]
        q4 = torch.randn(b, HQ, 1, D, device=DEV, dtype=DT)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            row["cudnn"] = graph_time_ms([lambda kv=kv: F.scaled_dot_product_attention(q4, kv[0], kv[1], enable_gqa=True)
                                          for kv in contiguous], 32, timer)
        del contiguous
        torch.cuda.empty_cache()
        n_bytes.append(paged_decode_attention_bytes([ctx] * b, HQ, hkv, D, 2, BS))
        for name, ms in row.items():
            times[name].append(ms * 1e3)
        print(f"  L={ctx:6} ({n_copies} copies, S plan {plan}): "
              + " | ".join(f"{n} {ms * 1e3:.1f}" for n, ms in row.items())
              + f" | gluon/cuDNN {row['cudnn'] / row['gluon']:.3f}", flush=True)
    x = np.array(n_bytes, dtype=float)
    for name, ts in times.items():
        slope, t0 = np.polyfit(x, np.array(ts), 1)  # us per byte, us
        print(f"  fit {name}: t0 {t0:.2f} us, rate {1e-6 / slope:.2f} TB/s "
              f"(max residual {np.max(np.abs(np.polyval([slope, t0], x) - ts)):.2f} us)", flush=True)


def gluon_pdl():
    """Programmatic dependent launches in a chain of decode calls, at Chapter 7's decode points
    (but the largest, whose two 64 GB layouts do not fit together): CUDA-graph times per call
    (32 calls, each on its own copy of the cache, enough copies to pass 128 MB) of the Gluon
    kernel launched plainly and as a programmatic dependent launch (``pdl=True``), each also
    with the merge in a second launch (``merge="launch"``; with ``pdl`` both launches), the
    Triton kernel the same two ways, and SDPA cuDNN on contiguous copies; ratio = cuDNN /
    variant. In the chain every call follows another decode call; a model's would follow its
    q/k/v projection."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench.ch07_flash_decoding import BATCHES, CONTEXTS, KV_HEADS
    from bench.common import contiguous_cache
    from minillm.kernels.ch07_flash_decoding_gluon import flash_decode_attention_gluon, plan_splits

    print("\n== gluon_pdl: graph us per call (copies past 128 MB); ratio = SDPA cuDNN / variant ==")
    sms = fd.num_sms(DEV)
    grid = sorted(((b, hkv, ctx) for hkv in KV_HEADS for b in BATCHES for ctx in CONTEXTS
                   if b * ctx * hkv * D * 2 * 2 <= 20e9), key=lambda p: (p[0] * p[1] * p[2], p))
    for b, hkv, ctx in grid:
        cache_bytes = b * ctx * hkv * D * 2 * 2
        n_copies = max(1, min(32, -(-(128 << 20) // cache_bytes)))
        copies = [inputs(b, hkv, ctx) for _ in range(n_copies)]
        outs = [decode_outputs(c[0], None, None) for c in copies]
        plan, wave = plan_splits(b, hkv, ctx, sms), fd.num_splits_heuristic(b, hkv, ctx, sms, 128)
        variants = {}
        for name, kw in (("gluon", {}), ("gluon pdl", {"pdl": True}), ("gluon launch", {"merge": "launch"}),
                         ("gluon launch pdl", {"merge": "launch", "pdl": True})):
            variants[name] = [lambda c=c, o=o, kw=kw: flash_decode_attention_gluon(*c, num_splits=plan, out=o[0],
                                                                                   lse=o[1], **kw)
                              for c, o in zip(copies, outs)]
        for name, kw in (("triton", {}), ("triton pdl", {"pdl": True})):
            variants[name] = [lambda c=c, o=o, kw=kw: fd.flash_decode_attention(*c, num_splits=wave, out=o[0],
                                                                                lse=o[1], **kw)
                              for c, o in zip(copies, outs)]
        row = {name: graph_time_ms(fns, 32, timer) * 1e3 for name, fns in variants.items()}
        del copies, outs, variants
        torch.cuda.empty_cache()
        contiguous = [contiguous_cache(3 + i, b, hkv, ctx, D, DT, DEV) for i in range(n_copies)]
        q4 = torch.randn(b, HQ, 1, D, device=DEV, dtype=DT)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = graph_time_ms([lambda kv=kv: F.scaled_dot_product_attention(q4, kv[0], kv[1], enable_gqa=True)
                                   for kv in contiguous], 32, timer) * 1e3
        del contiguous
        torch.cuda.empty_cache()
        print(f"  B={b:2} Hkv={hkv:2} L={ctx:6} graph S plan {plan}: cudnn {cudnn:.2f} | "
              + " | ".join(f"{n} {us:.2f} ({cudnn / us:.3f})" for n, us in row.items())
              + f"  gluon at {frac(b, hkv, ctx, row['gluon'] * 1e-3):.2f}, gluon pdl at "
              f"{frac(b, hkv, ctx, row['gluon pdl'] * 1e-3):.2f} of copy", flush=True)


def gluon_fixed_breakdown():
    """Where a short decode call's fixed cost goes (``gluon_fixed_cost`` fits it at about 9 us
    for the Gluon kernel, 1 us above cuDNN's): CUDA-graph times per call at batch 1, 8 KV heads,
    of calls that stream (almost) nothing. An empty kernel on one program per SM (the graph's
    launch floor); the Gluon kernel on empty sequences with the split count of a 4k context
    (every program starts, loads its queries, stores an empty partial and arrives at the merge,
    and the last one merges) and with one split (no merge: the merge's share is the
    difference); on one 64-key tile (the first tile's wait); both lengths also with the merge in
    a second launch (``merge="launch"`` and ``"launch_pdl"``); the Triton kernel on the same
    lengths and SDPA cuDNN on 64 keys. (Bytes are negligible here, so one copy of the cache
    serves: `gluon_fixed_cost` has the calls that stream.)"""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench.common import contiguous_cache
    from minillm.kernels.base import tl, triton
    from minillm.kernels.ch07_flash_decoding_gluon import flash_decode_attention_gluon, plan_splits

    @triton.jit
    def nothing(x_ptr):
        tl.store(x_ptr + tl.program_id(0), 0)

    print("\n== gluon_fixed_breakdown: B=1 Hkv=8, graph us per call ==")
    sms = fd.num_sms(DEV)
    b, hkv, full = 1, 8, 4096
    plan, wave = plan_splits(b, hkv, full, sms), fd.num_splits_heuristic(b, hkv, full, sms, 128)
    q, k, v, tables, _ = inputs(b, hkv, full)
    out, lse = decode_outputs(q, None, None)
    scratch = torch.empty(sms, device=DEV, dtype=torch.int32)
    lengths = {n: torch.full((b,), n, dtype=torch.int32, device=DEV) for n in (0, 64)}
    calls = {"empty kernel": lambda: nothing[(sms,)](scratch)}
    for name, n, splits, kw in (("", 0, plan, {}), (" (no merge)", 0, 1, {}), ("", 64, plan, {}),
                                (" merge launch", 0, plan, {"merge": "launch"}),
                                (" merge launch_pdl", 0, plan, {"merge": "launch_pdl"}),
                                (" merge launch", 64, plan, {"merge": "launch"}),
                                (" merge launch_pdl", 64, plan, {"merge": "launch_pdl"}),
                                (" (no merge)", 64, 1, {})):
        calls[f"gluon L={n} S={splits}{name}"] = lambda n=n, s=splits, kw=kw: flash_decode_attention_gluon(
            q, k, v, tables, lengths[n], num_splits=s, out=out, lse=lse, **kw)
    for n in (0, 64):
        calls[f"triton L={n} S={wave}"] = lambda n=n: fd.flash_decode_attention(q, k, v, tables, lengths[n],
                                                                               num_splits=wave, out=out, lse=lse)
    q4 = torch.randn(b, HQ, 1, D, device=DEV, dtype=DT)
    k64, v64 = contiguous_cache(3, b, hkv, 64, D, DT, DEV)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # (SDPA picks its backend at the call: capture inside)
        us = graph_time_ms(lambda: F.scaled_dot_product_attention(q4, k64, v64, enable_gqa=True), 32, timer) * 1e3
    print(f"  cudnn L=64: {us:.2f}", flush=True)
    for name, fn in calls.items():
        print(f"  {name}: {graph_time_ms(fn, 32, timer) * 1e3:.2f}", flush=True)


def timeline_us(timeline: torch.Tensor, programs: int) -> torch.Tensor:
    """The global-timer stamps of a filled timeline's first ``programs`` rows in µs from the
    call's first start: ``[programs, len(TIMELINE_EVENTS)]`` float64 on the CPU."""
    ns = timeline[:programs, 0].double().cpu()
    return (ns - ns[:, 0].min()) / 1e3


#: The timeline's points (batch, KV heads, context): the two batch-1 calls that split 16 ways,
#: and three where the batch fills the GPU (2, 1 and 2 units per program).
TIMELINE_POINTS = [(1, 8, 4096), (1, 8, 32768), (8, 8, 32768), (32, 8, 32768), (8, 32, 32768)]


def gluon_timeline(merge: str = "last", points=None, saved_as: str = "ch07_gluon_timeline.json",
                   schedule: str = "units"):
    """What each program of one call does, on the GPU's own clocks: the Gluon kernel (defaults,
    ``merge`` its merge, ``schedule`` its schedule) at ``points`` (default `TIMELINE_POINTS`) with a
    timeline (`TIMELINE_EVENTS`: start, the loader's first copies, the first tile in
    shared memory, the keys done, the end), replayed as a CUDA graph of 16 calls over enough
    copies of the cache that every call reads HBM (one timeline per copy: its last call's
    stamps). Prints, per point, the graph's time per call (the stamps' cost included: compare it
    with `bench.ch07_gluon`'s graph time of the same point) and the medians over the calls of:
    the spread of the programs' starts; start to first copy and to first tile (median and
    slowest program); the keys' stream (fastest, median, slowest program); keys done to end
    (median; the slowest is the merging program); how far the last end is past the median end
    and past the last program's keys (the merge's own time on the critical path); the whole
    span. Saves every stamp (global-timer ns from the call's first start) to
    ``$OUT/<saved_as>`` (``OUT`` default ``.``) for Chapter 7's plot."""
    import json
    import os

    from minillm.kernels.base import capture_calls, l2_copies
    from minillm.kernels.ch07_flash_decoding_gluon import (
        TIMELINE_EVENTS, flash_decode_attention_gluon, new_timeline, plan_splits,
    )

    print(f"\n== gluon_timeline (merge {merge}, schedule {schedule}): us on the GPU's global timer, "
          "medians over calls ==")
    sms = fd.num_sms(DEV)
    saved = {"events": list(TIMELINE_EVENTS), "device": torch.cuda.get_device_name(DEV), "points": []}
    for b, hkv, ctx in points or TIMELINE_POINTS:
        plan = plan_splits(b, hkv, ctx, sms)
        cache_bytes = 2 * b * hkv * ctx * D * 2
        n_copies = l2_copies(cache_bytes, DEV, 8)
        copies = [inputs(b, hkv, ctx) for _ in range(n_copies)]
        timelines = [new_timeline(sms, DEV) for _ in copies]
        fns = []
        for (q, k, v, tables, lens), tl_ in zip(copies, timelines):
            out, lse = decode_outputs(q, None, None)
            fns.append(lambda q=q, k=k, v=v, t=tables, n=lens, o=out, l=lse, tl_=tl_: flash_decode_attention_gluon(
                q, k, v, t, n, num_splits=plan, out=o, lse=l, timeline=tl_, merge=merge, schedule=schedule))
        n_calls = -(-16 // n_copies) * n_copies
        graph = capture_calls(fns, n_calls)
        call_us = timer(graph.replay) / n_calls * 1e3  # (also leaves every timeline filled)
        torch.cuda.synchronize()
        grid = min(sms, b * hkv * plan)
        stats, calls = [], []
        for tl_ in timelines:
            t = timeline_us(tl_, grid)
            start, first_copy, first_tile, keys_done, end = t.unbind(1)
            stream, finish = keys_done - first_tile, end - keys_done
            stats.append({
                "start spread": start.max() - start.min(), "to first copy": (first_copy - start).median(),
                "to first tile": (first_tile - start).median(), "slowest first tile": (first_tile - start).max(),
                "stream min": stream.min(), "stream median": stream.median(), "stream max": stream.max(),
                "finish median": finish.median(), "finish max": finish.max(),
                "last end past median": end.max() - end.median(),
                "last end past last keys": end.max() - keys_done.max(), "span": end.max()})
            calls.append((t * 1e3).tolist())  # ns, as saved before
        med = {name: statistics.median(float(st[name]) for st in stats) for name in stats[0]}
        print(f"  B={b:2} Hkv={hkv:2} L={ctx:6} S={plan} programs={grid} calls={len(stats)} "
              f"graph {call_us:.2f} us per call: "
              + " | ".join(f"{name} {value:.2f}" for name, value in med.items()), flush=True)
        saved["points"].append({"batch": b, "kv_heads": hkv, "context": ctx, "num_splits": plan, "programs": grid,
                                "graph_us_per_call": call_us, "medians_us": med, "calls_ns": calls})
        del copies, fns, graph
        torch.cuda.empty_cache()
    path = os.path.join(os.environ.get("OUT", "."), saved_as)
    with open(path, "w") as f:
        json.dump(saved, f)
    print(f"  saved {path}", flush=True)


def gluon_timeline_merges():
    """`gluon_timeline` at the batch-1 points with each in-launch merge: the last program to
    arrive (the counter) and the program of each unit's last split, polling."""
    for merge in ("last", "poll"):
        gluon_timeline(merge, TIMELINE_POINTS[:2], f"ch07_gluon_timeline_{merge}.json")


def gluon_timeline_claims():
    """`gluon_timeline` at the points where the plan splits 16 and 2 ways, with the unit's
    tiles in fixed runs and claimed (``schedule="claim"``)."""
    for schedule in ("units", "claim"):
        gluon_timeline("last", TIMELINE_POINTS[:3], f"ch07_gluon_timeline_{schedule}.json", schedule)


def gluon_timeline_steals():
    """`gluon_timeline` at the points where the plan splits 16 and 2 ways, with the unit's
    tiles in fixed runs and with stealing (``schedule="steal"``)."""
    for schedule in ("units", "steal"):
        gluon_timeline("last", TIMELINE_POINTS[:3], f"ch07_gluon_timeline_steals_{schedule}.json", schedule)


def gluon_timeline_repeats():
    """Is a slow program slow because of where its data lies, or at random? At batch 1 with 8 KV
    heads (4k and 32k keys) and at batch 32 (32k), six eager calls of the Gluon kernel (defaults)
    with a timeline on one and the same cache, each after a warm-up call and with the L2 emptied
    before it (a 256 MB write): if the per-program stream times correlate from call to call, the
    spread follows where the data lies; if not, it is contention that changes from call to call.
    Prints the median correlation between two of these calls, and between one of them and a call
    on a second copy (the same values and tables in a new allocation); saves the stamps to
    ``$OUT/ch07_gluon_timeline_repeats.json``."""
    import json
    import os

    import numpy as np

    from minillm.kernels.ch07_flash_decoding_gluon import (
        TIMELINE_EVENTS, flash_decode_attention_gluon, new_timeline, plan_splits,
    )

    repeats = 6
    print("\n== gluon_timeline_repeats: per-program stream times, call against call ==")
    sms = fd.num_sms(DEV)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=DEV)
    saved = {"events": list(TIMELINE_EVENTS), "device": torch.cuda.get_device_name(DEV), "points": []}
    for b, hkv, ctx in [(1, 8, 4096), (1, 8, 32768), (32, 8, 32768)]:
        plan = plan_splits(b, hkv, ctx, sms)
        grid = min(sms, b * hkv * plan)
        streams, stamps = {}, {}
        for copy in ("same", "other"):
            inp = inputs(b, hkv, ctx)
            q, k, v, tables, lens = inp
            out, lse = decode_outputs(q, None, None)
            flash_decode_attention_gluon(q, k, v, tables, lens, num_splits=plan, out=out, lse=lse)
            runs = []
            for _ in range(repeats if copy == "same" else 1):
                tl_ = new_timeline(sms, DEV)
                flush.zero_()
                flash_decode_attention_gluon(q, k, v, tables, lens, num_splits=plan, out=out, lse=lse, timeline=tl_)
                torch.cuda.synchronize()
                runs.append((timeline_us(tl_, grid) * 1e3).tolist())  # ns from the call's first start
            stamps[copy] = runs
            ns = np.array(runs, dtype=float)
            streams[copy] = ns[:, :, 3] - ns[:, :, 2]
            del inp, q, k, v, tables
            torch.cuda.empty_cache()
        # Only the programs with the usual number of units (at batch 32, 8 of 132 have one, not two:
        # their short streams alone would correlate).
        alike = np.abs(streams["same"].mean(0) / np.median(streams["same"]) - 1) < 0.25
        same = np.corrcoef(streams["same"][:, alike])
        within = float(np.median(same[np.triu_indices(len(same), 1)]))
        across = [float(np.corrcoef(streams["same"][i, alike], streams["other"][0, alike])[0, 1])
                  for i in range(repeats)]
        spread = [float((s.max() - np.median(s)) / np.median(s)) for s in streams["same"]]
        print(f"  B={b:2} Hkv={hkv:2} L={ctx:6} S={plan} programs={grid} ({alike.sum()} alike): median "
              f"correlation, same cache {within:.2f}, other copy {statistics.median(across):.2f}; slowest stream "
              "past the median " + " ".join(f"{x:.1%}" for x in spread), flush=True)
        saved["points"].append({"batch": b, "kv_heads": hkv, "context": ctx, "num_splits": plan, "programs": grid,
                                "same_cache_ns": stamps["same"], "other_copy_ns": stamps["other"]})
    path = os.path.join(os.environ.get("OUT", "."), "ch07_gluon_timeline_repeats.json")
    with open(path, "w") as f:
        json.dump(saved, f)
    print(f"  saved {path}", flush=True)


def gluon_turns():
    """Is a slow reading the kernel or its turn? At the two 128k points whose default reading
    came out 6-13 % above an identical-code variant in some runs (the default is the first call
    of every round in `bench.ch07_gluon`), the default kernel three times in one round (first,
    middle, last), beside the merge launch (the same split plan and stream) and the Triton
    kernel; eager, taking turns, 5 rounds, each round's times printed. Then one call of the
    default and one of the merge launch with a timeline (eager), summarised as in
    ``gluon_timeline``."""
    from bench.common import interleaved_times
    from minillm.kernels.ch07_flash_decoding_gluon import flash_decode_attention_gluon, new_timeline, plan_splits

    print("\n== gluon_turns: eager us per call, by position in the round ==")
    sms = fd.num_sms(DEV)
    for b, hkv, ctx in [(8, 8, 131072), (1, 32, 131072)]:
        q, cudnn_ms, (k, v, tables, lens) = cudnn_then_pool(b, hkv, ctx)
        out, lse = decode_outputs(q, None, None)
        plan, wave = plan_splits(b, hkv, ctx, sms), fd.num_splits_heuristic(b, hkv, ctx, sms, 128)
        default = lambda **kw: flash_decode_attention_gluon(  # noqa: E731
            q, k, v, tables, lens, num_splits=plan, out=out, lse=lse, **kw)
        calls = {"default first": default, "merge launch": lambda: default(merge="launch"),
                 "default middle": default,
                 "triton": lambda: fd.flash_decode_attention(q, k, v, tables, lens, num_splits=wave, out=out, lse=lse),
                 "default last": default}
        rounds = []
        for _ in range(5):
            rounds.append(interleaved_times(calls, timer, 1))
        print(f"  B={b:2} Hkv={hkv:2} L={ctx:6} S={plan}: cuDNN {cudnn_ms * 1e3:.1f}", flush=True)
        for name in calls:
            ts = [r[name] * 1e3 for r in rounds]
            print(f"    {name}: " + " ".join(f"{t:.1f}" for t in ts) + f" | median {statistics.median(ts):.1f}",
                  flush=True)
        for name, kw in (("default", {}), ("merge launch", {"merge": "launch"})):
            tl_ = new_timeline(sms, DEV)
            default(timeline=tl_, **kw)
            torch.cuda.synchronize()
            start, first_copy, first_tile, keys_done, end = timeline_us(tl_, min(sms, b * hkv * plan)).unbind(1)
            stream = keys_done - first_tile
            print(f"    timeline {name}: start spread {start.max() - start.min():.2f} | first tile "
                  f"{(first_tile - start).median():.2f} | stream {stream.min():.1f}/{stream.median():.1f}/"
                  f"{stream.max():.1f} | finish max {(end - keys_done).max():.2f} | span {end.max():.1f}", flush=True)
        del calls, k, v
        torch.cuda.empty_cache()


def gluon_grid():
    """The persistent grid's size at the points where units outnumber the SMs: with ``U`` units
    on ``P`` programs the last round is partial unless ``P`` divides ``U``; the smallest grid
    with the same number of rounds, ``⌈U / ⌈U / P⌉⌉``, gives every program the same work.
    Against SDPA cuDNN (contiguous) in the same run; eager, taking turns, median of 3;
    ratio = cuDNN / variant."""
    from bench.common import interleaved_times
    from minillm.kernels.ch07_flash_decoding_gluon import flash_decode_attention_gluon, plan_splits

    print("\n== gluon_grid: eager us per call; ratio = SDPA cuDNN (contiguous) / variant ==")
    sms = fd.num_sms(DEV)
    for b, hkv, ctx in [(8, 32, 32768), (32, 8, 32768), (8, 32, 131072), (32, 8, 131072), (32, 32, 4096),
                        (32, 32, 32768), (8, 8, 131072), (32, 8, 4096)]:
        q, cudnn_ms, (k, v, tables, lens) = cudnn_then_pool(b, hkv, ctx)
        out, lse = decode_outputs(q, None, None)
        plan = plan_splits(b, hkv, ctx, sms)
        units = b * hkv * plan
        even = -(-units // -(-units // sms))
        grids = {f"P={sms}": sms, f"P={even} (even)": even, "P=128": 128, "P=120": 120}
        calls = {name: lambda p=p: flash_decode_attention_gluon(q, k, v, tables, lens, num_splits=plan, programs=p,
                                                                 out=out, lse=lse)
                 for name, p in grids.items()}
        calls["triton"] = lambda: fd.flash_decode_attention(q, k, v, tables, lens, out=out, lse=lse,
                                                            num_splits=fd.num_splits_heuristic(b, hkv, ctx, sms, 128))
        t = interleaved_times(calls, timer, 3)
        print(f"  B={b:2} Hkv={hkv:2} L={ctx:6} S={plan} U={units}: cuDNN {cudnn_ms * 1e3:.1f} | "
              + " | ".join(f"{n} {ms * 1e3:.1f} ({cudnn_ms / ms:.3f})" for n, ms in t.items()), flush=True)
        del calls, k, v
        torch.cuda.empty_cache()


def gluon_contiguous():
    """The Gluon kernel on SDPA's own cache: a contiguous ``[batch, kv_heads, context,
    head_dim]`` tensor is an HND pool of ``batch`` blocks of ``context`` tokens (tables ``[[0],
    [1], ...]``), so the kernel reads exactly the bytes cuDNN reads, in the same places. Beside
    it, the same values in the shuffled 16-token pool (Gluon and Triton), taking turns (median
    of 3), and cuDNN timed before them (median of 3); eager; ratio = cuDNN / variant."""
    from torch.nn.attention import SDPBackend

    from bench.common import contiguous_cache, interleaved_times, time_sdpa
    from minillm.kernels.ch07_flash_decoding_gluon import flash_decode_attention_gluon, plan_splits

    print("\n== gluon_contiguous: eager us per call; ratio = SDPA cuDNN / variant ==")
    sms = fd.num_sms(DEV)
    for b, hkv, ctx in [(8, 32, 32768), (32, 8, 32768), (8, 8, 131072), (8, 32, 131072), (1, 8, 131072),
                        (32, 32, 32768)]:
        k_c, v_c = contiguous_cache(3, b, hkv, ctx, D, DT, DEV)
        q = torch.randn(b, HQ, D, device=DEV, dtype=DT)
        gen = torch.Generator(device=DEV)
        gen.manual_seed(0)
        k, v, tables = paged_cache(3, b, hkv, ctx, D, BS, DT, DEV, gen)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=DEV)
        one_block = torch.arange(b, device=DEV, dtype=torch.int32)[:, None]
        out, lse = decode_outputs(q, None, None)
        plan = plan_splits(b, hkv, ctx, sms)
        sdpa = [time_sdpa(q, k_c, v_c, SDPBackend.CUDNN_ATTENTION, timer) for _ in range(3)]
        cudnn_ms, ref = statistics.median(ms for ms, _ in sdpa), sdpa[0][1].float()
        calls = {
            "gluon on SDPA's cache": lambda: flash_decode_attention_gluon(q, k_c, v_c, one_block, lens, num_splits=plan,
                                                                         kv_layout="HND", out=out, lse=lse),
            "gluon paged": lambda: flash_decode_attention_gluon(q, k, v, tables, lens, num_splits=plan, out=out,
                                                                lse=lse),
            "triton paged": lambda: fd.flash_decode_attention(q, k, v, tables, lens, out=out, lse=lse,
                                                              num_splits=fd.num_splits_heuristic(b, hkv, ctx, sms, 128)),
        }
        t = interleaved_times(calls, timer, 3)
        got = flash_decode_attention_gluon(q, k_c, v_c, one_block, lens, num_splits=plan, kv_layout="HND")[0].float()
        err = ((got - ref).norm() / ref.norm()).item()
        print(f"  B={b:2} Hkv={hkv:2} L={ctx:6} S={plan}: cuDNN {cudnn_ms * 1e3:.1f} | "
              + " | ".join(f"{n} {ms * 1e3:.1f} ({cudnn_ms / ms:.3f})" for n, ms in t.items())
              + f" | rel err on SDPA's cache {err:.1e}", flush=True)
        del calls, k, v, k_c, v_c
        torch.cuda.empty_cache()


if __name__ == "__main__":
    parts = sys.argv[1:] or ["overhead", "config", "async", "splits", "fused"]
    t0 = time.time()
    for part in parts:
        {"overhead": overhead, "config": config, "async": async_variants, "splits": splits, "fused": fused,
         "hopper": hopper, "hopper2": hopper2, "gluon": gluon, "gluon_balance": gluon_balance,
         "gluon_layout": gluon_layout, "gluon_placement": gluon_placement,
         "gluon_fixed_cost": gluon_fixed_cost, "gluon_fixed_breakdown": gluon_fixed_breakdown,
         "gluon_grid": gluon_grid, "gluon_occupancy": gluon_occupancy, "gluon_merge": gluon_merge,
         "gluon_short_calls": gluon_short_calls, "gluon_ncu_target": gluon_ncu_target,
         "gluon_pipeline": gluon_pipeline, "gluon_contiguous": gluon_contiguous,
         "gluon_timeline": gluon_timeline, "gluon_timeline_repeats": gluon_timeline_repeats,
         "gluon_timeline_merges": gluon_timeline_merges, "gluon_claim": gluon_claim,
         "gluon_timeline_claims": gluon_timeline_claims, "gluon_steal": gluon_steal,
         "gluon_timeline_steals": gluon_timeline_steals, "gluon_pdl": gluon_pdl,
         "gluon_turns": gluon_turns}[part]()
        print(f"[{part} done at {time.time() - t0:.0f} s]", flush=True)
