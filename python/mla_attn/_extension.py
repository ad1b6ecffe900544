"""Loads the compiled extension (mla_attn._C), and says why when it cannot: Python's own message for a
missing build or a torch upgraded under the build ("undefined symbol: _ZN3c10...") names neither."""
import importlib
from types import ModuleType

import torch

_INSTALL = "pip install --no-build-isolation . (README, Install)"


def load() -> ModuleType:
    try:
        return importlib.import_module("._C", __package__)
    except ImportError as error:
        raise ImportError(load_failure(error)) from error


def load_failure(error: ImportError) -> str:
    """The message for an extension that did not load: what was built (setup.py's _build_config, next
    to _C), against what runs."""
    if isinstance(error, ModuleNotFoundError) and error.name == f"{__package__}._C":
        return f"mla_attn's CUDA extension (mla_attn._C) is not built; build it: {_INSTALL}"
    rebuild = f"rebuild it against the torch in use: {_INSTALL}"
    try:
        from . import _build_config as built
    except ImportError:
        return f"mla_attn's CUDA extension does not load ({error}); {rebuild}"
    if built.TORCH_VERSION != torch.__version__:
        return (f"mla_attn's CUDA extension was built against torch {built.TORCH_VERSION} but torch "
                f"{torch.__version__} is running, and it does not load ({error}); {rebuild}")
    return (f"mla_attn's CUDA extension does not load ({error}); it was built with torch {built.TORCH_VERSION} "
            f"and nvcc {built.NVCC_VERSION}; if torch or the CUDA runtime changed since, {rebuild}")
