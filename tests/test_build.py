"""How the package is built: the extension must run on torch's C++ runtime, not carry a copy of its
own (setup.py, "The C++ runtime": a private libstdc++ turned error paths into crashes), and the
source distribution must hold what a build from it and its tests need (MANIFEST.in); an extension that
does not load says why (_extension.py)."""
import os
import shutil
import subprocess
import sys
import tarfile
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
# What a source tree holds besides the sources: build outputs, environments, a fetched CUTLASS.
_NOT_SOURCES = shutil.ignore_patterns(".*", "build", "dist", "*venv*", "__pycache__", "*.egg-info", "*.so", "*.o",
                                      "cutlass", "cutlass.partial")


@pytest.mark.skipif(not (ROOT / "setup.py").is_file(), reason="needs the source tree")
@pytest.mark.skipif(not (Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda") / "bin" / "nvcc").is_file(),
                    reason="setup.py needs the CUDA toolkit (CUDA_HOME)")
def test_sdist_holds_every_header_the_pin_and_the_test_helpers(tmp_path):
    # A copy of the tree: setup.py writes python/mla_attn/_build_config.py and the egg-info in its tree.
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=_NOT_SOURCES)
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path / "dist")], cwd=tree,
                   check=True, capture_output=True, text=True)
    (sdist,) = (tmp_path / "dist").glob("mla_attn-*.tar.gz")
    with tarfile.open(sdist) as tar:
        shipped = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    needed = {str(p.relative_to(tree)) for d in ("csrc", "tests") for p in (tree / d).rglob("*") if p.is_file()}
    needed |= {"setup.py", "pyproject.toml", "LICENSE", "README.md", "third_party/cutlass.pin", "scripts/fetch_cutlass.sh"}
    assert needed - shipped == set()
    # Generated with the builder's paths and flags: a build from the sdist writes its own.
    assert "python/mla_attn/_build_config.py" not in shipped


def _package_copy(tmp_path, extra: dict) -> Path:
    """mla_attn's Python files without the build (_C, _build_config), plus `extra` {file: text}."""
    pkg = tmp_path / "mla_attn"
    shutil.copytree(Path(mla_attn.__file__).parent, pkg,
                    ignore=shutil.ignore_patterns("_C*", "_build_config.py", "__pycache__"))
    for name, text in extra.items():
        (pkg / name).write_text(text)
    return tmp_path


def _import_error(path: Path) -> str:
    run = subprocess.run([sys.executable, "-c", "import mla_attn"], env={**os.environ, "PYTHONPATH": str(path)},
                         capture_output=True, text=True)
    assert run.returncode != 0
    return run.stderr.strip().splitlines()[-1]


def test_import_without_a_build_says_so(tmp_path):
    message = _import_error(_package_copy(tmp_path, {}))
    assert message.startswith("ImportError: mla_attn's CUDA extension (mla_attn._C) is not built; build it: pip install")


def test_import_under_another_torch_names_both_versions(tmp_path):
    # An _C that fails as a build for another torch does (its symbols are missing from this torch).
    path = _package_copy(tmp_path, {
        "_build_config.py": 'TORCH_VERSION = "2.0.0+built"\nNVCC_VERSION = "12.4"\n',
        "_C.py": 'raise ImportError("_C.so: undefined symbol: _ZN3c1017RegisterOperators")\n'})
    message = _import_error(path)
    assert f"built against torch 2.0.0+built but torch {torch.__version__} is running" in message
    assert "undefined symbol: _ZN3c1017RegisterOperators" in message and "rebuild" in message


def test_load_failure_under_the_same_torch_names_the_build(monkeypatch):
    from mla_attn import _build_config as built
    monkeypatch.setattr(built, "TORCH_VERSION", torch.__version__)
    message = _extension.load_failure(ImportError("libcudart.so.13: cannot open shared object file"))
    assert "libcudart.so.13" in message and f"built with torch {torch.__version__}" in message
