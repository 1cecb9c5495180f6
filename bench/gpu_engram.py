"""The Engram part of bench/gpu_check.py: tables on the GPU vs kept in host memory (offload).

A `tiny` backbone with one Engram layer whose tables hold 1e7 rows of 32 dims (1.28 GB fp32):
the training step (bf16 autocast forward + backward + row-wise Adam) with the tables on the GPU
and with `model.engram.offload=true` (host memory; the rows a step reads go to the GPU through
pinned memory and their gradient rows come back), after checking that both give the same loss; and the copy
alone of one step's rows (B T heads Dh fp32) host -> device, pinned.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ROWS, HEADS, BATCH, SEQ = 10**7, 8, 8, 1024


def _engine(offload: bool):
    from model.presets import load_preset
    from model.transformer import build_model
    from optim.builder import build_optimizer
    from optim.config import OptimConfig

    per_head = ROWS // HEADS
    overrides = {
        "engram.layers": [1],
        "engram.heads": HEADS // 2,
        "engram.dim": 128,
        "engram.table_sizes": [per_head, per_head],
        "engram.offload": offload,
        "max_seq_len": SEQ,
    }
    model = build_model(load_preset("tiny", overrides), device="cuda", seed=0)
    return model, build_optimizer(OptimConfig(), model)


def _step(model, optimizer, tokens) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def engram_offload(timed: Callable[[Callable[[], object]], dict]) -> dict:
    """Step times on the GPU and offloaded (same loss checked first), and the rows' copy."""
    tokens = torch.randint(0, 8192, (BATCH, SEQ + 1), device="cuda")
    out: dict = {"rows": ROWS, "batch": [BATCH, SEQ]}
    losses = {}
    for offload in (False, True):
        model, optimizer = _engine(offload)
        table = model.layers["1"].engram.table.weight
        assert table.device.type == ("cpu" if offload else "cuda")
        losses[offload] = float(_step(model, optimizer, tokens))
        out["offload" if offload else "on_gpu"] = timed(
            lambda m=model, o=optimizer: _step(m, o, tokens)
        )
        del model, optimizer
        torch.cuda.empty_cache()
    out["first_loss"] = losses
    out["same_first_loss"] = abs(losses[True] - losses[False]) < 1e-4
    row_bytes = BATCH * SEQ * HEADS * 32 * 4
    host = torch.empty(row_bytes // 4, pin_memory=True)
    copy = timed(lambda: host.to("cuda", non_blocking=True))
    out["rows_copy"] = copy | {
        "bytes": row_bytes,
        "gb_per_s": round(row_bytes / (copy["median_ms"] / 1e3) / 1e9, 1),
    }
    return out
