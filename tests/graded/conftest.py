"""Graded tests get an ``impl`` fixture: the chapter's module from ``exercises`` or ``solutions``.

One test body grades both. Under ``--impl both`` (what `make test` and CI use) each graded
test runs twice: on ``solutions`` it must pass, and on the untouched ``exercises`` stubs it is
a strict expected failure that must raise ``NotImplementedError`` (a test that passes on a
stub, or fails for another reason, fails the suite).
"""
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest


def pytest_generate_tests(metafunc):
    if "impl" not in metafunc.fixturenames:
        return
    choice = metafunc.config.getoption("--impl")
    params = []
    if choice in ("both", "solutions"):
        params.append(pytest.param("solutions", id="solutions"))
    if choice in ("both", "exercises"):
        marks = [pytest.mark.xfail(raises=NotImplementedError, strict=True,
                                   reason="exercise stub: must raise NotImplementedError")] if choice == "both" else []
        params.append(pytest.param("exercises", id="exercises", marks=marks))
    metafunc.parametrize("impl", params, indirect=True)


@pytest.fixture
def impl(request):
    """``exercises.chNN`` or ``solutions.chNN`` for the test module ``test_chNN.py``.

    ``MINILLM_EXERCISES_DIR=DIR`` (set by ``python -m minillm.grade --exercises DIR``) grades
    ``DIR/chNN.py`` instead of ``exercises/chNN.py``: a copy of your work kept elsewhere.
    """
    chapter = re.search(r"test_(ch\d\d)", request.module.__name__).group(1)
    elsewhere = os.environ.get("MINILLM_EXERCISES_DIR")
    if request.param == "exercises" and elsewhere:
        return _load(Path(elsewhere).resolve() / f"{chapter}.py", f"exercises.{chapter}")
    return importlib.import_module(f"{request.param}.{chapter}")


def _load(path: Path, name: str):
    """Import the module at ``path`` as ``name`` (once; a module that fails to import is retried)."""
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None) == str(path):
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or not path.exists():
        raise ModuleNotFoundError(f"no module {name}: {path} does not exist", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
