"""Chapter 12: the engine and the server on a DeepSeek (multi-head latent attention) checkpoint.

- **Serving.** What ``minillm serve --model PATH`` runs (`LLMEngine.from_pretrained` on the
  folder, `minillm.server.create_app`, uvicorn; here in a thread on 127.0.0.1): a greedy
  ``/v1/completions`` request with token-id prompts completes them with the tokens
  transformers' greedy ``generate`` gives on the same model.
- **Admission.** For a KV pool of a given size, the engine runs as many sequences at once as
  `minillm.costs` predicts (`mla_kv_block_bytes` against `kv_block_bytes` for an MHA Llama of
  the same width), so MLA admits more than MHA by the ratio of their bytes per token.
"""
from __future__ import annotations

import math
import shutil
from fractions import Fraction

import pytest
import torch

transformers = pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")

import minillm  # noqa: E402
from minillm.costs import (kv_block_bytes, mha_kv_bytes_per_token, mla_kv_block_bytes,  # noqa: E402
                           mla_kv_bytes_per_token)
from minillm.engine import LLM, EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from minillm.paged.block_manager import blocks_for  # noqa: E402
from minillm.testing import TINY_MLA_SIZES, serve_in_thread, tiny_mla_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP32 = 4  # the engine computes, and caches, in float32 on a CPU


# == serving ======================================================================================
@pytest.fixture(scope="module")
def served_checkpoint(tmp_path_factory):
    """A tiny DeepSeek-V3 checkpoint with the bundled model's tokenizer (``minillm serve`` needs
    a ``tokenizer.json``): its vocabulary is the tokenizer's, 4096 tokens."""
    vocab = 4096
    path = tmp_path_factory.mktemp("mla-served")
    hf = tiny_mla_model("v3", vocab_size=vocab, q_lora_rank=24)
    hf.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(minillm.BUNDLED_MODEL / name, path / name)
    return hf, path


def test_serve_greedy_completions_match_transformers(served_checkpoint):
    from tokenizers import Tokenizer

    hf, path = served_checkpoint
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == hf.config.vocab_size
    engine = LLMEngine.from_pretrained(path, EngineConfig(device="cpu", block_size=4, kv_cache_memory_mb=1,
                                                          cuda_graphs="off"))
    assert engine.model_config.is_mla and engine.cache.pool.shape[0] == 1  # one latent plane
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (7, 13)]
    new = 12
    pytest.importorskip("fastapi")     # the server (the GPU machine has no web stack)
    from minillm.server import create_app

    with serve_in_thread(create_app(engine), log_level="warning") as url:
        body = {"prompt": prompts, "max_tokens": new, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert (reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"]) == (20, 2 * new)
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for prompt, choice in zip(prompts, choices):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                                   pad_token_id=0)[0, len(prompt):].tolist()
        assert len(set(expected)) >= 3, "a degenerate model: the comparison would say little"
        # The response spells each completion token (logprobs.tokens) and the whole text.
        assert choice["logprobs"]["tokens"] == [tokenizer.decode([t], skip_special_tokens=False) for t in expected]
        assert choice["text"] == tokenizer.decode(expected)
        assert choice["finish_reason"] == "length"


# == admission ====================================================================================
BLOCK = 4
PROMPT, MAX_TOKENS = 6, 10   # a prompt of 2 blocks; its decode steps stay in them for 2 tokens
HEADS = TINY_MLA_SIZES["num_attention_heads"]
HEAD_DIM = TINY_MLA_SIZES["hidden_size"] // HEADS
LAYERS = TINY_MLA_SIZES["num_hidden_layers"]
LATENT = TINY_MLA_SIZES["kv_lora_rank"] + TINY_MLA_SIZES["qk_rope_head_dim"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{"mla": path, "mha": path}``: the tiny DeepSeek-V2 (no query compression) and a Llama of
    the same hidden size, heads, head width and layers, with full multi-head attention."""
    mla = tmp_path_factory.mktemp("mla")
    tiny_mla_model("v2", q_lora_rank=None).save_pretrained(mla)
    mha = tmp_path_factory.mktemp("mha")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=TINY_MLA_SIZES["vocab_size"], hidden_size=HEADS * HEAD_DIM,
                                      intermediate_size=TINY_MLA_SIZES["intermediate_size"], num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
                                      max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(mha)
    return {"mla": mla, "mha": mha}


def block_bytes(kind: str) -> int:
    """One block id of the pool, from `minillm.costs`."""
    if kind == "mla":
        return mla_kv_block_bytes(LAYERS, LATENT, BLOCK, FP32)
    return kv_block_bytes(LAYERS, HEADS, HEAD_DIM, BLOCK, FP32)


def token_bytes(kind: str) -> int:
    """KV-cache bytes per token, all layers: the chapter's per-token formulas."""
    if kind == "mla":
        rank, rope = TINY_MLA_SIZES["kv_lora_rank"], TINY_MLA_SIZES["qk_rope_head_dim"]
        return LAYERS * mla_kv_bytes_per_token(rank, rope, FP32)
    return LAYERS * mha_kv_bytes_per_token(HEADS, HEAD_DIM, FP32)


#: A pool that both models divide exactly into whole prompts' worth of blocks (43008 bytes:
#: 48 MLA blocks, 14 MHA blocks), so the admitted counts stand exactly in the bytes' ratio.
POOL = math.lcm(*(block_bytes(k) * blocks_for(PROMPT, BLOCK) for k in ("mla", "mha")))


def engine(path, **config) -> LLMEngine:
    return LLM(path, device="cpu", block_size=BLOCK, kv_cache_memory_mb=POOL / 2**20, enable_prefix_caching=False,
               cuda_graphs="off", **config).engine


def submit(eng: LLMEngine, count: int) -> None:
    gen = torch.Generator().manual_seed(7)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for _ in range(count):
        eng.add_request(torch.randint(0, TINY_MLA_SIZES["vocab_size"], (PROMPT,), generator=gen).tolist(), params)


def test_engine_admits_what_the_formula_predicts(checkpoints):
    """The scheduler reserves at admission only the blocks of the prompt (``allocate`` of the
    tokens it computes now; decode steps take more blocks as sequences grow, preempting when
    the pool runs out), so the number running at once is
    ``(pool_bytes // block_bytes) // blocks_for(prompt_len, block_size)``: the pool in blocks
    (`mla_kv_block_bytes` / `kv_block_bytes`) over a prompt's blocks. Submitting more requests
    than that, the first step admits exactly that many (the next in line waits for blocks); the
    second, a decode step inside the same blocks (prompt of 6, block of 4), preempts none and
    admits none. MLA admits more than MHA by the ratio of their KV bytes per token."""
    running = {}
    for kind, path in checkpoints.items():
        eng = engine(path)
        assert eng.block_bytes == block_bytes(kind)
        pool_blocks = POOL // block_bytes(kind)
        assert eng.manager.num_blocks == pool_blocks
        predicted = pool_blocks // blocks_for(PROMPT, BLOCK)
        submit(eng, predicted + 3)
        for step in range(2):
            eng.step()
            assert eng.scheduler.num_running_seqs == predicted, f"{kind}, step {step + 1}"
            assert len(eng.scheduler.waiting) == 3
            assert eng.scheduler.num_preemptions == 0
            assert eng.manager.num_free_blocks < blocks_for(PROMPT, BLOCK)  # why the next one waits
        assert all(r.num_computed == PROMPT + 1 for r in (req.seqs[0] for req in eng.scheduler.running))
        running[kind] = predicted
    assert (running["mla"], running["mha"]) == (24, 7)
    assert Fraction(running["mla"], running["mha"]) == Fraction(token_bytes("mha"), token_bytes("mla"))  # 24/7


def test_lifetime_bound_never_preempts(checkpoints):
    """Admitting on the prompt alone overcommits the pool: the sequences outgrow it as they
    decode, and the newest are preempted (recomputed later). Capping ``max_num_seqs`` at the
    pool's blocks over a whole sequence's (``blocks_for(prompt_len + max_tokens)``) runs the
    same workload with that many at once and no preemption; both give the same greedy tokens."""
    path = checkpoints["mla"]
    pool_blocks = POOL // block_bytes("mla")
    lifetime = pool_blocks // blocks_for(PROMPT + MAX_TOKENS, BLOCK)        # 48 // 4 = 12
    completions = []
    for cap, preempts in ((lifetime, False), (None, True)):
        eng = engine(path, **({} if cap is None else dict(max_num_seqs=cap, max_n=1)))
        submit(eng, 30)
        peak, done = 0, {}
        while eng.has_unfinished_requests():
            done.update((out.request_id, out.outputs[0].token_ids) for out in eng.step() if out.finished)
            peak = max(peak, eng.scheduler.num_running_seqs)
        assert (eng.scheduler.num_preemptions > 0) == preempts, cap
        assert peak == (lifetime if cap else pool_blocks // blocks_for(PROMPT, BLOCK))
        assert len(done) == 30 and all(len(tokens) == MAX_TOKENS for tokens in done.values())
        completions.append(sorted(done.values()))
    assert completions[0] == completions[1]  # recomputation after preemption changes no token
