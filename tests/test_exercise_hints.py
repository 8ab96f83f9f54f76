"""Every graded exercise has a hint file with three levels, and every stub says, in one line,
what to implement and how to get a hint (`minillm.hints`, docs/exercises.md)."""
import ast
import re
from pathlib import Path

import pytest

from minillm import hints

REPO = Path(__file__).resolve().parent.parent
STUB = re.compile(r"Exercise (?P<id>(?P<ch>\d+)\.\d+)[a-z]? \((?P<name>\w+)\): not started\. "
                  r"Read its docstring; hints: python -m minillm\.grade (?P<ch2>\d+) --hint (?P<id2>\d+\.\d+)")


def exercise_ids() -> list[str]:
    """The ids of every ``@pytest.mark.exercise`` in the graded tests (read with ast)."""
    ids = []
    for path in sorted((REPO / "tests" / "graded").glob("test_ch*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "exercise"
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "mark"):
                ids += [ast.literal_eval(k.value) for k in node.keywords if k.arg == "id"]
    return sorted(set(ids), key=lambda i: [int(p) for p in i.split(".")])


def stub_messages() -> list[tuple[str, int, str]]:
    """``(file, line, message)`` of every ``raise NotImplementedError(...)`` in exercises/."""
    out = []
    for path in sorted((REPO / "exercises").glob("ch*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) \
                    and getattr(node.exc.func, "id", None) == "NotImplementedError":
                args = node.exc.args
                message = ast.literal_eval(args[0]) if args and isinstance(args[0], ast.Constant) else None
                out.append((path.name, node.lineno, message))
    return out


def test_the_graded_tests_have_exercises():
    assert len(exercise_ids()) >= 31


@pytest.mark.parametrize("exercise_id", exercise_ids())
def test_every_exercise_has_three_hints(exercise_id):
    path = hints.hint_file(exercise_id)
    assert path.exists(), f"exercise {exercise_id} has no hint file {path.relative_to(REPO)}"
    text = path.read_text(encoding="utf-8")
    assert re.findall(r"^## Hint (\d+)\s*$", text, flags=re.M) == ["1", "2", "3"], \
        f"{path.name}: exactly the sections '## Hint 1', '## Hint 2', '## Hint 3', in order"
    _, levels = hints.parse(text)
    assert all(len(level) > 20 for level in levels), f"{path.name}: an empty or near-empty hint"


def test_every_stub_says_not_started_in_one_line():
    stubs = stub_messages()
    assert len(stubs) >= 31
    ids = set(exercise_ids())
    for name, line, message in stubs:
        where = f"exercises/{name}:{line}"
        assert isinstance(message, str), f"{where}: the message must be one string literal"
        assert "\n" not in message, f"{where}: one line"
        m = STUB.fullmatch(message)
        assert m, f"{where}: not the one-line form 'Exercise N.M (name): not started. Read its docstring; " \
                  f"hints: python -m minillm.grade N --hint N.M', got {message!r}"
        assert m["id"] == m["id2"] and m["ch"] == m["ch2"] == str(int(name[2:4])), f"{where}: {message!r}"
        assert m["id"] in ids, f"{where}: exercise {m['id']} has no graded test"


def test_hint_parser_rejects_malformed_files():
    with pytest.raises(ValueError):
        hints.parse("## Hint 1\nx\n## Hint 3\ny\n")
    with pytest.raises(ValueError):
        hints.parse("## Hint 1\nx\n## Hint 2\n\n## Hint 3\ny\n")
    assert hints.parse("# Exercise 9.9 — T\n\n## Hint 1\na\n## Hint 2\nb\n## Hint 3\nc\n") == ("Exercise 9.9 — T", ["a", "b", "c"])
