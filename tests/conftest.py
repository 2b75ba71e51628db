"""Shared test fixtures: GPU skipping, the shared/ reference data, a clean dispatcher per test."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
HAS_GPU = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def shared_dir() -> pathlib.Path | None:
    """The project's shared/ folder: $GEMMTUNE_SHARED_DIR, else beside the checkout, else inside it."""
    env = os.environ.get("GEMMTUNE_SHARED_DIR")
    for cand in ([pathlib.Path(env)] if env else []) + [REPO.parent / "shared", REPO / "shared"]:
        if (cand / "reference" / "aiter-configs").is_dir():
            return cand
    return None


@pytest.fixture
def shared() -> pathlib.Path:
    d = shared_dir()
    if d is None:
        pytest.skip("shared/ reference data not found (set GEMMTUNE_SHARED_DIR)")
    return d


@pytest.fixture
def gpu() -> torch.device:
    if not HAS_GPU:
        pytest.skip("needs a CUDA/ROCm GPU")
    return torch.device("cuda")


@pytest.fixture(autouse=True)
def clean_dispatch(monkeypatch):
    """Each test starts with no table, no capture and an empty runner cache."""
    from gemmtune.dispatch import get_dispatcher

    monkeypatch.delenv("GEMMTUNE_CONFIG", raising=False)
    monkeypatch.delenv("GEMMTUNE_CAPTURE", raising=False)
    monkeypatch.delenv("GEMMTUNE_TUNE_ONLINE", raising=False)
    d = get_dispatcher()
    d.set_config(None)
    d.set_capture(None)
    d.set_online_tuning(None)
    yield d
    d.set_config(None)
    d.set_capture(None)
    d.set_online_tuning(None)
