"""Every chapter notebook runs top to bottom on CPU (small sizes, the Triton interpreter).

Executed in a scratch copy, so the committed outputs are left alone.
"""
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # dev extra; absent on a bare GPU box
NotebookClient = pytest.importorskip("nbclient").NotebookClient

pytestmark = pytest.mark.slow
CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"
NOTEBOOKS = sorted(CHAPTERS.glob("*.ipynb"))


def test_every_chapter_is_a_notebook():
    assert NOTEBOOKS, "no notebooks in chapters/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # no GPU in CI: kernels run in the interpreter
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(CHAPTERS)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
