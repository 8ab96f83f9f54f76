"""The schematic diagrams of `minillm.diagrams` draw on a headless (Agg) figure, quickly and
with the number of shapes their docstrings promise."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

from minillm import diagrams as D  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def count(ax, kind):
    return sum(isinstance(p, kind) for p in ax.patches)


def test_attention_passes():
    ax = D.draw_attention_passes(n=1024, d=64, heads=4)
    assert count(ax, Rectangle) == 6 and count(ax, FancyBboxPatch) == 3 and count(ax, FancyArrowPatch) == 8


@pytest.mark.parametrize("prompt, steps", [(6, 4), (1, 1), (3, 0)])
def test_kv_cache_growth(prompt, steps):
    ax = D.draw_kv_cache_growth(prompt, steps)
    assert count(ax, Rectangle) == prompt + sum(prompt + t for t in range(1, steps + 1))


def test_tile_classes():
    assert D.tile_classes(8, 8, 4, 4, causal=True) == [["masked", "skip"], ["full", "masked"]]
    assert D.tile_classes(2, 8, 4, 4, causal=True) == [["full", "masked"]]      # bottom-right aligned
    assert D.tile_classes(8, 8, 4, 4, causal=False) == [["full", "full"], ["full", "full"]]


@pytest.mark.parametrize("order, causal", [("fa1", False), ("fa2", False), ("fa2", True), ("fa1", True)])
def test_tiling_grid(order, causal):
    ax = D.draw_tiling_grid(3, 5, order=order, causal=causal)
    assert count(ax, Rectangle) == 15
    numbers = [t.get_text() for t in ax.texts if t.get_text().isdigit()]
    # FA1 visits every tile once, in one sequence; FA2 numbers each row's visible tiles from 0,
    # and with 3 Q blocks against 5 K/V blocks the causal mask is bottom-right aligned
    assert len(numbers) == (15 if order == "fa1" or not causal else 3 + 4 + 5)
    with pytest.raises(ValueError):
        D.draw_tiling_grid(order="fa3")


def test_block_table():
    tables, lengths = {"A": [4, 0], "B": [2]}, {"A": 7, "B": 3}
    ax = D.draw_block_table(tables, lengths, num_blocks=6, block_size=4)
    assert count(ax, Rectangle) == 6 + 2 * 3
    assert len(ax.lines) == 3


def test_copy_on_write():
    axes = D.draw_copy_on_write(block_size=4, prompt_len=6)
    assert len(axes) == 3
    assert [len(ax.lines) for ax in axes] == [2, 4, 4]
    assert "rc 2" in [t.get_text() for t in axes[1].texts]
    with pytest.raises(ValueError):
        D.draw_copy_on_write(block_size=4, prompt_len=8)


def test_split_tiles():
    assert D.split_tiles(1000, 4, 64) == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert D.split_tiles(100, 4, 64) == [(0, 64), (64, 100), (100, 100), (100, 100)]
    assert D.split_tiles(0, 2, 16) == [(0, 0), (0, 0)]


def test_split_merge():
    ax = D.draw_split_merge(seq_len=100, num_splits=4, block_n=64)
    assert count(ax, Rectangle) == 2                    # two non-empty splits
    assert count(ax, FancyBboxPatch) == 4 + 1           # four programs and the merge
    assert count(ax, FancyArrowPatch) == 2 + 4


def test_flat_gemm_tiles():
    ax = D.draw_flat_gemm_tiles(m=4, n_tiles=6, k_tiles=4, block_m=16, split_k=2)
    assert count(ax, Rectangle) == 6 * 4 + 2 * 4 + 6
    with pytest.raises(ValueError):
        D.draw_flat_gemm_tiles(k_tiles=2, split_k=3)
