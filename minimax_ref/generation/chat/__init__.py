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

Two renderers, two users
------------------------
`render_chat` (Python, `render`) and `CHAT_TEMPLATE` (jinja2, `template`) render the same format;
both stay because they serve different readers:

* `CHAT_TEMPLATE` is for programs that read a checkpoint folder: the test tokenizer
  (`weights.synth_tokenizer`), synthetic and exported checkpoints and the embedded default
  checkpoint ship it as their `chat_template.jinja`, so transformers (and this project's jinja2
  path) render them as the release renders. A checkpoint can only carry a template, not Python,
  and the release's own template is a test input here, never copied.
* `render_chat` is for Python callers: the tokenizer renders with it when a checkpoint folder has
  no `chat_template.jinja` (or, with a warning, when jinja2 cannot be imported), and the nano
  training data renders every prompt with it (and its tool-call completions with
  `render_tool_calls`, the same writer). It is also the readable statement of the format.
  Routing it through `CHAT_TEMPLATE` would change its errors (the template's refusals and
  jinja2's failures come back as InputErrors naming the template).

Tests (`tests/test_chat.py`, `tests/test_chat_release.py`) hold the two to byte-identical output,
with each other and with the release's `chat_template.jinja`, on every conversation they accept.

Modules
-------
`tokens`: the format's fixed texts (special tokens, turn texts, tag syntax) and sampling settings.
`messages`: validation and normalisation of messages and tools.
`render`: the built-in renderer `render_chat` and the tool-call block writer.
`template`: `CHAT_TEMPLATE` and the sandboxed rendering of any jinja2 chat template.
`parse`: reading a tool-call block, argument values coerced by the tool's schema.
`stream`: `StreamingParser` and `parse_output`, the reasoning / content / tool-call split.
Callers import from this package, which re-exports every name they use.
"""

from .messages import _IMAGE_PART_TYPES as _IMAGE_PART_TYPES  # read by generation.multimodal
from .messages import normalize_messages, normalize_tools, record_tools
from .render import (
    TOOL_CALL_EXAMPLE,
    render_chat,
    render_tool_call,
    render_tool_calls,
    split_reasoning,
    standing_instructions,
    tools_section,
)
from .stream import StreamingParser, parse_output
from .template import CHAT_TEMPLATE, render_chat_template
from .tokens import (
    BOD,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_SYSTEM_PROMPT,
    DSPARK_NOISE,
    EVAL_SAMPLING,
    EXAMPLE_CALLS,
    GENERATION_PROMPT,
    IDENTITY_TEXT,
    IMAGE,
    IMAGE_END,
    IMAGE_START,
    NS,
    RECOMMENDED_SAMPLING,
    THINK_END,
    THINK_START,
    THINKING_MODE_TEXT,
    THINKING_MODES,
    THINKING_TEXT,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOLS_INTRO,
    TOOLS_USAGE,
    TURN_END,
    TURN_START,
    VIDEO,
)

__all__ = [
    "BOD", "CHAT_TEMPLATE", "DEFAULT_MAX_NEW_TOKENS", "DEFAULT_SYSTEM_PROMPT", "DSPARK_NOISE", "EVAL_SAMPLING",
    "EXAMPLE_CALLS",
    "GENERATION_PROMPT", "IDENTITY_TEXT", "IMAGE", "IMAGE_END", "IMAGE_START", "NS", "RECOMMENDED_SAMPLING",
    "THINKING_MODES", "THINKING_MODE_TEXT", "THINKING_TEXT", "THINK_END", "THINK_START", "TOOLS_INTRO",
    "TOOLS_USAGE", "TOOL_CALL_END", "TOOL_CALL_EXAMPLE", "TOOL_CALL_START", "TURN_END", "TURN_START", "VIDEO",
    "StreamingParser", "normalize_messages", "normalize_tools", "parse_output", "record_tools", "render_chat",
    "render_chat_template", "render_tool_call", "render_tool_calls", "split_reasoning", "standing_instructions",
    "tools_section",
]
