"""Context parallelism's building blocks (parallel/context_parallel.py) on cp = 2 and 4 gloo
ranks against one process, fp32: each rank keeps its head-tail chunks of the sequence, and
(a) softmax attention over every rank's keys (GQA, a value width other than the key's, packed
documents crossing the chunks, a sliding window; SDPA with a mask and the Triton kernel, chunk by
chunk, under its interpreter) and (b) the gated delta rule passed on as
segment states (per-head and per-key-channel decay, documents crossing the chunks) give each
rank the whole sequence's outputs at its positions, as (c) does a causal convolution reading the
previous chunk's last positions; the gradients of every input (summed over the ranks onto the
rank holding each position) equal the whole sequence's (1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.sent_bytes import SentBytes
from model.mixers.delta_rule import chunk_gated_delta_rule
from model.mixers.gdn import l2_normalize
from model.mixers.masks import build_mask, document_starts, positions_in_documents
from model.mixers.qk_logits import max_logits_per_head
from parallel.context_parallel import kept_positions
from tests.parallel.ranks import run_ranks

pytestmark = pytest.mark.distributed

B, T = 2, 32
# packed rows: documents start at 0, 3, 13, 20 and 0, 9, 26 (across every cp=4 chunk of 4)
DOCS = torch.tensor([[0] * 3 + [1] * 10 + [2] * 7 + [3] * 12, [0] * 9 + [1] * 17 + [2] * 6])
TOL = {"rtol": 1e-5, "atol": 1e-6}


def attention_inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, 4, T, 8, generator=gen)
    k = torch.randn(B, 2, T, 8, generator=gen)
    v = torch.randn(B, 2, T, 6, generator=gen)
    weights = torch.randn(B, 4, T, 6, generator=gen)
    return [q, k, v, weights]


def delta_inputs(per_channel: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    q = l2_normalize(torch.randn(B, 3, T, 8, generator=gen)) * 8**-0.5
    k = l2_normalize(torch.randn(B, 3, T, 8, generator=gen))
    v = torch.randn(B, 3, T, 6, generator=gen)
    shape = (B, 3, T, 8) if per_channel else (B, 3, T)
    g = -torch.rand(*shape, generator=gen) * 0.5
    beta = torch.rand(B, 3, T, generator=gen)
    weights = torch.randn(B, 3, T, 6, generator=gen)
    return [q, k, v, g, beta, weights]


def whole_attention(window: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    *leaves, weights = attention_inputs()
    q, k, v = (x.requires_grad_() for x in leaves)
    mask, _ = build_mask(T, 0, window=window, doc_ids=DOCS)
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask
    )
    (out * weights).sum().backward()
    top = max_logits_per_head(q, k, 8**-0.5, mask, False, 0)  # QK-clip's, per head
    return out.detach(), [q.grad, k.grad, v.grad, top]


def whole_delta(per_channel: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    *leaves, weights = delta_inputs(per_channel)
    leaves = [x.requires_grad_() for x in leaves]
    o, s = chunk_gated_delta_rule(*leaves, None, document_starts(DOCS), 4)
    ((o * weights).sum() + s.square().sum()).backward()
    return o.detach(), s.detach(), [x.grad for x in leaves]


def over_ranks(rank: int, window: int, per_channel: bool) -> dict:
    """This rank's positions of both: outputs, final state, and its inputs' gradients."""
    import torch.distributed as dist

    from parallel.context_parallel import (
        attention_over_ranks,
        delta_rule_over_ranks,
        kernel_attention_over_ranks,
    )

    group, cp = dist.group.WORLD, dist.get_world_size()
    mine = kept_positions(T, cp, rank)
    *inputs, weights = attention_inputs()
    q, k, v = (x[:, :, mine].clone().requires_grad_() for x in inputs)
    out, top = attention_over_ranks(
        q, k, v, mine, group, window=window, doc_ids=DOCS, want_max=True
    )
    (out * weights[:, :, mine]).sum().backward()
    result = {"attention": out.detach(), "attention_grads": [q.grad, k.grad, v.grad], "max": top}
    # the Triton kernel (interpreted on CPU): each chunk over the keys before its end, no mask
    q, k, v = (x[:, :, mine].clone().requires_grad_() for x in inputs)
    out, top = kernel_attention_over_ranks(
        q, k, v, group, window=window, doc_ids=DOCS, want_max=True
    )
    (out * weights[:, :, mine]).sum().backward()
    result |= {"kernel": out.detach(), "kernel_grads": [q.grad, k.grad, v.grad], "kernel_max": top}
    *inputs, weights = delta_inputs(per_channel)
    leaves = [x[:, :, mine].clone().requires_grad_() for x in inputs]
    starts = document_starts(DOCS)[:, mine]
    o, s = delta_rule_over_ranks(*leaves, group, starts, chunk=4)
    # the final state's term counted once over the ranks (every rank holds it whole)
    ((o * weights[:, :, mine]).sum() + s.square().sum() / cp).backward()
    result |= {"delta": o.detach(), "state": s.detach(), "delta_grads": [x.grad for x in leaves]}
    x, weight, weights = conv_inputs()
    x = x[:, mine].clone().requires_grad_()
    result |= conv_over_ranks(x, weight, mine, weights[:, mine], group)
    return result


def conv_inputs() -> list[torch.Tensor]:
    """x (B, T, D), a depthwise kernel (D, 4), the output's weights (B, T, D)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B, T, 5, generator=gen)
    return [x, torch.randn(5, 4, generator=gen), torch.randn(B, T, 5, generator=gen)]


def conv_over_ranks(x, weight, mine, weights, group) -> dict:
    """GDN's causal conv (kernel 4) of this rank's two chunks, each continuing the chunk before
    it (`previous_rows`), with the documents' own positions."""
    from model.mixers.gdn import causal_conv
    from parallel.context_parallel import previous_rows

    past = previous_rows(x, 3, group)
    positions = positions_in_documents(DOCS)[:, mine]
    half = x.shape[1] // 2
    y = torch.cat(
        [
            causal_conv(x[:, :half], weight, past[:, 0], positions[:, :half])[0],
            causal_conv(x[:, half:], weight, past[:, 1], positions[:, half:])[0],
        ],
        dim=1,
    )
    (y * weights).sum().backward()
    return {"conv": y.detach(), "conv_grad": x.grad}


def whole_conv() -> tuple[torch.Tensor, torch.Tensor]:
    from model.mixers.gdn import causal_conv

    x, weight, weights = conv_inputs()
    x.requires_grad_()
    y = causal_conv(x, weight, None, positions_in_documents(DOCS))[0]
    (y * weights).sum().backward()
    return y.detach(), x.grad


def assemble(parts: list[torch.Tensor], cp: int) -> torch.Tensor:
    """Each rank's (B, H, T_local, ...) -> (B, H, T, ...) in global order."""
    whole = torch.empty(*parts[0].shape[:2], T, *parts[0].shape[3:])
    for rank, part in enumerate(parts):
        whole[:, :, kept_positions(T, cp, rank)] = part
    return whole


@pytest.mark.parametrize(
    ("cp", "window", "per_channel"), [(2, 0, False), (4, 5, True)], ids=["cp2", "cp4_window_kda"]
)
def test_attention_and_the_delta_rule_over_cp_ranks_equal_one_process(cp, window, per_channel):
    out, grads = whole_attention(window)
    o, s, delta_grads = whole_delta(per_channel)
    ranks = run_ranks(cp, over_ranks, window, per_channel)
    torch.testing.assert_close(assemble([r["attention"] for r in ranks], cp), out, **TOL)
    for i, name in enumerate("qkv"):
        got = assemble([r["attention_grads"][i] for r in ranks], cp)
        torch.testing.assert_close(got, grads[i], **TOL, msg=f"attention d{name}")
    # QK-clip's max logit per head: the maximum over the ranks (its hook reduces with max)
    top = torch.stack([r["max"] for r in ranks]).amax(0)
    torch.testing.assert_close(top, grads[3], **TOL)
    # the Triton kernel path (model.attention.backend=triton) against the same whole sequence
    torch.testing.assert_close(assemble([r["kernel"] for r in ranks], cp), out, **TOL)
    for i, name in enumerate("qkv"):
        got = assemble([r["kernel_grads"][i] for r in ranks], cp)
        torch.testing.assert_close(got, grads[i], **TOL, msg=f"kernel attention d{name}")
    top = torch.stack([r["kernel_max"] for r in ranks]).amax(0)
    torch.testing.assert_close(top, grads[3], **TOL)
    torch.testing.assert_close(assemble([r["delta"] for r in ranks], cp), o, **TOL)
    for r in ranks:
        torch.testing.assert_close(r["state"], s, **TOL)
    for i, name in enumerate(["q", "k", "v", "g", "beta"]):
        got = assemble([r["delta_grads"][i] for r in ranks], cp)
        torch.testing.assert_close(got, delta_grads[i], **TOL, msg=f"delta rule d{name}")
    y, x_grad = whole_conv()  # (B, T, D): positions on dim 1
    for key, want in (("conv", y), ("conv_grad", x_grad)):
        got = assemble([r[key].unsqueeze(1) for r in ranks], cp).squeeze(1)
        torch.testing.assert_close(got, want, **TOL, msg=key)


def test_the_kept_chunks_balance_causal_work():
    """Rank r keeps chunks r and 2 cp - 1 - r: every rank's queries see the same number of
    causal keys; a length that does not split into 2 cp chunks is refused."""
    work = [int((kept_positions(T, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1
    assert torch.cat([kept_positions(T, 4, r) for r in range(4)]).sort().values.tolist() == list(
        range(T)
    )
    with pytest.raises(ValueError, match="does not split into 2 x cp=4 chunks"):
        kept_positions(30, 4, 0)


MODEL = {"vocab_size": 128, "max_seq_len": 64, "d_model": 64, "n_layers": 2}
MODEL |= {"attention.n_heads": 4, "attention.n_kv_heads": 2}


def model_step(rank: int, overrides: dict, packed: bool, preset: str = "tiny") -> dict:
    """One fp32 training forward + backward of the seeded model, split over every rank as one
    context-parallel group (or whole, without a process group): the loss and each gradient."""
    import torch.distributed as dist

    from model.presets import load_preset
    from model.transformer import build_model
    from parallel.context_parallel import apply_context_parallel

    model = build_model(load_preset(preset, MODEL | overrides), seed=0)
    if dist.is_initialized():
        apply_context_parallel(model, dist.group.WORLD)
    tokens = torch.randint(0, 128, (B, T + 1), generator=torch.Generator().manual_seed(3))
    targets = tokens[:, 1:].clone()
    targets[0, 5:9] = -100  # ignored targets: the mean is over the whole sequence's count
    sent = SentBytes(dist.get_world_size() if dist.is_initialized() else 1)
    with sent.mode:
        loss = model(tokens[:, :-1], targets, doc_ids=DOCS if packed else None)
        mtp = model.pop_mtp_objective()
        (loss if mtp is None else loss + mtp).backward()
    grads = {
        n: p.grad.to_dense() if p.grad.is_sparse else p.grad for n, p in model.named_parameters()
    }
    # (Engram's tables: sparse gradients)
    return {"loss": loss.detach(), "grads": grads, "sent": sent.sent}


def planned_sent(cp: int, preset: str, overrides: dict) -> float:
    """model/planner.py's bytes a rank sends over the cp group per step (comm_cp)."""
    from model.planner import Layout, rank_plan
    from model.presets import load_preset
    from model.transformer import build_model

    model = build_model(load_preset(preset, MODEL | overrides), device="meta")
    return rank_plan(model, Layout(cp=cp, seq_len=T, micro_batch_size=B)).comm_cp


# what the planner counts exactly (keys/values and state maps); the conv halos and Engram's
# are left out of it, so there it is a lower bound
HALOS = ("tiny_hybrid", "tiny_kda", "tiny_engram")


HYBRID = {"n_layers": 4, "gdn.head_dim": 16, "gdn.v_head_dim": 16}


@pytest.mark.parametrize(
    ("cp", "preset", "overrides", "packed"),
    [
        # the Triton kernel (interpreted): each chunk over the keys before its end, no mask
        (2, "tiny", {"attention.backend": "triton"}, True),
        (4, "tiny", {"attention.sliding_window": 6}, True),
        (2, "tiny_hybrid", HYBRID, True),  # Gated DeltaNet: state passing and conv halos
        (4, "tiny_hybrid", HYBRID, False),
        (2, "tiny_mla", {}, True),  # its per-head keys (nope + rope) and values gathered
        (2, "tiny_kda", {"n_layers": 4, "kda.head_dim": 16}, True),  # KDA + MLA without RoPE
        # n-grams hashed over the whole row, the dilated conv (3 x 3 back) across the chunks
        (2, "tiny_engram", {"n_layers": 4, "engram.table_sizes": [500, 500]}, True),
        # per token: nothing to exchange beyond the layers' own
        (2, "tiny_attnres", {}, True),
        (2, "tiny_mhc", {}, False),
        # MTP: its inputs and labels shifted over the whole row, its block split like the stack's
        (2, "tiny", {"mtp.depth": 2}, True),
    ],
    ids=[
        "cp2_triton_packed",
        "cp4_packed_window",
        "cp2_hybrid_packed",
        "cp4_hybrid",
        "cp2_mla_packed",
        "cp2_kda_packed",
        "cp2_engram_packed",
        "cp2_attnres_packed",
        "cp2_mhc",
        "cp2_mtp_packed",
    ],
)
def test_a_model_split_over_cp_ranks_trains_as_one_process(cp, preset, overrides, packed):
    """The ranks' losses average to one process's (each its weighted mean over its positions)
    and so do their gradients (FSDP2's reduction over the context-parallel ranks); each rank
    sends what model/planner.py says it sends over the cp group."""
    whole = model_step(0, overrides, packed, preset)
    ranks = run_ranks(cp, model_step, overrides, packed, preset)
    torch.testing.assert_close(sum(r["loss"] for r in ranks) / len(ranks), whole["loss"], **TOL)
    for name, grad in whole["grads"].items():
        got = sum(r["grads"][name] for r in ranks) / len(ranks)
        torch.testing.assert_close(got, grad, **TOL, msg=name)
    # the bytes each rank sent over the cp group against the planner's formula
    plan = planned_sent(cp, preset, overrides)
    for r in ranks:
        assert plan <= r["sent"] if preset in HALOS else r["sent"] == pytest.approx(plan), (
            r["sent"],
            plan,
        )


def test_layers_it_cannot_split_yet_are_refused():
    from model.errors import ConfigError
    from model.presets import load_preset
    from model.transformer import build_model
    from parallel.context_parallel import apply_context_parallel

    model = build_model(load_preset("tiny", MODEL | {"position": "alibi"}), device="meta")
    with pytest.raises(ConfigError, match="does not split alibi positions yet; use model.pos"):
        apply_context_parallel(model, None)


def model_step_cp_tp(rank: int, preset: str, overrides: dict, sequence_parallel: bool) -> dict:
    """As model_step, on 4 ranks as cp=2 x tp=2 (tp innermost): tensor parallelism's plans
    (and sequence parallelism inside each rank's positions), then the context split."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from model.presets import load_preset
    from model.transformer import build_model
    from parallel.context_parallel import apply_context_parallel
    from parallel.sequence_parallel import sum_partial_gradients
    from parallel.tensor_parallel import split_over_tp

    model = build_model(load_preset(preset, MODEL | overrides), seed=0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    split_over_tp(model, mesh["tp"], sequence_parallel)
    apply_context_parallel(model, mesh["cp"].get_group())
    tokens = torch.randint(0, 128, (B, T + 1), generator=torch.Generator().manual_seed(3))
    loss = model(tokens[:, :-1], tokens[:, 1:], doc_ids=DOCS)
    loss.backward()
    sum_partial_gradients(model)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = g
    return {"loss": loss.detach(), "grads": grads, "cp_rank": mesh["cp"].get_local_rank()}


@pytest.mark.parametrize(
    ("preset", "overrides", "sequence_parallel"),
    [("tiny", {}, True), ("tiny_hybrid", HYBRID, False)],
    ids=["tiny_sequence_parallel", "hybrid"],
)
def test_context_and_tensor_parallelism_compose(preset, overrides, sequence_parallel):
    """cp=2 x tp=2 on 4 ranks, packed documents: the two cp ranks' losses average to one
    process's and so do their (tp-gathered) gradients."""
    from model.presets import load_preset
    from model.transformer import build_model

    tokens = torch.randint(0, 128, (B, T + 1), generator=torch.Generator().manual_seed(3))
    model = build_model(load_preset(preset, MODEL | overrides), seed=0)
    want = model(tokens[:, :-1], tokens[:, 1:], doc_ids=DOCS)
    want.backward()
    ranks = run_ranks(4, model_step_cp_tp, preset, overrides, sequence_parallel)
    lanes = [next(r for r in ranks if r["cp_rank"] == c) for c in (0, 1)]  # one tp rank each
    torch.testing.assert_close(sum(r["loss"] for r in lanes) / 2, want.detach(), **TOL)
    for name, p in model.named_parameters():
        got = sum(r["grads"][name] for r in lanes) / 2
        torch.testing.assert_close(got, p.grad, **TOL, msg=name)
