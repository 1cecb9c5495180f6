"""The DeepSpeed config the engine hands `deepspeed.initialize` (parallel/deepspeed/engine.py):
the trainer's batch shape, clipping and precision and parallel.deepspeed's ZeRO settings filled
into a user's JSON, whose other settings pass through; a JSON that sets one of ours to another
value is refused naming both. No DeepSpeed needed."""

from __future__ import annotations

import json
import re

import pytest
import torch

from model.errors import ConfigError
from model.presets import load_preset
from parallel.config import DeepSpeedConfig, ParallelConfig
from parallel.deepspeed.engine import deepspeed_config, refuse_unsupported
from parallel.engine import EngineRequest
from parallel.mesh import ParallelDims


def request(
    precision: str = "fp32", grad_clip: float = 1.0, layout: dict | None = None, **ds
) -> EngineRequest:
    parallel = ParallelConfig(engine="deepspeed", deepspeed=DeepSpeedConfig(**ds), **(layout or {}))
    return EngineRequest(
        model_cfg=load_preset("tiny_moe"), parallel=parallel, precision=precision, compile=False,
        dims=ParallelDims.resolve(parallel, 2), device=torch.device("cpu"), seed=0,
        make_optimizer=lambda m: None, grad_clip=grad_clip, micro_batch_size=2, micro_batches=4,
    )  # fmt: skip


def test_the_trainers_settings_fill_the_config():
    config = deepspeed_config(request("bf16_master", zero_stage=3, offload_optimizer="cpu"))
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 4
    assert config["gradient_clipping"] == 1.0
    assert config["bf16"] == {"enabled": True}
    assert config["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "compute_grad_norm": True,  # the loop reports and judges it
    }
    experts = deepspeed_config(request(zero_stage=2, layout={"ep": 2}))["zero_optimization"]
    assert experts["load_from_fp32_weights"] is True  # each rank's experts: its fp32 partitions
    assert "torch_autocast" not in config
    autocast = deepspeed_config(request("bf16"))
    assert autocast["torch_autocast"]["dtype"] == "bfloat16"
    assert autocast["torch_autocast"]["lower_precision_safe_modules"] == []  # fp32 reductions
    assert config["communication_data_type"] == "fp32"
    assert deepspeed_config(request(zero_stage=0))["gradient_clipping"] == 0.0  # clipped by us


def test_a_users_json_passes_through_and_conflicts_are_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1e6},
                                "wall_clock_breakdown": True}))  # fmt: skip
    config = deepspeed_config(request(config=str(path)))
    assert config["zero_optimization"]["reduce_bucket_size"] == 1e6
    assert config["wall_clock_breakdown"] is True
    path.write_text(json.dumps({"gradient_clipping": 2.0}))
    with pytest.raises(
        ConfigError, match=r"sets gradient_clipping=2.0, but the run sets it to 1.0"
    ):
        deepspeed_config(request(config=str(path)))
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError, match=r"sets zero_optimization.stage=3"):
        deepspeed_config(request(config=str(path)))
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        deepspeed_config(request(config=str(path)))
    with pytest.raises(ConfigError, match="no such file"):
        deepspeed_config(request(config=str(tmp_path / "missing.json")))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"zero_stage": 4}, "zero_stage=4 must be 0, 1, 2 or 3"),
        ({"offload_params": "cpu"}, "needs zero_stage=3"),
        ({"zero_stage": 0, "offload_optimizer": "cpu"}, "needs zero_stage >= 1"),
        ({"offload_optimizer": "nvme"}, "nvme_path"),
        ({"offload_optimizer": "disk"}, "is not one of"),
    ],
)
def test_bad_settings_name_their_keys(settings, message):
    with pytest.raises(ConfigError, match=message):
        DeepSpeedConfig(**settings)


@pytest.mark.parametrize(
    ("layout", "settings", "message"),
    [
        (
            {"ep": 2},
            {"zero_stage": 3},
            "zero_stage=3: DeepSpeed runs expert parallelism with ZeRO 1-2",
        ),
        (
            {"ep": 2},
            {"zero_stage": 0},
            "zero_stage=0: DeepSpeed runs expert parallelism with ZeRO 1-2",
        ),
        ({"ep": 2}, {"zero_stage": 2, "offload_optimizer": "cpu"}, "set offload_optimizer=none"),
        ({"dp_replicate": 2}, {}, "parallel.dp_replicate > 1 (HSDP) is FSDP2's layout"),
        ({"tp": 2}, {}, "parallel.tp > 1: tensor parallelism runs on parallel.engine=fsdp2"),
    ],
)
def test_layouts_the_engine_does_not_take_are_refused_with_the_way_on(layout, settings, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        refuse_unsupported(request(layout=layout, **settings), "adamw")
