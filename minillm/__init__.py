"""minillm: LLM inference from scratch."""
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

#: The model shipped in the repository (see minillm/checkpoints/shakespeare/README.md).
BUNDLED_MODEL = Path(__file__).resolve().parent / "checkpoints" / "shakespeare"


def _map_checkout_kernels() -> None:
    """Make the repository's top-level ``kernels/`` folder the subpackage ``minillm.kernels``.

    A wheel installs the kernels inside the package (``minillm/kernels/``, through setuptools'
    ``package-dir``), and then there is nothing to do. In a checkout (editable install, or the
    repository on ``PYTHONPATH``) the folder lies beside the package; ``kernels/`` has no
    ``__init__.py``, so ``import kernels`` never runs it under that name.
    """
    if "minillm.kernels" in sys.modules:
        return
    checkout = Path(__file__).resolve().parent.parent
    folder = checkout / "kernels"
    # A checkout has pyproject.toml beside the folder (a site-packages dir has neither, and may
    # hold PyPI's unrelated `kernels` package). A stale minillm/kernels/ left by an older
    # checkout must not shadow it, so the checkout's folder wins whenever it is there.
    if not ((checkout / "pyproject.toml").is_file() and (folder / "base.py").is_file()):
        return
    spec = importlib.machinery.ModuleSpec("minillm.kernels", None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    module = importlib.util.module_from_spec(spec)
    module.__doc__ = "The Triton kernels, one module per chapter (the repository's kernels/ folder)."
    sys.modules["minillm.kernels"] = module
    globals()["kernels"] = module


_map_checkout_kernels()
