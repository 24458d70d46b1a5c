"""Prefill attention as block-sparse `flex_attention` (`FastPaths(prefill_attention="flex")`): the same function as
`msa.msa_attention` on MSA layers and `attention.causal_attention` on dense layers, equal to fp32 rounding, computed
by one fused kernel per query chunk that visits only the key blocks a query reads.

Layout. MSA selects key blocks per (query token, kv head); the G = Hq / Hkv query heads of a kv head share the
selection. So the queries are folded as rows `r = t * G + g` of a [B, Hkv, T * G, D] tensor per kv head: a query
block of the BlockMask is rows / G whole tokens (rows = lcm(G, 16) on MSA layers, so with the release's G = 16 one
token, and its block list is exactly that token's selection, no union over neighbours; lcm(G, 128) on dense
layers). The keys stay [B, Hkv, L, D]: no kv head is repeated.

Masks. `mask_mod(b, h, r, n)` is the whole rule: key n at or before the query's position, and (MSA) in a block its kv
head selected for the query (`selected` [B, Hkv, T, nb] bool, from the indexer's top-k ids `blocks`). The BlockMask
(`block_mask`) lists, per query block, the partial key blocks (selected by some of its tokens, or crossing a token's
position: `mask_mod` is applied there) and the full ones (selected by every token and wholly before each: no mask);
its blocks are `block_size` keys, the MSA block. flex's unfused (eager) form ignores the block lists and applies
`mask_mod` everywhere, so both forms compute the same function.

Numerics: queries, keys and values in fp32 (the reference core's dtype), online softmax in fp32 (exp2), fp32 output.
The products, `precision`:
* "ieee" (`prefill_attention="flex"`): fp32 products whatever `torch.backends.cuda.matmul` allows (no TF32), on
  the CUDA cores. Against the reference (one fp32 softmax over the gathered keys) the sums run in another order and
  the kernel's exp2 is the GPU's approximate one: |o - o_ref| of the order of 1e-6 of max |o_ref|
  (tests/test_msa_prefill.py: within 2e-6 on CPU, flex's unfused form, where 3e-7 is seen; 5e-6 on CUDA);
* "tf32x3" (`prefill_attention="flex_tf32x3"`): on the tensor cores, each fp32 operand split into a TF32 part and
  a TF32 remainder and three products summed (Triton's `input_precision="tf32x3"`; the remainders' product is
  dropped): about 2^-21 relative per product instead of 2^-24. Values of bf16 (a bf16 model's queries, keys and
  values) are exact in TF32, so there only the probabilities are split. The test's bound is 2e-5.
The block selection is `fast.attention.select_blocks` (msa.py's rule, the same ids). A fully masked row cannot occur
(a query's own key is always selected).

Memory is linear in the context: queries in chunks (the layer's `chunk_elements` bounds the index scores
[B, Hi, t, L] of a selection chunk and the selection [B, Hkv, t, nb] of a kernel call), keys and values converted to
fp32 once per call ([B, Hkv, L, D]); the kernel keeps scores in registers (no [Q, K] tensor).

`FlexPrefill` owns the compiled `flex_attention` (one per model, handed to the attention twins by `fast.apply`); it
handles CUDA tensors (on other devices the twin keeps its gathering path, see `FlexPrefill`).
"""

from __future__ import annotations

import math
import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .attention import select_blocks

# Query rows per BlockMask block are a multiple of these: 16 (the smallest Triton tile) on MSA layers, so that a
# block is one token when G = 16 and its key blocks are exactly the token's selection; 128 on dense layers, where
# neighbouring tokens read nearly the same keys.
MSA_ROWS = 16
DENSE_ROWS = 128
# Key block of dense layers (their mask is only causal; any size works).
DENSE_BLOCK = 128


def fold(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """q [B, T, Hq, D] as fp32 rows [B, Hkv, T * G, D], row t * G + g = query head kv * G + g of token t."""
    B, T, Hq, D = q.shape
    G = Hq // n_kv
    return q.float().view(B, T, n_kv, G, D).permute(0, 2, 1, 3, 4).reshape(B, n_kv, T * G, D)


def unfold(o: torch.Tensor, T: int) -> torch.Tensor:
    """`fold`'s inverse: [B, Hkv, T * G, D] -> [B, T, Hkv * G, D]."""
    B, Hkv, _, D = o.shape
    return o.view(B, Hkv, T, -1, D).permute(0, 2, 1, 3, 4).reshape(B, T, -1, D)


def selected(blocks: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """Block ids [B, H, T, kb] (-1 = empty slot) as a bool [B, H, T, n_blocks]: block j selected."""
    sel = torch.zeros(*blocks.shape[:-1], n_blocks + 1, dtype=torch.bool, device=blocks.device)
    sel.scatter_(-1, torch.where(blocks < 0, n_blocks, blocks), True)  # empty slots land in a dropped column
    return sel[..., :n_blocks]


def causal_blocks(q_pos: torch.Tensor, n_blocks: int, block_size: int) -> torch.Tensor:
    """Dense causal attention as a selection [B, 1, T, n_blocks]: every block at or before the query's."""
    j = torch.arange(n_blocks, device=q_pos.device)
    return j <= (q_pos // block_size)[:, None, :, None]


def _packed(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [..., nb] bool as BlockMask lists: (count [...] int32, ids [..., nb] int32, the True ids first)."""
    nb = mask.shape[-1]
    slot = torch.where(mask, mask.cumsum(-1, dtype=torch.int32) - 1, nb)  # a False id goes to a dropped slot
    ids = torch.zeros(*mask.shape[:-1], nb + 1, dtype=torch.int32, device=mask.device)
    ids.scatter_(-1, slot.long(), torch.arange(nb, dtype=torch.int32, device=mask.device).expand_as(slot))
    return mask.sum(-1, dtype=torch.int32), ids[..., :nb]


def block_mask(sel: torch.Tensor, q_pos: torch.Tensor, kv_len: int, block_size: int, group: int, rows: int,
               mask_mod) -> BlockMask:
    """The BlockMask of folded queries (`fold`; T tokens, a multiple of rows / group) over kv_len keys.

    sel [B, H, T, nb] (H = kv heads, or 1 for all): the blocks each token may read; q_pos [B, T]. A key block is
    listed for a query block if some token selects it; full (no `mask_mod`) if every token selects it and each
    token's position is at or past its last key; partial (`mask_mod` applied) otherwise."""
    B, H, T, nb = sel.shape
    per = rows // group  # tokens per query block
    last_key = torch.arange(nb, device=sel.device) * block_size + block_size - 1
    whole = sel & (last_key <= q_pos[:, None, :, None])  # every key of the block is causal for the token
    any_ = sel.view(B, H, T // per, per, nb).any(3)
    full = whole.view(B, H, T // per, per, nb).all(3)
    num, ids = _packed(any_ & ~full)
    full_num, full_ids = _packed(full)
    return BlockMask.from_kv_blocks(num, ids, full_num, full_ids, BLOCK_SIZE=(rows, block_size), mask_mod=mask_mod,
                                    seq_lengths=(T * group, kv_len),
                                    compute_q_blocks=torch.is_grad_enabled())  # the q lists serve backward only


def _padded(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """x with its last entry along `dim` repeated up to a multiple of `multiple` entries (padded tokens copy the last
    token: they compute a discarded row, and change neither the union nor the full blocks of their query block)."""
    pad = -x.shape[dim] % multiple
    if not pad:
        return x
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    return torch.cat([x, last.expand(*x.shape[:dim], pad, *x.shape[dim + 1:])], dim=dim)


def _unfused(*args, **kwargs) -> torch.Tensor:
    """flex's unfused form, without its warning that it is not the fused kernel (asked for here, in tests)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


class FlexPrefill:
    """The prefill attention cores through `flex_attention`, owned by this object (one per model, `fast.apply`).

    On CUDA, flex compiled on first use (Triton; dynamic shapes: one graph per kind of layer and geometry, whatever
    the prompt and chunk lengths). Other devices are not `handled` (the attention twin keeps its gathering path:
    torch 2.13's C++ flex template fails to build these masks, and flex's unfused form materialises [Q, K] scores),
    unless `unfused_on_cpu` (tests): then the CPU runs flex's unfused form, which applies `mask_mod` to every score."""

    PRECISIONS = ("ieee", "tf32x3")

    def __init__(self, unfused_on_cpu: bool = False) -> None:
        self.unfused_on_cpu = unfused_on_cpu
        self._compiled = None

    def handles(self, device: torch.device) -> bool:
        return device.type == "cuda" or (device.type == "cpu" and self.unfused_on_cpu)

    def flex(self, device: torch.device):
        if device.type != "cuda":
            return _unfused
        if self._compiled is None:
            # one graph per kind of layer (dense, MSA), precision, batch of one or more and geometry; past the limit
            # dynamo would fall back to the unfused form, whose [Q, K] scores do not fit long prompts
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self._compiled = torch.compile(flex_attention, dynamic=True)
        return self._compiled

    @staticmethod
    def kernel_options(rows: int, block_size: int, precision: str) -> dict:
        """The products' `precision` whatever `torch.backends.cuda.matmul` allows; Triton tiles that divide the
        BlockMask's blocks (query tiles of at most 32 rows: fp32 tiles of 128-channel heads fill shared memory)."""
        if precision not in FlexPrefill.PRECISIONS:
            raise ValueError(f"flex prefill: precision {precision!r}: choose one of {list(FlexPrefill.PRECISIONS)}")
        options = {"FLOAT32_PRECISION": f"'{precision}'", "BLOCK_M": math.gcd(rows, 32)}
        if block_size % 64:
            options["BLOCK_N"] = math.gcd(block_size, 64)
        return options

    def attend(self, q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, q_pos: torch.Tensor, sel: torch.Tensor,
               block_size: int, rows: int, scale: float, exact: bool, precision: str = "ieee") -> torch.Tensor:
        """One query chunk: q [B, t, Hq, D] over fp32 kf, vf [B, Hkv, L, D]; sel [B, H, t, nb] the blocks each token
        reads (`exact`: mask_mod checks the selection too; else it is only causal, sel being every causal block).
        Returns fp32 [B, t, Hq, D]."""
        B, T, Hq, _ = q.shape
        Hkv, L = kf.shape[1], kf.shape[2]
        G = Hq // Hkv
        per = rows // G
        qf = fold(_padded(q, 1, per), Hkv)
        pos = _padded(q_pos, 1, per)
        sel = _padded(sel, 2, per)

        if exact:
            def mask_mod(b, h, r, n):
                t = r // G
                return (n <= pos[b, t]) & sel[b, h, t, n // block_size]
        else:
            def mask_mod(b, h, r, n):
                return n <= pos[b, r // G]

        mask = block_mask(sel, pos, L, block_size, G, rows, mask_mod)
        options = self.kernel_options(rows, block_size, precision) if q.is_cuda else None
        o = self.flex(q.device)(qf, kf, vf, block_mask=mask, scale=scale, kernel_options=options)
        return unfold(o, pos.shape[1])[:, :T]

    def msa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor,
            q_pos: torch.Tensor, scale: float, block_size: int, topk_blocks: int, local_blocks: int,
            init_blocks: int, chunk_elements: int, precision: str = "ieee") -> tuple[torch.Tensor, torch.Tensor]:
        """`msa.msa_attention`: q [B, T, Hq, D], iq [B, T, Hi, Di] against k, v [B, L, Hkv, D], ik [B, L, Di].
        Returns (fp32 [B, T, Hq, D], blocks [B, Hi, T, kb], msa's ids)."""
        B, T, Hq, _ = q.shape
        L, Hkv = k.shape[1], k.shape[2]
        nb = -(-L // block_size)
        rows = math.lcm(Hq // Hkv, MSA_ROWS)
        kf, vf = (x.float().transpose(1, 2).contiguous() for x in (k, v))
        # two chunkings, each bounding its temporaries by chunk_elements: the index scores [B, Hi, t, L] of a
        # selection chunk, and the selection [B, Hkv, t, nb] (and block lists) of a kernel call, which is much smaller
        # per query, so a call spans several selection chunks (fewer, larger kernel launches at long contexts)
        select_chunk = max(1, chunk_elements // (B * iq.shape[2] * L))
        chunk = max(select_chunk, chunk_elements // (B * Hkv * nb)) // select_chunk * select_chunk
        outs, sels = [], []
        for s0 in range(0, T, chunk):
            blocks = torch.cat([select_blocks(iq[:, s1:s1 + select_chunk], ik, q_pos[:, s1:s1 + select_chunk],
                                              block_size, topk_blocks, local_blocks, init_blocks)
                                for s1 in range(s0, min(T, s0 + chunk), select_chunk)], dim=2)
            sl = slice(s0, s0 + chunk)
            outs.append(self.attend(q[:, sl], kf, vf, q_pos[:, sl], selected(blocks, nb), block_size, rows, scale,
                                    exact=True, precision=precision))
            sels.append(blocks)
        return torch.cat(outs, dim=1), torch.cat(sels, dim=2)

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
               chunk_elements: int, precision: str = "ieee") -> torch.Tensor:
        """`attention.causal_attention`: q [B, T, Hq, D] against k, v [B, L, Hkv, D]; fp32 [B, T, Hq, D]."""
        B, T, Hq, _ = q.shape
        L, Hkv = k.shape[1], k.shape[2]
        nb = -(-L // DENSE_BLOCK)
        rows = math.lcm(Hq // Hkv, DENSE_ROWS)
        kf, vf = (x.float().transpose(1, 2).contiguous() for x in (k, v))
        chunk = max(1, chunk_elements // (B * nb))
        outs = []
        for s0 in range(0, T, chunk):
            sl = slice(s0, s0 + chunk)
            sel = causal_blocks(q_pos[:, sl], nb, DENSE_BLOCK)
            outs.append(self.attend(q[:, sl], kf, vf, q_pos[:, sl], sel, DENSE_BLOCK, rows, scale, exact=False,
                                    precision=precision))
        return torch.cat(outs, dim=1)

