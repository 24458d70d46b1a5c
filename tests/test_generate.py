"""Generation layers: the scheduler's emission rules, seeded sampling against a hand-written loop, continuous
batching in both loops, and the argument checks of the public generation functions (a string is one prompt; wrong
types are InputErrors naming the argument)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import minimax_ref as mr
from minimax_ref.errors import InputError
from minimax_ref.generation.decoding import DecodeJob, Scheduler, generate_ids, pad_prompts
from minimax_ref.generation.drafter import load_drafter
from minimax_ref.generation.sampling import RowSampling, SamplingParams, sample
from minimax_ref.generation.speculative import speculative_generate_ids
from minimax_ref.weights.loader import load_model
from minimax_ref.weights.synth_tokenizer import write_test_tokenizer

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model(spec_ckpt):
    return load_model(spec_ckpt, dtype=torch.float32)


@pytest.fixture(scope="module")
def tok(spec_ckpt):
    return mr.load_tokenizer(spec_ckpt)


def _prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]


def _fake_model(max_batch_size: int | None = None):
    """What the decode state reads of a model (no runtime settings unless a batch limit is given); its jobs name
    their prefill chunk (the fake has no memory to choose one from)."""
    rt = None if max_batch_size is None else SimpleNamespace(max_seq_len=64, kv_cache_dtype="auto",
                                                            max_batch_size=max_batch_size)
    return SimpleNamespace(text=SimpleNamespace(vocab_size=100, max_position_embeddings=4096),
                           device=torch.device("cpu"), runtime=rt,
                           new_cache=lambda slots, length, kv_cache_dtype: None)


# ---------------------------------------------------------------------------------------------- emission rules


def test_emission_pads_stops_and_truncates():
    seen = []
    job = DecodeJob.make(_fake_model(), [[1, 2, 3], [4]], max_new_tokens=4, stop_ids=9, max_seq_len=6, prefill_chunk=8,
                         on_token=lambda row, t: seen.append((row, t)))
    ids, embeds = pad_prompts(_fake_model(), job.prompts, None)
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]] and embeds is None
    assert (job.budget(0), job.budget(1)) == (6, 5)  # min(max_seq_len 6, prompt + 4 new tokens)
    sched = Scheduler(_fake_model(), job)
    sched.running = [sched.waiting.popleft(), sched.waiting.popleft()]  # both admitted
    assert sched.committed(0) == 3 and sched.committed(1) == 1
    # request 0 reaches its budget (3 + 3 = 6 positions) after 3 tokens; the 4th is dropped
    assert sched.emit(0, [5, 6, 7, 8]) == 3
    # request 1 stops at the stop token, which is kept; what follows is dropped
    assert sched.emit(1, [5, 9, 7]) == 2
    assert sched.running == [None, None], "a finished request frees its slot"
    assert sched.stats.generated_tokens == 5 and sched.stats.prompt_tokens == 4
    assert seen == [(0, 5), (0, 6), (0, 7), (1, 5), (1, 9)]
    # committed: the prompt and every emitted token but the last (fed next)
    assert sched.committed(0) == 3 + 2 and sched.committed(1) == 1 + 1
    assert [(s.generated, s.finish_reason) for s in sched.seqs] == [([5, 6, 7], "length"), ([5, 9], "stop")]


def test_no_new_tokens_finishes_without_a_slot():
    finished = []
    job = DecodeJob.make(_fake_model(), [[1], [2, 3]], max_new_tokens=0, prefill_chunk=8)
    seqs, stats = Scheduler(_fake_model(), job, on_finish=lambda i, s: finished.append(i)).run()
    assert [(s.generated, s.finish_reason) for s in seqs] == [([], "length")] * 2
    assert finished == [0, 1] and stats.decode_steps == 0 and stats.prefill_seconds == 0


def test_each_request_has_its_own_seed():
    job = DecodeJob.make(_fake_model(max_batch_size=2), [[1], [2], [3], [4], [5]], seed=10, prefill_chunk=8)
    assert job.seeds == (10, 11, 12, 13, 14) and job.batch_limit == 2  # request i: seed + i
    assert DecodeJob.make(_fake_model(), [[1], [2]], seed=[7, 3], prefill_chunk=8).seeds == (7, 3)


# ---------------------------------------------------------------------------------------------- sampling


def _reference_probs(logits: torch.Tensor, t: float, top_k: int, top_p: float) -> torch.Tensor:
    """The sampling contract written out for one row: temperature, the k largest, then the smallest
    most-likely set reaching top_p."""
    z = logits.float() / t
    keep = torch.zeros_like(z, dtype=torch.bool)
    keep[z.argsort(descending=True)[:top_k]] = True
    p = torch.softmax(z.masked_fill(~keep, float("-inf")), -1)
    order = p.argsort(descending=True)
    mass, nucleus = 0.0, []
    for i in order.tolist():
        nucleus.append(i)
        mass += float(p[i])
        if mass >= top_p:
            break
    q = torch.zeros_like(p)
    q[nucleus] = p[nucleus]
    return q / q.sum()


def test_seeded_sampling_equals_a_hand_written_loop(model):
    """Each token is one torch.multinomial draw, from a generator seeded with `seed`, of the filtered
    distribution of the full forward's last logits."""
    prompt, seed, n = _prompts(23)[0], 5, 10
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20)
    seqs, _ = generate_ids(model, [prompt], max_new_tokens=n, sampling=params, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]))[0, -1]
            probs = _reference_probs(logits, 0.8, 20, 0.9)
            ids.append(int(torch.multinomial(probs[None], 1, generator=g)))
    assert seqs[0].generated == ids[len(prompt):]


def test_row_sampling_draws_each_row_as_alone():
    """A batch of rows with their own settings and generators: each row's token is the one it samples alone (a greedy
    row draws nothing), and its distribution is its own setting's."""
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 3
    settings = (SamplingParams(0.8, 0.9, 20), GREEDY, SamplingParams(1.0), SamplingParams(0.8, 0.9, 20),
                SamplingParams(1.5, 1.0, 5))
    rows = RowSampling(settings, tuple(torch.Generator().manual_seed(10 + b) for b in range(5)))
    tokens, probs = rows.sample(logits)
    for b, params in enumerate(settings):
        alone = sample(logits[b:b + 1], params, torch.Generator().manual_seed(10 + b))
        assert int(tokens[b]) == int(alone[0]), b
        torch.testing.assert_close(probs[b], rows.take([b]).probs(logits[b:b + 1])[0], rtol=0, atol=0)
    assert rows.generators[1].initial_seed() == 11 and torch.equal(rows.generators[1].get_state(),
                                                                    torch.Generator().manual_seed(11).get_state())
    greedy_tokens, none = RowSampling((GREEDY,) * 2, (None, None)).sample(logits[:2])
    assert torch.equal(greedy_tokens, logits[:2].argmax(-1)) and none is None


# ---------------------------------------------------------------------------------------------- continuous batching


def test_a_request_decodes_as_it_does_alone(model):
    """Continuous batching: 6 requests of mixed lengths, max_new_tokens and sampling settings through 2 slots (the
    batch refilled as rows finish, a stop token among them) give each request the tokens it gets alone."""
    prompts = _prompts(23, 5, 40, 9, 31, 14)
    new = [6, 2, 9, 1, 5, 7]
    settings = [GREEDY, SamplingParams(0.8, 0.9, 20), SamplingParams(1.0), GREEDY, SamplingParams(0.7, 1.0, 5),
                SamplingParams(1.2, 0.95, 0)]
    seeds = [3, 4, 5, 6, 7, 8]
    first, _ = generate_ids(model, [prompts[0]], max_new_tokens=6, sampling=GREEDY)
    stop = first[0].generated[2]  # request 0 stops at its third token
    kw = dict(stop_ids=[stop])
    batched, stats = generate_ids(model, prompts, max_new_tokens=new, sampling=settings, seed=seeds,
                                  max_batch_size=2, **kw)
    assert batched[0].finish_reason == "stop" and len(batched[0].generated) == 3
    for i in range(len(prompts)):
        alone, _ = generate_ids(model, [prompts[i]], max_new_tokens=new[i], sampling=settings[i], seed=seeds[i], **kw)
        assert (batched[i].generated, batched[i].finish_reason) == (alone[0].generated, alone[0].finish_reason), i
    # two slots: every step decodes two rows until the queue runs dry, so fewer steps than one request at a time
    assert stats.decode_steps < sum(len(s.generated) - 1 for s in batched)
    assert stats.generated_tokens == sum(len(s.generated) for s in batched)


def test_empty_slots_leave_each_request_as_it_is_alone(model, monkeypatch):
    """A model that rounds its slots up (`batch_slots`, as compiled models do) decodes 3 requests in 4 slots, the
    fourth empty from the start and others emptying as requests finish: every step has 4 rows and every request
    keeps the tokens it gets alone."""
    prompts = _prompts(11, 4, 17)
    settings = [GREEDY, SamplingParams(0.9, 0.95, 10), GREEDY]
    new = [5, 2, 7]
    monkeypatch.setattr(type(model), "batch_slots", lambda self, n, limit: 4, raising=False)
    rows = []
    real_step = type(model).step
    monkeypatch.setattr(type(model), "step", lambda self, ids, pos, cache: rows.append(ids.shape[0]) or
                        real_step(self, ids, pos, cache))
    batched, stats = generate_ids(model, prompts, max_new_tokens=new, sampling=settings, seed=[1, 2, 3],
                                  max_batch_size=8)
    assert set(rows) == {4} and stats.decode_steps == len(rows) == max(new) - 1
    monkeypatch.undo()
    for i in range(len(prompts)):
        alone, _ = generate_ids(model, [prompts[i]], max_new_tokens=new[i], sampling=settings[i], seed=i + 1)
        assert batched[i].generated == alone[0].generated, i


def test_compiled_models_round_their_slots_to_powers_of_two():
    """`FastMiniMaxM3.batch_slots`: with compiled layers (a compile per batch size) the request count rounded up to
    a power of two within the batch limit; without them, or offloaded (an empty slot's experts would stream), the
    request count."""
    from minimax_ref.fast.model import FastMiniMaxM3

    compiled, eager = SimpleNamespace(compiled=object()), SimpleNamespace(compiled=None)
    offloaded = SimpleNamespace(compiled=object(), offload=object())
    cases = {(1, 41): 1, (2, 41): 2, (3, 41): 4, (5, 41): 8, (17, 41): 32, (32, 41): 32, (33, 41): 41, (6, 6): 6,
             (5, 6): 6, (64, 64): 64}
    for (n, limit), want in cases.items():
        assert FastMiniMaxM3.batch_slots(compiled, n, limit) == want, (n, limit)
        assert FastMiniMaxM3.batch_slots(eager, n, limit) == n
        assert FastMiniMaxM3.batch_slots(offloaded, n, limit) == n


def test_requests_admitted_together_share_prefill_forwards(model):
    """Prompts admitted into neighbouring free slots are prefilled together, right-padded, as many as fit the prefill
    chunk; a prompt longer than the chunk goes alone in chunks; every request keeps the tokens it gets alone."""
    forwards = []

    def count(module, args, kwargs):
        if kwargs.get("logit_index") is not None:  # prefill forwards ask for one position per row
            forwards.append(tuple(args[0].shape))

    prompts = _prompts(5, 9, 3, 30)
    settings = [GREEDY, SamplingParams(0.9), GREEDY, SamplingParams(0.8, 0.9, 10)]
    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        # 2 x 9 = 18 tokens fit a chunk of 20, a third row would pad to 27; the 30-token prompt goes in 2 chunks
        batched, _ = generate_ids(model, prompts, max_new_tokens=4, sampling=settings, seed=[1, 2, 3, 4],
                                  max_batch_size=4, prefill_chunk=20)
    finally:
        handle.remove()
    assert forwards == [(2, 9), (1, 3), (1, 20), (1, 10)]
    for i in range(len(prompts)):
        alone, _ = generate_ids(model, [prompts[i]], max_new_tokens=4, sampling=settings[i], seed=i + 1,
                                prefill_chunk=64)
        assert batched[i].generated == alone[0].generated, i


def test_seed_per_prompt_and_finish_order(model):
    """A call's prompt i is seeded with seed + i whatever its neighbours; on_finish reports each prompt as it ends,
    the shortest first."""
    prompts = _prompts(12, 12, 12)
    params = SamplingParams(0.9)
    together, _ = generate_ids(model, prompts, max_new_tokens=[8, 2, 5], sampling=params, seed=10)
    for i in range(3):
        alone, _ = generate_ids(model, [prompts[i]], max_new_tokens=[8, 2, 5][i], sampling=params, seed=10 + i)
        assert together[i].generated == alone[0].generated
    order = []
    generate_ids(model, prompts, max_new_tokens=[8, 2, 5], sampling=GREEDY, on_finish=lambda i, s: order.append(i))
    assert order == [1, 2, 0]


def test_generate_takes_per_prompt_settings(model, tok):
    prompts = ["The first", "A second prompt", "Third"]
    results = mr.generate(model, tok, prompts, max_new_tokens=[3, 5, 2], temperature=[0, 0.8, 0], top_k=[0, 10, 0],
                          seed=[1, 2, 3], stop_ids=[], max_batch_size=2)
    assert [len(r.token_ids) for r in results] == [3, 5, 2]
    assert all(r.request["time_to_first_token_seconds"] <= r.request["seconds"] for r in results)
    alone = mr.generate(model, tok, prompts[1], max_new_tokens=5, temperature=0.8, top_k=10, seed=2, stop_ids=[])
    assert alone[0].token_ids == results[1].token_ids
    with pytest.raises(InputError, match="one per prompt"):
        mr.generate(model, tok, prompts, max_new_tokens=[3, 5])




def test_both_loops_batch_continuously(spec_ckpt):
    """With more requests than slots, the speculative loop refills its slots as the plain loop does: every verify
    step runs `max_batch_size` slots, and the greedy tokens are plain greedy decoding's."""
    limited = load_model(spec_ckpt, dtype=torch.float32, max_batch_size=2)
    drafter = load_drafter(spec_ckpt / "dspark", limited)
    prompts = _prompts(30, 12, 50, 7, 21)
    plain, _ = generate_ids(limited, prompts, max_new_tokens=8, sampling=GREEDY)
    spec, stats = speculative_generate_ids(limited, drafter, prompts, max_new_tokens=8, sampling=GREEDY)
    assert [s.generated for s in spec] == [s.generated for s in plain]
    assert stats.prompt_tokens == sum(map(len, prompts)) and stats.max_batch_size == 2
    assert stats.generated_tokens == 5 * 8 and stats.steps >= 5
    assert stats.as_dict()["num_speculative_tokens"] == drafter.block_size


def test_text_generation_never_picks_the_padding_ids_past_the_tokenizer(spec_ckpt, tmp_path):
    """A checkpoint's vocab_size may be padded past its tokenizer's ids (the release's 200,064 rows); those ids have
    no text. Token-id generation may choose them; `generate` only chooses ids the tokenizer has, in both loops, and
    the rows it keeps score as before (greedy: the argmax among them)."""
    padded = load_model(spec_ckpt, dtype=torch.float32, max_batch_size=2)
    small = write_test_tokenizer(tmp_path, 600)  # the model has 1,024 ids
    tok = mr.load_tokenizer(tmp_path)
    assert tok.vocab_size == 600 < padded.text.vocab_size
    w = padded.lm_head.weight.data
    w[600::2], w[601::2] = 30 * w[5], -30 * w[5]  # padding rows that win the argmax almost everywhere
    prompts = [tok.encode("The weather in Lisbon"), tok.encode("Numbers: 1 2 3")]
    raw, _ = generate_ids(padded, prompts, max_new_tokens=6, sampling=GREEDY)
    assert any(t >= 600 for s in raw for t in s.generated), "the edited head should prefer padding ids"
    limited, _ = generate_ids(padded, prompts, max_new_tokens=6, sampling=GREEDY, vocab_limit=600)
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "top_p": 1.0, "top_k": 0}):
        results = mr.generate(padded, tok, prompts, max_new_tokens=6, stop_ids=small["turn_end"], **sampling)
        assert all(0 <= t < 600 for r in results for t in r.token_ids)
        assert all(r.text == tok.decode([t for t in r.token_ids if t != small["turn_end"]]) for r in results)
    greedy = mr.generate(padded, tok, prompts, max_new_tokens=6, temperature=0, stop_ids=small["turn_end"])
    assert [r.token_ids for r in greedy] == [s.generated for s in limited]
    drafted = mr.generate(padded, tok, prompts, max_new_tokens=6, temperature=0, stop_ids=small["turn_end"],
                          draft=load_drafter(spec_ckpt / "dspark", padded))
    assert [r.token_ids for r in drafted] == [r.token_ids for r in greedy]
    with pytest.raises(InputError, match=r"vocab_limit=2000: the model has 1024 token ids"):
        generate_ids(padded, prompts, max_new_tokens=1, vocab_limit=2000)
    with pytest.raises(InputError, match=r"stop_ids \[700\] are outside the vocabulary \[0, 600\)"):
        mr.generate(padded, tok, prompts, max_new_tokens=1, stop_ids=700)


# ---------------------------------------------------------------------------------------------- argument checks


def test_a_string_is_one_prompt(model, tok):
    kw = {"max_new_tokens": 4, "temperature": 0}
    one = mr.generate(model, tok, "What is 2+2?", **kw)
    listed = mr.generate(model, tok, ["What is 2+2?"], **kw)
    assert len(one) == 1 and one[0].token_ids == listed[0].token_ids
    assert one[0].prompt_token_ids == tok.encode("What is 2+2?")


@pytest.mark.parametrize(("prompts", "kw", "needle"), [
    ([5, 6, 7], {}, "prompts: got one flat list of token ids; pass a list of prompts: \\[ids\\]"),
    ([{"role": "user", "content": "hi"}], {"chat": True}, "prompts: got one flat list of chat messages"),
    (None, {}, "prompts: expected a string or a list of prompts, got NoneType"),
    (b"hello", {}, "prompts: got bytes"),
    (["fine", 3.5], {}, r"prompts\[1\]: expected a string, a list of token ids, got float"),
    ([["not", "a", "message"]], {"chat": True}, r"prompts\[0\]: a chat prompt is .* item 0 is str"),
])
def test_generate_refuses_wrong_prompt_types(model, tok, prompts, kw, needle):
    with pytest.raises(InputError, match=needle):
        mr.generate(model, tok, prompts, max_new_tokens=2, **kw)


def test_generate_stop_ids_and_images_arguments(model, tok):
    kw = {"max_new_tokens": 6, "temperature": 0}
    free = mr.generate(model, tok, "Hello", stop_ids=[], **kw)[0]
    stop = free.token_ids[2]
    first = free.token_ids.index(stop)
    one = mr.generate(model, tok, "Hello", stop_ids=stop, **kw)[0]  # a single id is one stop id
    assert one.token_ids == free.token_ids[:first + 1] and one.finish_reason == "stop"
    assert mr.generate(model, tok, "Hello", stop_ids=[stop], **kw)[0].token_ids == one.token_ids
    with pytest.raises(InputError, match="stop_ids: expected a token id or a list of token ids, got str"):
        mr.generate(model, tok, "Hello", stop_ids="abc", **kw)
    with pytest.raises(InputError, match="stop_ids: 'a' \\(str\\) is not an integer token id"):
        mr.generate(model, tok, "Hello", stop_ids=["a"], **kw)
    with pytest.raises(InputError, match="stop_ids: expected a token id or a list of token ids, got float"):
        mr.generate(model, tok, "Hello", stop_ids=2.0, **kw)
    with pytest.raises(InputError, match="images: give a list with one entry per prompt .* got PosixPath"):
        mr.generate(model, tok, "Hello", images=Path("cat.png"), **kw)
    with pytest.raises(InputError, match="images: give one entry per prompt .* got 2 entries for 1 prompts"):
        mr.generate(model, tok, "Hello", images=["a.png", "b.png"], **kw)
    with pytest.raises(InputError, match=r"images\[0\] is a tensor"):
        mr.generate(model, tok, ["a", "b"], images=[torch.zeros(4, 8), torch.tensor([[1, 2, 2]])], **kw)


@pytest.mark.parametrize(("prompts", "kw", "needle"), [
    ("hello", {}, "prompts: got text; this function takes token ids"),
    ([1, 2, 3], {}, "prompts: got one flat list of token ids"),
    ([[1, 2.5, 3]], {}, r"prompts\[0\]: item 1 is 2.5 \(float\), not an integer token id"),
    ([[1, True]], {}, r"prompts\[0\]: item 1 is True \(bool\)"),
    (torch.tensor([1.0, 2.0]), {}, "a tensor of prompts must be 2-d integer token ids"),
    ([[1, 2]], {"max_new_tokens": "5"}, "max_new_tokens='5': must be an integer >= 0"),
    ([[1, 2]], {"max_new_tokens": -1}, "max_new_tokens=-1: must be an integer >= 0"),
    ([[1, 2]], {"seed": "x"}, "seed='x': must be an integer"),
    ([[1, 2]], {"stop_ids": "ab"}, "stop_ids: expected a token id or a list of token ids, got str"),
    ([[1, 2]], {"stop_ids": [1, None]}, "stop_ids: None \\(NoneType\\) is not an integer token id"),
    ([[1, 2]], {"inputs_embeds": [torch.zeros(3, 64)]}, r"inputs_embeds\[0\]: expected a \[2, hidden\] tensor"),
    ([[1, 2]], {"sampling": 0.5}, "sampling: expected a SamplingParams, got float"),
])
def test_token_id_loops_refuse_wrong_arguments(model, spec_ckpt, prompts, kw, needle):
    with pytest.raises(InputError, match=needle):
        generate_ids(model, prompts, **kw)
    drafter = load_drafter(spec_ckpt / "dspark", model)
    with pytest.raises(InputError, match=needle):
        speculative_generate_ids(model, drafter, prompts, **kw)


def test_token_id_prompts_as_a_tensor_and_a_single_stop_id(model):
    prompts = _prompts(9, 9)
    ref, _ = generate_ids(model, prompts, max_new_tokens=5, sampling=GREEDY)
    out, _ = generate_ids(model, torch.tensor(prompts), max_new_tokens=5, sampling=GREEDY)
    assert [s.generated for s in out] == [s.generated for s in ref]
    stop = ref[0].generated[1]
    one, _ = generate_ids(model, prompts, max_new_tokens=5, sampling=GREEDY, stop_ids=stop)
    listed, _ = generate_ids(model, prompts, max_new_tokens=5, sampling=GREEDY, stop_ids=[stop])
    assert [s.generated for s in one] == [s.generated for s in listed]
    assert one[0].finish_reason == "stop" and one[0].generated[-1] == stop


@pytest.mark.parametrize(("kw", "needle"), [
    ({"temperature": "hot"}, "temperature='hot': must be a number >= 0"),
    ({"temperature": None}, "temperature=None"),
    ({"temperature": float("nan")}, "temperature=nan"),
    ({"top_p": "0.5"}, "top_p='0.5': must be a number in \\(0, 1\\]"),
    ({"top_k": 2.0}, "top_k=2.0: must be an integer >= 0"),
    ({"top_k": True}, "top_k=True"),
])
def test_sampling_params_refuse_wrong_types(kw, needle):
    with pytest.raises(InputError, match=needle):
        SamplingParams(**kw)


def test_streamed_text_follows_its_row(model, tok):
    """Two identical prompts stream into their own rows (the rows are told apart by position, not value)."""
    pieces: dict[int, str] = {0: "", 1: ""}

    def on_text(row: int, text: str) -> None:
        pieces[row] += text

    out = mr.generate(model, tok, ["Same", "Same"], max_new_tokens=6, temperature=0, stop_ids=[], on_text=on_text)
    assert [pieces[0], pieces[1]] == [r.text for r in out]
