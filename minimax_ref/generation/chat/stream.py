"""Splitting generated text into reasoning, content and tool calls: `StreamingParser`, piece by
piece, and `parse_output`, the one-piece case (spec `chat.md`).

Reasoning and content keep their text exactly (no stripping). Tool-call blocks are read by
`parse._parse_block`; a malformed or truncated block is returned as content, with an error entry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...errors import InputError
from .parse import _Malformed, _parse_block, _schema_map
from .tokens import THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START


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
    if not isinstance(text, str):
        raise InputError(f"parse_output: expected the generated text as a string, got {type(text).__name__}")
    parser = StreamingParser(tools, reasoning_started=reasoning_started)
    parser.feed(text)
    parser.finish()
    return parser.result()
