"""README's chapter map is true: every path in it exists, each sits in its chapter's row, and
every chapter module (references, kernels, experiments, notebooks, exercises, benchmarks) is
in it."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ["chapter", "notebook", "NumPy reference", "Triton kernels", "tests", "experiments", "exercises",
           "benchmark"]
#: Each column's paths: a pattern with NN, the chapter's two digits.
PATTERNS = {
    "notebook": [r"chapters/NN_\w+\.ipynb"],
    "NumPy reference": [r"minillm/reference/chNN_\w+\.py"],
    "Triton kernels": [r"kernels/chNN_\w+\.py"],
    "tests": [r"tests/test_chNN_\w+\.py"],
    "experiments": [r"minillm/experiments/chNN_\w+\.py"],
    "exercises": [r"exercises/chNN\.py", r"solutions/chNN\.py", r"tests/graded/test_chNN\.py"],
    "benchmark": [r"bench/chNN_\w+\.py"],
}
#: Files the map must list, every one (tests/ may hold more chapter tests than the map names).
MUST_LIST = ["chapters/[0-9][0-9]_*.ipynb", "minillm/reference/ch[0-9][0-9]_*.py", "kernels/ch[0-9][0-9]_*.py",
             "minillm/experiments/ch[0-9][0-9]_*.py", "exercises/ch[0-9][0-9].py", "solutions/ch[0-9][0-9].py",
             "tests/graded/test_ch[0-9][0-9].py", "bench/ch[0-9][0-9]_*.py"]


def chapter_map() -> dict[int, dict[str, list[str]]]:
    """``{chapter: {column: [paths]}}`` from the table under README's ``## Layout``."""
    text = (REPO / "README.md").read_text()
    layout = text[text.index("## Layout\n"):]
    layout = layout[:layout.index("\n## ", 1)]
    rows = [line for line in layout.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header == COLUMNS, f"the layout section must open with the chapter map; header {header}"
    assert set(rows[1].replace("|", "").strip()) <= set("-: ")
    table = {}
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) != len(COLUMNS) or not re.match(r"\d+ ", cells[0]):
            break  # the table ended (the next table has other columns)
        number = int(cells[0].split()[0])
        assert number not in table, f"chapter {number} twice"
        table[number] = {}
        for column, cell in zip(COLUMNS[1:], cells[1:]):
            paths = re.findall(r"`([^`]+)`", cell)
            assert paths or cell == "—", f"chapter {number}, {column}: {cell!r} (write — for none)"
            table[number][column] = paths
    return table


def test_chapter_map_lists_every_chapter_once():
    table = chapter_map()
    notebooks = sorted(p.name for p in (REPO / "chapters").glob("[0-9][0-9]_*.ipynb"))
    numbers = [int(name[:2]) for name in notebooks]
    assert sorted(table) == numbers
    assert [Path(table[n]["notebook"][0]).name for n in numbers] == notebooks


def test_chapter_map_paths_exist_in_their_row():
    for number, columns in chapter_map().items():
        for column, paths in columns.items():
            for path in paths:
                assert (REPO / path).is_file(), f"chapter {number}, {column}: {path} does not exist"
                patterns = [p.replace("NN", f"{number:02d}") for p in PATTERNS[column]]
                assert any(re.fullmatch(p, path) for p in patterns), f"chapter {number}, {column}: {path}"
        if columns["exercises"]:
            assert len(columns["exercises"]) == 3, f"chapter {number}: stub, answer and graded tests"


def test_chapter_map_lists_every_chapter_module():
    listed = {p for columns in chapter_map().values() for paths in columns.values() for p in paths}
    for pattern in MUST_LIST:
        files = {str(p.relative_to(REPO)) for p in REPO.glob(pattern)}
        assert files, pattern
        assert not files - listed, f"missing from README's chapter map: {sorted(files - listed)}"
