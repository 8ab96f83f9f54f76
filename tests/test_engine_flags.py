"""The engine's defaults have one source, `EngineConfig`: the flags of ``minillm serve`` and
``minillm generate`` take their defaults from its fields, and ``minillm bench`` (and
``bench/ch09_engine.py``) hold an `EngineConfig` instead of repeating its fields."""
from __future__ import annotations

import dataclasses

import pytest

from minillm import cli
from minillm.engine.config import EngineConfig
from minillm.experiments import ch09_engine_benchmark as bench

FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
#: EngineConfig fields that are deliberately not flags (``generate --seed`` is the sampling seed).
NOT_FLAGS = {"max_n", "seed", "record_steps"}
COMMANDS = {"serve": ["serve"], "generate": ["generate", "hi"]}


def parse(argv):
    return cli.build_parser(argv).parse_args(argv)


def test_every_field_has_a_default_and_is_a_flag_or_deliberately_not():
    assert all(f.default is not dataclasses.MISSING for f in FIELDS.values())
    flagged = [name for name, _ in cli.ENGINE_FLAGS.values()]
    assert len(flagged) == len(set(flagged)) and set(flagged) <= FIELDS.keys()
    assert set(flagged) | NOT_FLAGS == FIELDS.keys(), "a new EngineConfig field: add a flag or list it in NOT_FLAGS"
    for options, (name, kwargs) in cli.ENGINE_FLAGS.items():
        assert "default" not in kwargs, f"{options[0]}: the default comes from EngineConfig.{name}"
        if kwargs.get("action") == "store_false":
            assert FIELDS[name].default is True, f"{options[0]} can only turn off a field that defaults to True"


@pytest.mark.parametrize("command", COMMANDS)
def test_flag_defaults_are_the_dataclass_defaults(command):
    args = parse(COMMANDS[command])
    for options, (name, _) in cli.ENGINE_FLAGS.items():
        assert getattr(args, name) == FIELDS[name].default, options[0]
    assert cli.engine_config(args) == EngineConfig()


@pytest.mark.parametrize("command", COMMANDS)
def test_each_flag_sets_its_field(command):
    argv = COMMANDS[command] + ["--device", "cpu", "--dtype", "bfloat16", "--num-blocks", "7", "--block-size", "8",
                                "--kv-cache-mb", "3", "--gpu-memory-utilization", "0.25", "--max-num-seqs", "20",
                                "--max-num-batched-tokens", "99", "--max-model-len", "77", "--no-prefix-caching",
                                "--attention-backend", "torch", "--cuda-graphs", "decode", "--kv-cache", "virtual"]
    got = cli.engine_config(parse(argv))
    want = EngineConfig(device="cpu", dtype="bfloat16", num_blocks=7, block_size=8, kv_cache_memory_mb=3.0,
                        gpu_memory_utilization=0.25, max_num_seqs=20, max_num_batched_tokens=99, max_model_len=77,
                        enable_prefix_caching=False, attention_backend="torch", cuda_graphs="decode",
                        kv_cache="virtual")
    assert got == want
    assert set(cli.engine_flag_values(parse(argv))) == FIELDS.keys() - NOT_FLAGS


def test_help_shows_the_dataclass_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in (f"tokens per KV block (default {EngineConfig.block_size})",
                 f"(default {EngineConfig.max_num_seqs})", f"(default {EngineConfig.max_num_batched_tokens})",
                 f"in MiB (default {EngineConfig.kv_cache_memory_mb})"):
        assert text in out, text


def test_bench_holds_an_engine_config():
    names = {f.name for f in dataclasses.fields(bench.BenchConfig)}
    assert "engine" in names and not names & (FIELDS.keys() - {"engine"}), names & FIELDS.keys()
    cfg = bench.BenchConfig()
    assert isinstance(cfg.engine, EngineConfig) and cfg.engine == bench.bench_engine_config()
    assert cfg.concurrency == cfg.engine.max_num_seqs == bench.BENCH_ENGINE_DEFAULTS["max_num_seqs"]
    # The bench changes only what BENCH_ENGINE_DEFAULTS says; everything else is EngineConfig's.
    changed = {k for k, f in FIELDS.items() if getattr(cfg.engine, k) != f.default}
    assert changed <= set(bench.BENCH_ENGINE_DEFAULTS) | {"max_n"}


def test_bench_flags_build_the_same_config():
    args = parse(["bench"])
    assert bench.BenchConfig.from_args(args) == bench.BenchConfig()
    for options, (name, _) in cli.ENGINE_FLAGS.items():
        if hasattr(args, name):
            assert getattr(args, name) == bench.BENCH_ENGINE_DEFAULTS.get(name, FIELDS[name].default), options[0]
    args = parse(["bench", "--concurrency", "4", "--block-size", "8", "--kv-cache-memory-mb", "32", "--cuda-graphs",
                  "off", "--no-prefix-caching"])
    engine = bench.BenchConfig.from_args(args).engine
    assert (engine.max_num_seqs, engine.max_n, engine.block_size, engine.kv_cache_memory_mb, engine.cuda_graphs,
            engine.enable_prefix_caching) == (4, 4, 8, 32.0, "off", False)


def test_gpu_benchmark_uses_the_bench_engine():
    ch09_engine = pytest.importorskip("bench.ch09_engine")
    assert ch09_engine.ENGINE == bench.bench_engine_config(ch09_engine.CONCURRENCY, device="cuda")
