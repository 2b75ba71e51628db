"""The fmoe family's `torch` backend: pairs of torch stages, every op torch's own.

- `grouped_mm|grouped_mm`: torch._grouped_mm for both GEMMs over the slots sorted by expert, the sort,
  gated activation and combine in torch ops (fmoe/stages.py; the triton backend runs the same pair with
  Triton kernels around the GEMMs);
- `dense|dense`: every expert on every token, masked (capturable anywhere, E times the FLOPs);
- `loop|loop`: a Python loop over the experts hit (eager only, the plain reference formulation).
"""

from __future__ import annotations

import torch

from ...families.fmoe import MoeKey, act_name, join_name
from ...kernels import fused_moe as kmoe
from ..base import Backend, Runner, Solution
from .stages import GM, Call, finish, gated, grouped_mm_fits, pair_runner, stage_runner


def _expert_mlp(key: MoeKey, act: str, x, w1e, w2e, scale=None):
    """One expert on rows x (any batch dims): act(gate) * up, then down; `scale` per row if given."""
    inter = key.inter_dim
    gu = torch.matmul(x, w1e.transpose(-1, -2))
    h = kmoe.act_ref(gu[..., :inter], act) * gu[..., inter:] if gated(key) else kmoe.act_ref(gu, act)
    if scale is not None:
        h = h * scale.unsqueeze(-1).to(h.dtype)
    return torch.matmul(h, w2e.transpose(-1, -2))


def _loop_runner(key: MoeKey) -> Runner:
    act = act_name(key.act_type)

    def run(hidden, w1, w2, topk_weights, topk_ids, expert_map=None):
        call = Call(key, hidden, w1, w2, topk_weights, topk_ids, expert_map)
        ids, weights = call.ids, call.weights
        T, TK = ids.shape
        contrib = torch.zeros(T, TK, w2.shape[1], dtype=torch.float32, device=hidden.device)
        for e in torch.unique(ids[ids >= 0]).tolist():  # host sync: eager only
            t, j = torch.nonzero(ids == e, as_tuple=True)
            scale = weights[t, j] if key.doweight_stage1 else None
            contrib[t, j] = _expert_mlp(key, act, hidden[t], w1[e], w2[e], scale).float()
        return finish(key, contrib, ids, weights, hidden.dtype)

    return run


def _dense_runner(key: MoeKey) -> Runner:
    act = act_name(key.act_type)

    def run(hidden, w1, w2, topk_weights, topk_ids, expert_map=None):
        call = Call(key, hidden, w1, w2, topk_weights, topk_ids, expert_map)
        ids, weights = call.ids, call.weights
        T, TK = ids.shape
        x = hidden.unsqueeze(0).expand(w1.shape[0], T, hidden.shape[1])
        scale = None
        if key.doweight_stage1:  # the weight each expert's row gets (0 where the token did not pick it)
            hit = ids.unsqueeze(0) == torch.arange(w1.shape[0], device=ids.device).view(-1, 1, 1)
            scale = (hit * weights.unsqueeze(0)).sum(-1)
        y = _expert_mlp(key, act, x, w1, w2, scale).float()  # (E, T, H)
        contrib = y[ids.clamp(min=0).long(), torch.arange(T, device=ids.device).unsqueeze(1)]  # (T, TK, H)
        return finish(key, contrib, ids, weights, hidden.dtype)

    return run


def grouped_mm_torch_runner(key: MoeKey) -> Runner:
    """grouped_mm for both stages in plain torch ops (the combine too): a torch._grouped_mm
    implementation of the whole MoE, the baseline benchmarks compare against."""
    return pair_runner(key, GM, GM, triton_glue=False)


LOOP = Solution("torch", join_name("loop", "loop"), 0, 0)
DENSE = Solution("torch", join_name("dense", "dense"), 0, 0)
GROUPED_MM = Solution("torch", join_name(GM, GM), 0, 0)
_TORCH = {s.kernel_name: s for s in (LOOP, DENSE, GROUPED_MM)}


class TorchMoeBackend(Backend):
    name = "torch"
    family = "fmoe"

    def candidates(self, key: MoeKey, device: torch.device) -> list[Solution]:
        return [s for s in (GROUPED_MM, DENSE, LOOP) if self.supports(s, key, device)]

    def default_solution(self, key: MoeKey, device: torch.device) -> Solution:
        """torch's own pick: grouped_mm where it runs, else the loop (CPU) or dense."""
        if self.supports(GROUPED_MM, key, device):
            return GROUPED_MM
        return LOOP if torch.device(device).type == "cpu" else DENSE

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        return _TORCH.get(kernel_name)

    def supports(self, solution: Solution, key: MoeKey, device: torch.device) -> bool:
        if key.q_type != "QuantType.No" or key.q_dtype_w != key.dtype:
            return False
        if solution == GROUPED_MM:
            return grouped_mm_fits(key, device)
        return solution in (LOOP, DENSE)

    def make_runner(self, solution: Solution, key: MoeKey, device: torch.device) -> Runner:
        if solution == GROUPED_MM:
            return grouped_mm_torch_runner(key)
        if solution not in (LOOP, DENSE):
            raise ValueError(f"not a torch fused-MoE solution: {solution.describe()}")
        return {LOOP: _loop_runner, DENSE: _dense_runner}[solution](key)

    # stages: grouped_mm for either stage (pairs of two grouped_mm stages are this backend's)
    def stage_candidates(self, key: MoeKey, device: torch.device, stage: int) -> list[str]:
        return [GM] if grouped_mm_fits(key, device) else []

    def make_stage_runner(self, stage: int, name: str, key: MoeKey, device: torch.device) -> Runner:
        if name != GM:
            raise ValueError(f"not a torch fused-MoE stage: {name!r}")
        return stage_runner(key, stage, GM, triton_glue=False)

    def pair_solution(self, names: tuple[str, ...], key: MoeKey, device: torch.device) -> Solution | None:
        return GROUPED_MM if tuple(names) == (GM, GM) else None


BACKENDS = (TorchMoeBackend(),)
