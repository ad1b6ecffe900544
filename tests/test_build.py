"""How the extension was linked: it must run on torch's C++ runtime, not carry a copy of its own
(setup.py, "The C++ runtime": a private libstdc++ turned error paths into crashes)."""
import shutil
import subprocess

import pytest

import mla_attn._C as ext


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_extension_uses_the_shared_cxx_runtime():
    out = subprocess.check_output(["nm", "-D", "--defined-only", ext.__file__], text=True)
    defined = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert "__cxa_throw" not in defined and "__gxx_personality_v0" not in defined, (
        f"{ext.__file__} defines the C++ runtime (static libstdc++)")
