"""`minimax-ref plan`: per-card weight memory at tensor parallelism N and the KV-cache pool, from
`config.json` alone.

Weights. Every tensor of `checkpoint.tensor_table(cfg)` is counted as the engine holds it after loading
(`loaded_groups`): with `--weights packed` (the default, what a deployment keeps) each NVFP4 / MXFP8 linear in
its on-disk format, the format `quantization_config` implies (`NVFP4`, `MXFP8`, or unquantized BF16; a
single-algorithm MXFP8 config means MXFP8 for every linear it does not exclude); with `--weights dequant`
decoded to `--dtype` (NVFP4 linears keep their fp32 input_scale). BF16 linears and plain tensors are held in
`--dtype`, norms and the router (gate and selection bias) in FP32. When the shards are present their headers
give the stored formats (exact dtypes). Each family's label (`formats`) is the dtype its bytes are counted in, as
held in memory; `stored_formats` are the formats on disk.

| format | bytes of a linear [N, K] |
|---|---|
| bf16 | 2 N K |
| mxfp8 | N K + N K / 32 (E8M0 scales) |
| nvfp4 | N K / 2 + N K / 16 (E4M3 scales) + 8 (fp32 weight_scale_2 and input_scale) |

Per card at TP = n (spec `checkpoint.md`, "Tensor parallel slicing"): q_proj, o_proj, dense and
shared MLPs, routed experts (TP slicing; `--expert-parallel` gives each card E/n whole experts
instead; n must divide E), the vocab-parallel embedding and the LM head are divided by n; k_proj, v_proj and
index_q_proj are divided by min(n, kv_heads) (kv heads, and the index heads that follow them, are
replicated when n > kv_heads); index_k_proj, norms, router, NVFP4 global scales, vision tower and
projectors are replicated on every card (`--split-vision` divides the vision tower and projectors
by n instead, as vLLM shards them). Scales are sliced with their tensors.

KV cache per token and card: `2 * kv_heads_per_card * head_dim` elements (K and V) per layer, plus
one index key of `index_head_dim` elements per sparse (MSA) layer, replicated on every card (the
indexer has one key head). Elements are 1 byte with `--kv-cache-dtype fp8`, else the compute dtype
(2 bytes for bfloat16).

Pool (decided here): `usable = gpu_memory * gpu_memory_utilization - weights_per_card -
activation_reserve - image_reserve`; `kv_pool_tokens = floor(usable / kv_bytes_per_token)` rounded
down to whole pages of one MSA block (128 tokens in the release). Defaults: utilization 0.92 (the
seed's vLLM setting) and an activation reserve of 5.0 GiB per card: the memory the seed's vLLM run
kept outside weights and KV on a 96 GB card at TP2 (95.59 GiB * 0.92 - 76.17 GiB weights - 6.81 GiB
KV = 4.96 GiB: activations at the default batched-token budget, sampler, CUDA graphs, NCCL and
allocator overhead). Images add their encoder-cache bytes (tokens * hidden * 2 per image) to the
reserve. `max_model_len_fits` is true when one sequence of `--max-model-len` tokens fits the pool
and the model's position limit, and the image tokens fit in it. `runs` is false, `problems` says why and
the command exits 1 when the deployment cannot run: the loader's tensor-parallel split rules refuse `--tp`
(`parallel.tp_split_problems`, one rule set for both; a rule one module breaks in many layers is one problem naming
the layers), the weights alone exceed the card's budget, or a `--max-model-len` sequence does not fit.
Flag combinations a load refuses are refused with the load's own message (`check_flags`, exit 2).

Image token budget: one image at `max_pixels` (preprocessor_config.json, default 451,584) becomes
`max_pixels // (patch_size * merge_size)^2` tokens (576) plus the start/end-of-image tokens.

Offload (`--offload cpu|disk`, one card): the device map an offloaded load uses (weights/device_map.py, the rule
offload.py applies too). Each decoder layer is two units, its layer part and its routed expert stacks; the embedding,
final norm, LM head, routers and vision tower are always resident (`device_map.unit_of`); sizes are GPU bytes
(`offload_units`, counted here: packed as stored, bf16 tensors in the compute dtype, norms and routers in fp32). The
budget is `--gpu-memory` itself (no utilization factor): resident units + staging buffers + a reserve of
`--activation-reserve` plus the KV cache of `--batch` sequences of `--max-model-len` tokens.
`device_map.propose_device_map` keeps every layer part before any expert stack (a layer part saves all its bytes per
step, an expert stack about k/E of them), in layer order, first fit, after reserving the staging buffers. Bytes moved
per step at batch B: every streamed layer part plus, per streamed stack, `E (1 - (1 - k/E)^B)` experts' bytes
(`device_map.expected_distinct_experts`); the printed roofline is `tok/s = B / (bytes per step / --h2d-gbps)`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cli.arg_types import finite_float
from ..errors import InputError, MiniMaxRefError
from ..model.cache import kv_bytes_per_token
from ..model.config import ModelConfig, load_model_config
from ..weights.checkpoint import tensor_table
from ..weights.device_map import (
    GIB,
    OFFLOAD_MODES,
    default_prefetch,
    expected_distinct_experts,
    id_runs,
    propose_staged_map,
)
from ..weights.footprint import (
    DEFAULT_ACTIVATION_RESERVE_GIB,
    WEIGHTS_MODES,
    TensorBytes,
    loaded_groups,
    offload_units,
    tensor_groups,
)

DEFAULT_UTILIZATION = 0.92
DEFAULT_MAX_PIXELS = 451584


def image_tokens_per_image(cfg: ModelConfig, ckpt_dir: Path | None) -> int:
    """Language-model tokens of one image at the preprocessor's `max_pixels`, brackets included."""
    if cfg.vision is None:
        return 0
    max_pixels = DEFAULT_MAX_PIXELS
    if ckpt_dir is not None and (ckpt_dir / "preprocessor_config.json").is_file():
        from ..model.config import read_json

        pre = read_json(ckpt_dir / "preprocessor_config.json", "preprocessor_config.json")
        size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
        max_pixels = int(pre.get("max_pixels") or size.get("longest_edge") or DEFAULT_MAX_PIXELS)
    factor = cfg.vision.patch_size * cfg.vision.spatial_merge_size
    return max_pixels // factor**2 + 2


# Checkpoint problems a plan lists one by one; `inspect` lists every one.
MAX_CHECKPOINT_PROBLEMS = 20


def plan_memory(cfg: ModelConfig, *, tp: int, gpu_memory_gib: float, max_model_len: int,
                kv_cache_dtype: str = "auto", images: int = 0, utilization: float = DEFAULT_UTILIZATION,
                activation_reserve_gib: float = DEFAULT_ACTIVATION_RESERVE_GIB, dtype_bytes: int = 2,
                expert_parallel: bool = False, split_vision: bool = False, ckpt_dir: Path | None = None,
                weights: str = "packed") -> dict:
    """The memory plan as a JSON-ready dict (fields described in the module docstring)."""
    if tp < 1:
        raise InputError(f"--tp {tp} must be >= 1")
    if gpu_memory_gib <= 0 or not 0 < utilization <= 1:
        raise InputError(f"--gpu-memory {gpu_memory_gib} must be > 0 and --gpu-memory-utilization "
                         f"{utilization} in (0, 1]")
    if max_model_len < 2:  # as a load refuses it (`decoding.DecodeJob.make`): one prompt token and one generated
        raise InputError(f"--max-model-len {max_model_len}: must be >= 2 (a sequence holds the prompt, at least one "
                         "token, and the reply)")
    if images < 0 or activation_reserve_gib < 0:
        raise InputError("--images and --activation-reserve must be >= 0")
    if kv_cache_dtype not in ("auto", "fp8"):
        raise InputError(f"--kv-cache-dtype {kv_cache_dtype!r}: choose auto or fp8")
    t = cfg.text
    groups, source = tensor_groups(cfg, tp, ckpt_dir=ckpt_dir, expert_parallel=expert_parallel,
                                   split_vision=split_vision)
    groups = loaded_groups(cfg, groups, weights=weights, dtype_bytes=dtype_bytes)
    families: dict[str, dict] = {}
    for g in groups:
        f = families.setdefault(g.family, {"formats": set(), "stored_formats": set(), "bytes_total": 0,
                                           "bytes_per_card": 0.0})
        f["formats"].add(g.held or g.fmt)  # as counted: in memory (see loaded_groups)
        f["stored_formats"].add(g.fmt)
        f["bytes_total"] += g.split + g.replicated
        f["bytes_per_card"] += g.per_card()
    for f in families.values():
        f["formats"] = sorted(f["formats"])
        f["stored_formats"] = sorted(f["stored_formats"])
        f["bytes_per_card"] = int(round(f["bytes_per_card"]))
    total = sum(f["bytes_total"] for f in families.values())
    per_card = sum(g.per_card() for g in groups)
    per_token = kv_bytes_per_token(cfg, tp, kv_cache_dtype, dtype_bytes)
    img_tokens = image_tokens_per_image(cfg, ckpt_dir)
    image_budget = images * img_tokens
    image_reserve = image_budget * t.hidden_size * dtype_bytes
    budget = gpu_memory_gib * GIB * utilization
    usable = budget - per_card - activation_reserve_gib * GIB - image_reserve
    page = t.sparse.block_size if any(t.sparse_layers) else 16
    pool = max(0, int(usable // per_token) // page * page)
    need = max_model_len * per_token
    fits = (usable >= need and max_model_len <= t.max_position_embeddings and image_budget <= max_model_len)
    problems = run_problems(cfg, groups, tp=tp, expert_parallel=expert_parallel, weights_per_card=per_card,
                            budget=budget, usable=usable, fits=fits, max_model_len=max_model_len)
    if source == "headers":  # a checkpoint the loader would refuse does not run, whatever its sizes
        from ..weights.checkpoint import open_checkpoint

        found = open_checkpoint(ckpt_dir, strict=False).problems
        shown = found[:MAX_CHECKPOINT_PROBLEMS]
        problems += [f"the checkpoint would not load: {p}" for p in shown]
        if len(found) > len(shown):
            problems.append(f"the checkpoint would not load: {len(found) - len(shown)} more problems "
                            "(`minimax-ref inspect` lists them all)")
    return {
        "source": source,
        "weights": weights,
        "tp": tp,
        "expert_parallel": expert_parallel,
        "split_vision": split_vision,
        "weights_bytes_total": total,
        "weights_gib_total": total / GIB,
        "weights_bytes_per_card": int(round(per_card)),
        "weights_gib_per_card": per_card / GIB,
        "families": dict(sorted(families.items())),
        "gpu_memory_gib": gpu_memory_gib,
        "gpu_memory_utilization": utilization,
        "activation_reserve_gib": activation_reserve_gib,
        "image_reserve_gib": image_reserve / GIB,
        "kv_cache_dtype": kv_cache_dtype,
        "kv_bytes_per_token": per_token,
        "kv_gib_available": max(0.0, usable) / GIB,
        "kv_pool_tokens": pool,
        "kv_pool_gib": pool * per_token / GIB,
        "kv_page_tokens": page,
        "max_model_len": max_model_len,
        "kv_gib_for_max_model_len": need / GIB,
        "max_model_len_fits": bool(fits),
        "images": images,
        "image_tokens_per_image": img_tokens,
        "image_token_budget": image_budget,
        "runs": not problems,
        "problems": problems,
    }


def run_problems(cfg: ModelConfig, groups: list[TensorBytes], *, tp: int, expert_parallel: bool,
                 weights_per_card: float, budget: float, usable: float, fits: bool, max_model_len: int) -> list[str]:
    """Why the planned deployment cannot run ([] when it can): linears whose format cannot store their shape
    (`parallel.unstorable_linears`), the loader's own tensor-parallel split rules
    (`parallel.tp_split_problems`, with each linear's planned format), weights that exceed the card's budget,
    and a `max_model_len` sequence that does not fit the KV pool or the position limit."""
    from ..model.parallel import tp_split_hint, tp_split_problems, unstorable_linears

    linears, _ = tensor_table(cfg)
    fmt = {g.name: g.fmt for g in groups}
    formats = {prefix: (spec, fmt[prefix]) for prefix, spec in linears.items()}
    # a linear whose format's block scales do not tile its input columns has no on-disk form (one card or many)
    unstorable = unstorable_linears(formats)
    problems = tp_split_problems(cfg, formats, tp, expert_parallel)
    if problems:
        hint = tp_split_hint(problems, expert_parallel)
        problems = [f"cannot split over {tp} tensor-parallel ranks ({hint}): {p}" for p in problems]
    problems = unstorable + problems
    if weights_per_card > budget:
        problems.append(f"weights need {weights_per_card / GIB:.2f} GiB per card, more than the card's "
                        f"{budget / GIB:.2f} GiB budget (--gpu-memory x --gpu-memory-utilization): use more cards")
    elif usable <= 0:
        problems.append(f"weights ({weights_per_card / GIB:.2f} GiB per card) and the activation reserve leave no "
                        "memory for the KV cache: use more cards or a smaller --activation-reserve")
    elif not fits:
        why = (f"exceeds the model's max_position_embeddings={cfg.text.max_position_embeddings}"
               if max_model_len > cfg.text.max_position_embeddings else "does not fit the KV pool (or its images do not"
               " fit in it)")
        problems.append(f"--max-model-len {max_model_len} {why}")
    return problems


# ---------------------------------------------------------------------------------------------- CLI


def build_parser(p: argparse.ArgumentParser) -> None:
    """Flags of `minimax-ref plan`."""
    p.add_argument("--ckpt-path", type=Path, required=True, help="checkpoint folder (config.json is enough)")
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel cards")
    p.add_argument("--gpu-memory", type=finite_float, required=True, help="memory of one card in GiB")
    p.add_argument("--max-model-len", type=int, required=True, help="longest sequence to serve, in tokens")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="auto: the compute dtype; fp8: 1 byte per element (KV and index keys)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="compute dtype: sizes the bf16 tensors, decoded weights, the auto KV cache and activations "
                        "(default: bfloat16)")
    p.add_argument("--weights", choices=list(WEIGHTS_MODES), default="packed",
                   help="as `generate --weights`: packed (NVFP4 / MXFP8 linears as stored, what a deployment keeps; "
                        "default) or dequant (decoded to --dtype at load)")
    p.add_argument("--images", type=int, default=0, help="images per prompt (default: 0)")
    p.add_argument("--gpu-memory-utilization", type=finite_float, default=DEFAULT_UTILIZATION,
                   help=f"fraction of the card to use (default: {DEFAULT_UTILIZATION})")
    p.add_argument("--activation-reserve", type=finite_float, default=DEFAULT_ACTIVATION_RESERVE_GIB,
                   help=f"GiB per card kept for activations and runtime (default: {DEFAULT_ACTIVATION_RESERVE_GIB})")
    p.add_argument("--expert-parallel", action="store_true",
                   help="whole routed experts per card (E/TP; TP must divide E) instead of TP-sliced experts")
    p.add_argument("--split-vision", action="store_true",
                   help="divide the vision tower and projectors over the cards (vLLM) instead of replicating")
    p.add_argument("--offload", choices=list(OFFLOAD_MODES), default="none",
                   help="propose the device map of an offloaded run on one card (--tp 1): which layers and expert "
                        "stacks stay on the GPU within --gpu-memory, and the bytes moved per token (default: none)")
    p.add_argument("--batch", type=int, default=None,
                   help="with --offload: sequences decoded together (bytes moved per step at 1 and at this batch, "
                        "KV cache for this many sequences of --max-model-len) (default: 1)")
    p.add_argument("--h2d-gbps", type=finite_float, default=None,
                   help=f"with --offload: host-to-device GB/s assumed for the roofline (default: {DEFAULT_H2D_GBPS}, "
                        "PCIe Gen5 x16 from pinned memory; benchmarks/offload.py measures it)")
    p.add_argument("--offload-prefetch", action=argparse.BooleanOptionalAction, default=None,
                   help="with --offload: the map of a load with expert-row prefetch (one more expert stack of "
                        "staging) or without (default: as generate on a GPU: with for --offload cpu, without for "
                        "disk)")
    p.add_argument("--output-format", choices=["text", "json"], default="text")


def check_flags(args: argparse.Namespace) -> None:
    """Refuse the flag combinations a load refuses, with the loader's own messages (`offload.OffloadConfig.of`,
    `offload.check_offload`): a plan of a run that cannot start would be a plan of nothing."""
    if args.offload == "none":
        if args.offload_prefetch is not None:  # the same refusal as generate's (`model_args.check_offload_command`)
            raise InputError("--offload-prefetch / --no-offload-prefetch need --offload cpu|disk")
        # a flag that only sizes an offloaded run would be silently ignored: the plan would not be the one asked for
        given = [flag for flag, value in (("--batch", args.batch), ("--h2d-gbps", args.h2d_gbps)) if value is not None]
        if given:
            raise InputError(f"{' and '.join(given)} size an offloaded run: add --offload cpu|disk, or drop "
                             f"{'them' if len(given) > 1 else 'it'}")
        return
    if args.batch is None:
        args.batch = 1
    if args.h2d_gbps is None:
        args.h2d_gbps = DEFAULT_H2D_GBPS
    from ..weights.offload import OffloadConfig, check_offload

    cfg = OffloadConfig.of(args.offload, args.gpu_memory)
    check_offload(cfg, weights=args.weights, tp_size=args.tp, expert_parallel=args.expert_parallel, fast=None,
                  synthetic=False)


def run(args: argparse.Namespace) -> int:
    """`minimax-ref plan`: prints the plan (text table, or one JSON object)."""
    check_flags(args)
    cfg = load_model_config(args.ckpt_path)
    plan = plan_memory(cfg, tp=args.tp, gpu_memory_gib=args.gpu_memory, max_model_len=args.max_model_len,
                       kv_cache_dtype=args.kv_cache_dtype, images=args.images,
                       utilization=args.gpu_memory_utilization, activation_reserve_gib=args.activation_reserve,
                       dtype_bytes=2 if args.dtype == "bfloat16" else 4, expert_parallel=args.expert_parallel,
                       split_vision=args.split_vision, ckpt_dir=args.ckpt_path, weights=args.weights)
    if args.offload != "none":
        return run_offload(args, cfg, plan)
    status = 0 if plan["runs"] else 1
    for problem in plan["problems"]:
        print(f"error: {problem}", file=sys.stderr)
    if args.output_format == "json":
        json.dump(plan, sys.stdout)
        sys.stdout.write("\n")
        return status
    print(f"weights      {plan['weights_gib_total']:.2f} GiB total, {plan['weights_gib_per_card']:.2f} GiB per "
          f"card at TP{plan['tp']} (sizes from {plan['source']})")
    for fam, f in plan["families"].items():
        print(f"  {fam:<14} {'/'.join(f['formats']):<10} {f['bytes_total'] / GIB:10.3f} GiB "
              f"{f['bytes_per_card'] / GIB:10.3f} GiB/card")
    print(f"KV cache     {plan['kv_bytes_per_token']} bytes/token/card ({plan['kv_cache_dtype']}), "
          f"{plan['kv_gib_available']:.2f} GiB usable at utilization {plan['gpu_memory_utilization']} "
          f"after a {plan['activation_reserve_gib']:.2f} GiB activation reserve")
    print(f"KV pool      {plan['kv_pool_tokens']:,} tokens ({plan['kv_pool_gib']:.2f} GiB)")
    print(f"max len      {plan['max_model_len']:,} tokens need {plan['kv_gib_for_max_model_len']:.2f} GiB: "
          f"{'fits' if plan['max_model_len_fits'] else 'does NOT fit'}")
    if plan["images"]:
        print(f"images       {plan['images']} x {plan['image_tokens_per_image']} tokens = "
              f"{plan['image_token_budget']} tokens")
    print(f"runs         {'yes' if plan['runs'] else 'NO: ' + '; '.join(plan['problems'])}")
    return status


# ---------------------------------------------------------------------------------------------- offload
#
# With `--offload cpu|disk` (offload.py) the weights that do not fit `--gpu-memory` stay packed in host memory or
# on disk and are streamed to the GPU as each layer runs. The device map is weights/device_map.py's (one rule,
# `propose_device_map`, the loader's too), over the unit sizes counted here (`offload_units`).

DEFAULT_H2D_GBPS = 50.0  # assumed host-to-device rate for the printed roofline: PCIe Gen5 x16, pinned memory


def plan_offload(cfg: ModelConfig, *, gpu_memory_gib: float, offload: str, max_model_len: int, batch: int = 1,
                 kv_cache_dtype: str = "auto", dtype_bytes: int = 2,
                 activation_reserve_gib: float = DEFAULT_ACTIVATION_RESERVE_GIB, h2d_gbps: float = DEFAULT_H2D_GBPS,
                 ckpt_dir: Path | None = None, prefetch: bool | None = None) -> dict:
    """The offload proposal as a JSON-ready dict: the device map for `gpu_memory_gib` (the whole budget: resident
    weights, staging buffers, and a reserve of `activation_reserve_gib` plus the KV cache of `batch` sequences of
    `max_model_len` tokens), the bytes moved per decode step and per token at batch 1 and at `batch`, and the PCIe
    roofline `tok/s = B / (bytes_per_step(B) / h2d)` at an assumed host-to-device rate `h2d_gbps` (GB/s, 1e9).
    prefetch: the map of a load with expert-row prefetch (`--offload-prefetch`: a second expert staging stack); None:
    as a load on a GPU decides (`device_map.default_prefetch`)."""
    if offload not in OFFLOAD_MODES or offload == "none":
        raise InputError(f"--offload {offload!r}: choose cpu or disk for an offload plan")
    if prefetch is None:
        prefetch = default_prefetch(offload, cuda=True)
    if batch < 1 or h2d_gbps <= 0 or gpu_memory_gib <= 0:
        raise InputError("--batch must be >= 1, --h2d-gbps and --gpu-memory > 0")
    always, units = offload_units(cfg, dtype_bytes=dtype_bytes, ckpt_dir=ckpt_dir)
    kv = kv_bytes_per_token(cfg, 1, kv_cache_dtype, dtype_bytes) * max_model_len * batch
    reserve = int(activation_reserve_gib * GIB) + kv
    problems: list[str] = []
    try:
        dm, prefetch = propose_staged_map(units, always, int(gpu_memory_gib * GIB), reserve, prefetch)
    except MiniMaxRefError as e:
        problems.append(str(e))
        dm = None
    k = cfg.text.num_experts_per_tok
    out = {"offload": offload, "gpu_memory_gib": gpu_memory_gib, "prefetch": prefetch,
           "always_resident_bytes": always,
           "reserve_bytes": reserve, "kv_bytes": kv, "units": len(units),
           "weights_bytes": always + sum(u.nbytes for u in units), "problems": problems, "runs": not problems}
    if dm is None:
        return out
    h2d = h2d_gbps * 1e9
    steps = {}
    for b in sorted({1, batch}):
        step = dm.bytes_per_step(b, k)
        steps[str(b)] = {"bytes_per_step": step, "bytes_per_token": step / b,
                         "distinct_experts_per_layer": expected_distinct_experts(cfg.text.num_local_experts, k, b),
                         "roofline_tok_s": (b / (step / h2d)) if step else None}
    layers_res = [u.layer for u in units if u.kind == "layer" and u.name in dm.resident]
    experts_res = [u.layer for u in units if u.kind == "experts" and u.name in dm.resident]
    out.update({
        "resident_layers": layers_res,
        "resident_expert_layers": experts_res,
        "streamed_layers": [u.layer for u in dm.streamed_units() if u.kind == "layer"],
        "streamed_expert_layers": [u.layer for u in dm.streamed_units() if u.kind == "experts"],
        "resident_bytes": dm.resident_bytes, "staging_bytes": dm.staging_bytes, "gpu_bytes": dm.gpu_bytes,
        "streamed_bytes": sum(u.nbytes for u in dm.streamed_units()),
        "h2d_gbps_assumed": h2d_gbps, "per_batch": steps,
        "roofline": "tok/s = B / (bytes_per_step(B) / H2D bytes/s); bytes_per_step(B) = sum(streamed layer units) + "
                    "sum over streamed expert stacks of E * (1 - (1 - k/E)^B) * bytes per expert",
    })
    return out


def run_offload(args: argparse.Namespace, cfg: ModelConfig, plan: dict) -> int:
    """`minimax-ref plan --offload cpu|disk`: the weights, then the device map and bytes moved (`plan_offload`). The
    budget is --gpu-memory itself (the loader's `gpu_memory`; --gpu-memory-utilization does not apply)."""
    check_flags(args)  # --tp 1, --weights packed, no --expert-parallel: as a load refuses them
    off = plan_offload(cfg, gpu_memory_gib=args.gpu_memory, offload=args.offload, max_model_len=args.max_model_len,
                       batch=args.batch, kv_cache_dtype=args.kv_cache_dtype,
                       dtype_bytes=2 if args.dtype == "bfloat16" else 4, activation_reserve_gib=args.activation_reserve,
                       h2d_gbps=args.h2d_gbps, ckpt_dir=args.ckpt_path, prefetch=args.offload_prefetch)
    if args.max_model_len > cfg.text.max_position_embeddings:
        off["problems"].append(f"--max-model-len {args.max_model_len} exceeds the model's max_position_embeddings="
                               f"{cfg.text.max_position_embeddings}")
    off["runs"] = not off["problems"]
    for problem in off["problems"]:
        print(f"error: {problem}", file=sys.stderr)
    status = 0 if off["runs"] else 1
    if args.output_format == "json":
        json.dump({**plan, "offload_plan": off, "runs": off["runs"], "problems": off["problems"]}, sys.stdout)
        sys.stdout.write("\n")
        return status
    print(f"weights      {off['weights_bytes'] / GIB:.2f} GiB in GPU memory at TP1 (sizes from {plan['source']}; "
          f"packed linears as stored, the rest in {args.dtype})")
    print(f"offload      {args.offload}: budget {args.gpu_memory:g} GiB = resident weights + staging + reserve "
          f"({off['reserve_bytes'] / GIB:.2f} GiB: activations {args.activation_reserve:g} GiB, KV cache "
          f"{off['kv_bytes'] / GIB:.2f} GiB for {args.batch} x {args.max_model_len:,} tokens)")
    if not off["runs"]:
        print(f"runs         NO: {'; '.join(off['problems'])}")
        return status

    def spans(layers: list[int]) -> str:
        return ", ".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in id_runs(layers)) or "none"

    print("device map   on the GPU: embedding, LM head, norms, routers, vision; "
          f"layers {spans(off['resident_layers'])}; expert stacks of layers {spans(off['resident_expert_layers'])}")
    print(f"             streamed: layers {spans(off['streamed_layers'])}; expert stacks of layers "
          f"{spans(off['streamed_expert_layers'])} ({off['streamed_bytes'] / GIB:.2f} GiB off the GPU)")
    print(f"GPU memory   {off['resident_bytes'] / GIB:.2f} GiB resident + {off['staging_bytes'] / GIB:.2f} GiB "
          f"staging ({'two expert stacks: prefetch' if off['prefetch'] else 'one expert stack: no prefetch'}) + "
          f"{off['reserve_bytes'] / GIB:.2f} GiB reserve = {off['gpu_bytes'] / GIB:.2f} GiB")
    for b, row in off["per_batch"].items():
        roof = "no streaming" if row["roofline_tok_s"] is None else f"{row['roofline_tok_s']:.1f} tok/s"
        print(f"batch {b:<6} {row['bytes_per_step'] / 1e9:.3f} GB moved per step, "
              f"{row['bytes_per_token'] / 1e9:.3f} GB per token ({row['distinct_experts_per_layer']:.1f} distinct "
              "experts per streamed stack); PCIe "
              f"roofline at {args.h2d_gbps:g} GB/s: {roof}")
    print(f"roofline     {off['roofline']}")
    print("runs         yes")
    return status
