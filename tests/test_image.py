"""Image preprocessing: sizes, token counts, the patch layout, config overrides and input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from minimax_ref.errors import ConfigError, InputError
from minimax_ref.generation.image import (
    CLIP_MEAN,
    CLIP_STD,
    ImagePreprocessor,
    load_image,
    num_image_tokens,
    smart_resize,
)


def gradient_image(width: int, height: int) -> Image.Image:
    """A smooth synthetic RGB image (smooth so that resampling filters barely disagree)."""
    x = torch.arange(width, dtype=torch.float32)[None, :] / width
    y = torch.arange(height, dtype=torch.float32)[:, None] / height
    r = 255 * (0.5 + 0.5 * torch.sin(6 * x + 3 * y))
    g = 255 * x * y
    b = 255 * (1 - x) * torch.ones_like(y)
    arr = torch.stack([r, g, b], dim=-1).round().to(torch.uint8)
    return Image.frombytes("RGB", (width, height), bytes(arr.flatten().tolist()))


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.frombytes("RGB", (width, height), bytes(arr.flatten().tolist()))


# ----------------------------------------------------------------------------------------------
# sizes and token counts


@pytest.mark.parametrize(
    ("width", "height", "tokens", "grid"),
    [
        (224, 224, 64, (1, 16, 16)),
        (672, 672, 576, (1, 48, 48)),
        (1024, 768, 540, (1, 40, 54)),
        (1920, 1080, 576, (1, 36, 64)),
        (100, 100, 16, (1, 8, 8)),
    ],
)
def test_token_counts(width: int, height: int, tokens: int, grid: tuple[int, int, int]) -> None:
    pre = ImagePreprocessor()
    pixel_values, grid_thw = pre(Image.new("RGB", (width, height), (30, 60, 90)))
    assert grid_thw.dtype == torch.long and grid_thw.tolist() == [list(grid)]
    assert pixel_values.dtype == torch.float32
    assert pixel_values.shape == (grid[1] * grid[2], 1176)
    assert pre.num_image_tokens(grid_thw) == tokens
    assert num_image_tokens(grid) == tokens
    assert pre.num_tokens_for_size(height, width) == tokens


def test_smart_resize_rules() -> None:
    assert smart_resize(768, 1024) == (560, 756)
    assert smart_resize(1080, 1920) == (504, 896)
    assert smart_resize(100, 100) == (112, 112)  # below min_pixels: scaled up, sides ceiled
    assert smart_resize(56, 84) == (56, 84)  # already aligned: unchanged
    assert smart_resize(10, 1000, min_pixels=1, max_pixels=10**9)[0] == 28  # sides never below 28
    with pytest.raises(InputError, match="aspect ratio"):
        smart_resize(1, 201)
    with pytest.raises(InputError, match="zero size"):
        smart_resize(0, 10)


def test_num_image_tokens_sums_over_images() -> None:
    grids = torch.tensor([[1, 16, 16], [1, 8, 8]])
    assert num_image_tokens(grids) == 64 + 16


# ----------------------------------------------------------------------------------------------
# patch layout


def test_pixel_rows_equal_hand_built_patchify() -> None:
    width, height = 84, 56  # multiples of 28 above min_pixels: no resize happens
    img = noise_image(width, height)
    pixel_values, grid_thw = ImagePreprocessor()(img)
    assert grid_thw.tolist() == [[1, height // 14, width // 14]]

    def norm(c: int, y: int, x: int) -> float:
        return (img.getpixel((x, y))[c] / 255.0 - CLIP_MEAN[c]) / CLIP_STD[c]

    rows = []
    for block_y in range(height // 28):
        for block_x in range(width // 28):
            for in_y in range(2):
                for in_x in range(2):
                    top, left = (block_y * 2 + in_y) * 14, (block_x * 2 + in_x) * 14
                    row = []
                    for c in range(3):
                        for _frame in range(2):  # the still frame, repeated
                            for py in range(14):
                                for px in range(14):
                                    row.append(norm(c, top + py, left + px))
                    rows.append(row)
    expected = torch.tensor(rows, dtype=torch.float64)
    assert pixel_values.shape == expected.shape
    torch.testing.assert_close(pixel_values.double(), expected, rtol=0, atol=1e-5)


def test_several_images_concatenate_in_order() -> None:
    pre = ImagePreprocessor()
    a, b = noise_image(56, 56, seed=1), noise_image(84, 56, seed=2)
    pv, grid = pre([a, b])
    pa, _ = pre(a)
    pb, _ = pre(b)
    assert grid.tolist() == [[1, 4, 4], [1, 4, 6]]
    assert torch.equal(pv, torch.cat([pa, pb]))
    empty_pv, empty_grid = pre([])
    assert empty_pv.shape == (0, 1176) and empty_grid.shape == (0, 3)


def test_exif_orientation_applied_to_files(tmp_path: Path) -> None:
    path = tmp_path / "portrait.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # stored landscape, displayed rotated by 90 degrees
    Image.new("RGB", (84, 56), (10, 20, 30)).save(path, exif=exif)
    assert load_image(path).size == (56, 84)
    _, grid = ImagePreprocessor()(path)
    assert grid.tolist() == [[1, 6, 4]]


def test_transparency_composited_on_white() -> None:
    pv, _ = ImagePreprocessor()(Image.new("RGBA", (56, 56), (255, 0, 0, 0)))
    white = torch.tensor([(1.0 - m) / s for m, s in zip(CLIP_MEAN, CLIP_STD, strict=True)])
    per_channel = pv.view(-1, 3, 2 * 14 * 14)
    torch.testing.assert_close(per_channel[:, :, 0], white.expand(per_channel.shape[0], 3))
    assert load_image(Image.new("L", (5, 5), 7)).mode == "RGB"


# ----------------------------------------------------------------------------------------------
# preprocessor_config.json


def test_overrides_from_preprocessor_config(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "max_pixels": 224 * 224,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": [672, 672],  # list form: never read by the release processor
        "some_unrelated_key": True,
    }))
    pre = ImagePreprocessor.from_pretrained(tmp_path)
    assert pre.max_pixels == 224 * 224 and pre.image_mean == (0.5, 0.5, 0.5)
    pv, grid = pre(Image.new("RGB", (672, 672), (51, 102, 204)))
    assert pre.num_image_tokens(grid) == 64
    expected = torch.tensor([(v / 255 - 0.5) / 0.5 for v in (51, 102, 204)])
    torch.testing.assert_close(pv.view(-1, 3, 2 * 14 * 14)[:, :, 5], expected.expand(64 * 4, 3))


def test_geometry_overrides(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 256, "longest_edge": 100000},
        "patch_size": 16,
        "temporal_patch_size": 1,
        "merge_size": 1,
    }))
    pre = ImagePreprocessor.from_pretrained(tmp_path)
    assert (pre.min_pixels, pre.max_pixels, pre.factor, pre.row_size) == (256, 100000, 16, 768)
    pv, grid = pre(noise_image(64, 48))
    assert grid.tolist() == [[1, 3, 4]] and pv.shape == (12, 768)
    assert pre.num_image_tokens(grid) == 12


def test_defaults_without_preprocessor_config(tmp_path: Path) -> None:
    assert ImagePreprocessor.from_pretrained(tmp_path) == ImagePreprocessor()


def test_bad_preprocessor_config(tmp_path: Path) -> None:
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({"image_std": [0.5, 0.0, 0.5]}))
    with pytest.raises(ConfigError, match="image_std"):
        ImagePreprocessor.from_pretrained(tmp_path)
    path.write_text(json.dumps({"merge_size": "two"}))
    with pytest.raises(ConfigError, match="merge_size"):
        ImagePreprocessor.from_pretrained(tmp_path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="preprocessor_config.json"):
        ImagePreprocessor.from_pretrained(tmp_path)


# ----------------------------------------------------------------------------------------------
# bad input


def test_corrupt_file_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "garbage.png"
    bad.write_bytes(b"this is not an image at all")
    with pytest.raises(InputError, match="garbage.png"):
        ImagePreprocessor()(bad)

    truncated = tmp_path / "truncated.png"
    noise_image(64, 64).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:300])
    with pytest.raises(InputError, match="truncated.png"):
        load_image(str(truncated))


def test_empty_and_missing_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    with pytest.raises(InputError, match="empty.jpg"):
        ImagePreprocessor()([empty])
    with pytest.raises(InputError, match="missing.png"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(InputError, match="zero size"):
        ImagePreprocessor()(Image.new("RGB", (0, 5)))


def test_aspect_ratio_names_the_file(tmp_path: Path) -> None:
    thin = tmp_path / "thin.png"
    Image.new("RGB", (402, 2), (0, 0, 0)).save(thin)
    with pytest.raises(InputError, match=r"thin\.png.*aspect ratio"):
        ImagePreprocessor()(str(thin))


def test_video_is_refused(tmp_path: Path) -> None:
    pre = ImagePreprocessor()
    with pytest.raises(InputError, match="video"):
        pre(tmp_path / "clip.mp4")
    with pytest.raises(InputError, match="video"):
        pre(torch.zeros(4, 3, 28, 28))
    with pytest.raises(InputError, match="video"):
        pre.preprocess_video([Image.new("RGB", (56, 56))])


# ----------------------------------------------------------------------------------------------
# oracle


def test_matches_transformers_image_processor() -> None:
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # missing, or built for another torch: either way no oracle to run
        pytest.skip(f"transformers' MiniMaxM3VLImageProcessor needs a working torchvision ({e})")
    from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import (
        MiniMaxM3VLImageProcessor,
    )

    oracle = MiniMaxM3VLImageProcessor()
    ours = ImagePreprocessor()
    # (84, 56) needs no resize: agreement to float rounding. The others are resized, where
    # pillow's and torchvision's bicubic filters may differ by a level or two of 255.
    for (width, height), max_tol in [((84, 56), 1e-5), ((100, 100), 0.1), ((1024, 768), 0.1)]:
        img = gradient_image(width, height)
        expected = oracle(img, return_tensors="pt")
        pv, grid = ours(img)
        assert torch.equal(grid, expected["image_grid_thw"].long())
        diff = (pv - expected["pixel_values"].float()).abs()
        assert diff.max().item() <= max_tol, (width, height, diff.max().item())
        assert diff.mean().item() <= 1e-3, (width, height, diff.mean().item())
