"""Schematic diagrams of the book's algorithms, drawn with matplotlib.

Each chapter from 1 to 8 draws one picture of its algorithm from code: what a kernel reads
and writes, in which order it visits its tiles, where a block table points. The pictures
are schematic (a few blocks instead of thousands) but computed, not drawn by hand: the
tile classes, split bounds and table entries follow the same rules as the kernels.

Every function draws onto a matplotlib ``Axes`` (a new figure when ``ax`` is None),
returns that ``Axes``, needs no GPU and runs in milliseconds. Conventions: **blue** is data
read from memory, **orange** data written, **grey** skipped or unused; on-chip work is
drawn with rounded boxes, HBM tensors with square ones.

Functions:

- `draw_attention_passes`: Chapter 1's three kernels and their HBM traffic.
- `draw_kv_cache_growth`: Chapter 2's cache over prefill and decode steps.
- `draw_tiling_grid`: the tile grid of Chapters 3 and 4 in FlashAttention-1 or -2 order.
- `draw_block_table`: Chapter 5's logical-to-physical block mapping.
- `draw_copy_on_write`: Chapter 6's fork, shared blocks, reference counts and the copy.
- `draw_split_merge`: Chapter 7's split keys, partial results and merge.
- `draw_flat_gemm_tiles`: Chapter 8's flat GEMM tiles, padding and split-K.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

__all__ = [
    "draw_attention_passes", "draw_kv_cache_growth", "draw_tiling_grid", "tile_classes",
    "draw_block_table", "draw_copy_on_write", "draw_split_merge", "split_tiles",
    "draw_flat_gemm_tiles",
]

READ, WRITE, SKIP, CHIP = "#4c8bc6", "#f28e2b", "#d9d9d9", "#fbe7c6"
SEQ_COLORS = ("#4c8bc6", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948")


def _axes(ax, figsize):
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=figsize)
    return ax


def _box(ax, x, y, w, h, label=None, color="white", rounded=False, fontsize=9, **kw):
    """One rectangle (square corners: an HBM tensor; rounded: on-chip work) with a centred label."""
    from matplotlib.patches import FancyBboxPatch, Rectangle

    if rounded:
        patch = FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12", fc=color,
                               ec=kw.pop("ec", "k"), lw=kw.pop("lw", 1.0), **kw)
    else:
        patch = Rectangle((x, y), w, h, fc=color, ec=kw.pop("ec", "k"), lw=kw.pop("lw", 1.0), **kw)
    ax.add_patch(patch)
    if label is not None:
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=fontsize)
    return patch


def _arrow(ax, xy_from, xy_to, color="k", label=None, fontsize=8, **kw):
    from matplotlib.patches import FancyArrowPatch

    ax.add_patch(FancyArrowPatch(xy_from, xy_to, arrowstyle="-|>", mutation_scale=10, color=color,
                                 lw=kw.pop("lw", 1.2), shrinkA=2, shrinkB=2, **kw))
    if label:
        ax.text((xy_from[0] + xy_to[0]) / 2 + 0.08, (xy_from[1] + xy_to[1]) / 2, label, fontsize=fontsize,
                color=color, va="center")


def _finish(ax, xlim, ylim, title=None):
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.set_aspect("auto")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def _mib(nbytes):
    return f"{nbytes / 2**20:,.0f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:,.0f} KiB"


# --------------------------------------------------------------------------- Chapter 1


def draw_attention_passes(n: int = 4096, d: int = 128, heads: int = 16, elem_bytes: int = 2, ax=None):
    """Chapter 1: the three kernels of textbook attention and the HBM tensors between them.

    Top row: the kernels (scores, softmax, PV), on chip. Bottom row: the tensors in HBM,
    with their shapes and sizes for ``heads`` heads of one sequence of ``n`` tokens at head
    dimension ``d`` (inputs and output in ``elem_bytes`` per element, $S$ in fp32, $P$ in the
    input dtype). Blue arrows are reads, orange ones writes.

    Returns:
        The ``Axes``: 6 tensor boxes, 3 kernel boxes and 8 arrows (5 reads, 3 writes).
    """
    ax = _axes(ax, (11, 3.6))
    nd, nn = heads * n * d * elem_bytes, heads * n * n
    tensors = {"Q": (0.0, nd, "[N, d]"), "K": (1.3, nd, "[N, d]"), "S": (3.0, 4 * nn, "[N, N] fp32"),
               "P": (5.9, elem_bytes * nn, "[N, N]"), "V": (8.6, nd, "[N, d]"), "O": (9.9, nd, "[N, d]")}
    for name, (x, nbytes, shape) in tensors.items():
        big = name in "SP"
        _box(ax, x, 0.0, 2.2 if big else 1.0, 1.0, f"{name}\n{shape}\n{_mib(nbytes)}",
             color="#fde0dd" if big else "white", fontsize=8)
    kernels = {"1. scores\nS = scale·QKᵀ": 1.2, "2. softmax\nP = softmax(S)": 4.4, "3. output\nO = PV": 8.2}
    for label, x in kernels.items():
        _box(ax, x, 2.0, 1.9, 0.9, label, color=CHIP, rounded=True, fontsize=8)
    centre = {k: x + (1.1 if k in "SP" else 0.5) for k, (x, _, _) in tensors.items()}
    reads = [("Q", 1.6), ("K", 2.3), ("S", 4.9), ("P", 8.6), ("V", 9.4)]
    writes = [(2.9, "S"), (5.9, "P"), (9.9, "O")]
    for t, kx in reads:
        _arrow(ax, (centre[t], 1.0), (kx, 2.0), color=READ)
    for kx, t in writes:
        _arrow(ax, (kx, 2.0), (centre[t] + 0.3, 1.0), color=WRITE)
    total = sum(v[1] for v in tensors.values()) + 4 * nn + elem_bytes * nn   # S and P are read back once each
    ax.text(5.4, 3.35, f"N = {n}, d = {d}, {heads} heads: about {_mib(total)} of HBM traffic, "
            f"{(4 * nn + elem_bytes * nn) * 2 / total:.0%} of it S and P", ha="center", fontsize=9)
    ax.text(-0.1, 0.5, "HBM", rotation=90, va="center", ha="right", fontsize=9)
    ax.text(-0.1, 2.45, "on chip", rotation=90, va="center", ha="right", fontsize=9)
    return _finish(ax, (-0.4, 11.1), (-0.2, 3.6))


# --------------------------------------------------------------------------- Chapter 2


def draw_kv_cache_growth(prompt_len: int = 6, decode_steps: int = 4, ax=None):
    """Chapter 2: the KV cache of one sequence over a prefill and ``decode_steps`` decode steps.

    One row per forward pass, one column per position. Orange cells are the K/V the step
    computes and writes; blue cells are the K/V it reads back from the cache. Prefill
    writes ``prompt_len`` positions at once; each decode step writes one and reads all
    earlier ones.

    Returns:
        The ``Axes``, with one square per filled cell:
        ``prompt_len + sum(prompt_len + t for t in range(1, decode_steps + 1))``.
    """
    ax = _axes(ax, (9, 0.55 * (decode_steps + 1) + 1.2))
    width = prompt_len + decode_steps
    rows = [("prefill", 0, prompt_len)] + [(f"decode {t}", prompt_len + t - 1, 1) for t in range(1, decode_steps + 1)]
    for r, (name, start, new) in enumerate(rows):
        y = len(rows) - 1 - r
        for p in range(start):
            _box(ax, p, y, 0.92, 0.8, color=READ, lw=0.5)
        for p in range(start, start + new):
            _box(ax, p, y, 0.92, 0.8, color=WRITE, lw=0.5)
        ax.text(-0.3, y + 0.4, name, ha="right", va="center", fontsize=9)
        ax.text(width + 0.2, y + 0.4, f"computes K, V of {new} token{'s' if new > 1 else ''}, reads {start} from the cache",
                va="center", fontsize=8)
    for p in range(width):
        ax.text(p + 0.46, len(rows) + 0.05, str(p), ha="center", fontsize=7)
    ax.text(width / 2, len(rows) + 0.5, "position in the sequence", ha="center", fontsize=9)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=WRITE, label="computed and written this step"),
                       Patch(color=READ, label="read from the cache")], loc="upper left",
              bbox_to_anchor=(0.0, -0.02), ncol=2, fontsize=8, frameon=False)
    return _finish(ax, (-2.2, width + 6.5), (-0.3, len(rows) + 0.9))


# --------------------------------------------------------------------------- Chapters 3 and 4


def tile_classes(q_len: int, kv_len: int, block_m: int, block_n: int, causal: bool = True):
    """Classify every (Q block, K/V block) tile as ``"skip"``, ``"masked"`` or ``"full"``.

    The causal mask is bottom-right aligned, as in the kernels: query row ``r`` sits at
    position ``kv_len - q_len + r`` and sees keys up to that position.

    Returns:
        A list of rows (one per Q block) of class names (one per K/V block).
    """
    out = []
    for i in range(math.ceil(q_len / block_m)):
        first = kv_len - q_len + i * block_m
        last = kv_len - q_len + min((i + 1) * block_m, q_len) - 1
        row = []
        for j in range(math.ceil(kv_len / block_n)):
            k0, k1 = j * block_n, min((j + 1) * block_n, kv_len) - 1
            row.append("full" if not causal or k1 <= first else ("skip" if k0 > last else "masked"))
        out.append(row)
    return out


def draw_tiling_grid(n_q_blocks: int = 4, n_kv_blocks: int = 4, order: str = "fa1", causal: bool = False, ax=None):
    """The tile grid of tiled attention and the order in which it is visited.

    Rows are Q blocks $i$ (of $B_r$ queries), columns K/V blocks $j$ (of $B_c$ keys); each
    square is one $B_r \\times B_c$ score tile, numbered by the step at which it is computed.

    - ``order="fa1"`` (Chapter 3, FlashAttention-1): one program per (batch, head) walks
      every tile, **K/V outer, Q inner** (column by column); the running $O_i, \\ell_i, m_i$
      of each Q block go to HBM and back at every step.
    - ``order="fa2"`` (Chapter 4, FlashAttention-2): **one program per Q block** (one colour
      per row) walks its row left to right, its state in registers; the programs run in
      parallel, so the step numbers restart in every row.

    With ``causal=True`` (blocks of 4 queries and 4 keys, mask bottom-right aligned) tiles above the diagonal are skipped
    (grey, no number; FlashAttention-1 as in our Chapter 3 kernel still visits them) and
    the diagonal tiles are the only ones that build a mask (hatched).

    Returns:
        The ``Axes``, with one square per tile: ``n_q_blocks * n_kv_blocks`` of them.
    """
    if order not in ("fa1", "fa2"):
        raise ValueError(f"order must be 'fa1' or 'fa2', not {order!r}")
    ax = _axes(ax, (5.2, 4.6))
    classes = tile_classes(4 * n_q_blocks, 4 * n_kv_blocks, 4, 4, causal)   # blocks of 4 tokens
    step = {}
    if order == "fa1":
        for j in range(n_kv_blocks):
            for i in range(n_q_blocks):
                step[i, j] = len(step)
    else:
        for i in range(n_q_blocks):
            for j in range(n_kv_blocks):
                if classes[i][j] != "skip":
                    step[i, j] = j
    for i in range(n_q_blocks):
        for j in range(n_kv_blocks):
            cls = classes[i][j]
            skipped = cls == "skip" and order == "fa2"
            color = SKIP if skipped else (READ if order == "fa1" else SEQ_COLORS[i % len(SEQ_COLORS)])
            y = n_q_blocks - 1 - i
            _box(ax, j, y, 0.94, 0.94, color=color, alpha=1.0 if skipped else 0.55,
                 hatch="///" if cls == "masked" else None, lw=0.8)
            if (i, j) in step:
                ax.text(j + 0.47, y + 0.47, str(step[i, j]), ha="center", va="center", fontsize=9)
    for j in range(n_kv_blocks):
        ax.text(j + 0.47, n_q_blocks + 0.1, f"K,V{j}", ha="center", fontsize=8)
    for i in range(n_q_blocks):
        label = f"Q{i}" + ("  → program " + str(i) if order == "fa2" else "")
        ax.text(-0.1, n_q_blocks - 1 - i + 0.47, label, ha="right", va="center", fontsize=8)
    if order == "fa1":
        _arrow(ax, (-0.05, -0.25), (n_kv_blocks - 0.1, -0.25), label=None)
        ax.text(n_kv_blocks / 2, -0.6, "outer loop: K/V blocks; inner loop: Q blocks (down each column)",
                ha="center", fontsize=8)
        title = "FlashAttention-1 order: one program, K/V outer, Q inner"
    else:
        ax.text(n_kv_blocks / 2, -0.6, "each program loops over K/V blocks left to right; programs run in parallel",
                ha="center", fontsize=8)
        title = "FlashAttention-2 order: one program per Q block" + (", causal" if causal else "")
    return _finish(ax, (-2.3 if order == "fa2" else -0.8, n_kv_blocks + 0.2), (-0.9, n_q_blocks + 0.5), title)


# --------------------------------------------------------------------------- Chapters 5 and 6


def _tables_and_pool(ax, tables, lengths, num_blocks, block_size, refcounts=None, fresh=(), y_top=2.2):
    """Block tables (top) and the pool (bottom), with a line from each entry to its block."""
    owners = {}
    for s, (seq, table) in enumerate(tables.items()):
        for b in table:
            owners.setdefault(b, []).append(s)
    for b in range(num_blocks):
        who = owners.get(b, [])
        color = SEQ_COLORS[who[0] % len(SEQ_COLORS)] if len(who) == 1 else ("#bbbbbb" if who else "white")
        _box(ax, b, 0, 0.9, 0.7, color=color, alpha=0.6 if who else 1.0, ec="C3" if b in fresh else "k",
             lw=2.2 if b in fresh else 0.8)
        ax.text(b + 0.45, -0.25, str(b), ha="center", fontsize=8)
        if refcounts is not None:
            ax.text(b + 0.45, 0.35, f"rc {refcounts[b]}", ha="center", va="center", fontsize=7)
    ax.text(-0.2, 0.35, "pool", ha="right", va="center", fontsize=9)
    for s, (seq, table) in enumerate(tables.items()):
        y = y_top + 1.0 * s
        n = lengths[seq]
        ax.text(-0.2, y + 0.3, f"{seq}: {n} tok", ha="right", va="center", fontsize=9)
        for lb, b in enumerate(table):
            x = lb * 1.0
            filled = min(block_size, n - lb * block_size) / block_size
            _box(ax, x, y, 0.9, 0.6, color="white", lw=0.8)
            _box(ax, x, y, 0.9 * filled, 0.6, color=SEQ_COLORS[s % len(SEQ_COLORS)], alpha=0.6, lw=0)
            ax.text(x + 0.45, y + 0.3, str(b), ha="center", va="center", fontsize=8)
            ax.plot([x + 0.45, b + 0.45], [y, 0.7], color=SEQ_COLORS[s % len(SEQ_COLORS)], lw=0.8, alpha=0.8,
                    zorder=0.5)
    return y_top + 1.0 * len(tables)


def draw_block_table(tables: Mapping[str, Sequence[int]] | None = None,
                     lengths: Mapping[str, int] | None = None, num_blocks: int = 10, block_size: int = 4, ax=None):
    """Chapter 5: per-sequence block tables mapping logical blocks to physical blocks of a pool.

    Top: each sequence's table, one box per logical block, shaded as far as the block is
    filled, labelled with the physical block id it holds. Bottom: the pool, each block
    coloured by its owner (white: free). Token $p$ of a sequence with table $T$ sits in
    slot ``T[p // block_size] * block_size + p % block_size``.

    Returns:
        The ``Axes``: ``num_blocks`` pool boxes plus two boxes (outline and fill) per table entry.
    """
    if tables is None:
        tables, lengths = {"A": [6, 1, 8], "B": [3, 0], "C": [5]}, {"A": 10, "B": 7, "C": 2}
    if lengths is None:
        raise ValueError("lengths is required with tables")
    ax = _axes(ax, (9, 1.1 * len(tables) + 2.2))
    top = _tables_and_pool(ax, tables, lengths, num_blocks, block_size)
    ax.text(num_blocks / 2, top + 0.1, f"block tables (logical blocks, {block_size} tokens each) → "
            "physical blocks", ha="center", fontsize=9)
    return _finish(ax, (-1.8, num_blocks + 0.2), (-0.5, top + 0.5))


def draw_copy_on_write(block_size: int = 4, prompt_len: int = 6, axes=None):
    """Chapter 6: a fork, the shared blocks and their reference counts, and the copy on divergence.

    Three panels: (1) sequence A after a prompt of ``prompt_len`` tokens; (2) after
    ``fork(A, B)``: B's table is a copy of A's, every block's reference count ("rc") is 2,
    nothing is copied; (3) after B appends a token: its last block was shared and partly
    filled, so B gets a private copy (red edge) and the original's count drops to 1. Full
    blocks stay shared for good.

    Returns:
        The three ``Axes``.
    """
    n_blocks = math.ceil(prompt_len / block_size)
    if prompt_len % block_size == 0:
        raise ValueError("prompt_len must end inside a block for the copy to happen")
    num_blocks = n_blocks + 3
    if axes is None:
        import matplotlib.pyplot as plt

        _, axes = plt.subplots(1, 3, figsize=(13, 2.9))
    a = list(range(n_blocks))
    rc1 = [1 if b < n_blocks else 0 for b in range(num_blocks)]
    rc2 = [2 if b < n_blocks else 0 for b in range(num_blocks)]
    rc3 = [2 if b < n_blocks - 1 else (1 if b in (n_blocks - 1, n_blocks) else 0) for b in range(num_blocks)]
    states = [("1. allocate(A)", {"A": a}, {"A": prompt_len}, rc1, ()),
              ("2. fork(A, B): tables copied, nothing else", {"A": a, "B": a}, {"A": prompt_len, "B": prompt_len},
               rc2, ()),
              (f"3. B appends: block {n_blocks - 1} copied to {n_blocks}", {"A": a, "B": a[:-1] + [n_blocks]},
               {"A": prompt_len, "B": prompt_len + 1}, rc3, (n_blocks,))]
    for ax, (title, tables, lengths, rc, fresh) in zip(axes, states):
        top = _tables_and_pool(ax, tables, lengths, num_blocks, block_size, refcounts=rc, fresh=fresh, y_top=1.6)
        _finish(ax, (-1.8, num_blocks + 0.2), (-0.5, top + 0.2), title)
    return axes


# --------------------------------------------------------------------------- Chapter 7


def split_tiles(seq_len: int, num_splits: int, block_n: int):
    """The key ranges of the splits: ``ceil(T / S)`` whole tiles each, ``T = ceil(n / block_n)``.

    Returns:
        ``[(start, end)]`` per split, in keys; a split past the end is ``(n, n)`` (empty).
    """
    tiles = math.ceil(seq_len / block_n)
    per = math.ceil(tiles / num_splits) if tiles else 0
    return [(min(s * per * block_n, seq_len), min((s + 1) * per * block_n, seq_len)) for s in range(num_splits)]


def draw_split_merge(seq_len: int = 1000, num_splits: int = 4, block_n: int = 64, ax=None):
    """Chapter 7: flash-decoding's split of one query's keys, the partial results and the merge.

    Top: the ``seq_len`` keys of one (sequence, KV head), cut into tiles of ``block_n`` and
    into ``num_splits`` splits of whole tiles (one colour per split). Middle: one program
    per split (stage 1) streams its tiles with the online softmax and writes a partial
    result $(o_s, \\ell_s)$, its output normalised over the split and its log-sum-exp.
    Bottom: stage 2 merges them, $o = \\sum_s e^{\\ell_s - \\ell} o_s$ with
    $\\ell = \\log \\sum_s e^{\\ell_s}$.

    Returns:
        The ``Axes``: one bar per non-empty split, one box per program, one merge box, and
        one arrow per program into the merge (and one from its split).
    """
    ax = _axes(ax, (10, 4.2))
    bounds = split_tiles(seq_len, num_splits, block_n)
    scale = 10.0 / seq_len
    for s, (lo, hi) in enumerate(bounds):
        if hi > lo:
            _box(ax, lo * scale, 3.0, (hi - lo) * scale, 0.5, color=SEQ_COLORS[s % len(SEQ_COLORS)], alpha=0.6,
                 lw=0.8)
    for t in range(1, math.ceil(seq_len / block_n)):
        ax.plot([t * block_n * scale] * 2, [3.0, 3.5], color="k", lw=0.3)
    ax.text(5.0, 3.75, f"keys 0 … {seq_len - 1} of one (sequence, KV head): {math.ceil(seq_len / block_n)} tiles of "
            f"{block_n}, {num_splits} splits of whole tiles", ha="center", fontsize=9)
    w = 10.0 / num_splits
    for s, (lo, hi) in enumerate(bounds):
        x = s * w + 0.1
        tiles = (hi - lo + block_n - 1) // block_n
        label = (f"program {s}\nkeys {lo}–{hi - 1} ({tiles} tiles)\n→ o$_{s}$, ℓ$_{s}$" if hi > lo
                 else f"program {s}\nempty split\n→ o = 0, ℓ = −∞")
        _box(ax, x, 1.5, w - 0.2, 0.95, label, color=CHIP, rounded=True, fontsize=8)
        if hi > lo:
            _arrow(ax, ((lo + hi) / 2 * scale, 3.0), (x + (w - 0.2) / 2, 2.45), color=READ)
        _arrow(ax, (x + (w - 0.2) / 2, 1.5), (5.0, 0.75), color=WRITE)
    _box(ax, 3.0, 0.0, 4.0, 0.75, "stage 2 (merge): M = max ℓ$_s$,  w$_s$ = e$^{ℓ_s − M}$\n"
         "o = Σ w$_s$ o$_s$ / Σ w$_s$,   ℓ = M + log Σ w$_s$", color=CHIP, rounded=True, fontsize=8)
    ax.text(-0.1, 1.95, "stage 1", rotation=90, ha="right", va="center", fontsize=9)
    return _finish(ax, (-0.4, 10.2), (-0.1, 4.0))


# --------------------------------------------------------------------------- Chapter 8


def draw_flat_gemm_tiles(m: int = 4, n_tiles: int = 6, k_tiles: int = 4, block_m: int = 16, split_k: int = 2,
                         ax=None):
    """Chapter 8: a flat GEMM $y = x W^\\top$ with few rows, tiled along $N$ and split along $K$.

    Left: $x$, ``[M, K]`` with ``m`` real rows, padded with zeros to ``block_m`` rows for
    ``tl.dot`` (hatched: wasted tensor-core work, no extra memory traffic). Top right:
    $W^\\top$, ``[K, N]``, cut into ``n_tiles`` column tiles of ``BLOCK_N`` output features
    and ``k_tiles`` tiles of ``BLOCK_K`` along $K$; the $K$ range is dealt out in
    ``split_k`` runs (shades), one program per (column tile, run). Bottom right: $y$,
    ``[M, N]``: each program adds its partial tile, in run order.

    Returns:
        The ``Axes``: ``n_tiles * k_tiles`` weight tiles, ``k_tiles`` x tiles plus their
        padding, and ``n_tiles`` output tiles.
    """
    if not 1 <= split_k <= k_tiles:
        raise ValueError("split_k must be between 1 and k_tiles")
    ax = _axes(ax, (9.5, 5.2))
    h_x = 2.0                                   # drawn height of the padded x (block_m rows)
    real = h_x * m / block_m
    per = math.ceil(k_tiles / split_k)
    run_alpha = [0.85 - 0.5 * r / max(split_k - 1, 1) for r in range(split_k)]
    kw = 0.7                                    # drawn width of a K tile
    for kt in range(k_tiles):                   # x: [M, K], K along x
        x = kt * kw
        _box(ax, x, 0, kw * 0.96, real, color=READ, alpha=run_alpha[kt // per], lw=0.6)
        _box(ax, x, real, kw * 0.96, h_x - real, color="white", hatch="///", lw=0.6, ec="#888888")
    ax.text(k_tiles * kw / 2, real + (h_x - real) / 2, f"zero padding\n({block_m - m} rows)", ha="center",
            va="center", fontsize=8, bbox=dict(fc="white", ec="none", pad=1))
    ax.text(k_tiles * kw / 2, -0.35, f"x: [M, K], M = {m} real rows, padded to {block_m}", ha="center", fontsize=8)
    x0, y0 = k_tiles * kw + 0.6, h_x + 0.6
    nw = 0.9
    for nt in range(n_tiles):                   # W^T: [K, N], K downwards
        for kt in range(k_tiles):
            _box(ax, x0 + nt * nw, y0 + (k_tiles - 1 - kt) * kw, nw * 0.96, kw * 0.96,
                 color=SEQ_COLORS[nt % len(SEQ_COLORS)], alpha=run_alpha[kt // per], lw=0.6)
    for r in range(split_k):
        k0, k1 = r * per, min((r + 1) * per, k_tiles) - 1
        ytop = y0 + (k_tiles - k0) * kw
        ax.text(x0 - 0.1, ytop - (k1 - k0 + 1) * kw / 2, f"run {r}\nK tiles {k0}–{k1}", ha="right", va="center",
                fontsize=7)
    ax.text(x0 + n_tiles * nw / 2, y0 + k_tiles * kw + 0.15, "Wᵀ: [K, N], tiles of BLOCK_N features × BLOCK_K",
            ha="center", fontsize=8)
    for nt in range(n_tiles):                   # y: [M, N]
        _box(ax, x0 + nt * nw, 0, nw * 0.96, real, color=WRITE, alpha=0.7, lw=0.6)
        ax.text(x0 + nt * nw + nw / 2, real + 0.15, f"pid_n {nt}", ha="center", fontsize=7, rotation=0)
    ax.text(x0 + n_tiles * nw / 2, -0.35, f"y: [M, N]: {n_tiles} × {split_k} = {n_tiles * split_k} programs, "
            "partials added in run order", ha="center", fontsize=8)
    return _finish(ax, (-0.9, x0 + n_tiles * nw + 0.2), (-0.6, y0 + k_tiles * kw + 0.5))
