"""Loads the compiled extension (mla_attn._C), and says why when it cannot: Python's own message for a
missing build or a torch upgraded under the build ("undefined symbol: _ZN3c10...") names neither."""
import importlib
from pathlib import Path
from types import ModuleType

import torch

_BUILD = "pip install --no-build-isolation . in the source tree (README: Install and run)"


def load() -> ModuleType:
    # import_module, not `from . import _C`: only its ModuleNotFoundError names the module that is
    # missing, which tells a missing build from a missing dependency of one.
    try:
        return importlib.import_module("._C", __package__)
    except ImportError as error:
        raise ImportError(load_failure(error)) from error


def load_failure(error: ImportError) -> str:
    """The message for an extension that did not load: what setup.py recorded of the build
    (_build_config, written into the package when setup.py builds) against what runs."""
    here = Path(__file__).parent
    if isinstance(error, ModuleNotFoundError) and error.name == f"{__package__}._C":
        others = sorted(p.name for p in here.glob("_C.*.so"))
        found = f" (it holds {', '.join(others)}, built for another Python)" if others else ""
        return f"mla_attn's CUDA extension is not built in {here}{found}; build it: {_BUILD}"
    rebuild = f"rebuild it against the torch in use: {_BUILD}"
    try:
        from . import _build_config as built
    except ImportError:
        built = None
    torch_built = getattr(built, "TORCH_VERSION", None)
    if torch_built is None:
        return f"mla_attn's CUDA extension does not load ({error}); {rebuild}"
    if torch_built != torch.__version__:
        return (f"mla_attn's CUDA extension was built against torch {torch_built} but torch "
                f"{torch.__version__} is running, and it does not load ({error}); {rebuild}")
    return (f"mla_attn's CUDA extension does not load ({error}); setup.py last ran with torch {torch_built} "
            f"and nvcc {getattr(built, 'NVCC_VERSION', '?')}; if torch or the CUDA runtime changed since the "
            f"build, {rebuild}")
