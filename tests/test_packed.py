"""Packed weights, synthetic checkpoints in memory, and the fast paths, on CPU.

* packed == dequant: the decoders against `quant.dequant_*` on every byte value (bit-identical), then
  whole models (logits bit-identical, same greedy tokens) on NVFP4 and MXFP8 checkpoints, fp32 and bf16,
  at TP=1 and TP=2 (two spawned gloo ranks);
* memory at load is the packed size, tensor by tensor;
* synthetic weights: load and run at tiny scale, equal across TP sizes, packed == dequant, realistic
  magnitudes, valid scales;
* every fast path equals its reference (bit-identical decoders; the rest to fp32 rounding), and a
  fast decode step makes no host synchronisation;
* the command line and the benchmark scripts run (small presets).
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from minimax_ref.errors import ConfigError
from minimax_ref.fast import FastPaths, Kernels, apply
from minimax_ref.fast.attention import block_sparse_attention as fast_block_sparse_attention
from minimax_ref.fast.attention import causal_attention_sdpa
from minimax_ref.fast.attention import gather_block_attention as fast_gather_block_attention
from minimax_ref.fast.attention import select_blocks_chunked as fast_select_blocks_chunked
from minimax_ref.fast.moe import FastExperts
from minimax_ref.fast.packed import decode_fast
from minimax_ref.generation.generate import SamplingParams, generate_ids
from minimax_ref.model.attention import causal_attention
from minimax_ref.model.moe import Experts, Routing, route
from minimax_ref.model.msa import gather_block_attention, msa_attention
from minimax_ref.model.parallel import World
from minimax_ref.weights.checkpoint import DENSE, NVFP4, open_checkpoint
from minimax_ref.weights.loader import load_model, load_synthetic
from minimax_ref.weights.packed import (
    PackedWeight,
    check_packed,
    decode_reference,
    dequantize,
    model_nbytes,
    packed_weights,
)
from minimax_ref.weights.quant import dequant_mxfp8, dequant_nvfp4

REPO = Path(__file__).resolve().parents[1]
IDS = torch.randint(0, 1000, (2, 80), generator=torch.Generator().manual_seed(0))  # past the MSA budget (64)
PROMPTS = [IDS[0, :70].tolist(), IDS[1, :20].tolist()]
GREEDY = SamplingParams(temperature=0)
TIMEOUT_S = 120


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


def _greedy(model, n=5) -> list[list[int]]:
    seqs, _ = generate_ids(model, PROMPTS, max_new_tokens=n, sampling=GREEDY)
    return [s.generated for s in seqs]


# ---------------------------------------------------------------------------------------------- decoders


def _nvfp4_operands(E: int = 3, N: int = 16, K: int = 512, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.arange(256, dtype=torch.uint8).repeat(E * N * K // 2 // 256).view(E, N, K // 2)  # every byte
    weight = weight[:, :, torch.randperm(K // 2, generator=g)]
    scale_bytes = torch.randint(0, 256, (E, N, K // 16), generator=g, dtype=torch.uint8)
    scale_bytes = torch.where((scale_bytes & 0x7F) == 0x7F, scale_bytes - 1, scale_bytes)  # no NaN
    scale_bytes[0, 0, :4] = torch.tensor([0x00, 0x01, 0x7E, 0x80], dtype=torch.uint8)  # 0, subnormal, 448, -0
    g2 = torch.tensor([2.0**-12, 3.7e-4, 0.75], dtype=torch.float32)
    return weight, scale_bytes.view(torch.float8_e4m3fn), g2


def _mxfp8_operands(E: int = 2, N: int = 16, K: int = 512, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b = torch.arange(256, dtype=torch.uint8)
    finite = b[(b & 0x7F) != 0x7F]
    weight = finite[torch.randint(0, len(finite), (E, N, K), generator=g)].view(torch.float8_e4m3fn)
    # exponents from far below the float32 normal range (products round as subnormals) to 2^100
    scale = torch.randint(0, 228, (E, N, K // 32), generator=g, dtype=torch.uint8)
    return weight, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_decoders_equal_quant_on_every_byte(dtype):
    weight, scale, g2 = _nvfp4_operands()
    want = dequant_nvfp4(weight, scale, g2).to(dtype)
    assert torch.equal(decode_reference(NVFP4, weight, scale, g2).to(dtype), want)
    assert torch.equal(decode_fast(NVFP4, weight, scale, g2, dtype), want)
    pw = PackedWeight(NVFP4, weight, scale, g2, dtype=dtype)
    assert pw.shape == want.shape
    for mode in ("reference", "fast"):
        apply(pw, {"decode": mode})
        assert torch.equal(pw.decode(), want)
        assert torch.equal(pw[1], want[1])  # one expert
        ids = torch.tensor([2, 0, 2])  # a gathered batch, repeats allowed
        assert torch.equal(pw.decode(ids), want[ids])
    # one linear (scalar global)
    single = dequant_nvfp4(weight[0], scale[0], g2[1]).to(dtype)
    assert torch.equal(decode_fast(NVFP4, weight[0], scale[0], g2[1], dtype), single)
    assert torch.equal(PackedWeight(NVFP4, weight[0], scale[0], g2[1], dtype=dtype).decode(), single)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_decoders_equal_quant_on_every_byte(dtype):
    weight, scale = _mxfp8_operands()
    want = dequant_mxfp8(weight, scale).to(dtype)
    assert (want == 0).any() and bool(want.abs().max() > 1e30)  # subnormal and huge products are covered
    assert torch.equal(decode_reference("mxfp8", weight, scale).to(dtype), want)
    assert torch.equal(decode_fast("mxfp8", weight, scale, None, dtype), want)
    pw = PackedWeight("mxfp8", weight, scale, dtype=dtype)
    apply(pw, {"decode": "fast"})
    assert torch.equal(pw.decode(torch.tensor([1, 1, 0])), want[[1, 1, 0]])


@pytest.mark.slow
def test_compiled_decoder_equals_quant():
    """torch.compile of the reference decoder (compiles for a while on CPU: slow)."""
    weight, scale, g2 = _nvfp4_operands()
    kernels = Kernels()
    assert torch.equal(kernels.decode(NVFP4, weight, scale, g2, torch.bfloat16),
                       dequant_nvfp4(weight, scale, g2).to(torch.bfloat16))
    w8, s8 = _mxfp8_operands()
    assert torch.equal(kernels.decode("mxfp8", w8, s8, None, torch.bfloat16), dequant_mxfp8(w8, s8).to(torch.bfloat16))


def test_packed_weight_rejects_mismatched_globals():
    weight, scale, g2 = _nvfp4_operands()
    with pytest.raises(ValueError):
        PackedWeight(NVFP4, weight, scale, None)
    with pytest.raises(ValueError):
        PackedWeight("bf16", weight, scale, g2)


# ---------------------------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def checkpoints(ckpt_factory) -> dict[str, Path]:
    return {"nvfp4": ckpt_factory("tiny", "nvfp4"), "mxfp8": ckpt_factory("tiny", "mxfp8")}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_model_is_bit_identical_to_dequant(checkpoints, fmt, dtype):
    dequant = load_model(checkpoints[fmt], dtype=dtype)
    packed = load_model(checkpoints[fmt], dtype=dtype, weights="packed")
    kinds = {(type(m).__name__, m.fmt) for _, m in packed_weights(packed)}
    assert kinds == ({("PackedWeight", "nvfp4"), ("PackedWeight", "mxfp8")} if fmt == "nvfp4"
                     else {("PackedWeight", "mxfp8")})
    assert packed.layers[0].self_attn.q_proj.weight is None
    want = _logits(dequant)
    assert torch.equal(_logits(packed), want)
    apply(packed, {"decode": "fast"})  # the two-pass decoder gives the same bits
    assert torch.equal(_logits(packed), want)
    assert _greedy(packed) == _greedy(dequant)
    # decoding every packed weight once gives the dequant model's parameters
    state = dict(dequant.named_parameters())
    for name, p in dequantize(packed).named_parameters():
        assert torch.equal(p, state[name]), name


def test_packed_emulated_activations_equal_dequant(checkpoints):
    a = load_model(checkpoints["nvfp4"], dtype=torch.float32, act_quant="emulate")
    b = load_model(checkpoints["nvfp4"], dtype=torch.float32, act_quant="emulate", weights="packed")
    assert torch.equal(_logits(a, IDS[:1, :40]), _logits(b, IDS[:1, :40]))


def test_model_nbytes_counts_each_byte_once():
    """Tied tensors and contiguous views into one storage (a joint copy's parts, `fast.joint`) count their bytes once;
    views that overlap count their union; a strided view counts its elements; separate tensors add up."""
    m = torch.nn.Module()
    base = torch.zeros(10, 8, dtype=torch.int32)  # 320 bytes
    m.register_buffer("base", base)
    m.register_buffer("head", base[:4])  # inside base
    m.register_buffer("tail", base[6:])
    m.tied = torch.nn.Parameter(torch.zeros(3, dtype=torch.float32), requires_grad=False)
    m.register_buffer("also_tied", m.tied.data)
    assert model_nbytes(m) == 320 + 12
    views = torch.nn.Module()  # only views, overlapping: rows 0-5 and 3-8 of 10 rows of 8 bytes
    rows = torch.zeros(10, 2, dtype=torch.float32)
    views.register_buffer("a", rows[0:6])
    views.register_buffer("b", rows[3:9])
    assert model_nbytes(views) == 9 * 8
    views.register_buffer("column", rows[:, 1])  # strided: its elements
    views.register_buffer("same_column", rows[:, 1])
    assert model_nbytes(views) == 9 * 8 + 10 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_memory_at_load_is_the_packed_size(checkpoints, dtype):
    """Every quantized linear costs its stored bytes (data, block scales, globals, input scales); plain tensors
    cost their in-memory dtype (norms and router fp32, the rest the compute dtype)."""
    path = checkpoints["nvfp4"]
    ck = open_checkpoint(path)
    model = load_model(path, dtype=dtype, weights="packed")
    elem = torch.tensor([], dtype=dtype).element_size()
    expected = 0
    for f in ck.formats.values():
        names = [n for n in (f.weight, f.scale, f.scale_2, f.input_scale) if n]
        stored = sum(_numel(ck.tensors[n].shape) * _size(ck.tensors[n].dtype) for n in names)
        if f.fmt == DENSE:
            stored = _numel(ck.tensors[f.weight].shape) * elem
        expected += stored
    for spec in ck.plain.values():
        n = _numel(spec.shape)
        expected += n * (4 if spec.family in ("norm", "router") else elem)
    # expert stacks keep an fp32 input scale per expert (1.0 for MXFP8 stacks, which have none on disk)
    t = ck.config.text
    mxfp8_leaves = sum(1 for p, f in ck.formats.items() if ".experts.0." in p and f.fmt != NVFP4)
    expected += 4 * t.num_local_experts * mxfp8_leaves
    assert model_nbytes(model) == expected == model.load_stats["memory_bytes"]
    dequant = load_model(path, dtype=dtype)
    assert model_nbytes(model) < model_nbytes(dequant)
    # the quantized linears alone: packed bytes vs bf16 bytes
    packed_linears = sum(m.nbytes() for _, m in packed_weights(model))
    decoded = sum(m.shape.numel() * 2 for _, m in packed_weights(model))
    assert packed_linears < 0.6 * decoded


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _size(dtype: str) -> int:
    return {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1, "F8_E8M0": 1}[dtype]


def test_corrupt_scale_is_reported_when_packed(checkpoints, tmp_path):
    """The loader runs the decoder's checks on packed tensors too (E8M0 code 255 here)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from minimax_ref.errors import CheckpointError

    dst = tmp_path / "ck"
    shutil.copytree(checkpoints["nvfp4"], dst)
    name = "language_model.model.layers.0.self_attn.q_proj.weight_scale_inv"
    shard = dst / json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] = 255
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_model(dst, weights="packed")
    assert "code 255" in str(e.value.problems)


# ---------------------------------------------------------------------------------------------- synthetic


def test_synthetic_weights_load_run_and_match_their_dequant():
    packed = load_synthetic("tiny", dtype=torch.float32)  # packed by default
    dequant = load_model(None, synthetic="tiny", dtype=torch.float32, weights="dequant")
    assert packed.weights == "packed" and dequant.weights == "dequant" and packed.ckpt_path is None
    a, b = _logits(packed), _logits(dequant)
    assert torch.equal(a, b) and bool(torch.isfinite(a).all())
    assert torch.equal(_logits(load_synthetic("tiny", dtype=torch.float32)), a)  # deterministic
    assert not torch.equal(_logits(load_synthetic("tiny", dtype=torch.float32, seed=1)), a)
    for name, pw in packed_weights(packed):  # every generated scale passes the decoder's checks
        for e in range(pw.shape[0] if pw.weight.dim() == 3 else 1):
            w, s, g = pw.parts(e if pw.weight.dim() == 3 else None)
            check_packed(pw.fmt, w, s, g, name)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_synthetic_magnitudes_follow_synth_rules(fmt):
    """Decoded synthetic weights have about synth.py's standard deviation, 1/sqrt(in) (halved for outputs)."""
    model = load_synthetic("tiny", format=fmt, dtype=torch.float32)
    H = model.text.hidden_size
    q = model.layers[1].self_attn.q_proj.dense_weight()
    o = model.layers[1].self_attn.o_proj.dense_weight()
    w1 = model.layers[1].block_sparse_moe.experts.weight("w1")
    w2 = model.layers[1].block_sparse_moe.experts.weight("w2")
    for w, std in ((q, H**-0.5), (o, 0.5 * o.shape[1] ** -0.5), (w1, H**-0.5), (w2, 0.5 * w2.shape[-1] ** -0.5)):
        assert 0.6 * std < float(w.std()) < 1.6 * std, (tuple(w.shape), float(w.std()), std)


def test_synthetic_overrides_and_real_shapes_on_meta():
    """The release presets' tensor tables (without generating anything) and the --layers/--experts overrides."""
    from minimax_ref.weights.synthetic import SyntheticCheckpoint

    ck = SyntheticCheckpoint("pruned-80", "nvfp4", layers=5, experts=8)
    t = ck.config.text
    assert (t.num_hidden_layers, t.num_local_experts, t.hidden_size) == (5, 8, 6144)
    assert ck.formats["language_model.model.layers.4.block_sparse_moe.experts.7.w2"].fmt == NVFP4
    assert ck.tensors["language_model.model.layers.4.block_sparse_moe.experts.7.w2.weight"].shape == (6144, 1536)
    full = SyntheticCheckpoint("pruned-80", "nvfp4")
    assert full.config.text.num_local_experts == 80 and full.config.text.num_hidden_layers == 60


# ---------------------------------------------------------------------------------------------- fast paths


def _experts(E=16, H=64, I=32, world=None, ep=False, seed=0):  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    ex = Experts(E, H, I, 1.702, 7.0, world, ep)
    n = len(ex.local_experts)
    for leaf, shape in (("w1", (n, ex.channels.stop - ex.channels.start, H)), ("w3", None), ("w2", None)):
        shape = shape or ((n, ex.channels.stop - ex.channels.start, H) if leaf == "w3"
                          else (n, H, ex.channels.stop - ex.channels.start))
        setattr(ex, leaf, torch.nn.Parameter(torch.randn(shape, generator=g) * H**-0.5, requires_grad=False))
    return ex


@pytest.mark.parametrize("tokens", [1, 3, 4, 40])  # T*k < E (pairs), T*k >= E (every expert)
@pytest.mark.parametrize("ep_rank", [None, 0, 1])
def test_sync_free_experts_equal_reference(tokens, ep_rank):
    world = None if ep_rank is None else World(ep_rank, 2)
    ex = _experts(world=world, ep=ep_rank is not None)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=g)
    r = route(x, torch.randn(16, 64, generator=g), None, 4)
    want = ex(x, r)
    apply(ex, FastPaths(moe=True))
    got = ex(x, r)
    assert _rel(got, want) < 1e-6
    assert torch.allclose(got, ex.forward_sync_free(x, Routing(r.expert_ids, r.weights, r.logits)))


def test_sync_free_token_threshold_selects_the_path_and_keeps_gradients():
    """Below the threshold the grouped loop runs (and syncs); above it the dense path, with the same values
    and the same gradients (what training uses: every expert densely on every token)."""
    ex = _experts()
    for p in ex.parameters():
        p.requires_grad_(True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 64, generator=g)
    gate = torch.randn(16, 64, generator=g, requires_grad=True)
    grads = []
    for fast in (FastPaths(), FastPaths(moe=True), FastPaths(moe=True, sync_free_tokens=1 << 20)):
        apply(ex, fast)
        called = []
        ex.forward_sync_free = lambda *a, _c=called: _c.append(1) or FastExperts.forward_sync_free(ex, *a)
        y = ex(x, route(x, gate, None, 4))
        del ex.forward_sync_free
        assert bool(called) == (fast.sync_free_tokens >= 200)
        grads.append([t.detach().clone() for t in torch.autograd.grad(y.square().sum(), [gate, ex.w1, ex.w2])])
    for got in grads[2:]:
        for a, b in zip(got, grads[0]):
            assert _rel(a, b) < 1e-5
    with pytest.raises(ConfigError, match="sync_free_tokens"):
        FastPaths(sync_free_tokens=0)


def test_sync_free_experts_on_packed_weights_equal_reference(checkpoints):
    model = load_model(checkpoints["nvfp4"], dtype=torch.float32, weights="packed")
    ex = model.layers[1].block_sparse_moe.experts
    g = torch.Generator().manual_seed(5)
    for T in (1, 2, 8):
        x = torch.randn(T, model.text.hidden_size, generator=g)
        r = model.layers[1].block_sparse_moe.gate(x)
        want = ex(x, r)
        apply(ex, FastPaths(moe=True))
        assert _rel(ex.forward_sync_free(x, r), want) < 1e-6
        apply(ex, FastPaths())


def test_sdpa_attention_cores_equal_reference():
    g = torch.Generator().manual_seed(0)
    B, T, L, Hq, Hkv, D = 2, 7, 90, 8, 2, 32
    q = torch.randn(B, T, Hq, D, generator=g)
    k, v = torch.randn(B, L, Hkv, D, generator=g), torch.randn(B, L, Hkv, D, generator=g)
    pos = torch.tensor([[80 + i for i in range(T)], [40 + i for i in range(T)]])
    assert _rel(causal_attention_sdpa(q, k, v, pos, D**-0.5, 1 << 12), causal_attention(q, k, v, pos, D**-0.5)) < 1e-6
    iq, ik = torch.randn(B, T, Hkv, 16, generator=g), torch.randn(B, L, 16, generator=g)
    ref, blocks = msa_attention(q, k, v, iq, ik, pos, D**-0.5, 16, 3, 1, 0)
    fast_blocks = fast_select_blocks_chunked(iq, ik, pos, 16, 3, 1, 0, chunk=3)
    fast = fast_block_sparse_attention(q, k, v, fast_blocks, pos, 16, D**-0.5, chunk=3, load=lambda t: t, sdpa=True)
    assert torch.equal(blocks, fast_blocks) and _rel(fast, ref) < 1e-6
    # fp8 storage: gathering then converting equals converting the whole cache first
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    whole = gather_block_attention(q, k8.float(), v8.float(), blocks, pos, 16, D**-0.5)
    gathered = fast_gather_block_attention(q, k8, v8, blocks, pos, 16, D**-0.5, load=lambda t: t.float())
    assert torch.equal(whole, gathered)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_fast_model_equals_reference(checkpoints, kv_cache_dtype):
    """Cached prefill and decode (batch of two at different positions) with every fast path on."""
    model = load_model(checkpoints["nvfp4"], dtype=torch.float32, weights="packed")

    def run() -> torch.Tensor:
        with torch.no_grad():
            cache = model.new_cache(2, 96, kv_cache_dtype)
            out = [model(IDS[:, :70], positions=torch.arange(70).expand(2, -1), cache=cache)]
            pos = torch.tensor([[70], [66]])
            for t in range(6):  # decode steps: 2 tokens (pairs path) at different positions
                out.append(model(IDS[:, 70 + t:71 + t], positions=pos + t, cache=cache))
        return torch.cat(out, dim=1)

    want = run()
    apply(model, True)
    assert model.fast == FastPaths("fast", True, True, True, prefill_attention="triton", block_selection="triton",
                                   graph=True)
    # fp8 storage: an fp32-rounding difference before the store can move a key by one E4M3 step
    assert _rel(run(), want) < (1e-5 if kv_cache_dtype == "auto" else 1e-3)
    fast_tokens = _greedy(model)
    apply(model, False)
    assert fast_tokens == _greedy(model)


class _HostSyncs(TorchDispatchMode):
    """Records the ops that make a CUDA device synchronise with the host."""

    SYNCING = {"_local_scalar_dense", "nonzero", "unique", "_unique2", "unique_consecutive", "masked_select",
               "equal", "bincount", "item"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.SYNCING or (name == "repeat_interleave" and func._overloadname == "Tensor"):
            self.seen.append(str(func))
        if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or []):
            self.seen.append("indexing with a boolean mask")
        return func(*args, **(kwargs or {}))


def test_fast_decode_step_does_not_synchronise(checkpoints):
    """With the fast paths, a decode step's only host read is the token-id range check, which is skipped
    while a CUDA graph is captured; the reference reads positions and expert counts."""
    model = load_model(checkpoints["nvfp4"], dtype=torch.bfloat16, weights="packed", fast=True)
    cache = model.new_cache(4, 96, "fp8")
    with torch.no_grad():
        model(IDS[:, :70].repeat(2, 1), positions=torch.arange(70).expand(4, -1), cache=cache)
        guard = _HostSyncs()
        with guard:
            model(IDS[:, 70:71].repeat(2, 1), positions=torch.tensor([[70], [71], [72], [73]]), cache=cache)
        assert guard.seen == ["aten._local_scalar_dense.default"], guard.seen  # embed's range check
        apply(model, False)
        guard = _HostSyncs()
        with guard:
            model(IDS[:, 70:71].repeat(2, 1), positions=torch.tensor([[70], [71], [72], [73]]), cache=cache)
        assert len(guard.seen) > 3


# ---------------------------------------------------------------------------------------------- TP=2


def _worker(rank: int, port: int, tasks, results) -> None:
    torch.set_num_threads(1)
    if os.environ.get("TRITON_INTERPRET") == "1":  # a new process: the test run's interpreter patch again
        from conftest import _interpreter_numpy_compat

        _interpreter_numpy_compat()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=TIMEOUT_S))
    world = World.from_group(dist.group.WORLD)
    while (task := tasks.get()) is not None:
        fn, kwargs = task
        try:
            results.put((rank, ("ok", fn(world, **kwargs))))
        except Exception as e:
            results.put((rank, ("error", f"{type(e).__name__}: {e}")))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks():
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tasks, results = [ctx.Queue(), ctx.Queue()], ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, tasks[r], results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()

    def run(fn, **kwargs) -> list:
        for q in tasks:
            q.put((fn, kwargs))
        out = {}
        while len(out) < 2:
            rank, res = results.get(timeout=TIMEOUT_S)
            out[rank] = res
        assert all(r[0] == "ok" for r in out.values()), out
        return [out[0][1], out[1][1]]

    yield run
    for q in tasks:
        q.put(None)
    for p in procs:
        p.join(timeout=20)
        if p.is_alive():
            p.terminate()


def _task_packed_vs_dequant(world: World, path: str | None, dtype: str, expert_parallel: bool) -> dict:
    dt = getattr(torch, dtype)
    if path is None:  # synthetic
        packed = load_synthetic("tiny", dtype=dt, tp=world, expert_parallel=expert_parallel)
        dequant = load_synthetic("tiny", dtype=dt, tp=world, expert_parallel=expert_parallel, weights="dequant")
    else:
        packed = load_model(path, dtype=dt, tp=world, expert_parallel=expert_parallel, weights="packed")
        dequant = load_model(path, dtype=dt, tp=world, expert_parallel=expert_parallel)
    a, b = _logits(packed), _logits(dequant)
    greedy = _greedy(packed)
    apply(packed, True)
    fast = _logits(packed)
    per_position = (fast.float() - a.float()).abs().amax(-1) / a.float().abs().amax()
    return {"equal": torch.equal(a, b), "logits": a, "greedy": greedy, "dequant_greedy": _greedy(dequant),
            "fast_err": _rel(fast, a), "fast_err_median": float(per_position.median()),
            "memory": packed.load_stats["memory_bytes"],
            "read": packed.load_stats["bytes_read"]}


CASES = [("nvfp4", "float32", False), ("nvfp4", "bfloat16", True), ("mxfp8", "float32", False),
         ("synthetic", "float32", False), ("synthetic", "float32", True)]


@pytest.mark.parametrize("name,dtype,expert_parallel", CASES,
                         ids=[f"{n}-{d}-{'ep' if e else 'tp'}" for n, d, e in CASES])
def test_tp2_packed_equals_dequant_and_tp1(two_ranks, checkpoints, name, dtype, expert_parallel):
    path = None if name == "synthetic" else str(checkpoints[name])
    outs = two_ranks(_task_packed_vs_dequant, path=path, dtype=dtype, expert_parallel=expert_parallel)
    dt = getattr(torch, dtype)
    ref = load_synthetic("tiny", dtype=dt, weights="dequant") if path is None else load_model(path, dtype=dt)
    want = _logits(ref)
    for o in outs:
        assert o["equal"], "TP=2 packed logits differ from TP=2 dequant"
        assert o["greedy"] == o["dequant_greedy"]
        assert torch.equal(o["logits"], outs[0]["logits"])  # gathered: every rank holds the same bytes
        if dt == torch.float32:
            assert o["fast_err"] < 1e-5
        elif os.environ.get("TRITON_INTERPRET") == "1":
            # the bf16 attention kernel runs on these CPU ranks under the interpreter: a rounding difference can flip
            # a near tie of expert or block choices, which moves that position's logits a lot; the typical position
            # stays within bf16 rounding (the bound of the attention kernel's model tests, `_agree`)
            assert o["fast_err_median"] < 1e-2
        else:
            assert o["fast_err"] < 0.05
        if dt == torch.bfloat16:  # packed: memory = this rank's bytes read (+ norms widened to fp32)
            assert o["read"] <= o["memory"] < o["read"] + 16 * 1024
    if dt == torch.float32:  # TP=2 equals TP=1 to fp32 reduction rounding
        assert _rel(outs[0]["logits"], want) < 1e-5
        assert outs[0]["greedy"] == _greedy(ref)


# ---------------------------------------------------------------------------------------------- CLI, benchmarks


def test_cli_generate_packed_and_synthetic(checkpoints, capsys):
    from minimax_ref.cli.main import main

    base = ["generate", "--prompt", "hello world", "--max-new-tokens", "4", "--temperature", "0", "--dtype",
            "float32", "--output-format", "json"]
    runs = {}
    for extra in ([], ["--weights", "packed"], ["--weights", "packed", "--fast", "on"]):
        assert main([*base, "--ckpt-path", str(checkpoints["nvfp4"]), *extra]) == 0
        runs[" ".join(extra)] = json.loads(capsys.readouterr().out)["token_ids"]
    assert runs[""] == runs["--weights packed"] == runs["--weights packed --fast on"]
    assert main([*base, "--synthetic-weights", "tiny", "--weights", "packed", "--synthetic-layers", "2"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 4
    assert main([*base, "--synthetic-weights", "nope"]) == 2
    assert "choose one of" in capsys.readouterr().err
    assert main([*base, "--synthetic-layers", "2"]) == 2
    assert "need --synthetic-weights" in capsys.readouterr().err


def _bench(script: str, args: list[str], capsys, code: int = 0):
    """Run a benchmark script in-process; its JSON line (exit 0) or its stderr (other exit codes)."""
    saved = sys.argv
    sys.argv = [script, *args]
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        with pytest.raises(SystemExit) as e:
            runpy.run_path(str(REPO / "benchmarks" / script), run_name="__main__")
    finally:
        sys.argv = saved
        sys.path.remove(str(REPO / "benchmarks"))
    out = capsys.readouterr()
    assert e.value.code == code, out.err
    return json.loads(out.out.strip().splitlines()[-1]) if code == 0 else out.err


def test_tp_benchmark_dry_run(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = _bench("tp2_packed.py", ["--device", "cpu", "--preset", "tiny", "--prompt-len", "90", "--decode-tokens",
                                   "3", "--batches", "1,3", "--bw-gib", "0.01", "--prefill-repeats", "1",
                                   "--variants", "eager,reference"], capsys)
    for key in ("eager", "reference"):
        for b in ("1", "3"):
            assert out["decode"][key][b]["steps"] == 3
    roof = out["roofline"]["3"]
    assert roof["bytes_per_step_rank0"] > out["roofline"]["1"]["bytes_per_step_rank0"]
    assert 0 < roof["fraction_eager"] and out["summary"]["weights_gib_per_card"][0] > 0
    assert out["params"]["prompt_len"] == 90
    err = _bench("tp2_packed.py", ["--device", "cpu", "--preset", "tiny", "--prompt-len", "90", "--max-model-len",
                                   "50"], capsys, code=2)
    assert "--max-model-len 50 cannot hold" in err


def test_long_context_benchmark_dry_run(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = _bench("long_context_tp2.py", ["--device", "cpu", "--preset", "tiny", "--context", "300",
                                         "--prefill-chunk", "128", "--decode-tokens", "2"], capsys)
    assert out["kv"]["measured_equals_plan"] and out["decode"]["eager"]["steps"] == 2


@pytest.mark.slow
def test_transformers_benchmark_dry_run(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = _bench("vs_transformers.py", ["--device", "cpu", "--preset", "tiny", "--layers", "0", "--experts", "0",
                                        "--prompt-len", "60", "--decode-tokens", "2", "--batches", "1,2",
                                        "--bw-gib", "0.01"], capsys)
    assert out["agreement"]["ours_packed_vs_ours_dequant"]["last_logits_bit_identical"]
    assert "prefill_ours_packed_over_transformers" in out["speedups"]



def test_decode_ops_counts_the_step_by_layer(capsys):
    """benchmarks/decode_ops.py: the per-layer counts add up to the step's; the fast paths issue fewer operations
    than the reference, and leave at most one host synchronisation (the embedding's id check, skipped under
    CUDA-graph capture) where the reference has more."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import decode_ops
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    off = decode_ops.main(["--preset", "tiny", "--fast", "off"])
    on = decode_ops.main(["--preset", "tiny", "--fast", "on"])
    assert [json.loads(line)["ops_per_step"] for line in capsys.readouterr().out.splitlines()] == [
        off["ops_per_step"], on["ops_per_step"]]
    for r in (off, on):
        assert r["ops_per_step"] == sum(layer["ops"] for layer in r["layers"]) + r["outside_layers"]
        assert [layer["kind"] for layer in r["layers"]] == ["attn+mlp", "msa+moe", "msa+moe", "msa+moe"]
    assert 0 < on["ops_per_step"] < off["ops_per_step"]
    assert on["host_syncs"] <= 1 < off["host_syncs"]
