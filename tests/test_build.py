"""How the package is built: the extension must run on torch's C++ runtime, not carry a copy of its
own (setup.py, "The C++ runtime": a private libstdc++ turned error paths into crashes), and the
source distribution must hold what a build from it and its tests need (MANIFEST.in); an extension that
does not load says why (_extension.py)."""
import os
import shutil
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest
import torch

import mla_attn
import mla_attn._C as ext
from mla_attn import _extension


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_extension_uses_the_shared_cxx_runtime():
    out = subprocess.check_output(["nm", "-D", "--defined-only", ext.__file__], text=True)
    defined = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert "__cxa_throw" not in defined and "__gxx_personality_v0" not in defined, (
        f"{ext.__file__} defines the C++ runtime (static libstdc++)")


ROOT = Path(__file__).resolve().parents[1]


def _not_sources(directory: str, names: list) -> set:
    """What a source tree holds besides its sources: environments, build outputs and dot folders at its
    top, a fetched CUTLASS, caches and binaries anywhere."""
    here = Path(directory).relative_to(ROOT)
    if here == Path("."):
        return {n for n in names if n.startswith(".") or n in ("build", "dist") or "venv" in n}
    if here == Path("third_party"):
        return {n for n in names if n != "cutlass.pin"}
    return {n for n in names if n == "__pycache__" or n.endswith((".egg-info", ".so", ".o", ".pyc"))}


def _setup_py_without_cuda(tmp_path, *args: str) -> tuple:
    """setup.py `args` in a copy of the tree (it writes the egg-info there), with CUDA_HOME pointing
    nowhere. -> (the copy, the finished process)."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=_not_sources)
    env = {**os.environ, "CUDA_HOME": str(tmp_path / "no-cuda-here")}
    run = subprocess.run([sys.executable, "setup.py", "-q", *args], cwd=tree, env=env, capture_output=True, text=True)
    return tree, run


@pytest.mark.skipif(not (ROOT / "setup.py").is_file(), reason="needs the source tree")
def test_sdist_holds_every_header_the_pin_and_the_test_helpers(tmp_path):
    # No CUDA toolkit: packaging the sources must not need one (a release's sdist is often made on a
    # machine without it).
    tree, run = _setup_py_without_cuda(tmp_path, "sdist", "--dist-dir", str(tmp_path / "dist"))
    assert run.returncode == 0, run.stderr[-4000:]
    (sdist,) = (tmp_path / "dist").glob("mla_attn-*.tar.gz")
    with tarfile.open(sdist) as tar:
        shipped = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    needed = {str(p.relative_to(tree)) for d in ("csrc", "tests", "examples") for p in (tree / d).rglob("*")
              if p.is_file()}
    needed |= {"setup.py", "pyproject.toml", "LICENSE", "README.md", "third_party/cutlass.pin",
               "scripts/fetch_cutlass.sh"}
    assert needed - shipped == set()
    # Generated with the builder's paths and flags: a build from the sdist writes its own.
    assert "python/mla_attn/_build_config.py" not in shipped


@pytest.mark.skipif(not (ROOT / "setup.py").is_file(), reason="needs the source tree")
def test_a_call_that_also_builds_looks_for_the_toolchain(tmp_path):
    # `setup.py sdist bdist_wheel` must build the extension, not ship a wheel without it: with no
    # toolkit it stops at the nvcc lookup, before compiling anything.
    _, run = _setup_py_without_cuda(tmp_path, "sdist", "--dist-dir", str(tmp_path / "dist"),
                                    "bdist_wheel", "--dist-dir", str(tmp_path / "dist"))
    assert run.returncode != 0 and f"no nvcc at {tmp_path / 'no-cuda-here'}" in run.stderr, run.stderr[-4000:]
    assert not list((tmp_path / "dist").glob("*.whl"))


def _package_copy(tmp_path, extra: dict) -> Path:
    """mla_attn's Python files without the build (_C, _build_config), plus `extra` {file: text}."""
    pkg = tmp_path / "mla_attn"
    shutil.copytree(Path(mla_attn.__file__).parent, pkg,
                    ignore=shutil.ignore_patterns("_C.*", "_build_config.py", "__pycache__"))
    for name, text in extra.items():
        (pkg / name).write_text(text)
    return tmp_path


def _import_error(path: Path) -> str:
    """The last line of what `import mla_attn` prints when it fails, with only `path` ahead of the
    installed packages (run there: the working folder comes first on sys.path)."""
    run = subprocess.run([sys.executable, "-c", "import mla_attn"], cwd=path,
                         env={**os.environ, "PYTHONPATH": str(path)}, capture_output=True, text=True)
    assert run.returncode != 0 and run.stderr.strip(), run.stderr
    return run.stderr.strip().splitlines()[-1]


def test_import_without_a_build_says_so(tmp_path):
    message = _import_error(_package_copy(tmp_path, {}))
    assert message.startswith(f"ImportError: mla_attn's CUDA extension is not built in {tmp_path / 'mla_attn'}; "
                              "build it: pip install")


def test_import_with_a_build_for_another_python_names_it(tmp_path):
    other = "_C.cpython-39-x86_64-linux-gnu.so"  # never this interpreter's suffix (Python >= 3.10)
    message = _import_error(_package_copy(tmp_path, {other: ""}))
    assert f"is not built in {tmp_path / 'mla_attn'} (it holds {other}, built for another Python)" in message


def test_import_with_a_missing_dependency_of_the_build_names_it(tmp_path):
    message = _import_error(_package_copy(tmp_path, {"_C.py": "import libcudart_that_is_missing\n"}))
    assert "does not load" in message and "libcudart_that_is_missing" in message and "not built" not in message


def test_import_under_another_torch_names_both_versions(tmp_path):
    # An _C that fails as a build for another torch does (its symbols are missing from this torch).
    path = _package_copy(tmp_path, {
        "_build_config.py": 'TORCH_VERSION = "2.0.0+built"\nNVCC_VERSION = "12.4"\n',
        "_C.py": 'raise ImportError("_C.so: undefined symbol: _ZN3c1017RegisterOperators")\n'})
    message = _import_error(path)
    assert f"built against torch 2.0.0+built but torch {torch.__version__} is running" in message
    assert "undefined symbol: _ZN3c1017RegisterOperators" in message and "rebuild" in message


@pytest.mark.parametrize("config", [{"TORCH_VERSION": torch.__version__, "NVCC_VERSION": "13.0"}, {}],
                         ids=["same_torch", "no_versions"])
def test_load_failure_without_a_version_mismatch_keeps_the_error(monkeypatch, config):
    monkeypatch.setitem(sys.modules, "mla_attn._build_config", types.SimpleNamespace(**config))
    message = _extension.load_failure(ImportError("libcudart.so.13: cannot open shared object file"))
    assert "does not load (libcudart.so.13: cannot open shared object file)" in message and "rebuild" in message
    assert (f"torch {torch.__version__} and nvcc 13.0" in message) == bool(config)
