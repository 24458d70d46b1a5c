"""DSpark speculative decoding: greedy identity, lossless sampling, rollback, the drafter loader, the CLI.

Speculation must never change what is generated: greedy output is compared token by token with plain
greedy decoding (with a random drafter that is almost always wrong, an adversarial one that is always
wrong, and an oracle that is always right), and sampled output is compared in distribution with the
exact distribution of a toy Markov-chain target; wrong acceptance rules must fail the same check.
"""

from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import minimax_ref as mr
from minimax_ref.cli.main import main
from minimax_ref.errors import CheckpointError, ConfigError, InputError
from minimax_ref.generation.drafter import PREFIX, Draft, load_drafter
from minimax_ref.generation.generate import SamplingParams, filtered_probs, generate_ids
from minimax_ref.generation.speculative import (
    SpeculativeDecoder,
    accept_drafts,
    accept_greedy,
    sample_inverse_cdf,
    speculative_generate_ids,
)
from minimax_ref.research.trace import Trace
from minimax_ref.weights.loader import load_model

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model(spec_ckpt):
    return load_model(spec_ckpt, dtype=torch.float32)


@pytest.fixture(scope="module")
def drafter(spec_ckpt, model):
    return load_drafter(spec_ckpt / "dspark", model)


def _prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]


def _same_output(ref, out) -> None:
    for b, (r, o) in enumerate(zip(ref, out, strict=True)):
        assert o.generated == r.generated, f"row {b}"
        assert o.finish_reason == r.finish_reason, f"row {b}"


# ---------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("lengths", [(40,), (40, 70, 3)], ids=["single", "batch"])
def test_greedy_identical_to_plain_greedy(model, drafter, lengths):
    # contexts past 64 tokens engage both the drafter's window (64) and the target's MSA block selection
    prompts = _prompts(*lengths)
    ref, _ = generate_ids(model, prompts, max_new_tokens=40, sampling=GREEDY)
    out, stats = speculative_generate_ids(model, drafter, prompts, max_new_tokens=40, sampling=GREEDY)
    _same_output(ref, out)
    # a random drafter is nearly always wrong: about one token per step
    assert 1.0 <= stats.mean_accepted_length < 1.5
    assert stats.num_speculative_tokens == drafter.block_size == 4
    assert stats.generated_tokens == sum(len(s.generated) for s in out)
    assert stats.draft_seconds > 0 and stats.verify_seconds > 0
    print(f"random drafter: mean accepted length {stats.mean_accepted_length:.3f}")


def test_greedy_stop_tokens_and_capture_option(model, spec_ckpt):
    prompts = _prompts(30, 12)
    ref, _ = generate_ids(model, prompts, max_new_tokens=30, sampling=GREEDY)
    stop = [ref[0].generated[9], ref[1].generated[4]]
    ref, _ = generate_ids(model, prompts, max_new_tokens=30, sampling=GREEDY, stop_ids=stop)
    assert any(s.finish_reason == "stop" for s in ref)
    post = load_drafter(spec_ckpt / "dspark", model, capture_final_norm=True)
    for n in (1, 3):
        out, _ = speculative_generate_ids(model, post, prompts, max_new_tokens=30, sampling=GREEDY, stop_ids=stop,
                                          num_speculative_tokens=n)
        _same_output(ref, out)


def _reference(model, prompts, n):
    ref, _ = generate_ids(model, prompts, max_new_tokens=n, sampling=GREEDY)
    return [p + s.generated for p, s in zip(prompts, ref)]


def _patch_base_logits(monkeypatch, drafter, choose):
    """Replace the drafter's base logits by a spike of 1e4 on choose(row, position) (the real backbone
    still runs for the hidden states; the real Markov pass then picks the spiked token)."""
    real = drafter.block_logits

    def block_logits(target, cache, anchors, positions, num_tokens):
        U, h = real(target, cache, anchors, positions, num_tokens)
        U = torch.zeros_like(U)
        for b in range(U.shape[0]):
            for k in range(num_tokens):
                U[b, k, choose(b, int(positions[b]) + k + 1)] = 1e4
        return U, h

    monkeypatch.setattr(drafter, "block_logits", block_logits)


def test_oracle_drafter_accepts_everything(model, drafter, monkeypatch):
    B = drafter.block_size
    prompts = _prompts(20, 45)
    n = 1 + 3 * (B + 1)  # the first token, then three full steps of B accepted drafts + the bonus token
    seqs = _reference(model, prompts, n + B + 1)
    _patch_base_logits(monkeypatch, drafter, lambda b, pos: seqs[b][pos])
    ref, _ = generate_ids(model, prompts, max_new_tokens=n, sampling=GREEDY)
    out, stats = speculative_generate_ids(model, drafter, prompts, max_new_tokens=n, sampling=GREEDY)
    _same_output(ref, out)
    assert stats.mean_accepted_length == B + 1
    assert stats.acceptance_rate_per_position == [1.0] * B
    assert stats.decode_steps == 3 and stats.steps == 3 * len(prompts)


def test_adversarial_drafter_rejected_at_every_position(model, drafter, monkeypatch):
    prompts = _prompts(33, 8)
    seqs = _reference(model, prompts, 40)
    V = model.text.vocab_size
    _patch_base_logits(monkeypatch, drafter, lambda b, pos: (seqs[b][pos] + 1) % V)
    ref, _ = generate_ids(model, prompts, max_new_tokens=20, sampling=GREEDY)
    out, stats = speculative_generate_ids(model, drafter, prompts, max_new_tokens=20, sampling=GREEDY)
    _same_output(ref, out)
    assert stats.mean_accepted_length == 1.0
    assert stats.acceptance_rate_per_position[0] == 0.0


def test_confidence_threshold_only_shortens_the_verified_prefix(model, drafter):
    prompts = _prompts(25, 50)
    ref, _ = generate_ids(model, prompts, max_new_tokens=16, sampling=GREEDY)
    # a threshold above every sigmoid score verifies no draft at all: one token per step
    out, stats = speculative_generate_ids(model, drafter, prompts, max_new_tokens=16, sampling=GREEDY,
                                          confidence_threshold=1.5)
    _same_output(ref, out)
    assert stats.mean_accepted_length == 1.0 and stats.proposed_per_position == [0] * drafter.block_size
    draft = drafter.draft(model, drafter.new_cache(1, 8), torch.tensor([5]), torch.tensor([0]), 4, GREEDY, None)
    assert draft.confidence.shape == (1, 4) and bool(((draft.confidence > 0) & (draft.confidence < 1)).all())


# ---------------------------------------------------------------------------------------------- continuous batching


def test_a_request_decodes_as_it_does_alone(model, drafter):
    """Six requests of mixed prompt lengths, max_new_tokens and sampling settings (greedy among them) through two
    slots, a stop token among them: each request's tokens are those it gets alone (its own generator, seeded with its
    own seed, draws its first token, its drafts and its acceptance uniforms), and the drafts were accepted often
    enough to test the acceptance path (hot sampling makes a random drafter right)."""
    prompts = _prompts(23, 5, 70, 9, 31, 14)
    new = [14, 3, 18, 1, 9, 12]
    settings = [SamplingParams(3.0), GREEDY, SamplingParams(3.0, 0.95, 200), SamplingParams(1.2),
                SamplingParams(2.5, 0.99, 0), GREEDY]
    seeds = [3, 4, 5, 6, 7, 8]
    first, _ = generate_ids(model, [prompts[5]], max_new_tokens=12, sampling=GREEDY)
    stop = [first[0].generated[6]]  # request 5 stops at its seventh token
    kw = dict(stop_ids=stop, num_speculative_tokens=3)
    batched, stats = speculative_generate_ids(model, drafter, prompts, max_new_tokens=new, sampling=settings,
                                              seed=seeds, max_batch_size=2, **kw)
    assert batched[5].finish_reason == "stop" and len(batched[5].generated) == 7
    assert stats.mean_accepted_length > 1.5
    for i in range(len(prompts)):
        alone, _ = speculative_generate_ids(model, drafter, [prompts[i]], max_new_tokens=new[i], sampling=settings[i],
                                            seed=seeds[i], **kw)
        assert (batched[i].generated, batched[i].finish_reason) == (alone[0].generated, alone[0].finish_reason), i
    for i in (1, 5):  # greedy requests beside sampled ones: plain greedy decoding's tokens
        plain, _ = generate_ids(model, [prompts[i]], max_new_tokens=new[i], sampling=GREEDY, stop_ids=stop)
        assert batched[i].generated == plain[0].generated, i
    # the default seeds: request i is seeded with seed + i, whoever shares its batch
    hot = SamplingParams(2.0)
    together, _ = speculative_generate_ids(model, drafter, prompts[:3], max_new_tokens=6, sampling=hot, seed=10,
                                           max_batch_size=3)
    for i in range(3):
        alone, _ = speculative_generate_ids(model, drafter, [prompts[i]], max_new_tokens=6, sampling=hot, seed=10 + i)
        assert together[i].generated == alone[0].generated, i


def test_finished_slots_are_refilled_and_steps_keep_one_shape(model, drafter, monkeypatch):
    """Five requests through two slots: a finished request's slot is taken by the next waiting one at once, so a
    later request starts long before the first slot's long request ends; every verify step runs both slots, k+1
    tokens each; greedy output (stop tokens among it) is plain greedy decoding's."""
    shapes, events = [], []
    real = model.step_with_hidden

    def spy(ids, positions, cache, layers):
        shapes.append(tuple(ids.shape))
        return real(ids, positions, cache, layers)

    monkeypatch.setattr(model, "step_with_hidden", spy)
    prompts = _prompts(40, 12, 66, 7, 21)
    new = [30, 3, 4, 5, 6]
    ref, _ = generate_ids(model, prompts, max_new_tokens=new, sampling=GREEDY)
    stop = [ref[4].generated[2]]
    ref, _ = generate_ids(model, prompts, max_new_tokens=new, sampling=GREEDY, stop_ids=stop)
    out, stats = speculative_generate_ids(model, drafter, prompts, max_new_tokens=new, sampling=GREEDY, stop_ids=stop,
                                          max_batch_size=2, on_token=lambda i, t: events.append(i))
    _same_output(ref, out)
    assert any(s.finish_reason == "stop" for s in out)
    assert set(shapes) == {(2, drafter.block_size + 1)} and stats.decode_steps == len(shapes)
    # requests 1..4 all run in the second slot while request 0 is still decoding in the first
    last_of_0 = len(events) - 1 - events[::-1].index(0)
    assert all(events.index(i) < last_of_0 for i in (1, 2, 3, 4))
    # a random drafter emits about one token a step: request 0 alone needs about 29 steps, the others ride beside it
    assert stats.decode_steps < sum(len(s.generated) - 1 for s in out)


# ---------------------------------------------------------------------------------------------- rollback


def test_caches_after_rollback_equal_a_plain_run(model, drafter):
    """After a run each slot's rows of both caches equal a plain run over the prompt and the tokens but the last of
    the request it last held, also in a slot that a shorter request took over from a longer one."""
    prompts = _prompts(40, 70, 25)
    dec = SpeculativeDecoder(model, drafter)
    out, stats = dec.generate(prompts, max_new_tokens=[30, 6, 20], sampling=GREEDY, max_batch_size=2)
    assert stats.steps > 0 and dec.held == [0, 2]  # request 2 took request 1's slot
    assert dec.lengths[1] < len(out[1].prompt) + len(out[1].generated) - 1  # request 1 had left more positions there
    for b, i in enumerate(dec.held):
        s = out[i]
        L = len(s.prompt) + len(s.generated) - 1  # the last token is never run through the target
        assert dec.lengths[b] == L
        slots = dec.target_cache.max_seq_len
        plain, dplain = model.new_cache(1, slots), drafter.new_cache(1, slots)
        pos = torch.arange(L)[None]
        trace = Trace(layers=drafter.capture_layer_ids)
        model(torch.tensor([(s.prompt + s.generated)[:L]]), positions=pos, cache=plain, trace=trace)
        drafter.add_context(model, dplain, trace.hidden_states, pos)
        pairs = [(dec.target_cache.k, plain.k), (dec.target_cache.v, plain.v), (dec.draft_cache.k, dplain.k),
                 (dec.draft_cache.v, dplain.v),
                 ([x for x in dec.target_cache.index_k if x is not None], [x for x in plain.index_k if x is not None])]
        for got_layers, want_layers in pairs:
            assert len(got_layers) == len(want_layers) > 0
            for got, want in zip(got_layers, want_layers):
                torch.testing.assert_close(got[b, :L], want[0, :L], atol=1e-4, rtol=1e-4)
                assert not got[b, L:].any(), "slots past the accepted length must be rolled back (zero)"


# ---------------------------------------------------------------------------------------------- the verify step


def test_step_with_hidden_is_the_traced_forward(model, drafter):
    """The reference `step_with_hidden` returns the logits of the cached forward and the trace's residual streams."""
    ids = torch.tensor([_prompts(9)[0]])
    pos = torch.arange(9)[None]
    layers = sorted(drafter.capture_layer_ids)
    trace = Trace(layers=set(layers))
    with torch.no_grad():
        want = model(ids, positions=pos, cache=model.new_cache(1, 16), trace=trace)
        logits, hidden = model.step_with_hidden(ids, pos, model.new_cache(1, 16), layers)
    assert torch.equal(logits, want) and list(hidden) == layers
    for layer in layers:
        assert torch.equal(hidden[layer], trace.hidden_states[layer])
    n = model.text.num_hidden_layers
    for bad in ([n], [-1], [True], ["0"]):
        with pytest.raises(InputError, match=r"step_with_hidden\(layers=...\).*not layer indices"):
            model.step_with_hidden(ids, pos, model.new_cache(1, 16), bad)


@pytest.fixture(scope="module")
def fast_target(spec_ckpt):
    return load_model(spec_ckpt, dtype=torch.float32, weights="packed", fast="on")


def test_fast_verify_step_keeps_the_reference_hidden_states(model, fast_target, drafter):
    """The fast twin's synchronisation-free verify step (no trace: what a CUDA graph records) keeps the residual
    streams the reference traces, to fp32 rounding, after a prefill: k+1 = 5 tokens a row at each row's positions."""
    prompts = _prompts(40, 70)
    layers = sorted(drafter.capture_layer_ids)
    ids = torch.zeros(2, 75, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p)
    ids[0, 40:45] = torch.tensor(_prompts(5)[0])
    ids[1, 70:75] = torch.tensor(_prompts(6)[0][:5])
    pos = torch.tensor([[40], [70]]) + torch.arange(5)
    got = {}
    for name, target in (("reference", model), ("fast", fast_target)):
        cache = target.new_cache(2, 80)
        with torch.no_grad():
            target(ids[:, :70], positions=torch.arange(70).expand(2, -1), cache=cache)
            cache.rollback([40, 70])
            got[name] = target.step_with_hidden(ids.gather(1, pos), pos, cache, layers)
    assert fast_target.sync_free(pos, cache, None)
    torch.testing.assert_close(got["fast"][0], got["reference"][0], atol=1e-4, rtol=1e-4)
    assert list(got["fast"][1]) == layers
    for layer in layers:
        torch.testing.assert_close(got["fast"][1][layer], got["reference"][1][layer], atol=1e-4, rtol=1e-4)
    with pytest.raises(InputError, match="not layer indices"):
        fast_target.step_with_hidden(ids.gather(1, pos), pos, cache, [model.text.num_hidden_layers])


def test_fast_paths_speculative_greedy_is_plain_greedy(model, fast_target, spec_ckpt):
    """DSpark on the fast paths (verify steps through `sync_free_step`) emits plain greedy decoding's tokens."""
    prompts = _prompts(40, 70, 3)
    ref, _ = generate_ids(model, prompts, max_new_tokens=24, sampling=GREEDY)
    out, stats = speculative_generate_ids(fast_target, load_drafter(spec_ckpt / "dspark", fast_target), prompts,
                                          max_new_tokens=24, sampling=GREEDY)
    _same_output(ref, out)
    assert stats.warmup_seconds > 0 and stats.decode_steps > 1 and stats.decode_tokens > 0


def test_compiled_verify_steps_equal_the_eager_fast_paths(model, spec_ckpt):
    """With `--fast compiled` the verify steps (k+1 tokens a row) run compiled layers: the same logits and kept
    residual streams as the same fast paths run eagerly (fp32 rounding), and the loop emits plain greedy decoding's
    tokens. A call of k+1 tokens that is not a step (a prefill chunk) stays eager."""
    from dataclasses import replace

    from minimax_ref.fast import FastPaths, apply

    target = load_model(spec_ckpt, dtype=torch.float32, weights="packed", fast="compiled")
    drafter = load_drafter(spec_ckpt / "dspark", target)
    layers = sorted(drafter.capture_layer_ids)
    ids = torch.tensor([_prompts(45)[0]] * 2)
    pos = torch.tensor([[40], [38]]) + torch.arange(5)

    def verify() -> tuple[torch.Tensor, dict]:
        cache = target.new_cache(2, 64)
        with torch.no_grad():
            target(ids[:, :40], positions=torch.arange(40).expand(2, -1), cache=cache)
            cache.rollback([40, 38])
            return target.step_with_hidden(ids.gather(1, pos.clamp(max=44)), pos, cache, layers)

    compiled_calls = []
    real = target.compiled
    target.compiled = lambda *a: compiled_calls.append(1) or real(*a)
    got_logits, got_hidden = verify()
    assert len(compiled_calls) == target.text.num_hidden_layers
    compiled_calls.clear()
    with torch.no_grad():  # the same shape through `forward`: not a step, not compiled
        target(ids[:, :5], positions=torch.arange(5).expand(2, -1), cache=target.new_cache(2, 64))
    assert not compiled_calls
    apply(target, replace(FastPaths.of("compiled"), compile_layers=False))
    want_logits, want_hidden = verify()
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    for layer in layers:
        torch.testing.assert_close(got_hidden[layer], want_hidden[layer], atol=1e-5, rtol=1e-5)
    apply(target, "compiled")
    prompts = _prompts(40, 70)
    ref, _ = generate_ids(model, prompts, max_new_tokens=12, sampling=GREEDY)
    out, _ = speculative_generate_ids(target, load_drafter(spec_ckpt / "dspark", target), prompts, max_new_tokens=12,
                                      sampling=GREEDY)
    _same_output(ref, out)


def test_every_verify_step_has_one_shape(model, drafter, monkeypatch):
    """Every verify step runs k+1 tokens a row, also near the end (a captured step is one CUDA graph): rows that may
    emit fewer tokens verify fewer drafts, and the output is still plain greedy decoding's."""
    shapes = []
    real = model.step_with_hidden

    def spy(ids, positions, cache, layers):
        shapes.append(tuple(ids.shape))
        return real(ids, positions, cache, layers)

    monkeypatch.setattr(model, "step_with_hidden", spy)
    prompts = _prompts(40, 12)
    ref, _ = generate_ids(model, prompts, max_new_tokens=9, sampling=GREEDY)
    out, stats = speculative_generate_ids(model, drafter, prompts, max_new_tokens=9, sampling=GREEDY,
                                          num_speculative_tokens=3)
    _same_output(ref, out)
    assert len(shapes) >= 4 and set(shapes) == {(2, 4)}
    # the last step of a row that may emit one more token proposes no draft and is not a speculative step
    assert stats.steps < 2 * len(shapes)


def test_a_step_of_more_tokens_than_the_sync_free_experts_take_is_not_captured(fast_target):
    """The routed experts run without host synchronisation for up to `sync_free_tokens` tokens in all (batch x
    tokens a row): a step of more (a large batch, a long verify) runs eagerly, never in a CUDA graph."""
    n = fast_target.fast.sync_free_tokens
    cache = fast_target.new_cache(n + 1, 16)
    assert fast_target.sync_free(torch.zeros(n, 1, dtype=torch.long), cache, None)
    assert not fast_target.sync_free(torch.zeros(n + 1, 1, dtype=torch.long), cache, None)
    assert not fast_target.sync_free(torch.zeros(2, n // 2 + 1, dtype=torch.long), cache, None)


@pytest.mark.gpu
def test_verify_steps_replay_captured_graphs(spec_ckpt):
    """On CUDA with `--fast compiled`, DSpark's verify steps replay CUDA graphs keyed by shape and kept layers, the
    drafter's greedy passes graphs of their own, and both emit the tokens of the same fast paths launched op by op
    (graph off)."""
    from dataclasses import replace

    from minimax_ref.fast import FastPaths, apply

    target = load_model(spec_ckpt, dtype=torch.bfloat16, weights="packed", device="cuda", fast="compiled")
    drafter = load_drafter(spec_ckpt / "dspark", target)
    prompts = _prompts(40, 70)
    out, stats = speculative_generate_ids(target, drafter, prompts, max_new_tokens=24, sampling=GREEDY)
    layers = tuple(sorted(drafter.capture_layer_ids))
    keys = list(target.captured.graphs)
    assert ((2, drafter.block_size + 1), layers) in keys and stats.warmup_seconds > 0
    assert list(drafter.captured.passes) == [(2, drafter.block_size)]
    apply(target, replace(FastPaths.of("compiled"), graph=False))
    target.share_paths(drafter)
    assert not drafter.paths.graph
    eager, _ = speculative_generate_ids(target, drafter, prompts, max_new_tokens=24, sampling=GREEDY)
    _same_output(eager, out)


# ---------------------------------------------------------------------------------------------- drafter


def test_fast_drafter_pass_equals_the_reference(model, drafter, fast_target, spec_ckpt):
    """The drafter twin (a target with fast paths gives them to its drafter) gathers each row's window with a static
    shape: the same block hidden states and greedy drafts as the reference's host-read slice, for rows at different
    positions (no context yet, a window cut at position 0, a full window)."""
    from minimax_ref.fast.drafter import FastDSparkDrafter

    fast = load_drafter(spec_ckpt / "dspark", fast_target)
    assert isinstance(fast, FastDSparkDrafter) and not isinstance(drafter, FastDSparkDrafter)
    W = drafter.config.sliding_window
    t = torch.tensor([0, 5, W - 2, 2 * W + 9])
    cache = drafter.new_cache(4, 3 * W)
    g = torch.Generator().manual_seed(1)
    for layer in range(len(cache.k)):
        cache.k[layer].copy_(torch.randn(cache.k[layer].shape, generator=g))
        cache.v[layer].copy_(torch.randn(cache.v[layer].shape, generator=g))
    cache.rollback(t.tolist())
    anchors = torch.tensor([7, 11, 13, 17])
    with torch.no_grad():
        want, got = (d.block_hidden(model, cache, anchors, t) for d in (drafter, fast))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    a = drafter.draft(model, cache, anchors, t, drafter.block_size, GREEDY, None)
    b = fast.draft(model, cache, anchors, t, drafter.block_size, GREEDY, None)
    assert torch.equal(a.tokens, b.tokens)


def test_sliding_window_edge(model, drafter):
    """A block query at position q sees context keys p >= q - (W - 1): the block starts at t, so slot
    t - W is outside every query's window and slot t - W + 1 is inside the first query's."""
    W, t = drafter.config.sliding_window, 100
    cache = drafter.new_cache(1, 128)
    g = torch.Generator().manual_seed(0)
    for layer in range(len(cache.k)):
        cache.k[layer][:, :t] = torch.randn(cache.k[layer][:, :t].shape, generator=g)
        cache.v[layer][:, :t] = torch.randn(cache.v[layer][:, :t].shape, generator=g)
    anchors, positions = torch.tensor([7]), torch.tensor([t])
    base = drafter.block_hidden(model, cache, anchors, positions)

    def perturbed(slot: int) -> torch.Tensor:
        saved = [(k[:, slot].clone(), v[:, slot].clone()) for k, v in zip(cache.k, cache.v)]
        for k, v in zip(cache.k, cache.v):
            k[:, slot] += 3.0
            v[:, slot] += 3.0
        out = drafter.block_hidden(model, cache, anchors, positions)
        for (k, v), (k0, v0) in zip(zip(cache.k, cache.v), saved):
            k[:, slot], v[:, slot] = k0, v0
        return out

    assert torch.equal(perturbed(t - W), base)
    assert torch.equal(perturbed(t), base)  # not a committed context row yet
    assert not torch.allclose(perturbed(t - W + 1), base)
    assert not torch.allclose(perturbed(t - 1), base)


def test_drafter_loader_refuses_embedding_and_lm_head(spec_ckpt, model, tmp_path):
    d = tmp_path / "dspark"
    shutil.copytree(spec_ckpt / "dspark", d)
    V, H = model.text.vocab_size, model.text.hidden_size
    save_file({PREFIX + "embed_tokens.weight": torch.zeros(V, H, dtype=torch.bfloat16),
               "language_model.lm_head.weight": torch.zeros(V, H, dtype=torch.bfloat16)},
              str(d / "extra.safetensors"), metadata={"format": "pt"})
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"].update({PREFIX + "embed_tokens.weight": "extra.safetensors",
                                "language_model.lm_head.weight": "extra.safetensors"})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="carries its own embedding / LM head") as e:
        load_drafter(d, model)
    assert len(e.value.problems) == 2
    assert any("embed_tokens" in p and "embedding" in p for p in e.value.problems)
    assert any("lm_head" in p and "LM head" in p for p in e.value.problems)


@pytest.mark.parametrize("edit,needle", [
    ({"rotary_dim": 15}, r"rotary_dim=15 must be even"),
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, r"num_key_value_heads=4 must divide num_attention_heads=6"),
    ({"dspark_target_layer_ids": []}, r"dspark_target_layer_ids=\[\] must be a non-empty list"),
])
def test_drafter_configs_it_cannot_run_are_refused_naming_the_field(spec_ckpt, model, tmp_path, edit, needle):
    d = tmp_path / "dspark"
    shutil.copytree(spec_ckpt / "dspark", d)
    raw = json.loads((d / "config.json").read_text())
    raw["text_config"].update(edit)
    raw.update({k: v for k, v in edit.items() if k in raw})  # the top-level copies must agree
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=needle):
        load_drafter(d, model)


def test_synthetic_drafter_refuses_zero_sizes(model):
    from minimax_ref.weights.synth import drafter_config_json

    for kw in ({"block_size": 0}, {"num_layers": 0}, {"sliding_window": 0}, {"markov_rank": 0}):
        with pytest.raises(ConfigError):  # not silently the default
            drafter_config_json(model.config, **kw)


def test_drafter_loader_reports_every_missing_tensor(spec_ckpt, model, tmp_path):
    d = tmp_path / "dspark"
    shutil.copytree(spec_ckpt / "dspark", d)
    drop = [PREFIX + "markov_head.markov_w2.weight", PREFIX + "layers.1.decoder_layer.mlp.down_proj.weight_scale_inv",
            PREFIX + "final_norm.weight"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = d / index["weight_map"][drop[0]]
    tensors = load_file(str(shard))
    save_file({k: v for k, v in tensors.items() if k not in drop}, str(shard), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in drop}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="3 problems") as e:
        load_drafter(d, model)
    for name in drop:
        assert any(name in p and "missing" in p for p in e.value.problems), name


def test_drafter_tensors_follow_the_release_layout(spec_ckpt):
    index = json.loads((spec_ckpt / "dspark" / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    assert all(n.startswith(PREFIX) for n in names)
    # fc, hidden/final norm, markov w1/w2, confidence weight/bias, and per layer 4 norms + 7 fp8 weights
    # with their 7 scales: 97 tensors with the release's 5 layers, 43 with the tiny drafter's 2
    assert len(names) == 7 + 2 * 18 and 7 + 5 * 18 == 97
    q_proj = PREFIX + "layers.0.decoder_layer.self_attn.q_proj.weight"
    tensors = load_file(str(spec_ckpt / "dspark" / index["weight_map"][q_proj]))
    assert tensors[q_proj].dtype == torch.float8_e4m3fn
    assert tensors[q_proj + "_scale_inv"].dtype == torch.uint8
    assert tensors[PREFIX + "fc.weight"].dtype == torch.bfloat16


def test_release_drafter_table_matches_the_spec():
    from minimax_ref.generation.drafter import drafter_tensor_table
    from minimax_ref.model.config import parse_drafter_config, parse_model_config
    from minimax_ref.weights.synth import build_config, drafter_config_json

    target = parse_model_config(build_config("release", "nvfp4"))
    cfg = parse_drafter_config(drafter_config_json(target), target.text)
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.target_layer_ids, cfg.sliding_window, cfg.noise_token_id,
            cfg.markov_rank, cfg.intermediate_size) == (5, 7, (3, 17, 31, 45, 59), 4096, 200058, 256, 12288)
    linears, plain = drafter_tensor_table(cfg)
    shapes = {n[len(PREFIX):]: s.shape for n, s in plain.items()}
    shapes.update({n[len(PREFIX):]: (s.out_features, s.in_features) for n, s in linears.items()})
    assert shapes["fc"] == (6144, 30720) and shapes["confidence_head.proj.weight"] == (1, 6400)
    assert shapes["markov_head.markov_w2.weight"] == (200064, 256)
    assert shapes["layers.4.decoder_layer.self_attn.q_proj"] == (8192, 6144)
    assert shapes["layers.4.decoder_layer.self_attn.k_proj"] == (512, 6144)
    assert shapes["layers.4.decoder_layer.mlp.down_proj"] == (6144, 12288)
    fp8 = [n for n in linears if not n.endswith(".fc")]
    assert len(plain) + len(linears) + len(fp8) == 97  # each fp8 weight has its scale


# ---------------------------------------------------------------------------------------------- sampling


def test_sampled_generation_with_the_drafter_is_seeded(model, drafter):
    prompts = _prompts(30, 9)
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=40)
    a, stats = speculative_generate_ids(model, drafter, prompts, max_new_tokens=12, sampling=params, seed=3)
    b, _ = speculative_generate_ids(model, drafter, prompts, max_new_tokens=12, sampling=params, seed=3)
    assert [s.generated for s in a] == [s.generated for s in b]
    assert all(len(s.generated) == 12 for s in a) and stats.mean_accepted_length >= 1.0
    none, _ = speculative_generate_ids(model, drafter, prompts, max_new_tokens=0, sampling=params)
    assert [(s.generated, s.finish_reason) for s in none] == [([], "length")] * 2


def test_accept_greedy():
    assert accept_greedy(torch.tensor([3, 4, 5]), torch.tensor([3, 4, 9, 1])) == (2, 9)
    assert accept_greedy(torch.tensor([3, 4, 5]), torch.tensor([3, 4, 5, 1])) == (3, 1)
    assert accept_greedy(torch.tensor([], dtype=torch.long), torch.tensor([8])) == (0, 8)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 4))
def test_accept_drafts_invariants(seed, K):
    g = torch.Generator().manual_seed(seed)
    V = 6
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 2, -1)
    p[:, int(torch.randint(V, (1,), generator=g))] = 0  # a token the target never emits
    p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(torch.randn(K, V, generator=g) * 2, -1)
    drafts = torch.multinomial(q, 1, generator=g).squeeze(-1)
    u = torch.rand(K + 1, generator=g)
    j, tok = accept_drafts(drafts, q, p, u)
    assert 0 <= j <= K and p[j, tok] > 0  # never emits what the target cannot
    assert all(p[i, drafts[i]] > 0 for i in range(j))
    if j < K:  # a residual sample: where the target has more mass than the drafter, never the draft
        assert p[j, tok] > q[j, tok] and tok != drafts[j]
    # a draft distribution equal to the target's accepts every draft it can propose
    assert accept_drafts(drafts, p[:K], p, u)[0] == K or any(p[i, drafts[i]] == 0 for i in range(K))


def _accept_q_over_p(drafts, q, p, u):  # wrong: accepts with min(1, q/p)
    for i in range(drafts.shape[0]):
        d = int(drafts[i])
        qi = q[i] if q is not None else torch.nn.functional.one_hot(drafts[i], p.shape[-1]).float()
        if float(u[i]) * float(p[i, d]) < float(qi[d]):
            continue
        r = (p[i] - qi).clamp(min=0)
        return i, sample_inverse_cdf(r / r.sum(), u[-1])
    return drafts.shape[0], sample_inverse_cdf(p[-1], u[-1])


def _accept_unnormalised_residual(drafts, q, p, u):  # wrong: residual max(0, p - q) not renormalised
    for i in range(drafts.shape[0]):
        d = int(drafts[i])
        qi = q[i] if q is not None else torch.nn.functional.one_hot(drafts[i], p.shape[-1]).float()
        if float(u[i]) * float(qi[d]) < float(p[i, d]):
            continue
        return i, sample_inverse_cdf((p[i] - qi).clamp(min=0), u[-1])
    return drafts.shape[0], sample_inverse_cdf(p[-1], u[-1])


def _accept_resample_from_p(drafts, q, p, u):  # wrong: resamples from p instead of the residual
    for i in range(drafts.shape[0]):
        d = int(drafts[i])
        qi = q[i] if q is not None else torch.nn.functional.one_hot(drafts[i], p.shape[-1]).float()
        if float(u[i]) * float(qi[d]) < float(p[i, d]):
            continue
        return i, sample_inverse_cdf(p[i], u[-1])
    return drafts.shape[0], sample_inverse_cdf(p[-1], u[-1])


WRONG_RULES = {"q_over_p": _accept_q_over_p, "unnormalised_residual": _accept_unnormalised_residual,
               "resample_from_p": _accept_resample_from_p}


def _first_token_distribution(rule, p: torch.Tensor, q: torch.Tensor, M: int = 400) -> torch.Tensor:
    """The exact distribution of the first emitted token for one draft d ~ q, by midpoint quadrature
    over the two uniforms: the first decides acceptance, the second the token emitted on rejection."""
    V = p.shape[-1]
    grid = (torch.arange(M, dtype=torch.float64) + 0.5) / M
    out = torch.zeros(V, dtype=torch.float64)
    for d in range(V):
        if q[0, d] == 0:
            continue
        drafts, accepted, rejecting_u0 = torch.tensor([d]), 0, None
        for u0 in grid:
            if rule(drafts, q, p, torch.tensor([u0, 0.5]))[0] == 1:
                accepted += 1
            else:
                rejecting_u0 = u0
        out[d] += q[0, d] * accepted / M
        if rejecting_u0 is not None:
            for u1 in grid:
                _, tok = rule(drafts, q, p, torch.tensor([rejecting_u0, u1]))
                out[tok] += q[0, d] * (M - accepted) / M / M
    return out


def test_accept_drafts_emits_the_target_distribution():
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.5, 0.0, 0.2, 0.2]], dtype=torch.float64)
    got = _first_token_distribution(accept_drafts, p, q)
    assert (got - p[0]).abs().max() < 0.01, got
    for name, rule in WRONG_RULES.items():
        wrong = _first_token_distribution(rule, p, q)
        assert (wrong - p[0]).abs().max() > 0.05, name


class _ToyCache:
    def rollback(self, lengths) -> None:
        pass

    def rows(self, start, stop) -> _ToyCache:
        return self


class ToyTarget:
    """A Markov chain over V tokens behind the model interface: logits at a position are log P[token]."""

    def __init__(self, logits: torch.Tensor):
        self.table = logits
        self.text = SimpleNamespace(vocab_size=logits.shape[0], max_position_embeddings=4096)
        self.device = torch.device("cpu")

    def new_cache(self, batch_size, max_len, kv_cache_dtype="auto"):
        return _ToyCache()

    def __call__(self, ids, *, positions=None, cache=None, trace=None, inputs_embeds=None, logit_index=None):
        logits = self.table[ids]
        if logit_index is not None:  # MiniMaxM3.forward's contract: one position per row
            logits = logits[torch.arange(ids.shape[0]), logit_index][:, None]
        return logits

    def step_with_hidden(self, ids, positions, cache, layers):
        return self(ids, positions=positions, cache=cache), {}


class ToyDrafter:
    """Drafts from a different Markov chain (sampled from q after the same filtering, each row with its own setting
    and generator, or greedy)."""

    block_size = 2
    capture_layer_ids: set[int] = set()

    def __init__(self, logits: torch.Tensor, point_mass: bool):
        self.table, self.point_mass = logits, point_mass

    def new_cache(self, batch_size, max_len):
        return _ToyCache()

    def add_context(self, target, cache, hidden, positions) -> None:
        pass

    def draft(self, target, cache, anchors, positions, num_tokens, sampling, generator) -> Draft:
        prev, tokens, probs = anchors, [], []
        for _ in range(num_tokens):
            z = self.table[prev]
            if self.point_mass:
                d = z.argmax(-1)
            else:
                d, q = sampling.sample(z)
                probs.append(q)
            tokens.append(d)
            prev = d
        return Draft(torch.stack(tokens, 1), None if self.point_mass else torch.stack(probs, 1))


def _chi2_threshold(df: int, z: float = 4.0) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at a normal z-score (z = 4: p ~ 3e-5)."""
    a = 2.0 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def _toy_statistic(rule, point_mass: bool, rows: int = 4000) -> float:
    """Worst excess of a chi-square statistic over its p ~ 3e-5 quantile, over the joint distributions
    of consecutive pairs and triples of the first four generated tokens (y1 from the prefill, the rest
    from speculative steps); > 0 means the samples are inconsistent with the target's exact
    distribution."""
    V = 5
    g = torch.Generator().manual_seed(1)
    target_logits = torch.randn(V, V, generator=g) * 1.5
    draft_logits = torch.randn(V, V, generator=g) * 1.5
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=4)
    target, drafter = ToyTarget(target_logits), ToyDrafter(draft_logits, point_mass)
    out, stats = speculative_generate_ids(target, drafter, [[2]] * rows, max_new_tokens=4, sampling=params, seed=7,
                                          accept_fn=rule, max_batch_size=rows, prefill_chunk=8)
    assert stats.steps > 0 and 1.0 < stats.mean_accepted_length < 3.0
    ys = torch.tensor([s.generated for s in out])  # [rows, 4]
    P = filtered_probs(target_logits, params).double()  # row-stochastic transition matrix

    def excess(joint: torch.Tensor, columns: list[int]) -> float:
        counts = torch.zeros_like(joint)
        counts.index_put_(tuple(ys[:, c] for c in columns), torch.ones(rows, dtype=torch.float64), accumulate=True)
        expected = joint * rows
        if bool((counts[expected == 0] > 0).any()):
            return math.inf  # a token sequence the target can never produce
        # the usual chi-square hygiene: cells expecting fewer than 5 samples are pooled into one
        big, small = expected >= 5, (expected > 0) & (expected < 5)
        obs = torch.cat((counts[big], counts[small].sum().reshape(1)))
        exp = torch.cat((expected[big], expected[small].sum().reshape(1)))
        obs, exp = obs[exp > 0], exp[exp > 0]
        return float(((obs - exp) ** 2 / exp).sum()) - _chi2_threshold(obs.numel() - 1)

    # exact joints of consecutive tokens: P(y_n = a, y_n+1 = b) and P(y_n = a, y_n+1 = b, y_n+2 = c)
    marginals = [P[2], P[2] @ P, P[2] @ P @ P]
    pairs = [excess(marginals[n][:, None] * P, [n, n + 1]) for n in range(3)]
    triples = [excess(marginals[n][:, None, None] * P[:, :, None] * P[None], [n, n + 1, n + 2]) for n in range(2)]
    return max(pairs + triples)


@pytest.mark.parametrize("point_mass", [False, True], ids=["sampled-drafts", "greedy-drafts"])
def test_sampling_is_lossless_on_a_toy_chain(point_mass):
    assert _toy_statistic(accept_drafts, point_mass) < 0


@pytest.mark.parametrize("rule", sorted(WRONG_RULES))
def test_wrong_acceptance_rules_fail_the_same_check(rule):
    assert _toy_statistic(WRONG_RULES[rule], point_mass=False) > 0


# ---------------------------------------------------------------------------------------------- API / CLI


def test_generate_api_with_draft(model, spec_ckpt, drafter):
    tok = mr.load_tokenizer(spec_ckpt)
    assert tok.special_ids.dspark_noise == drafter.config.noise_token_id
    kw = {"max_new_tokens": 10, "temperature": 0}
    plain = mr.generate(model, tok, ["Hello world", "A longer prompt"], **kw)
    spec = mr.generate(model, tok, ["Hello world", "A longer prompt"], draft="dspark", num_speculative_tokens=2, **kw)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert spec[0].stats["mean_accepted_length"] >= 1.0 and spec[0].stats["num_speculative_tokens"] == 2
    with pytest.raises(InputError, match="num_speculative_tokens"):
        mr.generate(model, tok, ["x"], draft=drafter, num_speculative_tokens=drafter.block_size + 1, **kw)
    with pytest.raises(InputError, match="needs a drafter"):
        mr.generate(model, tok, ["x"], num_speculative_tokens=2, **kw)


def test_cli_synth_drafter_and_speculative_json(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["synth", "--preset", "tiny", "--format", "nvfp4", "--out", str(out), "--drafter"]) == 0
    assert (out / "dspark" / "config.json").is_file()
    base = ["generate", "--ckpt-path", str(out), "--prompt", "Hello", "--prompt", "The weather in Lisbon is",
            "--max-new-tokens", "9", "--temperature", "0", "--output-format", "json", "--dtype", "float32"]
    capsys.readouterr()
    assert main(base) == 0
    plain = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for extra in ([], ["--num-speculative-tokens", "2", "--drafter-capture", "post-norm"]):
        assert main(base + ["--speculative", "dspark"] + extra) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [r["token_ids"] for r in rows] == [r["token_ids"] for r in plain]
        for r in rows:
            assert r["stats"]["mean_accepted_length"] >= 1.0
            assert len(r["stats"]["acceptance_rate_per_position"]) == (int(extra[1]) if extra else 4)
    assert main(base + ["--num-speculative-tokens", "2"]) == 2
    assert "need --speculative dspark" in capsys.readouterr().err
