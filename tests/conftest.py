import pytest
import torch


def _has_hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an sm_90 (Hopper) GPU; skipped otherwise")


def pytest_collection_modifyitems(config, items):
    if _has_hopper():
        return
    skip = pytest.mark.skip(reason="needs an sm_90 (Hopper) GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
