"""The nano model's copy data and copy measurements (examples/nano): the "copy" kind renders tool turns
in the release format that parse back to their never-seen arguments, never holds a held-out city or an
evaluation string, stays out of the default mix, and eval.py's copy measurements run end to end on
the embedded default checkpoint."""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import pytest
import torch

import minimax_ref as mr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `examples.nano`

from examples.nano import data as nd  # noqa: E402
from minimax_ref.generation import chat  # noqa: E402


@pytest.fixture(scope="module")
def heldout() -> nd.Heldout:
    return nd.make_heldout(0)


@pytest.fixture(scope="module")
def gen(heldout) -> nd.TaskGenerator:
    return nd.TaskGenerator(heldout, {"copy": 1.0})


def _heldout_pattern(heldout: nd.Heldout) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(c) for c in sorted(heldout.city_set, key=len, reverse=True)))


def _check_copy_turns(examples: list[nd.Example], heldout_names: re.Pattern[str]) -> None:
    """Turns of a copy-like kind: no held-out city anywhere, every argument copied from the user's message and none
    reserved to evaluation, and each calling turn parses back to its calls."""
    for ex in examples:
        assert heldout_names.search(ex.prompt + ex.completion) is None
        for c in ex.meta["calls"]:
            arg = c["arguments"].get("city", c["arguments"].get("order_id"))
            assert arg in ex.meta["user"] and not nd.eval_only(arg)
        if ex.meta["stage"] == "call":
            parsed = chat.parse_output(ex.completion[: -len(chat.TURN_END)], nd.TOOLS,
                                       reasoning_started=ex.meta["thinking"] == "enabled")
            assert not parsed["errors"] and parsed["tool_calls"] == ex.meta["calls"]


@pytest.mark.parametrize("thinking", ["enabled", "adaptive", "disabled"])
def test_copy_turns_parse_back_to_their_arguments(gen, thinking):
    rng = random.Random(1)
    for stage in ("call", "answer"):
        for _ in range(150):
            ex = gen.copy(rng, thinking=thinking, stage=stage)
            assert ex.kind == "copy" and ex.completion.endswith(chat.TURN_END)
            calls = ex.meta["calls"]
            assert 1 <= len(calls) <= 4
            for c in calls:  # every argument to copy is in the user's message
                arg = c["arguments"]["city" if c["name"] == "get_weather" else "order_id"]
                assert arg in ex.meta["user"] and arg == arg.strip() and "  " not in arg
            parsed = chat.parse_output(ex.completion[: -len(chat.TURN_END)], nd.TOOLS,
                                       reasoning_started=thinking == "enabled")
            # adaptive thinking reasons before an answer, not before a call
            thinks = thinking == "enabled" or (thinking == "adaptive" and stage == "answer")
            assert not parsed["errors"] and (parsed["reasoning"] is not None) == thinks
            if stage == "call":
                assert parsed["tool_calls"] == calls and parsed["content"] == ""
            else:
                assert parsed["content"] == ex.meta["answer"] and not parsed["tool_calls"]
                assert ex.prompt.count("<response>") == len(calls)


def test_copy_prompts_are_the_release_chat_template(gen):
    """Names with apostrophes, hyphens, digits and diacritics render as the jinja template renders them."""
    rng = random.Random(2)
    for _ in range(60):
        ex = gen.copy(rng)
        assert chat.render_chat_template(chat.CHAT_TEMPLATE, ex.meta["messages"], ex.meta["tools"],
                                         ex.meta["thinking"]) == ex.prompt


def test_copy_strings_cover_the_kinds_of_names(gen):
    rng = random.Random(3)
    names = [gen.copy_string(rng) for _ in range(4000)]
    assert len(set(names)) > 3900  # nearly all new
    assert sum(not n.isascii() for n in names) > 800 and sum(" " in n for n in names) > 800
    assert sum("-" in n for n in names) > 200 and sum("'" in n for n in names) > 50
    assert sum(any(ch.isdigit() for ch in n) for n in names) > 200
    assert sum(n.isupper() for n in names) > 50 and sum(n.islower() for n in names) > 300
    assert min(map(len, names)) >= 2 and max(map(len, names)) <= 32
    assert any(6 <= len(n) <= 20 and n.isascii() and n.isalpha() for n in names)
    for style in nd.COPY_STRING_STYLES:
        s = [nd.random_string(rng, 6, 20, style) for _ in range(200)]
        assert all(6 <= len(x) <= 20 for x in s), style
        check = {"lower": str.islower, "upper": str.isupper, "title": lambda x: x[0].isupper() and x[1:].islower(),
                 "diacritics": lambda x: not x.isascii(), "digits": lambda x: any(c.isdigit() for c in x),
                 "mixed": lambda x: x.isalpha()}[style]
        assert all(check(x) for x in s), style
    codes = [gen.copy_code(rng) for _ in range(500)]
    assert not any(nd.ORDER_ID_RE.fullmatch(c) for c in codes) and len(set(codes)) > 490


def test_copy_data_never_holds_a_heldout_city_or_an_evaluation_string(gen, heldout):
    names = _heldout_pattern(heldout)
    rng = random.Random(4)
    examples = [gen.sample(rng) for _ in range(3000)]
    assert {ex.kind for ex in examples} == {"copy"}
    for ex in examples:
        hit = names.search(ex.prompt + ex.completion)
        assert hit is None, f"held-out city {hit.group()!r} in a copy example"
        for c in ex.meta["calls"]:
            arg = c["arguments"].get("city", c["arguments"].get("order_id"))
            assert not nd.eval_only(arg) and arg not in heldout.order_set
    drawn = {gen.copy_string(rng) for _ in range(20000)} | {gen.copy_code(rng) for _ in range(2000)}
    assert not any(nd.eval_only(s) for s in drawn)
    assert not any(names.search(s) for s in drawn)
    # recombined names use training-city words only
    held_words = {w for c in heldout.city_set for w in re.split(r"[ -]", c)}
    train_words = set(gen._train_words)
    assert not (held_words - {w for c in heldout.train_cities for w in re.split(r"[ -]", c)}) & train_words


def test_names_kind_copies_english_words_never_of_a_heldout_name(heldout):
    """The "names" kind: the copy kind's turns (same stream of draws for "copy": stage 6's data is unchanged) on
    names of English words, none of them a word of a held-out city name, and no held-out city inside."""
    g = nd.TaskGenerator(heldout, {"names": 1.0})
    held_words = {w.casefold() for c in heldout.city_set for w in re.split(r"[ '.-]", c) if w}
    assert {"Thunder", "Prince"} <= set(nd.ENGLISH_WORDS) and len(set(nd.ENGLISH_WORDS)) == len(nd.ENGLISH_WORDS)
    assert g._name_words and not {w.casefold() for w in g._name_words} & held_words
    # a held-out name's words are left out whatever its case ("Bay" of a held-out "Thunder Bay" among them)
    assert len(g._name_words) < len(nd.ENGLISH_WORDS)
    rng = random.Random(8)
    examples = [g.sample(rng) for _ in range(400)]
    assert {ex.kind for ex in examples} == {"names"}
    cities = [c["arguments"]["city"] for ex in examples for c in ex.meta["calls"] if c["name"] == "get_weather"]
    assert len(cities) > 400 and len(set(cities)) > 0.9 * len(cities)
    assert sum(" " in c for c in cities) > 150 and sum("-" in c for c in cities) > 40
    _check_copy_turns(examples, _heldout_pattern(heldout))
    # the drawn words (prefix, suffix and joiner words are the copy kind's shared place-name vocabulary)
    english = {w.casefold() for w in nd.ENGLISH_WORDS} - {w.casefold() for w in nd.NAME_PREFIXES + nd.NAME_SUFFIXES}
    for city in cities:
        drawn = [w for w in re.split(r"[ '.-]", city) if w.casefold() in english]
        assert all(w.casefold() not in held_words for w in drawn), city
    assert sum(bool(re.split(r"[ '.-]", c)[0].casefold() in english) for c in cities) > 0.7 * len(cities)
    # the copy kind draws exactly as before the names kind existed (its turns built by the shared body)
    a, b = random.Random(9), random.Random(9)
    copy_gen = nd.TaskGenerator(heldout, {"copy": 1.0})
    first = copy_gen.copy(a)
    assert first.kind == "copy" and copy_gen.copy(b).prompt == first.prompt


def test_pieces_kind_draws_every_vocabulary_piece_alike(heldout):
    """The "pieces" kind: the copy kind's turns on names built from the tokenizer's letter pieces, drawn
    uniformly, so that a piece rare in every other generator's text (the held-out misses' `ince`, `fil`)
    is copied as often as a common one; never a held-out city or an evaluation string; it needs the pieces."""
    tok = mr.load_tokenizer(None)
    pieces = nd.vocabulary_pieces(tok)
    # pieces are the tokens' own texts: letters only, a start piece's token begins with a space
    assert all(p.isalpha() for p in pieces.starts + pieces.inner) and len(pieces.inner) > 1000
    assert {"ince", "fil", "under"} <= set(pieces.inner) and "Pr" in pieces.starts
    assert all(len(tok.encode(" " + p)) == 1 for p in pieces.starts[::50])
    assert all(len(tok.encode(p)) == 1 for p in ("ince", "fil", *pieces.inner[::50]))
    with pytest.raises(ValueError, match="pieces"):
        nd.TaskGenerator(heldout, {"pieces": 1.0})
    assert nd.pieces_for({"pieces": 0.1}, tok) == pieces and nd.pieces_for({"copy": 1.0}, tok) is None
    g = nd.TaskGenerator(heldout, {"pieces": 1.0}, pieces=pieces)
    rng = random.Random(10)
    examples = [g.sample(rng) for _ in range(300)]
    assert {ex.kind for ex in examples} == {"pieces"}
    _check_copy_turns(examples, _heldout_pattern(heldout))
    names = [g.piece_string(rng) for _ in range(6000)]
    assert len(set(names)) > 5900 and max(map(len, names)) <= 32 and all(n == n.strip() for n in names)
    assert sum(" " in n for n in names) > 2000 and sum("-" in n for n in names) > 300
    assert 0.75 < sum(n[0].isupper() for n in names) / len(names) < 0.95
    # uniform over the vocabulary: each inner piece drawn about as often as any other (a name's tokens, not its
    # letters: the tokenizer may merge two pieces, so count the pieces as tokenized, by id)
    counts = {p: 0 for p in pieces.inner}
    for n in names:
        for i in tok.encode(n):
            text = tok.decode([i])
            if text in counts:
                counts[text] += 1
    drawn = sorted(counts.values())
    assert drawn[len(drawn) // 10] >= 2, "a tenth of the inner pieces were (nearly) never drawn"
    assert counts["ince"] > 0 and counts["fil"] > 0
    # the other kinds draw as before (their streams do not depend on the pieces)
    a, b = random.Random(11), random.Random(11)
    with_pieces = nd.TaskGenerator(heldout, {"copy": 1.0}, pieces=pieces)
    assert with_pieces.copy(a).prompt == nd.TaskGenerator(heldout, {"copy": 1.0}).copy(b).prompt


def test_fresh_strings_are_reserved_for_evaluation(gen):
    fresh = nd.fresh_copy_strings(200, 0)
    assert fresh == nd.fresh_copy_strings(200, 0) and fresh[:100] == nd.fresh_copy_strings(100, 0)
    assert fresh != nd.fresh_copy_strings(200, 1)
    strings = [s for s, _ in fresh]
    assert len(set(strings)) == 200 and all(6 <= len(s) <= 20 and nd.eval_only(s) for s in strings)
    assert [st for _, st in fresh[:6]] == list(nd.COPY_STRING_STYLES)
    # the training draws reject exactly this reserved share (about an eighth of all strings)
    rng = random.Random(5)
    raw = [nd.random_string(rng, 6, 20) for _ in range(8000)]
    assert 0.09 < sum(map(nd.eval_only, raw)) / len(raw) < 0.16
    assert not {gen.copy_string(rng) for _ in range(20000)} & set(strings)


def test_copy_kind_only_in_a_mix_that_names_it(heldout):
    from examples.nano import train as nt

    assert "copy" in nd.KINDS and "copy" not in nd.DEFAULT_MIX and "names" not in nd.DEFAULT_MIX
    mix = nt._mix("arith=0.16,tool=0.18,copy=0.36,image=0.26,greet=0.02,text=0.02")
    g = nd.TaskGenerator(heldout, mix)  # no text source: "text" is dropped
    rng = random.Random(6)
    kinds = [g.sample(rng).kind for _ in range(600)]
    assert set(kinds) == {"arith", "tool", "copy", "image", "greet"} and 0.28 < kinds.count("copy") / 600 < 0.46
    assert "copy" not in nd.TaskGenerator(heldout).kinds
    # the teacher-forced evaluation measures fresh strings too
    fresh = [ex for ex in nd.eval_examples(g, 3, 0) if ex.kind == "tool_random"]
    assert [ex.meta["calls"][0]["arguments"]["city"] for ex in fresh] == [s for s, _ in nd.fresh_copy_strings(3, 0)]


def test_eval_copy_measurements_on_the_default_checkpoint(capsys):
    """eval.py's copy measurements end to end on CPU with small counts (about 20 s on two cores)."""
    import json

    from examples.nano import eval as ne
    from minimax_ref.weights.embedded import default_checkpoint

    ckpt = default_checkpoint()
    args = ne.parse_args(["--ckpt-path", str(ckpt), "--no-cli", "--n-cities", "0", "--n-orders", "0",
                          "--n-arith", "0", "--n-images", "0", "--n-speculative", "0", "--n-long", "4",
                          "--n-random", "6", "--batch", "10", "--dtype", "float32"])
    summary = ne.evaluate(args)
    json.dumps(summary, ensure_ascii=False)
    assert not {"copying", "arithmetic", "images", "dspark", "seed_checks"} & summary.keys()
    long = summary["long_name_copying"]
    assert long["all"]["n"] == 4 and 0 <= long["all"]["exact"] <= 4
    assert sum(v["n"] for k, v in long["by_length"].items()) == 4
    assert sum(v["n"] for k, v in long["by_kind"].items() if k in ("ascii", "non_ascii")) == 4
    assert len(long["misses"]) == 4 - long["all"]["exact"] == sum(long["misses_by_word"].values())
    fresh = summary["fresh_string_copying"]
    assert fresh["all"]["n"] == 6 and set(fresh["by_style"]) == set(nd.COPY_STRING_STYLES)
    assert sum(v["n"] for v in fresh["by_length"].values()) == 6
    wants = [s for s, _ in nd.fresh_copy_strings(6, 0)]
    assert len(fresh["misses"]) == 6 - fresh["all"]["exact"] and all(m["want"] in wants for m in fresh["misses"])


def test_misses_are_placed_in_the_word_where_they_start():
    """`eval.miss_word`, worked by hand on the default's misses: the first word (spelled with other tokens in the call
    than in the prompt) against later words."""
    from examples.nano import eval as ne

    assert ne.miss_word("Prince George", "Prans George") == "first_word"
    assert ne.miss_word("Stoke-on-Trent", "Stoke-on-Tone") == "later_word"
    assert ne.miss_word("Des Moines", "Des Moca") == "later_word"
    assert ne.miss_word("Lüdenscheid", "Lüdentraid") == "first_word"
    assert ne.miss_word("Corpus Christi", "Corpus") == "later_word"  # cut off at the word boundary
    assert ne.miss_word("Thunder Bay", "Thun") == "first_word"  # cut off inside the first word
    assert ne.miss_word("Thunder Bay", None) == "no_call"


def test_image_readings_by_digits_worked_by_hand():
    """`eval.image_readings`: exact digits are right (spaces around them aside), counted by the number's digits; a
    miss records what was read and whether it kept the number's length."""
    from examples.nano import eval as ne

    got = ne.image_readings([3, 7, 63, 427, 5038], ["31", " 7", "54", "427", "5638"])
    assert (got["n"], got["correct"], got["accuracy"]) == (5, 2, 0.4)
    assert got["by_digits"] == {"1": {"n": 2, "correct": 1}, "2": {"n": 1, "correct": 0},
                                "3": {"n": 1, "correct": 1}, "4": {"n": 1, "correct": 0}}
    assert got["misses"] == [{"want": "3", "got": "31", "same_length": False},
                             {"want": "63", "got": "54", "same_length": True},
                             {"want": "5038", "got": "5638", "same_length": True}]


def test_first_miss_is_where_the_model_leaves_the_name():
    """`eval.first_miss` against a plain forward of the default: a greedy reply scored as written has no position
    whose most likely token differs from it; with one letter of its city changed, the first such position is inside
    the city, its probability is the softmax of the forward's logits there, and a reply without a call gives None."""
    import math

    from examples.nano import eval as ne
    from minimax_ref.weights.embedded import default_checkpoint

    ckpt = default_checkpoint()
    model = mr.load_model(ckpt, dtype=torch.float32)
    tok = mr.load_tokenizer(ckpt)
    got, replies = ne._exact_city_copies(model, tok, ["Lisbon"], 1, random.Random(0))
    city, reply = got[0], replies[0]
    assert city and ne.first_miss(model, tok, reply, city, city) == {"before": None, "right": None, "p_right": None,
                                                                      "chosen": None}
    assert ne.first_miss(model, tok, reply, city, None) is None
    want = city[:2] + ("q" if city[2] != "q" else "z") + city[3:]
    miss = ne.first_miss(model, tok, reply, want, city)
    ids = tok.encode(reply.text.replace(city, want, 1))
    prompt = list(reply.prompt_token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids]))[0, len(prompt) - 1:-1].double()
    chosen = logits.argmax(-1)
    i = next(i for i, t in enumerate(ids) if int(chosen[i]) != t)
    assert miss["right"] == tok.decode([ids[i]]) and miss["chosen"] == tok.decode([int(chosen[i])])
    assert miss["before"] == tok.decode(ids[max(0, i - 3):i])
    assert math.isclose(miss["p_right"], float(logits[i].softmax(-1)[ids[i]]), abs_tol=1e-4)
    # the first wrong token starts at or before the changed letter and ends past the name's start
    text = tok.decode(ids)
    start = text.index(want)
    assert len(tok.decode(ids[:i])) <= start + 2
    assert len(tok.decode(ids[:i + 1])) > start
