"""Chat rendering, reasoning split and tool-call parsing for MiniMax-M3 (spec `chat.md`).

Rendering
---------
`render_chat` is the built-in renderer; `render_chat_template` renders a checkpoint's jinja2 chat
template in a sandbox. `CHAT_TEMPLATE` is a jinja2 template that renders exactly what
`render_chat` renders (the test tokenizer ships it as `chat_template.jinja`). A conversation is::

    ]~!b[
    ]~b]system\\n{STANDING_INSTRUCTIONS + thinking-mode text}[e~[\\n
    ]~b]developer\\n{system message or DEFAULT_SYSTEM_PROMPT}{tools section, when tools}[e~[\\n
    ]~b]user\\n{content}[e~[\\n
    ]~b]ai\\n</mm:think>{content}{tool-call block, when tool_calls}[e~[\\n   (reasoning dropped)
    ]~b]tool\\n{result string}[e~[\\n                                   (one turn per tool message)
    ]~b]ai\\n  +  "" | "<mm:think>" | "</mm:think>"     (generation prompt: adaptive/enabled/disabled)

Decided here (the release's wrapper texts are not public): the tools section is
`TOOLS_SECTION_HEADER`, then `<tools>`, one `<tool>{function JSON}</tool>` line per tool,
`</tools>`, then `TOOLS_SECTION_FOOTER`; it follows the system message after a blank line.
The function JSON is `json.dumps(tool["function"], ensure_ascii=False)` with the caller's key order.
A tool turn's content is the tool message's result string, unwrapped. An assistant turn's tool calls
follow its content directly, as one `render_tool_calls` block.

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

from .errors import CheckpointError, InputError

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

TOOLS_SECTION_HEADER = (
    "# Tools\n"
    "You can call the functions below. Each <tool> line holds one function's JSON schema.\n"
)
TOOLS_SECTION_FOOTER = (
    "\nTo call functions, write one tool-call block with one invoke element per call and one tag per "
    "argument, every tag prefixed with " + NS + ":\n"
    + TOOL_CALL_START + "\n"
    + NS + '<invoke name="function_name">\n'
    + NS + "<argument_name>value" + NS + "</argument_name>\n"
    + NS + "</invoke>\n"
    + TOOL_CALL_END + "\n"
    "Values are raw text: objects are nested tags, lists are <item> tags, booleans are true or false."
)


def standing_instructions(thinking: str = "adaptive") -> str:
    """The content of the first (`system`) turn for a thinking mode."""
    _check_thinking(thinking)
    return (
        IDENTITY_TEXT
        + "\n\n<thinking_instructions>\n"
        + THINKING_TEXT
        + "\n"
        + THINKING_MODE_TEXT[thinking]
        + "\n</thinking_instructions>"
    )


def _check_thinking(thinking: Any) -> None:
    if thinking not in THINKING_MODES:
        raise InputError(f"thinking={thinking!r}: expected one of {', '.join(THINKING_MODES)}")


# ----------------------------------------------------------------------------------------------
# Validation and normalisation of messages and tools
# ----------------------------------------------------------------------------------------------
_ROLES = ("system", "developer", "user", "assistant", "tool")
_IMAGE_PART_TYPES = ("image", "image_url", "input_image")
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
    `parameters`, when present, must be a JSON-Schema object (`"type": "object"`), otherwise
    InputError names the tool.
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


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text":
                if not isinstance(part.get("text"), str):
                    raise InputError(f"{where}.content[{j}].text: expected a string")
                parts.append(part["text"])
            elif isinstance(part, Mapping) and part.get("type") in _IMAGE_PART_TYPES:
                # The image processor expands this marker into the image's feature slots.
                parts.append(IMAGE)
            else:
                raise InputError(f"{where}.content[{j}]: expected a text part or an image part")
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

    Roles: `system`/`developer` (first message only), `user`, `assistant`, `tool`. Content is a
    string or a list of parts (`{"type": "text", "text": ...}`, image parts, which become the image
    marker). An assistant message may omit content when it has `tool_calls` (OpenAI form or
    `{"name", "arguments"}`, arguments a dict or its JSON text). Any other shape raises InputError
    naming the message index.
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
        if role in ("system", "developer") and i != 0:
            raise InputError(f"{where}: a {role} message may only be the first message")
        tool_calls = msg.get("tool_calls") or []
        if tool_calls and role != "assistant":
            raise InputError(f"{where}.tool_calls: only assistant messages carry tool calls")
        content = msg.get("content")
        if content is None and not (role == "assistant" and "content" in msg or tool_calls):
            raise InputError(f"{where}: missing 'content'")
        text = "" if content is None else _content_text(content, where)
        # Other fields (reasoning_content, name, tool_call_id, ...) pass through for a checkpoint's
        # own template; the built-in renderer ignores them.
        norm: dict[str, Any] = dict(msg)
        norm.update(role="system" if role == "developer" else role, content=text)
        if role == "assistant":
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


def _value_xml(value: Any) -> str:
    # None inside a mapping is omitted (as the release does); None inside a list renders as null.
    if isinstance(value, Mapping):
        return "".join(f"{NS}<{k}>{_value_xml(v)}{NS}</{k}>" for k, v in value.items() if v is not None)
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "".join(f"{NS}<item>{_value_xml(v)}{NS}</item>" for v in value)
    return str(value)


def _invoke_xml(name: str, arguments: Mapping[str, Any]) -> str:
    lines = [f'{NS}<invoke name="{name}">']
    lines += [f"{NS}<{k}>{_value_xml(v)}{NS}</{k}>" for k, v in arguments.items() if v is not None]
    lines.append(f"{NS}</invoke>")
    return "\n".join(lines)


def render_tool_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    """One tool-call block holding one invoke per call (`{"name", "arguments"}` or OpenAI form).

    Elements are separated by newlines; argument values are raw text (see `render_tool_call`).
    """
    invokes = []
    for i, call in enumerate(calls):
        function = call.get("function", call)
        name = _check_name(function.get("name"), f"tool_calls[{i}]")
        args = _normalize_arguments(function.get("arguments"), f"tool_calls[{i}]")
        _check_renderable(args, f"tool_calls[{i}].arguments")
        invokes.append(_invoke_xml(name, args))
    return "\n".join([TOOL_CALL_START, *invokes, TOOL_CALL_END])


def render_tool_call(name: str, arguments: Mapping[str, Any] | str) -> str:
    """The tool-call block the model writes for one call; `parse_output` inverts it.

    Values: strings raw (unescaped), booleans `true`/`false`, numbers as Python writes them, objects
    as nested namespaced tags, lists as `<item>` tags, None fields omitted. Raises InputError for
    strings holding the namespace token, non-finite floats or keys that cannot be tag names.
    """
    return render_tool_calls([{"name": name, "arguments": arguments}])


# ----------------------------------------------------------------------------------------------
# Built-in renderer
# ----------------------------------------------------------------------------------------------
def _turn(role: str, content: str) -> str:
    return f"{TURN_START}{role}\n{content}{TURN_END}\n"


def tools_section(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool-definition text appended to the developer turn (tools in OpenAI form)."""
    lines = [f"<tool>{json.dumps(t['function'], ensure_ascii=False)}</tool>" for t in tools]
    return TOOLS_SECTION_HEADER + "<tools>\n" + "\n".join(lines) + "\n</tools>\n" + TOOLS_SECTION_FOOTER


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: str = "adaptive",
    add_generation_prompt: bool = True,
) -> str:
    """Render a conversation as the release template does (layout in the module docstring).

    `thinking` is `adaptive`, `enabled` or `disabled`. Earlier assistant turns lose their reasoning
    (`reasoning_content` is ignored). Raises InputError for bad messages, tools or mode.
    """
    _check_thinking(thinking)
    msgs = normalize_messages(messages)
    tool_defs = normalize_tools(tools)
    parts = [BOD, _turn("system", standing_instructions(thinking))]
    system_text = DEFAULT_SYSTEM_PROMPT
    if msgs and msgs[0]["role"] == "system":
        system_text = msgs[0]["content"]
        msgs = msgs[1:]
    if tool_defs:
        system_text += "\n\n" + tools_section(tool_defs)
    parts.append(_turn("developer", system_text))
    for msg in msgs:
        if msg["role"] == "assistant":
            calls = render_tool_calls(msg["tool_calls"]) if msg["tool_calls"] else ""
            parts.append(_turn("ai", THINK_END + msg["content"] + calls))
        else:
            parts.append(_turn(msg["role"], msg["content"]))
    if add_generation_prompt:
        parts.append(GENERATION_PROMPT[thinking])
    return "".join(parts)


# ----------------------------------------------------------------------------------------------
# Jinja2 renderer
# ----------------------------------------------------------------------------------------------
def _jinja_str(text: str) -> str:
    """A jinja2 string literal for `text`."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


# Every newline of the output is an explicit literal, so the template's own layout never leaks into it.
CHAT_TEMPLATE = (
    "{#- MiniMax-M3 chat template as rendered by minimax_ref.chat.render_chat. -#}\n"
    "{%- set ns_token = " + _jinja_str(NS) + " -%}\n"
    "{%- set bod_token = " + _jinja_str(BOD) + " -%}\n"
    "{%- set turn_start = " + _jinja_str(TURN_START) + " -%}\n"
    "{%- set turn_end = " + _jinja_str(TURN_END) + " -%}\n"
    "{%- set think_begin_token = " + _jinja_str(THINK_START) + " -%}\n"
    "{%- set think_end_token = " + _jinja_str(THINK_END) + " -%}\n"
    "{%- set mode = thinking_mode if (thinking_mode is defined and thinking_mode) else 'adaptive' -%}\n"
    "{%- if mode not in ['adaptive', 'enabled', 'disabled'] -%}\n"
    "{{- raise_exception('unknown thinking_mode ' ~ mode) -}}\n"
    "{%- endif -%}\n"
    "{%- set mode_texts = {"
    + ", ".join(f"'{m}': {_jinja_str(THINKING_MODE_TEXT[m])}" for m in THINKING_MODES)
    + "} -%}\n"
    "{%- macro to_xml(value) -%}\n"
    "{%- if value is mapping -%}\n"
    "{%- for k, v in value.items() -%}\n"
    "{%- if v is not none -%}\n"
    "{{- " + _jinja_str(NS) + " ~ '<' ~ k ~ '>' -}}{{- to_xml(v) -}}{{- "
    + _jinja_str(NS) + " ~ '</' ~ k ~ '>' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- elif value is string -%}{{- value -}}\n"
    "{%- elif value is boolean -%}{{- 'true' if value else 'false' -}}\n"
    "{%- elif value is none -%}{{- 'null' -}}\n"
    "{%- elif value is iterable -%}\n"
    "{%- for item in value -%}\n"
    "{{- " + _jinja_str(NS + "<item>") + " -}}{{- to_xml(item) -}}"
    "{{- " + _jinja_str(NS + "</item>") + " -}}\n"
    "{%- endfor -%}\n"
    "{%- else -%}{{- value -}}\n"
    "{%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{{- bod_token ~ turn_start ~ 'system\\n' -}}\n"
    "{{- " + _jinja_str(IDENTITY_TEXT + "\n\n<thinking_instructions>\n" + THINKING_TEXT + "\n") + " -}}\n"
    "{{- mode_texts[mode] ~ '\\n</thinking_instructions>' ~ turn_end ~ '\\n' -}}\n"
    "{%- if messages and messages[0].role in ['system', 'developer'] -%}\n"
    "{%- set system_text = messages[0].content -%}\n"
    "{%- set rest = messages[1:] -%}\n"
    "{%- else -%}\n"
    "{%- set system_text = " + _jinja_str(DEFAULT_SYSTEM_PROMPT) + " -%}\n"
    "{%- set rest = messages -%}\n"
    "{%- endif -%}\n"
    "{{- turn_start ~ 'developer\\n' ~ system_text -}}\n"
    "{%- if tools -%}\n"
    "{{- '\\n\\n' ~ " + _jinja_str(TOOLS_SECTION_HEADER + "<tools>\n") + " -}}\n"
    "{%- for tool in tools -%}\n"
    "{{- '<tool>' ~ (tool.function | tojson(ensure_ascii=False)) ~ '</tool>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{{- '</tools>\\n' ~ " + _jinja_str(TOOLS_SECTION_FOOTER) + " -}}\n"
    "{%- endif -%}\n"
    "{{- turn_end ~ '\\n' -}}\n"
    "{%- for message in rest -%}\n"
    "{%- if message.role == 'assistant' -%}\n"
    "{{- turn_start ~ 'ai\\n' ~ think_end_token ~ message.content -}}\n"
    "{%- if message.tool_calls -%}\n"
    "{{- ns_token ~ '<tool_call>' -}}\n"
    "{%- for call in message.tool_calls -%}\n"
    "{%- set fn = call.function if call.function is defined else call -%}\n"
    "{{- '\\n' ~ ns_token ~ '<invoke name=\"' ~ fn.name ~ '\">' -}}\n"
    "{%- for k, v in fn.arguments.items() -%}\n"
    "{%- if v is not none -%}\n"
    "{{- '\\n' ~ ns_token ~ '<' ~ k ~ '>' -}}{{- to_xml(v) -}}{{- ns_token ~ '</' ~ k ~ '>' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{{- '\\n' ~ ns_token ~ '</invoke>' -}}\n"
    "{%- endfor -%}\n"
    "{{- '\\n' ~ ns_token ~ '</tool_call>' -}}\n"
    "{%- endif -%}\n"
    "{{- turn_end ~ '\\n' -}}\n"
    "{%- else -%}\n"
    "{{- turn_start ~ message.role ~ '\\n' ~ message.content ~ turn_end ~ '\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- turn_start ~ 'ai\\n' -}}\n"
    "{%- if mode == 'enabled' -%}{{- think_begin_token -}}"
    "{%- elif mode == 'disabled' -%}{{- think_end_token -}}{%- endif -%}\n"
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


_TAG_RE = re.compile(r"<(/?)([^<>]*)>")
_INVOKE_RE = re.compile(r"""invoke\s+name\s*=\s*(?:"([^"]*)"|'([^']*)')\s*""")
_INT_RE = re.compile(r"[+-]?\d+")
_NUMBER_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


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


def _alternatives(schema: Any) -> list[tuple[str, dict]]:
    """Flatten a schema into (type, subschema) alternatives, in the schema's order."""
    if schema is None or isinstance(schema, bool) or not isinstance(schema, Mapping):
        return [("any", {})]
    schema = dict(schema)
    for sub in schema.pop("allOf", None) or []:
        if isinstance(sub, Mapping):
            schema = {**sub, **schema}
    alts: list[tuple[str, dict]] = []
    for key in ("anyOf", "oneOf"):
        if key in schema:
            base = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
            for sub in schema[key]:
                merged = {**base, **sub} if isinstance(sub, Mapping) else base
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
        for kind, sub in alts:
            if kind not in ("object", "array", "any"):
                continue
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


def _coerce_object(block: str, children: list[_Element], schema: Any, path: str,
                   ) -> tuple[dict[str, Any], list[str]]:
    props = schema.get("properties") or {} if isinstance(schema, Mapping) else {}
    extra = schema.get("additionalProperties", True) if isinstance(schema, Mapping) else True
    out: dict[str, Any] = {}
    errs: list[str] = []
    for c in children:
        if c.attr_name is not None:
            raise _Malformed(f"an <invoke> element inside {path}")
        sub_path = f"{path}.{c.name}" if path else c.name
        if c.name in out:
            errs.append(f"{sub_path}: given more than once; the last value is kept")
        if c.name in props:
            sub = props[c.name]
        else:
            if extra is False:
                errs.append(f"{sub_path}: not a declared property")
            sub = extra if isinstance(extra, Mapping) else None
        value, e = _coerce(block, c, sub, sub_path)
        out[c.name] = value
        errs += e
    if isinstance(schema, Mapping):
        for r in schema.get("required") or []:
            if r not in out:
                errs.append(f"{path + '.' if path else ''}{r}: required but missing")
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
