"""Chat rendering, reasoning split and tool-call parsing for MiniMax-M3 (spec `chat.md`).

Rendering
---------
`render_chat` is the built-in renderer; `render_chat_template` renders a checkpoint's jinja2 chat
template in a sandbox. `CHAT_TEMPLATE` is the project's jinja2 template; it renders exactly what
`render_chat` renders, and both render exactly what the release's `chat_template.jinja` renders for
every conversation they accept (the test tokenizer and exported checkpoints ship `CHAT_TEMPLATE`).
A conversation is::

    ]~!b[
    ]~b]system\\n{root message or IDENTITY_TEXT}\\n\\n<thinking_instructions>...</thinking_instructions>[e~[\\n
    ]~b]developer\\n{system/developer message or DEFAULT_SYSTEM_PROMPT}{tools section, when tools}[e~[\\n
    ]~b]user\\n{content}[e~[\\n
    ]~b]ai\\n<mm:think>{reasoning}</mm:think>{content}{tool-call block}[e~[\\n   (no reasoning: </mm:think>{content}...)
    ]~b]tool\\n<response>{result}</response>\\n<response>{result}</response>[e~[\\n   (consecutive results share a turn)
    ]~b]ai\\n  +  "" | "<mm:think>" | "</mm:think>"     (generation prompt: adaptive/enabled/disabled)

The tools section is `"\\n\\n" + tools_section(tools)`: `TOOLS_INTRO`, `<tools>` with one
`<tool>{function JSON}</tool>` line per tool (`json.dumps(tool["function"], ensure_ascii=False)`,
the caller's key order), `</tools>`, then `TOOLS_USAGE` and `TOOL_CALL_EXAMPLE`. A tool-call block is
`render_tool_calls`: the opener and a newline, then per call one line `<invoke name=...>` + its
arguments + `</invoke>` and a newline, then the closer (every tag namespaced). Values are raw text;
None is omitted from mappings (an item of a list that is None renders as an empty `<item>`).

Messages are first brought to one form by `normalize_messages` (string contents, parsed tool-call
arguments); conversations the release template refuses raise InputError naming the message.

Parsing
-------
`parse_output` and `StreamingParser` split generated text into reasoning, content and tool calls.
Reasoning and content keep their text exactly (no stripping). Tool-call argument values are coerced
by the tool's JSON schema; a value that does not fit stays a string and an error entry is added.
A malformed or truncated tool-call block is returned as content, with an error entry.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, InputError

# ----------------------------------------------------------------------------------------------
# Token texts (ids are read from the tokenizer files, never from here)
# ----------------------------------------------------------------------------------------------
BOD = "]~!b["
TURN_START = "]~b]"
TURN_END = "[e~["
IMAGE = "]<]image[>["
VIDEO = "]<]video[>["
IMAGE_START = "]<]start of image[>["
IMAGE_END = "]<]end of image[>["
THINK_START = "<mm:think>"
THINK_END = "</mm:think>"
NS = "]<]minimax[>["
DSPARK_NOISE = "]<]dspark_noise[>["  # decided here: the release's text for id 200058 is not public
TOOL_CALL_START = NS + "<tool_call>"
TOOL_CALL_END = NS + "</tool_call>"

THINKING_MODES = ("adaptive", "enabled", "disabled")
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

#: MiniMax's recommended sampling settings.
RECOMMENDED_SAMPLING: dict[str, float | int] = dict(temperature=1.0, top_p=0.95, top_k=40)
#: The sampling settings of the seed's evaluation protocol.
EVAL_SAMPLING: dict[str, float | int] = dict(temperature=0.6, top_p=0.95, top_k=20)

#: The first turn's text when the conversation has no `root` message.
IDENTITY_TEXT = (
    "Your model version is MiniMax-M3, developed by MiniMax. Knowledge cutoff: January 2026. "
    "Founded in early 2022, MiniMax is a global AI foundation model company committed to advancing "
    "the frontiers of AI towards AGI."
)
THINKING_TEXT = (
    "You have a thinking capability that allows you to reason step by step before responding. "
    "When thinking is enabled, wrap your reasoning in <mm:think></mm:think> tags before your "
    "response. When thinking is disabled, begin your response directly after the </mm:think> "
    "prefix. When thinking is adaptive, decide on your own whether to think for the current turn."
)
THINKING_MODE_TEXT = {
    "adaptive": "Current thinking mode: adaptive. You are encouraged to think for complex "
    "decision-making, multi-step reasoning, or when analyzing function/tool results.",
    "enabled": "Current thinking mode: enabled. You MUST think step by step before every response, "
    "including after receiving function/tool results.",
    "disabled": "Current thinking mode: disabled. Do not output any thinking process.",
}
GENERATION_PROMPT = {
    "adaptive": TURN_START + "ai\n",
    "enabled": TURN_START + "ai\n" + THINK_START,
    "disabled": TURN_START + "ai\n" + THINK_END,
}

TOOLS_INTRO = (
    "# Tools\n"
    "You may call one or more tools to assist with the user query.\n"
    "Here are the tools available in JSONSchema format:\n"
)
TOOLS_USAGE = (
    "To call tools, wrap all invocations in a single " + TOOL_CALL_START + TOOL_CALL_END + " block. "
    "Parameter values containing nested objects or arrays are recursively expanded into XML elements. "
    "Example:\n"
)
# The example calls of the tools section (rendered by `render_tool_calls` into TOOL_CALL_EXAMPLE).
EXAMPLE_CALLS: tuple[dict[str, Any], ...] = (
    {"name": "tool-name-1",
     "arguments": {"param-1": "value-1", "param-2": [{"key-a": "val-a", "key-b": "val-b"}]}},
    {"name": "tool-name-2", "arguments": {"param-1": "value-1"}},
)


def standing_instructions(thinking: str = "adaptive", identity: str | None = None) -> str:
    """The content of the first (`system`) turn: `identity` (a `root` message's text; None or ""
    gives `IDENTITY_TEXT`) and the thinking instructions of mode `thinking`."""
    _check_thinking(thinking)
    return ((identity or IDENTITY_TEXT) + "\n\n<thinking_instructions>\n" + THINKING_TEXT + "\n"
            + THINKING_MODE_TEXT[thinking] + "\n</thinking_instructions>")


def _check_thinking(thinking: Any) -> None:
    if thinking not in THINKING_MODES:
        raise InputError(f"thinking={thinking!r}: expected one of {', '.join(THINKING_MODES)}")


# ----------------------------------------------------------------------------------------------
# Validation and normalisation of messages and tools
# ----------------------------------------------------------------------------------------------
_ROLES = ("root", "system", "developer", "user", "assistant", "tool")
_PREAMBLE_ROLES = ("system", "developer")
_IMAGE_PART_TYPES = ("image", "image_url", "input_image")
_VIDEO_PART_TYPES = ("video", "video_url", "input_video")
# transformers fills `reasoning_content` from these fields, first one set wins.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_JSON_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")


def _check_schema(schema: Any, where: str) -> None:
    """Raise InputError when `schema` (or a subschema) is not a JSON-Schema object or boolean."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, Mapping):
        raise InputError(f"{where}: a JSON schema must be an object, got {type(schema).__name__}")
    types = schema.get("type")
    if types is not None:
        type_list = types if isinstance(types, list) else [types]
        for t in type_list:
            if t not in _JSON_TYPES:
                raise InputError(f"{where}.type: unknown JSON-Schema type {t!r}")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, Mapping):
            raise InputError(f"{where}.properties: must be an object mapping names to schemas")
        for key, sub in props.items():
            _check_schema(sub, f"{where}.properties.{key}")
    for key in ("items", "additionalProperties"):
        if key in schema and schema[key] is not None:
            _check_schema(schema[key], f"{where}.{key}")
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            subs = schema[key]
            if not isinstance(subs, list) or not subs:
                raise InputError(f"{where}.{key}: must be a non-empty list of schemas")
            for i, sub in enumerate(subs):
                _check_schema(sub, f"{where}.{key}[{i}]")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise InputError(f"{where}.enum: must be a list")
    if "required" in schema and not (
        isinstance(schema["required"], list) and all(isinstance(r, str) for r in schema["required"])
    ):
        raise InputError(f"{where}.required: must be a list of property names")


def _check_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise InputError(f"{where}: the function name must be a non-empty string")
    if any(c in name for c in '"<>\n') or NS in name:
        raise InputError(f'{where}: function name {name!r} may not contain quotes, "<", ">", newlines '
                         "or the namespace token")
    return name


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """Validate tool definitions; return them in OpenAI form `{"type": "function", "function": {...}}`.

    Accepts the OpenAI form or a bare function object (`{"name", "description", "parameters"}`).
    `parameters`, when present, must be a JSON-Schema object (`"type": "object"`, or no type with
    `properties` / `anyOf` / `oneOf` / `allOf`), otherwise InputError names the tool.
    """
    if tools is None:
        return []
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Iterable):
        raise InputError("tools: expected a list of tool definitions")
    out = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise InputError(f"{where}: a tool definition must be an object, got {type(tool).__name__}")
        if "function" in tool:
            if tool.get("type", "function") != "function":
                raise InputError(f"{where}.type: only 'function' tools are supported, got {tool['type']!r}")
            function = tool["function"]
            where += ".function"
        else:
            function = tool
        if not isinstance(function, Mapping):
            raise InputError(f"{where}: the function definition must be an object")
        name = _check_name(function.get("name"), where)
        where = f"tool {name!r} ({where})"
        if name in seen:
            raise InputError(f"{where}: a tool named {name!r} is defined twice")
        seen.add(name)
        if "parameters" in function and function["parameters"] is not None:
            params = function["parameters"]
            if not isinstance(params, Mapping):
                raise InputError(f"{where}.parameters: must be a JSON-Schema object, "
                                 f"got {type(params).__name__}")
            if params.get("type", "object") != "object":
                raise InputError(f"{where}.parameters.type: must be 'object', got {params.get('type')!r}")
            _check_schema(params, f"{where}.parameters")
        out.append({"type": "function", "function": dict(function)})
    return out


def _content_text(content: Any, where: str, role: str) -> str:
    """The text a message's content renders as: parts joined, image and video parts as their tokens.
    A tool result's part may also be `{"output": text}`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            pwhere = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, Mapping) else None
            if isinstance(part, str):
                parts.append(part)
            elif kind in _IMAGE_PART_TYPES:
                # The image processor expands this marker into the image's feature slots.
                parts.append(IMAGE)
            elif kind in _VIDEO_PART_TYPES:
                parts.append(VIDEO)
            elif role == "tool" and isinstance(part, Mapping) and "output" in part:
                if not isinstance(part["output"], str):
                    raise InputError(f"{pwhere}.output: expected a string (serialise the tool's result)")
                parts.append(part["output"])
            elif kind == "text":
                if not isinstance(part.get("text"), str):
                    raise InputError(f"{pwhere}.text: expected a string")
                parts.append(part["text"])
            else:
                raise InputError(f"{pwhere}: expected a string, a text part, an image part or a video part"
                                 + (" or an {'output': text} part" if role == "tool" else ""))
        return "".join(parts)
    raise InputError(f"{where}.content: expected a string or a list of parts, got {type(content).__name__}")


def _normalize_arguments(arguments: Any, where: str) -> dict[str, Any]:
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise InputError(f"{where}.arguments: not valid JSON ({e})") from None
    if not isinstance(arguments, Mapping):
        raise InputError(f"{where}.arguments: must be an object (or its JSON text)")
    return dict(arguments)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate a conversation; return it with string contents and parsed tool-call arguments.

    Roles: `root` (first message only: it replaces the identity text of the first turn), `system`
    or `developer` (first message, or second after `root`), `user`, `assistant`, `tool`. Content is
    a string or a list of parts (strings, `{"type": "text", "text": ...}`, image parts and video parts,
    which become their tokens; a tool result may also hold `{"output": text}` parts); None where the
    release allows it (root/system/developer: the default text; assistant). Assistant messages may
    carry `tool_calls` (OpenAI form or `{"name", "arguments"}`, arguments a dict or its JSON text) and
    `reasoning_content` (or `thinking` / `reasoning`, which transformers reads as it). Any other shape
    raises InputError naming the message index.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
        raise InputError("messages: expected a list of {'role': ..., 'content': ...} objects")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise InputError(f"{where}: expected an object with 'role' and 'content'")
        role = msg.get("role")
        if role not in _ROLES:
            raise InputError(f"{where}.role: unknown role {role!r}; expected one of {', '.join(_ROLES)}")
        after_root = i == 1 and out[0]["role"] == "root"
        if role == "root" and i != 0:
            raise InputError(f"{where}: a root message may only be the first message")
        if role in _PREAMBLE_ROLES and not (i == 0 or after_root):
            raise InputError(f"{where}: a {role} message may only be the first message (or the second, "
                             "after a root message)")
        tool_calls = msg.get("tool_calls") or []
        if tool_calls and role != "assistant":
            raise InputError(f"{where}.tool_calls: only assistant messages carry tool calls")
        content = msg.get("content")
        if content is None and role in ("user", "tool"):
            raise InputError(f"{where}: missing 'content'")
        text = _content_text(content, where, role)
        if role in ("root", *_PREAMBLE_ROLES) and isinstance(content, list) and content and not text:
            # The release renders a non-empty part list as its (empty) text, a string "" as the default:
            # a string cannot say which, so the ambiguous form is refused.
            raise InputError(f"{where}.content: the parts hold no text; pass \"\" (or leave the message "
                             "out) for the default text")
        norm: dict[str, Any] = dict(msg)
        norm["content"] = text
        if role == "assistant":
            reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
            if reasoning is not None and not isinstance(reasoning, str):
                raise InputError(f"{where}.reasoning_content: expected a string, got {type(reasoning).__name__}")
            for k in _REASONING_FIELDS:
                norm.pop(k, None)
            if reasoning is not None:
                norm["reasoning_content"] = reasoning
            calls = []
            if not isinstance(tool_calls, list):
                raise InputError(f"{where}.tool_calls: must be a list")
            for j, call in enumerate(tool_calls):
                cwhere = f"{where}.tool_calls[{j}]"
                if not isinstance(call, Mapping):
                    raise InputError(f"{cwhere}: must be an object")
                function = call.get("function", call)
                if not isinstance(function, Mapping):
                    raise InputError(f"{cwhere}.function: must be an object")
                name = _check_name(function.get("name"), cwhere)
                args = _normalize_arguments(function.get("arguments"), cwhere)
                _check_renderable(args, f"{cwhere}.arguments")
                calls.append({"type": "function", "function": {"name": name, "arguments": args}})
            norm["tool_calls"] = calls
        out.append(norm)
    return out


# ----------------------------------------------------------------------------------------------
# Tool-call rendering
# ----------------------------------------------------------------------------------------------
# Tags of tool-call blocks (the parser below reads them too).
_TAG_RE = re.compile(r"<(/?)([^<>]*)>")
_INVOKE_RE = re.compile(r"""invoke\s+name\s*=\s*(?:"([^"]*)"|'([^']*)')\s*""")
_INT_RE = re.compile(r"[+-]?\d+")
_NUMBER_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def _check_key(key: Any, where: str) -> None:
    if (not isinstance(key, str) or not key or key.startswith("/") or "<" in key or ">" in key
            or NS in key or _INVOKE_RE.fullmatch(key)):
        raise InputError(f"{where}: argument name {key!r} cannot be a tag name (it must be a non-empty "
                         "string without '<', '>', a leading '/' or the namespace token)")


def _check_renderable(value: Any, where: str) -> None:
    if isinstance(value, str):
        if NS in value:
            raise InputError(f"{where}: a string value may not contain the namespace token {NS!r}")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InputError(f"{where}: {value!r} has no JSON form")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _check_key(k, where)
            _check_renderable(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_renderable(v, f"{where}[{i}]")
    elif value is not None and not isinstance(value, (bool, int)):
        raise InputError(f"{where}: cannot render a {type(value).__name__} as a tool-call value")


def _tag(name: str, inner: str) -> str:
    return f"{NS}<{name}>{inner}{NS}</{name}>"


def _value_xml(value: Any) -> str:
    # None is left out of mappings; inside a list it keeps its (empty) <item>, as the release renders it.
    if isinstance(value, Mapping):
        return "".join(_tag(k, _value_xml(v)) for k, v in value.items() if v is not None)
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return "".join(_tag("item", _value_xml(v)) for v in value)
    return str(value)


def _invoke_xml(name: str, arguments: Mapping[str, Any]) -> str:
    return f'{NS}<invoke name="{name}">{_value_xml(arguments)}{NS}</invoke>\n'


def render_tool_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    """One tool-call block holding one invoke per call (`{"name", "arguments"}` or OpenAI form):
    the opener and a newline, each invoke on one line ending in a newline, then the closer.

    Argument values are raw text (see `render_tool_call`).
    """
    invokes = []
    for i, call in enumerate(calls):
        function = call.get("function", call)
        name = _check_name(function.get("name"), f"tool_calls[{i}]")
        args = _normalize_arguments(function.get("arguments"), f"tool_calls[{i}]")
        _check_renderable(args, f"tool_calls[{i}].arguments")
        invokes.append(_invoke_xml(name, args))
    return TOOL_CALL_START + "\n" + "".join(invokes) + TOOL_CALL_END


def render_tool_call(name: str, arguments: Mapping[str, Any] | str) -> str:
    """The tool-call block the model writes for one call; `parse_output` inverts it.

    Values: strings raw (unescaped), booleans `true`/`false`, numbers as Python writes them, objects
    as nested namespaced tags, lists as `<item>` tags, None fields omitted. Raises InputError for
    strings holding the namespace token, non-finite floats or keys that cannot be tag names.
    """
    return render_tool_calls([{"name": name, "arguments": arguments}])


#: The example block of the tools section.
TOOL_CALL_EXAMPLE = render_tool_calls(EXAMPLE_CALLS)


# ----------------------------------------------------------------------------------------------
# Built-in renderer
# ----------------------------------------------------------------------------------------------
def _turn(role: str, content: str) -> str:
    return f"{TURN_START}{role}\n{content}{TURN_END}\n"


def tools_section(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool-definition text of the developer turn (tools in OpenAI form; it follows the
    developer text after a blank line)."""
    lines = "".join(f"<tool>{json.dumps(t['function'], ensure_ascii=False)}</tool>\n" for t in tools)
    return TOOLS_INTRO + "\n<tools>\n" + lines + "</tools>\n\n" + TOOLS_USAGE + "\n" + TOOL_CALL_EXAMPLE


def split_reasoning(content: str, reasoning: str | None) -> tuple[str, str]:
    """(reasoning, content) of an earlier assistant turn, as the release renders history.

    A string `reasoning` is used as is and `content` kept whole. Otherwise, when `content` holds
    `</mm:think>`, the text before the first one (after its last `<mm:think>`) is the reasoning and
    the text after the last one the content, both stripped of surrounding newlines.
    """
    if reasoning is not None:
        return reasoning, content
    if THINK_END not in content:
        return "", content
    head = content.split(THINK_END)[0].strip("\n")
    return head.split(THINK_START)[-1].strip("\n"), content.split(THINK_END)[-1].strip("\n")


def _assistant_turn(msg: Mapping[str, Any]) -> str:
    reasoning, content = split_reasoning(msg["content"], msg.get("reasoning_content"))
    # A turn without reasoning still closes the (empty) reasoning, as the disabled-mode prompt does.
    head = THINK_START + reasoning + THINK_END if reasoning else THINK_END
    calls = render_tool_calls(msg["tool_calls"]) if msg["tool_calls"] else ""
    return _turn("ai", head + content + calls)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: str = "adaptive",
    add_generation_prompt: bool = True,
) -> str:
    """Render a conversation exactly as the release template does (layout in the module docstring).

    `thinking` is `adaptive`, `enabled` or `disabled`. Earlier assistant turns keep their reasoning.
    Raises InputError for bad messages, tools or mode, and for a tool result whose latest assistant
    message made no tool call.
    """
    _check_thinking(thinking)
    msgs = normalize_messages(messages)
    tool_defs = normalize_tools(tools)
    start = 0
    identity = None
    developer = DEFAULT_SYSTEM_PROMPT
    if msgs and msgs[0]["role"] == "root":
        identity, start = msgs[0]["content"], 1
    if len(msgs) > start and msgs[start]["role"] in _PREAMBLE_ROLES:
        developer = msgs[start]["content"] or DEFAULT_SYSTEM_PROMPT
        start += 1
    if tool_defs:
        developer += "\n\n" + tools_section(tool_defs)
    parts = [BOD, _turn("system", standing_instructions(thinking, identity)), _turn("developer", developer)]
    calls_pending = False  # whether the latest assistant message made tool calls
    for i in range(start, len(msgs)):
        msg, role = msgs[i], msgs[i]["role"]
        if role == "assistant":
            parts.append(_assistant_turn(msg))
            calls_pending = bool(msg["tool_calls"])
        elif role == "tool":
            if not calls_pending:
                raise InputError(f"messages[{i}]: a tool result must come after an assistant message with "
                                 "tool calls (the latest assistant message, if any, made none)")
            first = msgs[i - 1]["role"] != "tool"
            last = i + 1 == len(msgs) or msgs[i + 1]["role"] != "tool"
            parts.append((TURN_START + "tool" if first else "") + "\n<response>" + msg["content"]
                         + "</response>" + (TURN_END + "\n" if last else ""))
        else:
            parts.append(_turn("user", msg["content"]))
    if add_generation_prompt:
        parts.append(GENERATION_PROMPT[thinking])
    return "".join(parts)


# ----------------------------------------------------------------------------------------------
# Jinja2 renderer
# ----------------------------------------------------------------------------------------------
def _jinja_str(text: str) -> str:
    """A jinja2 string literal for `text`."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def _jinja_list(items: Sequence[str]) -> str:
    return "[" + ", ".join(_jinja_str(t) for t in items) + "]"


# Every newline of the output is an explicit literal, so the template's own layout never leaks into
# it. The template takes messages as `normalize_messages` gives them and also as transformers passes
# them (part lists, `{"name", "arguments"}` calls); it refuses what `normalize_messages` refuses where
# a template can tell.
CHAT_TEMPLATE = (
    "{#- MiniMax-M3 chat template of minimax_ref (renders what minimax_ref.generation.chat.render_chat renders). -#}\n"
    "{%- set ns_token = " + _jinja_str(NS) + " -%}\n"
    "{%- set think_open = " + _jinja_str(THINK_START) + " -%}\n"
    "{%- set think_close = " + _jinja_str(THINK_END) + " -%}\n"
    "{%- set turn_end = " + _jinja_str(TURN_END + "\n") + " -%}\n"
    "{%- set mode = thinking_mode if thinking_mode is defined else 'adaptive' -%}\n"
    "{%- if mode not in " + _jinja_list(THINKING_MODES) + " -%}\n"
    "{{- raise_exception('unknown thinking_mode ' ~ mode ~ '; expected adaptive, enabled or disabled') -}}\n"
    "{%- endif -%}\n"
    # part lists: text, image and video parts; a tool result's part may be {"output": text}
    "{%- macro part_text(part, in_tool) -%}\n"
    "{%- if part is string -%}{{- part -}}\n"
    "{%- elif part.type in " + _jinja_list(_IMAGE_PART_TYPES) + " -%}{{- " + _jinja_str(IMAGE) + " -}}\n"
    "{%- elif part.type in " + _jinja_list(_VIDEO_PART_TYPES) + " -%}{{- " + _jinja_str(VIDEO) + " -}}\n"
    "{%- elif in_tool and part.output is defined -%}{{- part.output -}}\n"
    "{%- elif part.type == 'text' -%}{{- part.text -}}\n"
    "{%- else -%}{{- raise_exception('a message part that is not text, image or video') -}}\n"
    "{%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{%- macro text_of(content, in_tool=false) -%}\n"
    "{%- if content is none -%}\n"
    "{%- elif content is string -%}{{- content -}}\n"
    "{%- else -%}{%- for part in content -%}{{- part_text(part, in_tool) -}}{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{%- endmacro -%}\n"
    # tool-call values: None left out of mappings, empty inside lists; booleans as JSON
    "{%- macro xml_value(value) -%}\n"
    "{%- if value is mapping -%}\n"
    "{%- for key, item in value.items() if item is not none -%}\n"
    "{{- ns_token ~ '<' ~ key ~ '>' -}}{{- xml_value(item) -}}{{- ns_token ~ '</' ~ key ~ '>' -}}\n"
    "{%- endfor -%}\n"
    "{%- elif value is string -%}{{- value -}}\n"
    "{%- elif value is boolean -%}{{- 'true' if value else 'false' -}}\n"
    "{%- elif value is none -%}\n"
    "{%- elif value is iterable -%}\n"
    "{%- for item in value -%}\n"
    "{{- ns_token ~ '<item>' -}}{{- xml_value(item) -}}{{- ns_token ~ '</item>' -}}\n"
    "{%- endfor -%}\n"
    "{%- else -%}{{- value -}}\n"
    "{%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{%- macro call_block(calls) -%}\n"
    "{{- ns_token ~ '<tool_call>\\n' -}}\n"
    "{%- for call in calls -%}\n"
    "{%- set fn = call.function if call.function is defined else call -%}\n"
    "{%- if fn.arguments is string -%}"
    "{{- raise_exception('tool-call arguments must be an object, not JSON text') -}}{%- endif -%}\n"
    "{{- ns_token ~ '<invoke name=\"' ~ fn.name ~ '\">' -}}{{- xml_value(fn.arguments or {}) -}}"
    "{{- ns_token ~ '</invoke>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{{- ns_token ~ '</tool_call>' -}}\n"
    "{%- endmacro -%}\n"
    # the preamble: root, then system/developer
    "{%- set head = namespace(identity=" + _jinja_str(IDENTITY_TEXT) + ", developer="
    + _jinja_str(DEFAULT_SYSTEM_PROMPT) + ", start=0, calls=false) -%}\n"
    "{%- if messages and messages[0].role == 'root' -%}\n"
    "{%- if messages[0].content -%}{%- set head.identity = text_of(messages[0].content) -%}{%- endif -%}\n"
    "{%- set head.start = 1 -%}\n"
    "{%- endif -%}\n"
    "{%- if messages | length > head.start and messages[head.start].role in "
    + _jinja_list(_PREAMBLE_ROLES) + " -%}\n"
    "{%- if messages[head.start].content -%}"
    "{%- set head.developer = text_of(messages[head.start].content) -%}{%- endif -%}\n"
    "{%- set head.start = head.start + 1 -%}\n"
    "{%- endif -%}\n"
    "{{- " + _jinja_str(BOD + TURN_START + "system\n") + " ~ head.identity -}}\n"
    "{{- " + _jinja_str("\n\n<thinking_instructions>\n" + THINKING_TEXT + "\n") + " -}}\n"
    "{%- if mode == 'enabled' -%}{{- " + _jinja_str(THINKING_MODE_TEXT["enabled"]) + " -}}\n"
    "{%- elif mode == 'disabled' -%}{{- " + _jinja_str(THINKING_MODE_TEXT["disabled"]) + " -}}\n"
    "{%- else -%}{{- " + _jinja_str(THINKING_MODE_TEXT["adaptive"]) + " -}}{%- endif -%}\n"
    "{{- '\\n</thinking_instructions>' ~ turn_end -}}\n"
    "{{- " + _jinja_str(TURN_START + "developer\n") + " ~ head.developer -}}\n"
    "{%- if tools -%}\n"
    "{{- '\\n\\n' ~ " + _jinja_str(TOOLS_INTRO + "\n<tools>\n") + " -}}\n"
    "{%- for tool in tools -%}\n"
    "{{- '<tool>' ~ (tool.function | tojson(ensure_ascii=False)) ~ '</tool>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{{- '</tools>\\n\\n' ~ " + _jinja_str(TOOLS_USAGE + "\n" + TOOL_CALL_EXAMPLE) + " -}}\n"
    "{%- endif -%}\n"
    "{{- turn_end -}}\n"
    # the conversation
    "{%- for message in messages -%}\n"
    "{%- if loop.index0 >= head.start -%}\n"
    "{%- set where = 'messages[' ~ loop.index0 ~ ']: ' -%}\n"
    "{%- if message.role == 'assistant' -%}\n"
    "{%- set body = text_of(message.content) -%}\n"
    "{%- set thought = '' -%}\n"
    "{%- if message.reasoning_content is string -%}\n"
    "{%- set thought = message.reasoning_content -%}\n"
    "{%- elif think_close in body -%}\n"
    "{%- set thought = body.split(think_close)[0].strip('\\n').split(think_open)[-1].strip('\\n') -%}\n"
    "{%- set body = body.split(think_close)[-1].strip('\\n') -%}\n"
    "{%- endif -%}\n"
    "{{- " + _jinja_str(TURN_START + "ai\n") + " -}}\n"
    "{{- (think_open ~ thought ~ think_close) if thought else think_close -}}{{- body -}}\n"
    "{%- if message.tool_calls -%}{{- call_block(message.tool_calls) -}}{%- endif -%}\n"
    "{{- turn_end -}}\n"
    "{%- set head.calls = message.tool_calls is defined and message.tool_calls | length > 0 -%}\n"
    "{%- elif message.role == 'tool' -%}\n"
    "{%- if not head.calls -%}{{- raise_exception(where ~ 'a tool result must come after an assistant "
    "message with tool calls') -}}{%- endif -%}\n"
    "{%- if loop.previtem.role != 'tool' -%}{{- " + _jinja_str(TURN_START + "tool") + " -}}{%- endif -%}\n"
    "{{- '\\n<response>' ~ text_of(message.content, true) ~ '</response>' -}}\n"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- turn_end -}}{%- endif -%}\n"
    "{%- elif message.role == 'user' -%}\n"
    "{{- " + _jinja_str(TURN_START + "user\n") + " ~ text_of(message.content) ~ turn_end -}}\n"
    "{%- else -%}\n"
    "{{- raise_exception(where ~ 'role ' ~ message.role ~ ' is not allowed here') -}}\n"
    "{%- endif -%}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- " + _jinja_str(TURN_START + "ai\n") + " -}}\n"
    "{%- if mode == 'enabled' -%}{{- think_open -}}{%- elif mode == 'disabled' -%}{{- think_close -}}{%- endif -%}\n"
    "{%- endif -%}\n"
)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Same signature and output as transformers' chat-template `tojson` (plain json.dumps, no HTML
    # escaping), so release templates written for it render the same here.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile_template(source: str, origin: str):
    try:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is installed with the `chat` extra
        raise InputError(f"{origin}: rendering a jinja2 chat template needs jinja2 "
                         "(pip install 'minimax-ref[chat]')") from e

    def raise_exception(message: str) -> None:
        raise InputError(f"{origin}: the chat template refused the conversation: {message}")

    # The same environment options as transformers' chat templates: templates rely on them.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise CheckpointError(f"{origin}: invalid jinja2 chat template: {e}") from None


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: str = "adaptive",
    add_generation_prompt: bool = True,
    *,
    origin: str = "chat template",
    extra_variables: Mapping[str, Any] | None = None,
) -> str:
    """Render a jinja2 chat template (sandboxed) on a validated, normalised conversation.

    The template sees `messages` (OpenAI form, string contents, dict tool-call arguments), `tools`
    (OpenAI form or None), `add_generation_prompt`, `thinking_mode` and `extra_variables` (special
    token texts, for example). A template that does not compile raises CheckpointError, one that fails
    or refuses the conversation raises InputError; both name `origin` (the template's file).
    """
    _check_thinking(thinking)
    msgs = normalize_messages(messages)
    tool_defs = normalize_tools(tools) or None
    compiled = _compile_template(template, origin)
    variables = dict(extra_variables or {})
    variables.update(messages=msgs, tools=tool_defs, add_generation_prompt=add_generation_prompt,
                     thinking_mode=thinking)
    from jinja2 import TemplateError

    try:
        return compiled.render(**variables)
    except (TemplateError, TypeError, ValueError) as e:
        raise InputError(f"{origin}: rendering the chat template failed: {e}") from None


# ----------------------------------------------------------------------------------------------
# Tool-call parsing
# ----------------------------------------------------------------------------------------------
class _Malformed(Exception):
    pass




@dataclass
class _Element:
    name: str
    attr_name: str | None
    start: int  # span of the inner text in the block
    end: int = -1
    children: list[Any] = field(default_factory=list)  # str | _Element

    @property
    def elements(self) -> list[_Element]:
        return [c for c in self.children if isinstance(c, _Element)]

    def stray_text(self) -> bool:
        return any(isinstance(c, str) and c.strip() for c in self.children)


def _parse_tree(text: str) -> list[Any]:
    """Split a tool-call block's inner text into text runs and namespaced elements."""
    root = _Element("", None, 0)
    stack = [root]
    pos = 0
    while True:
        k = text.find(NS, pos)
        chunk = text[pos:] if k < 0 else text[pos:k]
        if chunk:
            stack[-1].children.append(chunk)
        if k < 0:
            break
        m = _TAG_RE.match(text, k + len(NS))
        if not m:
            raise _Malformed(f"the namespace token at offset {k} is not followed by a tag")
        closing, body = m.group(1) == "/", m.group(2)
        if closing:
            if len(stack) == 1 or stack[-1].name != body:
                want = stack[-1].name if len(stack) > 1 else None
                raise _Malformed(f"closing tag </{body}> does not match "
                                 + (f"<{want}>" if want else "any open tag"))
            stack[-1].end = k
            stack.pop()
        else:
            if not body or body.startswith("/"):
                raise _Malformed("empty tag name")
            inv = _INVOKE_RE.fullmatch(body)
            el = _Element("invoke", inv.group(1) if inv.group(1) is not None else inv.group(2), m.end()) \
                if inv else _Element(body, None, m.end())
            stack[-1].children.append(el)
            stack.append(el)
        pos = m.end()
    if len(stack) > 1:
        raise _Malformed(f"tag <{stack[-1].name}> is never closed")
    return root.children


def _merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`extra` laid over `base`; `properties` and `required` are united rather than replaced."""
    out = {**base, **extra}
    for key in ("properties",):
        if isinstance(base.get(key), Mapping) and isinstance(extra.get(key), Mapping):
            out[key] = {**base[key], **extra[key]}
    if isinstance(base.get("required"), list) and isinstance(extra.get("required"), list):
        out["required"] = list(dict.fromkeys(base["required"] + extra["required"]))
    return out


def _alternatives(schema: Any) -> list[tuple[str, dict]]:
    """Flatten a schema into (type, subschema) alternatives, in the schema's order.

    `allOf` parts are merged into the schema; each `anyOf` / `oneOf` part is merged with the rest of
    the schema into an alternative of its own (at any depth).
    """
    if schema is None or isinstance(schema, bool) or not isinstance(schema, Mapping):
        return [("any", {})]
    schema = dict(schema)
    for sub in schema.pop("allOf", None) or []:
        if isinstance(sub, Mapping):
            schema = _merge(_alternatives_base(sub), schema)
    alts: list[tuple[str, dict]] = []
    for key in ("anyOf", "oneOf"):
        if key in schema:
            base = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
            for sub in schema[key]:
                merged = _merge(base, sub) if isinstance(sub, Mapping) else base
                alts += _alternatives(merged)
            return alts
    types = schema.get("type")
    if types is None:
        if "properties" in schema or "additionalProperties" in schema:
            types = "object"
        elif "items" in schema:
            types = "array"
        elif "enum" in schema or "const" in schema:
            return [("enum", schema)]
        else:
            return [("any", schema)]
    for t in types if isinstance(types, list) else [types]:
        alts.append((t, schema))
    return alts


def _alternatives_base(schema: Mapping[str, Any]) -> dict[str, Any]:
    # An allOf part's own allOf is merged in first, so nested parts contribute their properties too.
    out = dict(schema)
    for sub in out.pop("allOf", None) or []:
        if isinstance(sub, Mapping):
            out = _merge(_alternatives_base(sub), out)
    return out


def _object_view(schema: Any) -> tuple[dict[str, Any], list[list[str]], Any]:
    """(properties, required lists, additionalProperties) of an object schema, its alternatives
    merged: a name that several alternatives declare may take any of their schemas; the required
    lists are one per alternative (one of them must be met)."""
    alts = [sub for kind, sub in _alternatives(schema) if kind in ("object", "any")] or [{}]
    declared: dict[str, list[Any]] = {}
    for sub in alts:
        for key, prop in (sub.get("properties") or {}).items():
            if prop not in declared.setdefault(key, []):
                declared[key].append(prop)
    props = {k: v[0] if len(v) == 1 else {"anyOf": v} for k, v in declared.items()}
    required = [list(sub.get("required") or []) for sub in alts]
    extras = [sub.get("additionalProperties", True) for sub in alts]
    extra = False if all(e is False for e in extras) else next((e for e in extras if isinstance(e, Mapping)), True)
    return props, required, extra


def _describe(schema: Any) -> str:
    alts = _alternatives(schema)
    return " or ".join(dict.fromkeys(t for t, _ in alts))


def _inner(block: str, el: _Element) -> str:
    return block[el.start:el.end]


def _leaf_text(el: _Element) -> str:
    return "".join(c for c in el.children if isinstance(c, str))


_FAIL = object()


def _same(a: Any, b: Any) -> bool:
    # True == 1 in Python, but not in JSON.
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _enum_ok(value: Any, schema: Mapping) -> bool:
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        return False
    return "const" not in schema or _same(value, schema["const"])


def _try_leaf(kind: str, text: str, schema: Mapping) -> Any:
    s = text.strip()
    if kind == "string":
        return text
    if kind == "integer":
        if _INT_RE.fullmatch(s):
            return int(s)
        if _NUMBER_RE.fullmatch(s):
            f = float(s)
            if math.isfinite(f) and f.is_integer():
                return int(f)
        return _FAIL
    if kind == "number":
        if _INT_RE.fullmatch(s):
            return int(s)
        if _NUMBER_RE.fullmatch(s):
            f = float(s)
            return f if math.isfinite(f) else _FAIL
        return _FAIL
    if kind == "boolean":
        return {"true": True, "false": False}.get(s.lower(), _FAIL)
    if kind == "null":
        return None if s == "null" else _FAIL
    if kind in ("object", "array"):
        if not s:
            return {} if kind == "object" else []
        # Models sometimes write a structured value as JSON text inside the tag.
        try:
            value = json.loads(s)
        except ValueError:
            return _FAIL
        return value if isinstance(value, dict if kind == "object" else list) else _FAIL
    if kind == "enum":
        for e in schema.get("enum", [schema.get("const")]):
            if _value_xml(e) == text or (not isinstance(e, str) and _value_xml(e) == s):
                return e
        return _FAIL
    return text  # "any": no schema to go by


# Non-string alternatives are tried before `string`, which would accept anything; an empty value
# prefers a string (then an empty object or list).
_LEAF_ORDER = {"boolean": 0, "integer": 1, "number": 2, "null": 3, "enum": 4, "object": 5, "array": 6,
               "string": 7, "any": 8}
_EMPTY_ORDER = {"string": 0, "enum": 1, "object": 2, "array": 3, "null": 4, "any": 5}


def _coerce(block: str, el: _Element, schema: Any, path: str) -> tuple[Any, list[str]]:
    """Coerce one element by its schema: (value, errors). A misfit is the raw inner text + an error."""
    alts = _alternatives(schema)
    structured = bool(el.elements)
    partial: tuple[Any, list[str]] | None = None
    if structured:
        objects = [sub for kind, sub in alts if kind == "object"]
        tried_objects = False
        for kind, sub in alts:
            if kind not in ("object", "array", "any"):
                continue
            if kind == "object":
                # All object alternatives are read together, so that the one declaring the names wins.
                if tried_objects:
                    continue
                tried_objects = True
                sub = objects[0] if len(objects) == 1 else {"anyOf": objects}
            got = _coerce_structured(block, el, kind, sub, path)
            if got is _FAIL:
                continue
            value, errs = got
            if not errs and _enum_ok(value, sub):
                return value, []
            if partial is None:
                partial = (value, errs or [f"{path}: value is not one of the allowed values"])
    else:
        text = _leaf_text(el)
        order = _EMPTY_ORDER if not text.strip() else _LEAF_ORDER
        for kind, sub in sorted(alts, key=lambda a: order.get(a[0], 9)):
            value = _try_leaf(kind, text, sub)
            if value is not _FAIL and _enum_ok(value, sub):
                return value, []
    if partial is not None:
        return partial
    return _inner(block, el), [f"{path}: value {_inner(block, el)!r} does not fit the schema "
                               f"({_describe(schema)}); kept as a string"]


def _coerce_structured(block: str, el: _Element, kind: str, schema: Mapping, path: str):
    children = el.elements
    if el.stray_text():
        return _FAIL
    if kind == "array" or (kind == "any" and all(c.name == "item" for c in children)):
        if not all(c.name == "item" for c in children):
            return _FAIL
        items_schema = schema.get("items") if isinstance(schema, Mapping) else None
        values, errs = [], []
        for i, c in enumerate(children):
            v, e = _coerce(block, c, items_schema, f"{path}[{i}]")
            values.append(v)
            errs += e
        return values, errs
    return _coerce_object(block, children, schema, path)


def _coerce_repeated(block: str, els: list[_Element], schema: Any, path: str) -> tuple[list[Any], list[str]]:
    """A name given several times among siblings: its values, in order, as one list.

    Under an array schema each repetition is an item (or, written as `<item>`s, a run of items);
    otherwise each is coerced by the schema itself and, unless the schema allows anything, the list
    is flagged.
    """
    alts = _alternatives(schema)
    array = next((sub for kind, sub in alts if kind == "array"), None)
    values: list[Any] = []
    errs: list[str] = []
    for el in els:
        if array is not None:
            runs = bool(el.elements) and all(c.name == "item" for c in el.elements) and not el.stray_text()
            if runs:
                v, e = _coerce(block, el, array, f"{path}[{len(values)}:]")
                if isinstance(v, list):
                    values += v
                    errs += e
                    continue
            v, e = _coerce(block, el, array.get("items"), f"{path}[{len(values)}]")
        else:
            v, e = _coerce(block, el, schema, f"{path}[{len(values)}]")
        values.append(v)
        errs += e
    if array is None and not any(kind == "any" for kind, _ in alts):
        errs.append(f"{path}: given {len(els)} times; the values are kept as a list, but the schema "
                    f"expects {_describe(schema)}")
    return values, errs


def _coerce_object(block: str, children: list[_Element], schema: Any, path: str,
                   ) -> tuple[dict[str, Any], list[str]]:
    props, required, extra = _object_view(schema)
    groups: dict[str, list[_Element]] = {}
    for c in children:
        if c.attr_name is not None:
            raise _Malformed(f"an <invoke> element inside {path}")
        groups.setdefault(c.name, []).append(c)
    out: dict[str, Any] = {}
    errs: list[str] = []
    for name, els in groups.items():
        sub_path = f"{path}.{name}" if path else name
        if name in props:
            sub = props[name]
        else:
            if extra is False:
                errs.append(f"{sub_path}: not a declared property")
            sub = extra if isinstance(extra, Mapping) else None
        # Repeated sibling tags collect into a list: no value is dropped.
        value, e = _coerce(block, els[0], sub, sub_path) if len(els) == 1 else \
            _coerce_repeated(block, els, sub, sub_path)
        out[name] = value
        errs += e
    if not any(all(r in out for r in req) for req in required):
        prefix = path + "." if path else ""
        if len(required) == 1:
            errs += [f"{prefix}{r}: required but missing" for r in required[0] if r not in out]
        else:
            wanted = " or ".join("(" + ", ".join(req) + ")" for req in required)
            errs.append(f"{path or 'arguments'}: fits none of the alternatives' required properties {wanted}")
    return out, errs


def _schema_map(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any] | None:
    if tools is None:
        return None
    return {t["function"]["name"]: t["function"].get("parameters") for t in normalize_tools(tools)}


def _parse_block(inner: str, schemas: dict[str, Any] | None) -> tuple[list[dict], list[str]]:
    """Parse the text between a tool-call opener and closer. Raises _Malformed."""
    nodes = _parse_tree(inner)
    calls, errors = [], []
    for node in nodes:
        if isinstance(node, str):
            if node.strip():
                raise _Malformed(f"text {node.strip()[:40]!r} outside <invoke>")
            continue
        if node.attr_name is None:
            raise _Malformed(f"<{node.name}> where an <invoke name=...> was expected")
        if not node.attr_name:
            raise _Malformed("<invoke> without a function name")
        if node.stray_text():
            raise _Malformed(f"text between the arguments of {node.attr_name!r}")
        name = node.attr_name
        where = f"tool call {len(calls) + 1} ({name})"
        if schemas is not None and name not in schemas:
            errors.append(f"{where}: no tool named {name!r} was offered")
        schema = schemas.get(name) if schemas else None
        args, errs = _coerce_object(inner, node.elements, schema or {}, "")
        errors += [f"{where}: argument {e}" for e in errs]
        calls.append({"name": name, "arguments": args})
    if not calls:
        raise _Malformed("a tool-call block without any <invoke>")
    return calls, errors


# ----------------------------------------------------------------------------------------------
# Streaming parser (parse_output is the one-piece case)
# ----------------------------------------------------------------------------------------------
def _held_suffix(buf: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(buf), len(marker) - 1), best, -1):
            if buf.endswith(marker[:n]):
                best = n
                break
    return best


class StreamingParser:
    """Incremental reasoning/content/tool-call split of generated text.

    `feed(piece)` returns the events that became certain: `{"type": "reasoning", "text"}`,
    `{"type": "content", "text"}`, `{"type": "tool_call", "name", "arguments"}` and
    `{"type": "error", "message"}`. Text that might still be the start of a marker is held back.
    `finish()` flushes the rest. For any split of a text, the events together (and `result()`)
    equal `parse_output` of the whole text.

    `reasoning_started=True` is for prompts that ended with `<mm:think>` (thinking enabled): the
    text starts inside the reasoning. Otherwise a leading `<mm:think>` opens reasoning, a bare
    leading `</mm:think>` is stripped, and anything else is content.
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None, reasoning_started: bool = False):
        self._schemas = _schema_map(tools)
        self._state = "reasoning" if reasoning_started else "start"
        self._buf = ""
        self._scan_from = 0
        self._reasoning: list[str] | None = [] if reasoning_started else None
        self._content: list[str] = []
        self._calls: list[dict[str, Any]] = []
        self._errors: list[str] = []
        self._finished = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Add generated text; return the events it made certain."""
        if self._finished:
            raise InputError("StreamingParser.feed called after finish()")
        if not isinstance(text, str):
            raise InputError(f"StreamingParser.feed: expected a string, got {type(text).__name__}")
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[dict[str, Any]]:
        """End of generation: flush held text, report unclosed reasoning or truncated calls."""
        if self._finished:
            return []
        events = self._drain(final=True)
        self._finished = True
        return events

    def result(self) -> dict[str, Any]:
        """The parse so far, as `parse_output` returns it."""
        return {
            "reasoning": None if self._reasoning is None else "".join(self._reasoning),
            "content": "".join(self._content),
            "tool_calls": [dict(c) for c in self._calls],
            "errors": list(self._errors),
        }

    def _emit(self, events: list, kind: str, text: str) -> None:
        if not text:
            return
        (self._reasoning if kind == "reasoning" else self._content).append(text)
        events.append({"type": kind, "text": text})

    def _error(self, events: list, message: str) -> None:
        self._errors.append(message)
        events.append({"type": "error", "message": message})

    def _drain(self, final: bool) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        while True:
            buf = self._buf
            if self._state == "start":
                if buf.startswith(THINK_START):
                    self._buf, self._state, self._reasoning = buf[len(THINK_START):], "reasoning", []
                elif buf.startswith(THINK_END):
                    self._buf, self._state = buf[len(THINK_END):], "content"
                elif not final and (THINK_START.startswith(buf) or THINK_END.startswith(buf)):
                    return events
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                i, j = buf.find(THINK_END), buf.find(TOOL_CALL_START)
                if i >= 0 and (j < 0 or i < j):
                    self._emit(events, "reasoning", buf[:i])
                    self._buf, self._state = buf[i + len(THINK_END):], "content"
                elif j >= 0:
                    # A tool call ends reasoning that was never closed; the call itself is content.
                    self._emit(events, "reasoning", buf[:j])
                    self._buf, self._state = buf[j:], "content"
                elif final:
                    self._emit(events, "reasoning", buf)
                    self._buf = ""
                    self._error(events, f"the output ended inside the reasoning (no {THINK_END})")
                    return events
                else:
                    keep = _held_suffix(buf, (THINK_END, TOOL_CALL_START))
                    self._emit(events, "reasoning", buf[:len(buf) - keep])
                    self._buf = buf[len(buf) - keep:]
                    return events
            elif self._state == "content":
                j = buf.find(TOOL_CALL_START)
                if j >= 0:
                    self._emit(events, "content", buf[:j])
                    self._buf, self._state, self._scan_from = buf[j + len(TOOL_CALL_START):], "call", 0
                else:
                    keep = 0 if final else _held_suffix(buf, (TOOL_CALL_START,))
                    self._emit(events, "content", buf[:len(buf) - keep])
                    self._buf = buf[len(buf) - keep:]
                    return events
            else:  # inside a tool-call block
                k = buf.find(TOOL_CALL_END, self._scan_from)
                if k < 0:
                    if final:
                        self._emit(events, "content", TOOL_CALL_START + buf)
                        self._buf = ""
                        self._error(events, f"truncated tool call (no {TOOL_CALL_END}); "
                                            "kept as content")
                        return events
                    self._scan_from = max(0, len(buf) - len(TOOL_CALL_END) + 1)
                    return events
                inner = buf[:k]
                self._buf, self._state = buf[k + len(TOOL_CALL_END):], "content"
                try:
                    calls, errors = _parse_block(inner, self._schemas)
                except _Malformed as e:
                    self._emit(events, "content", TOOL_CALL_START + inner + TOOL_CALL_END)
                    self._error(events, f"malformed tool call ({e}); kept as content")
                    continue
                for call in calls:
                    self._calls.append(call)
                    events.append({"type": "tool_call", "name": call["name"],
                                   "arguments": call["arguments"]})
                for message in errors:
                    self._error(events, message)


def parse_output(
    text: str, tools: Sequence[Mapping[str, Any]] | None = None, reasoning_started: bool = False
) -> dict[str, Any]:
    """Split generated text into `{"reasoning", "content", "tool_calls", "errors"}` (spec `chat.md`).

    `reasoning` is None when the text had no reasoning. `tool_calls` are `{"name", "arguments"}`
    with arguments coerced by `tools`' JSON schemas (strings when no schema applies). Problems
    (unclosed reasoning, truncated or malformed blocks, values that do not fit) are listed in
    `errors`; nothing is dropped. See `StreamingParser` for `reasoning_started`.
    """
    parser = StreamingParser(tools, reasoning_started=reasoning_started)
    parser.feed(text)
    parser.finish()
    return parser.result()
