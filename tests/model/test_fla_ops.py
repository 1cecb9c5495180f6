"""The glue to fla-core's delta-rule kernels (model/mixers/fla_ops.py), on CPU: fla's Triton ops do not
run here, so a fake `fla` with the four functions' documented API (fla-core 0.6.0: argument names,
[B, T, H, K] layout, varlen as B = 1 with `cu_seqlens`, states [N, HV, K, V], `scale=None` meaning
K^-1/2), computed by a slow loop over sequences, stands in for it. The glue must then equal our
torch chunked form in fp64: per-head and per-channel decays, packed documents, initial states,
decoding; and the kernel choice must fall back, or fail clearly, where fla cannot run."""

from __future__ import annotations

import itertools
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from model.config import GDNConfig, KDAConfig
from model.errors import ConfigError
from model.init import InitStds
from model.mixers import fla_ops
from model.mixers.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from model.mixers.fla_ops import fla_gated_delta_rule, use_fla
from model.mixers.gdn import GatedDeltaNet, l2_normalize
from model.mixers.kda import KimiDeltaAttention
from model.mixers.kv_cache import RecurrentState
from model.mixers.masks import AttentionContext, document_starts, positions_in_documents
from model.mixers.mixer import LayerDims

F64 = dict(rtol=1e-10, atol=1e-10)


# ---- the fake fla ---------------------------------------------------------------------------


def _sequences(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(row, start, end) of each sequence, as fla reads a batch or a varlen row."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    assert B == 1, "fla: the batch size is expected to be 1 when using `cu_seqlens`"
    assert cu_seqlens.dtype == torch.long and cu_seqlens.dim() == 1
    bounds = cu_seqlens.tolist()
    assert bounds[0] == 0 and bounds[-1] == T and all(a < b for a, b in itertools.pairwise(bounds))
    return [(0, a, b) for a, b in itertools.pairwise(bounds)]


def _reference(q, k, v, decay, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens):
    """fla's semantics by a loop over sequences: q, k [B, T, H, K], v [B, T, HV, V], decay
    [B, T, HV] or [B, T, HV, K] (log space), beta [B, T, HV], states [N, HV, K, V]."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    assert k.shape == q.shape and HV % H == 0
    assert beta.shape == (B, T, HV) and decay.shape[:3] == (B, T, HV)
    if l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * (K**-0.5 if scale is None else scale)
    q, k = (x.repeat_interleave(HV // H, dim=2) for x in (q, k))
    sequences = _sequences(B, T, cu_seqlens)
    if initial_state is not None:
        assert initial_state.shape == (len(sequences), HV, K, V)
    outputs, finals = [], []
    for n, (b, start, end) in enumerate(sequences):
        part = [x[b : b + 1, start:end].transpose(1, 2) for x in (q, k, v, decay, beta)]
        state = None if initial_state is None else initial_state[n : n + 1]
        o, final = recurrent_gated_delta_rule(*part, state=state)
        outputs.append(o.transpose(1, 2))
        finals.append(final)
    o = torch.cat(outputs, dim=1 if cu_seqlens is not None else 0)
    return o, (torch.cat(finals) if output_final_state else None)


def _plain(**flags) -> None:
    """The options the glue must leave at their defaults: we pass post-sigmoid beta, log-decay
    g and K-first states."""
    assert not any(flags.values()), flags


def make_fake_fla(calls: list[dict]) -> dict[str, types.ModuleType]:
    def chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=None,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        use_beta_sigmoid_in_kernel=False,
        allow_neg_eigval=False,
        state_v_first=False,
        cu_seqlens=None,
        cu_seqlens_cpu=None,
        chunk_indices=None,
        cp_context=None,
        **kwargs,
    ):
        calls.append(
            dict(
                op="chunk_gated_delta_rule",
                scale=scale,
                cu_seqlens=cu_seqlens,
                l2norm=use_qk_l2norm_in_kernel,
                kwargs=kwargs,
            )
        )
        _plain(
            sigmoid=use_beta_sigmoid_in_kernel,
            neg=allow_neg_eigval,
            v_first=state_v_first,
            gate=kwargs.get("use_gate_in_kernel", False),
        )
        assert g.shape == beta.shape == v.shape[:3]
        return _reference(
            q,
            k,
            v,
            g,
            beta,
            scale,
            initial_state,
            output_final_state,
            use_qk_l2norm_in_kernel,
            cu_seqlens,
        )

    def fused_recurrent_gated_delta_rule(
        q,
        k,
        v,
        g=None,
        gk=None,
        gv=None,
        beta=None,
        scale=None,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        use_gate_in_kernel=False,
        A_log=None,
        dt_bias=None,
        use_beta_sigmoid_in_kernel=False,
        allow_neg_eigval=False,
        state_v_first=False,
        cu_seqlens=None,
        **kwargs,
    ):
        calls.append(
            dict(
                op="fused_recurrent_gated_delta_rule",
                scale=scale,
                cu_seqlens=cu_seqlens,
                l2norm=use_qk_l2norm_in_kernel,
                kwargs=kwargs,
            )
        )
        _plain(
            gate=use_gate_in_kernel,
            sigmoid=use_beta_sigmoid_in_kernel,
            neg=allow_neg_eigval,
            v_first=state_v_first,
            gk=gk is not None,
            gv=gv is not None,
        )
        assert g is not None and g.shape == beta.shape == v.shape[:3]
        with torch.no_grad():  # the real op's backward raises NotImplementedError
            return _reference(
                q,
                k,
                v,
                g,
                beta,
                scale,
                initial_state,
                output_final_state,
                use_qk_l2norm_in_kernel,
                cu_seqlens,
            )

    def chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=None,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False,
        allow_neg_eigval=False,
        safe_gate=False,
        lower_bound=None,
        disable_recompute=False,
        return_intermediate_states=False,
        state_v_first=False,
        cu_seqlens=None,
        cu_seqlens_cpu=None,
        cp_context=None,
        **kwargs,
    ):
        calls.append(
            dict(
                op="chunk_kda",
                scale=scale,
                cu_seqlens=cu_seqlens,
                l2norm=use_qk_l2norm_in_kernel,
                kwargs=kwargs,
            )
        )
        _plain(
            gate=use_gate_in_kernel,
            sigmoid=use_beta_sigmoid_in_kernel,
            neg=allow_neg_eigval,
            safe=safe_gate,
            v_first=state_v_first,
            inter=return_intermediate_states,
        )
        B, T, _, K = q.shape
        assert g.shape == (B, T, v.shape[2], K) and beta.shape == (B, T, v.shape[2])
        return _reference(
            q,
            k,
            v,
            g,
            beta,
            scale,
            initial_state,
            output_final_state,
            use_qk_l2norm_in_kernel,
            cu_seqlens,
        )

    def fused_recurrent_kda(
        q,
        k,
        v,
        g,
        beta,
        A_log=None,
        dt_bias=None,
        scale=None,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False,
        allow_neg_eigval=False,
        lower_bound=None,
        state_v_first=False,
        cu_seqlens=None,
        **kwargs,
    ):
        calls.append(
            dict(
                op="fused_recurrent_kda",
                scale=scale,
                cu_seqlens=cu_seqlens,
                l2norm=use_qk_l2norm_in_kernel,
                kwargs=kwargs,
            )
        )
        _plain(
            gate=use_gate_in_kernel,
            sigmoid=use_beta_sigmoid_in_kernel,
            neg=allow_neg_eigval,
            v_first=state_v_first,
        )
        B, T, _, K = q.shape
        assert g.shape == (B, T, v.shape[2], K) and beta.shape == (B, T, v.shape[2])
        with torch.no_grad():  # no autograd in the real op
            return _reference(
                q,
                k,
                v,
                g,
                beta,
                scale,
                initial_state,
                output_final_state,
                use_qk_l2norm_in_kernel,
                cu_seqlens,
            )

    fla, ops = types.ModuleType("fla"), types.ModuleType("fla.ops")
    gdn, kda = types.ModuleType("fla.ops.gated_delta_rule"), types.ModuleType("fla.ops.kda")
    gdn.chunk_gated_delta_rule = chunk_gated_delta_rule
    gdn.fused_recurrent_gated_delta_rule = fused_recurrent_gated_delta_rule
    kda.chunk_kda, kda.fused_recurrent_kda = chunk_kda, fused_recurrent_kda
    fla.ops, ops.gated_delta_rule, ops.kda = ops, gdn, kda
    return {"fla": fla, "fla.ops": ops, "fla.ops.gated_delta_rule": gdn, "fla.ops.kda": kda}


@pytest.fixture
def fake_fla(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Installs the fake fla; returns the list its functions record their calls in."""
    calls: list[dict] = []
    for name, module in make_fake_fla(calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    return calls


# ---- inputs ---------------------------------------------------------------------------------


def inputs(per_channel=False, B=2, Hk=2, H=4, T=37, Dk=8, Dv=6, seed=0):
    """Our layout, fp64, with GVA: Hk key heads repeated to H value heads."""
    gen = torch.Generator().manual_seed(seed)
    rand = dict(generator=gen, dtype=torch.float64)
    q = l2_normalize(torch.randn(B, Hk, T, Dk, **rand)) * Dk**-0.5
    k = l2_normalize(torch.randn(B, Hk, T, Dk, **rand))
    q, k = (x.repeat_interleave(H // Hk, dim=1) for x in (q, k))
    v = torch.randn(B, H, T, Dv, **rand)
    g = -torch.rand(B, H, T, *((Dk,) if per_channel else ()), **rand) * 0.7
    beta = torch.rand(B, H, T, **rand)
    initial = torch.randn(B, H, Dk, Dv, **rand) * 0.3
    return q, k, v, g, beta, initial


DOCS = torch.tensor([[0] * 5 + [1] * 11 + [2] * 21, [0] * 9 + [1] * 15 + [2] * 13])  # (2, 37)


def continuing_starts() -> torch.Tensor:
    """Row 0 continues the incoming state (no document starts at its first token)."""
    starts = document_starts(DOCS)
    starts[0, 0] = False
    return starts


OPS = {False: "gated_delta_rule", True: "kda"}


# ---- the glue equals the torch chunked form -------------------------------------------------


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("docs", [None, "starts", "continuing"])
@pytest.mark.parametrize("with_initial", [False, True])
def test_equals_the_torch_chunked_form(fake_fla, per_channel, docs, with_initial):
    q, k, v, g, beta, initial = inputs(per_channel)
    initial = initial if with_initial else None
    starts = {None: None, "starts": document_starts(DOCS), "continuing": continuing_starts()}[docs]
    o, final = fla_gated_delta_rule(q, k, v, g, beta, initial, starts)
    o_ref, final_ref = chunk_gated_delta_rule(q, k, v, g, beta, initial, starts, chunk=8)
    torch.testing.assert_close(o, o_ref, **F64)
    torch.testing.assert_close(final, final_ref, **F64)
    (call,) = fake_fla
    assert call["op"] == ("chunk_kda" if per_channel else "chunk_gated_delta_rule")
    assert call["scale"] == 1.0 and call["l2norm"] is False and call["kwargs"] == {}
    if docs is None:
        assert call["cu_seqlens"] is None
    else:  # a segment at every row start and document start of the flattened batch
        assert call["cu_seqlens"].tolist() == [0, 5, 16, 37, 46, 61, 74]


@pytest.mark.parametrize("per_channel", [False, True])
def test_decoding_one_token_uses_the_fused_recurrent_op(fake_fla, per_channel):
    q, k, v, g, beta, initial = inputs(per_channel, T=1)
    with torch.no_grad():
        o, final = fla_gated_delta_rule(q, k, v, g, beta, initial)
    o_ref, final_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial)
    torch.testing.assert_close(o, o_ref, **F64)
    torch.testing.assert_close(final, final_ref, **F64)
    assert [c["op"] for c in fake_fla] == [f"fused_recurrent_{OPS[per_channel]}"]
    assert fake_fla[0]["scale"] == 1.0


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("T", [1, 19])
def test_gradients_match_the_torch_chunked_form(fake_fla, per_channel, T):
    """One token with gradients goes to the chunk op (the fused recurrent one has no backward);
    gradients reach every input, the initial state included, through the document segments."""
    leaves = [x.requires_grad_() for x in inputs(per_channel, T=T, B=2)]
    starts = document_starts(DOCS[:, :T]) if T > 1 else None
    if starts is not None:
        starts[1, 0] = False  # row 1 carries its initial state into its first document
    grads = {}
    for name, fn in (("fla", fla_gated_delta_rule), ("torch", chunk_gated_delta_rule)):
        o, s = fn(*leaves, starts)
        grads[name] = torch.autograd.grad(o.square().sum() + s.sin().sum(), leaves)
    for a, b in zip(grads["fla"], grads["torch"]):
        torch.testing.assert_close(a, b, **F64)
    assert grads["fla"][-1].abs().sum() > 0  # the initial state does get a gradient
    assert {c["op"] for c in fake_fla} == {f"chunk_{OPS[per_channel]}"}


# ---- the kernel choice ----------------------------------------------------------------------


def test_the_kernel_choice_on_cpu(monkeypatch):
    x = torch.zeros(1, 2, 3, 8)
    assert use_fla("torch", x) is False
    assert use_fla("auto", x) is False
    monkeypatch.setattr(fla_ops, "fla_available", lambda: True)
    assert use_fla("auto", x) is False  # installed but not on CUDA: torch
    assert use_fla("torch", x) is False
    with pytest.raises(ConfigError, match=r"model\.gdn\.kernel=fla.*CUDA only.*cpu"):
        use_fla("fla", x)
    monkeypatch.setattr(fla_ops, "fla_available", lambda: False)
    with pytest.raises(ConfigError, match=r"model\.gdn\.kernel=fla.*pip install lmforge\[fla\]"):
        use_fla("fla", x)
    with pytest.raises(ConfigError, match="choose one of: auto, torch, fla"):
        use_fla("triton", x)


def test_a_layer_on_auto_runs_the_torch_form_on_cpu_even_with_fla_installed(fake_fla, monkeypatch):
    monkeypatch.setattr(fla_ops, "fla_available", lambda: True)
    layer = GatedDeltaNet(
        GDNConfig(n_heads=2, head_dim=8, kernel="auto"), LayerDims(16, 1e-6, None)
    )
    layer.init_weights(InitStds(0.2, 0.2, 0.2))
    x = torch.randn(1, 5, 16)
    assert layer(x, _context(None, 5)).shape == (1, 5, 16)
    assert fake_fla == []


def test_the_model_imports_and_runs_without_fla_or_triton():
    """A CPU install has neither: with both made unimportable, the model package, the fla
    dispatch and the Triton kernels' wrapper import (triton is imported on first use only), and
    a layer runs on torch. (Where triton is installed, torch's own Dynamo imports it, so what
    is checked is that nothing of ours needs it at import.)"""
    code = (
        "import sys\n"
        "sys.modules['fla'] = sys.modules['triton'] = None  # import raises ImportError\n"
        "import torch, model, model.mixers.gdn, model.mixers.kda, model.mixers.fla_ops as f\n"
        "import model.kernels.flash_attention\n"
        "from model import ModelConfig, build_model\n"
        "assert not f.fla_available()\n"
        "m = build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=2, layer_pattern=['gdn', 'gqa']))\n"
        "m(torch.randint(0, 64, (1, 8)))\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2]
    )


# ---- the layers pass their kernel through ---------------------------------------------------


def _context(doc_ids: torch.Tensor | None, T: int, start: int = 0) -> AttentionContext:
    if doc_ids is None:
        positions = torch.arange(start, start + T)[None]
        return AttentionContext(positions, None, None, start == 0, start)
    return AttentionContext(
        positions_in_documents(doc_ids), None, None, True, 0, doc_starts=document_starts(doc_ids)
    )


def _layers(kind: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    dims = LayerDims(24, 1e-6, None)
    made = []
    for kernel in ("torch", "fla"):
        torch.manual_seed(0)
        if kind == "gdn":
            cfg = GDNConfig(
                n_heads=2, n_v_heads=4, head_dim=8, v_head_dim=6, chunk_size=8, kernel=kernel
            )
            layer = GatedDeltaNet(cfg, dims)
        else:
            layer = KimiDeltaAttention(KDAConfig(n_heads=2, head_dim=8, kernel=kernel), dims)
        layer = layer.double()
        layer.init_weights(InitStds(0.2, 0.2, 0.2))
        made.append(layer)
    made[1].load_state_dict(made[0].state_dict())
    return made[0], made[1]


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_a_layer_with_kernel_fla_equals_kernel_torch(fake_fla, monkeypatch, kind):
    """Packed documents in a batch, then a prefill and decoded tokens with a state."""
    import model.mixers.gdn

    monkeypatch.setattr(model.mixers.gdn, "use_fla", lambda kernel, x: kernel == "fla")  # CUDA-less
    torch_layer, fla_layer = _layers(kind)
    x = torch.randn(2, 37, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(fla_layer(x, _context(DOCS, 37)), torch_layer(x, _context(DOCS, 37)))
    assert fake_fla and all(c["cu_seqlens"] is not None for c in fake_fla)
    fake_fla.clear()
    with torch.no_grad():
        states = [
            layer.new_state(2, 0, torch.float64, torch.device("cpu"))
            for layer in (torch_layer, fla_layer)
        ]
        outs = [
            layer(x[:, :30], _context(None, 30), s)
            for layer, s in zip((torch_layer, fla_layer), states)
        ]
        torch.testing.assert_close(outs[1], outs[0], **F64)
        for t in range(30, 33):
            outs = [
                layer(x[:, t : t + 1], _context(None, 1, t), s)
                for layer, s in zip((torch_layer, fla_layer), states)
            ]
            torch.testing.assert_close(outs[1], outs[0], **F64)
    assert isinstance(states[1], RecurrentState)
    torch.testing.assert_close(states[1].state, states[0].state, **F64)
    op = OPS[kind == "kda"]
    assert [c["op"] for c in fake_fla] == [f"chunk_{op}"] + [f"fused_recurrent_{op}"] * 3


def test_hopper_with_a_buggy_triton_blocks_flas_backward():
    """fla #640 (seen on an H200: torch 2.11, triton 3.6, fla-core 0.6.0 raised in backward);
    versions compare as packaging (fla's own check) compares them."""

    def bug(triton, capability=(9, 0), nvidia=True, tilelang=False):
        return fla_ops.hopper_triton_bug(capability, triton, nvidia, tilelang)

    assert bug("3.6.0") and bug("3.4.0") and bug("3.7.0+gitabc1234")
    assert bug("3.7.1rc1")  # a pre-release of 3.7.1 is below 3.7.1, as fla sees it
    assert bug("unknown")  # unreadable: assume the worst (the torch form trains correctly)
    assert not bug("3.7.1") and not bug("3.10.0") and not bug("3.3.1") and not bug("3.4.0rc1")
    assert not bug("3.6.0", tilelang=True)  # fla serves that kernel with tilelang (and nvcc)
    assert not bug("3.6.0", capability=(8, 0))  # A100
    assert not bug("3.6.0", capability=(10, 0))  # Blackwell
    assert not bug("3.6.0", nvidia=False)  # ROCm reports capability 9.x for MI200 / MI300


def test_tilelang_counts_only_with_nvcc_and_not_disabled(monkeypatch, tmp_path):
    monkeypatch.setattr(fla_ops.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(fla_ops.shutil, "which", lambda name: None)
    for var in ("CUDA_HOME", "CUDA_PATH", "FLA_TILELANG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(fla_ops, "Path", lambda p: tmp_path / "none" / str(p).lstrip("/"))
    assert not fla_ops._tilelang_usable()  # tilelang without an nvcc: fla falls back to triton
    monkeypatch.setattr(fla_ops.shutil, "which", lambda name: "/usr/bin/nvcc")
    assert fla_ops._tilelang_usable()
    monkeypatch.setenv("FLA_TILELANG", "0")
    assert not fla_ops._tilelang_usable()


def test_the_device_check_is_a_constant_inside_compiled_code(monkeypatch):
    """training_blocker and the fallback warning run at trace time: no graph break."""
    monkeypatch.setattr(fla_ops, "_training_blocker", lambda index: "blocked (fla #640)")
    monkeypatch.setattr(fla_ops, "_WARNED", set())

    def layer(x):
        if fla_ops.training_blocker(0):
            fla_ops._warn_torch_fallback(0)
            return x * 2
        return x * 3

    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="blocked"):
        out = torch.compile(layer, fullgraph=True, backend="eager")(torch.ones(2))
    assert out.tolist() == [2.0, 2.0]


def test_the_kernel_choice_avoids_flas_backward_where_it_is_wrong(monkeypatch):
    """On a blocked device: auto trains with the torch form (and says so once), kernel=fla
    refuses in one line; a forward without gradients (prefill, decoding) still uses fla."""
    from types import SimpleNamespace

    monkeypatch.setattr(fla_ops, "fla_available", lambda: True)
    monkeypatch.setattr(fla_ops, "_WARNED", set())
    reason = "fla-core's gated backward is wrong with triton 3.6.0 on Hopper (fla #640)"
    monkeypatch.setattr(fla_ops, "training_blocker", lambda index: reason)
    q = SimpleNamespace(
        is_cuda=True, dtype=torch.bfloat16, shape=(1, 2, 3, 8), device=torch.device("cuda", 0)
    )
    with pytest.warns(UserWarning, match=r"fla #640\): the delta-rule layers train with the torch"):
        assert use_fla("auto", q) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert use_fla("auto", q) is False
    with pytest.raises(ConfigError, match=r"kernel=fla.*#640.*triton >= 3\.7\.1 or tilelang"):
        use_fla("fla", q)
    with torch.no_grad():
        assert use_fla("auto", q) is True
        assert use_fla("fla", q) is True
    monkeypatch.setattr(fla_ops, "training_blocker", lambda index: "")
    assert use_fla("auto", q) is True
