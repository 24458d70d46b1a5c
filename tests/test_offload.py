"""Offloading (offload.py): an offloaded model, its weights streamed from host memory or disk, computes what the
resident packed model computes, bit for bit (the resident model is the oracle); the device map and the bytes it moves
are the plan's (checked by hand in tests/test_plan.py); bad combinations are refused with a message naming the fix."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
import torch

from minimax_ref.cli.main import main
from minimax_ref.errors import ConfigError
from minimax_ref.generation.decoding import generate_ids
from minimax_ref.generation.sampling import SamplingParams
from minimax_ref.model.cache import kv_bytes_per_token
from minimax_ref.model.config import load_model_config
from minimax_ref.research.trace import Trace
from minimax_ref.weights.device_map import GIB
from minimax_ref.weights.footprint import offload_units
from minimax_ref.weights.loader import load_model, load_synthetic
from minimax_ref.weights.offload import DiskStore, OffloadConfig, check_offload, id_runs

pytest.importorskip("accelerate")

RUNTIME = {"max_seq_len": 64, "max_batch_size": 4}
GREEDY = SamplingParams(temperature=0)


def budgets(path, prefetch: bool = True) -> dict[str, float]:
    """GPU budgets (GiB, reserve 0) for the tiny model in fp32: "layers" streams layer parts (and every expert stack),
    "experts" keeps every layer part resident and streams the expert stacks. Computed from the plan's unit sizes and
    the rule in device_map.propose_device_map's docstring (with `prefetch`, two staging stacks for the experts: the
    same maps either way)."""
    cfg = load_model_config(path)
    always, units = offload_units(cfg, dtype_bytes=4, ckpt_dir=path)
    kv = kv_bytes_per_token(cfg, 1, "auto", 4) * RUNTIME["max_seq_len"] * RUNTIME["max_batch_size"]
    layers = [u.nbytes for u in units if u.kind == "layer"]
    stack = max(u.nbytes for u in units if u.kind == "experts")
    base = always + kv + (2 if prefetch else 1) * stack
    return {"layers": (base + 2 * max(layers) + min(layers)) / GIB,  # room for the smallest layer part only
            "experts": (base + sum(layers)) / GIB}


@pytest.fixture(scope="module")
def resident(tiny_nvfp4):
    return load_model(tiny_nvfp4, dtype=torch.float32, weights="packed", **RUNTIME)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 1000, (3, 24), generator=g)


def offloaded(path, mode, which, tmp_path=None, prefetch: bool = True, **kw):
    cfg = OffloadConfig(mode, budgets(path, prefetch)[which], folder=None if tmp_path is None else tmp_path / "store",
                        reserve_gib=0.0, prefetch=prefetch)
    return load_model(path, dtype=torch.float32, weights="packed", offload=cfg, **RUNTIME, **kw)


EXPECTED = {  # the device maps of the two budgets (tiny: layer 0 dense MLP, layers 1-3 MoE)
    "layers": (["layers.1"], ["layers.0", "layers.1.experts", "layers.2", "layers.2.experts", "layers.3",
                              "layers.3.experts"]),
    "experts": (["layers.0", "layers.1", "layers.2", "layers.3"],
                ["layers.1.experts", "layers.2.experts", "layers.3.experts"]),
}


@pytest.mark.parametrize("mode", ["cpu", "disk"])
@pytest.mark.parametrize("which", ["layers", "experts"])
def test_offloaded_equals_resident(tiny_nvfp4, resident, prompts, mode, which, tmp_path):
    """Logits of a batch-3 prefill and greedy tokens at batch 1 and 3 are the resident model's, bit for bit; only the
    chosen experts' rows move; after a forward only the last streamed unit of each kind holds its weights."""
    model = offloaded(tiny_nvfp4, mode, which, tmp_path if mode == "disk" else None)
    assert (model.load_stats["resident_units"], model.load_stats["streamed_units"]) == EXPECTED[which]
    s = model.offload
    assert torch.equal(model(prompts), resident(prompts))
    one = prompts[:1, :10].tolist()
    for batch in (one, prompts.tolist()):
        want, _ = generate_ids(resident, batch, max_new_tokens=6, sampling=GREEDY)
        got, _ = generate_ids(model, batch, max_new_tokens=6, sampling=GREEDY)
        assert [q.generated for q in got] == [q.generated for q in want]
    per_expert = {u.nbytes / u.num_experts for u in s.device_map.units if u.kind == "experts"}.pop()
    # the plan counts each NVFP4 input scale (4 bytes per projection) with the stack; it stays resident, unmoved
    assert s.stats.expert_bytes == s.stats.expert_rows * (per_expert - 3 * 4)
    assert s.stats.expert_rows > 0
    assert (s.stats.layer_bytes > 0) == (which == "layers")
    last = {kind: max(u.layer for u in s.units.values() if u.kind == kind) for kind in ("layer", "experts")
            if any(u.kind == kind for u in s.units.values())}
    for u in s.units.values():
        held = [not r.module._parameters.get(r.leaf, r.module._buffers.get(r.leaf)).is_meta for r in u.records]
        assert held == [u.layer == last[u.kind]] * len(held), u.name
    if mode == "disk":
        index = json.loads((tmp_path / "store" / "index.json").read_text())
        assert set(index) == set(s.store) and isinstance(s.store, DiskStore)
        assert json.loads((tmp_path / "store" / "device_map.json").read_text())["streamed"] == EXPECTED[which][1]


def test_fast_paths_compose(tiny_nvfp4, prompts):
    """With the eager fast paths on both sides, offloaded equals resident bit for bit: prefill, decode at batch 1
    (the chosen experts gathered) and at batch 4 (4 x top-4 >= 16 experts: every staged expert multiplied, the rows
    left from other layers by weight 0)."""
    ref = load_model(tiny_nvfp4, dtype=torch.float32, weights="packed", fast="on", **RUNTIME)
    model = offloaded(tiny_nvfp4, "cpu", "layers", fast="on")
    assert type(model.layers[1].block_sparse_moe.experts).__name__ == "FastExperts"
    assert torch.equal(model(prompts), ref(prompts))
    four = torch.cat([prompts, prompts[:1].flip(1)]).tolist()
    for batch in (prompts[:1].tolist(), four):
        want, _ = generate_ids(ref, batch, max_new_tokens=5, sampling=GREEDY)
        got, _ = generate_ids(model, batch, max_new_tokens=5, sampling=GREEDY)
        assert [q.generated for q in got] == [q.generated for q in want]


def test_graph_switch_is_turned_off(tiny_nvfp4):
    """Offloaded decode steps read the router's choice on the host, so a whole step is never captured in a CUDA
    graph (only resident segments are, on CUDA); on a CPU eager paths are installed as they are, unsegmented."""
    from minimax_ref.fast import FastPaths

    model = offloaded(tiny_nvfp4, "cpu", "experts", fast=FastPaths(moe=True, static_kv=True, graph=True))
    assert model.fast.moe and not model.fast.graph
    assert model.compiled is None


def test_resident_segments():
    from minimax_ref.fast.segments import resident_segments

    assert resident_segments(6, {2, 3}) == [(("layer", 0), ("layer", 1)), (("layer", 4), ("layer", 5))]
    assert resident_segments(3, {0, 1, 2}) == [] and resident_segments(2, ()) == [(("layer", 0), ("layer", 1))]
    assert resident_segments(5, {1}, {2, 3}) == [(("layer", 0),), (("pre", 2),), (("post", 2), ("pre", 3)),
                                                 (("post", 3), ("layer", 4))]


def greedy_steps(model, prompts: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Logits of a prefill of `prompts` [B, T] and of `steps` greedy decode steps, on a cache of RUNTIME's length
    (what a bucketing model twin gives too, so both sides attend over the same slots)."""
    B, T = prompts.shape
    device = prompts.device
    cache = model.new_cache(B, RUNTIME["max_seq_len"])
    out = []
    with torch.no_grad():
        logits = model(prompts, positions=torch.arange(T, device=device).expand(B, T), cache=cache)
        for t in range(steps):
            out.append(logits[:, -1].clone())  # a replayed step's tensors are rewritten by the next step
            tok = logits[:, -1].argmax(-1, keepdim=True)
            logits = model(tok, positions=torch.full((B, 1), T + t, device=device), cache=cache)
        out.append(logits[:, -1].clone())
    return out


@pytest.mark.parametrize("eager, split, segments", [({1}, {2}, 3), ((), {2, 3}, 3), ({2}, (), 2)])
def test_segmented_steps_replay_equal_layer_by_layer(tiny_nvfp4, prompts, eager, split, segments):
    """`SegmentedLayers` with layers run eagerly and MoE layers split around their routed experts (resident here: no
    sync): each segment is recorded on the first step of each cache and batch shape and replayed after
    (`record_eagerly`: a CPU's stand-in for CUDA graphs), and the steps' logits are the model's own, stepping layer by
    layer, bit for bit; a new cache records anew."""
    from minimax_ref.fast.segments import SegmentedLayers, record_eagerly

    model = load_model(tiny_nvfp4, dtype=torch.float32, weights="packed", fast="on", **RUNTIME)
    for batch in (prompts[:1, :10], prompts):
        want = greedy_steps(model, batch, 4)
        seg = model.compiled = SegmentedLayers(len(model.layers), eager, split, recorder=record_eagerly)
        assert len(seg.segments) == segments
        got = greedy_steps(model, batch, 4)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert (seg.recorded, seg.replays) == (segments, segments * 3)
        greedy_steps(model, batch, 2)  # a new cache
        assert (seg.recorded, seg.replays) == (2 * segments, segments * 4)
        model.compiled = None


@pytest.mark.parametrize("which", ["layers", "experts"])
def test_offloaded_compiled_layers(tiny_nvfp4, prompts, which):
    """`fast="compiled"` on an offloaded model (inductor on a CPU): a layer whose layer part streams runs eagerly, a
    layer whose expert stack alone streams runs compiled in two pieces around the copy of its chosen rows, the
    resident layers compiled; prefill and decode logits equal, bit for bit, the resident packed model's with the same
    layers eager and split, and the fully compiled resident model's to fp32 rounding with its greedy tokens;
    recorded and replayed segments change nothing."""
    from minimax_ref.fast.segments import SegmentedLayers, record_eagerly

    model = offloaded(tiny_nvfp4, "cpu", which, fast="compiled")
    seg = model.compiled
    eager, split = {"layers": ({0, 2, 3}, {1}), "experts": (set(), {1, 2, 3})}[which]
    assert isinstance(seg, SegmentedLayers) and (seg.eager, seg.split) == (eager, split)
    assert seg.recorder is None  # CUDA graphs only on CUDA
    ref = load_model(tiny_nvfp4, dtype=torch.float32, weights="packed", fast="compiled", **RUNTIME)
    compiled = greedy_steps(ref, prompts, 4)
    ref.compiled = SegmentedLayers(len(ref.layers), eager, split, compiled=ref.compiled)
    want = greedy_steps(ref, prompts, 4)
    assert type(seg.layer_fn).__name__ == "CompiledLayers"
    calls, fns = [], {name: getattr(seg, name) for name in ("layer_fn", "pre_fn", "post_fn")}
    for name, fn in fns.items():
        setattr(seg, name, lambda *a, fn=fn, name=name: calls.append((name, a[0].layer)) or fn(*a))
    got = greedy_steps(model, prompts, 4)
    pieces = {"layers": [("pre_fn", 1), ("post_fn", 1)],
              "experts": [("layer_fn", 0), ("pre_fn", 1), ("post_fn", 1), ("pre_fn", 2), ("post_fn", 2),
                          ("pre_fn", 3), ("post_fn", 3)]}[which]
    assert calls == pieces * 4  # the decode steps' compiled pieces
    for name, fn in fns.items():
        setattr(seg, name, fn)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(got[0], compiled[0])  # the prefill runs eagerly on both
    for a, b in zip(got[1:], compiled[1:]):
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    rows = model.offload.stats.expert_rows
    seg.recorder = record_eagerly
    again = greedy_steps(model, prompts, 4)
    assert all(torch.equal(a, b) for a, b in zip(again, want))
    assert seg.recorded == len(seg.segments) and seg.replays == 3 * len(seg.segments)
    assert model.offload.stats.expert_rows > rows
    st = model.offload.stats  # the first streamed stack of a step is never predicted; the others are
    assert st.hit_rows + st.miss_rows == st.chosen_rows and st.prefetched_rows > 0
    four = torch.cat([prompts, prompts[:1].flip(1)]).tolist()  # generate's continuous batching, its steps replayed
    want, _ = generate_ids(ref, four, max_new_tokens=5, sampling=GREEDY)
    got, _ = generate_ids(model, four, max_new_tokens=5, sampling=GREEDY)
    assert [q.generated for q in got] == [q.generated for q in want]
    assert seg.replays > 3 * len(seg.segments)


@pytest.mark.gpu
@pytest.mark.parametrize("fast", ["on", "compiled"])
@pytest.mark.parametrize("which", ["layers", "experts"])
def test_offloaded_segments_replay_cuda_graphs(tiny_nvfp4, prompts, fast, which):
    """On CUDA the segments between an offloaded model's synchronisation points are captured in CUDA graphs (one per
    segment, cache and batch shape) and replayed; logits equal the resident packed model's cut into the same pieces run
    without graphs: bit for bit until the first replay, then within fp32 rounding with the same greedy tokens, at
    batch 1 and 3."""
    from minimax_ref.fast.segments import SegmentedLayers

    model = offloaded(tiny_nvfp4, "cpu", which, fast=fast, device="cuda")
    seg = model.compiled
    assert isinstance(seg, SegmentedLayers) and seg.recorder is not None and not model.fast.graph
    from minimax_ref.fast import FastPaths, apply

    ref = load_model(tiny_nvfp4, dtype=torch.float32, weights="packed", device="cuda", **RUNTIME)
    apply(ref, replace(FastPaths.of(fast), graph=False))  # the same pieces, every step run without a graph
    ref.compiled = SegmentedLayers(len(ref.layers), seg.eager, seg.split, compiled=ref.compiled)
    for batch in (prompts[:1, :10].cuda(), prompts.cuda()):
        recorded, replays = seg.recorded, seg.replays
        want = greedy_steps(ref, batch, 4)
        got = greedy_steps(model, batch, 4)
        # the prefill and the first step (which the segments run piece by piece, then record) run without graphs on
        # both sides: bit for bit with `on`; `compiled`'s first step within fp32 rounding (its pieces are compiled
        # per segment over the streamed weights' copies, so inductor may choose other reduction splits than for the
        # resident model's layers); the replayed steps within fp32 rounding (cuBLAS may take another algorithm inside
        # a capture than outside it; the CPU tests check the replays' bookkeeping bit for bit)
        exact = 1 if fast == "compiled" else 2
        assert all(torch.equal(a, b) for a, b in zip(got[:exact], want[:exact]))
        errors = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got[exact:], want[exact:])]
        assert max(errors) < 1e-5, f"batch {len(batch)}: relative logit error by step {errors}"
        assert all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(got, want))
        assert seg.recorded - recorded == len(seg.segments) and seg.replays - replays == 3 * len(seg.segments)
    st = model.offload.stats  # rows copied ahead on the side stream, waited on before the experts read them
    assert st.hit_rows + st.miss_rows == st.chosen_rows and st.prefetched_rows > 0 and st.hit_rows > 0


def test_streamed_twins_launch_for_the_compute_device(tiny_nvfp4, monkeypatch):
    """The fast twins of streamed units are configured on their host copies; `launch_on_device` derives what depends
    on the device (a streamed layer part's attention SM count, a streamed packed weight's kernel launches) for the
    streamer's device, and leaves the resident twins as configured."""
    from minimax_ref.fast import grouped, prefill_experts
    from minimax_ref.weights.offload import launch_on_device

    model = offloaded(tiny_nvfp4, "cpu", "layers", fast="compiled")
    s = model.offload
    seen = []
    monkeypatch.setattr(grouped, "sm_count", lambda d: seen.append(d) or 132)
    monkeypatch.setattr(grouped, "tiles_for", lambda fmt, d: seen.append(d) or "device tiles")
    monkeypatch.setattr(grouped, "launch_for", lambda fmt, e, n, k, d: seen.append(d) or ("device launch", e, n, k))
    monkeypatch.setattr(prefill_experts, "tiles_for", lambda d: seen.append(d) or "device sorted tiles")
    w = model.layers[2].block_sparse_moe.experts.w1  # a streamed stack's packed weight
    w.grouped_tokens, w.decode_tiles, w.sorted_tiles = 64, "host tiles", "host sorted tiles"
    launch_on_device(model, s)
    assert [model.layers[i].self_attn.sm_count for i in range(4)] == [132, 1, 132, 132]  # layer 1's part resident
    assert w.decode_tiles == "device tiles" and w.grouped_launch == ("device launch", *w.shape)
    assert w.sorted_tiles == "device sorted tiles"
    assert seen and set(seen) == {s.device}


def test_fast_auto_when_offloading(tiny_nvfp4, monkeypatch):
    """`fast="auto"` (`--fast auto`) with offloading takes `auto_preset` before the load, sized by the whole
    checkpoint (not by what stays resident): the reference on a CPU; where it names "compiled" (CUDA, >= 1 GiB), the
    segmented steps are installed."""
    from minimax_ref.fast import paths
    from minimax_ref.fast.segments import SegmentedLayers
    from minimax_ref.weights.checkpoint import open_checkpoint

    model = offloaded(tiny_nvfp4, "cpu", "experts", fast="auto")
    assert model.fast_preset == "off" and type(model).__name__ == "MiniMaxM3"
    asked = []
    monkeypatch.setattr(paths, "auto_preset", lambda device, nbytes: asked.append(nbytes) or "compiled")
    model = offloaded(tiny_nvfp4, "cpu", "experts", fast="auto")
    assert model.fast_preset == "compiled" and isinstance(model.compiled, SegmentedLayers)
    ck = open_checkpoint(tiny_nvfp4)
    assert asked == [sum(ck.family_bytes().values())]
    ck.close()


def test_default_prefetch_gives_way_to_a_tight_budget(tiny_nvfp4, monkeypatch, capsys):
    """Prefetch by default (as on CUDA: "where it fits") under a budget that holds one expert staging stack but not
    two: the model loads without prefetch and says so on stderr; asked for explicitly, prefetch is refused as before."""
    from minimax_ref.weights import offload

    budget = budgets(tiny_nvfp4, prefetch=False)["experts"]
    monkeypatch.setattr(offload, "default_prefetch", lambda mode, cuda: None)
    model = load_model(tiny_nvfp4, dtype=torch.float32, weights="packed",
                       offload=OffloadConfig("cpu", budget, reserve_gib=0.0), **RUNTIME)
    assert not model.offload.prefetch and model.offload.device_map.streamed
    assert "not the two that prefetch needs" in capsys.readouterr().err
    roomy = load_model(tiny_nvfp4, dtype=torch.float32, weights="packed",
                       offload=OffloadConfig("cpu", budgets(tiny_nvfp4)["experts"], reserve_gib=0.0), **RUNTIME)
    assert roomy.offload.prefetch and not capsys.readouterr().err
    with pytest.raises(ConfigError, match="is less than"):
        load_model(tiny_nvfp4, dtype=torch.float32, weights="packed",
                   offload=OffloadConfig("cpu", budget, reserve_gib=0.0, prefetch=True), **RUNTIME)


def test_prefetch_default():
    """Prefetch not asked for either way: "where it fits" (None) for the "cpu" store on CUDA, off on a CPU and for
    the "disk" store; `propose_staged_map` then takes the second staging stack only where it fits."""
    from minimax_ref.weights.device_map import OffloadUnit, default_prefetch, propose_staged_map

    assert OffloadConfig("cpu", 10).prefetch is None
    assert default_prefetch("cpu", cuda=True) is None
    assert default_prefetch("cpu", cuda=False) is False and default_prefetch("disk", cuda=True) is False
    units = [OffloadUnit("layers.0", "layer", 0, 100)] + [OffloadUnit(f"layers.{i}.experts", "experts", i, 1000, 8)
                                                          for i in range(3)]
    dm, on = propose_staged_map(units, 0, 2100, 0, None)
    assert on and dm.staging_bytes == 2000
    dm, on = propose_staged_map(units, 0, 1100, 0, None)
    assert not on and dm.staging_bytes == 1000
    with pytest.raises(ConfigError, match="is less than"):
        propose_staged_map(units, 0, 1100, 0, True)


@pytest.mark.parametrize("which", ["layers", "experts"])
def test_synthetic_shared_experts_move_the_same_bytes(which):
    """load_synthetic with share_streamed_experts: the streamed stacks read one host copy (the first streamed stack's),
    and each step still moves the chosen rows of every streamed stack; with layer parts streamed too."""
    kw = dict(dtype=torch.float32, weights="packed", **RUNTIME)
    full = load_synthetic("tiny", **kw)
    always, units = offload_units(full.config, dtype_bytes=4)
    stack = max(u.nbytes for u in units if u.kind == "experts")
    layers = [u.nbytes for u in units if u.kind == "layer"]
    kv = kv_bytes_per_token(full.config, 1, "auto", 4) * 64 * 4
    budget = always + kv + 2 * stack + (sum(layers) if which == "experts" else 2 * max(layers) + min(layers))
    model = load_synthetic("tiny", offload=OffloadConfig("cpu", budget / GIB, reserve_gib=0.0,
                                                         share_streamed_experts=True, prefetch=True), **kw)
    s = model.offload
    assert list(s.device_map.streamed) == EXPECTED[which][1]
    first = min(u.layer for u in s.units.values() if u.kind == "experts")
    keys = {r.key for u in s.units.values() if u.kind == "experts" for r in u.records}
    assert all(k.startswith(f"layers.{first}.") for k in keys)  # one host copy of the expert stacks
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(1))
    a, b = Trace(layers={first}), Trace(layers={first})
    full(ids, trace=a)
    assert torch.isfinite(model(ids, trace=b)).all()
    # up to the first streamed stack the model is the resident one
    assert torch.equal(a.hidden_states[first], b.hidden_states[first])
    chosen = s.stats.chosen_rows
    model(ids)
    assert s.stats.chosen_rows - chosen == sum(len(torch.unique(b.routing[u.layer].expert_ids))
                                               for u in s.units.values() if u.kind == "experts")
    assert s.stats.hit_rows + s.stats.miss_rows == s.stats.chosen_rows


class Chosen:
    """Wraps `Streamer.enter_experts` to record each call's stack and distinct chosen experts (what the stats count)."""

    def __init__(self, monkeypatch, streamer):
        self.calls: list[tuple[str, list[int]]] = []
        enter = streamer.enter_experts

        def wrapped(name, expert_ids, x=None):
            self.calls.append((name, sorted(set(expert_ids.reshape(-1).tolist()))))
            return enter(name, expert_ids, x)

        monkeypatch.setattr(streamer, "enter_experts", wrapped)

    @property
    def rows(self) -> int:
        return sum(len(c) for _, c in self.calls)


def check_counters(s, chosen_rows: int) -> None:
    """The streamer's row counters agree: hits + misses = the chosen rows, rows copied = copied ahead + misses."""
    st = s.stats
    assert st.chosen_rows == chosen_rows and st.hit_rows + st.miss_rows == st.chosen_rows
    assert st.expert_rows == st.prefetched_rows + st.miss_rows and st.hit_rows <= st.prefetched_rows


@pytest.mark.parametrize("fast", [None, "on"])
@pytest.mark.parametrize("which", ["layers", "experts"])
def test_prefetch_equals_resident_and_no_prefetch(tiny_nvfp4, prompts, monkeypatch, fast, which):
    """Rows copied ahead on the predicted experts of the next streamed stack change nothing: prefill and decode
    logits and greedy tokens (batch 1 and 4, the batch-4 steps reading every staged row through the dense branch of
    the fast path) equal, bit for bit, the resident packed model's and the offloaded model's without prefetch; the
    counters agree with the chosen experts (hits + misses = chosen) and some chosen rows were hits; the stacks
    alternate between two staging sets."""
    kw = {} if fast is None else {"fast": fast}
    ref = load_model(tiny_nvfp4, dtype=torch.float32, weights="packed", **kw, **RUNTIME)
    off = offloaded(tiny_nvfp4, "cpu", which, prefetch=False, **kw)
    model = offloaded(tiny_nvfp4, "cpu", which, **kw)
    s = model.offload
    assert s.prefetch and not off.offload.prefetch
    assert s.stage_set == {"layers.1.experts": 0, "layers.2.experts": 1, "layers.3.experts": 0}
    assert s.next_stack == {"layers.1.experts": "layers.2.experts", "layers.2.experts": "layers.3.experts"}
    seen = Chosen(monkeypatch, s)
    four = torch.cat([prompts, prompts[:1].flip(1)])
    for batch in (prompts[:1, :10], four):
        want = greedy_steps(ref, batch, 4)
        for m in (model, off):
            got = greedy_steps(m, batch, 4)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        want, _ = generate_ids(ref, batch.tolist(), max_new_tokens=4, sampling=GREEDY)
        for m in (model, off):
            got, _ = generate_ids(m, batch.tolist(), max_new_tokens=4, sampling=GREEDY)
            assert [q.generated for q in got] == [q.generated for q in want]
    check_counters(s, seen.rows)
    assert s.stats.prefetched_rows > 0 and s.stats.hit_rows > 0 and 0 < s.stats.hit_rate <= 1
    o = off.offload.stats
    assert o.prefetched_rows == o.hit_rows == 0 and o.miss_rows == o.chosen_rows == s.stats.chosen_rows
    assert o.expert_rows == o.chosen_rows and o.hit_rate == 0


def test_prefetch_always_wrong(tiny_nvfp4, prompts, monkeypatch):
    """A prediction that never holds (every expert but the ones the next stack will choose, from a recorded run)
    still gives the resident model's logits and tokens bit for bit: every chosen row is a miss, copied after the
    router, and every row copied ahead is one the experts do not read (or multiply by 0)."""
    ref = load_model(tiny_nvfp4, dtype=torch.float32, weights="packed", fast="on", **RUNTIME)
    four = torch.cat([prompts, prompts[:1].flip(1)])
    record = offloaded(tiny_nvfp4, "cpu", "experts", prefetch=False, fast="on")
    rec = Chosen(monkeypatch, record.offload)
    greedy_steps(record, four, 3)
    model = offloaded(tiny_nvfp4, "cpu", "experts", fast="on")
    s = model.offload
    seen = Chosen(monkeypatch, s)
    E = model.config.text.num_local_experts

    def wrong(name, x):  # called during call i for the stack of call i + 1
        nxt_name, nxt = rec.calls[len(seen.calls)]
        assert nxt_name == name
        return torch.tensor([e for e in range(E) if e not in nxt], dtype=torch.long)

    monkeypatch.setattr(s, "predict", wrong)
    want = greedy_steps(ref, four, 3)
    got = greedy_steps(model, four, 3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert seen.calls == rec.calls
    check_counters(s, rec.rows)
    assert s.stats.hit_rows == 0 and s.stats.miss_rows == rec.rows
    assert s.stats.prefetched_rows == sum(E - len(c) for name, c in rec.calls if name != "layers.1.experts")


def test_prefetch_reserves_second_staging(tiny_nvfp4):
    """With prefetch the device map reserves a second layer's expert stacks of staging (so `--gpu-memory` holds) and
    the streamer allocates it; without, one; a budget that holds one staging stack but not two refuses prefetch."""
    from minimax_ref.weights.device_map import propose_device_map

    cfg = load_model_config(tiny_nvfp4)
    always, units = offload_units(cfg, dtype_bytes=4, ckpt_dir=tiny_nvfp4)
    stack = max(u.nbytes for u in units if u.kind == "experts")
    b = budgets(tiny_nvfp4)["experts"]
    on, off = offloaded(tiny_nvfp4, "cpu", "experts"), offloaded(tiny_nvfp4, "cpu", "experts", prefetch=False)
    dm_on, dm_off = on.offload.device_map, off.offload.device_map
    assert dm_on.streamed == dm_off.streamed and dm_on.staging_bytes == dm_off.staging_bytes + stack
    assert dm_on.staging_bytes == 2 * stack and dm_on.gpu_bytes <= dm_on.budget_bytes == int(b * GIB)
    assert on.offload.device_bytes() == 2 * off.offload.device_bytes() <= 2 * stack
    assert on.load_stats["memory_bytes"] - off.load_stats["memory_bytes"] == off.offload.device_bytes()
    tight = always + sum(u.nbytes for u in units if u.kind == "layer") + stack  # one staging stack, reserve 0
    assert propose_device_map(units, always, tight, 0).streamed
    with pytest.raises(ConfigError, match="is less than"):
        propose_device_map(units, always, tight, 0, expert_stages=2)


def test_id_runs():
    assert id_runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (5, 6), (7, 9)]
    assert id_runs([]) == [] and id_runs([4]) == [(4, 5)]


def test_refused_combinations(tiny_nvfp4, tmp_path, monkeypatch):
    b = budgets(tiny_nvfp4)["layers"]
    with pytest.raises(ConfigError, match="--weights packed"):
        load_model(tiny_nvfp4, dtype=torch.float32, offload="cpu", gpu_memory=b, **RUNTIME)
    with pytest.raises(ConfigError, match="needs gpu_memory"):
        load_model(tiny_nvfp4, weights="packed", offload="cpu")
    with pytest.raises(ConfigError, match="need offload="):
        load_model(tiny_nvfp4, weights="packed", gpu_memory=10)
    with pytest.raises(ConfigError, match="choose one of"):
        load_model(tiny_nvfp4, weights="packed", offload="gpu", gpu_memory=10)
    with pytest.raises(ConfigError, match="is for offload='disk'"):
        load_model(tiny_nvfp4, weights="packed", offload="cpu", gpu_memory=10, offload_folder=tmp_path)
    with pytest.raises(ConfigError, match=r"--gpu-memory .* is less than the .* this model needs"):
        load_model(tiny_nvfp4, weights="packed", offload="cpu", gpu_memory=1e-4, dtype=torch.float32, **RUNTIME)
    with pytest.raises(ConfigError, match="synthetic weights only"):
        load_model(tiny_nvfp4, weights="packed", offload=OffloadConfig("cpu", b, share_streamed_experts=True))
    cfg = OffloadConfig("cpu", 1.0)
    with pytest.raises(ConfigError, match="TP=1"):
        check_offload(cfg, weights="packed", tp_size=2, expert_parallel=False, fast=None, synthetic=False)
    used = tmp_path / "used"
    used.mkdir()
    (used / "index.json").write_text("{}")
    with pytest.raises(ConfigError, match="already holds an offload index"):
        load_model(tiny_nvfp4, weights="packed", offload="disk", gpu_memory=b, offload_folder=used, **RUNTIME)
    monkeypatch.setitem(sys.modules, "accelerate", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"minimax-ref\[offload\]"):
        load_model(tiny_nvfp4, weights="packed", offload="cpu", gpu_memory=b, **RUNTIME)


def test_cli_generate_offloaded_equals_resident(tiny_nvfp4, tmp_path, capsys, monkeypatch):
    """`minimax-ref generate --offload disk --gpu-memory ...` prints what the resident run prints, and so does
    `--offload-prefetch`; a bad combination is one `error:` line, exit status 2."""
    from minimax_ref.weights import offload

    prefetch, load = [], offload.load_offloaded
    monkeypatch.setattr(offload, "load_offloaded", lambda model, ck, cfg, *a, **kw: prefetch.append(cfg.prefetch)
                        or load(model, ck, cfg, *a, **kw))
    common = ["generate", "--ckpt-path", str(tiny_nvfp4), "--weights", "packed", "--prompt", "Hello there",
              "--max-new-tokens", "5", "--temperature", "0", "--output-format", "json", "--max-model-len", "64"]
    assert main(common) == 0
    want = json.loads(capsys.readouterr().out)
    store = tmp_path / "store"
    # 5 GiB activation reserve (the default) and one sequence's KV cache, plus 2 MiB: a few units fit, the rest stream
    assert main(common + ["--offload", "disk", "--gpu-memory", str(5 + 2 / 1024), "--offload-folder", str(store)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
    assert json.loads((store / "device_map.json").read_text())["streamed"]
    assert main(common[:-2] + ["--offload", "cpu", "--gpu-memory", "8", "--weights", "dequant"]) == 2
    assert "--weights packed" in capsys.readouterr().err
    assert main(common + ["--offload", "cpu", "--gpu-memory", str(5 + 2 / 1024), "--offload-prefetch"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
    assert prefetch[0] is None and prefetch[-1] is True  # by default decided at load; the refused run in between
    assert main(common + ["--offload", "cpu", "--gpu-memory", str(5 + 2 / 1024), "--no-offload-prefetch"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want["token_ids"] and prefetch[-1] is False
    assert main(common + ["--offload-prefetch"]) == 2
    assert "--offload-prefetch / --no-offload-prefetch need --offload" in capsys.readouterr().err


def test_cli_score_offloaded_equals_resident(tiny_nvfp4, tmp_path, capsys):
    """`minimax-ref score` with a reference, both models offloaded to one --offload-folder (a subfolder each): the
    per-token scores of the resident run, exactly."""
    g = torch.Generator().manual_seed(3)
    traces = tmp_path / "traces.jsonl"
    traces.write_text("\n".join(json.dumps({"input_ids": torch.randint(0, 1000, (n,), generator=g).tolist(),
                                            "completion_start": s}) for n, s in ((40, 20), (70, 50))) + "\n")
    common = ["score", "--ckpt-path", str(tiny_nvfp4), "--reference", str(tiny_nvfp4), "--traces", str(traces),
              "--weights", "packed", "--dtype", "float32", "--per-token", "--max-model-len", "128"]
    assert main(common) == 0
    want = json.loads(capsys.readouterr().out)
    store = tmp_path / "store"
    assert main(common + ["--batch-size", "2", "--offload", "disk", "--gpu-memory", str(5 + 2.2 / 1024),
                          "--offload-folder", str(store)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == want
    assert {p.name for p in store.iterdir()} == {"model", "reference"}
    assert json.loads((store / "model" / "device_map.json").read_text())["streamed"]


def test_benchmark_runs_on_cpu(capsys):
    """benchmarks/offload.py with the tiny preset on the CPU: one JSON line, the measured bytes moved per step near the
    plan's, streamed units, tok/s and the roofline per batch."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "offload.py"
    spec = importlib.util.spec_from_file_location("offload_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for prefetch in ("on", "off"):
        out = bench.main(["--device", "cpu", "--preset", "tiny", "--batches", "1,2", "--steps", "2", "--warmup", "0",
                          "--h2d-mib", "1", "--h2d-repeats", "1", "--prefetch", prefetch])
        assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(out))
        assert out["streamed_units"] and [r["batch"] for r in out["results"]] == [1, 2]
        assert out["prefetch"] == prefetch
        for r in out["results"]:
            assert r["tok_s"] > 0 and r["roofline_tok_s"] > 0 and r["bytes_moved_per_step"] > 0
            assert r["hit_rows_per_step"] + r["miss_rows_per_step"] == r["chosen_rows_per_step"] > 0
            assert 0 <= r["hit_rate"] <= 1 and r["bytes_needed_per_step"] <= r["bytes_moved_per_step"]
            if prefetch == "off":
                assert r["prefetched_rows_per_step"] == r["hit_rate"] == 0
                assert r["bytes_needed_per_step"] == r["bytes_moved_per_step"]


def test_golden_bundle_offloaded_equals_resident(tiny_nvfp4, tmp_path, capsys):
    """`minimax-ref golden --offload cpu` writes the tensors the resident run writes (golden outputs of a model that
    does not fit the device)."""
    from safetensors.torch import load_file

    common = ["golden", "--ckpt-path", str(tiny_nvfp4), "--prompt", "hello world", "--ops", "moe,nvfp4_linear",
              "--layers", "2", "--weights", "packed", "--max-model-len", "64", "--dtype", "float32"]
    assert main(common + ["--out", str(tmp_path / "a")]) == 0
    assert main(common + ["--out", str(tmp_path / "b"), "--offload", "cpu", "--gpu-memory", str(5 + 2 / 1024)]) == 0
    capsys.readouterr()
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.safetensors"))
    assert files
    for f in files:
        a, b = load_file(tmp_path / "a" / f), load_file(tmp_path / "b" / f)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), (f, k)


def test_cli_prune_offloaded_keeps_the_resident_choice(tiny_nvfp4, tmp_path, capsys):
    """`minimax-ref prune` on an offloaded model scores the experts from the same routing and keeps the same ones."""
    g = torch.Generator().manual_seed(5)
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"input_ids": torch.randint(0, 1000, (n,), generator=g).tolist(),
                                           "completion_start": 1})
                               for n in (48, 64)) + "\n")
    common = ["prune", "--ckpt-path", str(tiny_nvfp4), "--keep", "8", "--calibration", str(calib), "--weights",
              "packed", "--max-model-len", "128", "--batch-size", "2"]
    assert main(common + ["--out", str(tmp_path / "resident")]) == 0
    want = json.loads(capsys.readouterr().out)
    assert main(common + ["--out", str(tmp_path / "offloaded"), "--offload", "cpu",
                          "--gpu-memory", str(5 + 4.5 / 1024)]) == 0
    assert json.loads(capsys.readouterr().out)["kept"] == want["kept"]
