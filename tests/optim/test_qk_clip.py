"""QK-clip: the recorded max logits against materialized logits, every head capped at tau after
a clip (MHA, GQA, MLA), heads below tau untouched bit for bit, and a high-learning-rate run in
which MuonClip keeps the max logit bounded while plain Muon lets it grow."""

from __future__ import annotations

import pytest
import torch

import model.mixers.qk_logits as qk_logits
from model.mixers.masks import build_mask
from model.presets import load_preset
from model.transformer import build_model
from optim.builder import build_optimizer
from optim.config import OptimConfig
from optim.qk_clip import apply_qk_clip, clip_layers, enable_qk_clip, pop_max_logits

SMALL = {"d_model": 64, "n_layers": 2, "vocab_size": 96, "max_seq_len": 64, "loss_chunk_tokens": 64}
VARIANTS = {
    "mha": ("tiny", {"attention.n_heads": 4, "attention.n_kv_heads": 4}),
    "gqa": ("tiny", {"attention.n_heads": 4, "attention.n_kv_heads": 2}),
    "mla": ("tiny_mla", {}),
}


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("docs", [False, True])
def test_max_logits_match_materialized_logits(monkeypatch, window: int, docs: bool) -> None:
    monkeypatch.setattr(qk_logits, "CHUNK_LOGITS", 2 * 4 * 24 * 3)  # 3 query rows per chunk
    gen = torch.Generator().manual_seed(0)
    B, H, K, T, D = 2, 4, 2, 24, 8
    q, k = torch.randn(B, H, T, D, generator=gen), torch.randn(B, K, T, D, generator=gen)
    doc_ids = torch.randint(0, 3, (B, T), generator=gen).sort(dim=1).values if docs else None
    mask, is_causal = build_mask(T, 0, window=window, doc_ids=doc_ids)
    got = qk_logits.max_logits_per_head(q, k, 0.5, mask, is_causal, 0)
    logits = (q @ k.repeat_interleave(H // K, dim=1).transpose(-1, -2)) * 0.5  # (B, H, T, T)
    allowed = mask if mask is not None else torch.ones(T, T, dtype=torch.bool).tril()
    want = logits.masked_fill(~allowed.expand_as(logits), float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _model(variant: str):
    # one layer: the attention input is the embedding, which the clip leaves alone, so the
    # logits after the clip are those of the same inputs (deeper layers' inputs would move)
    preset, extra = VARIANTS[variant]
    cfg = load_preset(preset, SMALL | extra | {"n_layers": 1})
    model = build_model(cfg, seed=0)
    with torch.no_grad():  # large query/key weights: logits in the hundreds
        for _, attn in clip_layers(model):
            for param, _ in attn.qk_clip_row_scales(torch.ones(cfg.attention.n_heads)):
                param.mul_(12.0)
    return model, cfg


def _max_logits(model, tokens) -> torch.Tensor:
    enable_qk_clip(model)
    model(tokens[:, :-1], tokens[:, 1:])
    return pop_max_logits(model)


@pytest.mark.parametrize("variant", ["mha", "gqa", "mla"])
def test_after_a_clip_every_head_is_at_most_tau(variant: str) -> None:
    model, cfg = _model(variant)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    before = _max_logits(model, tokens)  # (L, H)
    tau = float(before.median())  # about half the heads above, half below
    below = before <= tau
    params_before = {name: p.detach().clone() for name, p in model.named_parameters()}
    stats = apply_qk_clip(model, before, tau)
    assert stats["qk/clipped_heads"] == float((~below).sum()) > 0
    after = _max_logits(model, tokens)
    assert bool((after <= tau * (1 + 1e-4)).all()), (after, tau)
    torch.testing.assert_close(
        after[~below], torch.full_like(after[~below], tau), rtol=1e-4, atol=0
    )
    # heads that were below tau: their rows keep their exact values (MHA/MLA: x 1.0; GQA: only
    # the query rows of clipped heads change, the shared key heads never do)
    for (_, attn), layer_below in zip(clip_layers(model), below):
        for param, _rows in attn.qk_clip_row_scales(
            torch.ones_like(layer_below, dtype=torch.float32)
        ):
            full_name = next(n for n, p in model.named_parameters() if p is param)
            per_row = layer_below.float().repeat_interleave(param.shape[0] // layer_below.numel())
            unchanged = per_row.bool()
            assert torch.equal(param[unchanged], params_before[full_name][unchanged]), full_name
    if variant == "gqa":
        for name, p in model.named_parameters():
            if "k_proj" in name:
                assert torch.equal(p, params_before[name])


def test_qk_norm_models_are_refused() -> None:
    cfg = load_preset("tiny", SMALL | {"attention.qk_norm": True})
    with pytest.raises(Exception, match="QK-norm"):
        enable_qk_clip(build_model(cfg, seed=0))


def _run(
    tau: float,
    steps: int = 30,
    backend: str = "sdpa",
    stats: list | None = None,
    rows: int = 8,
) -> list[float]:
    """Each step's pre-clip max logit of a high-learning-rate MuonClip run (`stats` collects the
    steps' whole QK-clip statistics), on batches of `rows` sequences of 32 tokens."""
    from data.loader import Batch
    from parallel.engine import FSDP2Engine
    from trainer.hooks import start_hooks
    from trainer.step import LossTracker, StepSettings, train_step

    cfg = load_preset("tiny", SMALL | {"attention.backend": backend})
    model = build_model(cfg, seed=0)
    enable_qk_clip(model)
    opt = build_optimizer(OptimConfig(name="muonclip", lr=0.08, weight_decay=0.0), model)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (rows, 33), generator=gen)
    batch = Batch(tokens[:, :-1], tokens[:, 1:], torch.zeros_like(tokens[:, 1:]))
    engine = FSDP2Engine(model, opt, "fp32", torch.device("cpu"))
    hooks = start_hooks(engine, tau, None)
    peaks = []
    for _ in range(steps):
        result = train_step(engine, batch, StepSettings(), LossTracker(0.0), hooks)
        peaks.append(result.metrics["qk/max_logit"])
        if stats is not None:
            stats.append({k: v for k, v in result.metrics.items() if k.startswith("qk/")})
    return peaks


def test_muonclip_bounds_the_max_logit_where_muon_lets_it_grow() -> None:
    tau = 5.0
    plain = _run(1e9)  # records the logits but never clips: plain Muon
    clipped = _run(tau)
    assert max(plain[-5:]) > 4 * tau  # the high learning rate keeps growing the logits (to ~30)
    # each logged value is the step's pre-clip max: one step's growth above tau at most (~7.6)
    assert max(clipped) < 2 * tau, clipped


def test_muonclip_on_the_triton_kernel_clips_the_heads_sdpa_clips(monkeypatch) -> None:
    """The kernel's max logits (a by-product of its forward, under Triton's interpreter here)
    drive the same clips as SDPA plus the chunked recomputation, which the kernel path never
    calls: the same (layer, head) pairs clipped at every step. The first step's max logits agree
    to 1e-5; later ones to 5% only: at this learning rate Muon's bf16 Newton-Schulz turns the
    kernels' 1e-6 gradient differences into 2e-3 after one step, 2% after five."""
    pytest.importorskip("triton")
    import model.mixers.attention_backend as backends
    import optim.qk_clip

    clipped: list = []
    apply = optim.qk_clip.apply_qk_clip

    def recording_apply(model, max_logits, tau, scale=None):
        clipped.append(max_logits > tau)  # (L, H): the heads this step clips
        return apply(model, max_logits, tau, scale)

    monkeypatch.setattr(optim.qk_clip, "apply_qk_clip", recording_apply)
    sdpa_stats: list[dict] = []
    # max logits 0.11, 0.22, 0.33, ...: clips from step 3
    _run(0.3, steps=5, stats=sdpa_stats, rows=4)
    sdpa_clipped, clipped = clipped, []
    monkeypatch.setattr(backends, "max_logits_per_head", None)  # any call would fail
    kernel_stats: list[dict] = []
    _run(0.3, steps=5, backend="triton", stats=kernel_stats, rows=4)  # interpreted: ~15 s
    assert sum(s["qk/clipped_heads"] for s in sdpa_stats) >= 8
    for step, (got, want) in enumerate(zip(clipped, sdpa_clipped, strict=True)):
        assert torch.equal(got, want), step
    assert kernel_stats[0] == pytest.approx(sdpa_stats[0], rel=1e-5)
    for got, want in zip(kernel_stats, sdpa_stats, strict=True):
        assert got == pytest.approx(want, rel=5e-2)


def test_recording_compiles_each_block_once_over_micro_batches_and_steps() -> None:
    """The running max is a tensor from enable_qk_clip on (never None), so a compiled block's
    guards hold in every micro-batch and after every pop: no recompiles (with None in the first
    micro-batch every block compiled twice under gradient accumulation). Same maxima as eager."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model, cfg = _model("gqa")
    enable_qk_clip(model)
    counter = CompileCounter()
    blocks = list(model.layers.values())
    for block in blocks:
        block.compile(backend=counter)
    gen = torch.Generator().manual_seed(2)
    micro_batches = [torch.randint(0, cfg.vocab_size, (2, 17), generator=gen) for _ in range(2)]
    compiled_logits, frames_after_first = [], None
    for _step in range(2):
        for tokens in micro_batches:
            model(tokens[:, :-1], tokens[:, 1:]).backward()
            frames_after_first = frames_after_first or counter.frame_count
        compiled_logits.append(pop_max_logits(model))
    assert counter.frame_count == frames_after_first > 0
    for block in blocks:  # the same steps in eager
        block._compiled_call_impl = None
    for step in range(2):
        for tokens in micro_batches:
            model(tokens[:, :-1], tokens[:, 1:]).backward()
        torch.testing.assert_close(pop_max_logits(model), compiled_logits[step])


def test_a_layer_without_a_training_forward_is_left_out_of_the_logged_peaks() -> None:
    """A layer that recorded nothing since the last read (-inf) clips nothing and logs nothing:
    -inf is not JSON (metrics.jsonl) and wandb rejects it."""
    import json

    cfg = load_preset("tiny", SMALL | {"n_layers": 2})
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    peaks = _max_logits(model, tokens)  # (2, H)
    peaks[1] = float("-inf")  # layer 1: no forward since the last read
    stats = apply_qk_clip(model, peaks, tau=1e9)
    assert "qk/layer1/max_logit" not in stats and stats["qk/layer0/max_logit"] > 0
    assert stats["qk/max_logit"] == stats["qk/layer0/max_logit"]
    json.loads(json.dumps(stats, allow_nan=False))
    nothing = apply_qk_clip(model, torch.full_like(peaks, float("-inf")), tau=1e9)
    assert nothing == {"qk/clipped_heads": 0.0}
