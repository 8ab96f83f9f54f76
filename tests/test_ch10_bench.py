"""Chapter 10's benchmark module on the CPU: it imports, its random model and decode batch
build, and its profiler labels wrap the model (both paths) without changing what it computes.
The timings themselves run on CUDA only (``make gpu``)."""
import torch

from bench import ch10_fused_decode as b
from minillm.model.fused import enable_fused_decode


def test_categories_by_kernel_name():
    assert b.categorize("_flat_gemm_kernel") == "gemm"
    assert b.categorize("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert b.categorize("_split_kernel") == "attention"
    assert b.categorize("_add_rmsnorm_kernel") == "norms"
    assert b.categorize("_rope_write_kv_kernel") == "rotary"
    assert b.categorize("_silu_mul_kernel") == "elementwise"
    assert b.categorize("reduce_kernel<ArgMaxOps<float>>") == "sampling"
    assert set(b.CATEGORIES) >= {"gemm", "attention", "norms", "rotary", "elementwise", "sampling", "other"}


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
