"""Golden entries and their operands: `Entry` (one op at one layer and phase), packed linears and fused gate-up
operands as the checkpoint stores them, their decoding, and the paged KV views of a step's cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..errors import InputError
from ..weights.checkpoint import DENSE, MXFP8, NVFP4, Checkpoint


def checkpoint_of(model) -> Checkpoint:
    """The checkpoint `model` was loaded from, to read packed operands: its folder, or the synthetic preset that
    regenerates the same tensors."""
    from ..weights.checkpoint import open_checkpoint

    if model.ckpt_path is not None:
        return open_checkpoint(model.ckpt_path)
    spec = getattr(model, "synthetic", None)
    if spec is None:
        raise InputError("golden: the model has neither a checkpoint folder (ckpt_path) nor a synthetic preset; "
                         "load it with load_model(path) or load_synthetic(preset)")
    from ..weights.synthetic import SyntheticCheckpoint

    return SyntheticCheckpoint(spec["preset"], spec["fmt"], experts=spec["experts"], layers=spec["layers"],
                               overrides=spec["overrides"], seed=spec["seed"], device=model.device)


@dataclass
class Entry:
    """One golden file: an op at a layer in a phase."""

    op: str
    layer: int
    phase: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)

    shared: dict[str, str] = field(default_factory=dict)
    joined: dict[str, tuple[str, list[str]]] = field(default_factory=dict)  # name -> ("cat" | "stack", part names)
    tag: str = ""  # which instance, when a layer holds several (mxfp8_linear: the linear's path in the layer)

    def put(self, name: str, t: torch.Tensor, role: str, shared: str | None = None) -> None:
        """Record tensor `name` (a copy: captured activations may be views of buffers the forward reuses);
        `shared`: its key in the layer's weights file (stored once per bundle; packed operands are fresh tensors,
        read from the checkpoint, and are not copied)."""
        t = t.detach()
        self.tensors[name] = (t if shared is not None else t.clone()).contiguous().cpu()
        self.roles[name] = role
        if shared is not None:
            self.shared[name] = shared

    def put_joined(self, name: str, how: str, parts: Sequence[str], role: str = "weight") -> None:
        """Record `name` as the concatenation along axis 0 (`how` "cat") or the stack along a new axis 0 ("stack")
        of the entry's tensors `parts` (stored or themselves joined): the bundle stores no bytes for it, its
        manifest row says how to build it from the stored parts."""
        ts = [self.tensors[p] for p in parts]
        self.tensors[name] = torch.cat(ts) if how == "cat" else torch.stack(ts)
        self.roles[name] = role
        self.joined[name] = (how, list(parts))

    @property
    def file(self) -> str:
        tag = f".{self.tag}" if self.tag else ""
        return f"{self.op}/layer{self.layer:03d}_{self.phase}{tag}.safetensors"


def put_linear(e: Entry, ck: Checkpoint, prefix: str, key: str) -> str:
    """Put linear `prefix`'s packed operands into `e` under `key.*`, stored once per bundle under
    `prefix.*` (the same canonical leaves); returns the linear's format."""
    ops, fmt = linear_operands(ck, prefix, key)
    for name, t in ops.items():
        e.put(name, t, "weight", shared=prefix + name[len(key):])
    return fmt


def put_fused(e: Entry, gate: str, up: str, key: str, fmt: str) -> None:
    """Put the fused gate-up operand `key.*` of `e`'s operands `gate.*`, `up.*` (gate rows then up rows, vLLM's
    `w13_*` layout) as joins of them (`Entry.put_joined`): the bundle stores the separate operands once and the
    fused one as their concatenation (weight, block scales) and stack (NVFP4's global scales, fp32 [2])."""
    for leaf in ("weight", "weight_scale"):
        if f"{gate}.{leaf}" in e.tensors:
            e.put_joined(f"{key}.{leaf}", "cat", [f"{gate}.{leaf}", f"{up}.{leaf}"])
    for leaf in ("weight_scale_2", "input_scale"):
        if fmt == NVFP4 and f"{gate}.{leaf}" in e.tensors:
            e.put_joined(f"{key}.{leaf}", "stack", [f"{gate}.{leaf}", f"{up}.{leaf}"])


def activation_codes(x: torch.Tensor, fmt: str, input_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The quantized GEMM input a W4A4 / W8A8 kernel takes for the activation x (the `emulate` path's x_hat in
    codes): `codes` and `scale` (contract.ACT_CODES_LAYOUT), {} for a bf16 linear."""
    from ..weights.quant import quantize_activation_nvfp4, quantize_mxfp8

    if fmt == NVFP4:
        codes, scale = quantize_activation_nvfp4(x, input_scale if input_scale is not None else 1.0)
    elif fmt == MXFP8:
        codes, scale = quantize_mxfp8(x)
    else:
        return {}
    return {"codes": codes, "scale": scale}


def put_activation_codes(e: Entry, name: str, x: torch.Tensor, fmt: str, input_scale: torch.Tensor | None) -> None:
    """Put `{name}_codes` and `{name}_scale` (`activation_codes`) as inputs of `e`."""
    for part, t in activation_codes(x, fmt, input_scale).items():
        e.put(f"{name}_{part}", t, "input")


def linear_operands(ck: Checkpoint, prefix: str, key: str) -> tuple[dict[str, torch.Tensor], str]:
    """A linear's stored tensors under canonical names `{key}.weight/.weight_scale/.weight_scale_2/
    .input_scale` (global scales in the ModelOpt meaning), and its format."""
    f = ck.formats[prefix]
    out = {f"{key}.weight": ck.read(f.weight)}
    if f.fmt == MXFP8:
        out[f"{key}.weight_scale"] = ck.read(f.scale)
    elif f.fmt == NVFP4:
        g = ck.read_scalar(f.scale_2)
        out[f"{key}.weight_scale"] = ck.read(f.scale)
        out[f"{key}.weight_scale_2"] = 1.0 / g if f.compressed_tensors else g
        out[f"{key}.input_scale"] = ck.input_scale(prefix).reshape(())
    return out, f.fmt


def decode_operand(t: dict[str, torch.Tensor], key: str, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """The weight of packed operand `key` decoded exactly to fp32, then cast to `dtype` (the loader's rule)."""
    from ..weights.quant import dequant_mxfp8, dequant_nvfp4

    if fmt == NVFP4:
        w = dequant_nvfp4(t[f"{key}.weight"], t[f"{key}.weight_scale"], t[f"{key}.weight_scale_2"], name=key)
    elif fmt == MXFP8:
        w = dequant_mxfp8(t[f"{key}.weight"], t[f"{key}.weight_scale"], name=key)
    else:
        w = t[f"{key}.weight"].float()
    return w.to(dtype)


def decode_fused(t: dict[str, torch.Tensor], key: str, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """The fused gate-up weight `key` [2I, K] decoded as `decode_operand` decodes each half (NVFP4: row half j
    with weight_scale_2[j])."""
    if fmt != NVFP4:
        return decode_operand(t, key, fmt, dtype)
    n = t[f"{key}.weight"].shape[0] // 2
    halves = []
    for j, rows in enumerate((slice(0, n), slice(n, 2 * n))):
        half = {f"{key}.weight": t[f"{key}.weight"][rows], f"{key}.weight_scale": t[f"{key}.weight_scale"][rows],
                f"{key}.weight_scale_2": t[f"{key}.weight_scale_2"][j]}
        halves.append(decode_operand(half, key, fmt, dtype))
    return torch.cat(halves)


def quantized_input(x: torch.Tensor, fmt: str, t: dict[str, torch.Tensor], key: str, emulate: bool) -> torch.Tensor:
    """The GEMM input of the linear `key` of format `fmt`: x fake-quantized as W4A4 / W8A8 kernels do with
    `emulate` (`linear.emulate_activation_quant`, NVFP4 with the stored input_scale), else x."""
    from ..model.linear import emulate_activation_quant

    if not emulate or fmt == DENSE:
        return x
    return emulate_activation_quant(x, fmt, t.get(f"{key}.input_scale"))


def grouped_metadata(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_token_ids int32 [T * top_k], expert_offsets int32 [E + 1]) of routing `expert_ids` [T, top_k]: the
    token of each (token, slot) pair grouped by expert ascending, tokens ascending within an expert, and each
    expert's range in it."""
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    return (order // top_k).to(torch.int32), offsets.to(torch.int32)


def align_block_size(expert_ids: torch.Tensor, num_experts: int, block: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's moe_align_block_size of routing `expert_ids` [T, top_k] for blocks of `block` rows: (sorted_token_ids
    int32 [P]: flat pair indices t * top_k + k grouped by expert ascending, ascending within an expert, each group
    padded with T * top_k to a multiple of `block`; expert_ids int32 [P / block]: each block's expert;
    num_tokens_post_padded int32 [1] = P). Experts without pairs take no block."""
    flat = expert_ids.reshape(-1).long()
    pad = flat.numel()
    ids, experts = [], []
    for x_id in range(num_experts):
        pairs = (flat == x_id).nonzero().flatten()
        if not pairs.numel():
            continue
        n = -(-pairs.numel() // block) * block
        ids.append(torch.cat([pairs, torch.full((n - pairs.numel(),), pad, dtype=torch.long)]))
        experts += [x_id] * (n // block)
    sorted_ids = torch.cat(ids).to(torch.int32)
    return sorted_ids, torch.tensor(experts, dtype=torch.int32), torch.tensor([sorted_ids.numel()], dtype=torch.int32)


def routing_metadata(expert_ids: torch.Tensor, weights: torch.Tensor, num_experts: int, used: Sequence[int],
                     align_block: int | None) -> dict[str, torch.Tensor]:
    """The routing of a moe entry as grouped-GEMM kernels take it: `topk_ids` int32, `topk_weights`,
    `sorted_token_ids` / `expert_offsets` (`grouped_metadata`) and, with `align_block`, `align.*`
    (`align_block_size`) whose block experts are given as indices into `used` (the stacked operands' order)."""
    sorted_ids, offsets = grouped_metadata(expert_ids, num_experts)
    out = {"topk_ids": expert_ids.to(torch.int32), "topk_weights": weights, "sorted_token_ids": sorted_ids,
           "expert_offsets": offsets}
    if align_block is not None:
        a_ids, a_experts, a_n = align_block_size(expert_ids, num_experts, align_block)
        local = torch.searchsorted(torch.tensor(list(used)), a_experts.long()).to(torch.int32)
        out.update({"align.sorted_token_ids": a_ids, "align.expert_ids": local, "align.num_tokens_post_padded": a_n})
    return out


def put_stacked(e: Entry, used: Sequence[int]) -> None:
    """Put the stacked operands `w13.*` and `w2.*` of `e`'s experts `used` (index i: expert used[i]), as stacks of
    the per-expert operands (`Entry.put_joined`: no bytes of their own)."""
    for key in ("w13", "w2"):
        for leaf in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            parts = [f"experts.{x}.{key}.{leaf}" for x in used]
            if all(p in e.tensors for p in parts):
                e.put_joined(f"{key}.{leaf}", "stack", parts)


def page_pool(seq_lens: Sequence[int], page: int) -> int:
    """Pages of a paged view of rows `seq_lens`: the rows' pages and one spare page per row (pages no row uses)."""
    return sum(-(-n // page) for n in seq_lens) + len(seq_lens)


def block_table(seq_lens: Sequence[int], page: int, seed: int) -> torch.Tensor:
    """int32 [B, max_pages]: page ids of each row's tokens, -1 past a row's last page. The ids are the first pages
    of a seeded permutation of 0..page_pool-1: neither ascending nor contiguous, and some pages belong to no row."""
    need = [-(-n // page) for n in seq_lens]
    perm = torch.randperm(page_pool(seq_lens, page), generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    table = torch.full((len(seq_lens), max(need)), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start: start + n]
        start += n
    return table


def to_pages(buf: torch.Tensor, table: torch.Tensor, seq_lens: Sequence[int], page: int, seed: int) -> torch.Tensor:
    """Cache storage `buf` [B, S, ...] cut into pages [page_pool, page, ...] by `table`. Every slot that holds no
    row's position (past a row's length, pages no row uses) holds seeded filler, N(0, 4^2) in buf's dtype: finite,
    as a real cache's stale entries, and large enough that a kernel reading it gets a visibly wrong result."""
    P = page_pool(seq_lens, page)
    g = torch.Generator().manual_seed(seed + 7919)
    pages = (torch.randn((P, page, *buf.shape[2:]), generator=g) * 4).to(buf.dtype)
    for b, n in enumerate(seq_lens):
        for j in range(-(-n // page)):
            m = min(page, n - j * page)
            pages[int(table[b, j]), :m] = buf[b, j * page: j * page + m].cpu()
    return pages


def from_pages(pages: torch.Tensor, table: torch.Tensor, seq_lens: Sequence[int], length: int,
               dtype: torch.dtype, kv_scale: float) -> torch.Tensor:
    """Rows rebuilt from pages: [B, length, ...] in `dtype`, zero past each row's length."""
    page = pages.shape[1]
    out = torch.zeros((len(seq_lens), length, *pages.shape[2:]), dtype=dtype)
    for b, n in enumerate(seq_lens):
        for p0 in range(0, min(n, length), page):
            m = min(page, n - p0, length - p0)
            blk = pages[int(table[b, p0 // page]), :m]
            out[b, p0: p0 + m] = (blk.float() * kv_scale).to(dtype) if blk.dtype == torch.float8_e4m3fn else blk
    return out
