"""Chapter 10's benchmark module on the CPU: it imports, its random model and decode batch
build, and its profiler labels wrap the model (both paths) without changing what it computes.
The timings themselves run on CUDA only (``make gpu``)."""
import math
import pytest
import torch

from bench import ch10_fused_decode as b
from minillm.kernels.base import interpreting
from minillm.model.fused import enable_fused_decode


def test_categories_by_kernel_name():
    assert b.categorize("_flat_gemm_kernel") == "gemm"
    assert b.categorize("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert b.categorize("_split_kernel") == "attention"
    assert b.categorize("_add_rmsnorm_kernel") == "norms"
    assert b.categorize("_rope_write_kv_kernel") == "rotary"
    assert b.categorize("_silu_mul_kernel") == "elementwise"
    assert b.categorize("reduce_kernel<ArgMaxOps<float>>") == "sampling"
    assert b.categorize("_exponential_race_kernel") == "sampling"
    assert set(b.CATEGORIES) >= {"gemm", "attention", "norms", "rotary", "elementwise", "sampling", "other"}


@pytest.mark.skipif(not interpreting(), reason="the fused path on CPU tensors runs in Triton's interpreter only")
def test_labelled_model_computes_the_same_on_both_paths():
    model, _ = b.random_model("llama-tiny", "cpu", dtype=torch.float32)
    cache, batch = b.decode_setup(model, 3, 20, "cpu")
    assert batch.batch_size == 3 and batch.max_seq_len == 21
    assert b.weight_bytes(model) > 0
    outs = []
    for mode in ("off", "on"):
        enable_fused_decode(model, cache, mode)
        with torch.inference_mode():
            plain = model.forward_paged(batch, cache, last_only=True)
            with b.labelled(model):
                labelled = model.forward_paged(batch, cache, last_only=True)
        torch.testing.assert_close(labelled, plain)
        outs.append(plain)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    import minillm.model.torch_model as tm
    assert tm.apply_rope.__name__ == "apply_rope", "labelled() must restore what it patched"


# -- the parts: selection, partial re-runs that keep the other parts' rows, dry runs on the CPU --

import json
import types
from pathlib import Path

import pytest

from bench.common import Results

H100 = Path(__file__).resolve().parents[1] / "bench" / "results" / "nvidia-h100-80gb-hbm3.json"


def test_parts_selection():
    assert b.selected_parts("") == b.PARTS
    assert b.selected_parts(" hf_static, offline_eager ") == ("offline_eager", "hf_static")  # run order
    with pytest.raises(ValueError, match="unknown parts"):
        b.selected_parts("hf_static,nope")


def test_every_committed_row_belongs_to_a_part():
    rows = [r for r in json.loads(H100.read_text())["rows"] if r["benchmark"] == b.BENCHMARK]
    assert rows
    assert {b.row_part(r) for r in rows} <= set(b.PARTS)
    assert b.row_part({"params": {"kind": "offline", "mode": "fused eager", "cuda_graphs": "off"}}) == "offline_eager"
    assert b.row_part({"params": {"kind": "decode", "batch": 8}}) == "hf_static"
    assert b.row_part({"params": {"part": "hf_static"}}) == "hf_static"
    assert b.row_part({"params": {"part": "empty_kernel"}}) == "step"


def _rerun(out, parts, rows):
    results = Results("NVIDIA H100 80GB HBM3", {"copy_TBps": 3.0}, env={"torch": "test"})
    b.keep_unselected_parts(results, parts)
    for params, metric, value in rows:
        results.add(b.BENCHMARK, params, metric, value)
    results.save(out)
    return json.loads((out / H100.name).read_text())


def test_partial_rerun_keeps_the_other_parts_rows(tmp_path):
    # The committed file as it was before the two newer parts were measured.
    before = json.loads(H100.read_text())
    before["rows"] = [r for r in before["rows"]
                      if r["benchmark"] != b.BENCHMARK or b.row_part(r) not in ("offline_eager", "hf_static")]
    (tmp_path / H100.name).write_text(json.dumps(before))
    old = [r for r in before["rows"] if r["benchmark"] == b.BENCHMARK]
    others = [r for r in before["rows"] if r["benchmark"] != b.BENCHMARK]
    eager = {"kind": "offline", "mode": "fused eager", "cuda_graphs": "off"}
    decode = {"kind": "decode", "batch": 1}
    after = _rerun(tmp_path, ("offline_eager", "hf_static"), [(eager, "decode_step_ms", 5.0), (decode, "tpot_ms", 1.0)])
    rows = [r for r in after["rows"] if r["benchmark"] == b.BENCHMARK]
    assert rows[:len(old)] == old and len(rows) == len(old) + 2           # every earlier row kept, the new ones added
    assert [r for r in after["rows"] if r["benchmark"] != b.BENCHMARK] == others
    run = after["runs"][b.BENCHMARK]
    assert run["kept"]["rows"] == len(old) and run["kept"]["runs"][-1]["date"] == before["runs"][b.BENCHMARK]["date"]
    assert "rows kept from the earlier run" in (tmp_path / "nvidia-h100-80gb-hbm3.md").read_text()
    # re-running one part again replaces its rows only
    after = _rerun(tmp_path, ("hf_static",), [(decode, "tpot_ms", 2.0)])
    rows = [r for r in after["rows"] if r["benchmark"] == b.BENCHMARK]
    assert len(rows) == len(old) + 2
    assert [r["ours"] for r in rows if b.row_part(r) == "hf_static"] == [2.0]
    assert [r["ours"] for r in rows if b.row_part(r) == "offline_eager"] == [5.0]
    # a full run (all parts) replaces everything
    after = _rerun(tmp_path, b.PARTS, [(decode, "tpot_ms", 3.0)])
    assert [r["ours"] for r in after["rows"] if r["benchmark"] == b.BENCHMARK] == [3.0]
    assert "kept" not in after["runs"][b.BENCHMARK]


def test_hf_static_part_bookkeeping_on_cpu():
    """Part 6 end to end on a tiny model on the CPU (engine unfused, transformers eager with a
    StaticCache, compilation not asked for): the rows, their ratios and their part."""
    results = Results("cpu", env={})
    ctx = {"device": torch.device("cpu"), "left": lambda: 1e9, "decode_preset": "llama-tiny",
           "decode_batches": (1, 2), "new_tokens": 4, "prompt_len": 8, "fused": False, "compile": False,
           "reps": 1, "dtype": torch.float32}
    b.part_hf_static(results, ctx)
    rows = results.rows
    assert {b.row_part(r) for r in rows} == {"hf_static"}
    for batch in (1, 2):
        mine = [r for r in rows if r["params"]["batch"] == batch]
        ours = [r for r in mine if r["metric"] == "tpot_ms" and r["peer"] is None]
        peer = [r for r in mine if r["peer"] == "hf_static"]
        # (T(n) - T(1)) / (n - 1) of a few tokens on a loaded CPU can come out at or below zero:
        # the bookkeeping is what this test checks, not the timings' sign
        assert len(ours) == 1 and math.isfinite(ours[0]["ours"])
        assert len(peer) == 1 and peer[0]["ours"] == ours[0]["ours"] and math.isfinite(peer[0]["peer_value"])
        both_positive = peer[0]["ours"] > 0 and peer[0]["peer_value"] > 0
        assert peer[0]["ratio"] == (pytest.approx(peer[0]["peer_value"] / peer[0]["ours"]) if both_positive else None)
        assert [r["metric"] for r in mine if r["params"].get("peer") == "hf_static_compile"] == ["skipped"]
    assert results.to_dict()["rows"]  # JSON-safe


def test_offline_eager_part_bookkeeping_with_stand_ins(monkeypatch):
    """Part 5 with a stand-in engine and peer (no timing): eager engines (cuda_graphs off) fused
    and unfused, ratios against the one transformers measurement, shared through ctx."""
    from minillm.experiments import ch09_engine_benchmark as bench

    real = b.random_model
    monkeypatch.setattr(b, "random_model", lambda preset, device, **kw: real("llama-tiny", "cpu", dtype=torch.float32))
    built, peers = [], []

    def build_engine(model=None, tokenizer=None, config=None):
        assert config.cuda_graphs == "off"
        built.append(config.fused_decode)
        fused = types.SimpleNamespace(replay_layers=True)
        return types.SimpleNamespace(fused_decode=config.fused_decode == "on",
                                     runner=types.SimpleNamespace(model=types.SimpleNamespace(fused_decode=fused)))

    def result(tok_s, **kw):
        return bench.OfflineResult("x", "", 1, 1, 1.0, 1, 1, tok_s, tok_s, 1.0, 1, 1.0, steps=10, eager_steps=10,
                                   decode_step_ms=1000 / tok_s, **kw)

    def tokens_per_s(engine):
        if not engine.fused_decode:
            return 200.0
        return 300.0 if engine.runner.model.fused_decode.replay_layers else 250.0

    monkeypatch.setattr(bench, "build_engine", build_engine)
    monkeypatch.setattr(bench, "run_offline", lambda engine, work, **kw: result(tokens_per_s(engine)))
    monkeypatch.setattr(bench, "build_random_llama", lambda *a, **kw: "path")
    monkeypatch.setattr(bench, "load_hf_model", lambda *a: object())
    monkeypatch.setattr(bench, "run_hf_static", lambda hf, work, n, **kw: peers.append(len(work)) or result(100.0))
    results = Results("cpu", env={})
    ctx = {"device": torch.device("cpu"), "left": lambda: 1e9}
    b.part_offline_eager(results, ctx)
    assert built == ["off", "on", "on"] and len(peers) == 2     # one warm-up and one timed peer run
    rows = results.rows
    assert {b.row_part(r) for r in rows} == {"offline_eager"}
    ratio = {(r["params"]["mode"], r["peer"]): r["ratio"] for r in rows if r["metric"] == "output_tokens_per_s"}
    assert ratio == {("fused eager", "unfused eager"): 1.5, ("fused eager", "fused, no replay eager"): 1.2,
                     ("fused eager", "hf_static_batching"): 3.0, ("fused, no replay eager", "hf_static_batching"): 2.5,
                     ("unfused eager", "hf_static_batching"): 2.0}
    b.part_offline_eager(Results("cpu", env={}), ctx)          # the peer is measured once per run
    assert len(peers) == 2


def test_torch_sampler_peer_draws_from_what_our_filters_keep():
    """The sampling part's torch peer computes the operation our sampler does (temperature,
    top-k, top-p, a draw): every token it draws survives `filtered_logits`, and the
    most likely token is drawn most often."""
    from minillm.decoding.gpu_sampling import SamplingTensors, filtered_logits
    from minillm.decoding.sampling import SamplingParams

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=g) * 3
    rows = SamplingTensors.from_params([SamplingParams(temperature=0.8, top_k=50, top_p=0.9)] * 4, range(4),
                                       [0] * 4, "cpu")
    keep = filtered_logits(logits, rows) > -torch.inf
    assert 0 < int(keep.sum()) < 4 * 50
    torch.manual_seed(0)
    draws = torch.stack([b.torch_sampler(logits, rows.temperature, rows.top_k, rows.top_p) for _ in range(200)])
    assert bool(keep.gather(1, draws.T).all())
    assert draws.mode(0).values.tolist() == logits.argmax(-1).tolist()
    assert b.row_part({"params": {"kind": "sampler", "batch": 8}}) == "sampling"
    assert b.row_part({"params": {"kind": "sampled"}}) == "sampling"
