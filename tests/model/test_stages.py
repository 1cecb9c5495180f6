"""Pipeline stages of the model (model/stages.py) in one process: the stages of a pruned model,
run one after another on what the stage before sent, give the whole model's loss and every
gradient (fp32) for each residual stream and mixer kind; the tensors that cross a stage are the
shapes the stream declares; the FLOP-balanced split is the best contiguous one (against every
split); explicit splits and schedule names are checked in one line."""

from __future__ import annotations

import itertools

import pytest
import torch

from model.errors import ConfigError
from model.presets import load_preset
from model.stages import (
    StageLayout,
    explicit_layers,
    keep_stages,
    pipeline_layouts,
    shares_embedding,
    split_layers,
    stage_rank,
    stage_view,
    stages_per_rank,
)
from model.transformer import Transformer, build_model
from parallel.init import init_like_single_process

SMALL = {"vocab_size": 128, "max_seq_len": 64, "d_model": 64, "n_layers": 4}
SMALL |= {"attention.n_heads": 4, "attention.n_kv_heads": 2}


def staged(cfg, layouts: list[StageLayout]) -> list[torch.nn.Module]:
    """Each stage's own pruned model, initialized as the whole one (seed 0)."""
    views = []
    for layout in layouts:
        with torch.device("meta"):
            model = Transformer(cfg)
        keep_stages(model, [layout])
        model.to_empty(device="cpu")
        init_like_single_process(model, torch.device("cpu"), 0)
        views.append(stage_view(model, layout))
    return views


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        ("tiny", {}),
        ("tiny", {"mtp.depth": 1, "tie_embeddings": False}),
        ("tiny_moe", {}),
        ("tiny_mla", {}),
        ("tiny_hybrid", {}),
        ("tiny_mhc", {}),
        ("tiny_attnres", {}),
        ("tiny_attnres", {"attnres.block_layers": 3}),
        ("tiny_engram", {}),
    ],
)
def test_stages_run_in_turn_give_the_whole_models_loss_and_gradients(preset, overrides):
    cfg = load_preset(preset, SMALL | overrides)
    gen = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, 128, (2, 2, 16), generator=gen)
    whole = build_model(cfg, seed=0)
    loss = whole(ids, targets)
    if whole.mtp is not None:
        loss = loss + whole.pop_mtp_objective()
    loss.backward()
    layouts = [StageLayout(0, 3, (0,)), StageLayout(1, 3, (1, 2)), StageLayout(2, 3, (3,))]
    views = staged(cfg, layouts)
    sent, received = [], []
    carried: tuple[torch.Tensor, ...] = (ids,)
    for view in views:
        out = view(*carried, ids=ids, targets=targets)
        if view.stage.last:
            break
        shapes = view.stream.boundary_shapes(view.stage.layers[-1] + 1, 2, 16)
        assert [tuple(t.shape) for t in out] == shapes, preset  # what the stream declares
        sent.append(out)
        carried = tuple(t.detach().requires_grad_() for t in out)
        received.append(carried)
    if views[-1].mtp is not None:
        out = out + views[-1].pop_mtp_objective()
    torch.testing.assert_close(out, loss, rtol=1e-6, atol=1e-6)
    out.backward()  # each stage's backward from the gradients of what it sent
    for outputs, inputs in zip(reversed(sent), reversed(received)):
        torch.autograd.backward(outputs, [t.grad for t in inputs])
    grads = {}
    for view in views:
        grads |= {n: p.grad for n, p in view.named_parameters() if p.grad is not None}
    for name, param in whole.named_parameters():
        if name == "embed.weight" and shares_embedding(cfg):  # the first's and the last's
            grads[name] = views[0].embed.weight.grad + views[-1].embed.weight.grad
        if param.grad is not None:
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_pruned_model_keeps_only_its_stages_parts_under_their_whole_names():
    cfg = load_preset("tiny_attnres", SMALL | {"tie_embeddings": False})
    whole = {n for n, _ in build_model(cfg, device="meta").named_parameters()}
    held = []
    for layout in [StageLayout(0, 2, (0, 1)), StageLayout(1, 2, (2, 3))]:
        with torch.device("meta"):
            model = Transformer(cfg)
        keep_stages(model, [layout])
        held.append({n for n, _ in model.named_parameters()})
    assert held[0] | held[1] == whole and not held[0] & held[1]
    assert "embed.weight" in held[0] and "head.weight" in held[1]
    assert "stream.head.query" in held[1] or any(n.startswith("stream.") for n in held[1])
    assert not any(n.startswith(("layers.2", "layers.3", "stream.", "norm.")) for n in held[0])


def test_the_balanced_split_is_the_best_contiguous_one():
    costs = [3.0, 1.0, 1.0, 4.0, 1.0, 2.0, 2.0, 5.0]
    for stages, head in [(2, 0.0), (3, 4.0), (4, 2.5)]:
        split = split_layers(costs, head, stages)
        assert [i for part in split for i in part] == list(range(len(costs)))
        heaviest = max(
            sum(costs[i] for i in part) + (head if k == stages - 1 else 0)
            for k, part in enumerate(split)
        )
        best = min(  # every way to cut 8 blocks into `stages` non-empty runs
            max(
                sum(costs[a:b]) + (head if b == len(costs) else 0)
                for a, b in zip((0, *cuts), (*cuts, len(costs)))
            )
            for cuts in itertools.combinations(range(1, len(costs)), stages - 1)
        )
        assert heaviest == best, (stages, split)


def test_a_hybrid_stack_is_split_by_work_not_by_count():
    """Softmax attention over 8192 positions costs 2.4x a Gated DeltaNet block here (layer
    costs from model/accounting.py): the stage holding both softmax blocks takes 3 blocks,
    the other 5."""
    pattern = {"layer_pattern": ["gqa", "gqa", "gdn", "gdn", "gdn", "gdn", "gdn", "gdn"]}
    cfg = load_preset("tiny_hybrid", SMALL | {"n_layers": 8, "max_seq_len": 8192} | pattern)
    layouts = pipeline_layouts(build_model(cfg, device="meta"), 8192, 2, "1F1B", 0, [])
    assert [s.layers for s in layouts] == [(0, 1, 2), (3, 4, 5, 6, 7)]


def test_stage_ranks_loop_and_v():
    assert [stage_rank(s, 2, False) for s in range(4)] == [0, 1, 0, 1]
    assert [stage_rank(s, 2, True) for s in range(4)] == [0, 1, 1, 0]
    assert [stage_rank(s, 4, True) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: explicit_layers([3, 2], 4, 2), r"parallel.pp_layers=\[3, 2\] must list"),
        (lambda: explicit_layers([2, 2], 4, 4), r"each of the 4 stages"),
        (lambda: split_layers([1.0] * 3, 0.0, 4), "4 pipeline stages for 3 layers"),
        (lambda: stages_per_rank("1f1b", 2), "runs one stage per rank"),
        (lambda: stages_per_rank("ZBVZeroBubble", 3), "must be 2"),
        (lambda: stages_per_rank("Ring", 0), "parallel.pp_schedule='Ring' is not one of"),
    ],
)
def test_bad_pipeline_splits_are_refused_in_one_line(call, message):
    with pytest.raises(ConfigError, match=message):
        call()
