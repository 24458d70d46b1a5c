"""Chat rendering (built-in and jinja2), reasoning split and tool-call parsing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minimax_ref.errors import InputError
from minimax_ref.generation.chat import (
    CHAT_TEMPLATE,
    EVAL_SAMPLING,
    RECOMMENDED_SAMPLING,
    StreamingParser,
    normalize_messages,
    normalize_tools,
    parse_output,
    render_chat,
    render_chat_template,
    render_tool_call,
    render_tool_calls,
)
from minimax_ref.generation.tokenizer import StreamDecoder, load_tokenizer
from minimax_ref.weights.synth_tokenizer import write_test_tokenizer

NS = "]<]minimax[>["

# ------------------------------------------------------------------------------------------------
# Expected renderings, written out by hand
# ------------------------------------------------------------------------------------------------
SYSTEM_HEAD = (
    "]~!b[]~b]system\n"
    "Your model version is MiniMax-M3, developed by MiniMax. Knowledge cutoff: January 2026. Founded "
    "in early 2022, MiniMax is a global AI foundation model company committed to advancing the frontiers "
    "of AI towards AGI.\n"
    "\n"
    "<thinking_instructions>\n"
    "You have a thinking capability that allows you to reason step by step before responding. When "
    "thinking is enabled, wrap your reasoning in <mm:think></mm:think> tags before your response. When "
    "thinking is disabled, begin your response directly after the </mm:think> prefix. When thinking is "
    "adaptive, decide on your own whether to think for the current turn.\n"
)
MODE_LINE = {
    "adaptive": "Current thinking mode: adaptive. You are encouraged to think for complex decision-making, "
    "multi-step reasoning, or when analyzing function/tool results.\n",
    "enabled": "Current thinking mode: enabled. You MUST think step by step before every response, "
    "including after receiving function/tool results.\n",
    "disabled": "Current thinking mode: disabled. Do not output any thinking process.\n",
}
SYSTEM_TAIL = "</thinking_instructions>[e~[\n"
PROMPT = {"adaptive": "]~b]ai\n", "enabled": "]~b]ai\n<mm:think>", "disabled": "]~b]ai\n</mm:think>"}


def head(mode: str) -> str:
    return SYSTEM_HEAD + MODE_LINE[mode] + SYSTEM_TAIL


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather & forecast for a city (\"name\" in local spelling).",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
ORDER_TOOL = {
    "name": "lookup_order",
    "description": "Find an order.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
}

TOOLS_TEXT = (
    "\n\n# Tools\n"
    "You may call one or more tools to assist with the user query.\n"
    "Here are the tools available in JSONSchema format:\n"
    "\n<tools>\n"
    '<tool>{"name": "get_weather", "description": "Current weather & forecast for a city (\\"name\\" in '
    'local spelling).", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, '
    '"days": {"type": "integer"}}, "required": ["city"]}}</tool>\n'
    '<tool>{"name": "lookup_order", "description": "Find an order.", "parameters": {"type": "object", '
    '"properties": {"order_id": {"type": "string"}}}}</tool>\n'
    "</tools>\n"
    "\n"
    "To call tools, wrap all invocations in a single ]<]minimax[>[<tool_call>]<]minimax[>[</tool_call> block. "
    "Parameter values containing nested objects or arrays are recursively expanded into XML elements. Example:\n"
    "\n"
    "]<]minimax[>[<tool_call>\n"
    ']<]minimax[>[<invoke name="tool-name-1">]<]minimax[>[<param-1>value-1]<]minimax[>[</param-1>'
    "]<]minimax[>[<param-2>]<]minimax[>[<item>]<]minimax[>[<key-a>val-a]<]minimax[>[</key-a>"
    "]<]minimax[>[<key-b>val-b]<]minimax[>[</key-b>]<]minimax[>[</item>]<]minimax[>[</param-2>"
    "]<]minimax[>[</invoke>\n"
    ']<]minimax[>[<invoke name="tool-name-2">]<]minimax[>[<param-1>value-1]<]minimax[>[</param-1>'
    "]<]minimax[>[</invoke>\n"
    "]<]minimax[>[</tool_call>"
)

SIMPLE = [{"role": "user", "content": "What is 2+2?"}]
MULTI = [
    {"role": "system", "content": "Answer tersely."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
    {"role": "user", "content": "And 3+3?"},
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Yaoundé and Genève for 2 days?"},
    {
        "role": "assistant",
        "content": "Checking both.\n\n",
        "reasoning_content": "Two cities, call twice.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": '{"city": "Yaoundé", "days": 2}'}},
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Genève", "days": 2}}},
        ],
    },
    {"role": "tool", "content": "{\"temp\": 31, \"sky\": \"sunny\"}"},
    {"role": "tool", "content": "8°C, rain"},
]

EXPECTED_SIMPLE = {
    mode: head(mode) + "]~b]developer\nYou are a helpful assistant.[e~[\n"
    "]~b]user\nWhat is 2+2?[e~[\n" + PROMPT[mode]
    for mode in ("adaptive", "enabled", "disabled")
}
EXPECTED_MULTI = (
    head("adaptive")
    + "]~b]developer\nAnswer tersely.[e~[\n"
    "]~b]user\nWhat is 2+2?[e~[\n"
    "]~b]ai\n<mm:think>Two plus two is four.</mm:think>4[e~[\n"
    "]~b]user\nAnd 3+3?[e~[\n"
    "]~b]ai\n"
)
EXPECTED_TOOLS = (
    head("enabled")
    + "]~b]developer\nYou are a helpful assistant." + TOOLS_TEXT + "[e~[\n"
    "]~b]user\nWeather in Yaoundé and Genève for 2 days?[e~[\n"
    "]~b]ai\n<mm:think>Two cities, call twice.</mm:think>Checking both.\n\n"
    "]<]minimax[>[<tool_call>\n"
    ']<]minimax[>[<invoke name="get_weather">]<]minimax[>[<city>Yaoundé]<]minimax[>[</city>'
    "]<]minimax[>[<days>2]<]minimax[>[</days>]<]minimax[>[</invoke>\n"
    ']<]minimax[>[<invoke name="get_weather">]<]minimax[>[<city>Genève]<]minimax[>[</city>'
    "]<]minimax[>[<days>2]<]minimax[>[</days>]<]minimax[>[</invoke>\n"
    "]<]minimax[>[</tool_call>[e~[\n"
    ']~b]tool\n<response>{"temp": 31, "sky": "sunny"}</response>\n'
    "<response>8°C, rain</response>[e~[\n"
    "]~b]ai\n<mm:think>"
)


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory) -> tuple[Path, Path]:
    with_template = tmp_path_factory.mktemp("tok_jinja")
    write_test_tokenizer(with_template, 2048)
    builtin = tmp_path_factory.mktemp("tok_builtin")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(with_template / name, builtin / name)
    return with_template, builtin


@pytest.fixture(scope="module")
def toks(tok_dirs):
    jinja_tok, builtin_tok = (load_tokenizer(d) for d in tok_dirs)
    assert jinja_tok.chat_template is not None and builtin_tok.chat_template is None
    return jinja_tok, builtin_tok


@pytest.mark.parametrize("mode", ["adaptive", "enabled", "disabled"])
def test_render_simple_each_mode(mode):
    assert render_chat(SIMPLE, thinking=mode) == EXPECTED_SIMPLE[mode]
    assert render_chat_template(CHAT_TEMPLATE, SIMPLE, thinking=mode) == EXPECTED_SIMPLE[mode]


def test_render_multi_turn_keeps_reasoning():
    assert render_chat(MULTI) == EXPECTED_MULTI
    assert render_chat_template(CHAT_TEMPLATE, MULTI) == EXPECTED_MULTI


def test_render_tools_calls_and_results():
    tools = [WEATHER_TOOL, ORDER_TOOL]
    assert render_chat(TOOL_CONVERSATION, tools, thinking="enabled") == EXPECTED_TOOLS
    assert render_chat_template(CHAT_TEMPLATE, TOOL_CONVERSATION, tools, thinking="enabled") == EXPECTED_TOOLS


def test_no_generation_prompt_and_developer_role():
    msgs = [{"role": "developer", "content": ""}, {"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    # an empty developer message falls back to the default text, as the release renders it
    expected = (head("disabled") + "]~b]developer\nYou are a helpful assistant.[e~[\n"
                "]~b]user\n]<]image[>[What is this?[e~[\n")
    assert render_chat(msgs, thinking="disabled", add_generation_prompt=False) == expected
    assert render_chat_template(CHAT_TEMPLATE, msgs, thinking="disabled", add_generation_prompt=False) \
        == expected


CONVERSATIONS = [
    (SIMPLE, None, "adaptive"),
    (SIMPLE, [WEATHER_TOOL], "disabled"),
    (MULTI, None, "enabled"),
    (MULTI, [ORDER_TOOL], "adaptive"),
    (TOOL_CONVERSATION, [WEATHER_TOOL, ORDER_TOOL], "enabled"),
    (TOOL_CONVERSATION, [WEATHER_TOOL], "disabled"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"name": "f", "arguments": {"a": {"b": [1, 2.5, True, None, "s"], "c": None}, "d": []}}]}],
     None, "adaptive"),
]


@pytest.mark.parametrize("messages,tools,mode", CONVERSATIONS)
def test_jinja_and_builtin_give_identical_ids(toks, messages, tools, mode):
    jinja_tok, builtin_tok = toks
    a = jinja_tok.apply_chat_template(messages, tools=tools, thinking=mode)
    b = builtin_tok.apply_chat_template(messages, tools=tools, thinking=mode)
    assert isinstance(a, list) and a == b
    text = builtin_tok.apply_chat_template(messages, tools=tools, thinking=mode, tokenize=False)
    assert isinstance(text, str)
    assert text == render_chat(messages, tools, mode)
    assert jinja_tok.apply_chat_template(messages, tools=tools, thinking=mode, tokenize=False) == text
    assert builtin_tok.decode(a) == text
    s = builtin_tok.special_ids
    assert a[0] == s.bod and a[1] == s.turn_start
    assert a.count(s.turn_end) == text.count("[e~[")


def test_rendered_special_tokens_are_single_ids(toks):
    _, tok = toks
    ids = tok.apply_chat_template(TOOL_CONVERSATION, tools=[WEATHER_TOOL], thinking="enabled")
    s = tok.special_ids
    assert ids[-1] == s.think_start
    text = render_chat(TOOL_CONVERSATION, [WEATHER_TOOL], "enabled")
    for name, token in (("namespace", NS), ("turn_start", "]~b]"), ("think_end", "</mm:think>")):
        assert ids.count(getattr(s, name)) == text.count(token) > 0


def test_sampling_constants():
    assert RECOMMENDED_SAMPLING == {"temperature": 1.0, "top_p": 0.95, "top_k": 40}
    assert EVAL_SAMPLING == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "messages,tools,match",
    [
        ([{"role": "robot", "content": "hi"}], None, r"messages\[0\].role"),
        ([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}], None, r"messages\[1\]"),
        ([{"role": "user"}], None, r"messages\[0\]: missing 'content'"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], None, r"messages\[1\]"),
        ([{"role": "user", "content": 5}], None, r"messages\[0\].content"),
        ("hello", None, "messages"),
        (SIMPLE, [{"type": "function", "function": {"name": "f", "parameters": "string"}}], "tool 'f'"),
        (SIMPLE, [{"name": "f", "parameters": {"type": "array"}}], "tool 'f'"),
        (SIMPLE, [{"name": "g", "parameters": {"type": "object", "properties": ["a"]}}], "tool 'g'"),
        (SIMPLE, [{"name": "h", "parameters": {"type": "object", "properties": {"a": {"type": "str"}}}}],
         r"tool 'h'.*properties\.a"),
        (SIMPLE, [{"name": "h", "parameters": {"type": "object", "properties": {"a": 3}}}], "tool 'h'"),
        (SIMPLE, [{"description": "no name"}], r"tools\[0\]"),
        (SIMPLE, ["f"], r"tools\[0\]"),
        ([{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "{bad"}]}], None,
         r"messages\[0\].tool_calls\[0\].arguments"),
        ([{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {"a": NS}}]}], None,
         "namespace token"),
    ],
)
def test_bad_input(messages, tools, match):
    with pytest.raises(InputError, match=match):
        render_chat(messages, tools)
    with pytest.raises(InputError, match=match):
        render_chat_template(CHAT_TEMPLATE, messages, tools)


def test_bad_thinking_mode_and_bad_tool_values():
    with pytest.raises(InputError, match="thinking"):
        render_chat(SIMPLE, thinking="sometimes")
    with pytest.raises(InputError, match="namespace"):
        render_tool_call("f", {"a": "x" + NS})
    with pytest.raises(InputError, match="JSON"):
        render_tool_call("f", {"a": float("nan")})
    with pytest.raises(InputError, match="argument name"):
        render_tool_call("f", {"a<b": 1})
    with pytest.raises(InputError, match="function name"):
        render_tool_call('f"', {})
    with pytest.raises(InputError, match="tool 'f'"):
        parse_output("x", tools=[{"name": "f", "parameters": {"type": "string"}}])


# ------------------------------------------------------------------------------------------------
# Parsing
# ------------------------------------------------------------------------------------------------
def call(name: str, **args) -> str:
    """A hand-written tool-call block (newlines between elements)."""
    inner = "".join(f"{NS}<{k}>{v}{NS}</{k}>\n" for k, v in args.items())
    return f'{NS}<tool_call>\n{NS}<invoke name="{name}">\n{inner}{NS}</invoke>\n{NS}</tool_call>'


RICH_TOOL = {
    "name": "plan_trip",
    "parameters": {
        "type": "object",
        "properties": {
            "stops": {"type": "array", "items": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "nights": {"type": "integer"},
                               "coords": {"type": "array", "items": {"type": "number"}}}}},
            "budget": {"type": ["number", "null"]},
            "flexible": {"type": "boolean"},
            "mode": {"enum": ["train", "plane", 3]},
            "notes": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
            "meta": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
                     "additionalProperties": {"type": "integer"}},
        },
    },
}
ORDER_INT_TOOL = {"name": "refund", "parameters": {"type": "object", "properties": {
    "order_id": {"type": "integer"}, "amount": {"type": "number"}}}}
TOOLS = [WEATHER_TOOL, ORDER_TOOL, RICH_TOOL, ORDER_INT_TOOL]

MISMATCHED = (f'{NS}<tool_call>{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</town>'
              f"{NS}</invoke>{NS}</tool_call>")
PARSE_CASES = [
    # (text, reasoning_started, expected reasoning, content, tool calls, number of errors)
    ("<mm:think>The user wants weather.</mm:think>\n\nSure." + call("get_weather", city="Yaoundé", days="3"),
     False, "The user wants weather.", "\n\nSure.", [("get_weather", {"city": "Yaoundé", "days": 3})], 0),
    (f'{NS}<tool_call>\n{NS}<invoke name="get_weather">\n{NS}<city>Yaoundé{NS}</city>\n{NS}</invoke>\n'
     f'{NS}<invoke name="get_weather">{NS}<city>Genève{NS}</city>{NS}<days>\n2\n{NS}</days>{NS}</invoke>'
     f"\n{NS}</tool_call>",
     False, None, "", [("get_weather", {"city": "Yaoundé"}), ("get_weather", {"city": "Genève", "days": 2})],
     0),
    ("A" + call("get_weather", city="Genève") + "B" + call("get_weather", city="Lisbon") + "C",
     False, None, "ABC", [("get_weather", {"city": "Genève"}), ("get_weather", {"city": "Lisbon"})], 0),
    ("</mm:think>" + call("lookup_order", order_id="RD-57931-D6"),
     False, None, "", [("lookup_order", {"order_id": "RD-57931-D6"})], 0),
    (call("lookup_order", order_id="57931"), False, None, "", [("lookup_order", {"order_id": "57931"})], 0),
    (call("refund", order_id="RD-57931-D6", amount="12.50"),
     False, None, "", [("refund", {"order_id": "RD-57931-D6", "amount": 12.5})], 1),
    ("</mm:think>The answer is 4.", False, None, "The answer is 4.", [], 0),
    ("</mm:think>", False, None, "", [], 0),
    ("I should check the weather first." + call("get_weather", city="Genève"),
     True, "I should check the weather first.", "", [("get_weather", {"city": "Genève"})], 0),
    ("<mm:think>Need the weather." + call("get_weather", city="Yaoundé") + "tail",
     False, "Need the weather.", "tail", [("get_weather", {"city": "Yaoundé"})], 0),
    ("Let me reason</mm:think>Done.", True, "Let me reason", "Done.", [], 0),
    ("<mm:think>still thinking when the budget ran ou", False, "still thinking when the budget ran ou", "",
     [], 1),
    ("Checking." + call("get_weather", city="Lisbon")[:-20], False, None,
     "Checking." + call("get_weather", city="Lisbon")[:-20], [], 1),
    ("Checking." + f"{NS}<tool_call>\n{NS}<invoke name=\"get_weather\">\n{NS}<city>Lis",
     False, None, f"Checking.{NS}<tool_call>\n{NS}<invoke name=\"get_weather\">\n{NS}<city>Lis", [], 1),
    (call("lookup_order", order_id=' a < b && "c" \'d\' </x> &amp; '), False, None, "",
     [("lookup_order", {"order_id": ' a < b && "c" \'d\' </x> &amp; '})], 0),
    (call("lookup_order", order_id="\n  padded value\t\n"), False, None, "",
     [("lookup_order", {"order_id": "\n  padded value\t\n"})], 0),
    (call("lookup_order", order_id=""), False, None, "", [("lookup_order", {"order_id": ""})], 0),
    (call("get_weather", city="Paris", days="three"), False, None, "",
     [("get_weather", {"city": "Paris", "days": "three"})], 1),
    (call("get_weather", days="3"), False, None, "", [("get_weather", {"days": 3})], 1),  # city required
    (call("send_email", to="a@b.c", n="3"), False, None, "", [("send_email", {"to": "a@b.c", "n": "3"})], 1),
    (call(
        "plan_trip",
        stops=f"\n{NS}<item>{NS}<city>Yaoundé{NS}</city>{NS}<nights>2{NS}</nights>"
              f"{NS}<coords>{NS}<item>3.848{NS}</item>{NS}<item>11.502{NS}</item>{NS}</coords>{NS}</item>\n"
              f"{NS}<item>{NS}<city>Genève{NS}</city>{NS}<nights>1{NS}</nights>{NS}</item>\n",
        budget="null", flexible="true", mode="3", notes="7",
        meta=f"{NS}<tags>{NS}<item>a{NS}</item>{NS}</tags>{NS}<rooms>2{NS}</rooms>"),
     False, None, "",
     [("plan_trip", {"stops": [{"city": "Yaoundé", "nights": 2, "coords": [3.848, 11.502]},
                               {"city": "Genève", "nights": 1}],
                     "budget": None, "flexible": True, "mode": 3, "notes": 7,
                     "meta": {"tags": ["a"], "rooms": 2}})], 0),
    (call("plan_trip", budget="1e3", flexible="maybe", mode="bus", notes="seven",
          stops='[{"city": "Lisbon", "nights": 1}]', meta=""),
     False, None, "",
     [("plan_trip", {"budget": 1000.0, "flexible": "maybe", "mode": "bus", "notes": "seven",
                     "stops": [{"city": "Lisbon", "nights": 1}], "meta": {}})], 2),
    (call("plan_trip", stops=f"{NS}<item>{NS}<nights>x{NS}</nights>{NS}</item>"), False, None, "",
     [("plan_trip", {"stops": [{"nights": "x"}]})], 1),
    (MISMATCHED + "after", False, None, MISMATCHED + "after", [], 1),
    (f"{NS}<tool_call>oops{NS}</tool_call>", False, None, f"{NS}<tool_call>oops{NS}</tool_call>", [], 1),
    ("Plain answer with a stray ]<]minimax[>[ token and <mm:think> text.", False, None,
     "Plain answer with a stray ]<]minimax[>[ token and <mm:think> text.", [], 0),
    ("", False, None, "", [], 0),
    ("", True, "", "", [], 1),
]


@pytest.mark.parametrize("text,started,reasoning,content,calls,n_errors", PARSE_CASES)
def test_parse_table(text, started, reasoning, content, calls, n_errors):
    got = parse_output(text, TOOLS, reasoning_started=started)
    assert got["reasoning"] == reasoning
    assert got["content"] == content
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == calls
    assert len(got["errors"]) == n_errors, got["errors"]
    # Types survive exactly (1 == 1.0 == True in Python).
    assert json.dumps(got["tool_calls"]) == json.dumps([{"name": n, "arguments": a} for n, a in calls])
    # The same text fed one character at a time gives the same result.
    parser = StreamingParser(TOOLS, reasoning_started=started)
    for ch in text:
        parser.feed(ch)
    parser.finish()
    assert parser.result() == got


def test_parse_without_tools_keeps_strings():
    got = parse_output(call("get_weather", city="Lisbon", days="3"))
    assert got["tool_calls"] == [{"name": "get_weather", "arguments": {"city": "Lisbon", "days": "3"}}]
    assert got["errors"] == []


def test_error_messages_name_the_call_and_argument():
    got = parse_output(call("get_weather", city="Paris", days="three"), TOOLS)
    assert "get_weather" in got["errors"][0] and "days" in got["errors"][0] and "three" in got["errors"][0]


def test_streaming_holds_back_possible_tags():
    p = StreamingParser(TOOLS)
    assert p.feed("Hello ]<]mini") == [{"type": "content", "text": "Hello "}]
    assert p.feed("max[>[<tool") == []
    events = p.feed("_call>")
    assert events == []
    block = call("get_weather", city="Genève")[len(NS + "<tool_call>"):]
    events = p.feed(block)
    assert events == [{"type": "tool_call", "name": "get_weather", "arguments": {"city": "Genève"}}]
    assert p.feed("bye") == [{"type": "content", "text": "bye"}]
    assert p.finish() == []
    r = StreamingParser(reasoning_started=True)
    assert r.feed("abc</mm:th") == [{"type": "reasoning", "text": "abc"}]
    assert r.feed("ink>x") == [{"type": "content", "text": "x"}]
    s = StreamingParser()
    assert s.feed("<mm:") == []
    assert s.feed("thi") == []
    assert s.feed("nk>") == []
    assert s.feed("r") == [{"type": "reasoning", "text": "r"}]


def test_round_trip_through_tokenizer_stream(toks):
    _, tok = toks
    text = ("<mm:think>Weather for Genève 😀</mm:think>Sure!\n"
            + call("get_weather", city="Genève", days="2") + "\nDone.")
    ids = tok.encode(text, add_special_tokens=False)
    dec, parser, events = StreamDecoder(tok), StreamingParser([WEATHER_TOOL]), []
    for tid in ids:
        events += parser.feed(dec.push(tid))
    events += parser.feed(dec.finish()) + parser.finish()
    assert parser.result() == parse_output(text, [WEATHER_TOOL])
    assert parser.result()["tool_calls"] == [
        {"name": "get_weather", "arguments": {"city": "Genève", "days": 2}}]
    assert [e["type"] for e in events if e["type"] != "content"][-1] == "tool_call"


# ------------------------------------------------------------------------------------------------
# Property tests
# ------------------------------------------------------------------------------------------------
KEYS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
TRICKY = st.sampled_from(["", " ", "\n", " lead", "trail \n", "a < b & c", '"q" \'s\'', "]<]minimax[>",
                          "<city>x</city>", "</mm:think>", "[e~[", "Yaoundé", "Genève", "RD-57931-D6",
                          "12", "true", "null", "{}", "]<]minimax[>[".replace("[>[", "[>")])
STRINGS = st.one_of(st.text(), TRICKY, st.lists(st.one_of(st.text(max_size=3), TRICKY)).map("".join)) \
    .filter(lambda s: NS not in s)

SCALAR_SCHEMAS = st.sampled_from([
    {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
    {"type": ["integer", "boolean"]}, {"anyOf": [{"type": "number"}, {"type": "boolean"}]},
    {"type": "string", "enum": ["red", "green", "Genève"]}, {"enum": ["a", 2, True]},
    {"oneOf": [{"type": "boolean"}, {"type": "array", "items": {"type": "integer"}}]},
])


def _extend(children):
    return st.one_of(
        st.dictionaries(KEYS, children, max_size=4).map(lambda p: {"type": "object", "properties": p}),
        children.map(lambda s: {"type": "array", "items": s}),
        children.map(lambda s: {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"v": s}}]}),
    )


SCHEMAS = st.recursive(SCALAR_SCHEMAS, _extend, max_leaves=8)


def values_for(schema):
    """Values that conform to `schema` and are not ambiguous under it."""
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([values_for(s) for s in schema.get("anyOf", schema.get("oneOf"))])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    t = schema["type"]
    if isinstance(t, list):
        return st.one_of([values_for({"type": x}) for x in t])
    if t == "string":
        return STRINGS
    if t == "integer":
        return st.integers(min_value=-(2**70), max_value=2**70)
    if t == "number":
        return st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers())
    if t == "boolean":
        return st.booleans()
    if t == "array":
        return st.lists(values_for(schema["items"]), max_size=4)
    props = schema["properties"]
    return st.fixed_dictionaries({}, optional={k: values_for(s) for k, s in props.items()})


@st.composite
def tool_and_arguments(draw):
    props = draw(st.dictionaries(KEYS, SCHEMAS, min_size=0, max_size=5))
    args = draw(st.fixed_dictionaries({}, optional={k: values_for(s) for k, s in props.items()}))
    tool = {"type": "function", "function": {"name": "fn_1", "parameters": {
        "type": "object", "properties": props}}}
    return tool, args


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tool_and_arguments())
def test_render_then_parse_is_identity(tool_args):
    tool, args = tool_args
    text = render_tool_call("fn_1", args)
    got = parse_output(text, [tool])
    assert got == {"reasoning": None, "content": "", "errors": [],
                   "tool_calls": [{"name": "fn_1", "arguments": args}]}
    # bool/int/float distinctions survive too.
    assert json.dumps(got["tool_calls"][0]["arguments"]) == json.dumps(args)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tool_and_arguments(), st.sampled_from(["adaptive", "enabled", "disabled"]))
def test_jinja_renders_arbitrary_tool_calls_like_builtin(tool_args, mode):
    tool, args = tool_args
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "ok", "tool_calls": [{"name": "fn_1", "arguments": args}]},
            {"role": "tool", "content": json.dumps(args, ensure_ascii=False)}]
    assert render_chat_template(CHAT_TEMPLATE, msgs, [tool], mode) == render_chat(msgs, [tool], mode)


PIECES = st.one_of(
    st.sampled_from(["<mm:think>", "</mm:think>", NS, NS + "<tool_call>", NS + "</tool_call>", "\n",
                     NS + '<invoke name="get_weather">', NS + "</invoke>", NS + "<city>", NS + "</city>",
                     "Genève", "Yaoundé", "<", "]<]", "mini", "[>[", "<tool_call>", "3"]),
    st.text(max_size=6),
    st.builds(lambda c, d: call("get_weather", city=c, days=d), st.sampled_from(["Yaoundé", "Genève", " x "]),
              st.sampled_from(["2", "two", ""])),
)


@st.composite
def text_and_splits(draw):
    text = "".join(draw(st.lists(PIECES, max_size=12)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=10)))
    return text, cuts


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text_and_splits(), st.booleans())
def test_streaming_any_split_equals_one_shot(text_cuts, started):
    text, cuts = text_cuts
    expected = parse_output(text, [WEATHER_TOOL], reasoning_started=started)
    parser = StreamingParser([WEATHER_TOOL], reasoning_started=started)
    events = []
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        events += parser.feed(text[a:b])
    events += parser.finish()
    assert parser.result() == expected
    assert "".join(e["text"] for e in events if e["type"] == "content") == expected["content"]
    assert "".join(e["text"] for e in events if e["type"] == "reasoning") == (expected["reasoning"] or "")
    assert [{"name": e["name"], "arguments": e["arguments"]} for e in events if e["type"] == "tool_call"] \
        == expected["tool_calls"]
    assert [e["message"] for e in events if e["type"] == "error"] == expected["errors"]
    # Nothing is lost: every character is reasoning, content or part of a parsed call.
    if not expected["tool_calls"]:
        markers = len(text) - len(expected["content"]) - len(expected["reasoning"] or "")
        assert markers in (0, len("<mm:think>"), len("</mm:think>"), len("<mm:think></mm:think>"))


def test_render_tool_calls_several_invokes():
    text = render_tool_calls([{"name": "a", "arguments": {}},
                              {"type": "function", "function": {"name": "b", "arguments": '{"x": 1}'}}])
    # the release's layout: one line per invoke, the arguments inline
    assert text == (f'{NS}<tool_call>\n{NS}<invoke name="a">{NS}</invoke>\n{NS}<invoke name="b">'
                    f"{NS}<x>1{NS}</x>{NS}</invoke>\n{NS}</tool_call>")
    assert parse_output(text)["tool_calls"] == [{"name": "a", "arguments": {}},
                                                {"name": "b", "arguments": {"x": "1"}}]


def test_transformers_renders_the_written_template_identically(tok_dirs, toks):
    # transformers' own chat-template machinery is an independent oracle for the jinja2 path; it is
    # given the conversation as render_chat_template hands it to the template (normalised).
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dirs[0]))
    _, builtin_tok = toks
    for messages, tools, mode in CONVERSATIONS:
        text = hf.apply_chat_template(normalize_messages(messages), tools=normalize_tools(tools) or None,
                                      tokenize=False, add_generation_prompt=True, thinking_mode=mode)
        assert text == render_chat(messages, tools, mode)
        assert hf.encode(text, add_special_tokens=False) == builtin_tok.apply_chat_template(
            messages, tools=tools, thinking=mode)


# ------------------------------------------------------------------------------------------------
# Repeated sibling tags and composition keywords at the root of `parameters`
# ------------------------------------------------------------------------------------------------
def tags(**groups) -> str:
    """Sibling tags, each name given once per value of its list: tags(a=["1", "2"]) -> <a>1</a><a>2</a>."""
    return "".join(f"{NS}<{k}>{v}{NS}</{k}>" for k, vs in groups.items() for v in vs)


def block(name: str, inner: str) -> str:
    return f'{NS}<tool_call>\n{NS}<invoke name="{name}">{inner}{NS}</invoke>\n{NS}</tool_call>'


def fn(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


ONE_OF_ROOT = fn("calc", {"oneOf": [{"properties": {"number": {"type": "number"}}, "required": ["number"]},
                                    {"properties": {"text": {"type": "string"}, "flag": {"type": "boolean"}},
                                     "required": ["text"]}]})
ANY_OF_ROOT = fn("calc2", {"anyOf": [{"properties": {"text": {"type": "string"}}},
                                     {"properties": {"number": {"type": "integer"}}}]})
ALL_OF_ROOT = fn("merge", {"type": "object", "properties": {"a": {"type": "integer"}},
                           "allOf": [{"properties": {"b": {"type": "boolean"}}, "required": ["b"]},
                                     {"allOf": [{"properties": {"c": {"type": "array",
                                                                      "items": {"type": "number"}}}}]}]})
NESTED_ONE_OF = fn("draw", {"type": "object", "properties": {"shape": {"oneOf": [
    {"properties": {"kind": {"const": "square"}, "side": {"type": "string"}}},
    {"properties": {"kind": {"const": "circle"}, "radius": {"type": "number"}}, "required": ["radius"]}]}}})
LISTS = fn("tagger", {"type": "object", "properties": {
    "tag": {"type": "array", "items": {"type": "integer"}},
    "label": {"type": "string"},
    "meta": {"type": "object", "properties": {"k": {"type": "array", "items": {"type": "boolean"}}}}}})
SCHEMA_TOOLS = [ONE_OF_ROOT, ANY_OF_ROOT, ALL_OF_ROOT, NESTED_ONE_OF, LISTS]

SCHEMA_CASES = [
    # (text, tools, expected calls, number of errors)
    (block("anything", tags(x=["a", "b"])), None, [("anything", {"x": ["a", "b"]})], 0),
    (block("anything", tags(x=["a", "b", "c"], y=["1"])), None, [("anything", {"x": ["a", "b", "c"], "y": "1"})], 0),
    (block("anything", f"{NS}<o>{tags(t=['a', 'b'])}{NS}</o>"), None, [("anything", {"o": {"t": ["a", "b"]}})], 0),
    (block("tagger", tags(tag=["1", "2"])), [LISTS], [("tagger", {"tag": [1, 2]})], 0),
    (block("tagger", tags(tag=[f"{NS}<item>1{NS}</item>{NS}<item>2{NS}</item>", "3"])), [LISTS],
     [("tagger", {"tag": [1, 2, 3]})], 0),
    (block("tagger", f"{NS}<meta>{tags(k=['true', 'false'])}{NS}</meta>"), [LISTS],
     [("tagger", {"meta": {"k": [True, False]}})], 0),
    (block("tagger", tags(label=["a", "b"])), [LISTS], [("tagger", {"label": ["a", "b"]})], 1),
    (block("calc", tags(number=["42"])), [ONE_OF_ROOT], [("calc", {"number": 42})], 0),
    (block("calc", tags(number=["4.5e1"])), [ONE_OF_ROOT], [("calc", {"number": 45.0})], 0),
    (block("calc", tags(text=["42"], flag=["true"])), [ONE_OF_ROOT], [("calc", {"text": "42", "flag": True})], 0),
    (block("calc", tags(flag=["true"])), [ONE_OF_ROOT], [("calc", {"flag": True})], 1),
    (block("calc2", tags(number=["7"])), [ANY_OF_ROOT], [("calc2", {"number": 7})], 0),
    (block("calc2", tags(text=["7"])), [ANY_OF_ROOT], [("calc2", {"text": "7"})], 0),
    (block("merge", tags(a=["1"], b=["false"], c=[f"{NS}<item>2.5{NS}</item>"])), [ALL_OF_ROOT],
     [("merge", {"a": 1, "b": False, "c": [2.5]})], 0),
    (block("merge", tags(a=["1"])), [ALL_OF_ROOT], [("merge", {"a": 1})], 1),
    (block("draw", f"{NS}<shape>{tags(kind=['circle'], radius=['2'])}{NS}</shape>"), [NESTED_ONE_OF],
     [("draw", {"shape": {"kind": "circle", "radius": 2}})], 0),
    (block("draw", f"{NS}<shape>{tags(kind=['square'], side=['2'])}{NS}</shape>"), [NESTED_ONE_OF],
     [("draw", {"shape": {"kind": "square", "side": "2"}})], 0),
]


@pytest.mark.parametrize("text,tools,calls,n_errors", SCHEMA_CASES)
def test_repeated_tags_and_composed_schemas(text, tools, calls, n_errors):
    got = parse_output("</mm:think>" + text, tools)
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == calls
    assert json.dumps(got["tool_calls"]) == json.dumps([{"name": n, "arguments": a} for n, a in calls])
    assert len(got["errors"]) == n_errors, got["errors"]
    assert got["content"] == ""
    # streaming, one character at a time and in two halves, gives the one-shot result
    for pieces in ([*text], [text[: len(text) // 2], text[len(text) // 2:]]):
        parser = StreamingParser(tools)
        events = parser.feed("</mm:think>")
        for piece in pieces:
            events += parser.feed(piece)
        events += parser.finish()
        assert parser.result() == got
        assert [{"name": e["name"], "arguments": e["arguments"]} for e in events if e["type"] == "tool_call"] \
            == got["tool_calls"]


def test_repeated_scalar_tag_error_names_it():
    got = parse_output(block("tagger", tags(label=["a", "b"])), [LISTS])
    assert "label" in got["errors"][0] and "2 times" in got["errors"][0]


CALLED = [{"role": "user", "content": "a"},
          {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {}}]}]


@pytest.mark.parametrize("messages,match", [
    ([{"role": "user", "content": "a"}, {"role": "root", "content": "b"}], r"messages\[1\]: a root message"),
    ([{"role": "root", "content": "r"}, {"role": "system", "content": "s"}, {"role": "developer", "content": "d"}],
     r"messages\[2\]: a developer message"),
    ([{"role": "user", "content": [{"type": "audio"}]}], r"messages\[0\].content\[0\]"),
    ([*CALLED, {"role": "tool", "content": [{"output": 5}]}], r"messages\[2\].content\[0\].output"),
    ([*CALLED, {"role": "tool", "content": None}], r"messages\[2\]: missing 'content'"),
    ([{"role": "system", "content": [{"type": "text", "text": ""}]}], r"messages\[0\].content: the parts hold no text"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": 5}],
     r"messages\[1\].reasoning_content"),
    ([*CALLED, {"role": "tool", "content": "1"}, {"role": "assistant", "content": "ok"},
      {"role": "tool", "content": "2"}], r"messages\[4\]: a tool result must come after"),
])
def test_bad_conversation_shapes_name_the_message(messages, match):
    with pytest.raises(InputError, match=match):
        render_chat(messages)
    with pytest.raises(InputError, match=match):
        render_chat_template(CHAT_TEMPLATE, messages)


def test_video_parts_render_as_the_video_token():
    text = render_chat([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x.mp4"}}, "What?"]}])
    assert "]~b]user\n]<]video[>[What?[e~[\n" in text
