"""MuonClip's QK-clip under tensor parallelism (gloo) equals one process: each tp rank records
its own query heads' max logits (-inf elsewhere), the MAX over every rank gives each head's, and
the clip scales the heads' rows of the sharded weights (q, and k for MHA; MLA's q and kv_b)
wherever tensor parallelism and FSDP2 placed them."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.ranks import run_ranks
from tests.parallel.workers import engine_for, small_model, train

pytestmark = pytest.mark.distributed
STEPS = 3
TAU = 0.02  # below a fresh model's logits: heads are clipped at every step
# GQA's 2 kv heads split over tp=2; MQA's one kv head is whole on both ranks (colwise_replicated)
MODELS = {
    "mha": small_model("tiny", **{"attention.n_kv_heads": 4}),
    "gqa": small_model("tiny"),
    "mqa": small_model("tiny", **{"attention.n_kv_heads": 1}),
    "mla": small_model("tiny_mla"),
}
# Muon's Newton-Schulz runs in bf16: tp's fp32 reduction order can flip its roundings. Without
# QK-clip (tau = 0) tp=2 already moves single elements of GQA's and MQA's o_proj by up to 4.2e-4
# after 3 steps (MHA's weights 9e-5); with it, 5.3e-4 (MQA's o_proj, which the clip leaves
# alone). A clip on wrong heads would rescale whole rows by gamma (~0.1 here): far more
WEIGHT_ATOL = 1e-3


def train_all(rank: int, names: list[str], layout: dict) -> dict[str, dict]:
    return {
        name: train(rank, MODELS[name], layout, STEPS, optimizer_name="muonclip", qk_clip_tau=TAU)
        for name in names
    }


@pytest.fixture(scope="module")
def single() -> dict[str, dict]:
    return train_all(0, list(MODELS), {})


@pytest.mark.parametrize(
    ("ranks", "layout", "names"),
    [(2, {"tp": 2}, list(MODELS)), (4, {"tp": 2}, ["gqa", "mqa", "mla"])],
    ids=["tp2", "dp_shard2_x_tp2"],
)
def test_qk_clip_under_tensor_parallelism_equals_one_process(single, ranks, layout, names):
    results = run_ranks(ranks, train_all, names, layout)
    for name in names:
        ref, got = single[name], results[0][name]
        clipped = [s["qk/clipped_heads"] for s in ref["stats"]]
        assert all(c > 0 for c in clipped), (name, clipped)
        for result in results:  # every rank reduced every head's max logit
            assert [s["qk/clipped_heads"] for s in result[name]["stats"]] == clipped, name
        # step 1 sees the same weights (to fp32 order); later steps differ by Muon's bf16 roundings
        first, first_ref = got["stats"][0]["qk/max_logit"], ref["stats"][0]["qk/max_logit"]
        assert first == pytest.approx(first_ref, rel=1e-5), name
        for g, r in zip(got["stats"], ref["stats"]):
            assert g["qk/max_logit"] == pytest.approx(r["qk/max_logit"], rel=2e-3), name
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(got["norms"], ref["norms"], rtol=1e-4, atol=1e-6, msg=name)
        for key, tensor in ref["final"].items():
            torch.testing.assert_close(
                got["final"][key],
                tensor,
                rtol=0,
                atol=WEIGHT_ATOL,
                msg=lambda m, k=f"{name} {key}": f"{k}: {m}",
            )


def scaled_rows(rank: int) -> dict[str, tuple[str, bool]]:
    """scale_rows on the engine's dp_shard=2 x tp=2 weights: each weight's placements and whether
    its whole tensor afterwards equals the whole tensor before, row r times factor r."""
    from optim.qk_clip import scale_rows

    model = engine_for(MODELS["gqa"], {"tp": 2}).model
    attn = model.layers["0"].attn
    out = {}
    for name, param in [("q", attn.q_proj.weight), ("k", attn.k_proj.weight),
                        ("o", attn.o_proj.weight)]:  # fmt: skip
        before = param.full_tensor()
        factor = torch.arange(1, before.shape[0] + 1, dtype=torch.float32)
        with torch.no_grad():
            scale_rows(param, factor)
        expected = before * factor[:, None]
        out[name] = (str(param.placements), torch.equal(param.full_tensor(), expected))
    return out


def test_scale_rows_scales_whole_rows_of_tensor_and_data_parallel_shards():
    for result in run_ranks(4, scaled_rows):
        assert result["q"] == ("(_StridedShard(dim=0, sf=2), Shard(dim=0))", True), result
        assert result["k"] == ("(_StridedShard(dim=0, sf=2), Shard(dim=0))", True), result
        assert result["o"] == ("(Shard(dim=0), Shard(dim=1))", True), result
