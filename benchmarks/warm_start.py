"""A new process's start on the GPU: the README's first command and a compiled model, each run as a user runs it
(`python -m minimax_ref.cli generate ...` in a fresh process), first with an empty cache folder, then again with
the folder the first run filled (`MINIMAX_REF_CACHE`: the compile cache, `fast.compiled.use_compile_cache`).

Each run reports its wall time (process start to exit), and from the JSON stats the first decode step's time
(`warmup_seconds`: compiling and capturing the step) and the time to the first token. The case `compile_caches` runs
the same compiled model in a process of this script (`--child`) that also reports inductor's cache counters (graph
and AOT cache hits and misses), where the warm-up went (`torch._dynamo.utils.compile_times`), which kernels were
tuned by coordinate descent in that process, which Triton kernels it built down to a cubin (`cubins_built`: compiled
from their source, no cache held them), and whether its compiled layers were saved across processes
(`saved_layers`: the graphs it holds and the files in the compile cache's layers/ folder), with the fast paths'
notices on stderr (`fast_notices`, e.g. why its layers are not saved).

    # 1 x H200 (BENCHMARKS.md, "A new process on 1 x H200"):
    python benchmarks/warm_start.py --layers 4
    # where the warm process's warm-up goes, function by function (cProfile of its generate call), and a third
    # process with inductor's compile workers ready before the cached graphs load:
    python benchmarks/warm_start.py --cases compile_caches --profile 40 --pool
    # the same with the gemv-mma preset (its layers' graphs saved and loaded alike):
    python benchmarks/warm_start.py --cases compile_caches --fast gemv-mma
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_FIRST = ["--chat", "--prompt", "What is 17*23?"]


def run_cli(args: list[str], cache: str) -> dict:
    """One `minimax-ref generate` process with `MINIMAX_REF_CACHE=cache` (and the compile caches under it): its wall
    seconds, exit status and the stats of its (last) JSON result."""
    env = {**os.environ, "MINIMAX_REF_CACHE": cache, "PYTHONPATH": str(ROOT)}
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(var, None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "minimax_ref.cli", "generate", *args, "--output-format", "json"],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    out = {"wall_seconds": round(wall, 2), "returncode": proc.returncode}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        out["stderr_tail"] = proc.stderr[-2000:]
        return out
    row = json.loads(lines[-1])
    stats = row.get("stats", {})
    out.update({k: stats.get(k) for k in ("warmup_seconds", "time_to_first_token_seconds", "decode_tokens_per_s",
                                          "generated_tokens")})
    out["text"] = row.get("content", "")[:80]
    return out


def child(layers: int, experts: int, device: str, profile: int = 0, pool: bool = False,
          fast: str = "compiled") -> None:
    """Load the synthetic model with the preset `fast`, generate 4 tokens after a 3-token prompt, print one JSON
    line: import, load and warm-up seconds, inductor's cache counters and the slowest compile phases; with `profile` >
    0 also the generate call's `profile` functions of most cumulative time and of most own time (cProfile); with `pool`,
    inductor's compile workers started and ready before the load (otherwise the first compile request starts them,
    and kernels loaded before they are ready load in this process, one after another)."""
    t0 = time.perf_counter()
    import torch
    from torch._dynamo.utils import compilation_time_metrics, counters

    pool_seconds = None
    if pool:
        from torch._inductor.async_compile import AsyncCompile

        t = time.perf_counter()
        AsyncCompile.use_process_pool()  # submits the pool's readiness job, which starts the workers
        AsyncCompile.wait_pool_ready()
        pool_seconds = round(time.perf_counter() - t, 2)

    from minimax_ref.generation.decoding import generate_ids
    from minimax_ref.generation.sampling import SamplingParams
    from minimax_ref.weights.loader import load_synthetic

    tuned = _record_coordesc_tuning()
    built = _record_cubins()
    t1 = time.perf_counter()
    model = load_synthetic("release", format="nvfp4", layers=layers, experts=experts, device=device,
                           weights="packed", fast=fast)
    t2 = time.perf_counter()
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    _, stats = generate_ids(model, [[1, 2, 3]], max_new_tokens=4, sampling=SamplingParams(temperature=0))
    if profiler:
        profiler.disable()
        print(json.dumps({"profile": _profile_tops(profiler, profile)}), flush=True)
    phases = {name: round(sum(times), 3) for name, times in compilation_time_metrics.items()}
    print(json.dumps({"import_seconds": round(t1 - t0 - (pool_seconds or 0), 2), "pool_seconds": pool_seconds,
                      "load_seconds": round(t2 - t1, 2),
                      "warmup_seconds": round(stats.warmup_seconds, 2), "torch": torch.__version__,
                      "inductor": {k: v for k, v in counters["inductor"].items() if "cache" in k},
                      "aot_autograd": dict(counters["aot_autograd"]),
                      "saved_layers": _saved_layers(model.compiled),
                      "slowest_phases": dict(sorted(phases.items(), key=lambda kv: -kv[1])[:8]),
                      "coordesc_tuned": {"kernels": len(tuned), "seconds": round(sum(t for _, t in tuned), 2),
                                         "slowest": sorted(tuned, key=lambda kt: -kt[1])[:12]},
                      "cubins_built": {"kernels": len(built), "ptxas_seconds": round(sum(t for _, t in built), 2),
                                       "names": sorted({name for name, _ in built})}}), flush=True)


def _saved_layers(compiled) -> dict:
    """The compiled layers' graphs saved across processes (`CompiledLayers` with a folder): the graphs this process
    holds and the files in the folder, or why there are none."""
    if compiled is None or compiled.folder is None:
        return {"saved": False}
    return {"saved": True, "graphs": sum(len(g) for g in compiled.graphs.values()),
            "files": len(list(compiled.folder.glob("*.aot")))}


def _profile_tops(profiler: cProfile.Profile, n: int) -> dict[str, list[str]]:
    """The `n` functions of most cumulative and of most own time, as 'seconds calls file:line(name)' lines."""
    stats = pstats.Stats(profiler)
    rows = list(stats.stats.items())

    def line(key, value, seconds):
        return f"{seconds:8.3f} s {value[1]:7d} {key[0].split('site-packages/')[-1]}:{key[1]}({key[2]})"

    cumulative = sorted(rows, key=lambda kv: -kv[1][3])[:n]
    own = sorted(rows, key=lambda kv: -kv[1][2])[:n]
    return {"cumulative": [line(k, v, v[3]) for k, v in cumulative], "own": [line(k, v, v[2]) for k, v in own]}


def _record_coordesc_tuning() -> list[tuple[str, float]]:
    """(kernel, seconds) of every kernel inductor tunes by coordinate descent in this process: in a warm process
    each one is a kernel whose tuned configuration did not come back from the cache."""
    from torch._inductor.runtime import triton_heuristics

    tuned: list[tuple[str, float]] = []
    tune = triton_heuristics.CachingAutotuner.coordinate_descent_tuning

    def recorded(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return tune(self, *args, **kwargs)
        finally:
            seconds = time.perf_counter() - t0
            if seconds > 5e-3:  # not a kernel that returned at once (fixed configurations are not tuned)
                tuned.append((str(self.inductor_meta.get("kernel_name") or self.fn.__name__), round(seconds, 3)))

    triton_heuristics.CachingAutotuner.coordinate_descent_tuning = recorded
    return tuned


def _record_cubins() -> list[tuple[str, float]]:
    """(kernel, seconds) of every Triton kernel built down to a cubin (ptxas) in this process: in a warm process each
    one is a kernel that no cache held, compiled from its source."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend
    except ImportError:
        return []
    built: list[tuple[str, float]] = []
    make_cubin = CUDABackend.make_cubin

    def recorded(self, src, metadata, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return make_cubin(self, src, metadata, *args, **kwargs)
        finally:
            built.append((str(metadata.get("name")), round(time.perf_counter() - t0, 3)))

    CUDABackend.make_cubin = recorded
    return built


def run_child(args: argparse.Namespace, cache: str, profile: int = 0, pool: bool = False) -> dict:
    env = {**os.environ, "MINIMAX_REF_CACHE": cache, "PYTHONPATH": str(ROOT)}
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(var, None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", "--layers", str(args.layers), "--experts",
                           str(args.experts), "--device", args.device, "--profile", str(profile), "--fast", args.fast,
                           *(["--pool"] if pool else [])],
                          capture_output=True, text=True, env=env)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    out = {k: v for line in lines for k, v in line.items()} if lines else {"stderr_tail": proc.stderr[-2000:]}
    # the fast paths' own notices, e.g. why compiled layers are not saved across processes
    out["fast_notices"] = [line for line in proc.stderr.splitlines() if line.startswith("[fast]")]
    return {"wall_seconds": round(time.perf_counter() - t0, 2), "returncode": proc.returncode, **out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4, help="layers of the compiled synthetic model (default: 4)")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cases", nargs="+", default=["readme_first_command", "readme_first_command_compiled",
                                                   "synthetic_compiled", "compile_caches"],
                   help="which runs (default: all four)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="compile_caches: profile the warm process's generate call (cProfile) and report its N "
                        "functions of most cumulative and most own time")
    p.add_argument("--pool", action="store_true",
                   help="compile_caches: a third process, warm, with inductor's compile workers started and ready "
                        "before the load (the cached graphs' kernels then load in the workers)")
    p.add_argument("--fast", default="compiled", choices=["compiled", "gemv-mma"],
                   help="the compiling preset of compile_caches and synthetic_compiled (default: compiled)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.layers, args.experts, args.device, args.profile, args.pool, args.fast)
        return 0
    synthetic = ["--synthetic-weights", "release", "--synthetic-layers", str(args.layers), "--synthetic-experts",
                 str(args.experts), "--weights", "packed", "--device", args.device, "--fast", args.fast, "--prompt",
                 "Hello", "--max-new-tokens", "32", "--temperature", "0"]
    cases = [("readme_first_command", [*README_FIRST, "--device", args.device]),
             ("readme_first_command_compiled", [*README_FIRST, "--device", args.device, "--fast", "compiled"]),
             ("synthetic_compiled", synthetic)]
    if "compile_caches" in args.cases:
        with tempfile.TemporaryDirectory(prefix="warm-start-") as cache:
            cold, warm = run_child(args, cache), run_child(args, cache, args.profile)
            pooled = {"warm_with_pool": run_child(args, cache, pool=True)} if args.pool else {}
        print(json.dumps({"bench": "warm_start", "case": "compile_caches", "command": f"{__file__} --child",
                          "cold": cold, "warm": warm, **pooled}), flush=True)
    for name, cli in cases:
        if name not in args.cases:
            continue
        with tempfile.TemporaryDirectory(prefix="warm-start-") as cache:
            cold = run_cli(cli, cache)
            warm = run_cli(cli, cache)
        print(json.dumps({"bench": "warm_start", "case": name, "command": "minimax-ref generate " + " ".join(cli),
                          "cold": cold, "warm": warm}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
