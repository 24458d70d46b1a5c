"""Shared pieces of the GPU benchmarks (tp2_packed.py, vs_transformers.py, long_context_tp2.py).

Measurement rules (the device README's METHOD.md): device work is timed with a synchronisation before and
after the region, after a warm-up; the ceiling is measured in the same run (a large device-to-device copy,
counting bytes read plus bytes written); every figure is printed with the command's parameters.

The HBM roofline of a decode step (`decode_step_bytes`) counts the bytes one rank must read from device
memory to decode one token for each of B sequences:
  weights touched: attention + indexer projections, norms, router, shared expert, dense MLPs, the
    routed experts chosen (top-k of E per token; at batch B the expected number of distinct experts,
    E * (1 - (1 - k/E)^B), for uniform routing), B rows of the embedding, the whole LM head,
    each at its stored size on this rank (packed bytes and scales for packed weights);
  KV read by attention, per sequence: dense layers all K and V of the context; MSA layers K and V of
    at most topk_blocks * block_size keys per kv head, and every index key (the indexer scores them all).
Roofline tokens/s = B / (bytes / copy bandwidth); fraction of roofline = measured / roofline.

`packed_weight_traffic` estimates what the packed weights actually cost a decode step, unfused (decoded into
memory, then multiplied) against fused (`FastPaths(matmul="fused")`), and `check_fused_matmul` compiles and
checks the fused matmul on the model's own weights before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# The scripts run from a plain checkout too (the GPU machine has no `pip install -e .`): the repository root
# goes on the path before the package is imported.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minimax_ref.errors import MiniMaxRefError  # noqa: E402
from minimax_ref.fast import FastPaths, Kernels, paths_of  # noqa: E402
from minimax_ref.fast.graph import GraphStep  # noqa: E402
from minimax_ref.fast.launch import KINDS, ReductionConfigs  # noqa: E402
from minimax_ref.fast.packed import packed_matmul_reference  # noqa: E402
from minimax_ref.fast.paths import describe_presets  # noqa: E402
from minimax_ref.model.cache import KVCache  # noqa: E402
from minimax_ref.model.linear import Linear  # noqa: E402
from minimax_ref.model.moe import Experts  # noqa: E402
from minimax_ref.model.parallel import World  # noqa: E402
from minimax_ref.weights.packed import PackedWeight  # noqa: E402

GIB = 1 << 30


class BenchmarkError(RuntimeError):
    """A clear, expected failure (bad arguments, not enough devices): printed as one `error:` line."""


REDUCTION_CONFIG_HELP = ("launch configurations of the compiled layers' large reductions: XBLOCK,R0_BLOCK,NUM_WARPS "
                         "for every product over packed weights, NVFP4's/MXFP8's, then KIND=X,R,W or KIND=tuned parts "
                         f"(kinds: {', '.join(KINDS)}), tuned for everything (coordinate "
                         "descent, per compile), or default: the engine's table entry for this GPU and torch "
                         "(fast.launch.TUNED; tuned where it has none), also when not given")


WORDS_CHOICES = ["default", "off", "on", "both"]
MXFP8_WORDS_CHOICES = [*WORDS_CHOICES, "gate_up"]  # FastPaths.mxfp8_words="gate_up"


def words_settings(choice: str, default: bool | str) -> list[bool | str]:
    """A `--nvfp4-words` / `--mxfp8-words` argument, comma-separated `WORDS_CHOICES` (`MXFP8_WORDS_CHOICES`), as the
    settings to run in that order: `default` is the fast paths' own, `both` off then on."""
    named = {"default": [default], "off": [False], "on": [True], "both": [False, True], "gate_up": ["gate_up"]}
    return [setting for part in choice.split(",") for setting in named[part]]


def words_choice(choices: list[str]):
    """The argparse type of a words argument: comma-separated `choices`."""
    def parse(text: str) -> str:
        bad = [part for part in text.split(",") if part not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(bad)}: choose from {', '.join(choices)} (comma-separated)")
        return text
    return parse


def reduction_config(text: str | None) -> ReductionConfigs | str | None:
    """A `--reduction-config` argument: None or "default" ("auto": the engine's table, `fast.launch.tuned_for`),
    "tuned" (None: no fixed configuration), or the text of `ReductionConfigs.parse`."""
    if text is None or text == "default":
        return "auto"
    return None if text == "tuned" else ReductionConfigs.parse(text)


def add_fast_flag(p: argparse.ArgumentParser, names: list[str], default: str, auto: str | None = None) -> None:
    """`--fast` over the presets `names` of `fast.paths.PRESETS` (`FastPaths.of` / `load_model(fast=...)` take the
    chosen name), its help their own descriptions; `auto`: also an "auto" choice, which the script resolves, and
    what it means."""
    text = (f"auto = {auto}; " if auto else "") + describe_presets(names)
    p.add_argument("--fast", default=default, choices=[*(["auto"] if auto else []), *names],
                   help=textwrap.fill(f"fast paths: {text} (default: {default})", 100))


FUSED_ROWS_HELP = ("fused matmul: rows of the input per pass over a weight (default: each preset's own: compiled 1, "
                   "fused 8)")


def add_kernel_bench_flags(p: argparse.ArgumentParser, tiles_metavar: str, tiles_default: str, sweep: list[str],
                           iters: int) -> None:
    """The flags every kernel benchmark takes: --iters, one launch configuration (--tiles) or a --sweep over
    --sweep-tiles, --out."""
    p.add_argument("--iters", type=int, default=iters, help=f"graph replays timed (default: {iters})")
    p.add_argument("--tiles", default=None, metavar=tiles_metavar,
                   help=f"one launch configuration (default: {tiles_default})")
    p.add_argument("--sweep", action="store_true", help="time every configuration of --sweep-tiles instead")
    p.add_argument("--sweep-tiles", default=";".join(sweep), help="configurations to sweep, ';'-separated")
    p.add_argument("--out", default=None, help="also append the JSON line to this file")


def tile_configs(args: argparse.Namespace, tiles_cls, default=None) -> list:
    """The launch configurations a kernel benchmark measures (`add_kernel_bench_flags`): every one of --sweep-tiles
    with --sweep, else --tiles, else `default` (None: the kernel's own choice). `tiles_cls`: the kernel's `Tiles`."""
    if args.sweep:
        return [tiles_cls.parse(t) for t in args.sweep_tiles.split(";")]
    return [tiles_cls.parse(args.tiles) if args.tiles else default]


def add_attention_workload_flags(p: argparse.ArgumentParser) -> None:
    """An MSA prefill call's queries: --prompt-len after --context cached keys, neighbouring tokens' index queries
    correlated by --correlation, the last --check queries compared with the reference."""
    p.add_argument("--prompt-len", type=int, default=8192, help="queries of the call (default: 8192)")
    p.add_argument("--context", type=int, default=0, help="cached keys before them (default: 0)")
    p.add_argument("--correlation", type=float, default=0.9,
                   help="of one token's index query with the previous token's (default: 0.9)")
    p.add_argument("--check", type=int, default=256, help="last queries checked against the reference (0: none)")


def fused_rows_arg(text: str) -> int:
    """`--fused-rows`: a positive row count."""
    rows = int(text)
    if rows < 1:
        raise argparse.ArgumentTypeError(f"--fused-rows {text}: give a positive row count")
    return rows


def with_fused_rows(paths: FastPaths, rows: int | None) -> FastPaths:
    """`paths` with `--fused-rows` when given; None keeps the preset's own (`compiled` hands products of two rows
    and more to the grouped kernel)."""
    return paths if rows is None else replace(paths, fused_rows=rows)


def log(world: World, *parts) -> None:
    """Progress on stderr (rank 0 only), flushed at once so a killed run still shows how far it got."""
    if world.rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


def init_world(device: str | None, timeout_s: float) -> tuple[World, torch.device]:
    """The tensor-parallel World from torchrun's environment (one process when WORLD_SIZE is unset) and this
    rank's device: cuda:LOCAL_RANK when CUDA is available (or asked for), else the CPU (gloo)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    on_gpu = device.startswith("cuda")
    if on_gpu:
        if not torch.cuda.is_available():
            raise BenchmarkError(f"--device {device}: CUDA is not available here")
        if torch.cuda.device_count() < size:
            raise BenchmarkError(f"{size} ranks need {size} GPUs, {torch.cuda.device_count()} visible")
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
    if size == 1:
        return World.single(), torch.device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timedelta(seconds=timeout_s),
                            device_id=torch.device(device) if on_gpu else None)
    return World.from_group(dist.group.WORLD, device), torch.device(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier(group=world.group)


# ---------------------------------------------------------------------------------------------- memory


def event_ms(fn, iters: int, warmup: int = 1) -> float:
    """Milliseconds per call of `fn` launched from the host: CUDA events around `iters` calls after `warmup` calls,
    without autograd."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def memory_now(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"allocated_gib": torch.cuda.memory_allocated(device) / GIB,
            "max_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "reserved_gib": torch.cuda.memory_reserved(device) / GIB}


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


# ---------------------------------------------------------------------------------------------- ceilings


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 20) -> dict:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median of `iters`
    copies of `nbytes`, after 3 warm-ups). Random data (never zeros). The buffers are freed afterwards."""
    n = nbytes // 4
    src = torch.randn(n, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 3):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    times.sort()
    med = times[len(times) // 2]
    moved = 2 * n * 4  # read + written
    return {"copy_bytes": moved, "median_s": med, "bytes_per_s": moved / med}


# ---------------------------------------------------------------------------------------------- roofline


def _packed_bytes(pw: PackedWeight) -> int:
    return sum(p.numel() * p.element_size() for p in pw.parts() if p is not None)


def _stored_bytes(t) -> int:
    """The bytes of a weight as the checkpoint stores it: a fast path's reordered copy of the same bits (held beside
    the stored planes) is read instead of them, not as well."""
    if t is None:
        return 0
    if isinstance(t, PackedWeight):
        return _packed_bytes(t)
    return t.numel() * t.element_size()


def _linear_bytes(lin: Linear) -> int:
    return _stored_bytes(lin.packed if lin.packed is not None else lin.weight)


# E * (1 - (1 - k/E)^B): distinct experts chosen by B tokens choosing k of E each, uniformly (one definition, the
# offload device map's)
from minimax_ref.weights.device_map import expected_distinct_experts  # noqa: E402


def decode_step_bytes(model, batch: int, context: int, kv_elem_bytes: int) -> dict:
    """Bytes this rank must read for one decode step of `batch` sequences at `context` cached tokens (module
    docstring), by family."""
    t = model.text
    fam: dict[str, float] = {}

    def add(key: str, n: float) -> None:
        fam[key] = fam.get(key, 0.0) + n

    for layer in model.layers:
        a = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            add("attention", _linear_bytes(getattr(a, name)))
        if a.sparse:
            add("indexer", _linear_bytes(a.index_q_proj) + _linear_bytes(a.index_k_proj))
        for m in (layer.input_layernorm, layer.post_attention_layernorm, a.q_norm, a.k_norm,
                  *((a.index_q_norm, a.index_k_norm) if a.sparse else ())):
            add("norms", _stored_bytes(m.weight))
        # KV read per sequence
        kv_per_key = 2 * a.n_kv * a.head_dim * kv_elem_bytes
        if a.sparse:
            g = a.geometry
            add("kv", batch * (min(context, g.topk_blocks * g.block_size) * kv_per_key
                               + context * a.index_dim * kv_elem_bytes))
        else:
            add("kv", batch * context * kv_per_key)
        if hasattr(layer, "block_sparse_moe"):
            moe = layer.block_sparse_moe
            add("router", _stored_bytes(moe.gate.weight) + _stored_bytes(moe.gate.e_score_correction_bias))
            if moe.shared_experts is not None:
                s = moe.shared_experts
                add("shared_expert", sum(_linear_bytes(x) for x in (s.gate_proj, s.up_proj, s.down_proj)))
            ex: Experts = moe.experts
            per_expert = sum(_stored_bytes(getattr(ex, leaf)) for leaf in ("w1", "w2", "w3")) / len(ex.local_experts)
            distinct = expected_distinct_experts(t.num_local_experts, t.num_experts_per_tok, batch)
            local_share = len(ex.local_experts) / t.num_local_experts  # expert parallel: this rank's experts
            add("routed_experts", per_expert * distinct * local_share)
        else:
            m = layer.mlp
            add("dense_mlp", sum(_linear_bytes(x) for x in (m.gate_proj, m.up_proj, m.down_proj)))
    emb = model.embed_tokens.weight
    add("embedding", batch * emb.shape[1] * emb.element_size() / model.world.size)  # the rows of this rank
    add("lm_head", _linear_bytes(model.lm_head) + _stored_bytes(model.norm.weight))
    total = sum(fam.values())
    return {"batch": batch, "context": context, "bytes": int(total), "by_family": {k: int(v) for k, v in fam.items()}}


def active_linear_elements_per_token(model, lm_head: bool = True) -> int:
    """Weight elements of the linears one token passes through on this rank (top-k experts; the LM head unless
    `lm_head` is False: a prefill takes the logits of its last position only): 2x this is the matmul FLOPs per
    token, for an achieved-TFLOP/s figure of prefill."""
    t = model.text
    n = 0
    for layer in model.layers:
        for m in layer.modules():
            if isinstance(m, Linear):
                n += m.in_features * m.out_features
        if hasattr(layer, "block_sparse_moe"):
            ex = layer.block_sparse_moe.experts
            per_expert = sum(getattr(ex, leaf).shape[-1] * getattr(ex, leaf).shape[-2] for leaf in ("w1", "w2", "w3"))
            n += per_expert * t.num_experts_per_tok * len(ex.local_experts) // t.num_local_experts
    return n + (model.lm_head.in_features * model.lm_head.out_features if lm_head else 0)


# ---------------------------------------------------------------------------------------------- packed traffic


def unfused_bytes_per_element(fmt: str, elem: int) -> float:
    """Device-memory bytes one weight element costs when `decode="fast"` decodes it into memory (compute dtype
    of `elem` bytes) and a matmul reads it back: NVFP4 = bytes widened to int32 (0.5 read + 2 written), the
    pair lookup (2 read + elem written), the fp32 block scales (1/16 read, 3 x 4/16 written or read), the
    multiplication (elem + 4/16 read, elem written), the matmul (elem read); MXFP8 = the cast (1 read + elem
    written), the E8M0 table (1/32 read, 3 x 4/32), the multiplication (elem + 4/32 read, elem written), the
    matmul (elem read). Kernel-launch and cache effects are not counted."""
    if fmt == "nvfp4":
        return 0.5 + 2 + 2 + 4 * elem + 17 / 16
    return 1 + 4 * elem + 17 / 32


def packed_weight_traffic(model, batch: int, rows_per_pass: int) -> dict:
    """Estimated device-memory bytes the packed weights cost one decode step of `batch` sequences on this rank,
    unfused (`unfused_bytes_per_element` per element touched; gathered experts are first copied, 2 x their
    stored bytes) and fused (the stored bytes, read once per pass of `rows_per_pass` rows; a gathered expert
    is read once per (token, slot) pair). Which weights a step touches follows `Experts.forward_sync_free`:
    the chosen experts' pairs when batch * top_k < local experts, else every local expert. By family."""
    elem = model.dtype.itemsize
    passes = -(-batch // rows_per_pass)
    fam: dict[str, dict[str, float]] = {}

    def add(key: str, fused: float, unfused: float) -> None:
        f = fam.setdefault(key, {"fused": 0.0, "unfused": 0.0})
        f["fused"] += fused
        f["unfused"] += unfused

    for m in model.modules():
        if isinstance(m, Linear) and m.packed is not None:
            pw = m.packed
            add(pw.fmt, _packed_bytes(pw) * passes, pw.shape.numel() * unfused_bytes_per_element(pw.fmt, elem))
        elif isinstance(m, Experts):
            n_local = len(m.local_experts)
            pairs = batch * model.text.num_experts_per_tok
            for leaf in ("w1", "w2", "w3"):
                pw = getattr(m, leaf)
                if not isinstance(pw, PackedWeight):
                    continue
                per_elem = unfused_bytes_per_element(pw.fmt, elem)
                if pairs < n_local:
                    one = _packed_bytes(pw) / n_local
                    add("experts", one * pairs, pairs * (pw.shape[1:].numel() * per_elem + 2 * one))
                else:
                    add("experts", _packed_bytes(pw) * passes, pw.shape.numel() * per_elem)
    out = {k: {kk: int(vv) for kk, vv in v.items()} for k, v in fam.items()}
    return {"batch": batch, "fused_bytes": sum(v["fused"] for v in out.values()),
            "unfused_bytes": sum(v["unfused"] for v in out.values()), "by_family": out}


def check_fused_matmul(model, batches: list[int], rows_per_pass: int) -> dict:
    """Compile the fused packed matmul and check it on the model's own weights before anything is timed, so a
    compile failure or a wrong result ends the run at once instead of inside a timed variant.

    For the first packed linear of each format and the first packed expert stack (gathered pairs, and every
    expert of a sub-stack of at most 8 experts): rows of the identity and e_k + e_k+1 must give the decoded
    weight and its pair sums bit for bit (the kernel multiplies the exact weight bits); random rows at the
    row counts of `batches` must agree with decode-then-matmul (`packed_matmul_reference`) to 1e-5 relative
    in fp32, 1e-2 in bf16 (both round an fp32 sum once). Returns what it checked; raises BenchmarkError."""
    t0 = time.perf_counter()
    dtype, device = model.dtype, model.device
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    gen = torch.Generator(device=device).manual_seed(7)
    cases: dict[str, dict] = {}
    kernels = getattr(model, "kernels", None) or Kernels()  # the model's compiled functions when it has them
    packed_matmul_fused = kernels.matmul

    def compare(name: str, x: torch.Tensor, parts: tuple, fmt: str, index=None) -> None:
        got = packed_matmul_fused(x, fmt, *parts, dtype, index, rows_per_pass)
        want = packed_matmul_reference(x, fmt, *parts, dtype, index)
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))
        cases[name] = {"rows": x.shape[-2], "rel_err": err}
        if not (err <= tol and bool(torch.isfinite(got).all())):
            raise BenchmarkError(f"fused matmul check {name}: relative error {err:.3g} > {tol} against "
                                 "decode-then-matmul")

    def exact(name: str, pw: PackedWeight, parts: tuple, index=None) -> None:
        K = pw.shape[-1]
        eye = torch.eye(K, device=device, dtype=torch.float32)[:4]
        x = torch.cat([eye, eye + eye.roll(1, dims=1)]).to(dtype)  # [8, K]
        w_hat = pw.decode(index).float()
        if index is not None:  # one pair per row: x [8, 1, K] against expert index[p]
            x = x[:, None]
            got = packed_matmul_fused(x, pw.fmt, *parts, dtype, index, rows_per_pass)[:, 0]  # [8, N]
            rows = torch.arange(8, device=device)
            cols = rows % 4
            want = torch.where((rows >= 4)[:, None], w_hat[rows, :, cols] + w_hat[rows, :, cols + 1],
                               w_hat[rows, :, cols]).to(dtype)
        else:
            got = packed_matmul_fused(x, pw.fmt, *parts, dtype, None, rows_per_pass).T  # [N, 8]
            want = torch.cat([w_hat[:, :4], w_hat[:, :4] + w_hat[:, 1:5]], dim=1).to(dtype)
        ok = torch.equal(got, want)
        cases[name] = {"exact": ok}
        if not ok:
            bad = int((got != want).sum())
            raise BenchmarkError(f"fused matmul check {name}: {bad} outputs differ from the decoded weight's bits")

    rows_list = sorted({1, *[b for b in batches if b <= paths_of(model).sync_free_tokens]})
    seen = set()
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.packed is not None and m.packed.fmt not in seen:
            seen.add(m.packed.fmt)
            pw = m.packed
            exact(f"{name} exact", pw, pw.parts())
            for r in rows_list:
                x = torch.randn(r, pw.shape[-1], device=device, generator=gen).to(dtype)
                compare(f"{name} rows={r}", x, pw.parts(), pw.fmt)
    ex = next((m for m in model.modules() if isinstance(m, Experts) and isinstance(m.w1, PackedWeight)), None)
    if ex is not None:
        k, E = model.text.num_experts_per_tok, len(ex.local_experts)
        ids = torch.arange(8, device=device) % E
        exact("experts.w1 gathered exact", ex.w1, ex.w1.parts(), ids)
        for leaf in ("w1", "w2"):
            pw = getattr(ex, leaf)
            for b in rows_list:
                if b * k < E:  # the pairs path: [P, 1, K] against P gathered experts
                    x = torch.randn(b * k, 1, pw.shape[-1], device=device, generator=gen).to(dtype)
                    pair_ids = torch.arange(b * k, device=device) % E
                    compare(f"experts.{leaf} pairs={b * k}", x, pw.parts(), pw.fmt, pair_ids)
                else:  # every local expert (a sub-stack of 8): w1 takes x [T, K], w2 x [E, T, K]
                    sub = tuple(t[:8] if t is not None and t.dim() else t for t in pw.parts())
                    lead = (min(8, E),) if leaf == "w2" else ()
                    x = torch.randn(*lead, b, pw.shape[-1], device=device, generator=gen).to(dtype)
                    compare(f"experts.{leaf} every expert, rows={b}", x, sub, pw.fmt)
    sync(device)
    return {"ok": True, "seconds": time.perf_counter() - t0, "rows_per_pass": rows_per_pass, "cases": cases}


# ---------------------------------------------------------------------------------------------- running


def prefill(model, cache: KVCache, ids: torch.Tensor, chunk: int, start: int = 0) -> torch.Tensor:
    """Run `ids` [B, T] through the model at positions start.. in chunks of `chunk` tokens; returns the last
    position's logits [B, V]. Only the last position goes through the LM head (as serving engines do: the
    full [T, V] fp32 logits of an 8K prompt would be 6.5 GB)."""
    B, T = ids.shape
    h = None
    for s0 in range(0, T, chunk):
        s1 = min(T, s0 + chunk)
        pos = torch.arange(start + s0, start + s1, device=ids.device).expand(B, -1)
        h = model.hidden(model.embed(ids[:, s0:s1]), pos, cache)
    return model.logits(h[:, -1])


def replicate_cache(model, src: KVCache, batch: int, kv_cache_dtype: str) -> KVCache:
    """A cache of `batch` rows, each a copy of row 0 of `src` (the same prompt prefilled once)."""
    dst = model.new_cache(batch, src.max_seq_len, kv_cache_dtype)
    for a, b in zip([*dst.k, *dst.v, *dst.index_k], [*src.k, *src.v, *src.index_k]):
        if a is not None:
            a.copy_(b[:1].expand_as(a))
    return dst


@dataclass
class DecodeResult:
    steps: int
    seconds: float
    batch: int

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.steps / self.seconds

    @property
    def step_ms(self) -> float:
        return 1e3 * self.seconds / self.steps


def decode(model, cache: KVCache, logits: torch.Tensor, start: int, steps: int, *, graph: bool,
           budget_s: float, warmup: int = 2) -> DecodeResult:
    """Greedy decode `steps` tokens for every row of `cache` from last logits [B, V], the first at position
    `start`; everything stays on the device (argmax feeds the next step; every rank holds the same gathered
    logits, so no communication is needed to agree on tokens). Stops early once `budget_s` has passed (checked
    every 8 steps, with a synchronisation). `warmup` untimed steps come first (their positions are rewritten
    by the timed steps)."""
    device = logits.device
    B = logits.shape[0]
    ids = logits.argmax(-1, keepdim=True)
    pos = torch.full((B, 1), start, dtype=torch.long, device=device)
    runner = GraphStep(model, cache, ids, pos) if graph else None

    def one(ids, pos):
        if runner is not None:
            return runner.step(ids, pos)
        return model(ids, positions=pos, cache=cache)[:, -1]

    for _ in range(warmup):
        one(ids, pos)
    sync(device)
    t0 = time.perf_counter()
    done = 0
    while done < steps:
        out = one(ids, pos)
        ids = out.argmax(-1, keepdim=True)
        pos = pos + 1
        done += 1
        if done % 8 == 0:
            sync(device)
            if time.perf_counter() - t0 > budget_s:
                break
    sync(device)
    return DecodeResult(done, time.perf_counter() - t0, B)


def emit(result: dict, out_path: str | None) -> None:
    """The result as one JSON line on stdout (and in `out_path`)."""
    line = json.dumps(result, default=float)
    print(line, flush=True)
    if out_path:
        with open(out_path, "a") as fh:
            fh.write(line + "\n")


def main_guard(run, world_holder: list) -> int:
    """Run `run()`; expected failures (BenchmarkError, minimax-ref's own errors, out of memory) end with one
    `error: [rank r] ...` line on stderr and exit status 2; anything else is a bug and keeps its traceback."""
    try:
        run()
        return 0
    except (BenchmarkError, MiniMaxRefError) as e:  # bad arguments, a refused split, another rank's failure
        world = world_holder[0] if world_holder else None
        print(f"error: [rank {world.rank if world else 0}] {e}", file=sys.stderr, flush=True)
        return 2
    except torch.OutOfMemoryError as e:
        world = world_holder[0] if world_holder else None
        rank = world.rank if world else 0
        print(f"error: [rank {rank}] out of device memory: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
