"""Gradients for runners that only compute the forward (Triton kernels): plain matmuls backward."""

from __future__ import annotations

import torch

from ..backends.base import Runner


def linear_backward(grad, x, w, bias_needed: bool):
    """(grad_x, grad_w, grad_bias) of y = x @ w^T + b, in the inputs' dtypes."""
    g = grad.to(x.dtype)
    grad_x = g @ w
    g2 = g.reshape(-1, g.shape[-1])
    grad_w = g2.t() @ x.reshape(-1, x.shape[-1])
    grad_b = g2.sum(0) if bias_needed else None
    return grad_x, grad_w, grad_b


class _RunnerFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, runner):
        ctx.save_for_backward(x, w)
        ctx.has_bias = bias is not None
        return runner(x, w, bias)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gx, gw, gb = linear_backward(grad, x, w, ctx.has_bias)
        return gx, gw, (gb.to(grad.dtype) if gb is not None else None), None


def with_autograd(runner: Runner) -> Runner:
    return lambda x, w, bias: _RunnerFn.apply(x, w, bias, runner)
