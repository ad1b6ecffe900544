"""How the package is built: the extension must run on torch's C++ runtime, not carry a copy of its
own (setup.py, "The C++ runtime": a private libstdc++ turned error paths into crashes), and the
source distribution must hold what a build from it and its tests need (MANIFEST.in)."""
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import mla_attn._C as ext


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
