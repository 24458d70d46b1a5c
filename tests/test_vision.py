"""Vision tower and projector: release names, RoPE geometry, image isolation, and agreement with the
transformers implementation (MiniMaxM3VLVisionModel / MiniMaxM3VLMultiModalProjector) in fp32."""

from __future__ import annotations

import math

import pytest
import torch
from oracle import release_to_transformers
from PIL import Image

from minimax_ref.errors import InputError
from minimax_ref.generation.image import ImagePreprocessor
from minimax_ref.model.config import VisionConfig
from minimax_ref.model.vision import (
    VISION_PREFIX,
    Projector,
    VisionTower,
    apply_rope,
    encode_images,
    equal_length_runs,
    release_name_to_local,
    rope_cos_sin,
    rope_geometry,
    tokens_per_image,
    vision_position_ids,
)

TEXT_HIDDEN = 48
PROJ_HIDDEN = 40

# (hidden, heads, layers, intermediate): 4 heads of 16, and 2 heads of the release's head_dim 80.
SMALL_CONFIGS = [(64, 4, 2, 128), (160, 2, 1, 96)]


def small_cfg(hidden: int, heads: int, layers: int, inter: int) -> VisionConfig:
    return VisionConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                        num_attention_heads=heads)


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Non-degenerate weights: LayerNorm weights near 1, nonzero biases, fan-in scaled matrices."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / math.sqrt(p[0].numel()))


def build(cfg: VisionConfig, seed: int = 0) -> tuple[VisionTower, Projector]:
    tower = VisionTower(cfg)
    projector = Projector(cfg.hidden_size, TEXT_HIDDEN, cfg.spatial_merge_size, projector_hidden=PROJ_HIDDEN)
    randomize(tower, seed)
    randomize(projector, seed + 1)
    return tower.eval(), projector.eval()


def synthetic_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Two preprocessed images of different grids: (1, 4, 6) and (1, 4, 4)."""
    gen = torch.Generator().manual_seed(7)
    images = []
    for width, height in [(84, 56), (56, 56)]:
        arr = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
        images.append(Image.frombytes("RGB", (width, height), bytes(arr.flatten().tolist())))
    return ImagePreprocessor()(images)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# ----------------------------------------------------------------------------------------------
# oracle


def transformers_models(cfg: VisionConfig):
    from transformers import MiniMaxM3VLConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
        MiniMaxM3VLMultiModalProjector,
        MiniMaxM3VLVisionModel,
    )

    hf_cfg = MiniMaxM3VLConfig(
        vision_config=dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                           num_hidden_layers=cfg.num_hidden_layers,
                           num_attention_heads=cfg.num_attention_heads),
        text_config=dict(hidden_size=TEXT_HIDDEN, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=24, vocab_size=64, bos_token_id=0,
                         eos_token_id=1),
        projector_hidden_size=PROJ_HIDDEN,
    )
    hf_cfg.vision_config._attn_implementation = "eager"
    return (MiniMaxM3VLVisionModel(hf_cfg.vision_config).eval().float(),
            MiniMaxM3VLMultiModalProjector(hf_cfg).eval().float())




def local_to_release(module: str, key: str) -> str:
    if module == "tower":
        return VISION_PREFIX + key
    head, leaf = key.rsplit(".", 1)
    release = {"linear_1": "multi_modal_projector.linear_1", "linear_2": "multi_modal_projector.linear_2",
               "merge_linear_1": "patch_merge_mlp.linear_1", "merge_linear_2": "patch_merge_mlp.linear_2"}
    return f"{release[head]}.{leaf}"


@pytest.mark.parametrize("dims", SMALL_CONFIGS)
def test_matches_transformers_fp32(dims: tuple[int, int, int, int]) -> None:
    cfg = small_cfg(*dims)
    tower, projector = build(cfg)
    hf_tower, hf_projector = transformers_models(cfg)
    pairs = [("tower", tower, hf_tower, "model.vision_tower."),
             ("projector", projector, hf_projector, "model.multi_modal_projector.")]
    for module, ours, theirs, prefix in pairs:
        mapped = {}
        for key, value in ours.state_dict().items():
            release = local_to_release(module, key)
            assert release_name_to_local(release) == (module, key)
            hf_name = release_to_transformers(release)
            assert hf_name.startswith(prefix), hf_name
            mapped[hf_name[len(prefix):]] = value
        theirs.load_state_dict(mapped, strict=True)

    pixel_values, grid = synthetic_inputs()
    with torch.no_grad():
        expected = hf_tower(pixel_values, grid).last_hidden_state.squeeze(0)
        expected_tokens = hf_projector(expected)
    features = tower(pixel_values, grid)
    tokens = encode_images(tower, projector, pixel_values, grid)
    assert features.shape == (40, cfg.hidden_size) and features.dtype == torch.float32
    assert tokens.shape == (10, TEXT_HIDDEN) and tokens_per_image(grid) == [6, 4]
    assert rel_err(features, expected) < 1e-4
    assert rel_err(tokens, expected_tokens) < 1e-4


# ----------------------------------------------------------------------------------------------
# structure


def test_images_do_not_attend_to_each_other() -> None:
    tower, _ = build(small_cfg(*SMALL_CONFIGS[0]))
    pixel_values, grid = synthetic_inputs()
    n_a = int(grid[0].prod())
    perturbed = pixel_values.clone()
    perturbed[n_a:] += torch.randn(perturbed[n_a:].shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before, after = tower(pixel_values, grid), tower(perturbed, grid)
        alone = tower(pixel_values[:n_a], grid[:1])
    torch.testing.assert_close(after[:n_a], before[:n_a], rtol=0, atol=1e-6)
    torch.testing.assert_close(alone, before[:n_a], rtol=1e-6, atol=1e-6)
    assert (after[n_a:] - before[n_a:]).abs().max() > 1e-2


def test_query_chunking_is_exact() -> None:
    tower, _ = build(small_cfg(*SMALL_CONFIGS[0]))
    pixel_values, grid = synthetic_inputs()
    with torch.no_grad():
        whole = tower(pixel_values, grid)
        tower.attn_score_budget = 4 * 24 * 5  # five query rows per chunk
        chunked = tower(pixel_values, grid)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


def test_equal_length_runs_by_hand() -> None:
    assert equal_length_runs([0]) == []
    assert equal_length_runs([0, 4, 8, 10]) == [(0, 8, 2), (8, 10, 1)]
    assert equal_length_runs([0, 3, 5, 7, 9, 12]) == [(0, 3, 1), (3, 9, 3), (9, 12, 1)]
    assert equal_length_runs([0, 6, 12, 18]) == [(0, 18, 3)]


def test_equal_length_images_batched_are_each_image_alone() -> None:
    """Images of equal patch count run as one batched attention: each image's output is what it gives
    alone, and a small score budget (a run split into several calls, one query row each) changes nothing."""
    tower, _ = build(small_cfg(*SMALL_CONFIGS[0]))
    gen = torch.Generator().manual_seed(11)
    images = []
    for width, height in [(56, 56), (56, 56), (84, 56), (56, 56), (56, 56), (56, 56)]:
        arr = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
        images.append(Image.frombytes("RGB", (width, height), bytes(arr.flatten().tolist())))
    pixel_values, grid = ImagePreprocessor()(images)
    counts = [int(g.prod()) for g in grid]
    with torch.no_grad():
        together = tower(pixel_values, grid)
        alone = torch.cat([tower(pv, grid[i:i + 1]) for i, pv in enumerate(pixel_values.split(counts))])
        tower.attn_score_budget = 4 * 16  # heads * length: one image, one query row per call
        tight = tower(pixel_values, grid)
    torch.testing.assert_close(together, alone, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tight, alone, rtol=1e-5, atol=1e-5)  # other matmul shapes: fp32 rounding


def test_release_state_dict_keys_and_shapes_on_meta() -> None:
    with torch.device("meta"):
        tower = VisionTower(VisionConfig())
        projector = Projector(1280, 6144)
    shapes = {k: tuple(v.shape) for k, v in tower.state_dict().items()}
    expected = {"embeddings.patch_embedding.weight": (1280, 3, 2, 14, 14),
                "pre_layrnorm.weight": (1280,), "pre_layrnorm.bias": (1280,)}
    for i in range(32):
        p = f"encoder.layers.{i}."
        for ln in ("layer_norm1", "layer_norm2"):
            expected[p + ln + ".weight"] = expected[p + ln + ".bias"] = (1280,)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            expected[p + f"self_attn.{proj}.weight"] = (1280, 1280)
            expected[p + f"self_attn.{proj}.bias"] = (1280,)
        expected.update({p + "mlp.fc1.weight": (5120, 1280), p + "mlp.fc1.bias": (5120,),
                         p + "mlp.fc2.weight": (1280, 5120), p + "mlp.fc2.bias": (1280,)})
    assert shapes == expected
    assert {k: tuple(v.shape) for k, v in projector.state_dict().items()} == {
        "linear_1.weight": (6144, 1280), "linear_1.bias": (6144,),
        "linear_2.weight": (6144, 6144), "linear_2.bias": (6144,),
        "merge_linear_1.weight": (6144, 24576), "merge_linear_1.bias": (6144,),
        "merge_linear_2.weight": (6144, 6144), "merge_linear_2.bias": (6144,),
    }
    assert not list(tower.buffers()) and not list(projector.buffers())
    assert release_name_to_local("patch_merge_mlp.linear_2.bias") == ("projector", "merge_linear_2.bias")
    assert release_name_to_local("vision_tower.vision_model.pre_layrnorm.weight") == (
        "tower", "pre_layrnorm.weight")
    assert release_name_to_local("language_model.model.norm.weight") is None


def test_position_ids_are_block_major() -> None:
    pos = vision_position_ids(torch.tensor([[1, 2, 4], [1, 2, 2]]), merge_size=2)
    assert pos.tolist() == [
        [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1],  # first 2x2 block
        [0, 0, 2], [0, 0, 3], [0, 1, 2], [0, 1, 3],  # second block
        [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1],  # second image starts over
    ]


def test_rope_head_dim_80_by_hand() -> None:
    head_dim, theta = 80, 10000.0
    assert rope_geometry(head_dim) == (13, 78)
    assert rope_geometry(16) == (2, 12)
    positions = torch.tensor([[0, 3, 5], [1, 7, 2]])
    x = torch.randn(2, 3, head_dim, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    cos, sin = rope_cos_sin(positions, head_dim, theta)
    assert cos.shape == (2, 78) and cos.dtype == torch.float32
    out = apply_rope(x.float(), cos, sin).double()

    expected = x.clone()
    for n in range(2):
        for head in range(3):
            for axis in range(3):
                for i in range(13):
                    angle = positions[n, axis].item() * theta ** (-2 * i / 26)
                    lo, hi = axis * 13 + i, 39 + axis * 13 + i  # the pair rotate_half couples
                    a, b = x[n, head, lo].item(), x[n, head, hi].item()
                    expected[n, head, lo] = a * math.cos(angle) - b * math.sin(angle)
                    expected[n, head, hi] = b * math.cos(angle) + a * math.sin(angle)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    assert torch.equal(out[..., 78:], x[..., 78:].float().double())


def test_bf16_compute_dtype() -> None:
    cfg = small_cfg(*SMALL_CONFIGS[0])
    tower, projector = build(cfg)
    pixel_values, grid = synthetic_inputs()
    reference = encode_images(tower, projector, pixel_values, grid)
    tokens = encode_images(tower.to(torch.bfloat16), projector.to(torch.bfloat16), pixel_values, grid)
    assert tokens.dtype == torch.bfloat16
    assert rel_err(tokens.float(), reference) < 5e-2


def test_bad_inputs() -> None:
    tower, projector = build(small_cfg(*SMALL_CONFIGS[0]))
    pixel_values, grid = synthetic_inputs()
    with pytest.raises(InputError, match="patch rows"):
        tower(pixel_values[:-4], grid)
    with pytest.raises(InputError, match="multiples of 2"):
        tower(pixel_values, torch.tensor([[1, 5, 8]]))
    with pytest.raises(InputError, match="1176"):
        tower(pixel_values[:, :100], grid)
    with pytest.raises(InputError, match="multiple of 4"):
        projector(torch.zeros(6, 64))
