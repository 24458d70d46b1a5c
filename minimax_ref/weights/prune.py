"""`minimax-ref prune`: keep N of the E routed experts in every MoE layer (spec `checkpoint.md`,
"Expert-pruned builds").

Selection (decided here). The source model runs a prefill over the calibration traces (every real
token of every trace, prompt and completion alike, since experts serve both) and the engine's
`Trace` records each MoE layer's routing. Per layer and expert:

* `weight` (default): the routed weight mass, the sum over tokens of the normalised routing weight
  `w` the expert received (the weights that multiply its output; the constant routed scaling
  factor does not change the order);
* `frequency`: how many times the expert was among a token's top-k.

The N experts with the largest score are kept; ties are broken by the lower expert id (so experts
never chosen keep the lowest ids). Scores are accumulated in float64.

Writing (byte level, nothing is decoded). Kept experts' tensors (every tensor under
`...block_sparse_moe.experts.{e}.`, scales included) are copied byte for byte and renamed to
`0..N-1` in their original order; `gate.weight` and `e_score_correction_bias` keep the kept rows
(cut as raw byte rows, whatever the dtype); every other tensor is copied as stored. Shards that hold
no MoE tensor are copied as files; the other shards are rewritten (same file names, tensors in their
original order) and a shard left with no tensor is not written. `config.json` is edited as text:
only the value of `num_local_experts` changes (key order, formatting and the quantization config,
which may now name missing experts, are untouched). The index is rewritten with the same key order.
`pruning.json` records the source's expert count, the kept original ids per layer and the method.
Every other file and folder (tokenizer, generation config, `dspark/`, ...) is copied.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError, InputError
from ..outdir import check_new_folder, staged_folder
from .checkpoint import TEXT_PREFIX

METHODS = ("weight", "frequency")
INDEX = "model.safetensors.index.json"
PRUNING = "pruning.json"
_EXPERT = re.compile(r"^" + re.escape(TEXT_PREFIX) + r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(.+)$")
_ROUTER = re.compile(r"^" + re.escape(TEXT_PREFIX)
                     + r"layers\.(\d+)\.block_sparse_moe\.(gate\.weight|e_score_correction_bias)$")
_COPY_CHUNK = 64 << 20


# ---------------------------------------------------------------------------------------------- selection


def check_keep(keep: int, num_experts: int, top_k: int, where: str) -> None:
    """Reject a `--keep` outside [top_k, num_experts] with an InputError naming the value and limit."""
    if keep > num_experts:
        raise InputError(f"--keep {keep} exceeds num_local_experts={num_experts} of {where}")
    if keep < top_k:
        raise InputError(f"--keep {keep} is fewer than num_experts_per_tok={top_k} of {where}: every token "
                         f"is routed to {top_k} experts")


@torch.no_grad()
def expert_scores(model, seqs: Sequence[Sequence[int]], method: str = "weight", *, batch_size: int = 8,
                  prefill_chunk: int = 2048) -> dict[int, torch.Tensor]:
    """Per MoE layer, float64 [E] scores of every expert over all real tokens of `seqs`."""
    from ..research.score import prefill_chunks

    if method not in METHODS:
        raise InputError(f"--method {method!r}: choose one of {list(METHODS)}")
    text = model.text
    E = text.num_local_experts
    scores = {L: torch.zeros(E, dtype=torch.float64) for L, moe in enumerate(text.moe_layers) if moe}
    for ch in prefill_chunks(model, seqs, batch_size=batch_size, prefill_chunk=prefill_chunk, trace=True):
        B, t = ch.hidden.shape[:2]
        pos = torch.arange(ch.start, ch.start + t)
        valid = (pos[None, :] < torch.tensor(ch.lengths)[:, None]).reshape(-1)  # padding is not counted
        for L, acc in scores.items():
            r = ch.trace.routing[L]
            ids = r.expert_ids.cpu()[valid].reshape(-1)
            if method == "weight":
                acc.index_add_(0, ids, r.weights.cpu()[valid].reshape(-1).double())
            else:
                acc += torch.bincount(ids, minlength=E).double()
    return scores


def choose_experts(scores: torch.Tensor, keep: int) -> list[int]:
    """The `keep` ids with the largest score (ties: lower id first), returned in ascending order."""
    ranked = sorted(range(scores.numel()), key=lambda e: (-float(scores[e]), e))
    return sorted(ranked[:keep])


# ---------------------------------------------------------------------------------------------- safetensors bytes


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's JSON header and the byte offset where its data section starts."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    return header, 8 + n


def _copy_range(src, dst, offset: int, length: int) -> None:
    src.seek(offset)
    while length:
        buf = src.read(min(length, _COPY_CHUNK))
        if not buf:
            raise CheckpointError(f"{src.name}: truncated tensor data")
        dst.write(buf)
        length -= len(buf)


def write_shard(src_path: Path, dst_path: Path, plan: list[tuple[str, str, list[int] | None]]) -> int:
    """Write `dst_path` from tensors of `src_path` without decoding them.

    `plan` lists `(source name, new name, rows)` in output order; `rows` None copies the tensor's
    bytes, a list keeps only those rows of dimension 0 (contiguous byte runs). Returns data bytes.
    """
    header, base = read_header(src_path)
    meta = header.get("__metadata__")
    out_header: dict = {} if meta is None else {"__metadata__": meta}
    pieces: list[tuple[int, int, list[int] | None, int]] = []  # offset, length, rows, row bytes
    pos = 0
    for name, new, rows in plan:
        info = header[name]
        begin, end = info["data_offsets"]
        shape = list(info["shape"])
        row_bytes = 0
        length = end - begin
        if rows is not None:
            if not shape or (end - begin) % shape[0]:
                raise CheckpointError(f"{src_path.name}: {name} has shape {shape}; cannot cut rows")
            row_bytes = (end - begin) // shape[0]
            shape = [len(rows)] + shape[1:]
            length = row_bytes * len(rows)
        out_header[new] = {"dtype": info["dtype"], "shape": shape, "data_offsets": [pos, pos + length]}
        pieces.append((base + begin, end - begin, rows, row_bytes))
        pos += length
    blob = json.dumps(out_header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as safetensors writes it
    with open(src_path, "rb") as src, open(dst_path, "wb") as dst:
        dst.write(struct.pack("<Q", len(blob)))
        dst.write(blob)
        for offset, length, rows, row_bytes in pieces:
            if rows is None:
                _copy_range(src, dst, offset, length)
            else:
                for r in rows:
                    _copy_range(src, dst, offset + r * row_bytes, row_bytes)
    return pos


def tensor_action(name: str, kept: dict[int, list[int]]) -> tuple[str | None, list[int] | None]:
    """(new name or None to drop, rows to keep or None) for one tensor of the source."""
    m = _EXPERT.match(name)
    if m and int(m.group(1)) in kept:
        ids = kept[int(m.group(1))]
        e = int(m.group(2))
        if e not in ids:
            return None, None
        return f"{TEXT_PREFIX}layers.{m.group(1)}.block_sparse_moe.experts.{ids.index(e)}.{m.group(3)}", None
    m = _ROUTER.match(name)
    if m and int(m.group(1)) in kept:
        return name, kept[int(m.group(1))]
    return name, None


# ---------------------------------------------------------------------------------------------- config


def edit_num_experts(text: str, old: int, new: int, where: str) -> str:
    """`config.json` text with every `num_local_experts` (or `num_experts`) equal to `old` set to `new`.

    A textual edit, so everything else stays byte-identical; the result is checked by parsing.
    """
    pattern = re.compile(r'("(?:num_local_experts|num_experts)"\s*:\s*)(\d+)')
    count = 0

    def sub(m: re.Match) -> str:
        nonlocal count
        if int(m.group(2)) != old:
            return m.group(0)
        count += 1
        return m.group(1) + str(new)

    out = pattern.sub(sub, text)
    if count == 0:
        raise ConfigError(f"{where}: no num_local_experts={old} to edit")

    def expect(obj):
        if isinstance(obj, dict):
            return {k: (new if k in ("num_local_experts", "num_experts") and v == old else expect(v))
                    for k, v in obj.items()}
        if isinstance(obj, list):
            return [expect(v) for v in obj]
        return obj

    if json.loads(out) != expect(json.loads(text)):
        raise ConfigError(f"{where}: editing num_local_experts as text changed other values; refusing")
    return out


# ---------------------------------------------------------------------------------------------- writer


def _check_out(src: Path, out: Path) -> None:
    s, o = src.resolve(), out.resolve()
    if o == s or s in o.parents:
        raise InputError(f"--out {out}: must not be the source checkpoint or a folder inside it")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"--out {out}: exists and is not an empty folder")
    check_new_folder(out)  # a place where no folder can be made, before the calibration runs


def write_pruned(src: str | Path, out: str | Path, kept: dict[int, list[int]], method: str,
                 extra: dict | None = None) -> Path:
    """Write the pruned copy of checkpoint `src` to `out` (layout in the module docstring).

    `kept[L]` are the original ids kept in MoE layer L, ascending, the same count in every layer. The folder is
    written under a temporary name beside `out` and renamed when complete (`outdir.staged_folder`): a failure, a
    full disk included, leaves nothing behind.
    """
    src, out = Path(src), Path(out)
    _check_out(src, out)
    with staged_folder(out) as tmp:
        _write_pruned_into(src, tmp, kept, method, extra)
    return out


def _write_pruned_into(src: Path, out: Path, kept: dict[int, list[int]], method: str, extra: dict | None) -> Path:
    from .checkpoint import open_checkpoint

    src, out = Path(src), Path(out)
    _check_out(src, out)
    ck = open_checkpoint(src)  # only a valid checkpoint is pruned: every expert tensor is accounted for
    text = ck.config.text
    E = text.num_local_experts
    moe_layers = [L for L, m in enumerate(text.moe_layers) if m]
    counts = {len(v) for v in kept.values()}
    if sorted(kept) != moe_layers or len(counts) != 1:
        raise InputError(f"kept experts must be given for every MoE layer {moe_layers}, the same number each")
    for L, ids in kept.items():
        if ids != sorted(set(ids)) or not all(0 <= e < E for e in ids):
            raise InputError(f"layer {L}: kept ids {ids} must be distinct, ascending and in [0, {E})")
    N = counts.pop()
    check_keep(N, E, text.num_experts_per_tok, str(src / "config.json"))

    out.mkdir(parents=True, exist_ok=True)
    index_path = src / INDEX
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    shards = sorted({info.shard for info in ck.tensors.values()})
    new_map: dict[str, str] = {}
    total = 0
    for shard in shards:
        header, _ = read_header(src / shard)
        names = sorted((n for n in header if n != "__metadata__" and ck.tensors.get(n) is not None
                        and ck.tensors[n].shard == shard), key=lambda n: header[n]["data_offsets"][0])
        plan = []
        for n in names:
            new, rows = tensor_action(n, kept)
            if new is not None:
                plan.append((n, new, rows))
                new_map[n] = new
        untouched = len(plan) == len(names) and all(a == b and r is None for a, b, r in plan)
        if untouched:
            shutil.copyfile(src / shard, out / shard)
            total += sum(header[n]["data_offsets"][1] - header[n]["data_offsets"][0] for n in names)
        elif plan:
            total += write_shard(src / shard, out / shard, plan)
    renamed = {new: ck.tensors[old].shard for old, new in new_map.items()}

    cfg_path = src / "config.json"
    (out / "config.json").write_text(edit_num_experts(cfg_path.read_text(encoding="utf-8"), E, N, str(cfg_path)),
                                     encoding="utf-8")
    if index is not None:
        order = list(index.get("weight_map", {}))
        weight_map = {new_map[n]: renamed[new_map[n]] for n in order if n in new_map}
        new_index = dict(index)  # same key order; assigning existing keys keeps their place
        new_index["metadata"] = {**(index.get("metadata") or {}), "total_size": total}
        new_index["weight_map"] = weight_map
        (out / INDEX).write_text(json.dumps(new_index, indent=2) + "\n")
    record: dict = {"source_num_experts": E, "kept": {str(L): kept[L] for L in moe_layers}, "method": method}
    record.update(extra or {})
    previous = src / PRUNING
    if previous.is_file():
        record["source_pruning"] = json.loads(previous.read_text())
    (out / PRUNING).write_text(json.dumps(record, indent=2) + "\n")

    skip = {"config.json", INDEX, PRUNING, *shards}
    for item in sorted(src.iterdir()):
        if item.name in skip or (item.suffix == ".safetensors" and item.parent == src):
            continue
        if item.is_dir():
            shutil.copytree(item, out / item.name)
        else:
            shutil.copy2(item, out / item.name)
    open_checkpoint(out)  # the result must validate (unknown quantized_layers entries are tolerated)
    return out


# ---------------------------------------------------------------------------------------------- CLI


def build_parser(p: argparse.ArgumentParser) -> None:
    """Flags of `minimax-ref prune`."""
    from ..cli.arg_types import positive_int
    from ..cli.model_args import add_model_flags

    add_model_flags(p)
    p.add_argument("--keep", type=int, required=True, help="routed experts kept per MoE layer")
    p.add_argument("--calibration", type=Path, required=True,
                   help="JSONL traces (the score format) whose routing decides which experts stay")
    p.add_argument("--out", type=Path, required=True, help="output folder (new or empty)")
    p.add_argument("--method", choices=list(METHODS), default="weight",
                   help="weight: routed weight mass (default); frequency: top-k selection counts")
    p.add_argument("--chat", action="store_true", help="render text traces with the chat template")
    p.add_argument("--batch-size", type=positive_int, default=8, help="traces prefilled together (default: 8)")
    p.add_argument("--prefill-chunk", type=positive_int, default=2048,
                   help="positions per prefill step (default: 2048)")


def run(args: argparse.Namespace) -> int:
    """`minimax-ref prune`: prints a JSON summary (out, kept ids per layer, method) on stdout."""
    from ..model.config import load_model_config
    from ..research.score import free, load_for_args, load_traces_for_args, refuse_synthetic
    from .embedded import default_checkpoint

    refuse_synthetic(args)
    src = args.ckpt_path or default_checkpoint()
    text = load_model_config(src).text
    if not text.has_moe:
        raise InputError(f"{src}: the model has no MoE layers to prune")
    check_keep(args.keep, text.num_local_experts, text.num_experts_per_tok, str(Path(src) / "config.json"))
    if args.method not in METHODS:
        raise InputError(f"--method {args.method!r}: choose one of {list(METHODS)}")
    _check_out(Path(src), args.out)
    traces = load_traces_for_args(args.calibration, src, args, flag="--calibration")
    model = load_for_args(src, args)
    scores = expert_scores(model, [t.input_ids for t in traces], args.method, batch_size=args.batch_size,
                           prefill_chunk=args.prefill_chunk)
    free(model)
    model = None
    kept = {L: choose_experts(s, args.keep) for L, s in scores.items()}
    tokens = sum(len(t.input_ids) for t in traces)
    write_pruned(src, args.out, kept, args.method,
                 {"calibration": {"file": args.calibration.name, "traces": len(traces), "tokens": tokens}})
    json.dump({"out": str(args.out), "source_num_experts": text.num_local_experts, "keep": args.keep,
               "method": args.method, "kept": {str(L): v for L, v in kept.items()}}, sys.stdout)
    sys.stdout.write("\n")
    return 0
