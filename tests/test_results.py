"""CPU tests of the benchmark harness (bench/) and the results reader (minillm.results).

No timing is asserted anywhere: these check the bookkeeping (rows, ratios, merging, files,
parsing ncu's CSV) that turns GPU measurements into the numbers the chapters print.
"""
from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `pytest` without `python -m` does not put the root on the path
    sys.path.insert(0, str(REPO))

from minillm import costs as C  # noqa: E402
from minillm import results as mr  # noqa: E402
from bench import common  # noqa: E402
from bench.common import Results, compute_ratio, metric_direction  # noqa: E402

ENV = {"torch": "9.9.9", "triton": "8.8.8", "cuda": "13.0", "python": "3.12.0",
       "device_info": {"total_memory_bytes": 80 * 2 ** 30}}
H100 = "NVIDIA H100 80GB HBM3"


def make(device=H100, ceilings=None, env=ENV):
    return Results(device, ceilings if ceilings is not None else {"copy_TBps": 3.0, "bf16_matmul_TFLOPs": 800.0},
                   env=env)


# ----------------------------------------------------------------------------------------
# slug, direction, ratio
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, slug", [
    ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"),
    ("NVIDIA H200", "nvidia-h200"),
    ("  NVIDIA A100-SXM4-40GB ", "nvidia-a100-sxm4-40gb"),
    ("NVIDIA GeForce RTX 4090 (x)", "nvidia-geforce-rtx-4090-x"),
    ("", "unknown-device"),
])
def test_gpu_slug(name, slug):
    assert mr.gpu_slug(name) == slug
    assert common.gpu_slug(name) == slug


@pytest.mark.parametrize("metric, direction", [
    ("time_ms", "lower"), ("pass_time_ms", "lower"), ("peak_memory_bytes", "lower"),
    ("dram_read_bytes", "lower"), ("rel_err", "lower"), ("latency_s", "lower"),
    ("TFLOPs", "higher"), ("pass_bandwidth_TBps", "higher"), ("tokens_per_s", "higher"),
    ("oom", None), ("something", None),
])
def test_metric_direction(metric, direction):
    assert metric_direction(metric) == direction


def test_ratio_orientation_above_one_means_ours_better():
    # times: ours 1 ms vs peer 2 ms -> ours is 2x faster
    assert compute_ratio(1.0, 2.0, "lower") == pytest.approx(2.0)
    assert compute_ratio(4.0, 2.0, "lower") == pytest.approx(0.5)
    # rates: ours 100 TFLOP/s vs peer 50 -> 2x better
    assert compute_ratio(100.0, 50.0, "higher") == pytest.approx(2.0)
    assert compute_ratio(25.0, 50.0, "higher") == pytest.approx(0.5)


@pytest.mark.parametrize("ours, peer", [(None, 1.0), (1.0, None), (0.0, 1.0), (1.0, 0.0),
                                        (True, False), (float("nan"), 1.0), (1.0, float("inf"))])
def test_ratio_missing_values(ours, peer):
    assert compute_ratio(ours, peer, "lower") is None
    assert compute_ratio(ours, peer, "higher") is None


def test_add_computes_ratio_from_metric_name():
    r = make()
    t = r.add("b", {"n": 1}, "time_ms", 1.0, "peer", 3.0)
    assert t["ratio"] == pytest.approx(3.0) and t["better"] == "lower"
    f = r.add("b", {"n": 1}, "TFLOPs", 300.0, "peer", 100.0, fraction_of_ceiling=0.375)
    assert f["ratio"] == pytest.approx(3.0) and f["better"] == "higher"
    assert f["fraction_of_ceiling"] == pytest.approx(0.375)
    assert f["device"] == H100 and f["benchmark"] == "b" and f["params"] == {"n": 1}
    # explicit direction overrides the name
    x = r.add("b", {"n": 1}, "speedup", 2.0, "peer", 1.0, better="higher")
    assert x["ratio"] == pytest.approx(2.0)


def test_add_requires_direction_for_unknown_metric_with_peer():
    r = make()
    with pytest.raises(ValueError):
        r.add("b", {}, "mystery", 1.0, "peer", 2.0)
    with pytest.raises(ValueError):
        r.add("b", {}, "time_ms", 1.0, "peer", 2.0, better="sideways")
    # no peer value: nothing to orient, fine
    row = r.add("b", {}, "mystery", 1.0)
    assert row["ratio"] is None
    # flags (booleans) are recorded as they are, without a ratio
    oom = r.add("b", {}, "oom", True, "sdpa_math", False)
    assert oom["ours"] is True and oom["peer_value"] is False and oom["ratio"] is None


def test_add_copies_params_and_cleans_values():
    r = make()
    params = {"seq_len": 512}
    row = r.add("b", params, "time_ms", float("nan"), "p", 1.0)
    params["seq_len"] = 1024
    assert row["params"] == {"seq_len": 512}
    assert row["ours"] is None and row["ratio"] is None


# ----------------------------------------------------------------------------------------
# saving and merging
# ----------------------------------------------------------------------------------------
def test_save_writes_json_schema_and_markdown(tmp_path):
    r = make()
    r.add("ch01_naive_attention", {"seq_len": 512, "causal": False}, "time_ms", 0.5, "sdpa_math", 1.0)
    r.add("ch01_naive_attention", {"seq_len": 512, "causal": False}, "bandwidth_TBps", 1.5,
          fraction_of_ceiling=0.5)
    json_path, md_path = r.save(tmp_path)
    assert json_path == tmp_path / "nvidia-h100-80gb-hbm3.json"
    assert md_path == tmp_path / "nvidia-h100-80gb-hbm3.md"
    data = json.loads(json_path.read_text())
    for key in ("device", "gpu_slug", "torch", "triton", "cuda", "date", "ceilings", "rows", "runs"):
        assert key in data
    assert data["device"] == H100 and data["gpu_slug"] == "nvidia-h100-80gb-hbm3"
    assert data["torch"] == "9.9.9" and data["triton"] == "8.8.8" and data["cuda"] == "13.0"
    assert data["ceilings"] == {"copy_TBps": 3.0, "bf16_matmul_TFLOPs": 800.0}
    assert data["runs"]["ch01_naive_attention"]["status"] == "complete"
    assert "T" in data["date"]  # ISO 8601
    assert len(data["rows"]) == 2
    row = data["rows"][0]
    for key in ("benchmark", "params", "metric", "ours", "peer", "peer_value", "ratio",
                "fraction_of_ceiling", "device"):
        assert key in row
    assert row["ratio"] == pytest.approx(2.0)
    text = json_path.read_text()
    assert len([line for line in text.splitlines() if '"benchmark"' in line]) == 2  # a row a line
    md = md_path.read_text()
    assert H100 in md and "## ch01_naive_attention" in md
    assert "| seq_len | causal | metric | ours | peer | peer_value | ratio | fraction_of_ceiling |" in md
    assert "sdpa_math" in md


def test_save_without_rows_writes_nothing(tmp_path):
    r = make()
    r.save(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_save_merges_by_benchmark(tmp_path):
    first = make()
    first.add("ch01_naive_attention", {"seq_len": 512}, "time_ms", 1.0, "sdpa_math", 2.0)
    first.add("ch01_naive_attention", {"seq_len": 1024}, "time_ms", 4.0, "sdpa_math", 8.0)
    first.add("ch01_traffic", {"pass": "scores"}, "dram_read_bytes", 100, "count", 100)
    first.save(tmp_path)

    # re-running chapter 1's timing replaces its rows only; the traffic rows stay
    second = make(ceilings={"copy_TBps": 3.3, "bf16_matmul_TFLOPs": 790.0})
    second.add("ch01_naive_attention", {"seq_len": 512}, "time_ms", 0.9, "sdpa_math", 2.0)
    second.add("ch03_flash", {"seq_len": 512}, "time_ms", 0.1, "sdpa_flash", 0.1)
    json_path, _ = second.save(tmp_path)
    data = json.loads(json_path.read_text())
    by_bench = {}
    for row in data["rows"]:
        by_bench.setdefault(row["benchmark"], []).append(row)
    assert [r["ours"] for r in by_bench["ch01_naive_attention"]] == [0.9]
    assert [r["ours"] for r in by_bench["ch01_traffic"]] == [100]
    assert [r["ours"] for r in by_bench["ch03_flash"]] == [0.1]
    # benchmark order: old ones where they were, new ones after
    assert list(by_bench) == ["ch01_naive_attention", "ch01_traffic", "ch03_flash"]
    assert data["ceilings"]["copy_TBps"] == 3.3
    assert set(data["runs"]) == {"ch01_naive_attention", "ch01_traffic", "ch03_flash"}
    assert data["runs"]["ch01_traffic"]["ceilings"]["copy_TBps"] == 3.0  # from the first run

    # a run that measured no ceilings (the traffic step) keeps the file's ceilings
    third = Results(H100, ceilings=None, env=ENV)
    third.add("ch01_traffic", {"pass": "scores"}, "dram_read_bytes", 120, "count", 100)
    third.set_status("ch01_traffic", "partial: test")
    third.save(tmp_path)
    data = json.loads(json_path.read_text())
    assert data["ceilings"]["copy_TBps"] == 3.3
    assert [r["ours"] for r in data["rows"] if r["benchmark"] == "ch01_traffic"] == [120]
    assert len([r for r in data["rows"] if r["benchmark"] == "ch01_naive_attention"]) == 1
    assert data["runs"]["ch01_traffic"]["status"] == "partial: test"


def test_ceilings_of_a_part_that_measured_none_come_from_the_run_whose_rows_it_kept():
    results = {"ceilings": {"copy_TBps": 3.3},
               "runs": {"bwd_only": {"ceilings": None, "kept": {"rows": 5, "runs": [
                            {"ceilings": {"copy_TBps": 2.9}}, {"ceilings": {"copy_TBps": 3.0}}, {"ceilings": None}]}},
                        "measured": {"ceilings": {"copy_TBps": 3.1}},
                        "alone": {"ceilings": None}}}
    assert mr.ceilings(results, "measured") == {"copy_TBps": 3.1}
    assert mr.ceilings(results, "bwd_only") == {"copy_TBps": 3.0}  # the newest kept run that measured one
    assert mr.ceilings(results, "alone") == {"copy_TBps": 3.3}  # nothing kept: the file's
    assert mr.ceilings(results) == {"copy_TBps": 3.3}


def test_save_keeps_gpus_apart(tmp_path):
    a, b = make(H100), make("NVIDIA H200")
    a.add("x", {}, "time_ms", 1.0, "p", 1.0)
    b.add("x", {}, "time_ms", 2.0, "p", 1.0)
    a.save(tmp_path)
    b.save(tmp_path)
    assert mr.available(tmp_path) == ["nvidia-h100-80gb-hbm3", "nvidia-h200"]
    assert mr.rows(mr.load_results("nvidia-h200", tmp_path))[0]["ours"] == 2.0
    # Other JSON files of the folder (Chapter 8's dispatch table) are not a GPU's results.
    (tmp_path / "nvidia-h200.flat_gemm.json").write_text('{"kind": "flat_gemm_dispatch"}')
    assert mr.available(tmp_path) == ["nvidia-h100-80gb-hbm3", "nvidia-h200"]


def test_saved_json_is_strict(tmp_path):
    r = make()
    r.add("b", {}, "time_ms", float("inf"), "p", float("nan"), fraction_of_ceiling=float("nan"))
    path, _ = r.save(tmp_path)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    json.loads(text)


# ----------------------------------------------------------------------------------------
# minillm.results: the notebooks' reader
# ----------------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    r = make()
    for n in (512, 1024, 2048):
        for causal in (False, True):
            p = {"seq_len": n, "head_dim": 128, "causal": causal}
            r.add("ch01_naive_attention", p, "time_ms", n / 1000, "sdpa_math", n / 500)
            r.add("ch01_naive_attention", p, "TFLOPs", 10.0, "sdpa_math", 5.0, fraction_of_ceiling=10 / 800)
    r.add("ch01_traffic", {"pass": "pv", "seq_len": 4096}, "dram_read_bytes", 10, "count", 10)
    r.save(tmp_path)
    return tmp_path


def test_results_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("MINILLM_RESULTS_DIR", raising=False)
    assert mr.results_dir() == REPO / "bench" / "results"
    monkeypatch.setenv("MINILLM_RESULTS_DIR", str(tmp_path))
    assert mr.results_dir() == tmp_path


def test_load_results_when_empty(tmp_path):
    assert mr.available(tmp_path) == []
    assert mr.available(tmp_path / "missing") == []
    assert mr.load_results(directory=tmp_path) is None
    assert mr.load_results("nvidia-h100-80gb-hbm3", tmp_path) is None
    assert mr.rows(None) == [] and mr.ceilings(None) == {}
    (tmp_path / "broken.json").write_text("{not json")
    assert mr.load_results(directory=tmp_path) is None


def test_load_results_picks_most_recent(tmp_path):
    for slug, date in (("old-gpu", "2026-01-01T00:00:00+00:00"), ("new-gpu", "2026-06-01T00:00:00+00:00"),
                       ("mid-gpu", "2026-03-01T00:00:00+00:00")):
        (tmp_path / f"{slug}.json").write_text(json.dumps({"gpu_slug": slug, "date": date, "rows": []}))
    assert mr.load_results(directory=tmp_path)["gpu_slug"] == "new-gpu"
    assert mr.load_results("old-gpu", tmp_path)["gpu_slug"] == "old-gpu"


def test_rows_filters(saved):
    data = mr.load_results(directory=saved)
    assert data["gpu_slug"] == "nvidia-h100-80gb-hbm3"
    assert len(mr.rows(data)) == 13
    assert len(mr.rows(data, "ch01_naive_attention")) == 12
    assert len(mr.rows(data, metric="time_ms")) == 6
    got = mr.rows(data, "ch01_naive_attention", "time_ms", causal=True)
    assert [r["params"]["seq_len"] for r in got] == [512, 1024, 2048]
    assert all(r["params"]["causal"] is True for r in got)
    assert len(mr.rows(data, metric="time_ms", seq_len=[512, 2048])) == 4
    assert len(mr.rows(data, metric="time_ms", seq_len=lambda n: n > 600)) == 4
    assert mr.rows(data, metric="time_ms", seq_len=4096) == []
    assert mr.rows(data, metric="time_ms", missing_param=1) == []
    assert mr.rows(data, "ch01_traffic", **{"pass": "pv"})[0]["peer"] == "count"
    assert mr.ceilings(data) == {"copy_TBps": 3.0, "bf16_matmul_TFLOPs": 800.0}


def test_markdown_table(saved):
    data = mr.load_results(directory=saved)
    table = mr.markdown_table(mr.rows(data, metric="time_ms", causal=False))
    lines = table.strip().splitlines()
    assert lines[0] == "| seq_len | head_dim | causal | metric | ours | peer | peer_value | ratio | fraction_of_ceiling |"
    assert lines[1].count("---") == 9
    assert len(lines) == 2 + 3
    assert lines[2] == "| 512 | 128 | no | time_ms | 0.512 | sdpa_math | 1.024 | 2 | — |"
    custom = mr.markdown_table(mr.rows(data, metric="TFLOPs", seq_len=512), columns=["seq_len", "causal", "ours"])
    assert custom.splitlines()[0] == "| seq_len | causal | ours |"
    assert custom.splitlines()[2] == "| 512 | no | 10 |"
    assert mr.markdown_table([]) == ""


@pytest.mark.parametrize("value, text", [
    (None, "—"), (True, "yes"), (False, "no"), (3, "3"), (0.5, "0.5"), (1.23456, "1.235"),
    (1234.5, "1234"), (2.5e10, "2.5e+10"), (1e-5, "1e-05"), (0.0, "0"), ("a|b", "a\\|b"),
])
def test_format_value(value, text):
    assert mr.format_value(value) == text


def test_results_reader_needs_no_torch():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['triton'] = None; "
            "import minillm.results as r, bench.common as c; print(r.gpu_slug('NVIDIA H200'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "nvidia-h200"


# ----------------------------------------------------------------------------------------
# The benchmark modules: importable, registered, and their CPU-side helpers
# ----------------------------------------------------------------------------------------
def test_benchmark_modules_importable():
    from bench import run as bench_run

    names = [n for n, _ in bench_run.BENCHMARKS]
    assert "ch01_naive_attention" in names and "ch01_traffic" in names
    for name, module in bench_run.BENCHMARKS:
        mod = importlib.import_module(module)
        assert callable(mod.run), module
        assert mod.BENCHMARK == name
    assert [n for n, _ in bench_run.select(["ch01"])] == ["ch01_naive_attention", "ch01_traffic"]
    assert [n for n, _ in bench_run.select(["ch01_traffic"])] == ["ch01_traffic"]
    assert bench_run.select(["ch99"]) == []
    assert bench_run.main(["--list"]) == 0
    assert bench_run.main(["--only", "ch99"]) == 2


def test_bench_run_refuses_without_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from bench import run as bench_run

    assert bench_run.main(["--only", "ch01_naive_attention"]) == 2


def test_attempt_records_oom_and_propagates_bugs():
    import torch

    from bench import common

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    assert common.attempt(oom) == (None, "oom")
    assert common.attempt(lambda: 7) == (7, None)

    def cublas():
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)")

    assert common.attempt(cublas) == (None, "oom")

    def unsupported():
        raise RuntimeError("No available kernel. Aborting execution.")

    with pytest.raises(RuntimeError):
        common.attempt(unsupported)
    value, status = common.attempt(unsupported, allow_errors=True)
    assert value is None and status.startswith("error: RuntimeError: No available kernel")


def test_ch01_summary_from_rows():
    from bench import ch01_naive_attention as ch01

    r = make()
    p = {"batch": 1, "heads": 16, "seq_len": 512, "head_dim": 128, "causal": False, "dtype": "bfloat16"}
    r.add(ch01.BENCHMARK, p, "time_ms", 0.1, "sdpa_math", 0.3)
    r.add(ch01.BENCHMARK, p, "time_ms", 0.1, "sdpa_flash", 0.02)
    r.add(ch01.BENCHMARK, p, "peak_memory_bytes", 2e9, "sdpa_math", None)
    text = ch01.summary(r)
    lines = text.splitlines()
    assert len(lines) == 2
    assert "3.00" in lines[1] and "OOM/—" in lines[1] and "2.00" in lines[1]


# ----------------------------------------------------------------------------------------
# ch01_traffic: parsing ncu's CSV (synthetic files in both layouts)
# ----------------------------------------------------------------------------------------
DETAILS_CSV = '''==PROF== Connected to process 1234 (/usr/bin/python3.12)
ch01_traffic target: something the program printed
==PROF== Profiling "_scores_kernel" - 0: 0%....50%....100% - 1 pass
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1234","python3.12","127.0.0.1","_scores_kernel","1","7","(128, 1, 1)","(64, 64, 16)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","17,039,360"
"0","1234","python3.12","127.0.0.1","_scores_kernel","1","7","(128, 1, 1)","(64, 64, 16)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","1,073,741,824"
"1","1234","python3.12","127.0.0.1","_softmax_kernel","1","7","(128, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Gbyte","1.07"
"1","1234","python3.12","127.0.0.1","_softmax_kernel","1","7","(128, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","Mbyte","537.13"
"2","1234","python3.12","127.0.0.1","_pv_kernel","1","7","(128, 1, 1)","(64, 16, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","545,259,520"
"2","1234","python3.12","127.0.0.1","_pv_kernel","1","7","(128, 1, 1)","(64, 16, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","parsec","3"
==PROF== Disconnected from process 1234
'''

RAW_CSV = '''"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","dram__bytes_read.sum","dram__bytes_write.sum"
"","","","","","","","byte","byte"
"0","1","python3","h","_scores_kernel","1","7","17039360","1073741824"
"1","1","python3","h","_softmax_kernel","1","7","1073741824","538968064"
"2","1","python3","h","_pv_kernel","1","7","545259520","16777216"
'''


def _meta():
    from bench import ch01_traffic as tr
    from minillm.costs import naive_attention_traffic

    p = tr.PARAMS
    counts = naive_attention_traffic(p["batch"], p["heads"], p["heads"], p["seq_len"], p["seq_len"], p["head_dim"], 2)
    return {"device": H100, "params": p, "counts": counts, "env": ENV}


def test_parse_ncu_details_csv():
    from bench import ch01_traffic as tr

    recs = tr.parse_ncu_csv(DETAILS_CSV)  # the "parsec" cell is skipped, not guessed
    assert len(recs) == 5
    m = tr.measured_by_pass(recs)
    assert m["scores"]["dram__bytes_read.sum"] == 17_039_360
    assert m["scores"]["dram__bytes_write.sum"] == 1_073_741_824
    assert m["softmax"]["dram__bytes_read.sum"] == pytest.approx(1.07e9)
    assert m["softmax"]["dram__bytes_write.sum"] == pytest.approx(537.13e6)
    assert m["pv"] == {"dram__bytes_read.sum": 545_259_520}
    assert tr.parse_ncu_csv("==ERROR== something failed\n") == []


def test_parse_ncu_raw_csv_and_rows():
    from bench import ch01_traffic as tr

    m = tr.measured_by_pass(tr.parse_ncu_csv(RAW_CSV))
    assert set(m) == {"scores", "softmax", "pv"}
    assert m["pv"]["dram__bytes_write.sum"] == 16_777_216
    r = Results(H100, env=ENV)
    assert tr.add_rows(r, m, _meta()) == 8  # 3 passes x 2 metrics + 2 totals
    meta = _meta()
    scores_write = [row for row in r.rows if row["params"]["pass"] == "scores" and row["metric"] == "dram_write_bytes"]
    assert len(scores_write) == 1
    row = scores_write[0]
    assert row["benchmark"] == "ch01_traffic" and row["peer"] == "count"
    assert row["ours"] == 1_073_741_824 and row["peer_value"] == meta["counts"]["scores"]["write"]
    assert row["ratio"] == pytest.approx(meta["counts"]["scores"]["write"] / 1_073_741_824)
    total_read = [row for row in r.rows if row["params"]["pass"] == "total" and row["metric"] == "dram_read_bytes"]
    assert total_read[0]["ours"] == 17_039_360 + 1_073_741_824 + 545_259_520
    assert total_read[0]["peer_value"] == sum(c["read"] for c in meta["counts"].values())


def test_traffic_incomplete_csv_records_only_what_was_measured():
    from bench import ch01_traffic as tr

    r = Results(H100, env=ENV)
    n = tr.add_rows(r, tr.measured_by_pass(tr.parse_ncu_csv(DETAILS_CSV)), _meta())
    assert n == 5 + 1  # pv's write is missing: no total for writes, the reads' total is there
    assert not [row for row in r.rows if row["params"]["pass"] == "pv" and row["metric"] == "dram_write_bytes"]


def test_traffic_cli_parse_merges_into_results(tmp_path):
    from bench import ch01_traffic as tr

    existing = make()
    existing.add("ch01_naive_attention", {"seq_len": 512}, "time_ms", 1.0, "sdpa_math", 2.0)
    existing.save(tmp_path)
    csv_path, meta_path = tmp_path / "ncu.csv", tmp_path / "meta.json"
    csv_path.write_text(RAW_CSV)
    meta_path.write_text(json.dumps(_meta()))
    assert tr.main(["--parse", str(csv_path), "--meta", str(meta_path), "--out", str(tmp_path)]) == 0
    data = mr.load_results("nvidia-h100-80gb-hbm3", tmp_path)
    assert len(mr.rows(data, "ch01_traffic")) == 8
    assert len(mr.rows(data, "ch01_naive_attention")) == 1  # kept
    assert data["ceilings"] == {"copy_TBps": 3.0, "bf16_matmul_TFLOPs": 800.0}  # kept
    # nothing parsable, or no meta: nothing recorded, non-zero exit
    bad = tmp_path / "bad.csv"
    bad.write_text("==ERROR== ERR_NVGPUCTRPERM\n")
    assert tr.main(["--parse", str(bad), "--meta", str(meta_path), "--out", str(tmp_path)]) == 1
    assert tr.main(["--parse", str(csv_path), "--meta", str(tmp_path / "none.json"), "--out", str(tmp_path)]) == 1
    assert len(mr.rows(mr.load_results("nvidia-h100-80gb-hbm3", tmp_path), "ch01_traffic")) == 8


def test_traffic_ncu_command():
    from bench import ch01_traffic as tr

    cmd = tr.ncu_command("/opt/ncu", "/usr/bin/python3", "/tmp/meta.json")
    assert cmd[0] == "/opt/ncu"
    joined = " ".join(cmd)
    for flag in ("--csv", "--print-units base", "--clock-control none", "--target-processes all",
                 "--metrics dram__bytes_read.sum,dram__bytes_write.sum",
                 "--kernel-name regex:_scores_kernel|_softmax_kernel|_pv_kernel"):
        assert flag in joined
    assert cmd[-6:] == ["/usr/bin/python3", "-m", "bench.ch01_traffic", "--target", "--meta", "/tmp/meta.json"]


def test_traffic_run_without_ncu_records_nothing(monkeypatch, capsys):
    from bench import ch01_traffic as tr

    monkeypatch.setattr(tr, "ncu_path", lambda: None)
    r = Results(H100, env=ENV)
    tr.run(r, None)
    assert r.rows == []
    assert "ncu not found" in capsys.readouterr().out


def test_unit_conversion():
    from bench import ch01_traffic as tr

    assert tr.to_number("1,024", "byte") == 1024
    assert tr.to_number("2", "Kbyte") == 2000
    assert tr.to_number("1", "MiB") == 2 ** 20
    with pytest.raises(ValueError):
        tr.to_number("1", "furlong")
    with pytest.raises(ValueError):
        tr.to_number("n/a", "byte")
    assert math.isclose(tr.to_number("1.5", "Gbyte"), 1.5e9)


def test_ch01_sweep_rows_and_oom_stop(monkeypatch):
    """The sweep's bookkeeping on the CPU, with the GPU parts replaced: our kernel 'runs out of
    memory' from N=64 on, the math backend from N=128 on; the sweep must record both, keep the
    flash peer's rows, and stop after the first N where both are out of memory."""
    import torch
    import torch.nn.functional as F

    from bench import ch01_naive_attention as ch01

    calls = []

    def fake_measure(fn, warmup=0, rep=0):
        out = fn()
        return {"ms": 2.0, "peak_bytes": 1000, "out": out[0] if isinstance(out, tuple) else out}

    def fake_naive(q, k, v, causal=False):
        calls.append(("ours", q.shape[2]))
        if q.shape[2] >= 64:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal), None

    class FakeF:
        @staticmethod
        def scaled_dot_product_attention(q, k, v, is_causal=False):
            calls.append(("peer", q.shape[2]))
            if q.shape[2] >= 128 and torch.backends.cuda.math_sdp_enabled() and \
                    not torch.backends.cuda.flash_sdp_enabled():
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    monkeypatch.setattr(ch01, "measure", fake_measure)
    monkeypatch.setattr(ch01, "naive_attention", fake_naive)
    monkeypatch.setattr(ch01, "F", FakeF)
    monkeypatch.setattr(ch01, "run_passes", lambda q, k, v, causal: {"scores": 1.0, "softmax": 0.5, "pv": 0.25})

    r = make()
    ch01.sweep(r, torch.device("cpu"), head_dims=(16,), causals=(True,), seq_lens=(32, 64, 128, 256))
    # 256 was never tried: both ran out of memory at 128
    assert max(n for _, n in calls) == 128
    data = r.to_dict()
    oom = {row["params"]["seq_len"]: (row["ours"], row["peer_value"]) for row in mr.rows(data, metric="oom")}
    assert oom == {32: (False, False), 64: (True, False), 128: (True, True)}

    t32 = {row["peer"]: row for row in mr.rows(data, metric="time_ms", seq_len=32)}
    assert set(t32) == {"sdpa_math", "sdpa_flash"}
    assert t32["sdpa_math"]["ratio"] == pytest.approx(1.0)
    assert t32["sdpa_math"]["params"] == {"batch": 1, "heads": 16, "seq_len": 32, "head_dim": 16,
                                          "causal": True, "dtype": "bfloat16"}
    t64 = {row["peer"]: row for row in mr.rows(data, metric="time_ms", seq_len=64)}
    assert t64["sdpa_math"]["ours"] is None and t64["sdpa_math"]["peer_value"] == 2.0
    assert t64["sdpa_math"]["ratio"] is None
    t128 = {row["peer"]: row for row in mr.rows(data, metric="time_ms", seq_len=128)}
    assert set(t128) == {"sdpa_flash"}  # nothing to compare with math: both out of memory

    flops = C.nominal_attention_flops(1, 16, 32, 32, 16, True)
    counted = C.per_array_bytes(C.naive_attention_traffic(1, 16, 16, 32, 32, 16, 2))
    tf = mr.rows(data, metric="TFLOPs", seq_len=32)[0]
    assert tf["ours"] == pytest.approx(flops / 2e-3 / 1e12)
    assert tf["fraction_of_ceiling"] == pytest.approx(tf["ours"] / 800.0)
    bw = mr.rows(data, metric="bandwidth_TBps", seq_len=32)[0]
    assert bw["ours"] == pytest.approx(sum(counted.values()) / 2e-3 / 1e12)
    assert bw["fraction_of_ceiling"] == pytest.approx(bw["ours"] / 3.0)
    err = mr.rows(data, metric="rel_err", seq_len=32)[0]
    assert err["peer"] == "sdpa_math" and 0 <= err["ours"] < 2e-2  # bf16 inputs, fp32 "ours"
    passes = mr.rows(data, metric="pass_bandwidth_TBps", seq_len=32)
    assert [row["params"]["pass"] for row in passes] == ["scores", "softmax", "pv"]
    assert passes[1]["ours"] == pytest.approx(counted["softmax"] / 0.5e-3 / 1e12)
    assert mr.rows(data, metric="pass_time_ms", seq_len=64) == []  # ours out of memory: no passes
    assert r.status[ch01.BENCHMARK] == "complete"
    assert "OOM/—" in ch01.summary(r)


def test_traffic_run_orchestrates_ncu(monkeypatch, tmp_path, capsys):
    """run() with a stand-in for ncu (a script that writes the meta file the real target would
    and prints a CSV): the subprocess, the artifact copies and the parsing, without a GPU."""
    from bench import ch01_traffic as tr

    meta = _meta()
    fake = tmp_path / "ncu"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        "args = sys.argv[1:]\n"
        "assert '--csv' in args and args[args.index('--target-processes') + 1] == 'all'\n"
        f"json.dump(json.loads({json.dumps(meta)!r}), open(args[args.index('--meta') + 1], 'w'))\n"
        "print('==PROF== Connected to process 1')\n"
        f"sys.stdout.write({RAW_CSV!r})\n")
    fake.chmod(0o755)
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    monkeypatch.setattr(tr, "ncu_path", lambda: str(fake))
    monkeypatch.setenv("MINILLM_ARTIFACTS", str(artifacts))
    r = Results(H100, env=ENV)
    tr.run(r, None)
    assert "recorded 8 rows" in capsys.readouterr().out
    assert len(r.rows) == 8
    table = tr.summary(r).splitlines()
    assert len(table) == 9 and "scores" in table[1] and "1073741824" in table[2]
    assert sorted(p.name for p in artifacts.iterdir()) == [
        "ch01_traffic_meta.json", "ch01_traffic_ncu.csv", "ch01_traffic_ncu.stderr"]

    # a failing ncu: nothing recorded, the reason printed
    fake.write_text("#!/bin/sh\necho '==ERROR== ERR_NVGPUCTRPERM - no permission' \nexit 1\n")
    r = Results(H100, env=ENV)
    tr.run(r, None)
    out = capsys.readouterr().out
    assert r.rows == [] and "ncu failed (exit 1)" in out and "ERR_NVGPUCTRPERM" in out


def test_time_budget_marks_the_benchmark_partial_once(capsys):
    results = Results("dry run", ceilings={}, env={})
    assert not common.TimeBudget(results, "bench_x", 3600).spent()
    assert "bench_x" not in results.status
    budget = common.TimeBudget(results, "bench_x", 0)
    budget.start -= 1.0  # one second ago: the budget of 0 s is spent
    assert budget.spent() and budget.spent()
    assert results.status["bench_x"] == "partial: time budget 0 s spent"
    assert capsys.readouterr().out.count("time budget of 0 s spent") == 1


def test_rel_err():
    import torch

    ref = torch.tensor([3.0, 4.0])
    assert common.rel_err(ref, ref) == 0.0
    assert common.rel_err(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
