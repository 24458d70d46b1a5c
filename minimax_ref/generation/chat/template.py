"""Jinja2 chat templates: the project's own `CHAT_TEMPLATE`, and rendering any checkpoint's template.

`render_chat_template` renders a template (the checkpoint's `chat_template.jinja`, or `CHAT_TEMPLATE`)
in a jinja2 sandbox with transformers' environment options, on a conversation validated and
normalised by `normalize_messages`. `CHAT_TEMPLATE` renders exactly what `render.render_chat`
renders; the package docstring says why both exist.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ...errors import CheckpointError, InputError
from .messages import (
    _IMAGE_PART_TYPES,
    _PREAMBLE_ROLES,
    _VIDEO_PART_TYPES,
    _check_thinking,
    normalize_messages,
    normalize_tools,
)
from .render import TOOL_CALL_EXAMPLE
from .tokens import (
    BOD,
    DEFAULT_SYSTEM_PROMPT,
    IDENTITY_TEXT,
    IMAGE,
    NS,
    THINK_END,
    THINK_START,
    THINKING_MODE_TEXT,
    THINKING_MODES,
    THINKING_TEXT,
    TOOLS_INTRO,
    TOOLS_USAGE,
    TURN_END,
    TURN_START,
    VIDEO,
)


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
                         "(pip install jinja2)") from e

    def raise_exception(message: str) -> None:
        raise InputError(f"{origin}: the chat template refused the conversation: {message}")

    # The same environment options as transformers' chat templates: templates rely on them.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    # transformers' other global: the current local time (date-stamped system prompts)
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
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
