"""The autograder CLI itself: solutions score full marks, untouched stubs score zero and show
as "not started"; failures, errors and hints are reported as documented in docs/exercises.md."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minillm import grade, hints

REPO = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(int(m.group(1)) for p in (REPO / "tests" / "graded").glob("test_ch*.py")
                  if (m := re.match(r"test_ch(\d+)\.py", p.name)))
# The scratch-copy tests grade only chapter 3's NumPy exercises (Triton ones run slowly on a CPU).
NUMPY_3 = ("--only", "3.1,3.2,3.3")
ROW = re.compile(r"^(\d+\.\d+)\s+(Python|Triton)\s+(.*?)\s+(\d+)/(\d+)\s+(PASS|FAIL|ERROR|not started)$", re.M)


def run_grader(chapter, impl="exercises", *extra, env=None):
    proc = subprocess.run([sys.executable, "-m", "minillm.grade", str(chapter), "--impl", impl, *extra],
                          capture_output=True, text=True, cwd="/", timeout=600,
                          env={**os.environ, **(env or {})})
    return proc, ROW.findall(proc.stdout)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_solutions_pass(chapter):
    proc, rows = run_grader(chapter, "solutions")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rows and all(r[5] == "PASS" and r[3] == r[4] for r in rows), proc.stdout
    assert re.search(r"Score: (\d+) / \1 points", proc.stdout)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_stubs_show_as_not_started(chapter):
    proc, rows = run_grader(chapter, "exercises")
    assert proc.returncode != 0, proc.stdout
    assert rows and all(r[5] == "not started" and r[3] == "0" for r in rows), proc.stdout
    assert "Score: 0 /" in proc.stdout
    assert f"Not started: {', '.join(r[0] for r in rows)}." in proc.stdout
    assert f"python -m minillm.grade {chapter} --hint {rows[0][0]}" in proc.stdout
    assert "Traceback" not in proc.stdout and "NotImplementedError" not in proc.stdout, proc.stdout
    # The Kind column: every exercise is Python or Triton, as its marker says.
    kinds = {r[0]: r[1] for r in rows}
    assert kinds == {ex_id: kind.title() for ex_id, kind in marked_kinds(chapter).items()}


def marked_kinds(chapter):
    """``{id: kind}`` from the exercise markers of ``test_chNN.py``, read as text."""
    text = (REPO / "tests" / "graded" / f"test_ch{chapter:02d}.py").read_text()
    out = {}
    for call in re.findall(r"pytest\.mark\.exercise\((.*?)\)\s*$", text, flags=re.M | re.S):
        ex_id = re.search(r'id="([^"]+)"', call).group(1)
        kind = re.search(r'kind="([^"]+)"', call)
        out[ex_id] = kind.group(1) if kind else "python"
    return out


def test_a_triton_exercise_is_labelled_triton():
    assert "triton" in marked_kinds(1).values(), "chapter 1 has a Triton exercise (1.4)"


# --- failures, errors, JSON -------------------------------------------------------------------

@pytest.fixture
def scratch(tmp_path):
    """A scratch copy of ``solutions/ch03.py`` to break on purpose; the grader reads it with
    ``--exercises DIR``."""
    def make(edit):
        src = (REPO / "solutions" / "ch03.py").read_text()
        (tmp_path / "ch03.py").write_text(edit(src))
        return tmp_path
    return make


def test_a_failure_is_shown_in_full_with_its_seed(scratch):
    # A classic mistake in 3.2: the old sums are not rescaled to the common max.
    where = scratch(lambda s: s.replace("w1, w2 = l1 * np.exp(m1 - m_safe), l2 * np.exp(m2 - m_safe)",
                                        "w1, w2 = l1, l2"))
    proc, rows = run_grader(3, "exercises", *NUMPY_3, "--exercises", str(where), env={"MINILLM_SEED": "1234"})
    status = {r[0]: r[5] for r in rows}
    assert status == {"3.1": "PASS", "3.2": "FAIL", "3.3": "FAIL"}, proc.stdout
    details = proc.stdout.split("3.2 Merging partial attention outputs — FAIL", 1)[1]
    assert "tests/graded/test_ch03.py:" in details                     # where the assertion is
    assert "Not equal to tolerance" in details and "Max absolute difference" in details  # the values
    assert "Seed 1234: reproduce with MINILLM_SEED=1234 python -m minillm.grade 3" in details
    assert str(where / "ch03.py") in proc.stdout                       # what was graded
    assert "Score: 2 / 8 points" in proc.stdout


def test_json_report(scratch):
    where = scratch(lambda s: s.replace("w1, w2 = l1 * np.exp(m1 - m_safe), l2 * np.exp(m2 - m_safe)",
                                        "w1, w2 = l1, l2"))
    proc, _ = run_grader(3, "exercises", *NUMPY_3, "--exercises", str(where), "--json")
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)                                   # stdout is pure JSON
    assert (report["chapter"], report["impl"], report["score"], report["total"], report["passed"]) == \
        (3, "exercises", 2, 8, False)
    by_id = {ex["id"]: ex for ex in report["exercises"]}
    assert list(by_id) == ["3.1", "3.2", "3.3"]
    assert set(by_id["3.1"]) >= {"id", "title", "kind", "points", "status", "message"}
    assert (by_id["3.1"]["status"], by_id["3.1"]["message"], by_id["3.1"]["kind"]) == ("passed", "", "python")
    assert by_id["3.2"]["status"] == "failed" and "MINILLM_SEED=" in by_id["3.2"]["message"]
    assert by_id["3.2"]["title"] == "Merging partial attention outputs" and by_id["3.2"]["points"] == 3


def test_json_report_of_the_stubs():
    proc, _ = run_grader(3, "exercises", *NUMPY_3, "--json")
    report = json.loads(proc.stdout)
    assert [ex["status"] for ex in report["exercises"]] == ["not_started"] * 3
    assert all(re.fullmatch(r"Exercise 3\.\d+ \(\w+\): not started\. .*--hint 3\.\d+", ex["message"])
               for ex in report["exercises"]), report


def test_syntax_error_shows_file_line_and_caret(scratch):
    where = scratch(lambda s: s.replace("def merge_partials(", "def merge_partials((", 1))
    line = next(i for i, text in enumerate((where / "ch03.py").read_text().splitlines(), 1) if "merge_partials((" in text)
    proc, rows = run_grader(3, "exercises", *NUMPY_3, "--exercises", str(where))
    assert len(rows) == 3 and all(r[5] == "ERROR" for r in rows), proc.stdout
    assert f'File "{where / "ch03.py"}", line {line}' in proc.stdout
    assert re.search(r"^\s+\^+\s*$", proc.stdout, flags=re.M), proc.stdout      # the caret line
    assert "SyntaxError" in proc.stdout


def test_import_error_and_errors_in_your_code(scratch):
    where = scratch(lambda s: s.replace("import numpy as np", "import numpy as np\nimport no_such_module_xyz", 1))
    proc, _ = run_grader(3, "exercises", "--only", "3.1,3.2", "--exercises", str(where), "--json")
    report = json.loads(proc.stdout)
    assert all(ex["status"] == "error" and "ModuleNotFoundError: No module named 'no_such_module_xyz'" in ex["message"]
               for ex in report["exercises"]), report
    # An exception raised inside the student's function: its type, and where in their file.
    where = scratch(lambda s: s.replace("    m = np.maximum(m1, m2)\n", "    m = np.maximum(m1, m2)\n    m = m[None][5]\n", 1))
    proc, _ = run_grader(3, "exercises", "--only", "3.2", "--exercises", str(where), "--json")
    merge = next(ex for ex in json.loads(proc.stdout)["exercises"] if ex["id"] == "3.2")
    assert merge["status"] == "error", merge
    assert "IndexError" in merge["message"] and "ch03.py:" in merge["message"] and "in merge_partials" in merge["message"]


# --- hints ------------------------------------------------------------------------------------

def hint(capsys, *args):
    code = grade.main(["3", "--hint", *args])
    return code, capsys.readouterr().out


def test_hints_are_revealed_one_level_at_a_time(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINILLM_STATE_DIR", str(tmp_path))
    _, levels = hints.load("3.1")
    for level in (1, 2, 3):
        code, out = hint(capsys, "3.1")
        assert code == 0 and f"hint {level} of 3" in out and levels[level - 1] in out, out
        for other in {1, 2, 3} - {level}:
            assert levels[other - 1] not in out
        assert json.loads((tmp_path / "hints.json").read_text())["3.1"] == level
    code, out = hint(capsys, "3.1")
    assert code == 0 and "all 3 hints" in out and not any(text in out for text in levels), out
    code, out = hint(capsys, "3.1", "--level", "2")
    assert code == 0 and levels[1] in out and "hint 2 of 3" in out
    assert json.loads((tmp_path / "hints.json").read_text()) == {"3.1": 3}   # --level never lowers it
    code, out = hint(capsys, "2")                                             # "2" in chapter 3: 3.2
    assert code == 0 and "Exercise 3.2" in out and "hint 1 of 3" in out


def test_hint_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINILLM_STATE_DIR", str(tmp_path))
    code, out = hint(capsys, "3.99")
    assert code == 2 and "No exercise 3.99" in out and "3.1, 3.2, 3.3" in out
    code, out = hint(capsys, "4.1")
    assert code == 2 and "python -m minillm.grade 4 --hint 4.1" in out
    code, out = hint(capsys, "3.1", "--level", "4")
    assert code == 2 and "between 1 and 3" in out
    assert not (tmp_path / "hints.json").exists()
    with pytest.raises(SystemExit):
        grade.main(["3", "--level", "2"])                                     # --level needs --hint
