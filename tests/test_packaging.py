"""How the Triton kernels are found: the top-level ``kernels/`` folder is the subpackage
``minillm.kernels`` in every way minillm runs, and never the top-level package ``kernels``.

- a wheel installs it as ``minillm/kernels/`` (setuptools ``package-dir``), and the installed
  copy imports from any directory;
- the editable install (the ``.venv`` of ``make``) and ``PYTHONPATH=<repo>`` without any
  install (``scripts/gpu.sh`` on the GPU machine) map the folder at import time
  (``minillm/__init__.py``);
- PyPI has a package named ``kernels`` that transformers imports when it is installed. With
  the repository root on ``sys.path`` (cwd = the root), the installed one must win, and
  without one, ``import kernels`` must not run our modules (the folder has no
  ``__init__.py``: at most a namespace portion, which transformers ignores).

Each check runs a fresh interpreter (``subprocess``). Where the editable install must be out of
the way, it runs ``python -S`` (no ``site``, so no ``.pth`` file and no editable finder) with
the venv's site-packages appended to ``sys.path`` by hand. The wheel is built offline from a
copy of the sources (``pip wheel --no-deps --no-build-isolation --no-index``), in seconds.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
#: The current venv's site-packages (torch, triton, numpy...), added without their .pth files.
SITE_PACKAGES = list(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))
CHAPTER_KERNELS = sorted(p.name for p in (REPO / "kernels").glob("ch[0-9][0-9]_*.py"))


def python(code: str, *, cwd, pythonpath=(), no_site: bool = False, timeout: float = 300) -> str:
    """Run ``code`` in a fresh interpreter; returns its stdout, fails the test on a non-zero exit.

    ``no_site``: ``python -S`` with ``SITE_PACKAGES`` appended to ``sys.path`` (so the editable
    install's finder, installed by a ``.pth`` file, is absent). ``pythonpath``: ``PYTHONPATH``.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME")}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    argv, code = [sys.executable], textwrap.dedent(code)
    if no_site:
        argv.append("-S")
        code = f"import sys; sys.path.extend({SITE_PACKAGES!r})\n" + code
    proc = subprocess.run(argv + ["-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc.stdout


def repo_packages() -> set[str]:
    """Every package of the repository that a wheel must ship: folders with an ``__init__.py``
    under ``minillm/``, ``exercises``, ``solutions``, and ``minillm.kernels`` (``kernels/``)."""
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "minillm").rglob("__init__.py")}
    return found | {"exercises", "solutions", "minillm.kernels"}


# == the wheel ===================================================================================

def _setuptools_ok() -> bool:
    need = next(r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools"))
    try:
        have = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    return tuple(int(x) for x in have.split(".")[:1]) >= tuple(int(x) for x in need.split(">=")[1].split(".")[:1])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the sources (the build writes ``build/`` and
    ``*.egg-info`` beside them, which must not touch the working tree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".ipynb_checkpoints")
    for name in ("pyproject.toml", "README.md", "LICENSE", "minillm", "kernels", "exercises", "solutions"):
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        elif path.exists():
            shutil.copy(path, src / name)
    # Offline: the venv's own setuptools (pyproject's dev extras pin it) instead of an isolated
    # build environment fetched from the index.
    isolation = ["--no-build-isolation", "--no-index"] if _setuptools_ok() else []
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", str(src),
                           "-w", str(tmp / "dist")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = (tmp / "dist").glob("minillm-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed into a fresh folder (``pip install --target``, no dependencies)."""
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target


def test_pyproject_lists_every_package():
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]) == repo_packages()
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"minillm.kernels": "kernels"}
    assert not (REPO / "kernels" / "__init__.py").exists(), "kernels/ must stay a folder, not a package"


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = sorted(n.removeprefix("minillm/kernels/") for n in names if n.startswith("minillm/kernels/"))
    assert kernels == sorted(CHAPTER_KERNELS + ["base.py"]) and len(CHAPTER_KERNELS) >= 7
    assert not any(n.startswith("kernels/") for n in names), "the wheel must not ship a top-level kernels package"
    for package in repo_packages() - {"minillm.kernels"}:
        assert package.replace(".", "/") + "/__init__.py" in names, package
    for name in ("minillm/__main__.py", "minillm/experiments/ch09_engine_benchmark.py",
                 "minillm/checkpoints/shakespeare/model.safetensors", "minillm/checkpoints/shakespeare/tokenizer.json",
                 "minillm/data/shakespeare_sample.txt", "exercises/hints/1.1.md"):
        assert name in names, name
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "minillm = minillm.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_installed_wheel_imports_from_outside_the_repo(installed, tmp_path):
    out = python(f"""
        import json, sys
        sys.path.insert(0, {str(installed)!r})
        import minillm, minillm.kernels, minillm.kernels.ch04_flash_attention as k, minillm.kernels.base
        import minillm.reference.ch04_flash_attention as r, minillm.experiments.ch09_engine_benchmark
        import importlib.util
        print(json.dumps({{"minillm": minillm.__file__, "kernel": k.__file__, "reference": r.__file__,
                          "kernels_path": list(minillm.kernels.__path__), "toplevel": importlib.util.find_spec("kernels")
                          is not None, "editable": [m for m in sys.modules if "editable" in m]}}))
    """, cwd=tmp_path, no_site=True)
    got = json.loads(out)
    assert got["minillm"] == str(installed / "minillm" / "__init__.py")
    assert got["kernel"] == str(installed / "minillm" / "kernels" / "ch04_flash_attention.py")
    assert got["reference"] == str(installed / "minillm" / "reference" / "ch04_flash_attention.py")
    assert got["kernels_path"] == [str(installed / "minillm" / "kernels")]
    assert not got["toplevel"] and not got["editable"]


def test_installed_wheel_runs_python_dash_m_minillm(installed, tmp_path):
    out = python(f"""
        import runpy, sys
        sys.path.insert(0, {str(installed)!r})
        sys.argv = ["minillm", "--help"]
        try:
            runpy.run_module("minillm", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            assert e.code == 0, e.code
        import minillm
        assert minillm.__file__.startswith({str(installed)!r}), minillm.__file__
    """, cwd=tmp_path, no_site=True)
    assert "usage: minillm" in out and "serve" in out and "generate" in out


# == python -m minillm ===========================================================================

def _run(argv, cwd):
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_python_dash_m_minillm_is_the_minillm_command(tmp_path):
    module = _run([sys.executable, "-m", "minillm", "--help"], tmp_path)
    assert module.returncode == 0 and module.stdout.startswith("usage: minillm "), module.stderr
    script = Path(sys.executable).with_name("minillm")
    if script.exists():  # the console script of the installed (editable) package
        command = _run([str(script), "--help"], tmp_path)
        assert (command.returncode, command.stdout) == (0, module.stdout)
    # a subcommand's error path: one line on stderr, exit 2, as the command does
    for argv in ([sys.executable, "-m", "minillm"], [str(script)] if script.exists() else None):
        if argv is None:
            continue
        proc = _run(argv + ["generate", "hi", "--model", str(tmp_path / "nope")], tmp_path)
        assert proc.returncode == 2 and proc.stderr.startswith("minillm generate: "), proc.stderr
        assert "nope" in proc.stderr and "Traceback" not in proc.stderr


# == a checkout: the editable install, and PYTHONPATH=<repo> (scripts/gpu.sh) ======================

def test_editable_install_maps_kernels_into_the_repo(tmp_path):
    # The venv's own record (not the minillm.egg-info a checkout may hold in its root).
    dists = importlib.metadata.distributions(name="minillm", path=SITE_PACKAGES)
    direct_urls = [json.loads(d.read_text("direct_url.json") or "{}") for d in dists]
    if not any(u.get("dir_info", {}).get("editable") for u in direct_urls):
        pytest.skip("minillm is not installed in editable mode in this environment")
    out = python("""
        import json, minillm.kernels, minillm.kernels.ch04_flash_attention as k
        print(json.dumps({"minillm": minillm.__file__, "kernel": k.__file__,
                          "kernels_path": list(minillm.kernels.__path__)}))
    """, cwd=tmp_path)
    got = json.loads(out)
    assert got["minillm"] == str(REPO / "minillm" / "__init__.py")
    assert got["kernel"] == str(REPO / "kernels" / "ch04_flash_attention.py")
    assert got["kernels_path"] == [str(REPO / "kernels")]


def test_repo_on_pythonpath_without_install(tmp_path):
    """What ``scripts/gpu.sh`` does: ``PYTHONPATH=<repo>``, nothing installed (here: the
    editable finder kept out with ``python -S``), from another directory."""
    out = python("""
        import json, sys
        finders = [type(f).__name__ if not isinstance(f, type) else f.__name__ for f in sys.meta_path]
        import minillm.kernels.ch07_flash_decoding as k
        import minillm
        print(json.dumps({"minillm": minillm.__file__, "kernel": k.__file__, "finders": finders,
                          "editable": [m for m in sys.modules if "editable" in m],
                          "toplevel": [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]}))
    """, cwd=tmp_path, pythonpath=[REPO], no_site=True)
    got = json.loads(out)
    assert not got["editable"] and "_EditableFinder" not in got["finders"]
    assert got["minillm"] == str(REPO / "minillm" / "__init__.py")
    assert got["kernel"] == str(REPO / "kernels" / "ch07_flash_decoding.py")
    assert got["toplevel"] == []


# == no clash with PyPI's `kernels` ===============================================================

STANDIN = '''
"""A stand-in for PyPI's ``kernels`` (the names transformers' hub-kernels integration imports)."""
import contextlib
import enum

__version__ = {version!r}
STANDIN = True
CALLS = []


class Mode(enum.Flag):
    INFERENCE = enum.auto()
    TRAINING = enum.auto()
    TORCH_COMPILE = enum.auto()
    FALLBACK = enum.auto()


class _Thing:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class LayerRepository(_Thing): pass
class LocalLayerRepository(_Thing): pass
class FuncRepository(_Thing): pass
class LocalFuncRepository(_Thing): pass
class Device(_Thing): pass
class CUDAProperties(_Thing): pass
class ROCMProperties(_Thing): pass
class KernelizeFallback(_Thing): pass


def use_kernel_forward_from_hub(layer_name):
    CALLS.append(("use_kernel_forward_from_hub", layer_name))
    return lambda cls: cls


def use_kernelized_func(*funcs):
    CALLS.append(("use_kernelized_func", len(funcs)))
    return lambda cls: cls


def use_kernel_mapping(*args, **kwargs):
    return contextlib.nullcontext()


def register_kernel_mapping(*args, **kwargs):
    CALLS.append(("register_kernel_mapping",))


def replace_kernel_forward_from_hub(*args, **kwargs):
    CALLS.append(("replace_kernel_forward_from_hub",))


def kernelize(model, *args, **kwargs):
    return model


def get_kernel(*args, **kwargs):
    raise RuntimeError("stand-in kernels: no hub here")


def __getattr__(name):  # names a later transformers may import: harmless classes
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Thing,), {{}})
'''


def _pypi_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_installed_pypi_kernels_wins_over_the_folder(tmp_path):
    """cwd = the repository root (``''`` first on ``sys.path``), a regular ``kernels`` package
    later on the path: Python takes the regular package, transformers imports its hub-kernels
    integration from it and loads a tiny Llama; ``minillm.kernels`` is still our folder."""
    transformers = pytest.importorskip("transformers")
    from transformers.utils import import_utils

    version = getattr(import_utils, "KERNELS_MIN_VERSION", "0.4.0")
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text(STANDIN.format(version=version))
    info = site / f"kernels-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kernels\nVersion: {version}\n")
    (info / "top_level.txt").write_text("kernels\n")
    model_dir = tmp_path / "tiny-llama"
    out = python(f"""
        import json, sys
        assert sys.path[0] == "", sys.path[:2]       # the repository root (cwd) comes first
        import kernels
        from transformers.utils.import_utils import is_kernels_available
        import torch, transformers
        from transformers.integrations import hub_kernels
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained({str(model_dir)!r})
        model = transformers.AutoModelForCausalLM.from_pretrained({str(model_dir)!r}).eval()
        with torch.no_grad():
            logits = model(torch.tensor([[1, 2, 3]])).logits
        import minillm.kernels.ch01_naive_attention as ours
        print(json.dumps({{"file": kernels.__file__, "standin": getattr(kernels, "STANDIN", False),
                          "available": is_kernels_available(), "hub": hub_kernels.__name__,
                          "calls": [list(c) for c in kernels.CALLS], "shape": list(logits.shape),
                          "finite": bool(torch.isfinite(logits).all()), "ours": ours.__file__,
                          "same": sys.modules["kernels"] is kernels}}))
    """, cwd=REPO, pythonpath=[site])
    got = json.loads(out)
    assert got["file"] == str(site / "kernels" / "__init__.py") and got["standin"] and got["same"]
    assert got["available"], "transformers did not accept the stand-in's version"
    assert ["use_kernel_forward_from_hub", "RMSNorm"] in got["calls"], got["calls"]
    assert got["shape"] == [1, 3, 64] and got["finite"]
    assert got["ours"] == str(REPO / "kernels" / "ch01_naive_attention.py")


@pytest.mark.skipif(_pypi_kernels_installed(), reason="a `kernels` distribution is installed here")
def test_without_pypi_kernels_the_folder_is_never_kernels():
    """cwd = the repository root and no ``kernels`` installed: ``import kernels`` finds at
    most a namespace portion (no ``__file__``, no module of ours runs), and transformers does
    not take it for the PyPI package."""
    out = python("""
        import json, sys
        import kernels
        import minillm.kernels.ch01_naive_attention, minillm.kernels.base
        try:
            from transformers.utils.import_utils import is_kernels_available
            available = is_kernels_available()
        except ImportError:
            available = None
        print(json.dumps({"file": getattr(kernels, "__file__", None), "path": list(getattr(kernels, "__path__", [])),
                          "modules": sorted(m for m in sys.modules if m.startswith("kernels.")),
                          "available": available}))
    """, cwd=REPO)
    got = json.loads(out)
    assert got["file"] is None, got
    assert got["path"] == [str(REPO / "kernels")]
    assert got["modules"] == []
    assert got["available"] in (False, None)
