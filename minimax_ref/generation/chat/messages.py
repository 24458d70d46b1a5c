"""Validation and normalisation of a conversation's messages and tools (spec `chat.md`).

`normalize_messages` and `normalize_tools` bring what callers pass (OpenAI form, transformers' form,
part lists, JSON-text arguments) to one form that both renderers take; conversations the release
template refuses raise InputError naming the message. Tool-call arguments are checked here for
having a tool-call block form (tag-able names, no namespace token in strings, finite numbers).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ...errors import InputError
from .tokens import _INVOKE_RE, IMAGE, NS, THINKING_MODES, VIDEO


def _check_thinking(thinking: Any) -> None:
    if thinking not in THINKING_MODES:
        raise InputError(f"thinking={thinking!r}: expected one of {', '.join(THINKING_MODES)}")


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


def record_tools(value: Any) -> list:
    """A request record's `tools` (an --input-file line, an eval task, a chat trace): one tool schema or a list of
    them, checked by `normalize_tools` (InputError naming what is wrong); returned as given, in a list."""
    tools = [value] if isinstance(value, Mapping) else value
    if not isinstance(tools, list):
        raise InputError(f"'tools' must be a list of tool schemas, got {value!r}")
    normalize_tools(tools)
    return tools


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
