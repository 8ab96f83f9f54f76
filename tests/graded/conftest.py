"""Graded tests get an ``impl`` fixture: the chapter's module from ``exercises`` or ``solutions``.

One test body grades both. Under ``--impl both`` (what `make test` and CI use) each graded
test runs twice: on ``solutions`` it must pass, and on the untouched ``exercises`` stubs it is
a strict expected failure that must raise ``NotImplementedError`` (a test that passes on a
stub, or fails for another reason, fails the suite).
"""
import importlib
import re

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
    """``exercises.chNN`` or ``solutions.chNN`` for the test module ``test_chNN.py``."""
    chapter = re.search(r"test_(ch\d\d)", request.module.__name__).group(1)
    return importlib.import_module(f"{request.param}.{chapter}")
