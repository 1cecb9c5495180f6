"""The experts' whole GLU FFN per group on one thread each (CPU): the threaded grouped GEMM of
cpu_grouped.py with the activation and product fused in, forward and backward.

Per group g (rows x_g of the expert's slots), on the thread that owns its range:
    forward   a = x_g W_gate[g],  b = x_g W_up[g],  h = act(a) * b,  y_g = h W_down[g]
    backward  dh = dy_g W_down[g]^T,  dW_down[g] = h^T dy_g   (h recomputed from a and b)
              da = act'(a) (dh * b),  db = dh * act(a)
              dx_g = da W_gate[g]^T + db W_up[g]^T,  dW_gate[g] = x_g^T da,  dW_up[g] = x_g^T db
A group's rows stay in this core's cache from one GEMM to the next, the elementwise work runs on
the same threads as the GEMMs, and only a and b (M, F) are kept for backward, where autograd
over three grouped GEMMs keeps a, act(a), b and h. Activations with a known derivative only
(FUSED_ACTIVATIONS); GroupedExperts takes the unfused threaded GEMMs for others.

Shapes: x (M, C) grouped by expert, w_gate and w_up (G, C, F), w_down (G, F, C), counts G ints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from model.moe.cpu_grouped import check_groups, row_starts, run_in_parallel, thread_ranges

# activation -> its backward (grad of the output, input) -> grad of the input
FUSED_ACTIVATIONS: dict[Callable[[Tensor], Tensor], Callable[[Tensor, Tensor], Tensor]] = {
    F.silu: torch.ops.aten.silu_backward,
    F.gelu: torch.ops.aten.gelu_backward,
}


def _forward(
    x: Tensor,
    weights: tuple[Tensor, Tensor, Tensor],
    counts: Sequence[int],
    act: Callable[[Tensor], Tensor],
    n_threads: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> y (M, C), a = x W_gate and b = x W_up (M, F), group by group."""
    w_gate, w_up, w_down = weights
    M, F_ = x.shape[0], w_gate.shape[2]
    y, a, b = x.new_empty(M, w_down.shape[2]), x.new_empty(M, F_), x.new_empty(M, F_)
    starts = row_starts(counts)

    def work(lo: int, hi: int) -> None:
        for g in range(lo, hi):
            rows = slice(starts[g], starts[g + 1])
            torch.mm(x[rows], w_gate[g], out=a[rows])
            torch.mm(x[rows], w_up[g], out=b[rows])
            torch.mm(act(a[rows]) * b[rows], w_down[g], out=y[rows])

    run_in_parallel(work, thread_ranges(counts, n_threads))
    return y, a, b


def _backward(
    x: Tensor,
    a: Tensor,
    b: Tensor,
    weights: tuple[Tensor, Tensor, Tensor],
    dy: Tensor,
    counts: Sequence[int],
    act: Callable[[Tensor], Tensor],
    n_threads: int,
    need: tuple[bool, bool, bool, bool],
) -> tuple[Tensor | None, ...]:
    """-> dx (M, C), dW_gate, dW_up, dW_down, each None where `need` (x, W_gate, W_up, W_down)
    says so (frozen weights, a leaf input); an empty group's weight gradients are zero."""
    w_gate, w_up, w_down = weights
    dx, dw_gate, dw_up, dw_down = (
        torch.empty_like(t) if wanted else None for t, wanted in zip((x, *weights), need)
    )
    need_da, need_db = need[0] or need[1], need[0] or need[2]  # x takes both, W_gate da, W_up db
    act_backward = FUSED_ACTIVATIONS[act]
    starts = row_starts(counts)

    def work(lo: int, hi: int) -> None:
        for g in range(lo, hi):
            rows = slice(starts[g], starts[g + 1])
            a_g, b_g, dy_g, x_g = a[rows], b[rows], dy[rows], x[rows]
            act_a = act(a_g) if dw_down is not None or need_db else None
            if dw_down is not None:
                torch.mm((act_a * b_g).t(), dy_g, out=dw_down[g])
            if not (need_da or need_db):
                continue
            dh = dy_g @ w_down[g].t()  # (rows, F)
            da = act_backward(dh * b_g, a_g) if need_da else None
            db = dh.mul_(act_a) if need_db else None
            if dw_gate is not None:
                torch.mm(x_g.t(), da, out=dw_gate[g])
            if dw_up is not None:
                torch.mm(x_g.t(), db, out=dw_up[g])
            if dx is not None:
                torch.mm(da, w_gate[g].t(), out=dx[rows])
                dx[rows].addmm_(db, w_up[g].t())

    run_in_parallel(work, thread_ranges(counts, n_threads))
    return dx, dw_gate, dw_up, dw_down


class _ThreadedGLUExperts(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, counts: tuple[int, ...],
        act: Callable[[Tensor], Tensor], n_threads: int,
    ) -> Tensor:  # fmt: skip
        weights = (w_gate, w_up, w_down)
        y, a, b = _forward(x, weights, counts, act, n_threads)
        ctx.save_for_backward(x, a, b, *weights)
        ctx.counts, ctx.act, ctx.n_threads = counts, act, n_threads
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, a, b, *weights = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:4])
        grads = _backward(
            x, a, b, tuple(weights), dy.contiguous(), ctx.counts, ctx.act, ctx.n_threads, need
        )
        return (*grads, None, None, None)


@torch.compiler.disable  # threads and host counts: compiled code calls it eagerly
def threaded_glu_experts(
    x: Tensor,
    weights: tuple[Tensor, Tensor, Tensor],
    counts: Sequence[int],
    activation: Callable[[Tensor], Tensor],
    n_threads: int | None = None,
) -> Tensor:
    """(act(x W_gate[g]) * x W_up[g]) W_down[g] for each group g of x's rows -> (M, C),
    differentiable in x and the weights; `activation` one of FUSED_ACTIVATIONS."""
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(f"no fused backward for {activation}; use threaded_grouped_mm")
    for w in weights:
        check_groups(x, w, counts)
    threads = n_threads or torch.get_num_threads()
    w_gate, w_up, w_down = (w.contiguous() for w in weights)
    return _ThreadedGLUExperts.apply(
        x.contiguous(), w_gate, w_up, w_down, tuple(counts), activation, threads
    )
