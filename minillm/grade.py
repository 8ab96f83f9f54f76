"""The autograder: ``python -m minillm.grade CH [--impl exercises|solutions] [--json] [--hint ID]``.

Runs the graded tests of chapter CH (``tests/graded/test_chNN.py``) against your
``exercises/chNN.py`` (default) or the reference ``solutions/chNN.py`` and prints one row per
exercise (id, kind, title, points, result), then, below the table, the first failure of each
exercise that did not pass, in full: the assertion with the values it compared, or the error
(a SyntaxError with its file, line and caret; an ImportError; where in your code it was
raised), and the seed that reproduces it. A stub that still raises ``NotImplementedError`` is
"not started", not a failure. An exercise earns its points only if every one of its tests
passes. Exit status 0 iff all pass.

``--json`` prints the same report as JSON (for a course's autograder); ``--hint ID`` reveals
the hints of one exercise a level at a time (see `minillm.hints`); ``--exercises DIR`` grades
``DIR/chNN.py`` (a copy of ``exercises/``) instead of ``exercises/chNN.py``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import textwrap
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from minillm import hints, testing

REPO = Path(__file__).resolve().parent.parent

PASSED, FAILED, NOT_STARTED, ERROR = "passed", "failed", "not_started", "error"
RESULT = {PASSED: "PASS", FAILED: "FAIL", NOT_STARTED: "not started", ERROR: "ERROR"}
KINDS = {"python": "Python", "triton": "Triton"}


@dataclass
class Outcome:
    """What went wrong in one test: ``status`` is failed, not_started or error."""
    status: str
    message: str
    test: str


@dataclass
class Exercise:
    id: str
    title: str
    points: int
    kind: str = "python"
    tests: int = 0
    passed: int = 0
    failures: list[Outcome] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.passed > 0 and not self.failures

    @property
    def status(self) -> str:
        if self.ok:
            return PASSED
        for status in (ERROR, FAILED, NOT_STARTED):   # the most informative first
            if any(f.status == status for f in self.failures):
                return status
        return FAILED                                  # no test ran (all skipped)

    @property
    def message(self) -> str:
        """The first failure of the exercise's status, in full ("" if it passed)."""
        if self.ok:
            return ""
        first = next((f for f in self.failures if f.status == self.status), None)
        return first.message if first else "no test ran (all of this exercise's tests were skipped)"

    @property
    def earned(self) -> int:
        return self.points if self.ok else 0

    def as_dict(self) -> dict:
        failed_tests = len({f.test for f in self.failures})
        return {"id": self.id, "title": self.title, "kind": self.kind, "points": self.points,
                "earned": self.earned, "status": self.status, "message": self.message,
                "tests": self.tests, "failed_tests": failed_tests}


class _Collector:
    """A pytest plugin that groups test outcomes by their ``@pytest.mark.exercise`` marker."""

    def __init__(self, chapter: int, only: set[str] | None = None) -> None:
        self.chapter = chapter
        self.only = only
        self.exercises: dict[str, Exercise] = {}
        self.errors: list[str] = []                 # test files that failed to import
        self._by_nodeid: dict[str, Exercise] = {}

    def pytest_collection_modifyitems(self, config, items):
        if self.only is not None:               # --only: deselect the other exercises' tests
            keep = [i for i in items if (m := i.get_closest_marker("exercise")) and m.kwargs["id"] in self.only]
            config.hook.pytest_deselected(items=[i for i in items if i not in keep])
            items[:] = keep
        for item in items:
            marker = item.get_closest_marker("exercise")
            if marker is None:
                continue
            kw = marker.kwargs
            ex = self.exercises.setdefault(kw["id"], Exercise(
                id=kw["id"], title=kw["title"], points=kw["points"], kind=kw.get("kind", "python")))
            ex.tests += 1
            self._by_nodeid[item.nodeid] = ex

    def pytest_collectreport(self, report):
        if report.failed:
            self.errors.append(str(report.longrepr))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        testing.drawn_seeds.clear()                 # before the fixtures draw this test's seed

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        ex = self._by_nodeid.get(item.nodeid)
        if ex is None:
            return
        if report.failed:
            ex.failures.append(_describe(call.excinfo, report, item.nodeid, self.chapter))
        elif report.passed and call.when == "call":
            ex.passed += 1


def _describe(excinfo, report, nodeid: str, chapter: int) -> Outcome:
    """The whole story of one failed test, as the student needs it."""
    test = nodeid.split("::")[-1]
    if excinfo is None:
        return Outcome(FAILED, str(report.longrepr), nodeid)
    if excinfo.errisinstance(NotImplementedError):
        return Outcome(NOT_STARTED, str(excinfo.value) or "NotImplementedError", nodeid)
    seeds = list(dict.fromkeys(testing.drawn_seeds))
    if excinfo.errisinstance((AssertionError, pytest.fail.Exception)):
        status, lines = FAILED, [f"{test} failed at {_where(_last_in(excinfo, 'tests'))}",
                                 textwrap.indent(excinfo.exconly().strip(), "  ")]
    else:
        status = ERROR
        during = " while setting up the test (importing your module?)" if report.when == "setup" else " raised"
        lines = [f"{test}: {excinfo.typename}{during}"]
        if not excinfo.errisinstance(SyntaxError):          # its own text has file, line, caret
            entry = _last_in(excinfo, "exercises") or _last_in(excinfo, None)
            lines.append(f"  {_where(entry)}")
        only = "".join(traceback.format_exception_only(excinfo.type, excinfo.value)).rstrip()
        lines.append(textwrap.indent(only, "  "))
    if seeds:
        lines.append(f"Seed {seeds[0]}: reproduce with MINILLM_SEED={seeds[0]} python -m minillm.grade {chapter}")
    return Outcome(status, "\n".join(lines), nodeid)


def _exercises_dir() -> Path:
    return Path(os.environ.get("MINILLM_EXERCISES_DIR") or REPO / "exercises").resolve()


def _last_in(excinfo, where: str | None):
    """The innermost traceback entry in the graded tests (``"tests"``), in the student's code
    (``"exercises"``) or anywhere (None); None if there is none."""
    root = {"tests": REPO / "tests", "exercises": _exercises_dir(), None: Path("/")}[where]
    entries = [e for e in excinfo.traceback if Path(str(e.path)).resolve().is_relative_to(root)]
    return entries[-1] if entries else None


def _where(entry) -> str:
    """``path:line in function`` plus the source line of a traceback entry."""
    if entry is None:
        return "(no traceback)"
    path = Path(str(entry.path)).resolve()
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    try:
        source = str(entry.statement).strip().splitlines()
    except Exception:           # no source (e.g. code built at run time)
        source = []
    text = f"{shown}:{entry.lineno + 1} in {entry.name}"
    return text + ("\n    " + "\n    ".join(source) if source else "")


def grade(chapter: int, impl: str = "exercises", verbose: bool = False,
          exercises_dir: str | Path | None = None, only: set[str] | None = None) -> dict[str, Exercise]:
    """Run chapter ``chapter``'s graded tests on ``impl``; return the exercises by id.

    ``exercises_dir``: grade ``exercises_dir/chNN.py`` instead of ``exercises/chNN.py``;
    ``only``: grade just these exercise ids.
    """
    return _run(chapter, impl, verbose, exercises_dir, only).exercises


def _run(chapter: int, impl: str, verbose: bool, exercises_dir: str | Path | None,
         only: set[str] | None = None) -> _Collector:
    path = REPO / "tests" / "graded" / f"test_ch{chapter:02d}.py"
    if not path.exists():
        raise SystemExit(f"no graded tests for chapter {chapter} ({path} does not exist)")
    collector = _Collector(chapter, only)
    args = [str(path), f"--impl={impl}", "-p", "no:cacheprovider", f"--rootdir={REPO}",
            "-c", str(REPO / "pyproject.toml")]
    # Quiet by default: the report is the table. --verbose shows pytest as usual.
    args += ["--tb=short"] if verbose else ["-p", "no:terminal", "-p", "no:warnings", "-o", "addopts="]
    before = os.environ.get("MINILLM_EXERCISES_DIR")
    if exercises_dir is not None:
        os.environ["MINILLM_EXERCISES_DIR"] = str(Path(exercises_dir).resolve())
    try:
        pytest.main(args, plugins=[collector])
    finally:
        if exercises_dir is not None:
            if before is None:
                os.environ.pop("MINILLM_EXERCISES_DIR", None)
            else:
                os.environ["MINILLM_EXERCISES_DIR"] = before
    return collector


def _ordered(exercises: dict[str, Exercise]) -> list[Exercise]:
    return sorted(exercises.values(), key=lambda e: [int(p) if p.isdigit() else p for p in e.id.split(".")])


def print_table(exercises: dict[str, Exercise], impl: str, chapter: int, verbose: bool = False,
                exercises_dir: str | Path | None = None) -> None:
    """The table, then the first failure of each exercise in full, then the score."""
    ordered = _ordered(exercises)
    rows = [(ex.id, KINDS.get(ex.kind, ex.kind.title()), ex.title, f"{ex.earned}/{ex.points}", RESULT[ex.status])
            for ex in ordered]
    header = ("Exercise", "Kind", "Title", "Points", "Result")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(5)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    where = exercises_dir or os.environ.get("MINILLM_EXERCISES_DIR") if impl == "exercises" else None
    source = Path(where).resolve() / f"ch{chapter:02d}.py" if where else f"{impl}/ch{chapter:02d}.py"
    print(f"\nChapter {chapter} — grading {source}\n")
    print(fmt.format(*header).rstrip())
    print(fmt.format(*("-" * w for w in widths)))
    for r in rows:
        print(fmt.format(*r).rstrip())
    shown = [ex for ex in ordered if ex.status in (FAILED, ERROR) or (verbose and ex.status == NOT_STARTED)]
    printed: dict[str, str] = {}                # message -> the exercise it was shown under
    for ex in shown:
        bad = len({f.test for f in ex.failures})
        counts = f" ({bad} of {ex.tests} tests)" if ex.failures else ""
        print(f"\n{ex.id} {ex.title} — {RESULT[ex.status]}{counts}")
        same = printed.get(ex.message.split("\n", 1)[-1])   # e.g. one SyntaxError fails every exercise
        print(f"  the same error as {same}, above" if same else textwrap.indent(ex.message, "  "))
        printed.setdefault(ex.message.split("\n", 1)[-1], ex.id)
    todo = [ex.id for ex in ordered if ex.status == NOT_STARTED]
    if todo:
        print(f"\nNot started: {', '.join(todo)}. Each stub's docstring says what to write; "
              f"hints: python -m minillm.grade {chapter} --hint {todo[0]}")
    earned = sum(ex.earned for ex in ordered)
    total = sum(ex.points for ex in ordered)
    print(f"\nScore: {earned} / {total} points")


def report(exercises: dict[str, Exercise], impl: str, chapter: int, errors: list[str] = ()) -> dict:
    """The machine-readable report that ``--json`` prints."""
    ordered = _ordered(exercises)
    return {"chapter": chapter, "impl": impl,
            "score": sum(ex.earned for ex in ordered), "total": sum(ex.points for ex in ordered),
            "passed": bool(ordered) and all(ex.ok for ex in ordered),
            "exercises": [ex.as_dict() for ex in ordered], "errors": list(errors)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.grade", description=__doc__.splitlines()[0])
    parser.add_argument("chapter", type=int, help="chapter number, e.g. 1")
    parser.add_argument("--impl", choices=["exercises", "solutions"], default="exercises",
                        help="grade your exercises (default) or the reference solutions")
    parser.add_argument("--exercises", metavar="DIR",
                        help="grade DIR/chNN.py (a copy of exercises/) instead of exercises/chNN.py")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show pytest's output and tracebacks, and every exercise's message")
    parser.add_argument("--only", metavar="ID[,ID...]",
                        help="grade only these exercises, e.g. --only 3.2 (the others are not run)")
    parser.add_argument("--json", action="store_true", help="print a machine-readable JSON report")
    parser.add_argument("--hint", metavar="ID",
                        help="show the next hint of exercise ID (e.g. 3.1); run again for the next level")
    parser.add_argument("--level", type=int, metavar="K", help="with --hint: show hint level K (1, 2 or 3)")
    args = parser.parse_args(argv)
    if args.level is not None and args.hint is None:
        parser.error("--level needs --hint ID")
    if args.hint is not None:
        return hints.main(args.chapter, args.hint, args.level)
    if args.exercises is not None and not Path(args.exercises).is_dir():
        parser.error(f"--exercises {args.exercises}: not a directory")
    only = None
    if args.only is not None:
        only = {i if "." in i else f"{args.chapter}.{i}" for i in args.only.replace(" ", "").split(",") if i}
    if args.json:
        # Keep stdout pure JSON: pytest's own output (--verbose) goes to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            collector = _run(args.chapter, args.impl, args.verbose, args.exercises, only)
        result = report(collector.exercises, args.impl, args.chapter, collector.errors)
        print(json.dumps(result, indent=2, ensure_ascii=False))
        return 0 if result["passed"] else 1
    collector = _run(args.chapter, args.impl, args.verbose, args.exercises, only)
    for error in collector.errors:
        print(f"\nThe graded tests of chapter {args.chapter} could not be loaded:\n{error}")
    if not collector.exercises:
        which = f" for {', '.join(sorted(only))}" if only else ""
        print(f"no graded tests were collected for chapter {args.chapter}{which}")
        return 1
    print_table(collector.exercises, args.impl, args.chapter, args.verbose, args.exercises)
    return 0 if all(ex.ok for ex in collector.exercises.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
