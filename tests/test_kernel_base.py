"""`minillm.kernels.base`: a cached launch must compute what Triton's own launch computes,
for every specialization Triton makes (pointer alignment, integers equal to 1 or divisible
by 16, constexpr defaults), and under CUDA-graph capture. And the helpers every chapter
shares: the host-side checks and sizes, the head-dim offsets, and the online-softmax update
(tile by tile, masked and unmasked, it must give NumPy's softmax statistics)."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from minillm.kernels.base import (
    CPU_NUM_SMS, DIRECT_LAUNCH_VERSIONS, LN2, LOG2E, TRITON_VERSION, block_d, clear_launch_cache, device_capability,
    direct_plan, dot_precision, expanded_arguments, head_dim_offsets, launch, launch_cache, num_sms,
    online_softmax_update, power_of_2_at_least, record_call, recording, scale_and_window,
)
import minillm.kernels.base as kernel_base


@triton.jit
def _axpy_kernel(X, Y, Out, n, alpha, stride_x, BLOCK: tl.constexpr, SQUARE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(X + offs * stride_x, mask=ok)
    if SQUARE:
        x = x * x
    tl.store(Out + offs, alpha * x + tl.load(Y + offs, mask=ok), mask=ok)


def _axpy(x, y, alpha, square=False, via=launch):
    n = y.numel()
    out = torch.empty_like(y)
    block = 64
    extra = {"SQUARE": True} if square else {}
    via(_axpy_kernel, (triton.cdiv(n, block),), x, y, out, n, alpha, x.stride(0), BLOCK=block, **extra)
    return out


def _jit(kernel, grid, *args, **meta):
    return kernel[grid](*args, **meta)


def _reference(x, y, alpha, square=False):
    return alpha * (x * x if square else x) + y


@pytest.mark.parametrize("n", [1, 16, 37, 130])
@pytest.mark.parametrize("square", [False, True])
def test_launch_matches_reference(n, square, device, gen):
    x = torch.randn(2 * n + 1, generator=gen).to(device)
    y = torch.randn(n, generator=gen).to(device)
    for xs in (x[:n], x[1:n + 1], x[::2][:n]):  # aligned, misaligned by 4 bytes, stride 2
        for _ in range(2):  # the second call of each signature takes the cached path on a GPU
            torch.testing.assert_close(_axpy(xs, y, 0.5, square), _reference(xs, y, 0.5, square))


@pytest.mark.gpu
def test_cache_hits_reuse_one_binary_per_specialization():
    clear_launch_cache()
    x = torch.randn(65, device="cuda")
    y = torch.randn(64, device="cuda")
    _axpy(x[:64], y, 2.0)
    assert len(launch_cache()) == 1
    (binary, constexprs, _), = launch_cache().values()
    assert constexprs == (64, False)  # BLOCK from the call, SQUARE from its default
    _axpy(x[:64], y, 2.0)
    assert len(launch_cache()) == 1  # a hit
    out = _axpy(x[1:], y, 2.0)  # misaligned: Triton compiles another binary; so must the cache key differ
    assert len(launch_cache()) == 2
    torch.testing.assert_close(out, _reference(x[1:], y, 2.0))
    b1 = launch(_axpy_kernel, (1,), x, y, torch.empty_like(y), 1, 1.0, 1, BLOCK=64)
    b16 = launch(_axpy_kernel, (1,), x, y, torch.empty_like(y), 16, 1.0, 1, BLOCK=64)
    assert b1 is not b16  # n == 1 is a specialization of its own
    jit_binary = _jit(_axpy_kernel, (1,), x, y, torch.empty_like(y), 16, 1.0, 1, BLOCK=64)
    assert jit_binary is b16  # the binary Triton itself picks


@pytest.mark.gpu
def test_cached_launch_in_a_cuda_graph():
    x = torch.randn(100, device="cuda")
    y = torch.randn(100, device="cuda")
    out = torch.empty_like(y)
    args = (x, y, out, 100, 3.0, 1)
    launch(_axpy_kernel, (2,), *args, BLOCK=64)  # compile and cache outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(_axpy_kernel, (2,), *args, BLOCK=64)
    out.zero_()
    x.copy_(torch.randn(100, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, _reference(x, y, 3.0))


def test_expanded_arguments_put_each_descriptor_s_values_in_its_place():
    args = ("x", "desc_a", 3, "desc_b", 0.5)
    expand = lambda desc, meta: [f"{desc}:{meta}", 8, 1]  # noqa: E731  (map, shape, stride)
    assert expanded_arguments(args, ((1, "m1"), (3, "m2")), expand) == [
        "x", "desc_a:m1", 8, 1, 3, "desc_b:m2", 8, 1, 0.5]
    assert expanded_arguments(args, ((0, None),), expand) == ["x:None", 8, 1, "desc_a", 3, "desc_b", 0.5]
    assert expanded_arguments(args, ()) is args


class CudaLauncher:
    """A stand-in for Triton 3.6's launcher object (the class name `direct_plan` checks)."""

    def __init__(self, launch, scratch: int = 0):
        self.launch, self.global_scratch_size, self.profile_scratch_size = launch, scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True


class _Binary:
    def __init__(self, run):
        self.run = run


def _descriptor_wrapper(launcher, tensordesc_indices, tensordesc_meta):
    """Shaped as Triton 3.6's wrapper around the C function (`wrap_handle_tensordesc`'s ``inner``)."""
    def inner(*args):
        return launcher, tensordesc_indices, tensordesc_meta
    return inner


def test_direct_plan_reads_the_known_launcher_and_refuses_the_rest(monkeypatch):
    monkeypatch.setattr(kernel_base, "DIRECT_LAUNCH_VERSIONS", (TRITON_VERSION,))
    c_function = len  # any builtin stands for the compiled C launch function
    assert direct_plan(_Binary(CudaLauncher(c_function))) == (c_function, False, True, ())
    wrapped = _descriptor_wrapper(c_function, {4, 1}, [{"box": 1}, {"box": 4}])
    assert direct_plan(_Binary(CudaLauncher(wrapped))) == (
        c_function, False, True, ((1, {"box": 1}), (4, {"box": 4})))  # positions ascending, metadata in order
    assert direct_plan(_Binary(CudaLauncher(c_function, scratch=128))) is None  # scratch to allocate
    assert direct_plan(_Binary(CudaLauncher(lambda *args: None))) is None  # a wrapper of another shape
    assert direct_plan(_Binary(CudaLauncher(_descriptor_wrapper(c_function, {1}, [])))) is None
    monkeypatch.setattr(kernel_base, "DIRECT_LAUNCH_VERSIONS", ())
    assert direct_plan(_Binary(CudaLauncher(c_function))) is None  # a Triton whose launcher is not known


@triton.jit
def _copy_rows_kernel(src_desc, Out, ROWS: tl.constexpr, COLS: tl.constexpr):
    row0 = tl.program_id(0) * ROWS
    tile = src_desc.load([row0, 0])
    rows = row0 + tl.arange(0, ROWS)[:, None]
    tl.store(Out + rows * COLS + tl.arange(0, COLS)[None, :], tile)


def _known_launcher() -> bool:
    return TRITON_VERSION in DIRECT_LAUNCH_VERSIONS


@pytest.mark.gpu
def test_hits_call_the_c_launcher_directly_where_the_wrapper_is_known():
    clear_launch_cache()
    x, y = torch.randn(64, device="cuda"), torch.randn(64, device="cuda")
    _axpy(x, y, 2.0)
    (_, _, plan), = launch_cache().values()
    assert (plan is not None) == _known_launcher()
    if plan is not None:
        assert plan[3] == ()  # no descriptors: nothing to expand
    for _ in range(2):  # the hits take the plan
        torch.testing.assert_close(_axpy(x, y, 2.0), _reference(x, y, 2.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="host tensor descriptors need TMA (sm_90 or newer)")
def test_a_descriptor_kernel_s_hits_expand_the_descriptor_per_call():
    from triton.tools.tensor_descriptor import TensorDescriptor

    clear_launch_cache()
    rows, cols = 16, 32
    for n in (64, 64, 128, 64):  # a miss, a hit, a new shape (same key: the box), the first again
        src = torch.randn(n, cols, device="cuda")
        out = torch.empty_like(src)
        launch(_copy_rows_kernel, (n // rows,), TensorDescriptor.from_tensor(src, [rows, cols]), out,
               ROWS=rows, COLS=cols)
        torch.testing.assert_close(out, src)  # the descriptor's address and shape are this call's
    (_, _, plan), = launch_cache().values()
    if _known_launcher():
        assert plan is not None and [position for position, _ in plan[3]] == [0]


# ----------------------------------------------------------------------------------------
# Recording launches and replaying them with other tensors (Chapter 10's eager layers)
# ----------------------------------------------------------------------------------------
def _chain(x, y, out, w):
    """Two launches and a recorded torch call: ``out = w · (0.5·x + y)²``-ish, through a
    buffer."""
    mid = torch.empty_like(y)
    launch(_axpy_kernel, (triton.cdiv(y.numel(), 64),), x, y, mid, y.numel(), 0.5, 1, BLOCK=64)
    launch(_axpy_kernel, (triton.cdiv(y.numel(), 64),), mid, y, out, y.numel(), 2.0, 1, BLOCK=64, SQUARE=True)
    record_call(_mul_into, out, w, out)


def _mul_into(a, b, out):
    return torch.mul(a, b, out=out)


@pytest.mark.parametrize("n", [1, 37, 130])
def test_a_recording_replays_with_swapped_tensors(n, device, gen):
    x, y, w = (torch.randn(n, generator=gen).to(device) for _ in range(3))
    out = torch.empty_like(y)
    with recording() as rec:
        _chain(x, y, out, w)
    assert rec.reason is None and len(rec.calls) == 3
    torch.testing.assert_close(out, w * (2.0 * (0.5 * x + y) ** 2 + y))
    assert rec.bind([x, w])
    for _ in range(2):  # other inputs, other weights; the same buffers and output
        x2, w2 = torch.randn(n, generator=gen).to(device), torch.randn(n, generator=gen).to(device)
        out.zero_()
        rec.replay([x2, w2])
        torch.testing.assert_close(out, w2 * (2.0 * (0.5 * x2 + y) ** 2 + y))


def test_a_recording_refuses_what_it_cannot_replay(device, gen):
    x, y, w = (torch.randn(64, generator=gen).to(device) for _ in range(3))
    out = torch.empty_like(y)
    with recording() as rec:
        _chain(x, y, out, w)
        out.add_(1.0)  # device work outside a launch: a replay would leave it out
    assert rec.reason is not None and "add" in rec.reason
    assert not rec.bind([x])
    with pytest.raises(RuntimeError, match="bind"):
        rec.replay([x])
    big = torch.randn(128, generator=gen).to(device)
    with recording() as rec:
        _chain(big[32:96], y, out, w)  # an argument inside a tensor to substitute, not at its start
    assert rec.reason is None and not rec.bind([big, w]) and "inside" in rec.reason
    with recording() as rec, pytest.raises(RuntimeError, match="nest"):
        with recording():
            pass


# ----------------------------------------------------------------------------------------
# The shared helpers
# ----------------------------------------------------------------------------------------
def test_host_helpers():
    assert LOG2E * LN2 == pytest.approx(1.0) and LOG2E == pytest.approx(1 / math.log(2))
    assert [block_d(d) for d in (1, 16, 17, 64, 100, 128, 256)] == [16, 16, 32, 64, 128, 128, 256]
    assert dot_precision(torch.float32) == "ieee" and dot_precision(torch.float16) == "tf32"
    assert scale_and_window(64, None, None) == (0.125, None)
    assert scale_and_window(64, 2, 5) == (2.0, 5)
    for bad in ((0.0, None), (-1.0, None), (None, 0)):
        with pytest.raises(ValueError):
            scale_and_window(64, *bad)
    assert num_sms("cpu") == num_sms(torch.device("cpu")) == CPU_NUM_SMS
    if torch.cuda.is_available():
        assert num_sms("cuda:0") == torch.cuda.get_device_properties(0).multi_processor_count
        assert device_capability(torch.device("cuda:0")) == torch.cuda.get_device_capability(0)
    # The launchers' plain-Python power of two is Triton's, from 0 up (and past 2^31: head counts
    # are small, but a table's capacity need not be).
    ns = [*range(0, 2050), 2**31 - 1, 2**31, 2**31 + 1, 3 * 2**40]
    assert [power_of_2_at_least(n) for n in ns] == [triton.next_power_of_2(n) for n in ns]


@triton.jit
def _online_softmax_kernel(S, Visible, P, Alpha, L, M, n_tiles, qk_scale,
                           ROWS: tl.constexpr, COLS: tl.constexpr, MASKED: tl.constexpr):
    """Fold ``n_tiles`` tiles ``S[t]: [ROWS, COLS]`` into the statistics; store each tile's
    ``p`` and ``alpha`` and the final ``l``, ``m``."""
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    tile = rows[:, None] * COLS + cols[None, :]
    m = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((ROWS,), dtype=tl.float32)
    for t in range(0, n_tiles):
        s = tl.load(S + t * ROWS * COLS + tile)
        if MASKED:
            s = tl.where(tl.load(Visible + t * ROWS * COLS + tile) != 0, s * qk_scale, float("-inf"))
        p, alpha, l, m = online_softmax_update(m, l, s, qk_scale, MASKED)
        tl.store(P + t * ROWS * COLS + tile, p)
        tl.store(Alpha + t * ROWS + rows, alpha)
    tl.store(L + rows, l)
    tl.store(M + rows, m)


@pytest.mark.parametrize("masked", [False, True])
def test_online_softmax_update(masked, device, gen):
    """Over 3 tiles the update gives the running max (log2 units), the sum of 2^(x - m), and
    the weights p of each tile against the max so far; alpha rescales the earlier ones. With
    the mask: an invisible pair weighs 0, and a row that sees nothing (here row 0, in every
    tile; row 1 in the first tile only) stays at m = -inf, l = 0, with no NaN."""
    rows, cols, tiles, scale = 16, 16, 3, 0.3
    s = torch.randn(tiles, rows, cols, generator=gen, dtype=torch.float32) * 4
    visible = torch.rand(tiles, rows, cols, generator=gen) < 0.7 if masked else torch.ones(tiles, rows, cols, dtype=torch.bool)
    if masked:
        visible[:, 0] = False
        visible[0, 1] = False
    out = [torch.empty(tiles, rows, cols), torch.empty(tiles, rows), torch.empty(rows), torch.empty(rows)]
    out = [t.to(device) for t in out]
    _online_softmax_kernel[(1,)](s.to(device), visible.to(torch.int32).to(device), *out, tiles, scale * LOG2E,
                                 ROWS=rows, COLS=cols, MASKED=masked)
    p, alpha, l, m = (t.cpu().numpy().astype(np.float64) for t in out)

    x = np.where(visible.numpy(), s.numpy().astype(np.float64) * scale * LOG2E, -np.inf)  # log2 units
    m_ref = np.full(rows, -np.inf)
    for t in range(tiles):
        m_new = np.maximum(m_ref, x[t].max(axis=1))
        m_sub = np.where(np.isinf(m_new), 0.0, m_new)
        np.testing.assert_allclose(p[t], np.exp2(x[t] - m_sub[:, None]), rtol=1e-5, atol=1e-30)
        np.testing.assert_allclose(alpha[t], np.exp2(m_ref - m_sub), rtol=1e-5, atol=1e-30)
        m_ref = m_new
    np.testing.assert_allclose(m, m_ref, rtol=1e-6)
    seen = ~np.isinf(m_ref)
    l_ref = np.where(seen, np.exp2(x - np.where(seen, m_ref, 0.0)[None, :, None]).sum(axis=(0, 2)), 0.0)
    np.testing.assert_allclose(l, l_ref, rtol=1e-5)
    assert not np.isnan(p).any() and not np.isnan(alpha).any() and not np.isnan(l).any()
    if masked:
        assert m[0] == -np.inf and l[0] == 0.0 and alpha[0, 1] == 0.0  # row 1 sees nothing in tile 0


@triton.jit
def _offsets_kernel(Offs, Ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    offs, d_ok = head_dim_offsets(HEAD_DIM, BLOCK_D)
    cols = tl.arange(0, BLOCK_D)
    tl.store(Offs + cols, offs)
    tl.store(Ok + cols[None, :], d_ok.to(tl.int32))


@pytest.mark.parametrize("head_dim", [16, 20, 64, 100])
def test_head_dim_offsets(head_dim, device):
    """The real columns as they are, the padding ones masked and clamped onto the last real one."""
    bd = block_d(head_dim)
    offs = torch.empty(bd, dtype=torch.int32, device=device)
    ok = torch.empty(bd, dtype=torch.int32, device=device)
    _offsets_kernel[(1,)](offs, ok, HEAD_DIM=head_dim, BLOCK_D=bd)
    cols = torch.arange(bd)
    assert offs.cpu().tolist() == torch.clamp(cols, max=head_dim - 1).tolist()
    assert ok.cpu().tolist() == (cols < head_dim).int().tolist()


# --- the interpreter switch, in a plain process (no conftest) ----------------------------------------

def _plain_python(code: str, cwd) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that inherits nothing of pytest's set-up (no TRITON_INTERPRET)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter switch only acts without a GPU")
def test_kernels_run_in_a_plain_process_without_a_gpu(tmp_path):
    """Importing a chapter's kernels is enough: the base decides on the interpreter before
    Triton is imported (a student's script or a notebook needs no set-up of its own)."""
    proc = _plain_python("import torch\n"
                         "from minillm.kernels.ch03_online_softmax import online_softmax\n"
                         "out, lse = online_softmax(torch.randn(3, 100))\n"
                         "assert torch.allclose(out.sum(-1), torch.ones(3)), out.sum(-1)\n"
                         "from solutions.ch01 import row_softmax\n"
                         "assert torch.allclose(row_softmax(torch.randn(2, 37)).sum(-1), torch.ones(2))\n", tmp_path)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter switch only acts without a GPU")
def test_triton_imported_first_gets_a_clear_warning(tmp_path):
    proc = _plain_python("import warnings, triton\n"
                         "with warnings.catch_warnings(record=True) as w:\n"
                         "    warnings.simplefilter('always')\n"
                         "    import minillm.kernels.base\n"
                         "assert any('imported before minillm' in str(x.message) for x in w), [str(x.message) for x in w]\n",
                         tmp_path)
    assert proc.returncode == 0, proc.stderr
