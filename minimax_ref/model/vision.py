"""The MiniMax-M3 vision tower and the projector that turns its patches into text-model tokens.

Spec: `model.md`, "Vision tower". The tower is CLIP-style and pre-norm:

    x = patch_embed(pixel_values)            # Conv3d (T, P, P) with stride = kernel, as a matmul
    x = pre_layrnorm(x)
    for each layer:
        x = x + out_proj(attention(rope3d(q), rope3d(k), v))   # q, k, v from layer_norm1(x)
        x = x + fc2(gelu_erf(fc1(layer_norm2(x))))
    (no post-norm)

Attention is bidirectional inside one image and never crosses images. Consecutive images with the
same patch count run as one batched attention (a batch of small images is then a few kernels, not a
few per image); each runs in chunks of query rows, so the score memory is bounded by
`VisionTower.attn_score_budget`, never by the whole batch.

3-D axial RoPE: with `head_dim` channels per head, each of the three axes (frame, row, column) gets
`n = (head_dim // 3) // 2` frequencies `theta^(-2i / (2n))`; the angles `cat(t*f, h*f, w*f)` (3n)
are duplicated to `3 * 2n` channels and applied NeoX style (rotate_half) to the first `6n` channels
of q and k; the remaining channels pass through. For head_dim 80: 13 frequencies per axis, 78
rotated channels, channels 78 and 79 untouched. Patch positions follow the pixel rows, which are in
`spatial_merge_size` x `spatial_merge_size` block-major order.

The projector maps each patch `linear_2(gelu(linear_1(v)))`, concatenates the `merge**2` consecutive
rows of one block and maps `merge_linear_2(gelu(merge_linear_1(.)))`: one token per block.

Numerics (decided here):
* compute dtype = the modules' parameter dtype (float32 or bfloat16); inputs are cast to it and
  outputs are returned in it;
* LayerNorm runs in float32 and its result is cast back to the compute dtype;
* RoPE angles, cos/sin and the rotation itself are float32; rotated q/k are then cast back (the
  transformers oracle rotates in the compute dtype; vLLM rotates in float32 as here);
* attention scores q.k^T and the softmax are float32; probabilities are cast to the compute dtype
  before multiplying V;
* linears and erf-GELU run in the compute dtype.
In float32 everything is float32 and matches the transformers eager implementation to rounding.

Checkpoint names: `VisionTower.state_dict()` keys are the release's names with the prefix
`vision_tower.vision_model.` removed; `Projector.state_dict()` keys are `linear_1/2.*` (the release's
`multi_modal_projector.linear_1/2.*`) and `merge_linear_1/2.*` (the release's
`patch_merge_mlp.linear_1/2.*`). `release_name_to_local` maps one to the other.

Modules hold only parameters (no buffers) and are constructible on the meta device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError
from .config import VisionConfig

VISION_PREFIX = "vision_tower.vision_model."
PROJECTOR_RELEASE_NAMES: dict[str, str] = {
    "multi_modal_projector.linear_1.": "linear_1.",
    "multi_modal_projector.linear_2.": "linear_2.",
    "patch_merge_mlp.linear_1.": "merge_linear_1.",
    "patch_merge_mlp.linear_2.": "merge_linear_2.",
}


def release_name_to_local(name: str) -> tuple[str, str] | None:
    """Map a release tensor name to `("tower", key)` or `("projector", key)`, where `key` is a
    `VisionTower` / `Projector` state_dict key; None for tensors of neither module."""
    if name.startswith(VISION_PREFIX):
        return "tower", name[len(VISION_PREFIX):]
    for prefix, local in PROJECTOR_RELEASE_NAMES.items():
        if name.startswith(prefix):
            return "projector", local + name[len(prefix):]
    return None


# ----------------------------------------------------------------------------------------------
# 3-D axial RoPE


def rope_geometry(head_dim: int) -> tuple[int, int]:
    """`(frequencies per axis, rotated channels)` for a head of `head_dim` channels: (13, 78) for 80."""
    n_freq = (head_dim // 3) // 2
    return n_freq, 6 * n_freq


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """float32 `[n_freq]`: `theta ** (-2i / (2 * n_freq))` for i in [0, n_freq)."""
    n_freq, _ = rope_geometry(head_dim)
    axis_dim = 2 * n_freq
    exponent = torch.arange(0, axis_dim, 2, dtype=torch.float32, device=device) / axis_dim
    return 1.0 / (theta**exponent)


def vision_position_ids(grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """int64 `[sum t*h*w, 3]`: the (frame, row, column) of every patch row, in the order of the
    pixel rows (per image, frame-major, then `merge_size` x `merge_size` blocks in raster order,
    then raster order inside a block)."""
    out = []
    m = merge_size
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
        cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        # block-major: (block_row, block_col, in_block_row, in_block_col)
        rows = rows.permute(0, 2, 1, 3).reshape(-1)
        cols = cols.permute(0, 2, 1, 3).reshape(-1)
        frames = torch.arange(t).repeat_interleave(h * w)
        out.append(torch.stack([frames, rows.repeat(t), cols.repeat(t)], dim=-1))
    if not out:
        return torch.zeros(0, 3, dtype=torch.long)
    return torch.cat(out, dim=0)


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin `[N, rotated]` for `position_ids` `[N, 3]`."""
    inv_freq = rope_inv_freq(head_dim, theta, device=position_ids.device)
    angles = (position_ids.to(torch.float32)[:, :, None] * inv_freq).flatten(1)  # [N, 3*n_freq]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` channels of `x` `[N, heads, head_dim]` (NeoX rotate_half),
    in float32; the other channels pass through. Returns `x`'s dtype."""
    rotated = cos.shape[-1]
    xf = x.to(torch.float32)
    xr, rest = xf[..., :rotated], xf[..., rotated:]
    half = rotated // 2
    turned = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    out = xr * cos[:, None, :] + turned * sin[:, None, :]
    return torch.cat([out, rest], dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# modules


def _layer_norm(x: torch.Tensor, ln: nn.LayerNorm) -> torch.Tensor:
    y = F.layer_norm(x.to(torch.float32), ln.normalized_shape, ln.weight.to(torch.float32),
                     ln.bias.to(torch.float32), ln.eps)
    return y.to(x.dtype)


class PatchEmbedding(nn.Module):
    """Conv3d with kernel = stride = (T, P, P) and no bias, computed as one matmul over pixel rows.

    `weight` `[hidden, C, T, P, P]` is stored in the Conv3d layout, so a row ordered (C, T, y, x)
    dotted with `weight.reshape(hidden, -1)` is exactly the convolution of one patch.
    """

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(
            cfg.hidden_size, cfg.num_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size
        ))
        nn.init.normal_(self.weight, std=cfg.patch_row_size**-0.5)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        w = self.weight.reshape(self.weight.shape[0], -1)
        return pixel_values.to(w.dtype) @ w.t()


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.patch_embedding = PatchEmbedding(cfg)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.patch_embedding(pixel_values)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                bounds: list[int], score_budget: int) -> torch.Tensor:
        n = x.shape[0]
        shape = (n, self.num_heads, self.head_dim)
        q = apply_rope(self.q_proj(x).view(shape), cos, sin)
        k = apply_rope(self.k_proj(x).view(shape), cos, sin)
        v = self.v_proj(x).view(shape)
        out = torch.empty_like(v)
        for start, end, images in equal_length_runs(bounds):
            length = (end - start) // images
            per_call = max(1, score_budget // (self.num_heads * length))  # one query row of each fits the budget
            for first in range(0, images, per_call):
                a, b = start + first * length, start + min(images, first + per_call) * length
                run = ((b - a) // length, length, self.num_heads, self.head_dim)
                out[a:b] = _attend(q[a:b].view(run), k[a:b].view(run), v[a:b].view(run), score_budget).flatten(0, 1)
        return self.out_proj(out.reshape(n, -1))


def equal_length_runs(bounds: list[int]) -> list[tuple[int, int, int]]:
    """`(start, end, images)` for each run of consecutive images of equal length, given the image
    boundaries `bounds` (`[0, end_0, end_1, ...]`): `[0, 4, 8, 10]` -> `[(0, 8, 2), (8, 10, 1)]`."""
    runs: list[tuple[int, int, int]] = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if runs and end - start == (runs[-1][1] - runs[-1][0]) // runs[-1][2]:
            runs[-1] = (runs[-1][0], end, runs[-1][2] + 1)
        else:
            runs.append((start, end, 1))
    return runs


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_budget: int) -> torch.Tensor:
    """Full bidirectional attention within each of S images of equal length; q, k, v
    `[S, L, heads, head_dim]` -> `[S, L, heads, head_dim]`.

    Scores and softmax in float32, probabilities cast to v's dtype before multiplying V. Softmax is per
    query row, so splitting queries into chunks is exact; the chunk is sized so that one float32 score
    tensor holds at most `score_budget` elements.
    """
    images, length, heads, head_dim = q.shape
    scale = head_dim**-0.5
    qh = q.transpose(1, 2).to(torch.float32)  # [S, heads, L, d]
    kt = k.transpose(1, 2).to(torch.float32).transpose(2, 3)  # [S, heads, d, L]
    vh = v.transpose(1, 2)
    out = torch.empty_like(vh)
    chunk = max(1, score_budget // max(1, images * heads * length))
    for s in range(0, length, chunk):
        scores = (qh[:, :, s:s + chunk] @ kt) * scale
        probs = torch.softmax(scores, dim=-1)
        out[:, :, s:s + chunk] = probs.to(v.dtype) @ vh
    return out.transpose(1, 2)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                bounds: list[int], score_budget: int) -> torch.Tensor:
        x = x + self.self_attn(_layer_norm(x, self.layer_norm1), cos, sin, bounds, score_budget)
        return x + self.mlp(_layer_norm(x, self.layer_norm2))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class VisionTower(nn.Module):
    """The vision encoder. See the module docstring for the math and numerics.

    `forward(pixel_values, grid_thw)`:
      pixel_values: `[N, C*T*P*P]` (1176 in the release), any float dtype, rows as produced by
        `minimax_ref.generation.image.ImagePreprocessor` (per image, merge-block-major);
      grid_thw: integer `[n_images, 3]` of (t, h, w) in patches, `sum(t*h*w) == N`, h and w
        multiples of `spatial_merge_size`;
      returns `[N, hidden_size]` in the parameter dtype, rows in the input order.
    """

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError(
                f"hidden_size={cfg.hidden_size} is not a multiple of "
                f"num_attention_heads={cfg.num_attention_heads}"
            )
        self.cfg = cfg
        # Upper bound on the elements of one float32 attention-score tensor (256 MiB).
        self.attn_score_budget = 1 << 26
        self.embeddings = VisionEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = VisionEncoder(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.patch_embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embeddings.patch_embedding.weight.device

    def check_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Validate shapes; returns `grid_thw` as an int64 CPU tensor `[n, 3]`."""
        cfg = self.cfg
        if pixel_values.dim() != 2 or pixel_values.shape[1] != cfg.patch_row_size:
            raise InputError(
                f"pixel_values must have shape [N, {cfg.patch_row_size}], got {list(pixel_values.shape)}"
            )
        grid = torch.as_tensor(grid_thw).to(device="cpu", dtype=torch.long)
        if grid.dim() != 2 or grid.shape[1] != 3:
            raise InputError(f"image_grid_thw must have shape [n, 3], got {list(grid.shape)}")
        m = cfg.spatial_merge_size
        for i, (t, h, w) in enumerate(grid.tolist()):
            if t < 1 or h < 1 or w < 1 or h % m or w % m:
                raise InputError(
                    f"image_grid_thw[{i}] = {[t, h, w]}: entries must be positive and h, w multiples of {m}"
                )
        total = int(grid.prod(dim=1).sum().item()) if len(grid) else 0
        if total != pixel_values.shape[0]:
            raise InputError(
                f"image_grid_thw covers {total} patch rows but pixel_values has {pixel_values.shape[0]}"
            )
        return grid

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        grid = self.check_inputs(pixel_values, grid_thw)
        x = self.embeddings(pixel_values.to(self.device))
        positions = vision_position_ids(grid, cfg.spatial_merge_size).to(self.device)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        # An image (all of its frames) is one attention segment.
        bounds = [0]
        for t, h, w in grid.tolist():
            bounds.append(bounds[-1] + t * h * w)
        x = _layer_norm(x, self.pre_layrnorm)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin, bounds, self.attn_score_budget)
        return x


class Projector(nn.Module):
    """Vision patches -> text-model tokens, one token per `merge` x `merge` block.

    `forward(features)`: `[N, vision_hidden]` (N a multiple of merge**2, rows in block-major order)
    -> `[N / merge**2, text_hidden]` in the parameter dtype. `projector_hidden` (the inner width of
    both MLPs) defaults to `text_hidden`, as in the release (6144).
    """

    def __init__(self, vision_hidden: int, text_hidden: int, merge: int = 2,
                 projector_hidden: int | None = None):
        super().__init__()
        inner = text_hidden if projector_hidden is None else projector_hidden
        self.merge = merge
        self.text_hidden = text_hidden
        self.linear_1 = nn.Linear(vision_hidden, inner)
        self.linear_2 = nn.Linear(inner, text_hidden)
        self.merge_linear_1 = nn.Linear(text_hidden * merge**2, inner)
        self.merge_linear_2 = nn.Linear(inner, text_hidden)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        group = self.merge**2
        if features.dim() != 2 or features.shape[0] % group:
            raise InputError(
                f"projector input must be [N, hidden] with N a multiple of {group}, "
                f"got {list(features.shape)}"
            )
        y = self.linear_2(F.gelu(self.linear_1(features.to(self.linear_1.weight.dtype))))
        y = y.reshape(y.shape[0] // group, group * self.text_hidden)
        return self.merge_linear_2(F.gelu(self.merge_linear_1(y)))


def tokens_per_image(grid_thw: torch.Tensor, merge: int = 2) -> list[int]:
    """Number of merged tokens of each image, in order: t*h*w / merge**2."""
    return [t * h * w // merge**2 for t, h, w in torch.as_tensor(grid_thw).tolist()]


@torch.no_grad()
def encode_images(tower: VisionTower, projector: Projector, pixel_values: torch.Tensor,
                  grid_thw: torch.Tensor) -> torch.Tensor:
    """Image pixel rows -> text-model embeddings `[sum tokens_per_image, text_hidden]` in the
    projector's parameter dtype, images concatenated in order (split with `tokens_per_image`)."""
    return projector(tower(pixel_values, grid_thw))
