"""What FSDP2's mixed precision does to a block's inputs (one gloo process, CPU).

`MixedPrecisionPolicy(param_dtype=bf16)` casts every floating tensor among a sharded module's forward
inputs to bf16, dataclass fields included. The RoPE rotations travel as complex64, which that cast
leaves alone, so the angles stay fp32 inside a sharded block.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from model import build_model
from model.presets import load_preset

pytestmark = pytest.mark.distributed


@pytest.fixture
def gloo_group(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("preset", ["tiny", "tiny_mla"])
def test_rope_rotations_stay_fp32_inside_a_bf16_sharded_block(gloo_group, preset):
    torch.manual_seed(0)
    model = build_model(load_preset(preset, {"n_layers": 2}))
    reference = build_model(load_preset(preset, {"n_layers": 2}))
    reference.load_state_dict(model.state_dict())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    seen = []
    model.layers["0"].attn.register_forward_pre_hook(
        lambda _m, args: seen.append(next(iter(args[1].rope.values())).dtype)
    )
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 32))
    loss = model(tokens, tokens.roll(-1, dims=1))
    assert seen == [torch.complex64]
    assert (
        abs(loss.item() - reference(tokens, tokens.roll(-1, dims=1)).item()) < 2e-2
    )  # bf16 compute
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
