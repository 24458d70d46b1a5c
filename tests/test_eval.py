"""`minimax-ref eval` and `research.tasks`: hand-made replies graded (right, wrong, malformed tool call, no answer, cut
by length), the columns and their standard errors worked by hand, task-file checks naming the line, per-prompt chat
settings in `generate`, and the command end to end on the embedded default."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import minimax_ref as mr
from minimax_ref.errors import InputError
from minimax_ref.research.tasks import compare, grade, parse_task, read_tasks, summarize

NS = "]<]minimax[>["
TOOLS = json.loads((Path(__file__).parents[1] / "examples" / "nano" / "tools.json").read_text())
WEATHER = {"name": "get_weather", "arguments": {"city": "Lisbon", "days": 3}}


def _call(name: str, **args) -> str:
    inner = "".join(f"{NS}<{k}>{v}{NS}</{k}>" for k, v in args.items())
    return f"{NS}<tool_call>{NS}<invoke name=\"{name}\">{inner}{NS}</invoke>{NS}</tool_call>"


def _graded(task: dict, text: str, finish: str = "stop") -> dict:
    """A raw reply parsed by the engine's parser (as `generate` does), then graded."""
    t = parse_task(task)
    parsed = mr.parse_output(text, t.tools)
    return grade(t, parsed["content"], parsed["tool_calls"], parsed["errors"], finish)


ANSWER = {"prompt": "What is 17*23?", "answer": "391"}
CALL = {"prompt": "Weather in Lisbon for 3 days?", "tool_call": WEATHER, "tools": TOOLS}


@pytest.mark.parametrize("task,text,finish,expected", [
    # right: the content after the reasoning is the answer (whitespace around it does not count)
    (ANSWER, "<mm:think>17*23 = 391</mm:think>\n391 ", "stop", dict(right=True, finished=True)),
    (ANSWER, "</mm:think>391", "stop", dict(right=True, finished=True)),
    # wrong: another number, or the answer inside a longer reply
    (ANSWER, "<mm:think>17*23 = 381</mm:think>381", "stop", dict(right=False, finished=True)),
    (ANSWER, "<mm:think>x</mm:think>It is 391.", "stop", dict(right=False, finished=True)),
    # no answer: reasoning, then nothing
    (ANSWER, "<mm:think>17*23 = 391</mm:think>", "stop", dict(right=False, abstained=True, finished=True)),
    # cut by length: the right text so far is not an answer
    (ANSWER, "<mm:think>17*23 = 391</mm:think>391", "length", dict(right=False, finished=False)),
    (ANSWER, "<mm:think>17*23 is", "length", dict(right=False, finished=False)),
    # a tool call where an answer was wanted
    (ANSWER, _call("get_weather", city="Lisbon", days=3), "stop", dict(right=False, called=True, finished=True)),
    # tool calls: exact, wrong argument, wrong tool, malformed (truncated, unknown tool, argument off its schema)
    (CALL, _call("get_weather", city="Lisbon", days=3), "stop", dict(right=True, called=True, finished=True)),
    (CALL, _call("get_weather", city="Lisboa", days=3), "stop", dict(right=False, called=True, finished=True)),
    (CALL, _call("get_order", order_id="Lisbon"), "stop", dict(right=False, called=True, finished=True)),
    (CALL, _call("get_weather", city="Lisbon", days=3)[:-20], "stop", dict(right=False, malformed=True,
                                                                            finished=True)),
    (CALL, _call("get_forecast", city="Lisbon", days=3), "stop", dict(right=False, called=True, malformed=True,
                                                                       finished=True)),
    (CALL, _call("get_weather", city="Lisbon", days="three"), "stop", dict(right=False, called=True, malformed=True,
                                                                            finished=True)),
    (CALL, _call("get_weather", city="Lisbon", days=3) + _call("get_order", order_id="x"), "stop",
     dict(right=False, called=True, finished=True)),
    (CALL, "The weather is fine.", "stop", dict(right=False, finished=True)),
    (CALL, _call("get_weather", city="Lisbon", days=3), "length", dict(right=False, called=True, finished=False)),
])
def test_hand_made_replies_are_graded(task, text, finish, expected):
    want = {**dict(right=False, called=False, malformed=False, abstained=False, finished=False), **expected}
    assert _graded(task, text, finish) == want


def test_columns_and_standard_errors_by_hand():
    tasks = [parse_task(ANSWER)] * 3 + [parse_task(CALL)] * 2
    g = [dict(right=r, called=c, malformed=False, abstained=False, finished=f)
         for r, c, f in ((True, False, True), (False, False, True), (False, False, False), (True, True, True),
                         (False, True, True))]
    s = summarize(tasks, g)
    assert (s["tasks"], s["answer_tasks"], s["tool_call_tasks"]) == (5, 3, 2)
    assert s["accuracy"] == pytest.approx(2 / 5)
    # sample variance of 1,0,0,1,0 is 0.3; the standard error of its mean sqrt(0.3 / 5)
    assert s["accuracy_stderr"] == pytest.approx(math.sqrt(0.3 / 5))
    assert s["answer_exact"] == pytest.approx(1 / 3) and s["tool_call_exact"] == pytest.approx(1 / 2)
    assert s["call_rate"] == pytest.approx(2 / 5) and s["finished_rate"] == pytest.approx(4 / 5)
    assert s["abstain_rate"] == 0.0 and s["abstain_rate_stderr"] == 0.0
    ref = [dict(x, right=True) for x in g]
    d = compare(tasks, g, ref)
    # differences 0,-1,-1,0,-1: mean -0.6, sample variance 0.3
    assert d["accuracy"] == pytest.approx(-0.6) and d["accuracy_stderr"] == pytest.approx(math.sqrt(0.3 / 5))
    assert d["call_rate"] == 0.0
    one = summarize(tasks[:1], g[:1])
    assert one["accuracy"] == 1.0 and one["accuracy_stderr"] is None and one["tool_call_exact"] is None


@pytest.mark.parametrize("line,needle", [
    ('{"answer": "1"}', "exactly one of 'prompt'"),
    ('{"prompt": "x"}', "exactly one of 'answer'"),
    ('{"prompt": "x", "answer": 1}', "'answer' must be a string"),
    ('{"prompt": "x", "answer": " "}', "'answer' is empty"),
    ('{"prompt": "x", "tool_call": {"name": "f"}}', "'tool_call' must be an object"),
    ('{"prompt": "x", "tool_call": {"name": "f", "arguments": {}}}', "needs the 'tools'"),
    ('{"prompt": "x", "answer": "1", "thinking": "maybe"}', "'thinking'='maybe'"),
    ('{"prompt": "x", "answer": "1", "max_new_tokens": 0}', "'max_new_tokens'=0"),
    ('{"prompt": "x", "answer": "1", "extra": 1}', "unknown keys ['extra']"),
    ('{"prompt": "x", "answer": "1"', "not valid JSON"),
])
def test_bad_task_lines_name_the_line(tmp_path, line, needle):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"prompt": "ok", "answer": "1"}\n\n' + line + "\n")
    with pytest.raises(InputError) as e:
        read_tasks(path)
    assert f"{path}:3: " in str(e.value) and needle in str(e.value)


def test_the_shipped_task_file_reads():
    tasks = read_tasks(Path(__file__).parents[1] / "examples" / "nano" / "tasks.jsonl")
    kinds = [t.kind for t in tasks]
    assert len(tasks) == 40 and kinds.count("tool_call") == 16
    assert all(str(int(t.answer)) == t.answer for t in tasks if t.kind == "answer")


@torch.no_grad()
def test_generate_takes_tools_thinking_and_system_per_prompt():
    """Each prompt is rendered with its own chat settings (the template called directly), parsed with its own tools,
    and its greedy tokens are those it gets alone."""
    model, tok = mr.load_model(None, dtype=torch.float32), mr.load_tokenizer(None)
    prompts = ["What's the weather in Lisbon for the next 3 days?", "What is 12+30?", "Hi"]
    tools = [TOOLS, None, TOOLS]
    thinking = ["adaptive", "enabled", "disabled"]
    system = [None, None, "Be brief."]
    new = [56, 24, 24]  # room for prompt 0's tool call
    out = mr.generate(model, tok, prompts, chat=True, tools=tools, thinking=thinking, system=system,
                      max_new_tokens=new, temperature=0, max_batch_size=3)
    for i, r in enumerate(out):
        messages = ([{"role": "system", "content": system[i]}] if system[i] else []) + [
            {"role": "user", "content": prompts[i]}]
        assert r.prompt_token_ids == tok.apply_chat_template(messages, tools=tools[i], thinking=thinking[i],
                                                             add_generation_prompt=True)
        alone = mr.generate(model, tok, [prompts[i]], chat=True, tools=tools[i], thinking=thinking[i],
                            system=system[i], max_new_tokens=new[i], temperature=0)[0]
        assert r.token_ids == alone.token_ids and r.tool_calls == alone.tool_calls
    assert out[0].tool_calls == [WEATHER]  # the nano model's seed check, parsed with prompt 0's tools
    with pytest.raises(InputError, match="one entry per prompt"):
        mr.generate(model, tok, prompts, chat=True, tools=[TOOLS, None], max_new_tokens=1)
    with pytest.raises(InputError, match=r"thinking: give one value, or one per prompt \(3\)"):
        mr.generate(model, tok, prompts, chat=True, thinking=["enabled"], max_new_tokens=1)


def test_eval_command_on_the_embedded_default(tmp_path, capsys):
    """Tasks with known outcomes on the nano model: a sum it gets right, an answer it does not give wrong, its seed
    tool call, a thinking turn cut by a 4-token limit; with --reference the same checkpoint, every difference is 0."""
    from minimax_ref.cli.main import main
    from minimax_ref.weights.embedded import default_checkpoint

    path = tmp_path / "tasks.jsonl"
    lines = [{"prompt": "What is 13+4?", "answer": "17", "thinking": "enabled", "id": "right"},
             {"prompt": "What is 13+4?", "answer": "18", "thinking": "enabled", "id": "wrong"},
             {"prompt": "What's the weather in Lisbon for the next 3 days?", "tools": TOOLS, "tool_call": WEATHER},
             {"prompt": "What is 13+4?", "answer": "17", "thinking": "enabled", "max_new_tokens": 4, "id": "cut"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["eval", "--tasks", str(path), "--max-new-tokens", "96", "--output-format", "json",
                 "--reference", str(default_checkpoint())]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    rows, summary = out[:-1], out[-1]
    assert [r["right"] for r in rows] == [True, False, True, False]
    assert [r["finished"] for r in rows] == [True, True, True, False] and rows[3]["finish_reason"] == "length"
    assert rows[2]["tool_calls"] == [WEATHER] and rows[0]["content"] == "17"
    assert summary["accuracy"] == 0.5 and summary["tool_call_exact"] == 1.0 and summary["finished_rate"] == 0.75
    assert summary["reference"]["accuracy"] == 0.5 and summary["difference"]["accuracy"] == 0.0
    assert all(r["reference"]["right"] == r["right"] for r in rows)
    # the text table, and a mask that keeps too few experts refused before loading
    assert main(["eval", "--tasks", str(path), "--max-new-tokens", "4"]) == 0
    assert "accuracy" in capsys.readouterr().out
    assert main(["eval", "--tasks", str(path), "--drop-experts", "2:0,1,2,3,4,5,6,7,8,9,10,11,12"]) == 2
    assert "layer 2 keeps 3 experts" in capsys.readouterr().err


def _long_tasks(tmp_path) -> Path:
    """A tasks file whose third line (a blank line before it) is too long for 256 tokens, with an id."""
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"prompt": "What is 13+4?", "answer": "17"}) + "\n\n"
                    + json.dumps({"prompt": "word " * 300, "answer": "2", "id": "long-one"}) + "\n")
    return path


def test_eval_names_a_too_long_task_by_file_line_and_id_before_loading(tmp_path, capsys, monkeypatch):
    """A task whose prompt (rendered with the chat template, as eval renders it) leaves no room under
    --max-model-len is refused before any model loads, named by its tasks-file line and id, with its token count from
    the checkpoint's own tokenizer; not as `prompts[1]` once the model has loaded."""
    import minimax_ref.cli.model_args as model_args
    from minimax_ref.cli.main import main

    def no_load(*a, **k):
        raise AssertionError("the model loaded before the task lengths were checked")

    monkeypatch.setattr(model_args, "load_from_args", no_load)
    path = _long_tasks(tmp_path)
    tok = mr.load_tokenizer(None)
    n = len(tok.apply_chat_template([{"role": "user", "content": "word " * 300}], add_generation_prompt=True,
                                    thinking="adaptive"))
    assert main(["eval", "--tasks", str(path), "--max-model-len", "256"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:3 (id 'long-one') has {n} tokens" in err and "maximum sequence length 256" in err, err
    assert "prompts[" not in err and f"{path}:1" not in err


def test_evaluate_names_a_too_long_task_when_checked_after_loading(tmp_path):
    """Where the tokenizer cannot be read before loading (synthetic weights), `evaluate` names the task the same
    way, before generating."""
    from minimax_ref.research.tasks import evaluate

    path = _long_tasks(tmp_path)
    model = mr.load_model(None, dtype=torch.float32, max_seq_len=256)
    with pytest.raises(InputError) as e:
        evaluate(model, mr.load_tokenizer(None), read_tasks(path), max_new_tokens=1, source=path)
    assert f"{path}:3 (id 'long-one') has" in str(e.value) and "prompts[" not in str(e.value)
