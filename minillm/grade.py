"""The autograder: ``python -m minillm.grade CH [--impl exercises|solutions]``.

Runs the graded tests of chapter CH (``tests/graded/test_chNN.py``) against your
``exercises/chNN.py`` (default) or the reference ``solutions/chNN.py`` and prints one row per
exercise: id, title, points, PASS/FAIL, and the first line of the first failure. An exercise
earns its points only if every one of its tests passes. Exit status 0 iff all pass.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Exercise:
    id: str
    title: str
    points: int
    passed: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.passed > 0 and not self.failures


class _Collector:
    """A pytest plugin that groups test outcomes by their ``@pytest.mark.exercise`` marker."""

    def __init__(self) -> None:
        self.exercises: dict[str, Exercise] = {}
        self._by_nodeid: dict[str, Exercise] = {}

    def pytest_collection_modifyitems(self, items):
        for item in items:
            marker = item.get_closest_marker("exercise")
            if marker is None:
                continue
            ex = self.exercises.setdefault(marker.kwargs["id"], Exercise(**marker.kwargs))
            self._by_nodeid[item.nodeid] = ex

    def pytest_runtest_logreport(self, report):
        ex = self._by_nodeid.get(report.nodeid)
        if ex is None:
            return
        if report.failed:
            ex.failures.append(_first_line(report))
        elif report.passed and report.when == "call":
            ex.passed += 1


def _first_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "failed"
    # np.testing's messages start on the line after "AssertionError:": show that one too.
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def grade(chapter: int, impl: str = "exercises", verbose: bool = False) -> dict[str, Exercise]:
    """Run chapter ``chapter``'s graded tests on ``impl``; return the exercises by id."""
    path = REPO / "tests" / "graded" / f"test_ch{chapter:02d}.py"
    if not path.exists():
        raise SystemExit(f"no graded tests for chapter {chapter} ({path} does not exist)")
    collector = _Collector()
    args = [str(path), f"--impl={impl}", "-p", "no:cacheprovider", f"--rootdir={REPO}",
            "-c", str(REPO / "pyproject.toml")]
    # Quiet by default: the table is the report. --verbose shows pytest as usual.
    args += ["--tb=short"] if verbose else ["-p", "no:terminal", "-p", "no:warnings", "-o", "addopts="]
    pytest.main(args, plugins=[collector])
    return collector.exercises


def print_table(exercises: dict[str, Exercise], impl: str, chapter: int) -> None:
    rows = [(ex.id, ex.title, str(ex.points), "PASS" if ex.ok else "FAIL",
             "" if ex.ok else (ex.failures[0] if ex.failures else "no test ran"))
            for ex in sorted(exercises.values(), key=lambda e: [int(p) for p in e.id.split(".")])]
    header = ("Exercise", "Title", "Points", "Result", "First failure")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    print(f"\nChapter {chapter} — grading {impl}/ch{chapter:02d}.py\n")
    print(fmt.format(*header))
    print(fmt.format(*("-" * w for w in widths), "-" * 13))
    for r in rows:
        print(fmt.format(*r[:4], r[4][:120]))
    earned = sum(ex.points for ex in exercises.values() if ex.ok)
    total = sum(ex.points for ex in exercises.values())
    print(f"\nScore: {earned} / {total} points")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.grade", description=__doc__.splitlines()[0])
    parser.add_argument("chapter", type=int, help="chapter number, e.g. 1")
    parser.add_argument("--impl", choices=["exercises", "solutions"], default="exercises",
                        help="grade your exercises (default) or the reference solutions")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's tracebacks")
    args = parser.parse_args(argv)
    exercises = grade(args.chapter, args.impl, args.verbose)
    if not exercises:
        print(f"no graded tests were collected for chapter {args.chapter}")
        return 1
    print_table(exercises, args.impl, args.chapter)
    return 0 if all(ex.ok for ex in exercises.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
