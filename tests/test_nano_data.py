"""The nano model's data generators (examples/nano/data.py): held-out items never reach training data,
order ids have their format, arithmetic answers and working are right, tool calls round-trip through
`chat.parse_output`, prompts equal the shipped chat template's rendering, and token streams pack."""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `examples.nano`

from examples.nano import data as nd  # noqa: E402
from examples.nano.tokenizer import train_tokenizer  # noqa: E402
from minimax_ref.generation import chat  # noqa: E402
from minimax_ref.generation.tokenizer import load_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def heldout() -> nd.Heldout:
    return nd.make_heldout(0)


@pytest.fixture(scope="module")
def gen(heldout) -> nd.TaskGenerator:
    return nd.TaskGenerator(heldout, text_source=nd.StdlibText(heldout, max_files=40), fonts=("",))


@pytest.fixture(scope="module")
def tok(gen, tmp_path_factory):
    out = tmp_path_factory.mktemp("nano-tok")
    train_tokenizer(nd.tokenizer_texts(gen, 400, 0), 600, out)
    return load_tokenizer(out)


def test_heldout_split_is_deterministic_and_complete(heldout, tmp_path):
    assert nd.make_heldout(0) == heldout and nd.make_heldout(1) != heldout
    assert len(set(heldout.cities)) == nd.N_HELDOUT_CITIES and len(set(heldout.order_ids)) == nd.N_HELDOUT_ORDERS
    assert len(heldout.arithmetic) == nd.N_HELDOUT_PROBLEMS and nd.SEED_PROBLEM in heldout.arithmetic
    assert len(heldout.image_numbers) == nd.N_HELDOUT_IMAGES and nd.SEED_IMAGE_NUMBER in heldout.image_numbers
    assert "Lisbon" not in heldout.cities and "Lisbon" in heldout.train_cities
    assert set(heldout.cities) <= set(nd.CITIES) and len(nd.CITIES) >= 300
    assert any(not c.isascii() for c in nd.CITIES) and {"Yaoundé", "Genève"} <= set(nd.CITIES)
    assert nd.read_heldout(nd.write_heldout(heldout, tmp_path / "h.json")) == heldout


def test_heldout_cities_never_appear_in_training_text(gen, heldout):
    assert heldout.city_set == set(heldout.cities) | set(heldout.long_cities)
    names = re.compile("|".join(re.escape(c) for c in sorted(heldout.city_set, key=len, reverse=True)))
    rng = random.Random(1)
    examples = [gen.sample(rng) for _ in range(3000)] + [gen.tool(rng) for _ in range(1500)]
    assert {ex.kind for ex in examples} == {"arith", "tool", "image", "greet", "text"}
    for ex in examples:
        hit = names.search(ex.prompt + ex.completion)
        assert hit is None, f"held-out city {hit.group()!r} in a {ex.kind} example"
    # the tokenizer is trained on the same stream (special tokens stripped)
    assert not any(names.search(t) for t in nd.tokenizer_texts(gen, 500, 0))


def test_training_draws_avoid_every_heldout_item(gen, heldout):
    rng = random.Random(2)
    assert not {gen.train_order_id(rng) for _ in range(3000)} & heldout.order_set
    problems = {gen.train_problem(rng) for _ in range(20000)}
    assert not problems & heldout.problem_set and (23, "*", 17) not in problems
    assert not {gen.train_image_number(rng) for _ in range(20000)} & heldout.image_set


def test_order_id_format(heldout):
    rng = random.Random(3)
    for oid in [nd.random_order_id(rng) for _ in range(500)] + list(heldout.order_ids) + [nd.SCHEMA_ORDER_ID]:
        assert nd.ORDER_ID_RE.fullmatch(oid), oid
    assert nd.SCHEMA_ORDER_ID not in heldout.order_ids


_EQUATION = re.compile(r"(?<![\d.])(\d+(?:[-+*]\d+)+)=(-?\d+)")
_STATEMENT = re.compile(r"So (\d+(?:[-+*]\d+)*) = (-?\d+)\.")


@pytest.mark.parametrize("thinking", ["enabled", "adaptive", "disabled"])
def test_arithmetic_answers_and_working_are_right(gen, heldout, thinking):
    rng = random.Random(4)
    problems = list(heldout.arithmetic) + [gen.train_problem(rng) for _ in range(300)]
    for a, op, b in problems:
        ex = gen.arithmetic(rng, problem=(a, op, b), thinking=thinking)
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        assert ex.meta["answer"] == str(answer) and ex.completion.endswith(f"{answer}{chat.TURN_END}")
        parsed = chat.parse_output(ex.completion[: -len(chat.TURN_END)], reasoning_started=thinking == "enabled")
        assert parsed["content"] == str(answer) and not parsed["errors"]
        if thinking == "disabled":
            assert parsed["reasoning"] is None
            continue
        reasoning = parsed["reasoning"]
        assert reasoning.endswith(f"So {a}{op}{b} = {answer}.")
        # every equation of the working holds (only digits and + - * are evaluated)
        checks = _EQUATION.findall(reasoning) + _STATEMENT.findall(reasoning)
        assert checks
        for expr, value in checks:
            assert eval(expr) == int(value), (expr, value, reasoning)  # noqa: S307 - digits and operators only
    seed = gen.arithmetic(rng, problem=(17, "*", 23), thinking="enabled")
    assert seed.meta["answer"] == "391" and "17*3 = 51" in seed.completion and "340+51 = 391" in seed.completion


@pytest.mark.parametrize("which", ["weather", "order", "both", "two_cities"])
@pytest.mark.parametrize("thinking", ["enabled", "adaptive", "disabled"])
def test_tool_calls_parse_back_to_their_arguments(gen, which, thinking):
    rng = random.Random(5)
    for city in ("Yaoundé", "Genève", "N'Djamena", "Sana'a", "Port-au-Prince", "São Paulo", "Ho Chi Minh City",
                 "Hafnarfjörður", "Điện Biên Phủ", "Saint George's", "Ústí nad Labem"):
        ex = gen.tool(rng, city=city, which=which, stage="call", thinking=thinking)
        parsed = chat.parse_output(ex.completion[: -len(chat.TURN_END)], nd.TOOLS,
                                   reasoning_started=thinking == "enabled")
        assert parsed["tool_calls"] == ex.meta["calls"] and not parsed["errors"]
        assert parsed["content"] == "" and (parsed["reasoning"] is not None) == (thinking == "enabled")
        if which != "order":
            assert parsed["tool_calls"][0]["arguments"]["city"] == city
            assert isinstance(parsed["tool_calls"][0]["arguments"]["days"], int)
        if which in ("order", "both"):
            assert nd.ORDER_ID_RE.fullmatch(parsed["tool_calls"][-1]["arguments"]["order_id"])
        answer = gen.tool(rng, city=city, which=which, stage="answer", thinking=thinking)
        parsed = chat.parse_output(answer.completion[: -len(chat.TURN_END)], nd.TOOLS,
                                   reasoning_started=thinking == "enabled")
        assert parsed["content"] == answer.meta["answer"] and not parsed["tool_calls"] and not parsed["errors"]
        # the release's format: the results share one tool turn, each in its <response>
        assert answer.prompt.count("]~b]tool\n<response>") == 1
        assert answer.prompt.count("<response>") == len(answer.meta["calls"])


def test_prompts_are_the_shipped_chat_template(gen, tok):
    """Prompts are rendered with chat.render_chat; the tokenizer's jinja template renders the same."""
    assert tok.chat_template is not None
    rng = random.Random(6)
    for _ in range(150):
        ex = gen.sample(rng)
        if ex.kind == "text":
            continue
        text = tok.apply_chat_template(ex.meta["messages"], tools=ex.meta["tools"], thinking=ex.meta["thinking"],
                                       tokenize=False)
        assert text == ex.prompt


def test_tokenize_pack_and_collate(gen, tok):
    rng = random.Random(7)
    ex = gen.image(rng, number=58, thinking="adaptive")
    te = nd.tokenize_example(ex, tok)
    sp = tok.special_ids
    n = nd.PREPROCESSOR.num_tokens_for_size(ex.image.height, ex.image.width)
    start = te.ids.index(sp.image_start)
    assert te.ids[start + 1: start + 1 + n] == [sp.image] * n and te.ids[start + 1 + n] == sp.image_end
    completion = [t for t, m in zip(te.ids, te.loss) if m]
    assert tok.decode(completion) == ex.completion and tok.decode(completion[-1:]) == chat.TURN_END
    assert not any(te.loss[: len(te.ids) - len(completion)])

    seq = 1024
    packer = nd.Packer(nd.training_stream(gen, tok, seed=0), seq, pad_id=sp.bod)
    rows = [packer.row() for _ in range(6)]
    assert all(len(r.ids) == seq == len(r.loss) for r in rows)
    batch = nd.collate(rows)
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape == labels.shape == (6, seq)
    keep = labels != -100
    assert bool((labels[:, :-1][keep[:, :-1]] == ids[:, 1:][keep[:, :-1]]).all()) and not bool(keep[:, -1].any())
    n_images = sum(len(r.images) for r in rows)
    if n_images:
        assert batch["image_grid_thw"].shape == (n_images, 3)
        assert int((ids == sp.image).sum()) == nd.PREPROCESSOR.num_image_tokens(batch["image_grid_thw"])


def test_images_render_deterministically():
    rng = random.Random(8)
    spec = nd.random_image_spec(4071, rng, nd.find_fonts("default"))
    a, b = spec.render(), spec.render()
    assert a.size == (spec.width, spec.height) and a.tobytes() == b.tobytes()
    seed = nd.seed_image_spec()
    assert seed.number == 427 and seed.render().size == (112, 56)


def test_shipped_tools_json_is_the_generators_tools():
    import json

    shipped = Path(__file__).resolve().parents[1] / "examples" / "nano" / "tools.json"
    assert json.loads(shipped.read_text(encoding="utf-8")) == nd.TOOLS


def test_long_city_names_and_their_heldout_split(gen, heldout):
    assert len(nd.LONG_CITIES) >= 150 and len(set(nd.CITIES)) == len(nd.CITIES)
    for name in nd.LONG_CITIES:
        assert 10 <= len(name) <= 15 and (not name.isascii() or any(c in name for c in " -'")), name
    assert sum(not c.isascii() for c in nd.LONG_CITIES) >= 80 and sum(" " in c for c in nd.LONG_CITIES) >= 80
    # no long name holds another city's name (or the held-out and training texts would overlap)
    assert not [(c, o) for c in nd.LONG_CITIES for o in nd.CITIES if c != o and (c in o or o in c)]
    long_held = set(heldout.long_cities)
    assert len(long_held) == nd.N_HELDOUT_LONG_CITIES and long_held <= set(nd.LONG_CITIES)
    assert not long_held & set(heldout.cities) and not long_held & set(heldout.train_cities)
    assert any(not c.isascii() for c in long_held) and any(" " in c for c in long_held)
    # training weather calls practise long names at about LONG_CITY_SHARE, never a held-out one
    rng = random.Random(9)
    drawn = [gen.train_city(rng) for _ in range(4000)]
    share = sum(c in nd.LONG_CITIES for c in drawn) / len(drawn)
    assert abs(share - nd.LONG_CITY_SHARE - (1 - nd.LONG_CITY_SHARE) * len(heldout.train_long_cities)
               / len(heldout.train_cities)) < 0.04
    assert not set(drawn) & heldout.city_set
    # splits written before long names existed still load (with none held out)
    raw = heldout.to_json()
    raw.pop("long_cities")
    assert nd.Heldout.from_json(raw).long_cities == ()
    # the teacher-forced evaluation has a kind of its own for them
    kinds = {ex.kind for ex in nd.eval_examples(gen, 2, 0)}
    assert "tool_long_city" in kinds


RELEASE_TEMPLATE = Path(__file__).resolve().parents[2] / "shared" / "testdata" / "release_chat_template.jinja"


def test_prompts_are_what_the_release_template_renders(gen):
    if not RELEASE_TEMPLATE.is_file():
        pytest.skip(f"{RELEASE_TEMPLATE} is absent (the shared test data sits beside the repository)")
    template = RELEASE_TEMPLATE.read_text(encoding="utf-8")
    rng = random.Random(10)
    examples = [gen.sample(rng) for _ in range(120)] + [gen.tool(rng, stage="answer", thinking=t)
                                                         for t in ("enabled", "adaptive", "disabled")]
    for ex in examples:
        if ex.kind == "text":
            continue
        assert chat.render_chat_template(template, ex.meta["messages"], ex.meta["tools"], ex.meta["thinking"]) \
            == ex.prompt


def test_shipped_checkpoints_heldout_items_stay_held_out():
    # Continuing the embedded default's training (train.py --init) must not train on its held-out
    # items: the seed's split keeps every item it had before the long names were added.
    import json

    from minimax_ref.weights.embedded import default_checkpoint

    raw = json.loads((default_checkpoint() / "nano_run.json").read_text(encoding="utf-8"))["heldout"]
    shipped, now = nd.Heldout.from_json(raw), nd.make_heldout(raw["seed"])
    assert (shipped.cities, shipped.order_ids, shipped.arithmetic, shipped.image_numbers) == \
        (now.cities, now.order_ids, now.arithmetic, now.image_numbers)
    assert shipped.long_cities in ((), now.long_cities)
