"""Highlighted excerpts of the library's source, for the chapter notebooks.

``show_source(kernels._fwd_tiles, start="for start_n", end="return acc")`` displays the lines
of a function (a ``@triton.jit`` kernel or any Python function) from the first one that
contains ``start`` to the first one after it that contains ``end``, syntax-highlighted, with
its docstring left out (the chapter's text says the same in prose). Markers that are not
found fall back to the start or end of the function, so a notebook keeps running when the
kernel it quotes is edited.
"""
from __future__ import annotations

import ast
import inspect
import textwrap

__all__ = ["source_excerpt", "show_source"]


def source_excerpt(obj, start: str | None = None, end: str | None = None, docstring: bool = False) -> str:
    """The source of ``obj`` (a function, or a Triton kernel: its ``.fn``) as text, dedented.

    ``start``/``end``: keep only the lines from the first containing ``start`` through the
    first one at or after it containing ``end``; elided lines become a ``...`` line.
    ``docstring=False`` drops the function's docstring.
    """
    fn = getattr(obj, "fn", obj)  # a @triton.jit kernel wraps the Python function as .fn
    text = textwrap.dedent(inspect.getsource(fn))
    lines = text.splitlines()
    if not docstring:
        body = ast.parse(text).body[0].body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            first, last = body[0].lineno - 1, body[0].end_lineno  # 0-based, end exclusive
            lines = lines[:first] + lines[last:]
    lo = next((i for i, line in enumerate(lines) if start in line), 0) if start else 0
    hi = next((i for i in range(lo, len(lines)) if end in lines[i]), len(lines) - 1) if end else len(lines) - 1
    picked = lines[lo:hi + 1]
    indent = " " * (len(picked[0]) - len(picked[0].lstrip())) if picked else ""
    if lo > 0:
        picked = [indent + "..."] + picked
    if hi < len(lines) - 1:
        picked = picked + [indent + "..."]
    return "\n".join(picked)


def show_source(obj, start: str | None = None, end: str | None = None, docstring: bool = False):
    """`source_excerpt` as a syntax-highlighted ``IPython.display.Code`` (the notebook displays it)."""
    from IPython.display import Code

    return Code(source_excerpt(obj, start, end, docstring), language="python")
