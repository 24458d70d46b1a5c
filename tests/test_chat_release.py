"""The chat format of the release, exactly: the release's `chat_template.jinja` (from `../shared`,
rendered with jinja2 as transformers renders chat templates) against the built-in renderer
(`chat.render_chat`) and the project's own template (`chat.CHAT_TEMPLATE`) on a table of
conversations; conversations the release refuses are refused with an InputError naming the message.
Checkpoint folders' templates are held to the same table."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from minimax_ref.errors import InputError
from minimax_ref.generation import chat
from minimax_ref.generation.chat import CHAT_TEMPLATE, render_chat, render_chat_template

# CI has ../shared beside the clone; resolved from the repository root, never an absolute path.
RELEASE_TEMPLATE = Path(__file__).resolve().parents[2] / "shared" / "testdata" / "release_chat_template.jinja"
MODES = ("adaptive", "enabled", "disabled")
# The special-token variables a checkpoint's tokenizer_config.json gives the template (transformers and
# `Tokenizer.apply_chat_template` both pass them); the release template sets its own over them.
TOKEN_VARIABLES = {"bos_token": "]~!b[", "eos_token": "[e~["}


class Refused(Exception):
    """The release template called raise_exception."""


def _jinja_env():
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise Refused(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # transformers replaces jinja's HTML-escaping tojson with plain json.dumps
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols],
                                        undefined=jinja2.Undefined)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


@pytest.fixture(scope="module")
def release():
    if not RELEASE_TEMPLATE.is_file():
        pytest.skip(f"{RELEASE_TEMPLATE} is absent (the shared test data sits beside the repository)")
    template = _jinja_env().from_string(RELEASE_TEMPLATE.read_text(encoding="utf-8"))

    def render(messages, tools=None, mode="adaptive", add_generation_prompt=True) -> str:
        return template.render(messages=copy.deepcopy(messages), tools=copy.deepcopy(tools),
                               add_generation_prompt=add_generation_prompt, thinking_mode=mode, **TOKEN_VARIABLES)

    return render


def raw_template(source: str):
    """A template rendered on the messages exactly as given (as transformers hands them over)."""
    template = _jinja_env().from_string(source)
    return lambda messages, tools, mode, gp: template.render(
        messages=copy.deepcopy(messages), tools=copy.deepcopy(tools), add_generation_prompt=gp, thinking_mode=mode,
        **TOKEN_VARIABLES)


# ------------------------------------------------------------------------------------------------
# The table (messages in the form the release template reads: dict arguments, `image`/`video` parts)
# ------------------------------------------------------------------------------------------------
NS = chat.NS
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Forecast for a city (\"name\" in local spelling, e.g. Genève).",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "São Paulo, Reykjavík, Đà Nẵng..."},
        "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "days"]}}}
ORDER = {"type": "function", "function": {
    "name": "get_order", "description": "Look up an order & its <status>.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}
PLAN = {"type": "function", "function": {
    "name": "plan_trip", "description": "Plan a trip.",
    "parameters": {"type": "object", "properties": {
        "stops": {"type": "array", "items": {"type": "object", "properties": {
            "city": {"type": "string"}, "nights": {"type": "integer"}, "notes": {"type": ["string", "null"]}}}},
        "budget": {"type": ["number", "null"]}, "flexible": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}}}}}}
NO_PARAMS = {"type": "function", "function": {"name": "ping", "description": "Liveness check."}}


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}


def user(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def ai(content: Any = "", **kw: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content, **kw}


def tool(content: Any) -> dict[str, Any]:
    return {"role": "tool", "content": content}


Q = user("What is 17*23?")
WEATHER_TURNS = [
    user("Weather in Yaoundé and Genève for 2 days?"),
    ai("Checking both.\n\n", reasoning_content="Two cities: two calls.",
       tool_calls=[call("get_weather", city="Yaoundé", days=2), call("get_weather", city="Genève", days=2)]),
    tool('{"temp": 31, "sky": "sunny"}'),
    tool("8°C, rain"),
]
NESTED_ARGS = dict(
    stops=[{"city": "Cluj-Napoca", "nights": 2, "notes": None}, {"city": "Đà Nẵng", "nights": 1, "notes": "a < b & c"}],
    budget=None, flexible=True, tags=["x", None, "", "  spaced  "], extra={"deep": {"deeper": [1, 2.5, False, {}]}},
    empty_list=[], empty_dict={}, zero=0, neg=-3, big=10**20, small=1e-7, text='say "hi"\nand <b>bye</b>',
)

TABLE: list[tuple[str, list, list | None, str, bool]] = []


def case(name: str, messages: list, tools: list | None = None, modes: tuple[str, ...] = ("adaptive",),
         gp: bool = True) -> None:
    for mode in modes:
        TABLE.append((f"{name}-{mode}", messages, tools, mode, gp))


case("simple", [Q], modes=MODES)
case("no-generation-prompt", [Q, ai("391")], modes=MODES, gp=False)
case("empty-conversation", [])
case("system", [{"role": "system", "content": "Answer tersely."}, Q], modes=("enabled",))
case("developer", [{"role": "developer", "content": "You are a pirate."}, Q], modes=("disabled",))
case("empty-system-is-default", [{"role": "system", "content": ""}, Q])
case("none-system-is-default", [{"role": "developer", "content": None}, Q])
case("system-parts", [{"role": "system", "content": [{"type": "text", "text": "Be "},
                                                     {"type": "text", "text": "brief."}]}, Q])
case("root", [{"role": "root", "content": "You are Nano, a tiny model."}, Q], modes=MODES)
case("root-and-developer", [{"role": "root", "content": "You are Nano."}, {"role": "developer", "content": "Be kind."},
                            Q])
case("empty-root-is-identity", [{"role": "root", "content": ""}, {"role": "system", "content": "Hi."}, Q])
case("root-system-tools", [{"role": "root", "content": "You are Nano."}, {"role": "system", "content": "Use tools."},
                           user("Weather in Lisbon?")], [WEATHER], modes=("enabled",))
case("tools", [user("Weather in Lisbon for 3 days?")], [WEATHER, ORDER], modes=MODES)
case("tools-nested-schema", [user("Plan a trip.")], [PLAN, NO_PARAMS])
case("empty-tool-list", [Q], [])
case("tool-call-and-results", WEATHER_TURNS, [WEATHER], modes=MODES)
case("results-then-answer", [*WEATHER_TURNS, ai("Yaoundé: sunny, 31 °C. Genève: rain, 8 °C."),
                             user("Thanks! And order RD-57931-D6?")], [WEATHER, ORDER], modes=("enabled",))
case("one-result-per-call-turns", [user("Order RD-57931-D6?"),
                                   ai("", tool_calls=[call("get_order", order_id="RD-57931-D6")]), tool("shipped"),
                                   ai(None, tool_calls=[call("get_order", order_id="XY-00001-Z9")]), tool("delivered")],
     [ORDER], modes=("disabled",))
case("tool-result-parts", [user("Look."), ai("", tool_calls=[call("ping")]),
                           tool([{"type": "text", "text": "pong "}, {"type": "image"}, "raw", {"type": "video"},
                                 {"type": "text", "text": " done"}])], [NO_PARAMS])
case("tool-result-output-part", [user("Look."), ai("", tool_calls=[call("ping")]), tool([{"output": "pong"}])],
     [NO_PARAMS])
case("tool-result-empty", [user("Look."), ai("", tool_calls=[call("ping")]), tool("")], [NO_PARAMS])
case("tool-after-user", [user("a"), ai("", tool_calls=[call("ping")]), tool("1"), user("b"), tool("2")], [NO_PARAMS])
case("nested-arguments-none-booleans", [user("Plan."), ai("", tool_calls=[call("plan_trip", **NESTED_ARGS)])], [PLAN],
     modes=MODES)
case("bare-call-form", [user("Ping."), ai("ok", tool_calls=[{"name": "ping", "arguments": {"n": 1}}])], [NO_PARAMS],
     gp=False)
case("reasoning-in-history", [Q, ai("391", reasoning_content="17*23 = 340 + 51 = 391."), user("And 2+2?")],
     modes=MODES)
case("reasoning-every-turn", [user("a"), ai("A", reasoning_content="r1"), user("b"), ai("B", reasoning_content="r2"),
                              user("c")])
case("empty-reasoning-keeps-content", [Q, ai("<mm:think>kept</mm:think>391", reasoning_content=""), user("x")])
case("think-tags-in-content", [Q, ai("<mm:think>17*23 = 391</mm:think>391"), user("x")], modes=MODES)
case("think-tags-with-newlines", [Q, ai("\n<mm:think>\nworking\n</mm:think>\n\n391\n"), user("x")])
case("think-close-only", [Q, ai("working</mm:think>391"), user("x")])
case("two-think-closes", [Q, ai("<mm:think>a</mm:think>b</mm:think>c"), user("x")])
case("reasoning-with-calls-no-content", [user("Weather?"), ai(None, reasoning_content="Call it.",
                                                              tool_calls=[call("get_weather", city="Lisbon", days=3)]),
                                         tool("sunny")], [WEATHER], modes=("enabled",))
case("user-parts-image-video", [user([{"type": "image"}, {"type": "text", "text": "What number is this?"}]),
                                ai("427"), user(["And ", {"type": "video"}, {"type": "text", "text": " this?"}])])
case("assistant-parts", [Q, ai([{"type": "text", "text": "<mm:think>r</mm:think>"}, {"type": "text", "text": "391"}]),
                         user("x")])
case("unicode-and-markup", [user("¿Qué tal? 😀 <b>&amp;</b> ]~b] is not a turn"), ai("Très bien. 🙂")], gp=False)
case("long", [{"role": "system", "content": "Be brief."}, *WEATHER_TURNS, ai("Done.", reasoning_content="ok"),
              user("Order?"), ai("", tool_calls=[call("get_order", order_id="AB-12345-C6")]),
              tool([{"type": "text", "text": "{\"status\": \"shipped\"}"}]), ai("Shipped.")], [WEATHER, ORDER],
     modes=MODES)

REFUSED = [
    ("tool-first", [tool("x")], 0),
    ("tool-after-plain-answer", [user("a"), ai("b"), tool("x")], 2),
    ("tool-after-calls-then-plain", [user("a"), ai("", tool_calls=[call("ping")]), tool("1"), ai("ok"), tool("2")], 4),
]


def test_table_covers_the_issue():
    names = {n.rsplit("-", 1)[0] for n, *_ in TABLE}
    assert len(TABLE) >= 30 and {m for *_, m, _ in TABLE} == set(MODES)
    for needed in ("tools", "tool-call-and-results", "reasoning-in-history", "think-tags-in-content",
                   "nested-arguments-none-booleans", "root", "developer", "empty-system-is-default",
                   "tool-result-parts", "user-parts-image-video"):
        assert needed in names


@pytest.mark.parametrize("name,messages,tools,mode,gp", TABLE, ids=[t[0] for t in TABLE])
def test_release_template_builtin_and_own_template_agree(release, name, messages, tools, mode, gp):
    expected = release(messages, tools, mode, gp)
    assert render_chat(messages, tools, mode, gp) == expected
    # the project's template through the engine's template path (normalised messages) ...
    assert render_chat_template(CHAT_TEMPLATE, messages, tools, mode, gp, extra_variables=TOKEN_VARIABLES) == expected
    # ... and given the messages as they are, as transformers hands them to a checkpoint's template
    assert raw_template(CHAT_TEMPLATE)(messages, tools, mode, gp) == expected
    # the release template through the engine's template path
    assert render_chat_template(RELEASE_TEMPLATE.read_text(encoding="utf-8"), messages, tools, mode, gp,
                                extra_variables=TOKEN_VARIABLES) == expected


def test_release_layout_by_hand(release):
    # A few facts of the format written out independently of any renderer.
    text = release(WEATHER_TURNS, [WEATHER], "enabled", True)
    assert text.startswith("]~!b[]~b]system\nYour model version is MiniMax-M3")
    assert ("]~b]ai\n<mm:think>Two cities: two calls.</mm:think>Checking both.\n\n" + NS + "<tool_call>\n"
            + NS + '<invoke name="get_weather">' + NS + "<city>Yaoundé" + NS + "</city>" + NS + "<days>2" + NS
            + "</days>" + NS + "</invoke>\n") in text
    assert '\n<response>{"temp": 31, "sky": "sunny"}</response>\n<response>8°C, rain</response>[e~[\n' in text
    assert text.count("]~b]tool") == 1 and text.endswith("]~b]ai\n<mm:think>")
    assert ('<tool>{"name": "get_weather", "description": "Forecast for a city (\\"name\\" in local spelling, '
            'e.g. Genève).",') in text


@pytest.mark.parametrize("name,messages,index", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_like_the_release(release, name, messages, index):
    with pytest.raises(Refused):
        release(messages, [NO_PARAMS], "adaptive", True)
    with pytest.raises(InputError, match=rf"messages\[{index}\]"):
        render_chat(messages, [NO_PARAMS])
    with pytest.raises(InputError, match=rf"messages\[{index}\]"):
        render_chat_template(CHAT_TEMPLATE, messages, [NO_PARAMS])


# The engine's extra accepted forms render as the release renders their release form.
PROJECT_FORMS = [
    ("json-text-arguments",
     [user("w"), ai("", tool_calls=[{"type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Genève", "days": 2}'}}])],
     [user("w"), ai("", tool_calls=[call("get_weather", city="Genève", days=2)])], [WEATHER], [WEATHER]),
    ("image-url-parts",
     [user([{"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text", "text": "n?"}])],
     [user([{"type": "image"}, {"type": "text", "text": "n?"}])], None, None),
    ("bare-tool-definition",
     [user("w")], [user("w")], [WEATHER["function"]], [WEATHER]),
]


@pytest.mark.parametrize("name,ours,theirs,our_tools,their_tools", PROJECT_FORMS, ids=[p[0] for p in PROJECT_FORMS])
def test_accepted_extra_forms_render_as_their_release_form(release, name, ours, theirs, our_tools, their_tools):
    expected = release(theirs, their_tools, "adaptive", True)
    assert render_chat(ours, our_tools) == expected
    assert render_chat_template(CHAT_TEMPLATE, ours, our_tools) == expected


def test_transformers_renders_the_release_template_the_same(release):
    # transformers' own chat-template machinery (its environment, its field aliases) as a second oracle.
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    source = RELEASE_TEMPLATE.read_text(encoding="utf-8")
    for name, messages, tools, mode, gp in TABLE:
        got, _ = utils.render_jinja_template([copy.deepcopy(messages)], tools=copy.deepcopy(tools),
                                             chat_template=source, add_generation_prompt=gp, thinking_mode=mode,
                                             **TOKEN_VARIABLES)
        assert got[0] == render_chat(messages, tools, mode, gp), name
        # a checkpoint exported with the project's template, loaded by transformers, gets the same text
        ours, _ = utils.render_jinja_template([copy.deepcopy(messages)], tools=copy.deepcopy(tools),
                                              chat_template=CHAT_TEMPLATE, add_generation_prompt=gp,
                                              thinking_mode=mode, **TOKEN_VARIABLES)
        assert ours[0] == got[0], name
    # `reasoning` / `thinking` stand for `reasoning_content` there and here
    msgs = [Q, ai("391", reasoning="17*23"), user("x"), ai("4", thinking="2+2"), user("y")]
    got, _ = utils.render_jinja_template([msgs], chat_template=source, add_generation_prompt=True,
                                         thinking_mode="adaptive")
    assert got[0] == render_chat(msgs) == render_chat_template(CHAT_TEMPLATE, msgs)


# ------------------------------------------------------------------------------------------------
# Checkpoint folders: their own chat_template.jinja renders the release's text on the same table
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["test-tokenizer", "embedded-default"])
def checkpoint_tokenizer(request, tmp_path_factory):
    from minimax_ref.generation.tokenizer import load_tokenizer
    from minimax_ref.weights.embedded import default_checkpoint
    from minimax_ref.weights.synth_tokenizer import write_test_tokenizer

    if request.param == "test-tokenizer":
        folder = tmp_path_factory.mktemp("tok")
        write_test_tokenizer(folder, 2048)
    else:
        folder = default_checkpoint()
    return load_tokenizer(folder)


def test_checkpoint_template_renders_the_release_text(release, checkpoint_tokenizer):
    tok = checkpoint_tokenizer
    assert tok.chat_template is not None
    for name, messages, tools, mode, gp in TABLE:
        expected = release(messages, tools, mode, gp)
        text = tok.apply_chat_template(messages, tools=tools, thinking=mode, add_generation_prompt=gp, tokenize=False)
        assert text == expected, name
        ids = tok.apply_chat_template(messages, tools=tools, thinking=mode, add_generation_prompt=gp)
        assert ids == tok.encode(expected, add_special_tokens=False) and tok.decode(ids) == expected, name
