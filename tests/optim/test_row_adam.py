"""Engram's tables in the optimizer: row-wise Adam equals torch's Adam on the rows a step touches
and leaves the others alone; sparse and dense gradients give the same update; the tables form a
`memory` group (lr x 5 by default, no decay, never Muon) under AdamW and Muon; gradient clipping
counts sparse rows; bf16 master weights share the fp32 tables instead of copying them."""

from __future__ import annotations

import pytest
import torch

from model import ModelConfig, build_model
from model.config import EngramConfig
from optim.builder import build_optimizer
from optim.config import OptimConfig
from optim.grouping import muon_names
from optim.row_adam import AdamWWithTables, row_adam_step, touched_rows
from parallel.grad_norm import clip_grad_norm
from parallel.precision import MasterWeights

BETAS, EPS, LR = (0.9, 0.95), 1e-8, 1e-2


def test_every_row_touched_equals_torch_adam():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 4, generator=g)
    reference = weight.clone().requires_grad_()
    adam = torch.optim.Adam([reference], lr=LR, betas=BETAS, eps=EPS)
    state: dict = {}
    for _ in range(5):
        grad = torch.randn(6, 4, generator=g)
        row_adam_step(weight, grad, state, LR, BETAS, EPS)
        reference.grad = grad.clone()
        adam.step()
    torch.testing.assert_close(weight, reference.detach(), rtol=1e-6, atol=1e-7)


def test_untouched_rows_and_their_moments_stay_put():
    weight = torch.randn(5, 3)
    state: dict = {}
    grad = torch.zeros(5, 3)
    grad[1], grad[3] = 1.0, -2.0
    before = weight.clone()
    row_adam_step(weight, grad, state, LR, BETAS, EPS)
    first_m = state["exp_avg"].clone()
    grad = torch.zeros(5, 3)
    grad[3] = 1.0
    row_adam_step(weight, grad, state, LR, BETAS, EPS)
    for row in (0, 2, 4):
        assert torch.equal(weight[row], before[row])
    assert torch.equal(state["exp_avg"][1], first_m[1])  # row 1 untouched in step 2: frozen
    assert not torch.equal(weight[1], before[1]) and not torch.equal(weight[3], before[3])


def test_sparse_and_dense_gradients_give_the_same_update():
    indices = torch.tensor([[4, 1, 4, 0, 5]])  # row 4 read twice: summed; row 5's gradient is 0
    values = torch.cat([torch.randn(4, 3), torch.zeros(1, 3)])
    sparse = torch.sparse_coo_tensor(indices, values, (6, 3), check_invariants=True)
    rows, summed = touched_rows(sparse)
    assert rows.tolist() == [0, 1, 4]  # row 5 (a zero gradient) counts as untouched
    torch.testing.assert_close(summed[2], values[0] + values[2])
    rows_c, summed_c = touched_rows(sparse.coalesce())  # torch's coalesce: the same rows and sums
    assert torch.equal(rows_c, rows) and torch.equal(summed_c, summed)
    a, b = torch.randn(6, 3), None
    b = a.clone()
    sa, sb = {}, {}
    for _ in range(3):
        row_adam_step(a, sparse, sa, LR, BETAS, EPS)
        row_adam_step(b, sparse.to_dense(), sb, LR, BETAS, EPS)
    assert torch.equal(a, b)


def engram_model():
    cfg = ModelConfig(
        vocab_size=256,
        d_model=32,
        n_layers=2,
        engram=EngramConfig(layers=[1], heads=2, dim=16, table_sizes=[97, 89]),
    )
    return build_model(cfg, seed=0)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_tables_form_a_memory_group_at_five_times_the_lr(name):
    model = engram_model()
    cfg = OptimConfig(name=name, lr=1e-3, adamw_lr=2e-3 if name == "muon" else 0.0)
    groups = {g["name"]: g for g in build_optimizer(cfg, model).param_groups}
    memory = groups["memory_x5"]
    table = model.layers["1"].engram.table.weight
    assert [id(p) for p in memory["params"]] == [id(table)]
    assert memory["algorithm"] == "row_adam" and memory["weight_decay"] == 0.0
    assert memory["base_lr"] == pytest.approx(5 * (2e-3 if name == "muon" else 1e-3))
    assert "layers.1.engram.table.weight" not in muon_names(model, [])
    other = OptimConfig(name=name, memory_lr_multiplier=3.0)
    names = {g["name"] for g in build_optimizer(other, model).param_groups}
    assert "memory_x3" in names and "memory_x5" not in names


def test_the_table_optimizer_leaves_the_other_groups_as_adamw_does():
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    ours, plain = engram_model(), engram_model()
    cfg = OptimConfig(name="adamw")
    opt = build_optimizer(cfg, ours)
    assert isinstance(opt, AdamWWithTables)
    groups = [
        {k: v for k, v in g.items() if k != "params"}
        | {"params": [dict(plain.named_parameters())[n] for n in names_of(ours, g["params"])]}
        for g in opt.param_groups
        if g["name"] != "memory_x5"
    ]
    reference = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, fused=True)
    table = ours.layers["1"].engram.table.weight
    before = table.detach().clone()
    for _ in range(3):  # the same gradients for both
        ours(tokens, tokens).backward()
        for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
            b.grad = None if "engram.table" in name else a.grad.clone()
        opt.step()
        reference.step()
        opt.zero_grad()
        reference.zero_grad()
    assert not torch.equal(table, before)  # the table's rows were updated
    for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
        if "engram.table" not in name:
            assert torch.equal(a, b), name


def names_of(model, params):
    ids = {id(p): n for n, p in model.named_parameters()}
    return [ids[id(p)] for p in params]


def test_clipping_counts_sparse_rows_like_dense_ones():
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    norms, grads = [], []
    for sparse in (True, False):
        model = engram_model()
        model.layers["1"].engram.table.sparse_grad = sparse
        model(tokens, tokens).backward()
        model(tokens.flip(1), tokens).backward()  # accumulated: repeated rows
        norms.append(clip_grad_norm(list(model.parameters()), 0.1))
        grad = model.layers["1"].engram.table.weight.grad
        grads.append(grad.to_dense() if grad.is_sparse else grad)
    torch.testing.assert_close(norms[0], norms[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-9)


def test_bf16_master_weights_share_the_fp32_tables():
    model, copy = engram_model(), engram_model()
    master = MasterWeights(model, copy)
    table = model.layers["1"].engram.table.weight
    kept = copy.layers["1"].engram.table.weight
    assert table.dtype == torch.float32 and table.data_ptr() == kept.data_ptr()
    assert model.layers["1"].engram.keys.weight.dtype == torch.bfloat16
    opt = build_optimizer(OptimConfig(name="adamw"), copy)
    tokens = torch.randint(0, 256, (2, 12))
    model(tokens, tokens).backward()
    master.grads_to_master()
    assert kept.grad is not None and kept.grad.is_sparse
    before = table.detach().clone()
    opt.step()
    master.master_to_model()
    assert not torch.equal(table, before)  # the model reads the updated rows without a copy
