"""`fast.joint`: the linears that read one input held as one `fast.mma_gemv` product, and a routed layer's gate and
up stacks read in place as one stack.

On the CPU the joint copy is checked against `mma_gemv.reorder` of the stacked rows and `restore`, and the joint
stack's products against the kernel's contract written in torch (no kernel runs); the kernel-side checks (each part's
rows of the joint product within the bound, the model's decode steps) run on a GPU."""

from __future__ import annotations

import pytest
import torch
from test_grouped import _bound_ok, _decoded, _operands

import minimax_ref.fast.mma_gemv as mg
from minimax_ref.fast import FastPaths, apply
from minimax_ref.fast.attention import FastAttention
from minimax_ref.fast.joint import JointProduct, JointStack, joined
from minimax_ref.fast.moe import FastExperts, FastMLP
from minimax_ref.fast.packed import GEMV_BUFFERS, decode_reference
from minimax_ref.model.linear import Linear
from minimax_ref.model.moe import Experts
from minimax_ref.weights.loader import load_model
from minimax_ref.weights.packed import PackedWeight, model_nbytes

BF16 = torch.bfloat16
on_gpu = pytest.mark.skipif(mg.grouped.interpreting() or not mg.AVAILABLE or not torch.cuda.is_available(),
                            reason="the Gluon kernel on a CUDA GPU (not under TRITON_INTERPRET=1)")
# rows of the parts: none of them whole `GROUP`s of row tiles but the last
ROWS = (40, 300, 128)


def _linear(fmt: str, n: int, k: int, device: str = "cpu", glob: float | None = None) -> Linear:
    w, s, g = _operands(fmt, 1, n, k, 1, device=device)
    if g is not None:
        g = g[:1].reshape(()) if glob is None else torch.tensor(glob, device=device)
    linear = Linear(k, n)
    linear.set_packed(PackedWeight(fmt, w[0], s[0], g))
    return linear


@pytest.fixture
def mma_on_cpu(monkeypatch):
    """`gemv="mma"`'s copies made on the CPU (the kernel's device checks stubbed; nothing is launched)."""
    monkeypatch.setattr(mg, "runs_on", lambda device: True)
    monkeypatch.setattr(mg.grouped, "runs_on", lambda device: True)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_joined_copy_is_the_reorder_of_the_stacked_rows(fmt):
    K = 128
    parts = [_operands(fmt, 1, n, K, 1) for n in ROWS]
    parts = [(w[0], s[0], None if g is None else g[:1].reshape(())) for w, s, g in parts]
    words, scales, starts = joined([mg.reorder(fmt, *p) for p in parts])
    # the parts' rows stacked, each padded with zero rows (codes and scales) to its whole groups of row tiles
    group_rows = mg.ROW_TILE * mg.GROUP
    data, scale = [], []
    for (w, s, _), n in zip(parts, ROWS):
        pad = -n % group_rows
        data.append(torch.cat([w.view(torch.uint8), w.view(torch.uint8).new_zeros(pad, w.shape[-1])]))
        scale.append(torch.cat([s.view(torch.uint8), s.view(torch.uint8).new_zeros(pad, s.shape[-1])]))
    stacked = torch.cat(data).view(parts[0][0].dtype), torch.cat(scale).view(parts[0][1].dtype), parts[0][2]
    want_words, want_scales, _ = mg.reorder(fmt, *stacked)
    assert torch.equal(words, want_words) and torch.equal(scales, want_scales)
    tiles = [-(-n // group_rows) * mg.GROUP for n in ROWS]
    assert starts == [0, tiles[0], tiles[0] + tiles[1]]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_parts_read_their_rows_of_the_joint_copy(fmt, mma_on_cpu):
    """`JointProduct.of` on linears with `gemv="mma"` copies: each part's copy becomes a view of its rows of the
    joint one (its storage, no second copy) that `restore` reads back as the part's weight; the output bounds are
    the parts' rows at their first row tile."""
    K = 128
    parts = [_linear(fmt, n, K, glob=0.5) for n in ROWS]
    for p in parts:
        apply(p.packed, FastPaths(gemv="mma"))
        assert p.packed.gemv_kernel == "mma"
    joint = JointProduct.of(parts)
    assert joint is not None and joint.rows == joint.words.shape[1] * mg.ROW_TILE
    start = 0
    for p, (first, n) in zip(parts, joint.bounds):
        w = p.packed
        assert w.gemv_words.untyped_storage().data_ptr() == joint.words.untyped_storage().data_ptr()
        assert w.gemv_scales.untyped_storage().data_ptr() == joint.scales.untyped_storage().data_ptr()
        assert (first, n) == (start * mg.ROW_TILE, p.out_features)
        assert torch.equal(joint.words[:, start:start + w.gemv_words.shape[1]], w.gemv_words)
        got = mg.restore(w.gemv_words, w.gemv_scales, w.gemv_global, p.out_features, K, stack=False)
        assert torch.equal(got[0].view(torch.uint8), w.weight.view(torch.uint8))
        assert torch.equal(got[1].view(torch.uint8), w.weight_scale.view(torch.uint8))
        start += w.gemv_words.shape[1]


def test_of_refuses_what_one_launch_cannot_hold(mma_on_cpu):
    """None for: one linear; a part without an MMA copy (the reference, another preset); formats, K or NVFP4
    global scales that differ; a part whose input is fake-quantized. The parts' copies are left as they were."""
    K = 128

    def prepared(*linears):
        for p in linears:
            apply(p.packed, FastPaths(gemv="mma"))
        return list(linears)

    assert JointProduct.of(prepared(_linear("mxfp8", 64, K))) is None
    plain = _linear("mxfp8", 64, K)
    assert JointProduct.of(prepared(_linear("mxfp8", 64, K)) + [plain]) is None
    assert JointProduct.of(prepared(_linear("mxfp8", 64, K), _linear("nvfp4", 64, K))) is None
    assert JointProduct.of(prepared(_linear("mxfp8", 64, K), _linear("mxfp8", 64, 2 * K))) is None
    different = prepared(_linear("nvfp4", 64, K, glob=0.5), _linear("nvfp4", 64, K, glob=0.25))
    before = [p.packed.gemv_words for p in different]
    assert JointProduct.of(different) is None
    assert all(p.packed.gemv_words is b for p, b in zip(different, before))
    quantized = prepared(_linear("mxfp8", 64, K), _linear("mxfp8", 64, K))
    quantized[1].act_format, quantized[1].emulate_act_quant = "mxfp8", True
    assert JointProduct.of(quantized) is None
    assert JointProduct.of(prepared(_linear("nvfp4", 64, K, glob=0.5), _linear("nvfp4", 64, K, glob=0.5)))


@pytest.mark.skipif(not mg.AVAILABLE, reason="triton with Gluon (the custom operator)")
def test_a_compiled_region_traces_the_joint_product_whole(mma_on_cpu):
    """`takes` (the parts' checks and hooks) and the product trace into one graph with one kernel launch (the backend
    records the graph and runs nothing)."""
    parts = [_linear("mxfp8", n, 128) for n in ROWS]
    for p in parts:
        apply(p.packed, FastPaths(gemv="mma"))
    joint = JointProduct.of(parts)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        outputs = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        return lambda *args: [None] * outputs

    step = torch.compile(lambda x: joint(x) if joint.takes(x) else None, backend=record, fullgraph=True)
    step(torch.zeros(1, 2, 128, dtype=BF16))
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert len(graphs) == 1 and ops.count(torch.ops.minimax_ref.packed_mma_gemv.default) + ops.count(
        torch.ops.minimax_ref.packed_mma_gemv) == 1, ops


def test_apply_joins_each_layers_projections(tiny_nvfp4, mma_on_cpu):
    """`gemv-mma` on a model: every attention's input projections (q, k, v and on MSA layers the indexer's) and
    every MLP's gate and up are one joint product whose parts are those linears, and every routed layer's gate and
    up stacks one joint stack (views: no byte more than its split counters); the state dict is unchanged and the
    weight memory counts each copied byte once; restoring the reference removes the joint products and the copies."""
    model = load_model(tiny_nvfp4, weights="packed", dtype=BF16)
    keys = set(model.state_dict())
    before = model_nbytes(model)
    apply(model, "gemv-mma")
    attentions = [m for m in model.modules() if isinstance(m, FastAttention)]
    mlps = [m for m in model.modules() if isinstance(m, FastMLP)]
    assert attentions and mlps
    for m in attentions:
        want = [m.q_proj, m.k_proj, m.v_proj] + ([m.index_q_proj, m.index_k_proj] if m.sparse else [])
        assert m.joint.parts == want and sum(n for _, n in m.joint.bounds) == sum(p.out_features for p in want)
    for m in mlps:
        assert m.joint.parts == [m.gate_proj, m.up_proj]
    assert set(model.state_dict()) == keys
    # the copies' bytes once: each weight's copy (the joined ones views of their joint copy) and the joint counters
    copies = sum(t.numel() * t.element_size() for m in model.modules() for name, t in m._buffers.items()
                 if name in GEMV_BUFFERS)
    experts = [m for m in model.modules() if isinstance(m, FastExperts)]
    assert experts and all(m.joint.parts == [m.w1, m.w3] for m in experts)
    counters = sum(m.joint.counters.numel() * 4 for m in attentions + mlps + experts)
    assert model_nbytes(model) == before + copies + counters
    apply(model, False)
    assert not any("joint" in m._modules for m in model.modules())
    assert not any(hasattr(m, b) for m in model.modules() for b in GEMV_BUFFERS)


def _stored_by_contract(x, fmt, weight, weight_scale, weight_scale_2, index=None, active=None, ends=None, copies=1,
                        **_):
    """`mma_gemv.packed_product_stored`'s contract in torch (the kernel does not run on a CPU): each entry's decoded
    bf16 weight times its rows, fp32 sums rounded once to bf16; unflagged entries give zero rows; `copies` stacks of
    E / copies entries each take the same selection, their outputs one after the other."""
    w_hat = decode_reference(fmt, weight, weight_scale, weight_scale_2).to(BF16).float()
    outs = []
    for stack in w_hat.chunk(copies):
        if ends is not None:
            out, start = torch.empty(x.shape[0], stack.shape[1], dtype=BF16), 0
            for e, end in enumerate(ends.tolist()):
                out[start:end] = (x[start:end].float() @ stack[e].T).to(BF16)
                start = end
        else:
            xs = x.unsqueeze(0) if x.dim() == 2 else x
            out = (xs.float() @ (stack if index is None else stack[index]).transpose(-1, -2)).to(BF16)
            out = out if active is None else out * (active != 0)[:, None, None]
        outs.append(out)
    return torch.cat(outs)


def test_loader_places_gate_and_up_stacks_in_one_allocation(tiny_nvfp4):
    """Packed weights: each routed layer's up stack (w3: codes, block scales, global scales) starts where its gate
    stack (w1) ends, in one allocation, each a contiguous stack of the layer's experts."""
    model = load_model(tiny_nvfp4, weights="packed", dtype=BF16)
    layers = [m for m in model.modules() if isinstance(m, Experts)]
    assert layers
    for m in layers:
        for a, b in zip(m.w1.parts(), m.w3.parts()):
            assert a.is_contiguous() and b.is_contiguous() and a.shape[0] == len(m.local_experts)
            assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            assert b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()


def test_joint_stack_refuses_stacks_that_are_not_one(mma_on_cpu):
    """`JointStack.of` is None for stacks allocated apart, of other shapes or formats, or not read in place; for a
    pair allocation its halves are the stacks' own bytes."""
    E, N, K = 4, 40, 128

    def stacks(pair: bool, fmt: str = "nvfp4", n_up: int = N):
        (w, s, g), (w3, s3, g3) = _operands(fmt, E, N, K, 1), _operands(fmt, E, n_up, K, 1)
        if pair and n_up == N:
            both = [None if a is None else torch.stack((a, b)) for a, b in ((w, w3), (s, s3), (g, g3))]
            (w, w3), (s, s3), (g, g3) = [(None, None) if t is None else (t[0], t[1]) for t in both]
        gate, up = PackedWeight(fmt, w, s, g), PackedWeight(fmt, w3, s3, g3)
        for p in (gate, up):
            apply(p, FastPaths(gemv="mma"))
        return gate, up

    joint = JointStack.of(*stacks(True))
    gate, up = joint.parts
    assert torch.equal(joint.weight[:E], gate.weight) and torch.equal(joint.weight[E:], up.weight)
    assert torch.equal(joint.weight_scale_2, torch.cat((gate.weight_scale_2, up.weight_scale_2)))
    assert joint.weight.untyped_storage().data_ptr() == gate.weight.untyped_storage().data_ptr()
    assert JointStack.of(*stacks(True, "mxfp8")).weight_scale_2 is None
    assert JointStack.of(*stacks(False)) is None
    assert JointStack.of(*stacks(True, n_up=2 * N)) is None
    gate, up = stacks(True)
    apply(up, False)  # the reference: not read in place
    assert JointStack.of(gate, up) is None


@pytest.mark.skipif(not mg.AVAILABLE, reason="triton with Gluon")
def test_a_selection_that_does_not_fit_the_stacks_is_refused():
    """`packed_product_stored(..., copies=c)`: a stack that is not c stacks of whole entries, flags or ranges longer
    than one stack's entries, and x with one row per selected entry of another count are each refused with the
    shapes named, before anything is launched."""
    w, s, g = _operands("nvfp4", 4, 40, 128, 0)
    x = torch.zeros(1, 128, dtype=BF16)
    cases = [dict(index=torch.tensor([0]), copies=3),
             dict(active=torch.ones(4, dtype=torch.int32), copies=2),
             dict(ends=torch.tensor([1, 1, 1], dtype=torch.int32), copies=2),
             dict(index=torch.tensor([0, 1]), copies=2, x=torch.zeros(3, 1, 128, dtype=BF16))]
    for kw in cases:
        with pytest.raises(ValueError, match=r"nvfp4 weight \[4, 40, 64\].*stacks"):
            mg.packed_product_stored(kw.pop("x", x), "nvfp4", w, s, g, **kw)


@pytest.mark.skipif(not mg.AVAILABLE, reason="triton with Gluon (the custom operator)")
def test_a_compiled_region_traces_the_joint_stack_whole(mma_on_cpu):
    """`takes` / `takes_ranged` (the parts' checks and hooks; the address check skipped while tracing) and each of the
    joint stack's products trace into one graph with one kernel launch (the backend records the graph and runs
    nothing)."""
    E, N, K = 4, 40, 128
    w, s, g = (torch.stack((a, a)) for a in _operands("nvfp4", E, N, K, 1))
    parts = [PackedWeight("nvfp4", w[i], s[i], g[i]) for i in (0, 1)]
    for p in parts:
        apply(p, FastPaths(gemv="mma"))
    joint = JointStack.of(*parts)
    ids = torch.tensor([[0, 3]])
    ends = torch.tensor([2, 2, 3, 5], dtype=torch.int32)
    calls = {"ids": lambda x: joint.by_ids(x, ids) if joint.takes(x, 1) else None,
             "flags": lambda x: joint.by_flags(x, torch.ones(E, dtype=torch.int32), E) if joint.takes(x, 1) else None,
             "ranges": lambda x: joint.by_ranges(x.expand(5, K), ends) if joint.takes_ranged(x) else None}
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        outputs = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        return lambda *args: [None] * outputs

    for name, fn in calls.items():
        graphs.clear()
        torch.compile(fn, backend=record, fullgraph=True)(torch.zeros(1, K, dtype=BF16))
        ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
        assert len(graphs) == 1 and ops.count(torch.ops.minimax_ref.packed_mma_gemv.default) + ops.count(
            torch.ops.minimax_ref.packed_mma_gemv) == 1, (name, ops)


@pytest.mark.skipif(not mg.AVAILABLE, reason="triton with Gluon")
@pytest.mark.parametrize("tokens, path", [(1, "index"), (3, "index"), (4, "active"), (8, "active"),
                                          (12, "ends")])
def test_gate_and_up_stacks_multiply_in_one_launch(tiny_nvfp4, mma_on_cpu, monkeypatch, tokens, path):
    """`gemv-mma` (the kernel stubbed by its contract in torch): a decode step's tokens multiply the gate and up
    stacks in one launch over the joint stack of 2 E entries (the chosen experts by id below E pairs, flags up to 8
    tokens, ranges of rows sorted by expert above), then the down stack; the experts' output equals the reference
    `Experts.forward` within fp32 rounding. A gate stack replaced after `fast.apply` is not read through the joint
    stack: each stack its own launch."""
    calls = []

    def stored(x, fmt, weight, *args, **kw):
        calls.append((weight.shape[0], next(k for k in ("index", "active", "ends") if kw.get(k) is not None)))
        return _stored_by_contract(x, fmt, weight, *args, **kw)

    monkeypatch.setattr(mg, "packed_product_stored", stored)
    model = load_model(tiny_nvfp4, weights="packed", dtype=BF16)
    moe = model.layers[1].block_sparse_moe
    ex, E = moe.experts, len(moe.experts.local_experts)
    x = torch.randn(tokens, model.text.hidden_size, generator=torch.Generator().manual_seed(tokens)).to(BF16)
    routing = moe.gate(x)
    want = ex(x, routing).float()
    apply(ex, "gemv-mma")
    got = ex.forward_sync_free(x, routing)
    assert calls == [(2 * E, path), (E, path)]
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    ex.w1.register_buffer("weight", ex.w1.weight.clone())
    calls.clear()
    torch.testing.assert_close(ex.forward_sync_free(x, routing), got, rtol=0, atol=0)
    assert calls == [(E, path)] * 3
    apply(ex, False)
    assert "joint" not in ex._modules


# ------------------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("rows", [1, 5, 8, 32])
def test_joint_product_on_cuda_within_the_bound(fmt, rows):
    """Each part's rows of the joint product within the kernel's bound against the decoded weight, and equal to
    the part's own launch where the two launches split K alike (one split)."""
    K = 256
    parts = [_linear(fmt, n, K, device="cuda", glob=0.5) for n in ROWS]
    for p in parts:
        apply(p.packed, FastPaths(gemv="mma"))
    joint = JointProduct.of(parts)
    x = torch.randn(rows, K, device="cuda").to(BF16)
    assert joint.takes(x)
    for p, y in zip(parts, joint(x)):
        w = p.packed
        assert y.shape == (rows, p.out_features)
        ok, ratio = _bound_ok(y[None], x, _decoded(fmt, w.weight[None], w.weight_scale[None],
                                                    None if w.weight_scale_2 is None else w.weight_scale_2.reshape(1)))
        assert ok, ratio
    one = mg.packed_product(x, joint.rows, joint.words, joint.scales, joint.glob, split=1)[0]
    for p, (start, n) in zip(parts, joint.bounds):
        alone = mg.packed_product(x, p.out_features, p.packed.gemv_words, p.packed.gemv_scales, p.packed.gemv_global,
                                  split=1)[0]
        assert torch.equal(one[:, start:start + n], alone)


@pytest.mark.gpu
@on_gpu
def test_a_hooked_part_is_called_alone(tiny_nvfp4):
    """A hook on one of the joined linears: the layer calls the linears one by one (the hook sees its call)."""
    model = load_model(tiny_nvfp4, weights="packed", dtype=BF16, device="cuda")
    apply(model, FastPaths(gemv="mma"))
    attention = next(m for m in model.modules() if isinstance(m, FastAttention))
    x = torch.randn(1, 1, attention.q_proj.in_features, device="cuda").to(BF16)
    assert attention.joint.takes(x)
    seen = []
    handle = attention.k_proj.register_forward_hook(lambda m, args, out: seen.append(out))
    assert not attention.joint.takes(x)
    handle.remove()
    assert attention.joint.takes(x) and not seen


@pytest.mark.gpu
@on_gpu
def test_decode_steps_take_the_joint_products(tiny_nvfp4):
    """An eager decode step with `gemv="mma"`: one joint product an attention and an MLP (each its one launch), the
    logits as with the joint products removed (each linear its own launch) within bf16 rounding; the captured
    `gemv-mma` step against the reference engine is `test_mma_gemv.test_mma_preset_decode_step_equals_reference`."""
    model = load_model(tiny_nvfp4, weights="packed", dtype=BF16, device="cuda")
    apply(model, FastPaths(gemv="mma"))
    joints = [m.joint for m in model.modules() if isinstance(m, (FastAttention, FastMLP)) and "joint" in m._modules]
    assert len(joints) == sum(isinstance(m, (FastAttention, FastMLP)) for m in model.modules())
    calls = []
    handles = [j.register_forward_hook(lambda m, args, out: calls.append(m)) for j in joints]
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0)).cuda()

    def step():
        cache = model.new_cache(2, 16)
        with torch.no_grad():
            model(ids[:, :8], positions=torch.arange(8, device="cuda").expand(2, -1), cache=cache)
            calls.clear()  # the prefill's 16 rows take them too
            return model(ids[:, 8:], positions=torch.full((2, 1), 8, device="cuda"), cache=cache)[:, -1].float()

    got = step()
    assert sorted(map(id, calls)) == sorted(map(id, joints))
    for h in handles:
        h.remove()
    for m in model.modules():
        m._modules.pop("joint", None)
    want = step()
    assert float((got - want).norm() / want.norm()) < 2e-2


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_joint_stack_on_cuda_within_the_bound(fmt):
    """The joint stack of a pair allocation read in place: by ids (a token's chosen experts, and 3 tokens' rows laid
    out), by flags (unflagged experts zero) and by ranges of rows sorted by expert (empty ones too), each part's rows
    within the kernel's bound against its decoded stack; at one K split the joint launch gives the bits of each
    stack's own launch."""
    E, N, K = 6, 300, 256
    gate, up = (_operands(fmt, E, N, K, case, device="cuda") for case in (0, 1))
    pair = [None if a is None else torch.stack((a, b)) for a, b in zip(gate, up)]
    parts = [PackedWeight(fmt, *(None if t is None else t[i] for t in pair)) for i in (0, 1)]
    for p in parts:
        apply(p, FastPaths(gemv="mma"))
    joint = JointStack.of(*parts)
    assert joint is not None
    w_hat = [_decoded(fmt, *p.parts()) for p in parts]
    ids = torch.tensor([[4, 0, 5, 2], [1, 1, 3, 0], [2, 5, 4, 3]], device="cuda")
    for T in (1, 3):
        x = torch.randn(T, K, device="cuda").to(BF16)
        assert joint.takes(x, 1)
        for y, w in zip(joint.by_ids(x, ids[:T]), w_hat):
            assert y.shape == (T, 4, 1, N)
            for t in range(T):
                for j in range(4):
                    ok, ratio = _bound_ok(y[t, j], x[t:t + 1], w[ids[t, j]])
                    assert ok, (T, t, j, ratio)
    x = torch.randn(5, K, device="cuda").to(BF16)
    active = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.int32, device="cuda")
    for y, w in zip(joint.by_flags(x, active, busy=4), w_hat):
        for e in range(E):
            if active[e]:
                assert _bound_ok(y[e], x, w[e])[0], e
            else:
                assert not y[e].any(), e
    sizes = [3, 0, 12, 1, 9, 0]
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    xs = torch.randn(sum(sizes), K, device="cuda").to(BF16)
    assert joint.takes_ranged(xs)
    for y, w in zip(joint.by_ranges(xs, ends), w_hat):
        start = 0
        for e, size in enumerate(sizes):
            rows = slice(start, start + size)
            assert size == 0 or _bound_ok(y[rows], xs[rows], w[e])[0], e
            start += size
    both = torch.tensor([4, 0, 5, 2], device="cuda")
    one = mg.packed_product_stored(x[:1], fmt, joint.weight, joint.weight_scale, joint.weight_scale_2,
                                   index=torch.cat((both, both + E)), split=1)
    copies = mg.packed_product_stored(x[:1], fmt, joint.weight, joint.weight_scale, joint.weight_scale_2,
                                      index=both, split=1, copies=2)
    assert torch.equal(one, copies)
    for i, p in enumerate(parts):
        alone = mg.packed_product_stored(x[:1], fmt, *p.parts(), index=both, split=1)
        assert torch.equal(one[4 * i:4 * i + 4], alone), i
    joined = mg.packed_product_stored(xs, fmt, joint.weight, joint.weight_scale, joint.weight_scale_2, ends=ends,
                                      split=1, copies=2)
    for i, p in enumerate(parts):  # ranges (empty ones too) at one split: each stack's own bits
        alone = mg.packed_product_stored(xs, fmt, *p.parts(), ends=ends, split=1)
        assert torch.equal(joined[i * xs.shape[0]:(i + 1) * xs.shape[0]], alone), i
