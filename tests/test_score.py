"""`minimax-ref score`: per-token NLL through the chunked, batched, cached prefill, drift and top-1
agreement against a reference, checked against an independent full-forward computation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from minimax_ref.cli.main import main
from minimax_ref.errors import InputError
from minimax_ref.generation.tokenizer import load_tokenizer
from minimax_ref.research.score import ScoreTrace, TraceScore, chat_trace_ids, drift_stats, read_traces
from minimax_ref.weights.loader import load_model
from minimax_ref.weights.prune import write_pruned

# (length, completion_start): one trace past the tiny preset's dense-equivalent MSA budget
# (4 blocks x 16 = 64 tokens), so the sparse path and chunk boundaries are both exercised.
SHAPES = [(90, 30), (41, 40), (25, 3), (60, 59)]


@pytest.fixture(scope="module")
def src(tiny_nvfp4):
    return tiny_nvfp4


@pytest.fixture(scope="module")
def pruned(src, tmp_path_factory):
    """The source with 8 of 16 experts kept (every other one), written by the pruning writer."""
    out = tmp_path_factory.mktemp("score-pruned") / "p"
    return write_pruned(src, out, {L: list(range(0, 16, 2)) for L in (1, 2, 3)}, "test")


@pytest.fixture(scope="module")
def traces_file(tmp_path_factory):
    g = torch.Generator().manual_seed(7)
    path = tmp_path_factory.mktemp("traces") / "traces.jsonl"
    lines = []
    for n, start in SHAPES:
        lines.append(json.dumps({"input_ids": torch.randint(0, 1000, (n,), generator=g).tolist(),
                                 "completion_start": start, "id": f"t{n}"}))
    lines.append("")  # blank lines are skipped
    lines.append(json.dumps({"prompt": "The answer is", "completion": " forty-two, of course."}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(capsys, *argv) -> dict:
    assert main(list(argv)) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1  # one JSON object on stdout
    return json.loads(out[0])


def _independent(path, traces) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-trace completion NLL and argmax from the plain full forward (no cache, no batching)."""
    model = load_model(path, dtype=torch.float32)
    nll, arg = [], []
    with torch.no_grad():
        for t in traces:
            ids = torch.tensor([t.input_ids])
            logits = model(ids)[0]
            logp = torch.log_softmax(logits, dim=-1)
            pos = torch.arange(t.completion_start, len(t.input_ids))
            nll.append(-logp[pos - 1, ids[0, pos]].double())
            arg.append(logits[pos - 1].argmax(-1))
    return nll, arg


def test_self_drift_is_zero_and_agreement_one(capsys, src, traces_file):
    res = _run(capsys, "score", "--ckpt-path", str(src), "--reference", str(src), "--traces", str(traces_file),
               "--dtype", "float32", "--batch-size", "2", "--prefill-chunk", "24", "--per-trace")
    tok = load_tokenizer(src)
    text_tokens = len(tok.encode(" forty-two, of course.", add_special_tokens=False))
    assert res["tokens"] == sum(n - s for n, s in SHAPES) + text_tokens
    assert res["traces"] == 5
    assert res["drift_1e3"] == 0.0 and res["drift_stderr_1e3"] == 0.0
    assert res["top1_agreement"] == 1.0
    assert [r["line"] for r in res["per_trace"]] == [1, 2, 3, 4, 6]
    assert res["per_trace"][0]["id"] == "t90"


def test_drift_against_pruned_matches_independent_nll(capsys, src, pruned, traces_file):
    res = _run(capsys, "score", "--ckpt-path", str(pruned), "--reference", str(src), "--traces", str(traces_file),
               "--dtype", "float32", "--batch-size", "3", "--prefill-chunk", "32", "--per-token")
    traces = read_traces(traces_file, load_tokenizer(src), vocab_size=1024)
    nll_p, arg_p = _independent(pruned, traces)
    nll_s, arg_s = _independent(src, traces)
    N = sum(int(x.numel()) for x in nll_p)
    d = torch.stack([(a - b).sum() for a, b in zip(nll_p, nll_s)])
    n = torch.tensor([float(x.numel()) for x in nll_p], dtype=torch.float64)
    drift = 1000 * float(d.sum()) / N
    D = float(d.sum()) / N
    se = 1000 * math.sqrt(len(n) / (len(n) - 1) * float(((d - D * n) ** 2).sum())) / N
    assert res["tokens"] == N
    assert abs(res["drift_1e3"]) > 1.0  # pruning half the experts must show
    assert res["drift_1e3"] == pytest.approx(drift, abs=5e-3)
    assert res["drift_stderr_1e3"] == pytest.approx(se, abs=5e-3)
    assert res["total_nll"] == pytest.approx(float(sum(x.sum() for x in nll_p)), abs=1e-3)
    agree = sum(int((a == b).sum()) for a, b in zip(arg_p, arg_s)) / N
    assert res["top1_agreement"] == pytest.approx(agree, abs=1.5 / N)  # a near-tie may flip one argmax
    for row, want in zip(res["per_trace"], nll_p):
        assert torch.allclose(-torch.tensor(row["logprobs"], dtype=torch.float64), want, atol=1e-4)


def test_expert_mask_scores_as_the_pruned_checkpoint(capsys, src, pruned, traces_file):
    """`--expert-mask pruning.json` on the full checkpoint gives the pruned checkpoint's log-likelihoods (the
    reference runs unmasked), through the chunked, cached prefill."""
    flags = ["--traces", str(traces_file), "--dtype", "float32", "--batch-size", "2", "--prefill-chunk", "16",
             "--per-trace"]
    from_pruned = _run(capsys, "score", "--ckpt-path", str(pruned), "--reference", str(src), *flags)
    masked = _run(capsys, "score", "--ckpt-path", str(src), "--expert-mask", str(pruned / "pruning.json"),
                  "--reference", str(src), *flags)
    for a, b in zip(from_pruned["per_trace"], masked["per_trace"]):
        assert a["nll"] == pytest.approx(b["nll"], abs=1e-3) and a["reference_nll"] == b["reference_nll"]
    assert masked["drift_1e3"] == pytest.approx(from_pruned["drift_1e3"], abs=1e-2)
    dropped = _run(capsys, "score", "--ckpt-path", str(src), "--drop-experts", "2:3", *flags)
    assert dropped["total_nll"] != pytest.approx(from_pruned["reference_total_nll"], abs=1e-3)
    assert main(["score", "--ckpt-path", str(pruned), "--expert-mask", str(pruned / "pruning.json"),
                 "--traces", str(traces_file)]) == 2
    assert "keeps experts of a 16-expert model, this checkpoint has 8" in capsys.readouterr().err


def test_drift_stats_estimator_by_hand():
    """Ratio of sums, with the delta-method (cluster) standard error, on hand-made numbers."""
    a = [TraceScore(torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([1, 2])),
         TraceScore(torch.tensor([0.5, 0.5, 0.5, 1.5], dtype=torch.float64), torch.tensor([3, 3, 3, 3]))]
    b = [TraceScore(torch.tensor([1.0, 1.0], dtype=torch.float64), torch.tensor([1, 5])),
         TraceScore(torch.tensor([0.5, 0.5, 0.5, 0.5], dtype=torch.float64), torch.tensor([3, 3, 0, 3]))]
    s = drift_stats(a, b)
    # d = [1, 1], n = [2, 4], D = 2/6; residuals 1 - 2/3, 1 - 4/3
    D = 2 / 6
    se = math.sqrt(2 * ((1 - 2 * D) ** 2 + (1 - 4 * D) ** 2)) / 6
    assert s["drift_1e3"] == pytest.approx(1000 * D)
    assert s["drift_stderr_1e3"] == pytest.approx(1000 * se)
    assert s["top1_agreement"] == pytest.approx(4 / 6)
    assert s["tokens"] == 6
    assert drift_stats(a[:1], b[:1])["drift_stderr_1e3"] is None  # one trace: undefined


def test_chat_trace_is_generation_prompt_plus_reply(src):
    tok = load_tokenizer(src)
    ids, start = chat_trace_ids(tok, "What is 2+2?", "It is 4.")
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True)
    assert ids[:start] == prompt
    assert tok.decode(ids[start:]) == "</mm:think>It is 4.[e~["


def test_chat_traces_take_tools_thinking_and_a_message_completion():
    """A tool-call reply as a trace: its completion tokens are those the nano model generates when it makes that
    call (rendered with the line's tools and thinking); a reasoning reply renders inside the thinking turn."""
    import minimax_ref as mr

    tools = json.loads((Path(__file__).parents[1] / "examples" / "nano" / "tools.json").read_text())
    model, tok = mr.load_model(None, dtype=torch.float32), mr.load_tokenizer(None)
    prompt = "What's the weather in Lisbon for the next 3 days?"
    made = mr.generate(model, tok, [prompt], chat=True, tools=tools, max_new_tokens=60, temperature=0)[0]
    assert made.tool_calls and made.finish_reason == "stop"
    (t,) = mr.score(model, tok, [{"prompt": prompt, "tools": tools, "completion": {"content": "",
                                                                               "tool_calls": made.tool_calls}}],
                    chat=True).traces
    assert list(t.input_ids[:t.completion_start]) == made.prompt_token_ids
    assert list(t.input_ids[t.completion_start:]) == made.token_ids  # the call and the end-of-turn token
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    ids, start = chat_trace_ids(tok, messages, {"reasoning_content": "2+2=4", "content": "4"}, thinking="enabled")
    assert ids[:start] == tok.apply_chat_template(messages, thinking="enabled", add_generation_prompt=True)
    assert tok.decode(ids[start:]) == "2+2=4</mm:think>4[e~["
    with pytest.raises(InputError, match="tools: chat traces only"):
        mr.score(model, tok, [{"prompt": prompt, "tools": tools, "completion": "x"}])
    with pytest.raises(InputError, match="exactly one of 'prompt'"):
        mr.score(model, tok, [{"prompt": prompt, "messages": messages, "completion": "x"}], chat=True)


@pytest.mark.parametrize("line, why", [
    ("{not json", "not valid JSON"),
    ('{"input_ids": [1, 2, 3], "completion_start": 3}', "completion_start"),
    ('{"input_ids": [1, 2, 3], "completion_start": 0}', "completion_start"),
    ('{"input_ids": [1, "a"], "completion_start": 1}', "list of integers"),
    ('{"input_ids": [1, 5000], "completion_start": 1}', "outside the vocabulary"),
    ('{"prompt": "a", "completion": "b", "input_ids": [1]}', "either"),
    ('{"prompt": "a", "completion": "b", "extra": 1}', "unknown keys"),
    ('{"prompt": "a", "completion": ""}', "empty"),
    ('{"messages": [{"role": "user", "content": "a"}], "completion": "b"}', "chat traces only"),
    ('{"prompt": "a", "completion": {"content": "b"}}', "chat traces only"),
    ("[1, 2]", "JSON object"),
])
def test_malformed_trace_names_the_line(tmp_path, src, line, why):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_ids": [1, 2, 3], "completion_start": 1}\n\n' + line + "\n")
    with pytest.raises(InputError, match=rf"bad\.jsonl:3: .*{why}"):
        read_traces(path, load_tokenizer(src), vocab_size=1024)


def test_cli_reports_bad_trace_before_loading(capsys, tmp_path, src):
    path = tmp_path / "t.jsonl"
    path.write_text('{"input_ids": [1, 2], "completion_start": 1}\n{"input_ids": [1, 2], "completion_start": 7}\n')
    assert main(["score", "--ckpt-path", str(src), "--traces", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "t.jsonl:2" in err and "completion_start" in err


def test_trace_longer_than_max_model_len_is_refused(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"input_ids": list(range(50)), "completion_start": 10}) + "\n")
    with pytest.raises(InputError, match=r"long\.jsonl:1: .*max-model-len 32"):
        read_traces(path, None, vocab_size=1024, max_len=32)
    assert read_traces(path, None, max_len=64) == [ScoreTrace(1, tuple(range(50)), 10)]


def _metaspace_tokenizer(folder: Path, post: str | None = None) -> None:
    """A Unigram tokenizer normalised the Llama way (spaces as "▁" and one "▁" prepended to every text, so a text
    that starts with a space starts with two) and optionally a BERT-style post-processor that puts [CLS] before and
    [SEP] after the text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")  # words split before each "▁"
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    corpus = ["The weather in Paris today is fine, the weather in Lisbon is warm."] * 50
    tok.train_from_iterator(corpus, trainers.UnigramTrainer(vocab_size=60, special_tokens=["<unk>", "[CLS]", "[SEP]"],
                                                            unk_token="<unk>", show_progress=False))
    if post:
        tok.post_processor = processors.TemplateProcessing(single=post, special_tokens=[
            ("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))


@pytest.mark.parametrize("post", [None, "[CLS] $A [SEP]"])
def test_raw_completions_are_tokenized_in_context(tmp_path, post):
    """A raw trace's completion is scored as its tokens fall in the whole text: a Llama-style tokenizer encoding
    " Paris today" alone gives it a second word-start marker; spaces that end the prompt start the completion; a
    [SEP] the post-processor appends to a text does not sit between the prompt and its completion (a [CLS] before it
    stays)."""
    from minimax_ref.research.score import raw_trace_ids

    _metaspace_tokenizer(tmp_path / "t", post)
    tok = load_tokenizer(tmp_path / "t")
    whole = tok.encode("The weather in Paris today", add_special_tokens=False)
    prompt = tok.encode("The weather in", add_special_tokens=False)
    assert whole[:len(prompt)] == prompt
    lead = [tok.token_to_id("[CLS]")] if post else []
    for p, c in (("The weather in", " Paris today"), ("The weather in ", "Paris today")):
        ids, start = raw_trace_ids(tok, p, c)
        assert ids == lead + whole and start == len(lead) + len(prompt), (p, c)
    alone = tok.encode(" Paris today", add_special_tokens=False)
    assert alone != whole[len(prompt):], "the case this guards: the completion alone tokenizes otherwise"


def test_score_and_prune_refuse_what_they_would_silently_ignore(capsys, src, traces_file, tmp_path, monkeypatch):
    """--synthetic-weights (they read a checkpoint folder: were the embedded default, in silence); a reference that
    cannot read every trace, before either model loads; a prune --out where no folder can be made, before the
    calibration runs; a batch size of 0 by the parser."""
    import minimax_ref.research.score as score_module

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(score_module, "load_for_args", no_load)
    for argv in (["score", "--traces", str(traces_file)],
                 ["prune", "--keep", "4", "--calibration", str(traces_file), "--out", str(tmp_path / "p")]):
        assert main([*argv, "--synthetic-weights", "tiny"]) == 2
        assert "--synthetic-weights: `minimax-ref " in capsys.readouterr().err
    short = tmp_path / "short"
    short.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (short / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    cfg.get("text_config", cfg)["max_position_embeddings"] = 64
    (short / "config.json").write_text(json.dumps(cfg))
    assert main(["score", "--ckpt-path", str(src), "--reference", str(short), "--traces", str(traces_file)]) == 2
    err = capsys.readouterr().err
    assert f"--reference {short}: trace 0 (line 1) has 90 tokens, more than the reference's max_seq_len 64" in err
    assert main(["prune", "--ckpt-path", str(src), "--keep", "4", "--calibration", str(traces_file),
                 "--out", "/proc/minimax-ref-pruned"]) == 2
    assert "cannot create a folder in /proc" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["score", "--ckpt-path", str(src), "--traces", str(traces_file), "--batch-size", "0"])
