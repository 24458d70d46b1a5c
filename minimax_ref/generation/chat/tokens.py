"""The fixed texts of the chat format (spec `chat.md`): special tokens, the first two turns' texts,
the tools section's texts, the generation prompts and the tag syntax of tool-call blocks; also the
sampling settings published with the model.

Token ids are read from the tokenizer files, never from here. The renderers (`render`, `template`),
the parser (`parse`, `stream`) and the tokenizer (`generation.tokenizer`) all take their texts from
this module, so a text is written once.
"""

from __future__ import annotations

import re
from typing import Any

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

# Published with the chat model rather than part of the format; they live here so that callers that
# format chats (the CLI, the nano evaluation) find them beside the format's texts.
#: MiniMax's recommended sampling settings.
RECOMMENDED_SAMPLING: dict[str, float | int] = dict(temperature=1.0, top_p=0.95, top_k=40)
#: Tokens per reply by default (`generate`, the CLI): room for the reasoning of a thinking turn before its answer.
DEFAULT_MAX_NEW_TOKENS = 512
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

# Tags of tool-call blocks: the parser reads them, and the argument-name check (`messages`) refuses
# names that would read back as an invoke tag.
_TAG_RE = re.compile(r"<(/?)([^<>]*)>")
_INVOKE_RE = re.compile(r"""invoke\s+name\s*=\s*(?:"([^"]*)"|'([^']*)')\s*""")
