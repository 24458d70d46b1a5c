"""Tensor parallelism (parallel.py) on CPU: gloo, spawned ranks, tiny synthetic checkpoints.

TP=2 and TP=4 (the tiny preset has 2 kv heads, so TP=4 replicates each kv head on two ranks) must
give the TP=1 logits to fp32 reduction rounding and the same greedy tokens, in both routed-expert
modes, on NVFP4+MXFP8 and MXFP8 checkpoints; each rank must read about 1/TP of the split tensors; a
checkpoint that does not split is refused before any weight is read; a rank that fails alone makes
every rank fail. Four ranks are spawned once for the whole file and run every check (TP=2 checks on
a subgroup of ranks 0 and 1).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minimax_ref.errors import ConfigError
from minimax_ref.generation.generate import SamplingParams, generate_ids
from minimax_ref.model.parallel import World, check_tp_split
from minimax_ref.weights.checkpoint import Checkpoint, open_checkpoint
from minimax_ref.weights.loader import load_model

RANKS = 4
REL_TOL = 1e-5  # fp32 reduction order: partial sums over ranks instead of one matmul
TIMEOUT_S = 120
REPO = Path(__file__).resolve().parents[1]
SPLIT_FAMILIES = ("embedding", "lm_head", "dense_mlp", "shared_expert", "routed_expert")

# 80 tokens: past the tiny preset's MSA budget (4 blocks of 16), so block selection matters
IDS = torch.randint(0, 1000, (2, 80), generator=torch.Generator().manual_seed(0))
PROMPTS = [IDS[0, :70].tolist(), IDS[1, :20].tolist()]
NEW_TOKENS = 6


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _run_model(model) -> dict:
    """What every check compares: logits, greedy and sampled tokens (cached decode)."""
    with torch.no_grad():
        logits = model(IDS).numpy()
    greedy, _ = generate_ids(model, PROMPTS, max_new_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=0))
    sampled, _ = generate_ids(model, PROMPTS, max_new_tokens=NEW_TOKENS, seed=7,
                              sampling=SamplingParams(temperature=1.0, top_k=50))
    return {"logits": logits, "greedy": [s.generated for s in greedy], "sampled": [s.generated for s in sampled]}


# ---------------------------------------------------------------------------------------------- ranks


def _worker(rank: int, port: int, tasks, results) -> None:
    """One spawned rank: joins the gloo group, then runs (function, tp, kwargs) tasks until None."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS,
                            timeout=timedelta(seconds=TIMEOUT_S))
    groups = {RANKS: dist.group.WORLD, 2: dist.new_group([0, 1])}  # every rank must create each group
    while (task := tasks.get()) is not None:
        fn, tp, kwargs = task
        try:
            out = ("ok", fn(World.from_group(groups[tp]), **kwargs))
        except Exception as e:  # reported to the test, which decides
            out = ("error", f"{type(e).__name__}: {e}")
        results.put((rank, out))
    dist.destroy_process_group()


class Ranks:
    """The spawned ranks; `run(fn, tp, **kw)` runs fn(world, **kw) on ranks 0..tp-1 and returns
    their results in rank order."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.tasks = [ctx.Queue() for _ in range(RANKS)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, port, self.tasks[r], self.results), daemon=True)
                      for r in range(RANKS)]
        for p in self.procs:
            p.start()

    def run(self, fn, tp: int, **kwargs) -> list:
        for r in range(tp):
            self.tasks[r].put((fn, tp, kwargs))
        out = {}
        while len(out) < tp:
            rank, res = self.results.get(timeout=TIMEOUT_S)
            out[rank] = res
        return [out[r] for r in range(tp)]

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.terminate()


@pytest.fixture(scope="module")
def ranks():
    pool = Ranks()
    yield pool
    pool.close()


def _task_load_and_run(world: World, path: str, expert_parallel: bool) -> dict:
    model = load_model(path, dtype=torch.float32, tp=world, expert_parallel=expert_parallel)
    out = _run_model(model)
    out["load_stats"] = model.load_stats
    out["cache_kv_heads"] = model.new_cache(1, 8).k[0].shape[2]
    return out


def _task_count_reads(world: World, path: str) -> dict:
    """Load (expected to be refused) while counting tensor reads."""
    reads = []
    original = Checkpoint.read

    def counting_read(self, name, *args, **kwargs):
        reads.append(name)
        return original(self, name, *args, **kwargs)

    Checkpoint.read = counting_read
    try:
        load_model(path, dtype=torch.float32, tp=world)
        error = None
    except ConfigError as e:
        error = str(e)
    finally:
        Checkpoint.read = original
    return {"error": error, "reads": len(reads)}


def _task_rank1_out_of_memory(world: World, path: str) -> str:
    """Rank 1 alone runs out of memory while decoding a slice; returns the error each rank sees."""
    original = Checkpoint.read_linear

    def read_linear(self, prefix, rows=None, cols=None):
        if world.rank == 1 and prefix.endswith("layers.2.self_attn.o_proj"):
            raise torch.OutOfMemoryError("simulated: CUDA out of memory on rank 1")
        return original(self, prefix, rows=rows, cols=cols)

    Checkpoint.read_linear = read_linear
    try:
        load_model(path, dtype=torch.float32, tp=world)
        return "loaded"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        Checkpoint.read_linear = original


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def checkpoints(ckpt_factory) -> dict[str, Path]:
    return {
        "tiny-nvfp4": ckpt_factory("tiny", "nvfp4"),  # NVFP4 experts + MXFP8 attention/shared/dense
        "tiny-mxfp8": ckpt_factory("tiny", "mxfp8"),
        # the tiny shared expert (64 channels) leaves 16 MXFP8 columns per rank at TP=4: widen it
        "tp4-nvfp4": ckpt_factory("tiny", "nvfp4", overrides={"shared_intermediate_size": 128}),
    }


_reference: dict[Path, dict] = {}


def _tp1(path: Path) -> dict:
    if path not in _reference:
        model = load_model(path, dtype=torch.float32)
        _reference[path] = _run_model(model)
    return _reference[path]


# ---------------------------------------------------------------------------------------------- tests

CASES = [("tiny-nvfp4", 2, False), ("tiny-nvfp4", 2, True), ("tiny-mxfp8", 2, False),
         ("tp4-nvfp4", 4, False), ("tp4-nvfp4", 4, True)]


@pytest.mark.parametrize("name,tp,expert_parallel", CASES,
                         ids=[f"{n}-tp{t}-{'ep' if e else 'tp-experts'}" for n, t, e in CASES])
def test_tp_equals_tp1(ranks, checkpoints, name, tp, expert_parallel):
    path = checkpoints[name]
    ref = _tp1(path)
    outs = ranks.run(_task_load_and_run, tp, path=str(path), expert_parallel=expert_parallel)
    assert all(o[0] == "ok" for o in outs), outs
    outs = [o[1] for o in outs]

    err = _rel_err(outs[0]["logits"], ref["logits"])
    assert err < REL_TOL, (name, tp, expert_parallel, err)
    for o in outs[1:]:  # gathered logits: every rank holds the same bytes, so every rank samples alike
        assert np.array_equal(o["logits"], outs[0]["logits"])
        assert o["greedy"] == outs[0]["greedy"] and o["sampled"] == outs[0]["sampled"]
    assert outs[0]["greedy"] == ref["greedy"]

    # each rank reads ~1/TP of the split tensors (plus per-tensor scalars, read whole)
    full = open_checkpoint(path).family_bytes()
    for rank, o in enumerate(outs):
        stats = o["load_stats"]
        assert (stats["tp_rank"], stats["tp_size"]) == (rank, tp)
        for fam in SPLIT_FAMILIES:
            got = stats["bytes_read_by_family"][fam]
            assert abs(got - full[fam] / tp) <= 0.01 * full[fam] / tp, (fam, got, full[fam], tp)
        # replicated: norms, router, index keys (and kv heads at TP=4): a few % of the tiny model
        assert stats["bytes_read"] < (1 / tp + 0.05) * sum(full.values())
        assert o["cache_kv_heads"] == max(1, 2 // tp)  # the KV cache holds this rank's kv heads only
    if expert_parallel:  # whole experts: the ranks' reads partition the routed experts exactly
        assert sum(o["load_stats"]["bytes_read_by_family"]["routed_expert"] for o in outs) == full["routed_expert"]


def test_indivisible_split_is_refused_before_reading(ranks, checkpoints):
    # tiny: shared expert of 64 channels -> 16 per rank at TP=4, not a whole MXFP8 group of 32
    outs = ranks.run(_task_count_reads, RANKS, path=str(checkpoints["tiny-nvfp4"]))
    for status, out in outs:
        assert status == "ok" and out["error"] is not None, out
        assert "shared_experts.down_proj (mxfp8): 16 input columns" in out["error"], out["error"]
        assert out["error"].count("shared_experts.down_proj") == 1  # one line for all of its layers
        assert "(L = layers 1-3: 3 layers)" in out["error"], out["error"]
        assert out["reads"] == 0


def test_counts_that_do_not_divide_are_listed(checkpoints):
    ck = open_checkpoint(checkpoints["tiny-nvfp4"])
    with pytest.raises(ConfigError) as e:
        check_tp_split(ck, 3, expert_parallel=True)
    msg = str(e.value)
    for what in ("num_attention_heads=8", "num_key_value_heads=2", "vocab_size=1024", "num_local_experts"):
        assert what in msg, msg
    check_tp_split(ck, 2, expert_parallel=False)  # divides
    assert "drop --expert-parallel" in msg, msg  # expert parallelism is what made the experts fail
    with pytest.raises(ConfigError, match="expert parallelism") as e:
        check_tp_split(open_checkpoint(checkpoints["tiny-mxfp8"]), 4, expert_parallel=False)
    assert "drop --expert-parallel" not in str(e.value)


def test_kv_heads_replicate_when_ranks_exceed_them():
    assert [World(r, 8).kv_heads(4) for r in range(8)] == [range(r // 2, r // 2 + 1) for r in range(8)]
    assert [World(r, 2).kv_heads(4) for r in range(2)] == [range(0, 2), range(2, 4)]
    with pytest.raises(ConfigError):
        World(0, 3).kv_heads(2)


def test_one_failing_rank_fails_every_rank(ranks, checkpoints):
    outs = ranks.run(_task_rank1_out_of_memory, 2, path=str(checkpoints["tiny-nvfp4"]))
    (s0, rank0), (s1, rank1) = outs
    assert s0 == s1 == "ok"  # the task returns the error each rank raised
    assert rank1.startswith("OutOfMemoryError: simulated"), rank1
    assert rank0.startswith("RankFailedError: tensor-parallel rank 1"), rank0
    assert "simulated: CUDA out of memory on rank 1" in rank0
    # the group is still usable afterwards
    outs = ranks.run(_task_load_and_run, 2, path=str(checkpoints["tiny-nvfp4"]), expert_parallel=False)
    assert all(o[0] == "ok" for o in outs)


def _generate_cmd(path: Path) -> list[str]:
    return ["examples/generate.py", "--ckpt-path", str(path), "--prompt", "hello world", "--max-new-tokens",
            str(NEW_TOKENS), "--temperature", "0", "--dtype", "float32", "--output-format", "json"]


def _expected_tokens(path: Path) -> list[int]:
    from minimax_ref.generation.generate import generate
    from minimax_ref.generation.tokenizer import load_tokenizer

    model = load_model(path, dtype=torch.float32)
    res = generate(model, load_tokenizer(path), ["hello world"], max_new_tokens=NEW_TOKENS, temperature=0)
    return res[0].token_ids


def test_examples_generate_single_process(checkpoints):
    path = checkpoints["tiny-nvfp4"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, *_generate_cmd(path)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["token_ids"] == _expected_tokens(path)


def test_examples_generate_under_torchrun(checkpoints):
    """`torchrun --nproc 2 examples/generate.py`: gloo on CPU, only rank 0 prints, TP=1's tokens."""
    path = checkpoints["tiny-nvfp4"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          *_generate_cmd(path), "--expert-parallel"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, run.stdout  # rank 1 prints nothing
    assert json.loads(lines[0])["token_ids"] == _expected_tokens(path)


def _launcher():
    import importlib.util

    spec = importlib.util.spec_from_file_location("examples_generate", REPO / "examples" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("text", ["nan", "inf", "0", "-1", "1e300"])
def test_dist_timeout_must_be_a_usable_duration(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        _launcher().timeout_seconds(text)
    assert _launcher().timeout_seconds("2.5") == 2.5


def test_launcher_usage_errors_print_once_for_all_ranks(checkpoints):
    """A bad flag under torchrun: rank 0 prints the usage error, the other ranks stay quiet; no traceback."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          *_generate_cmd(checkpoints["tiny-nvfp4"]), "--dist-timeout", "nan"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if "error: argument --dist-timeout" in line]
    assert len(errors) == 1 and "not a finite number" in errors[0], run.stderr[-3000:]
    assert "examples/generate.py\", line" not in run.stderr  # torchrun's report of the exit is its own


def test_expert_parallel_in_one_process_says_it_does_nothing(checkpoints):
    run = subprocess.run([sys.executable, *_generate_cmd(checkpoints["tiny-nvfp4"]), "--expert-parallel"], cwd=REPO,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr
    assert "--expert-parallel has no effect in one process" in run.stderr


def _task_speculative(world: World, path: str) -> list[list[int]]:
    from minimax_ref.generation.drafter import load_drafter
    from minimax_ref.generation.speculative import speculative_generate_ids

    model = load_model(path, dtype=torch.float32, tp=world)
    drafter = load_drafter(Path(path) / "dspark", model)
    seqs, _ = speculative_generate_ids(model, drafter, PROMPTS, max_new_tokens=NEW_TOKENS,
                                       sampling=SamplingParams(temperature=0))
    return [s.generated for s in seqs]


def test_speculative_decoding_under_tp_equals_plain_greedy(ranks, ckpt_factory):
    """The drafter is replicated; the target is split: greedy output with speculation at TP=2 equals
    plain greedy at TP=1."""
    path = ckpt_factory("tiny", "nvfp4", drafter=True)
    plain, _ = generate_ids(load_model(path, dtype=torch.float32), PROMPTS, max_new_tokens=NEW_TOKENS,
                            sampling=SamplingParams(temperature=0))
    outs = ranks.run(_task_speculative, 2, path=str(path))
    for status, value in outs:
        assert status == "ok", value
        assert value == [s.generated for s in plain]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("extra", [[], ["--expert-parallel"]], ids=["tp2", "tp2-expert-parallel"])
def test_examples_generate_on_two_gpus_equals_one(checkpoints, extra):
    """The README's two-GPU command (`torchrun --nproc-per-node 2 examples/generate.py`: NCCL, each rank on its GPU,
    the GPU default fast paths: compiled layers and CUDA graphs) emits one GPU's greedy tokens."""
    path = checkpoints["tiny-nvfp4"]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    one = subprocess.run([sys.executable, *_generate_cmd(path)], cwd=REPO, env={**env, "CUDA_VISIBLE_DEVICES": "0"},
                         capture_output=True, text=True, timeout=6 * TIMEOUT_S)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          *_generate_cmd(path), *extra], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=6 * TIMEOUT_S)
    assert two.returncode == 0, two.stderr
    lines = two.stdout.strip().splitlines()
    assert len(lines) == 1, two.stdout  # rank 1 prints nothing
    assert json.loads(lines[0])["token_ids"] == json.loads(one.stdout.strip().splitlines()[-1])["token_ids"]
    assert "[fast]" in one.stderr and "[fast]" in two.stderr  # the default on a GPU: compiled and captured steps
