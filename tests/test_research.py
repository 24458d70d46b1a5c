"""The research API: interventions against independent computations (a pruned checkpoint, the layer recomputed by
hand, another input's stream), the Trace's shapes, padding mask, range checks and logit lens, `mr.score` and its
input checks, the short config repr and the sequence-length limit."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

import minimax_ref as mr
from minimax_ref.errors import InputError
from minimax_ref.fast import apply
from minimax_ref.model.mlp import swiglu_oai
from minimax_ref.research.score import ScoreTrace, score_traces
from minimax_ref.research.trace import Interventions, Trace
from minimax_ref.weights.loader import load_model
from minimax_ref.weights.prune import write_pruned

MOE_LAYERS = (1, 2, 3)  # the tiny preset: layer 0 dense, 1..3 MoE with 16 experts, top 4
KEPT = list(range(0, 16, 2))


def _ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 1000, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model(tiny_nvfp4):
    return load_model(tiny_nvfp4, dtype=torch.float32)


@pytest.fixture(scope="module")
def pruned_path(tiny_nvfp4, tmp_path_factory):
    out = tmp_path_factory.mktemp("research-pruned") / "p"
    return write_pruned(tiny_nvfp4, out, {L: KEPT for L in MOE_LAYERS}, "test")


@pytest.fixture(scope="module")
def pruned_model(pruned_path):
    return load_model(pruned_path, dtype=torch.float32)


# ------------------------------------------------------------------------------------------ interventions


@torch.no_grad()
def test_expert_mask_equals_the_pruned_checkpoint(model, pruned_model):
    mask = torch.zeros(16, dtype=torch.bool)
    mask[KEPT] = True
    ids = _ids(80, seed=1, batch=2)  # past the 4 x 16-token MSA budget: the sparse path too
    masked = model(ids, interventions=Interventions(expert_mask={L: mask for L in MOE_LAYERS}))
    torch.testing.assert_close(masked, pruned_model(ids), rtol=0, atol=1e-5)
    assert not torch.allclose(masked, model(ids), atol=1e-3)  # the mask changed something
    # and routing never picks a masked expert
    tr = Trace(interventions=Interventions(expert_mask={2: mask}))
    model(ids, trace=tr)
    assert bool(mask[tr.routing[2].expert_ids].all())


def _layer_by_hand(layer, x: torch.Tensor, scale: dict[int, float], model) -> torch.Tensor:
    """Decoder layer on x [B, T, H] with each expert's output scaled, from its parts: the routing recomputed
    from the router's weights, each chosen expert's SwiGLU from its stacked weights, summed per token."""
    T = x.shape[1]
    pos = torch.arange(T).expand(x.shape[0], T)
    cos, sin = model.rope(pos)
    h = x + layer.self_attn(layer.input_layernorm(x), pos, cos, sin)
    moe = layer.block_sparse_moe
    flat = layer.post_attention_layernorm(h).reshape(-1, h.shape[-1])
    probs = torch.sigmoid(flat.float() @ moe.gate.weight.float().T)
    chosen = torch.topk(probs + moe.gate.e_score_correction_bias, moe.gate.top_k, dim=-1).indices
    w = probs.gather(-1, chosen)
    w = w / w.sum(-1, keepdim=True)
    ex = moe.experts
    y = torch.zeros(flat.shape, dtype=torch.float64)
    for t in range(flat.shape[0]):
        for j in range(chosen.shape[1]):
            e = int(chosen[t, j])
            g, u = ex.weight("w1", e) @ flat[t], ex.weight("w3", e) @ flat[t]
            out = ex.weight("w2", e) @ swiglu_oai(g, u, ex.alpha, ex.limit)
            y[t] += float(w[t, j]) * scale.get(e, 1.0) * out.double()
    y = moe.scaling * y + moe.shared_experts(flat).double()
    return h + y.float().reshape(h.shape)


@pytest.mark.parametrize("factor", [0.0, 2.5])
@torch.no_grad()
def test_expert_scale_equals_the_layer_by_hand(model, factor):
    ids = _ids(12, seed=2)
    tr = Trace(interventions=Interventions(expert_scale={2: {3: factor, 7: factor}}))
    model(ids, trace=tr)
    expected = _layer_by_hand(model.layers[2], tr.hidden_states[1], {3: factor, 7: factor}, model)
    torch.testing.assert_close(tr.hidden_states[2], expected, rtol=1e-5, atol=1e-5)
    assert {3, 7} & set(tr.routing[2].expert_ids.flatten().tolist())  # the edit had something to act on


@torch.no_grad()
def test_scale_one_and_no_interventions_change_nothing(model):
    ids = _ids(20, seed=3)
    plain = model(ids)
    assert torch.equal(model(ids, interventions=Interventions()), plain)
    assert torch.equal(model(ids, interventions=Interventions(expert_scale={1: {0: 1.0}})), plain)


@torch.no_grad()
def test_residual_replacement_is_the_other_inputs_stream(model):
    a, b = _ids(30, seed=4), _ids(30, seed=5)
    tb = Trace(components=True)
    logits_b = model(b, trace=tb)
    # every later layer reads only layer 1's output: replacing it with b's makes the whole run b's
    out = model(a, interventions=Interventions(residual={1: tb.hidden_states[1]}))
    assert torch.equal(out, logits_b)
    # the residual after attention: b's (layer 1's input plus its attention output) gives b's run as well
    h_b = tb.hidden_states[0] + tb.attention_output[1]
    out = model(a, interventions=Interventions(attention_residual={1: h_b}))
    torch.testing.assert_close(out, logits_b, rtol=0, atol=1e-5)
    # a function of the stream: the identity changes nothing, and it sees the stream
    seen = []
    out = model(a, interventions=Interventions(residual={2: lambda h: seen.append(h.shape) or h}))
    assert torch.equal(out, model(a)) and seen == [torch.Size([1, 30, model.text.hidden_size])]


@torch.no_grad()
def test_components_sum_to_the_stream(model):
    tr = Trace(components=True)
    model(_ids(10, seed=6), trace=tr)
    for L in range(1, 4):
        torch.testing.assert_close(tr.hidden_states[L],
                                   tr.hidden_states[L - 1] + tr.attention_output[L] + tr.ffn_output[L])


@torch.no_grad()
def test_fast_twins_apply_the_same_interventions(tiny_nvfp4):
    m = load_model(tiny_nvfp4, dtype=torch.float32)
    mask = torch.ones(16, dtype=torch.bool)
    mask[:5] = False
    ids = _ids(3, seed=7, batch=2)  # a few tokens: the sync-free expert path
    iv = Interventions(expert_mask={1: mask}, expert_scale={3: {2: 0.0}},
                       msa_blocks={2: torch.zeros(2, 2, 3, 1, dtype=torch.long)})  # FastAttention defers to these
    ref = m(ids, interventions=iv)
    apply(m, True)
    try:
        torch.testing.assert_close(m(ids, interventions=iv), ref, rtol=1e-5, atol=1e-5)
    finally:
        apply(m, False)


GEN_PROMPTS = [list(range(5, 5 + n)) for n in (7, 40, 90)]  # 90 tokens: the MSA layers select blocks in prefill


def _greedy(model, tok, **kw) -> list[list[int]]:
    out = mr.generate(model, tok, GEN_PROMPTS, max_new_tokens=20, temperature=0, max_batch_size=2, stop_ids=[], **kw)
    return [r.token_ids for r in out]


@pytest.mark.parametrize("fast", [False, True])
def test_generation_with_an_expert_mask_equals_the_pruned_checkpoint(tiny_nvfp4, pruned_model, fast):
    """Greedy tokens under the mask (prefill and every cached decode step edited; with the fast twins too) are the
    pruned checkpoint's, and differ from the unmasked model's."""
    m = load_model(tiny_nvfp4, dtype=torch.float32, fast=fast)
    tok = mr.load_tokenizer(tiny_nvfp4)
    mask = torch.zeros(16, dtype=torch.bool)
    mask[KEPT] = True
    masked = _greedy(m, tok, interventions=Interventions(expert_mask={L: mask for L in MOE_LAYERS}))
    assert masked == _greedy(pruned_model, tok)
    assert masked != _greedy(m, tok)


def test_speculative_generation_under_a_mask_equals_plain(spec_ckpt):
    """DSpark verify steps carry the interventions too: greedy speculative tokens under a mask are the plain loop's
    under the same mask."""
    m = load_model(spec_ckpt, dtype=torch.float32)
    tok = mr.load_tokenizer(spec_ckpt)
    mask = torch.zeros(16, dtype=torch.bool)
    mask[KEPT] = True
    iv = Interventions(expert_mask={L: mask for L in MOE_LAYERS})
    plain = _greedy(m, tok, interventions=iv)
    assert _greedy(m, tok, interventions=iv, draft="dspark") == plain
    assert plain != _greedy(m, tok)


def test_generate_command_takes_the_pruning_as_a_mask(tiny_nvfp4, pruned_path, capsys):
    """`generate --expert-mask pruning.json` on the full checkpoint writes the pruned checkpoint's greedy tokens;
    `--drop-experts` naming the same experts does too."""
    import json

    from minimax_ref.cli.main import main

    flags = ["--prompt", "hello world", "--prompt", "the quick brown fox", "--temperature", "0",
             "--max-new-tokens", "12", "--output-format", "json"]

    def tokens(*argv) -> list:
        assert main(["generate", *argv, *flags]) == 0
        return [json.loads(x)["token_ids"] for x in capsys.readouterr().out.splitlines()]

    pruned = tokens("--ckpt-path", str(pruned_path))
    assert tokens("--ckpt-path", str(tiny_nvfp4), "--expert-mask", str(pruned_path / "pruning.json")) == pruned
    dropped = ",".join(str(e) for e in range(16) if e not in KEPT)
    drops = [x for L in MOE_LAYERS for x in ("--drop-experts", f"{L}:{dropped}")]
    assert tokens("--ckpt-path", str(tiny_nvfp4), *drops) == pruned
    assert tokens("--ckpt-path", str(tiny_nvfp4)) != pruned


def test_generation_under_a_steering_function_is_the_edited_full_forward(model, tiny_nvfp4):
    """A residual edit given as a function applies to every forward of the generation: each greedy token is the
    argmax of the edited model's full forward over the sequence so far."""
    tok = mr.load_tokenizer(tiny_nvfp4)
    shift = torch.randn(model.text.hidden_size, generator=torch.Generator().manual_seed(3))
    iv = Interventions(residual={1: lambda h: h + shift}, expert_scale={2: {0: 0.0, 5: 3.0}})
    out = mr.generate(model, tok, [GEN_PROMPTS[1]], max_new_tokens=8, temperature=0, stop_ids=[], interventions=iv)
    seq = list(GEN_PROMPTS[1])
    with torch.no_grad():
        for token in out[0].token_ids:
            assert int(model(torch.tensor([seq]), interventions=iv)[0, -1].argmax()) == token
            seq.append(token)


@pytest.mark.parametrize("iv,needle", [
    (Interventions(residual={1: torch.zeros(1, 7, 64)}), "interventions.residual[1] is a tensor"),
    (Interventions(msa_blocks={2: torch.zeros(1, 2, 7, 1, dtype=torch.long)}), "interventions.msa_blocks[2]"),
    (Interventions(expert_mask={0: torch.ones(16, dtype=torch.bool)}), "layer 0 has a dense MLP"),
    ("expert_mask", "expected a minimax_ref.Interventions"),
])
def test_generation_refuses_interventions_it_cannot_apply(model, tiny_nvfp4, iv, needle):
    with pytest.raises(InputError) as e:
        mr.generate(model, mr.load_tokenizer(tiny_nvfp4), [[1, 2, 3]], max_new_tokens=2, interventions=iv)
    assert needle in str(e.value)


@torch.no_grad()
def test_fast_twins_keep_the_hook_points(tiny_nvfp4):
    """The fast twins call the same selection module, so a trace on a fast model records the indexer's blocks,
    the routing and the streams; a recorded attention core runs the reference forward of its layer."""
    m = load_model(tiny_nvfp4, dtype=torch.float32)
    ids = _ids(40, seed=8, batch=2)
    ref = Trace(components=True, attention_layers={2})
    want = m(ids, trace=ref)
    apply(m, True)
    try:
        tr = Trace(components=True, attention_layers={2})
        torch.testing.assert_close(m(ids, trace=tr), want, rtol=1e-5, atol=1e-5)
    finally:
        apply(m, False)
    assert sorted(tr.blocks) == sorted(ref.blocks) and tr.blocks
    for L in ref.blocks:
        assert torch.equal(tr.blocks[L], ref.blocks[L])
    assert sorted(tr.routing) == sorted(ref.routing) and sorted(tr.hidden_states) == sorted(ref.hidden_states)
    assert torch.equal(tr.attention[2]["blocks"], ref.attention[2]["blocks"])
    for name in ("q", "k", "v", "o", "iq", "ik"):  # the layers before it ran fast: equal to fp32 rounding
        torch.testing.assert_close(tr.attention[2][name], ref.attention[2][name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("iv,needle", [
    (Interventions(expert_mask={0: torch.ones(16, dtype=torch.bool)}), "dense MLP"),
    (Interventions(expert_mask={9: torch.ones(16, dtype=torch.bool)}), "not a layer index"),
    (Interventions(expert_mask={1: torch.ones(15, dtype=torch.bool)}), "bool tensor [16]"),
    (Interventions(expert_mask={1: torch.arange(16) < 3}), "keeps 3 experts"),
    (Interventions(expert_scale={1: {16: 0.0}}), "not in [0, 16)"),
    (Interventions(residual={1: torch.zeros(1, 3, 4)}), "the replacement is (1, 3, 4)"),
    (Interventions(residual={1: 3.0}), "residual[1] must be a tensor [B, T, H] or a function"),
    (Interventions(expert_scale={1: [1, 2]}), "expert_scale[1] must be a dict {expert id: factor}, got list"),
    (Interventions(expert_scale={1: {0: "x"}}), "expert_scale[1][0] = 'x': a factor must be a finite number"),
    (Interventions(expert_scale={1: {0: float("nan")}}), "expert_scale[1][0] = nan"),
    (Interventions(expert_scale={1: {True: 0.5}}), "expert ids [True] are not in"),
    (Interventions(expert_mask={True: torch.ones(16, dtype=torch.bool)}), "layer True is not a layer index"),
    (Interventions(expert_mask=[torch.ones(16, dtype=torch.bool)]), "expert_mask: expected a dict"),
])
def test_bad_interventions_are_input_errors(model, iv, needle):
    with pytest.raises(InputError, match="interventions") as e:
        model(_ids(5), interventions=iv)
    assert needle in str(e.value)


# ------------------------------------------------------------------------------------------ Trace


def _alone(model, ids: list[int], **settings) -> Trace:
    """The trace of one sequence run alone (no padding, no batching)."""
    tr = Trace(**settings)
    model(torch.tensor([ids]), trace=tr)
    return tr


@torch.no_grad()
def test_routing_has_no_padding_rows(model):
    pairs = [{"input_ids": _ids(n, seed=n)[0].tolist(), "completion_start": 2} for n in (9, 20, 14)]
    tr = Trace()
    mr.score(model, None, pairs, trace=tr, batch_size=2)
    assert tr.shape == (3, 20) and tr.mask.sum(1).tolist() == [9, 20, 14]
    assert tr.routing[2].expert_ids.shape == (43, 4) and tr.routing[2].logits.shape == (43, 16)
    expected_counts = torch.zeros(16, dtype=torch.long)
    expected_mass = torch.zeros(16, dtype=torch.float64)
    for b, p in enumerate(pairs):
        alone = _alone(model, p["input_ids"], layers=set()).routing[2]
        r = tr.routed(2, b)  # sequence b's real tokens, in order
        assert torch.equal(r.expert_ids, alone.expert_ids)
        torch.testing.assert_close(r.weights, alone.weights, rtol=0, atol=1e-6)
        expected_counts += torch.bincount(alone.expert_ids.flatten(), minlength=16)
        for t in range(alone.expert_ids.shape[0]):  # the mass by hand: each chosen expert gets its weight
            for j in range(4):
                expected_mass[int(alone.expert_ids[t, j])] += float(alone.weights[t, j])
    assert torch.equal(tr.expert_counts(2), expected_counts) and int(expected_counts.sum()) == 43 * 4
    torch.testing.assert_close(tr.routed_mass(2), expected_mass, rtol=0, atol=1e-5)
    assert float(tr.routed_mass(2).sum()) == pytest.approx(43, abs=1e-4)  # one unit of weight per token
    with pytest.raises(InputError, match=r"padding \(17 of 60 positions\).*routed\(2, b\)"):
        tr.routed(2)
    with pytest.raises(InputError, match="b must be a sequence index in"):
        tr.routed(2, 3)
    # a batch without padding keeps the [B, T, k] view
    full = _alone(model, pairs[0]["input_ids"])
    assert full.routed(2).expert_ids.shape == (1, 9, 4)


@torch.no_grad()
def test_batched_capture_equals_each_sequence_alone(model):
    """Records merged over batches of 2: every real position holds what the sequence computes alone, padding holds
    zeros (streams) and -1 (blocks)."""
    seqs = [_ids(n, seed=40 + n)[0].tolist() for n in (70, 9, 40)]
    tr = Trace(components=True)
    tr.capture(model, seqs, batch_size=2)
    assert tr.shape == (3, 70) and tr.mask.sum(1).tolist() == [70, 9, 40]
    for b, ids in enumerate(seqs):
        n = len(ids)
        alone = _alone(model, ids, components=True)
        for L in (0, 3):
            torch.testing.assert_close(tr.hidden_states[L][b, :n], alone.hidden_states[L][0], rtol=0, atol=1e-5)
            assert not tr.hidden_states[L][b, n:].any() and not tr.ffn_output[L][b, n:].any()
        kb = alone.blocks[2].shape[-1]
        assert torch.equal(tr.blocks[2][b, :, :n, :kb], alone.blocks[2][0])
        assert bool((tr.blocks[2][b, :, :n, kb:] == -1).all()) and bool((tr.blocks[2][b, :, n:] == -1).all())
    with pytest.raises(InputError, match="batch_size=0"):
        tr.capture(model, seqs, batch_size=0)
    blocks = Interventions(msa_blocks={2: tr.blocks[2]})
    with pytest.raises(InputError, match=r"msa_blocks\[2\] is a tensor of one forward's shape.*batch_size=3"):
        Trace(interventions=blocks).capture(model, seqs, batch_size=2)


@torch.no_grad()
def test_batched_score_equals_unbatched(model):
    pairs = [{"input_ids": _ids(n, seed=20 + n)[0].tolist(), "completion_start": s}
             for n, s in ((30, 5), (12, 11), (50, 3), (7, 1))]
    one = mr.score(model, None, pairs, trace=Trace(layers=set()), batch_size=1)
    for batch in (3, 4):
        many = mr.score(model, None, pairs, trace=Trace(layers=set()), batch_size=batch)
        for a, b in zip(one.per_trace, many.per_trace):
            torch.testing.assert_close(a.nll, b.nll, rtol=0, atol=1e-5)
            assert torch.equal(a.argmax, b.argmax)
    cached = mr.score(model, None, pairs, batch_size=3, prefill_chunk=16)
    for a, b in zip(one.per_trace, cached.per_trace):
        torch.testing.assert_close(a.nll, b.nll, rtol=0, atol=1e-4)


def _probabilities_by_hand(rec: dict, b: int, h: int, t: int) -> torch.Tensor:
    """Row t of query head h's attention weights over the keys, in float64, from the record as README documents it:
    q and k already rotated, key slot j = position j, kv head h // G, keys at or before the query and (MSA) in one of
    its kv head's blocks."""
    q, k = rec["q"].double(), rec["k"].double()
    G = q.shape[2] // k.shape[2]
    pos = int(rec["q_pos"][b, t])
    keys = [j for j in range(k.shape[1]) if j <= pos]
    if "blocks" in rec:
        chosen = {int(x) for x in rec["blocks"][b, h // G, t] if int(x) >= 0}
        keys = [j for j in keys if j // rec["block_size"] in chosen]
    scores = torch.stack([q[b, t, h] @ k[b, j, h // G] for j in keys]) * rec["scale"]
    row = torch.zeros(k.shape[1], dtype=torch.float64)
    row[keys] = torch.softmax(scores, 0)
    return row


@torch.no_grad()
def test_attention_probabilities_recomputed_from_the_records(model):
    ids = _ids(70, seed=13, batch=2)  # past the 4 x 16-token MSA budget: layer 2 selects blocks
    cache = model.new_cache(2, 80)
    model(ids[:, :40], positions=torch.arange(40).expand(2, 40), cache=cache)
    tr = Trace(layers=set(), attention_layers={0, 2}, attention_probs=True)
    model(ids[:, 40:], positions=torch.arange(40, 70).expand(2, 30), cache=cache, trace=tr)  # 30 queries, 70 keys
    for L in (0, 2):
        rec = tr.attention[L]
        assert rec["probs"].shape == (2, rec["q"].shape[2], 30, 70) and rec["probs"].dtype == torch.float32
        for b, h, t in ((0, 0, 0), (1, 1, 29), (0, 3, 17), (1, 2, 5)):
            expected = _probabilities_by_hand(rec, b, h, t)
            torch.testing.assert_close(rec["probs"][b, h, t].double(), expected, rtol=0, atol=1e-6)
        # the weights are the ones the core used: their sum of the values is its output o
        G = rec["q"].shape[2] // rec["v"].shape[2]
        v = rec["v"].float().repeat_interleave(G, dim=2)  # [B, L, Hq, D]
        o = torch.einsum("bhtl,blhd->bthd", rec["probs"], v)
        torch.testing.assert_close(o, rec["o"], rtol=0, atol=1e-5)
    assert "probs" not in _alone(model, ids[0].tolist(), attention_layers={2}).attention[2]  # opt-in


def test_trace_layers_are_range_checked(model):
    with pytest.raises(InputError, match=r"Trace\(layers=...\): \[99\]"):
        model(_ids(4), trace=Trace(layers={99}))
    with pytest.raises(InputError, match="attention_layers"):
        model(_ids(4), trace=Trace(attention_layers={-1}))
    with pytest.raises(InputError, match=r"Trace\(layers=1\): give a set of layer indices, e.g. \{1\}"):
        model(_ids(4), trace=Trace(layers=1))
    with pytest.raises(InputError, match="trace: expected a minimax_ref.Trace, got dict"):
        model(_ids(4), trace={})
    with pytest.raises(InputError, match="interventions: expected a minimax_ref.Interventions, got dict"):
        model(_ids(4), interventions={})


@torch.no_grad()
def test_logit_lens_and_reset(model):
    ids = _ids(16, seed=8)
    tr = Trace()
    logits = model(ids, trace=tr)
    lens = tr.logit_lens(model)
    assert sorted(lens) == [0, 1, 2, 3]
    assert torch.equal(lens[3], logits)  # the last layer's lens is the model's output
    h = tr.hidden_states[1]
    expected = F.linear(model.norm(h), model.lm_head.weight).float()
    torch.testing.assert_close(lens[1], expected)
    with pytest.raises(InputError, match="not recorded"):
        Trace(layers={1}).logit_lens(model, {1})
    tr.reset()
    assert not tr.hidden_states and not tr.routing and tr.shape is None
    assert tr.layers is None  # settings stay


@torch.no_grad()
def test_longer_than_max_seq_len_is_refused(tiny_nvfp4):
    m = load_model(tiny_nvfp4, dtype=torch.float32, max_seq_len=16)
    assert m.max_seq_len == 16
    m(_ids(16))
    with pytest.raises(InputError, match="17 positions, more than max_seq_len 16"):
        m(_ids(17))


# ------------------------------------------------------------------------------------------ score


def test_score_is_the_public_function():
    import minimax_ref.research.score as score_module

    assert callable(mr.score) and mr.score is score_module.score
    assert mr.score.__module__ == "minimax_ref.research.score"
    assert callable(mr.generate) and mr.generate.__module__ == "minimax_ref.generation.generate"


@pytest.mark.parametrize("trace,needle", [
    (ScoreTrace(line=0, input_ids=(1, 2, 3), completion_start=0), "completion_start=0 must be in [1, 3)"),
    (ScoreTrace(line=0, input_ids=(1, 2, 3), completion_start=3), "completion_start=3 must be in [1, 3)"),
    (ScoreTrace(line=0, input_ids=(1, 99999), completion_start=1), "token ids [99999] are outside"),
    (ScoreTrace(line=0, input_ids=(-1, 5), completion_start=1), "token ids [-1] are outside"),
])
def test_score_traces_checks_like_the_cli(model, trace, needle):
    with pytest.raises(InputError) as e:
        score_traces(model, [ScoreTrace(line=0, input_ids=(1, 2, 3), completion_start=1), trace])
    assert needle in str(e.value) and "trace 1" in str(e.value)


@pytest.mark.parametrize("pairs,needle", [
    ([("Hello", "")], "'completion' is empty"),
    ([("Hello", " there", "x")], "expected (prompt, completion)"),
    ([{"input_ids": [1, 2], "completion_start": 2}], "must be in [1, 2)"),
    ([{"input_ids": [1, 5000], "completion_start": 1}], "outside the vocabulary"),
    ([{"input_ids": [1, 2], "completion_start": 1, "extra": 0}], "unknown keys"),
    ("Hello", "pairs must be a list"),
])
def test_score_pairs_are_checked(model, pairs, needle):
    tok = mr.load_tokenizer(None)
    with pytest.raises(InputError) as e:
        mr.score(model, tok, pairs)
    assert needle in str(e.value)


@torch.no_grad()
def test_score_matches_the_full_forward(model):
    pairs = [{"input_ids": _ids(n, seed=10 + n)[0].tolist(), "completion_start": s} for n, s in ((30, 5), (12, 11))]
    res = mr.score(model, None, pairs, prefill_chunk=8)
    traced = mr.score(model, None, pairs, trace=Trace(layers=set()))
    total = 0.0
    for p, s, t in zip(pairs, res.per_trace, traced.per_trace):
        ids = torch.tensor([p["input_ids"]])
        logp = torch.log_softmax(model(ids)[0], -1)
        st = p["completion_start"]
        nll = -logp[st - 1: -1].gather(-1, ids[0, st:, None])[:, 0].double()
        torch.testing.assert_close(s.nll, nll, rtol=0, atol=1e-4)
        torch.testing.assert_close(t.nll, nll, rtol=0, atol=1e-4)
        total += float(nll.sum())
    assert res.summary["tokens"] == 25 + 1
    assert res.summary["total_nll"] == pytest.approx(total, abs=1e-3)
    assert res.drift(res)["drift_1e3"] == 0.0 and res.drift(res)["top1_agreement"] == 1.0


def test_config_repr_is_short(model):
    r = repr(model.config)
    assert len(r) < 2000 and "entries>" in r and "moe_layers=3/4" in r


@torch.no_grad()
def test_embedded_default_loads_without_arguments():
    from minimax_ref.weights.embedded import default_checkpoint

    model, tok = mr.load_model(dtype=torch.float32), mr.load_tokenizer()
    explicit = load_model(default_checkpoint(), dtype=torch.float32)
    ids = torch.tensor([tok.encode("The capital of France is")])
    assert torch.equal(model(ids), explicit(ids))


def test_readme_research_snippet_runs_verbatim():
    from pathlib import Path

    text = (Path(__file__).parents[1] / "README.md").read_text()
    section = text[text.index("## Research"):]
    begin = section.index("```python") + len("```python")
    scope: dict = {}
    exec(compile(section[begin: section.index("```", begin)], "README.md", "exec"), scope)
    assert scope["edited"].shape == scope["logits"].shape and not torch.equal(scope["edited"], scope["logits"])
    assert set(scope["drift"]) >= {"drift_1e3", "drift_stderr_1e3", "top1_agreement"}
    assert torch.equal(scope["lens"][5], scope["logits"])  # the embedded default has 6 layers
    assert len(scope["masked"]) == 1 and scope["masked"][0].token_ids
    rec = scope["probs"].attention[2]
    assert rec["probs"].shape[:3] == (2, rec["q"].shape[2], scope["probs"].shape[1])


@torch.no_grad()
def test_forcing_the_indexers_own_blocks_changes_nothing(model):
    ids = _ids(100, seed=11, batch=2)  # past the 4 x 16-token budget: the indexer chooses
    tr = Trace(layers=set())
    plain = model(ids, trace=tr)
    forced = model(ids, interventions=Interventions(msa_blocks=dict(tr.blocks)))
    assert torch.equal(forced, plain)


def _attention_by_hand(attn, x: torch.Tensor, blocks: torch.Tensor, model) -> torch.Tensor:
    """Layer attention output on its input x [B, T, H] with keys limited to `blocks` [B, Hkv, T, kb]: a dense
    causal softmax whose mask also drops every key outside the query's blocks."""
    B, T, _ = x.shape
    cos, sin = model.rope(torch.arange(T).expand(B, T))
    q, k, v = attn.qkv(x, cos, sin)  # [B, T, heads, D]
    bs = attn.geometry.block_size
    key_block = torch.arange(T) // bs
    allowed = torch.zeros(B, attn.n_kv, T, T, dtype=torch.bool)
    for j in range(blocks.shape[-1]):
        allowed |= (key_block[None, None, None, :] == blocks[..., j, None]) & (blocks[..., j, None] >= 0)
    allowed &= torch.ones(T, T, dtype=torch.bool).tril()
    group = attn.n_heads // attn.n_kv
    allowed = allowed.repeat_interleave(group, dim=1)  # [B, Hq, T, T]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * attn.scale
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    o = torch.einsum("bhqk,bkhd->bqhd", p, v.double()).float()
    return attn.o_proj(o.reshape(B, T, -1))


@torch.no_grad()
def test_forced_blocks_equal_attention_by_hand(model):
    ids = _ids(70, seed=12)
    T, L = 70, 2
    own = (torch.arange(T) // 16)[None, None, :, None].expand(1, model.layers[L].self_attn.n_kv, T, 1)
    blocks = torch.cat([own, torch.zeros_like(own), torch.full_like(own, -1)], dim=-1)  # own block + block 0
    tr = Trace(components=True, interventions=Interventions(msa_blocks={L: blocks}))
    model(ids, trace=tr)
    layer = model.layers[L]
    expected = _attention_by_hand(layer.self_attn, layer.input_layernorm(tr.hidden_states[L - 1]), blocks, model)
    torch.testing.assert_close(tr.attention_output[L], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(tr.blocks[L], blocks)
    # it changed the layer: the indexer picks 4 blocks, not 2
    plain = Trace(components=True)
    model(ids, trace=plain)
    assert not torch.allclose(plain.attention_output[L], tr.attention_output[L], atol=1e-4)


@pytest.mark.parametrize("blocks,needle", [  # the tiny preset: 2 kv heads, blocks of 16
    (torch.zeros(1, 1, 20, 2, dtype=torch.long), "integer tensor [1, 2, 20, kb], got (torch.int64, (1, 1, 20, 2))"),
    (torch.zeros(1, 2, 20, 2), "integer tensor [1, 2, 20, kb], got (torch.float32"),
    (torch.ones(1, 2, 20, 2, dtype=torch.long), "at or before the query's own"),
    (torch.full((1, 2, 20, 2), -1, dtype=torch.long), "at least one block"),
])
def test_bad_forced_blocks_are_input_errors(model, blocks, needle):
    with pytest.raises(InputError, match="msa_blocks") as e:
        model(_ids(20), interventions=Interventions(msa_blocks={2: blocks}))
    assert needle in str(e.value)
    with pytest.raises(InputError, match="layer 0 has dense attention"):
        model(_ids(20), interventions=Interventions(msa_blocks={0: blocks}))


def test_research_example_runs_on_the_embedded_default(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "examples" / "research.py"
    out = subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    for needle in ("== expert usage per layer", "after layer 5:", "top-1 agreement", "key blocks of 32"):
        assert needle in out.stdout, needle
    # the README shows what the command prints: every line of its sample but the elisions
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    sample = readme[readme.index("abridged output:"):].split("```")[1]
    shown = [line.strip() for line in sample.splitlines()
             if line.strip() and line.strip() != "..." and not line.strip().startswith("wrote ")]  # --out differs
    assert shown and all(line in out.stdout for line in shown), [x for x in shown if x not in out.stdout]
    assert list(tmp_path.glob("msa_blocks_layer*.png"))


def test_expert_mask_files_and_flags_refuse_repeats(tmp_path):
    """A layer given twice in a mask file ("1" and "01": the second silently won), an expert listed twice, a
    non-integer source_num_experts; --drop-experts naming an expert twice."""
    from minimax_ref.research.intervened import parse_drop, read_expert_mask

    for raw, needle in (({"1": [0, 1, 2, 3], "01": [0, 1, 2, 3, 4]}, "layer 1 is given twice ('01')"),
                        ({"1": [0, 1, 2, 3, 3]}, "expert ids [3] are listed more than once"),
                        ({"kept": {"1": [0, 1, 2, 3]}, "source_num_experts": 16.0},
                         "source_num_experts=16.0 must be an integer")):
        path = tmp_path / "mask.json"
        path.write_text(json.dumps(raw))
        with pytest.raises(InputError, match=re.escape(needle)):
            read_expert_mask(path, 16)
    with pytest.raises(InputError, match=re.escape("expert ids [2] are named more than once")):
        parse_drop("1:2,2,5", 16)


def test_an_empty_batch_is_an_input_error(model):
    for shape in ((1, 0), (0, 3)):
        with pytest.raises(InputError, match=r"input_ids is \[\d, \d\]: give at least one sequence"):
            model(torch.zeros(*shape, dtype=torch.long))
