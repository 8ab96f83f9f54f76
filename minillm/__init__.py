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
    if (Path(__file__).parent / "kernels").is_dir() or "minillm.kernels" in sys.modules:
        return
    folder = Path(__file__).resolve().parent.parent / "kernels"
    if not folder.is_dir():
        return
    spec = importlib.machinery.ModuleSpec("minillm.kernels", None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    module = importlib.util.module_from_spec(spec)
    module.__doc__ = "The Triton kernels, one module per chapter (the repository's kernels/ folder)."
    sys.modules["minillm.kernels"] = module
    globals()["kernels"] = module


_map_checkout_kernels()
