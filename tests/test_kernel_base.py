"""`minillm.kernels.base`: a cached launch must compute what Triton's own launch computes,
for every specialization Triton makes (pointer alignment, integers equal to 1 or divisible
by 16, constexpr defaults), and under CUDA-graph capture."""
import pytest
import torch
import triton
import triton.language as tl

from minillm.kernels import base as launch_mod
from minillm.kernels.base import launch


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
    launch_mod._BINARIES.clear()
    x = torch.randn(65, device="cuda")
    y = torch.randn(64, device="cuda")
    _axpy(x[:64], y, 2.0)
    assert len(launch_mod._BINARIES) == 1
    (binary, constexprs), = launch_mod._BINARIES.values()
    assert constexprs == (64, False)  # BLOCK from the call, SQUARE from its default
    _axpy(x[:64], y, 2.0)
    assert len(launch_mod._BINARIES) == 1  # a hit
    out = _axpy(x[1:], y, 2.0)  # misaligned: Triton compiles another binary; so must the cache key differ
    assert len(launch_mod._BINARIES) == 2
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
