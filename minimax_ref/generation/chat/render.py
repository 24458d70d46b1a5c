"""The built-in renderer of the chat format (`render_chat`) and the tool-call block writer.

`render_chat` renders a conversation in Python, exactly as the release's template does (layout in the
package docstring); `render_tool_calls` / `render_tool_call` write the block a model emits for its
calls, which `parse_output` inverts. The jinja2 twin of `render_chat` is `template.CHAT_TEMPLATE`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ...errors import InputError
from .messages import (
    _PREAMBLE_ROLES,
    _check_name,
    _check_renderable,
    _check_thinking,
    _normalize_arguments,
    normalize_messages,
    normalize_tools,
)
from .tokens import (
    BOD,
    DEFAULT_SYSTEM_PROMPT,
    EXAMPLE_CALLS,
    GENERATION_PROMPT,
    IDENTITY_TEXT,
    NS,
    THINK_END,
    THINK_START,
    THINKING_MODE_TEXT,
    THINKING_TEXT,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOLS_INTRO,
    TOOLS_USAGE,
    TURN_END,
    TURN_START,
)


def standing_instructions(thinking: str = "adaptive", identity: str | None = None) -> str:
    """The content of the first (`system`) turn: `identity` (a `root` message's text; None or ""
    gives `IDENTITY_TEXT`) and the thinking instructions of mode `thinking`."""
    _check_thinking(thinking)
    return ((identity or IDENTITY_TEXT) + "\n\n<thinking_instructions>\n" + THINKING_TEXT + "\n"
            + THINKING_MODE_TEXT[thinking] + "\n</thinking_instructions>")


# ----------------------------------------------------------------------------------------------
# Tool-call blocks
# ----------------------------------------------------------------------------------------------
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
# Conversations
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
    """Render a conversation exactly as the release template does (layout in the package docstring).

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
