"""Progressive hints: ``python -m minillm.grade CH --hint ID [--level K]``.

Each exercise has a hint file ``exercises/hints/<id>.md`` (e.g. ``exercises/hints/3.1.md``):
an optional ``# title`` line, then exactly three sections headed ``## Hint 1``, ``## Hint 2``
and ``## Hint 3`` (a nudge; the key idea or equation; pseudocode, never the code itself).

``--hint ID`` shows the next level not yet seen (1, then 2, then 3) and remembers it in
``.minillm/hints.json`` under the repository root (``MINILLM_STATE_DIR`` puts that file
elsewhere); ``--level K`` shows level K again (and counts it as seen).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HINTS_DIR = REPO / "exercises" / "hints"
LEVELS = 3
_SECTION = re.compile(r"^## Hint (\d+)[ \t]*$", re.M)


def hint_file(exercise_id: str) -> Path:
    return HINTS_DIR / f"{exercise_id}.md"


def parse(text: str) -> tuple[str, list[str]]:
    """``(title, [hint 1, hint 2, hint 3])`` of a hint file; ValueError if it is malformed."""
    parts = _SECTION.split(text)
    preamble, numbers, bodies = parts[0], parts[1::2], [b.strip() for b in parts[2::2]]
    if numbers != [str(i) for i in range(1, LEVELS + 1)]:
        raise ValueError(f"expected sections '## Hint 1' … '## Hint {LEVELS}' in order, found {numbers}")
    if not all(bodies):
        raise ValueError("a hint section is empty")
    title = next((line[2:].strip() for line in preamble.splitlines() if line.startswith("# ")), "")
    return title, bodies


def load(exercise_id: str) -> tuple[str, list[str]]:
    return parse(hint_file(exercise_id).read_text(encoding="utf-8"))


def chapter_ids(chapter: int) -> list[str]:
    """The ids with a hint file in chapter ``chapter``, in order."""
    ids = [p.stem for p in HINTS_DIR.glob(f"{chapter}.*.md")]
    return sorted(ids, key=lambda i: [int(x) if x.isdigit() else x for x in i.split(".")])


def state_file() -> Path:
    return Path(os.environ.get("MINILLM_STATE_DIR") or REPO / ".minillm") / "hints.json"


def _read_state() -> dict[str, int]:
    try:
        state = json.loads(state_file().read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _write_state(state: dict[str, int]) -> None:
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")


def revealed(exercise_id: str) -> int:
    """The highest hint level of ``exercise_id`` shown so far (0: none)."""
    level = _read_state().get(exercise_id, 0)
    return level if isinstance(level, int) else 0


def main(chapter: int, exercise_id: str, level: int | None = None) -> int:
    """Print one hint of ``exercise_id`` (chapter ``chapter``); the exit status."""
    if "." not in exercise_id:                      # `--hint 2` in chapter 3 means 3.2
        exercise_id = f"{chapter}.{exercise_id}"
    head = exercise_id.split(".")[0]
    if head != str(chapter) and head.isdigit():
        print(f"Exercise {exercise_id} is in chapter {head}, not {chapter}: "
              f"run python -m minillm.grade {head} --hint {exercise_id}")
        return 2
    if not hint_file(exercise_id).exists():
        known = ", ".join(chapter_ids(chapter)) or "none"
        print(f"No exercise {exercise_id} with hints in chapter {chapter}. Exercises with hints: {known}.")
        return 2
    title, bodies = load(exercise_id)
    seen = revealed(exercise_id)
    if level is None:
        if seen >= LEVELS:
            print(f"You have seen all {LEVELS} hints of exercise {exercise_id}; there are no more. "
                  f"Show one again with --hint {exercise_id} --level K (K = 1 … {LEVELS}). "
                  f"Still stuck? Re-read the chapter's section, or compare with solutions/ch{chapter:02d}.py.")
            return 0
        level = seen + 1
    if not 1 <= level <= LEVELS:
        print(f"--level must be between 1 and {LEVELS}, not {level}")
        return 2
    name = title if exercise_id in title else f"Exercise {exercise_id}" + (f" — {title}" if title else "")
    print(f"{name}: hint {level} of {LEVELS}\n")
    print(bodies[level - 1])
    if level > seen:
        state = _read_state()
        state[exercise_id] = level
        _write_state(state)
    if level < LEVELS:
        print(f"\n(Still stuck? Run the same command again for hint {level + 1} of {LEVELS}.)")
    else:
        print(f"\n(That was the last hint of exercise {exercise_id}.)")
    return 0
