"""A generative evaluation beside `score`: tasks answered by generation, graded by exact match (`minimax-ref eval`).

Tasks file: one JSON object per line (blank lines skipped), each

* the conversation: `"prompt"` (one user turn) or `"messages"` (chat messages, as `generate` takes them), rendered
  with the checkpoint's chat template as users talk to the model, with the generation prompt;
* what is right: `"answer"` (a string: the final answer, the content after the reasoning, must equal it with
  leading and trailing whitespace stripped on both sides) or `"tool_call"` (`{"name", "arguments"}`, or a list of
  them: the reply's parsed tool calls must be exactly these, in order, arguments equal as JSON values);
* optional `"tools"` (the tool schemas offered), `"thinking"` (adaptive / enabled / disabled), `"system"`,
  `"max_new_tokens"` and `"id"`; any other key is an error.

Grading (`grade`), per task, from the generation result (`GenerationResult`):

* finished: the reply ended with a stop token (finish_reason "stop"), not cut by the token limit;
* called: it holds at least one parsed tool call; malformed: a tool call of its output did not parse cleanly
  (truncated or malformed, naming no offered tool, or with an argument that does not fit its schema);
* abstained: it finished with no final answer and no tool call (empty content after the reasoning);
* right: it finished without a parse error and, for an answer task, made no tool call and its content is the
  answer; for a tool-call task, its calls are the expected ones. A reply cut by length is never right.

Columns (`summarize`): `accuracy` (right over all tasks), `answer_exact` and `tool_call_exact` (right over the
answer / tool-call tasks), and the `call_rate`, `malformed_rate`, `abstain_rate` and `finished_rate` over all tasks;
each with its standard error, that of a mean of 0/1 outcomes over the tasks: `sqrt(p (1 - p) / (n - 1))` (null for
one task). Against a reference (`compare`): each column's paired difference (model - reference) over the same tasks,
with the standard error of the mean of the per-task differences.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InputError
from .records import read_jsonl

if TYPE_CHECKING:
    from ..generation.generate import GenerationResult
    from ..model.decoder import MiniMaxM3
    from .trace import Interventions

TASK_KEYS = {"prompt", "messages", "answer", "tool_call", "tools", "thinking", "system", "max_new_tokens", "id"}
THINKING = ("adaptive", "enabled", "disabled")
INDICATORS = ("right", "called", "malformed", "abstained", "finished")
# what every tool-call error of `chat.parse_output` says (truncated or malformed calls, unknown tools, arguments off
# their schema); its other error, a reply that ends inside its reasoning, is no call
TOOL_CALL_ERROR = "tool call"
# summary column -> (indicator, which tasks: None = all, else the kind)
COLUMNS = {"accuracy": ("right", None), "answer_exact": ("right", "answer"), "tool_call_exact": ("right", "tool_call"),
           "call_rate": ("called", None), "malformed_rate": ("malformed", None), "abstain_rate": ("abstained", None),
           "finished_rate": ("finished", None)}


@dataclass(frozen=True)
class Task:
    """One task: the conversation (`prompt`, a string or a list of messages), what is right (`answer`, or the list of
    expected `tool_calls`), and its own chat settings. `kind` is "answer" or "tool_call"."""

    line: int
    prompt: str | list
    answer: str | None
    tool_calls: list[dict] | None
    tools: list | None = None
    thinking: str | None = None
    system: str | None = None
    max_new_tokens: int | None = None
    id: object = None

    @property
    def kind(self) -> str:
        return "answer" if self.answer is not None else "tool_call"


def _check_call(call: object, where: str) -> dict:
    if not isinstance(call, dict) or set(call) != {"name", "arguments"} or not isinstance(call["name"], str) \
            or not isinstance(call["arguments"], dict):
        raise InputError(f"{where} must be an object {{\"name\": str, \"arguments\": {{...}}}}, got {call!r}")
    return {"name": call["name"], "arguments": call["arguments"]}


def parse_task(obj: object, line: int = 0) -> Task:
    """One decoded tasks-file line as a `Task` (InputError for anything else; the caller adds the line)."""
    if not isinstance(obj, dict):
        raise InputError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - TASK_KEYS)
    if unknown:
        raise InputError(f"unknown keys {unknown} (known: {sorted(TASK_KEYS)})")
    if ("prompt" in obj) == ("messages" in obj):
        raise InputError("give exactly one of 'prompt' (a user turn) or 'messages' (a conversation)")
    prompt = obj.get("prompt", obj.get("messages"))
    if "prompt" in obj and (not isinstance(prompt, str) or not prompt):
        raise InputError(f"'prompt' must be a non-empty string, got {prompt!r}")
    if "messages" in obj and (not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict)
                                                                                   for m in prompt)):
        raise InputError("'messages' must be a non-empty list of message objects")
    if ("answer" in obj) == ("tool_call" in obj):
        raise InputError("give exactly one of 'answer' (the final answer) or 'tool_call' (the expected call)")
    answer, calls = obj.get("answer"), None
    if "answer" in obj and not isinstance(answer, str):
        raise InputError(f"'answer' must be a string, got {answer!r}")
    if "answer" in obj and not answer.strip():  # an empty reply would count as right, and as an abstention
        raise InputError("'answer' is empty: give the expected final answer")
    if "tool_call" in obj:
        raw = obj["tool_call"]
        items = raw if isinstance(raw, list) else [raw]
        if not items:
            raise InputError("'tool_call' is an empty list: give the expected call (or use 'answer')")
        calls = [_check_call(c, "'tool_call'") for c in items]
    tools = obj.get("tools")
    if tools is not None:
        from ..generation.chat import record_tools

        tools = record_tools(tools)
    if calls is not None and not tools:
        raise InputError("a 'tool_call' task needs the 'tools' the model may call")
    thinking = obj.get("thinking")
    if thinking is not None and thinking not in THINKING:
        raise InputError(f"'thinking'={thinking!r}: choose one of {list(THINKING)}")
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        raise InputError(f"'system' must be a string, got {system!r}")
    new = obj.get("max_new_tokens")
    if new is not None and (isinstance(new, bool) or not isinstance(new, int) or new < 1):
        raise InputError(f"'max_new_tokens'={new!r}: must be an integer >= 1")
    return Task(line, prompt, answer, calls, tools, thinking, system, new, obj.get("id"))


def read_tasks(path: str | Path) -> list[Task]:
    """Every task of a tasks file; an InputError names `path:line` of the first bad line."""
    return read_jsonl(path, parse_task, flag="--tasks", what="tasks")


# ---------------------------------------------------------------------------------------------- grading


def grade(task: Task, content: str, tool_calls: Sequence[dict], errors: Sequence[str], finish_reason: str
          ) -> dict[str, bool]:
    """The 0/1 outcomes of one reply (module docstring): right, called, malformed, abstained, finished. content, tool
    calls and errors are the parsed reply's (`chat.parse_output`), finish_reason "stop" or "length"."""
    finished = finish_reason == "stop"
    called = len(tool_calls) > 0
    malformed = any(TOOL_CALL_ERROR in e for e in errors)
    calls = [{"name": c.get("name"), "arguments": c.get("arguments")} for c in tool_calls]
    if task.answer is not None:
        right = not called and content.strip() == task.answer.strip()
    else:
        right = calls == task.tool_calls
    return {"right": finished and not malformed and right, "called": called, "malformed": malformed,
            "abstained": finished and not called and not malformed and not content.strip(), "finished": finished}


def proportion(outcomes: Sequence[bool]) -> tuple[float | None, float | None]:
    """(mean, standard error) of 0/1 outcomes: p and sqrt(p (1 - p) / (n - 1)), the standard error of a mean with the
    sample variance; (None, None) for no outcomes, a None error for one."""
    n = len(outcomes)
    if n == 0:
        return None, None
    p = sum(bool(x) for x in outcomes) / n
    return p, (math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else None)


def paired_difference(a: Sequence[bool], b: Sequence[bool]) -> tuple[float | None, float | None]:
    """(mean, standard error) of the per-task differences a_i - b_i of 0/1 outcomes on the same tasks: the mean of
    d_i and sqrt(sum (d_i - mean)^2 / (n - 1) / n)."""
    if len(a) != len(b):
        raise ValueError("paired outcomes cover different tasks")
    n = len(a)
    if n == 0:
        return None, None
    d = [int(x) - int(y) for x, y in zip(a, b)]
    mean = sum(d) / n
    if n == 1:
        return mean, None
    return mean, math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)


def _column_outcomes(tasks: Sequence[Task], grades: Sequence[dict], column: str) -> list[bool]:
    indicator, kind = COLUMNS[column]
    return [g[indicator] for t, g in zip(tasks, grades) if kind is None or t.kind == kind]


def summarize(tasks: Sequence[Task], grades: Sequence[dict]) -> dict[str, Any]:
    """The columns (module docstring) with their standard errors (`<column>_stderr`), and the task counts."""
    out: dict[str, Any] = {"tasks": len(tasks), "answer_tasks": sum(t.kind == "answer" for t in tasks),
                           "tool_call_tasks": sum(t.kind == "tool_call" for t in tasks)}
    for column in COLUMNS:
        p, se = proportion(_column_outcomes(tasks, grades, column))
        out[column], out[f"{column}_stderr"] = p, se
    return out


def compare(tasks: Sequence[Task], grades: Sequence[dict], reference: Sequence[dict]) -> dict[str, Any]:
    """Each column's paired difference, model minus reference, with its standard error (`paired_difference`)."""
    out: dict[str, Any] = {}
    for column in COLUMNS:
        d, se = paired_difference(_column_outcomes(tasks, grades, column), _column_outcomes(tasks, reference, column))
        out[column], out[f"{column}_stderr"] = d, se
    return out


# ---------------------------------------------------------------------------------------------- running


def task_name(task: Task, source: str | Path | None = None) -> str:
    """How an error names a task: `source:line` (the tasks file and the task's line in it; "line N" without a
    source), with the task's id where it has one."""
    where = f"{source}:{task.line}" if source is not None else f"task at line {task.line}"
    return where + (f" (id {task.id!r})" if task.id is not None else "")


def check_task_lengths(tok, tasks: Sequence[Task], limit: int, source: str | Path | None = None) -> None:
    """Refuse, naming each (`task_name`), the tasks whose prompt, rendered as `evaluate` renders it (the chat template
    with the task's tools, thinking and system, and the generation prompt), has `limit` tokens or more: no room is
    left for the reply under the maximum sequence length. All of them in one InputError, so that one edit of the
    tasks file (or one --max-model-len) fixes the run."""
    from ..generation.generate import encode_prompt

    too_long = []
    for t in tasks:
        name = task_name(t, source)
        n = len(encode_prompt(tok, t.prompt, chat=True, tools=t.tools, thinking=t.thinking or "adaptive",
                              system=t.system, where=name))
        if n >= limit:
            too_long.append(f"{name} has {n} tokens")
    if too_long:
        shown = "; ".join(too_long[:5]) + (f"; and {len(too_long) - 5} more" if len(too_long) > 5 else "")
        raise InputError(f"no room for a reply under the maximum sequence length {limit} for {len(too_long)} "
                         f"task{'s' if len(too_long) != 1 else ''}: {shown} (raise --max-model-len, or shorten or "
                         "drop those tasks)")


def evaluate(model: MiniMaxM3, tok, tasks: Sequence[Task], *, max_new_tokens: int = 512, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0, max_batch_size: int | None = None,
             interventions: Interventions | None = None, on_result=None,
             source: str | Path | None = None) -> list[GenerationResult]:
    """Generate a reply to every task in one `generate` call (continuous batching, each task with its own tools,
    thinking, system and max_new_tokens; greedy by default) and return the results in task order; `grade` each with
    `grade_result`. interventions: applied to every forward (`generate`'s). on_result(i, result) as each task ends.
    A task whose prompt leaves no room under the model's maximum sequence length is refused first, named by its line
    (in `source`, the tasks file) and id (`check_task_lengths`), not by its index in the batch."""
    from ..generation.generate import generate
    from ..model.config import RuntimeConfig

    if not tasks:
        raise InputError("no tasks to evaluate")
    rt = getattr(model, "runtime", None)
    limit = rt.max_seq_len if rt is not None and rt.max_seq_len else RuntimeConfig().resolved(
        model.text.max_position_embeddings).max_seq_len  # as generate's `DecodeJob.make` resolves it
    check_task_lengths(tok, tasks, limit, source)
    return generate(model, tok, [t.prompt for t in tasks], chat=True, tools=[t.tools for t in tasks],
                    thinking=[t.thinking or "adaptive" for t in tasks], system=[t.system for t in tasks],
                    max_new_tokens=[t.max_new_tokens or max_new_tokens for t in tasks], temperature=temperature,
                    top_p=top_p, top_k=top_k, seed=seed, max_batch_size=max_batch_size, interventions=interventions,
                    on_result=on_result)


def grade_result(task: Task, result: GenerationResult) -> dict[str, bool]:
    """`grade` of a `generate` result."""
    return grade(task, result.content, result.tool_calls, result.errors, result.finish_reason)
