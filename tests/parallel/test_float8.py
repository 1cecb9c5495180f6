"""trainer.precision=float8 through torchao on CPU (torch._scaled_mm's CPU kernels; MXFP8
emulated): every recipe follows the bf16 run of the same model, the filter keeps what must stay in
bf16, FSDP2 gathers float8 weights over gloo, tensor parallelism takes torchao's float8 styles,
and checkpoints move between float8 and bf16 runs.

Tolerance: float8 (e4m3: 3 mantissa bits) rounds each GEMM operand by up to 2^-4 relative, scaled
per tensor, row or 32-block; over 6 steps of the small models the losses stayed within 0.007 of
bf16's (measured for every recipe and family here), so 0.02 is the bound, well under the 0.03
the losses fall in those steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.errors import ConfigError
from model.float8_filter import float8_candidates
from model.transformer import Transformer
from parallel.config import Float8Config
from parallel.float8 import check_float8_device, check_float8_tokens, plan_float8
from tests.parallel.float8_workers import resumes_across_precisions, run
from tests.parallel.ranks import run_ranks
from tests.parallel.workers import small_model, train

pytest.importorskip("torchao")
STEPS = 6
LOSS_ATOL = 0.02  # float8 against bf16 (see the module docstring)
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
FAMILIES = ("tiny", "tiny_moe", "tiny_hybrid")
LINEAR_CLASSES = {"Float8Linear", "MXFP8Linear"}


def _config(preset: str):
    return small_model(preset, **({"n_layers": 4} if preset == "tiny_hybrid" else {}))


@pytest.fixture(scope="module")
def bf16_runs() -> dict[str, dict]:
    return {preset: train(0, _config(preset), {}, STEPS, precision="bf16") for preset in FAMILIES}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("preset", FAMILIES)
def test_every_recipe_follows_the_bf16_run(preset: str, recipe: str, bf16_runs: dict) -> None:
    got = run(0, preset, {}, recipe, STEPS)
    ref = bf16_runs[preset]["losses"]
    gaps = [abs(a - b) for a, b in zip(got["losses"], ref)]
    assert max(gaps) <= LOSS_ATOL, (got["losses"], ref)
    assert max(gaps) > 0  # the float8 matmuls did run
    assert got["losses"][-1] < got["losses"][0]
    converted = {n for n, kind in got["modules"].items() if kind in LINEAR_CLASSES}
    assert "layers.0.ffn.down_proj" in converted or "layers.0.attn.o_proj" in converted
    assert not any(n.endswith(("router.gate", "a_proj", "b_proj")) for n in converted)


OTHER_FAMILIES = {  # the remaining layer kinds: MLA, KDA (+ MLA), mHC, AttnRes, Engram, MTP
    "tiny_mla": {},
    "tiny_kda": {"n_layers": 4},
    "tiny_mhc": {},
    "tiny_attnres": {},
    "tiny_engram": {"n_layers": 4},
    "tiny": {"mtp.depth": 1},
}


@pytest.mark.parametrize("preset", OTHER_FAMILIES)
def test_every_other_family_trains_in_float8(preset: str) -> None:
    """rowwise (every qualifying matmul) against bf16, 4 steps, the same bound."""
    cfg = small_model(preset, **OTHER_FAMILIES[preset])
    ref = train(0, cfg, {}, 4, precision="bf16")["losses"]
    got = train(0, cfg, {}, 4, precision="float8", float8={"recipe": "rowwise"})
    assert max(abs(a - b) for a, b in zip(got["losses"], ref)) <= LOSS_ATOL, (got["losses"], ref)
    assert sum(kind == "Float8Linear" for kind in got["modules"].values()) >= 8


def test_the_filter_keeps_the_head_router_gates_and_odd_shapes_in_bf16() -> None:
    with torch.device("meta"):
        hybrid = Transformer(_config("tiny_hybrid"))
        moe = Transformer(small_model("tiny_moe", tie_embeddings=False))
    reasons = {c.name: c.reason for c in float8_candidates(moe, 16)}
    assert reasons["head"].startswith("output head")
    assert reasons["layers.1.ffn.router.gate"].startswith("router")
    assert reasons["layers.1.ffn.experts"] == "" and reasons["layers.0.attn.q_proj"] == ""
    reasons = {c.name: c.reason for c in float8_candidates(hybrid, 16)}
    assert reasons["layers.0.attn.a_proj"].startswith("recurrent decay")
    assert reasons["layers.0.attn.b_proj"].startswith("recurrent decay")
    assert reasons["layers.0.attn.q_proj"] == ""
    # MXFP8's 32-blocks: a 16-multiple that is not a 32-multiple stays in bf16
    with torch.device("meta"):
        odd = Transformer(small_model("tiny", d_model=48, **{"attention.n_heads": 2}))
    reasons = {c.name: c.reason for c in float8_candidates(odd, 32)}
    assert reasons["layers.0.attn.q_proj"] == "dims 48 x 48 not multiples of 32"


def test_filter_auto_skip_and_experts_settings() -> None:
    cpu = torch.device("cpu")
    with torch.device("meta"):
        small = Transformer(small_model("tiny_moe"))
        large = Transformer(small_model("tiny", d_model=4096, **{"attention.n_heads": 32}))
    auto = plan_float8(small, Float8Config(), cpu, sharded=False)
    linears = [c for c in auto.candidates if c.kind == "linear" and c.reason.startswith("filter")]
    assert linears and not [c for c in auto.converted if c.kind == "linear"]  # all too small
    # torchao's tensorwise thresholds: a GEMM qualifies unless K <= 4096 and N <= 1024
    by_name = {c.name: c for c in plan_float8(large, Float8Config(), cpu, False).candidates}
    assert by_name["layers.0.ffn.gate_proj"].qualifies  # (N 11008 > 1024)
    assert not by_name["layers.0.attn.k_proj"].qualifies  # (N 1024, K 4096)
    skipped = plan_float8(small, Float8Config(filter="all", skip=["attn.q"]), cpu, False)
    assert {c.reason for c in skipped.candidates if "attn.q_proj" in c.name} == {
        "trainer.float8.skip"
    }
    # tensorwise experts need CUDA's fp8 grouped GEMM: on CPU they stay in bf16, said why
    experts = [c for c in auto.candidates if c.kind == "experts"]
    assert experts and all("grouped GEMM" in c.reason for c in experts)
    mx = plan_float8(small, Float8Config(recipe="mxfp8", experts=False), cpu, False)
    assert {c.reason for c in mx.candidates if c.kind == "experts"} == {
        "trainer.float8.experts=false"
    }
    summary = plan_float8(small, Float8Config(recipe="mxfp8"), cpu, False).summary()
    assert "float8 (mxfp8)" in summary and "experts by mxfp8" in summary
    assert (
        "kept in bf16 (router (its scores pick the experts)): layers.*.ffn.router.gate" in summary
    )


def test_gpus_without_float8_and_the_deepspeed_engine_are_refused(monkeypatch) -> None:
    from trainer.build import check_float8_engine

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match="no float8 tensor cores"):
        check_float8_device("tensorwise", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_device("rowwise", torch.device("cuda"))  # H100: fine
    with pytest.raises(ConfigError, match="mxfp8 needs an SM100 GPU"):
        check_float8_device("mxfp8", torch.device("cuda"))
    with pytest.raises(ConfigError, match="parallel.engine=deepspeed"):
        check_float8_engine("float8", "deepspeed")
    with pytest.raises(ConfigError, match="trainer.float8.recipe='fp4'"):
        Float8Config(recipe="fp4")
    # MXFP8's weight gradients quantize the micro-batch's tokens in blocks of 32
    check_float8_tokens("mxfp8", 64)
    check_float8_tokens("tensorwise", 33)  # (torchao pads the float8 GEMMs' inner dims)
    with pytest.raises(ConfigError, match="holds 48: change data.seq_len"):
        check_float8_tokens("mxfp8", 48)


@pytest.mark.distributed
def test_two_ranks_in_float8_follow_one_process() -> None:
    """FSDP2 gathering float8 weights (as bytes over gloo), tensor parallelism with torchao's
    float8 styles, MXFP8 experts under expert parallelism, and a pipeline of two stages, against
    one process in float8 (the pipeline's with the same 2 micro-batches).
    Not bitwise: one process casts fp32 weights under autocast where the ranks compute in
    FSDP2's bf16, so the float8 operands differ in rounding (measured within 5.4e-3 over 4
    steps)."""
    cases = [
        ("tiny", {}, "tensorwise"),
        ("tiny", {"tp": 2}, "tensorwise"),
        # MLA's down projections have no tp plan: their weights live on another mesh
        ("tiny_mla", {"tp": 2}, "tensorwise"),
        ("tiny_moe", {"ep": 2}, "mxfp8"),
        ("tiny", {"pp": 2}, "rowwise"),  # (2 micro-batches through 1F1B)
    ]
    for preset, layout, recipe in cases:
        one = run(0, preset, {"pp": 1} if "pp" in layout else {}, recipe, 4)
        got = run_ranks(2, run, preset, layout, recipe, 4)
        label = f"{preset} {layout} {recipe}"
        assert got[0]["losses"] == got[1]["losses"] or "pp" in layout, label
        torch.testing.assert_close(got[0]["losses"], one["losses"], rtol=0, atol=1e-2, msg=label)
        torch.testing.assert_close(got[0]["norms"], one["norms"], rtol=3e-2, atol=0, msg=label)
        if "tp" in layout:  # torchao's float8 styles for the split float8 linears, for all
            styles = set(got[0]["tp_styles"])
            assert {"Float8ColwiseParallel", "Float8RowwiseSummable"} <= styles, styles
            assert not styles & {"ColwiseParallel", "RowwiseSummable"}, styles
        if layout == {}:  # FSDP2's float8 all-gather, its scales precomputed after each step
            weight_type = got[0]["weight_types"]["layers.0.attn.q_proj.weight"]
            assert weight_type == "WeightWithDynamicFloat8CastTensor", label
            assert got[0]["float8_scaled"] >= 14, label  # every converted weight (2 x 7)
        if recipe == "mxfp8":  # the experts split over the ranks, through MXFP8's GEMMs
            assert got[0]["placements"]["layers.1.ffn.experts.w_gate"] != "local", label
            assert "experts by mxfp8" in got[0]["summary"], label


@pytest.mark.distributed
def test_checkpoints_move_between_float8_and_bf16(tmp_path: Path) -> None:
    got = run_ranks(2, resumes_across_precisions, str(tmp_path))[0]
    for name, tensor in got["f8"]["final"].items():  # a float8 run's weights, resumed in bf16
        assert torch.equal(got["bf16"]["loaded"][name], tensor), name
        assert tensor.dtype == torch.float32, name
    for name, tensor in got["plain"]["final"].items():  # and a bf16 run's, resumed in float8
        assert torch.equal(got["back"]["loaded"][name], tensor), name
    # one process (autocast over fp32 weights) resumes the ranks' float8 checkpoint too
    (saved,) = (tmp_path / "f8").glob("step_*")
    one = train(0, small_model(), {}, 1, precision="bf16", resume_from=str(saved))
    for name, tensor in got["f8"]["final"].items():
        assert torch.equal(one["loaded"][name], tensor), name


def test_the_gpu_sessions_float8_case_runs_on_cpu() -> None:
    """bench/gpu_check.py's float8 sub-cases (their dry-run shapes, eager): the converted
    model trains through the same step, its plan and losses recorded for the bf16 comparison."""
    from bench.gpu_train import train_case

    cpu = torch.device("cpu")
    got = train_case("moe", True, cpu, lambda: None, False, float8="mxfp8")
    assert got["float8"].startswith("float8 (mxfp8)") and "experts by mxfp8" in got["float8"]
    assert len(got["losses"]) == 2 and got["losses"][-1] < got["losses"][0]  # (1 + 1 timed)
