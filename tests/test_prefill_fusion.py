"""Prefill's fused norms and rotations (`fast.prefill`; `FastPaths(prefill_fusion=True)`, in the `compiled`
preset): each compiled function against the reference functions it fuses (`gemma_rms_norm`, `apply_rope`) and a
float64 computation of the same contract, and a model's prefill through them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from minimax_ref.fast import FastPaths, apply
from minimax_ref.fast import prefill as fp
from minimax_ref.model.norm import gemma_rms_norm
from minimax_ref.model.rope import apply_rope, rope_cos_sin, rope_inv_freq

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                 reason="needs a CUDA device")])]


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element of `x` in its dtype (bf16: 8 significant bits)."""
    mant = torch.finfo(x.dtype).eps  # 2^-(significant bits - 1)
    mag = x.float().abs().clamp_min(torch.finfo(x.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * mant


def _norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps) * (1 + w.double())


def _operands(shape, rot: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)
    w = torch.randn(shape[-1], generator=g) * 0.1
    B, T = shape[0], shape[1]
    pos = torch.arange(T)[None].expand(B, T) + torch.arange(B)[:, None] * 17
    cos, sin = rope_cos_sin(pos, rope_inv_freq(rot, 10000.0))
    return x, w, cos, sin


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 300, 96), (2, 70, 4, 32), (3, 65, 1, 64), (1, 1000, 6144)])
def test_fused_norm_within_one_ulp(shape, device):
    """The compiled norm equals `gemma_rms_norm` except where the fp32 value lies at a bf16 rounding boundary: at
    most one unit in the last place, on few elements; both are the float64 norm rounded once to bf16 (within one
    ulp of it, from the fp32 arithmetic before the rounding)."""
    x, w, *_ = _operands(shape, 16, seed=len(shape))
    x, w = x.to(device), w.to(device)
    want = gemma_rms_norm(x, w, 1e-6)
    got = fp.fused_rms_norm(x, w, 1e-6)
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    assert (diff <= _ulp(want)).all()
    assert (diff > 0).float().mean() < 0.01
    exact = _norm64(x, w, 1e-6)
    for y in (got, want):
        assert ((y.double() - exact).abs() <= _ulp(y).double() * 1.01).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape, rot", [((2, 70, 4, 32), 16), ((1, 130, 8, 64), 64), ((2, 66, 1, 32), 32),
                                        ((1, 700, 64, 128), 64)])
def test_fused_norm_rope_within_one_ulp(shape, rot, device):
    """The compiled norm + rotation equals `apply_rope(gemma_rms_norm(...))`, the norm's bf16 rounding kept before
    the rotation (which a fused kernel could elide): off only where the norm's value sits at a bf16 boundary, by what
    one ulp of the norm moves the rotation, and bit-identical elsewhere."""
    x, w, cos, sin = (t.to(device) for t in _operands(shape, rot, seed=rot))
    want = apply_rope(gemma_rms_norm(x, w, 1e-6), cos, sin)
    got = fp.fused_norm_rope(x, w, 1e-6, cos, sin)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    normed = gemma_rms_norm(x, w, 1e-6).float()
    # a rotated value combines two normed values (cos and sin terms), each at most one ulp off, then rounds to bf16
    bound = 2 * (_ulp(normed).amax(-1, keepdim=True) + _ulp(want))
    diff = (got.float() - want.float()).abs()
    assert (diff <= bound).all()
    assert (diff > 0).float().mean() < 0.02
    # without the bf16 rounding between norm and rotation the errors would be of the norm's full fp32 precision
    # everywhere; with it, most elements are bit-identical
    assert (diff == 0).float().mean() > 0.98


@pytest.mark.parametrize("device", DEVICES)
def test_fused_swiglu_equals_the_eager_activation(device):
    """The compiled SwiGLU-OAI keeps eager's rounding after each operation: bf16 inputs spanning the clamps (|v| up
    to 12 against limit 7) give eager's bits except where a sigmoid differs in its last place (at most one ulp, on
    few elements); both follow the float64 formula on the same inputs."""
    from minimax_ref.model.mlp import swiglu_oai

    g = torch.Generator().manual_seed(9)
    gate = (torch.randn(333, 96, generator=g) * 4).bfloat16().to(device)
    up = (torch.randn(333, 96, generator=g) * 4).bfloat16().to(device)
    want = swiglu_oai(gate, up, 1.702, 7.0)
    got = fp.fused_swiglu(gate, up, 1.702, 7.0)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    assert (diff <= _ulp(want)).all() and (diff > 0).float().mean() < 0.01
    gd, ud = gate.double().clamp(max=7.0), up.double().clamp(-7.0, 7.0)
    exact = (ud + 1) * gd * torch.sigmoid(1.702 * gd)
    # eager rounds alpha * g to bf16 before the sigmoid (relative 2^-9 of up to 12: a few % of the sigmoid where it
    # is small), so the formula agrees to a few percent, not to the last place
    for y in (got, want):
        assert ((y.double() - exact).abs() <= 0.06 * exact.abs() + 1e-3).all()


@pytest.mark.parametrize("ep_rank", [None, 0, 1])
def test_fused_combine_equals_the_unfused_and_the_reference(ep_rank):
    """The routed experts of 150 tokens sorted by expert with the fused combine: within fp32 rounding of the unfused
    sorted path and of the reference's loop over experts, also under expert parallelism (the other rank's pairs add
    nothing) and with an expert no token chose; and `combine_sorted` on a hand-made case."""
    from minimax_ref.model.moe import Experts, Routing, route
    from minimax_ref.model.parallel import World

    world = None if ep_rank is None else World(ep_rank, 2)
    g = torch.Generator().manual_seed(5)
    ex = Experts(16, 64, 32, 1.702, 7.0, world, ep_rank is not None)
    n, c = len(ex.local_experts), ex.channels.stop - ex.channels.start
    for leaf, shape in (("w1", (n, c, 64)), ("w3", (n, c, 64)), ("w2", (n, 64, c))):
        setattr(ex, leaf, torch.nn.Parameter(torch.randn(shape, generator=g) * 0.125, requires_grad=False))
    x = torch.randn(150, 64, generator=g)
    r = route(x, torch.randn(16, 64, generator=g), None, 4)
    r = Routing(torch.where(r.expert_ids == 5, 6, r.expert_ids), r.weights, r.logits)
    want = ex(x, r)
    apply(ex, FastPaths(moe=True))
    unfused = ex(x, r)
    apply(ex, FastPaths(moe=True, prefill_fusion=True))
    got = ex(x, r)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got - unfused).abs().max() / unfused.abs().max()).item() < 1e-6
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-6

    y = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]).bfloat16()
    inv = torch.tensor([[2, 0], [1, 3]])  # token 1's second pair is another rank's (row 3 >= 3 rows)
    w = torch.tensor([[0.5, 0.25], [2.0, 0.75]])
    want = torch.tensor([[0.5 * 5 + 0.25 * 1, 0.5 * 6 + 0.25 * 2], [2.0 * 3, 2.0 * 4]])
    assert torch.equal(fp.combine_sorted(y, inv, w, 3), want)
    assert torch.equal(fp.fused_combine_sorted(y, inv, w, 3), want)
    assert torch.equal(fp.fused_combine_sorted(y[:0], inv + 3, w, 0), torch.zeros(2, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [True, False])
def test_fused_moe_block_equals_the_reference_block(dtype, shared, monkeypatch):
    """A MoE block (router, 16 experts of which one is never chosen, a shared expert or none, scaling 2.5) on 150
    tokens: with `prefill_fusion` its output comes from `moe_output` in one kernel and equals the reference block's
    `MoE.forward` within fp32 rounding (fp32), within one bf16 unit in the last place (bf16: the one rounding of an
    fp32 sum whose order differs); `moe_output` on a hand-made case equals the formula exactly."""
    from minimax_ref.model.moe import MoE

    g = torch.Generator().manual_seed(11)
    moe = MoE(64, 16, 4, 32, 48, int(shared), 2.5, True, 1.702, 7.0)
    for name, p in moe.named_parameters():
        p.data = (torch.randn(p.shape, generator=g) * (0.02 if "bias" in name else 0.125))
    moe.gate.e_score_correction_bias.data[5] = -100.0  # expert 5 is never chosen
    moe = moe.to(dtype)
    x = torch.randn(150, 64, generator=g).to(dtype)
    with torch.no_grad():
        want = moe(x)
        apply(moe, FastPaths(moe=True, prefill_fusion=True))
        assert type(moe).__name__ == "FastMoE"
        seen = []
        import minimax_ref.fast.moe as fm

        monkeypatch.setattr(fm, "fused_moe_output", lambda *a: seen.append(a) or fp.fused_moe_output(*a))
        got = moe(x)
        monkeypatch.undo()
        unfused = MoE.forward(moe, x)  # the twin's experts without the block's fusion
    assert len(seen) == 1 and got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-6
    else:
        assert ((got.float() - unfused.float()).abs() <= _ulp(unfused)).all()
        assert ((got.float() - want.float()).abs() <= 2 * _ulp(want) + 1e-6).all()

    y = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    inv = torch.tensor([[2, 0], [1, 2]])
    w = torch.tensor([[0.5, 0.25], [2.0, 0.75]])
    sh = torch.tensor([[0.125, -1.0], [1.0, 0.0]])
    routed = torch.tensor([[0.5 * 5 + 0.25 * 1, 0.5 * 6 + 0.25 * 2], [2.0 * 3 + 0.75 * 5, 2.0 * 4 + 0.75 * 6]])
    assert torch.equal(fp.moe_output(y, inv, w, 3, 3.0, sh), routed * 3.0 + sh)
    assert torch.equal(fp.fused_moe_output(y, inv, w, 3, 3.0, None), routed * 3.0)
    assert torch.equal(fp.fused_moe_output(y.bfloat16(), inv, w, 3, 3.0, sh.bfloat16()),
                       (routed * 3.0 + sh).bfloat16())
    assert torch.equal(fp.fused_moe_output(y[:0], inv + 3, w, 0, 3.0, sh), sh)  # no routed row of this rank


def test_model_prefill_through_the_fused_kernels(tiny_nvfp4, monkeypatch):
    """A bf16 model prefilling 90 tokens of two sequences with `prefill_fusion`: every decoder layer's two norms and
    every attention's q / k (and, on MSA layers, index q / k) go through the compiled functions, decode-sized calls
    do not, and the logits equal the same fast paths without the fusion up to bf16 rounding."""
    from minimax_ref.weights.loader import load_model

    model = load_model(tiny_nvfp4, dtype=torch.bfloat16, weights="packed")
    ids = torch.randint(0, 1000, (2, 100), generator=torch.Generator().manual_seed(3))
    pos = torch.stack([torch.arange(100), torch.arange(100) + 5])

    def run() -> torch.Tensor:
        with torch.no_grad():
            cache = model.new_cache(2, 128)
            first = model(ids[:, :90], positions=pos[:, :90], cache=cache)
            return torch.cat([first, model(ids[:, 90:], positions=pos[:, 90:], cache=cache)], dim=1)

    apply(model, True)
    want = run()
    calls = {"norm": 0, "norm_rope": 0, "combine": 0, "moe_output": 0, "swiglu": 0}
    norm, norm_rope, combine, swiglu = fp.fused_rms_norm, fp.fused_norm_rope, fp.fused_combine_sorted, fp.fused_swiglu

    def count(name, fn):
        def wrapped(x, *args):
            assert name in ("combine", "moe_output", "swiglu") or x.shape[1] == 90
            calls[name] += 1
            return fn(x, *args)
        return wrapped

    import minimax_ref.fast.attention as fa
    import minimax_ref.fast.compiled as fc
    import minimax_ref.fast.moe as fm

    monkeypatch.setattr(fm, "fused_combine_sorted", count("combine", combine))
    monkeypatch.setattr(fm, "fused_moe_output", count("moe_output", fp.fused_moe_output))
    monkeypatch.setattr(fm, "fused_swiglu", count("swiglu", swiglu))
    monkeypatch.setattr(fc, "fused_rms_norm", count("norm", norm))
    monkeypatch.setattr(fa, "fused_norm_rope", count("norm_rope", norm_rope))
    apply(model, replace(FastPaths.of(True), prefill_fusion=True))
    got = run()
    layers = model.layers
    sparse = sum(layer.self_attn.sparse for layer in layers)
    moe = sum(hasattr(layer, "block_sparse_moe") for layer in layers)
    mlps = sum(type(m).__name__ == "FastMLP" for m in layers.modules())  # dense MLPs and shared experts
    # each MLP once, each MoE layer's routed experts once (one group: their decoded weights fit together), finished
    # with the shared expert in one kernel (one rank)
    assert moe and calls == {"norm": 2 * len(layers), "norm_rope": 2 * len(layers) + 2 * sparse, "combine": 0,
                             "moe_output": moe, "swiglu": mlps + moe}
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95  # a near tie may flip under one ulp
    # one ulp in an index query can turn a near tie of MSA block scores: that token attends over another block and
    # its logits move; the others stay within bf16 rounding
    per_position = (got.float() - want.float()).abs().amax(-1) / want.float().abs().amax()
    assert per_position.median() < 1e-2 and (per_position < 5e-2).float().mean() > 0.9
    apply(model, FastPaths())
    assert type(model.layers[0].input_layernorm).__name__ == "RMSNorm"


def test_presets():
    """`compiled` (what `--fast auto` takes on a GPU) fuses prefill; `on` compiles nothing, so it does not."""
    assert FastPaths.of("compiled").prefill_fusion
    assert not FastPaths.of("on").prefill_fusion and not FastPaths.of("off").prefill_fusion
