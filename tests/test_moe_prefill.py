"""The routed experts of many tokens (prefill) sorted by expert, one grouped matmul per projection
(`FastExperts.forward_sorted`), against the reference's loop over experts (`Experts.forward`): plain and packed
stacks, expert parallelism, experts no token chose, groups of decoded experts, and whole models."""

from __future__ import annotations

import pytest
import torch

from minimax_ref.fast import FastPaths, apply
from minimax_ref.fast import moe as fast_moe
from minimax_ref.model.moe import Experts, Routing, route
from minimax_ref.model.parallel import World
from minimax_ref.weights.loader import load_model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _experts(E=16, H=64, I=32, world=None, ep=False, seed=0):  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    ex = Experts(E, H, I, 1.702, 7.0, world, ep)
    n, c = len(ex.local_experts), ex.channels.stop - ex.channels.start
    for leaf, shape in (("w1", (n, c, H)), ("w3", (n, c, H)), ("w2", (n, H, c))):
        setattr(ex, leaf, torch.nn.Parameter(torch.randn(shape, generator=g) * H**-0.5, requires_grad=False))
    return ex


def _sorted_calls(ex) -> list:
    calls = []
    ex.forward_sorted = lambda *a, _c=calls: _c.append(1) or fast_moe.FastExperts.forward_sorted(ex, *a)
    return calls


@pytest.mark.parametrize("ep_rank", [None, 0, 1])
def test_sorted_experts_equal_the_reference(ep_rank):
    world = None if ep_rank is None else World(ep_rank, 2)
    ex = _experts(world=world, ep=ep_rank is not None)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(150, 64, generator=g)
    r = route(x, torch.randn(16, 64, generator=g), None, 4)
    # expert 5 is never chosen (its pairs moved to expert 6; a token may then choose 6 twice)
    r = Routing(torch.where(r.expert_ids == 5, 6, r.expert_ids), r.weights, r.logits)
    want = ex(x, r)
    apply(ex, FastPaths(moe=True))
    calls = _sorted_calls(ex)
    got = ex(x, r)
    assert calls and _rel(got, want) < 1e-6


def test_whole_stacks_take_one_call_without_a_host_read(monkeypatch):
    """Without expert parallelism and with the stacks at hand (plain here; packed ones that decode within
    `SORTED_DECODED_BYTES`): one grouped call over every local expert whose offsets stay on the device (nothing read
    back on the host), an expert no pair chose an empty group; the reference's result."""
    ex = _experts()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(120, 64, generator=g)
    r = route(x, torch.randn(16, 64, generator=g), None, 4)
    r = Routing(torch.where(r.expert_ids == 5, 6, r.expert_ids), r.weights, r.logits)
    want = ex(x, r)
    apply(ex, FastPaths(moe=True))
    calls = []
    grouped = fast_moe.FastExperts.grouped
    monkeypatch.setattr(fast_moe.FastExperts, "grouped", lambda self, xs, index, offs: calls.append((index, offs))
                        or grouped(self, xs, index, offs))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("a host read in the sorted products"))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a host read in the sorted products"))
    got = ex(x, r)
    monkeypatch.undo()
    assert len(calls) == 1 and calls[0][0] is None
    offs = calls[0][1]
    assert offs.dtype == torch.int32 and len(offs) == 16 and offs[5] == offs[4] and offs[-1] == 120 * 4
    assert _rel(got, want) < 1e-6


def test_decoded_experts_go_in_groups(nvfp4_ckpt, monkeypatch):
    """Packed stacks whose decoded weights exceed `SORTED_DECODED_BYTES` (room for two experts' here) decode the
    chosen experts in groups, with the counts read on the host; the same result."""
    model = load_model(nvfp4_ckpt, dtype=torch.float32, weights="packed")
    ex = model.layers[1].block_sparse_moe.experts
    g = torch.Generator().manual_seed(4)
    x = torch.randn(120, model.text.hidden_size, generator=g)
    r = model.layers[1].block_sparse_moe.gate(x)
    want = ex(x, r)
    apply(ex, FastPaths(moe=True))
    per_expert = sum(getattr(ex, leaf).shape[1] * getattr(ex, leaf).shape[2] for leaf in ("w1", "w2", "w3")) * 4
    monkeypatch.setattr(fast_moe, "SORTED_DECODED_BYTES", 2 * per_expert)
    groups = []
    grouped = fast_moe.FastExperts.grouped
    monkeypatch.setattr(fast_moe.FastExperts, "grouped", lambda self, xs, index, offs: groups.append(len(index))
                        or grouped(self, xs, index, offs))
    assert _rel(ex(x, r), want) < 1e-6
    assert max(groups) == 2 and sum(groups) == len(r.expert_ids.unique())


@pytest.fixture(scope="module")
def nvfp4_ckpt(ckpt_factory):
    return ckpt_factory("tiny", "nvfp4")


def test_sorted_experts_on_packed_stacks_and_in_a_model(nvfp4_ckpt):
    """Packed NVFP4 stacks decode the chosen experts for the grouped products; a whole model's prefill of more
    tokens than the synchronisation-free path takes gives the reference's logits."""
    model = load_model(nvfp4_ckpt, dtype=torch.float32, weights="packed")
    ex = model.layers[1].block_sparse_moe.experts
    g = torch.Generator().manual_seed(5)
    x = torch.randn(100, model.text.hidden_size, generator=g)
    r = model.layers[1].block_sparse_moe.gate(x)
    want = ex(x, r)
    ids = torch.randint(0, model.text.vocab_size, (2, 90), generator=g)
    logits = model(ids)
    apply(model, FastPaths(moe=True))
    calls = _sorted_calls(model.layers[1].block_sparse_moe.experts)
    assert _rel(ex(x, r), want) < 1e-6
    assert _rel(model(ids), logits) < 1e-5 and calls


@pytest.mark.gpu
def test_sorted_experts_on_the_gpu_in_bf16():
    """On a GPU (compute capability 9.0+) the grouped products of bf16 experts, one an empty group (no pair chose
    it): the reference's function within bf16 rounding of the products' outputs."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a CUDA device of compute capability 9.0 or later")
    ex = _experts(E=16, H=256, I=128).to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(300, 256, generator=g).to("cuda", torch.bfloat16)
    r = route(x, torch.randn(16, 256, generator=g).to("cuda", torch.bfloat16), None, 4)
    r = Routing(torch.where(r.expert_ids == 5, 6, r.expert_ids), r.weights, r.logits)
    want = ex(x, r)
    apply(ex, FastPaths(moe=True))
    calls = _sorted_calls(ex)
    assert _rel(ex(x, r), want) < 1e-2 and calls
