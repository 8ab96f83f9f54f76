"""A Griffe extension for the docs site (mkdocs.yml, mkdocstrings' python handler): the
repository's top-level ``kernels/`` folder documented as ``minillm.kernels``.

At run time ``minillm/__init__.py`` maps the folder to ``minillm.kernels`` (a wheel installs it
there), but Griffe reads the sources statically and finds no ``minillm/kernels/``. When Griffe
has loaded the ``minillm`` package, this visits ``kernels/*.py`` and attaches them as the
members of a ``minillm.kernels`` module, so ``::: minillm.kernels.ch04_flash_attention`` in
docs/api/kernels.md works and the kernels' imports of each other (``from minillm.kernels.base import
launch``) resolve.
"""
from __future__ import annotations

from pathlib import Path

import griffe

DOCSTRING = "The Triton kernels, one module per chapter (the repository's kernels/ folder)."


class MinillmKernels(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        if pkg.name != "minillm" or "kernels" in pkg.members or not isinstance(pkg.filepath, Path):
            return
        folder = pkg.filepath.parent.parent / "kernels"
        if not folder.is_dir():
            return
        kernels = griffe.Module("kernels", filepath=[folder], parent=pkg, lines_collection=loader.lines_collection,
                                modules_collection=loader.modules_collection)
        kernels.docstring = griffe.Docstring(DOCSTRING, parent=kernels)
        pkg.set_member("kernels", kernels)
        for path in sorted(folder.glob("*.py")):
            code = path.read_text(encoding="utf-8")
            loader.lines_collection[path] = code.splitlines(keepends=False)
            module = griffe.visit(path.stem, filepath=path, code=code, parent=kernels, extensions=loader.extensions,
                                  docstring_parser=loader.docstring_parser, docstring_options=loader.docstring_options,
                                  lines_collection=loader.lines_collection,
                                  modules_collection=loader.modules_collection)
            kernels.set_member(path.stem, module)
