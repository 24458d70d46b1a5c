"""Attention of the text model: per-head Gemma q/k norm, partial NeoX RoPE, GQA, and on sparse
layers the MSA lightning indexer (msa.py).

Numerics (decided here): projections run in the compute dtype; q/k norms and RoPE in fp32 (cast
back); the attention core (scores, fp32 softmax, value sum) in fp32; the output is cast to the
compute dtype before `o_proj`. Dense layers process queries in chunks too, so no layer allocates an
S x S matrix.

Tensor parallelism (parallel.py): a rank holds a contiguous run of query heads and the kv heads they
read (with more ranks than kv heads, one kv head replicated over several ranks), the index heads of
those kv heads, and the whole index key projection (one shared key head). Attention and MSA block
selection run on the local heads only; `o_proj` holds the local heads' input columns and its fp32
all-reduce is the block's one collective.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from .cache import LayerCache
from .config import TextConfig
from .linear import Linear
from .msa import CHUNK_ELEMENTS, BlockSelection, BlockSparseAttention, query_chunk
from .norm import RMSNorm
from .parallel import ColumnParallelLinear, RowParallelLinear, World
from .rope import apply_rope


def gqa_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, chunk_elements: int
               ) -> tuple[torch.Tensor, torch.Tensor, Iterator[tuple[torch.Tensor, torch.Tensor]]]:
    """The layout of the dense attention cores: q [B, T, Hq, D] against k, v [B, L, Hkv, D] (slot = position) as
    fp32 keys and values [B, Hkv, L, D] and the queries in chunks of at most `chunk_elements` scores, each chunk as
    (qg fp32 [B, Hkv, G, t, D]: query head h = kv head h // G, group member h % G; future bool [B, 1, 1, t, L]: keys
    at positions > q_pos [B, T]). `merge_heads` turns a chunk's output back into [B, t, Hq, D]."""
    B, T, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    kf = k.float().permute(0, 2, 1, 3)
    vf = v.float().permute(0, 2, 1, 3)
    k_pos = torch.arange(L, device=q.device)
    chunk = max(1, chunk_elements // (B * Hq * L))

    def chunks() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for s0 in range(0, T, chunk):
            sl = slice(s0, s0 + chunk)
            qc = q[:, sl].float()
            qg = qc.view(B, qc.shape[1], Hkv, Hq // Hkv, D).permute(0, 2, 3, 1, 4)
            yield qg, k_pos[None, None, None, None, :] > q_pos[:, None, None, sl, None]

    return kf, vf, chunks()


def merge_heads(o: torch.Tensor) -> torch.Tensor:
    """A chunk's output [B, Hkv, G, t, D] as [B, t, Hkv * G, D] (`gqa_chunks`' head order)."""
    B, Hkv, G, t, D = o.shape
    return o.permute(0, 3, 1, 2, 4).reshape(B, t, Hkv * G, D)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                     chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Dense causal GQA: q [B, T, Hq, D] against k, v [B, L, Hkv, D] (slot = position).

    Query head h reads kv head h // (Hq / Hkv). Keys at positions > q_pos [B, T] are masked.
    fp32 scores / softmax / sum; returns fp32 [B, T, Hq, D]. Queries in chunks of at most
    `chunk_elements` scores.
    """
    kf, vf, chunks = gqa_chunks(q, k, v, q_pos, chunk_elements)
    outs = []
    for qg, future in chunks:
        s = torch.einsum("bhgtd,bhld->bhgtl", qg, kf) * scale
        p = torch.softmax(s.masked_fill(future, float("-inf")), dim=-1)
        outs.append(merge_heads(torch.einsum("bhgtl,bhld->bhgtd", p, vf)))
    return torch.cat(outs, dim=1)


class CausalAttention(nn.Module):
    """The dense layers' attention core (`causal_attention`) as a module without parameters, so that what reads its
    operands attaches to it from outside (`research.trace`)."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                chunk_elements: int) -> torch.Tensor:
        return causal_attention(q, k, v, q_pos, self.scale, chunk_elements)


def _head_rows(heads: range, head_dim: int) -> slice:
    """Rows of a [heads * head_dim, in] projection that belong to the heads `heads`."""
    return slice(heads.start * head_dim, heads.stop * head_dim)


class Attention(nn.Module):
    """`self_attn` of one layer. Module and parameter names are the release's.

    n_heads / n_kv_heads: the model's head counts (default: the config's); `self.n_heads` and
    `self.n_kv` are the heads this rank holds. chunk_elements: bound on the largest attention temporary.
    """

    def __init__(self, cfg: TextConfig, layer: int, n_heads: int | None = None, n_kv_heads: int | None = None,
                 world: World | None = None, chunk_elements: int = CHUNK_ELEMENTS):
        super().__init__()
        world = world or World.single()
        self.layer = layer
        total_heads = cfg.num_attention_heads if n_heads is None else n_heads
        total_kv = cfg.num_key_value_heads if n_kv_heads is None else n_kv_heads
        q_part = world.split(total_heads, "num_attention_heads")
        q_heads = range(q_part.start, q_part.stop)
        kv_heads = world.kv_heads(total_kv)
        group = total_heads // total_kv  # query head h reads kv head h // group
        # invariant of the even splits: the local query heads read exactly the local kv heads
        assert range(q_heads.start // group, (q_heads.stop - 1) // group + 1) == kv_heads
        self.n_heads, self.n_kv = len(q_heads), len(kv_heads)
        self.head_dim = D = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.chunk_elements = chunk_elements  # bound on the largest attention temporary (elements)
        H = cfg.hidden_size
        self.q_proj = ColumnParallelLinear(H, _head_rows(q_heads, D))
        self.k_proj = ColumnParallelLinear(H, _head_rows(kv_heads, D))
        self.v_proj = ColumnParallelLinear(H, _head_rows(kv_heads, D))
        self.o_proj = RowParallelLinear(H, _head_rows(q_heads, D), world)  # all-reduces over the ranks' heads
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.sparse = cfg.sparse_layers[layer]
        if self.sparse:
            sp = cfg.sparse
            self.geometry = sp
            self.index_dim = sp.index_head_dim
            # one index head per kv head (index head h selects blocks for kv head h): they split alike
            self.index_q_proj = ColumnParallelLinear(H, _head_rows(kv_heads, sp.index_head_dim))
            self.index_k_proj = Linear(H, sp.index_head_dim)  # replicated: one key head for all index heads
            self.index_q_norm = RMSNorm(sp.index_head_dim, cfg.rms_norm_eps)
            self.index_k_norm = RMSNorm(sp.index_head_dim, cfg.rms_norm_eps)
            self.selection = BlockSelection(sp)
            self.core = BlockSparseAttention(self.scale, sp.block_size)
        else:
            self.core = CausalAttention(self.scale)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None, kv_len: int | None = None) -> torch.Tensor:
        """x [B, T, H] at absolute positions pos [B, T]; cos/sin [B, T, rotary_dim] fp32.

        Without a cache, pos must be 0..T-1 (keys are this call's tokens). With a cache (this layer's part,
        `KVCache.layer`), this call's K/V are written at `pos` and the keys are slots [0, kv_len); kv_len defaults
        to max(pos) + 1 (which reads pos on the host: the model passes it once for all layers). On MSA layers the
        indexer's block selection and the attention over those blocks run in the same query chunks
        (`msa.query_chunk`).
        """
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        iq, ik = self.index_qk(x, cos, sin) if self.sparse else (None, None)
        if cache is not None:
            length = kv_len if kv_len is not None else int(pos.max()) + 1
            cache.write(k, v, pos)
            k, v = cache.keys_values(length)
            if self.sparse:
                cache.write_index(ik, pos)
                ik = cache.index_keys(length)
        if self.sparse:
            sp = self.geometry
            chunk = query_chunk(q, k, iq, sp.block_size, sp.topk_blocks, self.chunk_elements)
            o = self.core(q, k, v, pos, self.selection(iq, ik, pos, chunk), chunk)
        else:
            o = self.core(q, k, v, pos, self.chunk_elements)
        # row-parallel o_proj: this rank's heads' contribution, summed over the ranks (fp32 all-reduce)
        return self.o_proj(o.to(x.dtype).reshape(B, T, -1))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries [B, T, heads, D] and keys [B, T, kv_heads, D] after q/k norm and RoPE, values [B, T, kv_heads, D]."""
        return self.heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin)

    def heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`qkv` from the projections q [B, T, heads * D], k and v [B, T, kv_heads * D]."""
        B, T, _ = q.shape
        q = apply_rope(self.q_norm(q.view(B, T, self.n_heads, self.head_dim)), cos, sin)
        k = apply_rope(self.k_norm(k.view(B, T, self.n_kv, self.head_dim)), cos, sin)
        return q, k, v.view(B, T, self.n_kv, self.head_dim)

    def index_qk(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The lightning indexer's queries [B, T, kv_heads, Di] and key [B, T, Di], after norm and RoPE."""
        return self.index_heads(self.index_q_proj(x), self.index_k_proj(x), cos, sin)

    def index_heads(self, iq: torch.Tensor, ik: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`index_qk` from the projections iq [B, T, kv_heads * Di] and ik [B, T, Di]."""
        B, T, _ = iq.shape
        iq = self.index_q_norm(iq.view(B, T, self.n_kv, self.index_dim))
        ik = self.index_k_norm(ik.view(B, T, 1, self.index_dim))
        return apply_rope(iq, cos, sin), apply_rope(ik, cos, sin)[:, :, 0]
