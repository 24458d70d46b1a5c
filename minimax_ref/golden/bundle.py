"""A bundle on disk: `BundleWriter` / `write_bundle` write entries as they complete (each entry's file, its
manifest row, packed operands stored once), `read_bundle_manifest` checks a bundle is whole, `entry_tensors` reads
an entry back under its canonical names."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import InputError
from ..outdir import staged_folder
from .contract import FORMAT, MANIFEST, MXFP8_LINEARS, OPS, contract, sha256, tolerance
from .fp64 import add_fp64
from .layouts import ABOUT
from .norm_edges import EDGE_PHASE
from .operands import Entry


def weights_file(layer: int) -> str:
    """The bundle-relative file that holds layer `layer`'s packed operands, once."""
    return f"weights/layer{layer:03d}.safetensors"


def stored_ref(e: Entry, name: str, files: dict[tuple[int, str], str]) -> dict:
    """Where `e`'s weight `name` is in the bundle: {file, key} for a stored tensor, {cat | stack: [refs]} for a
    joined one (`Entry.put_joined`)."""
    if name in e.joined:
        how, parts = e.joined[name]
        return {how: [stored_ref(e, p, files) for p in parts]}
    return {"file": files[(e.layer, e.shared[name])], "key": e.shared[name]}


def tensor_meta(e: Entry, name: str, t: torch.Tensor, files: dict[tuple[int, str], str]) -> dict:
    """The manifest row of `e`'s tensor `name`; a weight's says where it is stored (`stored_ref`)."""
    meta = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "role": e.roles[name]}
    if name in e.shared or name in e.joined:
        meta["stored"] = stored_ref(e, name, files)
    return meta


def ref_files(ref: dict) -> list[str]:
    """The weights files a `stored` reference reads."""
    if "file" in ref:
        return [ref["file"]]
    return [f for part in next(iter(ref.values())) for f in ref_files(part)]


def read_ref(path: Path, ref: dict, opened: dict[str, dict[str, torch.Tensor]]) -> torch.Tensor:
    """The tensor a `stored` reference names, built from the bundle's weights files (`opened` caches them)."""
    if "file" in ref:
        if ref["file"] not in opened:
            opened[ref["file"]] = load_file(str(path / ref["file"]))
        return opened[ref["file"]][ref["key"]]
    how, parts = next(iter(ref.items()))
    ts = [read_ref(path, p, opened) for p in parts]
    return torch.cat(ts) if how == "cat" else torch.stack(ts)


def entry_order(key: tuple[str, int, str, str]) -> tuple:
    op, layer, phase, tag = key
    return OPS.index(op), layer, phase, MXFP8_LINEARS.index(tag) if tag in MXFP8_LINEARS else -1, tag


class BundleWriter:
    """Writes a bundle's entries into the staging folder `tmp` as they are complete (`add`: each entry's own file,
    its manifest row, and the packed operands not yet stored; the entries' tensors are then dropped, so a long
    export holds about one layer's entries at a time), and at the end the manifest (`finish`). Each packed operand is
    stored once: in `weights/layerNNN.safetensors` when the layer's first phase uses it, in
    `weights/layerNNN_{phase}.safetensors` when a later phase first does (a routed expert chosen only there)."""

    def __init__(self, tmp: Path, manifest: dict, *, fp64: bool = False, emulate: bool = False):
        self.tmp, self.manifest, self.fp64, self.emulate = tmp, manifest, fp64, emulate
        manifest.setdefault("weights_files", [])
        manifest.setdefault("entries", [])
        if fp64:
            manifest["numerics"]["fp64_outputs"] = True
        self.stored: dict[tuple[int, str], str] = {}  # (layer, key) -> the weights file holding it
        self.largest = 0  # elements of the largest tensor written
        self.names: dict[str, set[str]] = {}  # op -> the tensor names its entries hold (the contract describes them)
        self.params: dict[str, set[str]] = {}  # op -> the parameter names its entries hold

    def add(self, entries: Sequence[Entry]) -> None:
        new: dict[int, dict[str, torch.Tensor]] = {}
        for e in entries:
            for name, key in e.shared.items():
                if (e.layer, key) not in self.stored:
                    new.setdefault(e.layer, {}).setdefault(key, e.tensors[name])
        for L, tensors in sorted(new.items()):
            rel, n = weights_file(L), 0
            while (self.tmp / rel).exists():
                n += 1
                rel = weights_file(L).replace(".safetensors", f"_{entries[0].phase}{f'_{n}' if n > 1 else ''}"
                                                               ".safetensors")
            (self.tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(self.tmp / rel), metadata={"layer": str(L)})
            self.manifest["weights_files"].append({"file": rel, "layer": L, "sha256": sha256(self.tmp / rel)})
            self.stored.update({(L, key): rel for key in tensors})
        del new
        for e in entries:
            if self.fp64:
                add_fp64(e, self.emulate)
            path = self.tmp / e.file
            path.parent.mkdir(parents=True, exist_ok=True)
            own = {n: t for n, t in e.tensors.items() if n not in e.shared and n not in e.joined}
            self.largest = max([self.largest, *(t.numel() for t in own.values())])
            save_file(own, str(path), metadata={"op": e.op, "layer": str(e.layer), "phase": e.phase})
            self.names.setdefault(e.op, set()).update(e.tensors)
            self.params.setdefault(e.op, set()).update(e.params)
            edge = e.phase == EDGE_PHASE and self.manifest["numerics"]["dtype"] == "bfloat16"
            self.manifest["entries"].append({
                "file": e.file, "op": e.op, "layer": e.layer, "phase": e.phase, **({"tag": e.tag} if e.tag else {}),
                "params": e.params,
                "sha256": sha256(path),
                "tensors": {n: tensor_meta(e, n, t, self.stored) for n, t in e.tensors.items()},
                "tolerance": {n: tolerance(e.op, n, t, edge) for n, t in e.tensors.items()
                              if e.roles[n] == "output"}})
            e.tensors = {}  # written: the entry's memory is released

    def finish(self) -> None:
        """Write the manifest: the entries in bundle order, each op's contract describing exactly the tensors and
        parameters its entries hold; every file of the bundle gets the manifest's permissions (safetensors writes
        0600)."""
        m = self.manifest
        m["entries"].sort(key=lambda r: entry_order((r["op"], r["layer"], r["phase"], r.get("tag", ""))))
        dtype = m["numerics"]["dtype"]
        m["ops"] = [op for op in OPS if op in self.names] if "single_op" in m else m["ops"]
        m["contracts"] = {op: contract(op, dtype, self.fp64, self.names.get(op, ()), self.params.get(op, ()))
                          for op in m["ops"] if op in self.names}
        if "layers" in m:  # the layers the bundle holds entries of (the head's num_hidden_layers included)
            m["layers"] = sorted({r["layer"] for r in m["entries"]})
        m["about"] = ABOUT
        (self.tmp / MANIFEST).write_text(json.dumps(m, indent=1) + "\n")
        mode = (self.tmp / MANIFEST).stat().st_mode & 0o777
        for f in self.tmp.rglob("*.safetensors"):
            f.chmod(mode)


def write_bundle(out: Path, manifest: dict, entries: Sequence[Entry], *, fp64: bool = False,
                 emulate: bool = False) -> None:
    """Write `entries` (their packed operands once per layer under weights/) and `manifest` (its `entries` and
    `weights_files` filled here) into the new folder `out`; fp64: add each entry's fp64 outputs first."""
    # written under a temporary name and renamed when complete: a failure (a full disk) leaves nothing behind
    with staged_folder(out) as tmp:
        w = BundleWriter(tmp, manifest, fp64=fp64, emulate=emulate)
        w.add(entries)
        w.finish()


def entry_tensors(path: Path, ent: dict) -> dict[str, torch.Tensor]:
    """Every tensor of manifest entry `ent` of bundle `path`: its own file's and its packed operands from the
    shared weights file. Fresh (allocator-aligned) copies: safetensors maps tensors at 8-byte offsets, and CPU
    BLAS takes different code paths (different rounding) for differently aligned small matrices."""
    tensors = {k: v.clone() for k, v in load_file(str(path / ent["file"])).items()}
    opened: dict[str, dict[str, torch.Tensor]] = {}
    for name, meta in ent.get("tensors", {}).items():
        if isinstance(meta, dict) and "stored" in meta:
            try:
                tensors[name] = read_ref(path, meta["stored"], opened).clone()
            except KeyError as e:
                raise InputError(f"{path}: {ent['file']}'s {name} is stored under {e.args[0]!r}, which its weights "
                                 "file lacks (a damaged bundle: export it again)") from None
    return tensors


def valid_ref(ref) -> bool:
    """Whether `ref` is a well-formed `stored` reference."""
    if not isinstance(ref, dict):
        return False
    if set(ref) == {"file", "key"}:
        return isinstance(ref["file"], str) and isinstance(ref["key"], str)
    return (len(ref) == 1 and next(iter(ref)) in ("cat", "stack") and isinstance(next(iter(ref.values())), list)
            and bool(next(iter(ref.values()))) and all(valid_ref(p) for p in next(iter(ref.values()))))


def read_bundle_manifest(path: Path) -> dict:
    """The manifest of golden bundle `path`, after checking the bundle is whole: the manifest is JSON of this
    format with numerics and entries, and every entry's file exists and is a complete safetensors file. Every
    problem found is raised together as one InputError (a damaged bundle must not end in a traceback)."""
    from ..weights.checkpoint import _read_header

    mf = path / MANIFEST
    if not path.exists():
        raise InputError(f"{path}: no such folder")
    if not mf.is_file():
        raise InputError(f"{path}: no {MANIFEST} (not a golden bundle)")
    try:
        manifest = json.loads(mf.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{mf}: not valid JSON ({e}); export the bundle again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise InputError(f"{mf}: format {got!r} is not {FORMAT!r}")
    problems = []
    num = manifest.get("numerics")
    if not isinstance(num, dict) or not all(k in num for k in ("dtype", "act_quant", "kv_scale")):
        problems.append("'numerics' must hold dtype, act_quant and kv_scale")
    elif not isinstance(getattr(torch, str(num["dtype"]), None), torch.dtype):
        problems.append(f"numerics.dtype {num['dtype']!r} is not a torch dtype")
    entries = manifest.get("entries")
    if not isinstance(entries, list):
        problems.append("'entries' must be a list")
        entries = []
    for i, ent in enumerate(entries):
        if not isinstance(ent, dict) or not all(k in ent for k in ("file", "op", "params")):
            problems.append(f"entries[{i}] must hold file, op and params")
            continue
        f = path / str(ent["file"])
        if not f.is_file():
            problems.append(f"entries[{i}]: {ent['file']} is missing")
            continue
        try:
            _read_header(f)
        except (ValueError, json.JSONDecodeError, OSError) as e:
            problems.append(f"entries[{i}]: {ent['file']} cannot be read ({e})")
        tensors = ent.get("tensors") if isinstance(ent.get("tensors"), dict) else {}
        stored = [m["stored"] for m in tensors.values() if isinstance(m, dict) and "stored" in m]
        if not all(valid_ref(st) for st in stored):
            problems.append(f"entries[{i}]: a 'stored' reference is not {{file, key}}, {{cat: [...]}} or "
                            "{stack: [...]}")
            continue
        for rel in sorted({f for st in stored for f in ref_files(st)}):
            if not (path / rel).is_file():
                problems.append(f"entries[{i}]: its weights file {rel} is missing")
    if problems:
        raise InputError(f"{path}: damaged golden bundle ({len(problems)} problems); export it again:\n"
                         + "\n".join(f"  - {p}" for p in problems[:20]))
    return manifest


def check_sha256(path: Path, manifest: dict) -> None:
    """Refuse (InputError naming them) the bundle's files whose bytes differ from the manifest's sha256: a changed
    byte would otherwise read as a numeric mismatch."""
    files = [(w["file"], w.get("sha256")) for w in manifest.get("weights_files", [])]
    files += [(e["file"], e.get("sha256")) for e in manifest["entries"]]
    bad = [f for f, h in files if h is not None and sha256(path / f) != h]
    if bad:
        raise InputError(f"{path}: {len(bad)} files differ from the manifest's sha256 ({', '.join(bad[:5])}); "
                         "export the bundle again (golden.load(verify=False) reads them anyway)")
