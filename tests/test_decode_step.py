"""The decode loop's step (`MiniMaxM3.step`), its CUDA-graph twin (`FastPaths(graph=True)`), the generation stats
and the CLI's `--fast auto`."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from minimax_ref.cli.main import main
from minimax_ref.cli.model_args import fast_mode
from minimax_ref.errors import InputError
from minimax_ref.fast import FastPaths, apply
from minimax_ref.generation.decoding import generate_ids
from minimax_ref.generation.sampling import SamplingParams
from minimax_ref.weights.loader import load_model

PROMPTS = [[5, 9, 2, 7, 11, 3], [4, 8, 1]]
GREEDY = SamplingParams(temperature=0.0)


def test_step_is_the_cached_forward(tiny_nvfp4):
    model = load_model(tiny_nvfp4, dtype=torch.float32)
    ids = torch.tensor([PROMPTS[0]])
    pos = torch.arange(6)[None]
    with torch.no_grad():
        want = model(ids, positions=pos, cache=model.new_cache(1, 16))
        got = model.step(ids, pos, model.new_cache(1, 16))
    assert torch.equal(got, want)


def test_stats_time_the_first_step_apart(tiny_nvfp4):
    """The first decode step (compile and capture on the fast paths) is `warmup_seconds`; the decode rate counts
    only the tokens of the other steps: with no stop token, every row emits one token from the prefill, one from
    the warm-up step and one from each timed step."""
    model = load_model(tiny_nvfp4, dtype=torch.float32)
    seqs, stats = generate_ids(model, PROMPTS, max_new_tokens=5, sampling=GREEDY)
    assert [len(s.generated) for s in seqs] == [5, 5]
    assert stats.decode_steps == 4 and stats.decode_tokens == 2 * 3
    assert stats.generated_tokens == 10
    # prompts are prefilled into their slots one after another; the first one's first token comes first
    assert stats.prefill_seconds > 0 and 0 < stats.first_token_seconds == seqs[0].first_token_seconds
    assert seqs[0].first_token_seconds <= seqs[1].first_token_seconds <= min(s.finish_seconds for s in seqs)
    assert stats.warmup_seconds > 0 and stats.decode_seconds > 0
    assert stats.decode_tokens_per_s == pytest.approx(6 / stats.decode_seconds)
    row = stats.as_dict()
    for key in ("time_to_first_token_seconds", "warmup_seconds", "decode_tokens", "prefill_tokens_per_s",
                "decode_tokens_per_s"):
        assert key in row


def test_no_new_tokens_means_no_step(tiny_nvfp4):
    model = load_model(tiny_nvfp4, dtype=torch.float32)
    seqs, stats = generate_ids(model, PROMPTS, max_new_tokens=0)
    assert [s.generated for s in seqs] == [[], []] and stats.decode_steps == 0 and stats.generated_tokens == 0


def test_graph_switch_is_inert_off_cuda(tiny_nvfp4):
    """On a CPU the graph switch changes nothing: the step runs eagerly, no graph is kept."""
    model = load_model(tiny_nvfp4, dtype=torch.float32, weights="packed", fast="on")
    assert model.fast.graph
    seqs, _ = generate_ids(model, PROMPTS, max_new_tokens=4, sampling=GREEDY)
    assert getattr(model, "captured", None) is None
    apply(model, FastPaths())
    assert [s.generated for s in seqs] == [s.generated for s in generate_ids(model, PROMPTS, max_new_tokens=4,
                                                                              sampling=GREEDY)[0]]


def test_graph_needs_static_steps():
    with pytest.raises(Exception, match="graph needs moe=True and static_kv=True"):
        FastPaths(graph=True)
    assert all(FastPaths.of(m).graph for m in ("on", "compile", "fused", "compiled"))


def test_fast_auto_compiles_large_models_on_cuda_only(tiny_nvfp4):
    """--fast auto: the reference on a CPU; on CUDA the loader's choice by size: compiled layers from
    AUTO_COMPILE_MIN_BYTES of weights on, CUDA graphs alone ("on") below (compiling would not pay back)."""
    from minimax_ref.fast.paths import AUTO_COMPILE_MIN_BYTES, auto_preset
    from minimax_ref.weights.loader import load_model

    assert fast_mode("auto", "cuda") == "auto" and fast_mode("auto", "cuda:1") == "auto"
    assert fast_mode("auto", "cpu") is False
    assert fast_mode("off", "cuda") is False and fast_mode("on", "cpu") is True
    assert auto_preset(torch.device("cuda"), AUTO_COMPILE_MIN_BYTES) == "compiled"
    assert auto_preset("cuda:0", AUTO_COMPILE_MIN_BYTES - 1) == "on" and auto_preset("cpu", 1 << 40) == "off"
    model = load_model(tiny_nvfp4, dtype=torch.float32, fast="auto")
    assert model.fast_preset == "off" and type(model).__name__ == "MiniMaxM3"
    assert load_model(tiny_nvfp4, dtype=torch.float32, fast="on").fast_preset == "on"
    assert load_model(tiny_nvfp4, dtype=torch.float32, fast={"moe": True}).fast_preset is None


def test_cli_json_stats(tiny_nvfp4, capsys):
    assert main(["generate", "--ckpt-path", str(tiny_nvfp4), "--prompt", "hello", "--max-new-tokens", "4",
                 "--temperature", "0", "--output-format", "json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    stats = row["stats"]
    assert stats["decode_steps"] == len(row["token_ids"]) - 1
    assert stats["time_to_first_token_seconds"] >= stats["prefill_seconds"] > 0
    assert stats["warmup_seconds"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("fast", ["on", "compiled"])
def test_generate_replays_captured_steps(tiny_nvfp4, fast):
    """On CUDA, generate's decode steps replay CUDA graphs (one per cache and shape; a new cache recaptures and
    drops the old graphs) and choose the tokens the same fast paths choose eagerly. Compiled layers round the
    3 requests up to 4 slots (`batch_slots`: a power of two, so few batch sizes compile)."""
    model = load_model(tiny_nvfp4, dtype=torch.float32, weights="packed", device="cuda", fast=fast)
    prompts = PROMPTS + [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    seqs, stats = generate_ids(model, prompts, max_new_tokens=12, sampling=GREEDY)
    first = model.captured
    slots = 4 if fast == "compiled" else 3
    assert first is not None and list(first.graphs) == [(slots, 1)] and first.capture_seconds > 0
    again, _ = generate_ids(model, prompts, max_new_tokens=12, sampling=GREEDY)
    assert model.captured is not first  # a new cache, captured anew
    apply(model, replace(FastPaths.of(fast), graph=False))
    eager, _ = generate_ids(model, prompts, max_new_tokens=12, sampling=GREEDY)
    assert [s.generated for s in seqs] == [s.generated for s in again] == [s.generated for s in eager]
    assert stats.warmup_seconds > 0 and stats.decode_tokens > 0


@pytest.mark.gpu
def test_a_batch_past_the_sync_free_limit_decodes_without_graphs(tiny_nvfp4):
    """65 sequences (more tokens a step than the experts' synchronisation-free path takes): the steps are not captured
    (their experts read counts on the host) and choose the reference's tokens."""
    model = load_model(tiny_nvfp4, dtype=torch.float32, weights="packed", device="cuda", fast="on", max_batch_size=65)
    prompts = [[(7 * i + j) % 900 + 1 for j in range(5)] for i in range(65)]
    seqs, _ = generate_ids(model, prompts, max_new_tokens=3, sampling=GREEDY)
    assert model.captured is None or not model.captured.graphs
    apply(model, FastPaths())
    want, _ = generate_ids(model, prompts, max_new_tokens=3, sampling=GREEDY)
    assert [s.generated for s in seqs] == [s.generated for s in want]


def test_logit_index_is_the_full_logits_at_those_positions(tiny_nvfp4):
    model = load_model(tiny_nvfp4, dtype=torch.float32)
    ids = torch.tensor([PROMPTS[0], PROMPTS[0][::-1]])
    index = torch.tensor([5, 2])
    with torch.no_grad():
        full = model(ids)
        some = model(ids, logit_index=index)
    assert some.shape == (2, 1, full.shape[-1])
    # the same values up to fp32 rounding (the LM head's matmul runs over other shapes)
    assert torch.allclose(some[:, 0], full[torch.arange(2), index], rtol=0, atol=1e-5)
    for bad in (torch.tensor([6, 0]), torch.tensor([0]), torch.tensor([-1, 0])):
        with pytest.raises(InputError, match="logit_index"):
            model(ids, logit_index=bad)


def test_prefill_runs_the_lm_head_on_one_position_per_row(tiny_nvfp4, monkeypatch):
    """generate's prefill (in chunks, prompts of different lengths) sends one position per row through the LM
    head, never [B, T, V]; the tokens are those of a full-logits prefill."""
    model = load_model(tiny_nvfp4, dtype=torch.float32)
    prompts = [list(range(1, 40)), list(range(3, 20))]
    want, _ = generate_ids(model, prompts, max_new_tokens=4, sampling=GREEDY, prefill_chunk=16)
    rows = []
    lm_head = model.lm_head.forward
    monkeypatch.setattr(model.lm_head, "forward", lambda h: rows.append(h.shape[1]) or lm_head(h))
    got, _ = generate_ids(model, prompts, max_new_tokens=4, sampling=GREEDY, prefill_chunk=16)
    assert [s.generated for s in got] == [s.generated for s in want]
    assert rows and max(rows) == 1


def test_compile_cache_lives_in_the_cache_folder_unless_named(monkeypatch, tmp_path):
    """What compiling produces goes under $MINIMAX_REF_CACHE/compile (Triton's kernels in its triton/ folder); a
    TORCHINDUCTOR_CACHE_DIR or TRITON_CACHE_DIR the user set is kept, inductor's own default is not."""
    from minimax_ref.fast.compiled import use_compile_cache

    monkeypatch.setenv("MINIMAX_REF_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert use_compile_cache() == tmp_path / "compile"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "compile" / "triton")
    # inductor's own default (importing inductor sets it) is not a folder the user named
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert use_compile_cache() == tmp_path / "compile"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "kernels"))
    assert use_compile_cache() == tmp_path / "mine"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "kernels")


def test_compile_cache_pins_one_ptxas_for_every_compiling_process(monkeypatch, tmp_path):
    """Triton keys its cached kernels by the ptxas version, and inductor's compile workers take torch's own ptxas
    unless TRITON_PTXAS_PATH names one: `use_compile_cache` names Triton's (the one the main process uses) before
    any worker starts, and keeps a ptxas the user named."""
    triton = pytest.importorskip("triton")
    from triton import knobs

    from minimax_ref.fast.compiled import use_compile_cache

    monkeypatch.setenv("MINIMAX_REF_CACHE", str(tmp_path))
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    use_compile_cache()
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    assert os.environ["TRITON_PTXAS_PATH"] == knobs.nvidia.ptxas.path == bundled
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(tmp_path / "my-ptxas"))
    use_compile_cache()
    assert os.environ["TRITON_PTXAS_PATH"] == str(tmp_path / "my-ptxas")
