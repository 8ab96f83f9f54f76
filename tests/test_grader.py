"""The autograder CLI itself: solutions score full marks, untouched stubs score zero."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(int(m.group(1)) for p in (REPO / "tests" / "graded").glob("test_ch*.py")
                  if (m := re.match(r"test_ch(\d+)\.py", p.name)))


def run_grader(chapter, impl):
    proc = subprocess.run([sys.executable, "-m", "minillm.grade", str(chapter), "--impl", impl],
                          capture_output=True, text=True, cwd="/", timeout=600)
    rows = re.findall(r"^(\d+\.\d+)\s+.*?\s(\d+)\s+(PASS|FAIL)\s*(.*)$", proc.stdout, flags=re.M)
    return proc, rows


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_solutions_pass(chapter):
    proc, rows = run_grader(chapter, "solutions")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rows and all(r[2] == "PASS" for r in rows), proc.stdout
    assert re.search(r"Score: (\d+) / \1 points", proc.stdout)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_stubs_fail_with_not_implemented(chapter):
    proc, rows = run_grader(chapter, "exercises")
    assert proc.returncode != 0, proc.stdout
    assert rows and all(r[2] == "FAIL" and r[3].startswith("NotImplementedError") for r in rows), proc.stdout
    assert "Score: 0 /" in proc.stdout
