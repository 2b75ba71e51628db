"""What every backend provides. A backend never times itself: the tuner times all of them alike."""

from __future__ import annotations

import importlib
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..device import Needs
from ..keys import GemmKey

# A runner computes one call of its family's op: for a16w16 y[..., N] = x[..., K] @ w[N, K]^T (+ bias)
# in the key's out dtype, called as runner(x, w, bias); other families call runner(*inputs) with the
# tuple their op builds (families/). It is bound to one solution and one key (out dtype included) and
# is what the dispatch cache stores, so nothing is left to decide per call.
Runner = Callable[..., torch.Tensor]


def stable_solidx(kernel_name: str) -> int:
    """A small integer id derived from the kernel name, identical in every process and release.

    aiter's `solidx` column is an int; deriving it from the config string (not a list position)
    keeps it meaning the same kernel after a restart or when the candidate list changes.
    """
    return zlib.crc32(kernel_name.encode()) & 0x7FFFFFFF


@dataclass(frozen=True)
class Solution:
    """One runnable choice: the backend (libtype), its stable ids and its split-K factor."""

    libtype: str
    kernel_name: str
    solidx: int
    splitk: int = 0

    def describe(self) -> str:
        return f"{self.libtype}:{self.kernel_name}"


class Backend(ABC):
    """A set of kernels for one GEMM family. Subclasses set `name`, the table's `libtype` for their
    rows (a library's name: a `torch` row runs torch, a `triton` row a Triton kernel), `family`
    (families/: the key type their methods receive) and `needs` (device.Needs: what the device must
    have), from which availability and its reason derive."""

    name: str = ""
    family: str = "a16w16"
    needs: Needs = Needs()  # by default: runs wherever torch runs

    def library_missing(self, device: torch.device) -> str:
        """Why the backend's library cannot be used on `device` beyond what `needs` says ("" when it
        can): a probe, e.g. loading the bindings of an optional library."""
        return ""

    def unavailable_reason(self, device: torch.device) -> str:
        """Why this backend cannot run on `device`, naming the backend ("" when it can)."""
        device = torch.device(device)
        why = self.needs.missing(device) or self.library_missing(device)
        return f"{self.name} ({self.family}): {why}" if why else ""

    def is_available(self, device: torch.device) -> bool:
        """Can this backend run on `device` at all (library installed, right vendor)?"""
        return not self.unavailable_reason(device)

    @abstractmethod
    def candidates(self, key: GemmKey, device: torch.device) -> list[Solution]:
        """Every solution worth timing for `key` (already pruned of ones that cannot run or win)."""

    def default_solution(self, key: GemmKey, device: torch.device) -> Solution | None:
        """This backend's own cheap choice for a key nobody tuned; None when it has none. What the
        family runs untuned is its policy's decision (backends/<group>/policy.py), which may ask this."""
        return None

    @abstractmethod
    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        """Re-create a solution from a table row; None when the row names nothing this backend knows."""

    @abstractmethod
    def supports(self, solution: Solution, key: GemmKey, device: torch.device) -> bool:
        """Can `solution` compute `key` on `device` (dtypes, alignment, bias, out dtype)?"""

    @abstractmethod
    def make_runner(self, solution: Solution, key: GemmKey, device: torch.device) -> Runner:
        """A callable bound to `solution`; compile/lookup work happens here, not per call."""

    # ---- two-stage families (fmoe): stages timed apart, then paired (tuner/stages.py) ------------
    def stage_candidates(self, key, device: torch.device, stage: int) -> list[str]:
        """Names of this backend's kernels for one stage of `key` (none for a one-stage family)."""
        return []

    def make_stage_runner(self, stage: int, name: str, key, device: torch.device) -> Runner:
        """A callable running one stage alone, as the family's stage_inputs feed it."""
        raise NotImplementedError(f"{self.name} has no stage kernels")

    def pair_solution(self, names: tuple[str, ...], key, device: torch.device) -> Solution | None:
        """This backend's solution running these stage kernels in turn, or None if it has none."""
        return None

    def runner_scope(self, solution: Solution, key) -> tuple:
        """What a runner made for `key` depends on besides the solution: keys with the same scope share
        one runner. By default the whole key (no sharing); a backend whose runners size every launch
        from the call's tensors returns `m_agnostic_scope(key)` so all Ms of a shape share one."""
        return tuple(key)

    def m_agnostic_scope(self, key) -> tuple:
        from ..families import get

        return get(self.family).shape_family(key)


def compile_items_of(backend: Backend) -> Callable | None:
    """A backend's `compile_items(jobs, scope=None) -> [(kernel name, key) or (name, key, builder class)]`
    (a method, or its module's function), if it can compile ahead of time: a backend whose kernels are
    compiled before they run (Triton's) has one, a library's ready-made kernels (torch, cuBLASLt) none.
    `scope` is the tune's CompileScope (tuner/search.py), for backends that also compile what the range
    verification runs. An item names the key of the first job that needs its kernel (or that key at a
    stand-in M)."""
    fn = getattr(backend, "compile_items", None)
    if fn is None:
        fn = getattr(importlib.import_module(type(backend).__module__), "compile_items", None)
    return fn
