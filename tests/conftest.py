"""Shared test fixtures: GPU skipping, the reference data in tests/data, a clean dispatcher per test."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

HAS_GPU = torch.cuda.is_available()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread per worker, and for the processes its tests start: the workers already fill the cores,
    # and more OpenMP threads than cores spend their time spinning against each other.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per core on the CPU; none on a GPU machine, where the
    GPU tests would share one GPU and its memory."""
    if HAS_GPU:
        return 0
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Reference data shipped with the tests: aiter's own CSV tables (MIT, see its LICENSE-aiter) and
# Hugging Face config.json files of real models.
DATA = pathlib.Path(__file__).resolve().parent / "data"
AITER_CONFIGS = DATA / "aiter-configs"
MODEL_CONFIGS = DATA / "models"


@pytest.fixture
def aiter_configs() -> pathlib.Path:
    """The folder of aiter's reference CSV tables."""
    return AITER_CONFIGS


@pytest.fixture
def model_configs() -> pathlib.Path:
    """The folder of model config.json files (llama-3-8b.json, tiny-llama.json, ...)."""
    return MODEL_CONFIGS


@pytest.fixture
def gpu() -> torch.device:
    if not HAS_GPU:
        pytest.skip("needs a CUDA/ROCm GPU")
    return torch.device("cuda")


@pytest.fixture
def usable(gpu):
    """usable(backend) -> the backend, or the test skipped with the reason it cannot run on the GPU."""

    def check(backend):
        if not backend.is_available(gpu):
            pytest.skip(backend.unavailable_reason(gpu))
        return backend

    return check


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
    d.set_miss_hook(None)
    yield d
    d.set_config(None)
    d.set_capture(None)
    d.set_miss_hook(None)


class VirtualClock:
    """The tuner's CPU timer plus a virtual offset: a fake "slow" kernel calls sleep(s), which advances
    the clock by s without waiting, so a timing decision cannot race a loaded machine."""

    def __init__(self):
        import time

        self._real = time.perf_counter
        self.extra = 0.0

    def __call__(self) -> float:
        return self._real() + self.extra

    def sleep(self, seconds: float) -> None:
        self.extra += seconds


@pytest.fixture
def virtual_clock(monkeypatch) -> VirtualClock:
    from gemmtune.tuner import timing

    clock = VirtualClock()
    monkeypatch.setattr(timing, "CPU_CLOCK", clock)
    return clock
