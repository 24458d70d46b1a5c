"""Image preprocessing for the MiniMax-M3 vision tower (spec `model.md`, "Image preprocessing").

Pipeline for each still image:

1. Load and convert to RGB. Transparency is composited onto white, as the transformers oracle does
   (decided here: the release processor's behaviour on alpha is not documented). Files are turned
   upright by their EXIF orientation tag, as transformers' `load_image` does; images passed in
   already open are taken as they are.
2. Resize with pillow's bicubic filter to `smart_resize(H, W)`: both sides multiples of
   `patch_size * merge_size` (28) and the area kept within `[min_pixels, max_pixels]`. The oracle
   resizes with torchvision, whose bicubic kernel differs slightly from pillow's, so pixel values
   agree with it only to a tolerance; images already at the target size agree to float rounding.
3. Rescale by 1/255 and normalise with the mean/std (OpenAI CLIP by default), in float32.
4. Repeat the still frame `temporal_patch_size` (2) times and cut into patches of
   `patch_size` x `patch_size`. Rows are emitted in 2x2-block-major order (all patches of one
   `merge_size` x `merge_size` block are consecutive, blocks in raster order) and each row holds
   `C * T * P * P` (1176) values ordered (channel, frame, y, x), the layout of the patch-embedding
   Conv3d weight.

The result for a batch is `pixel_values` float32 `[sum of rows, C*T*P*P]` and `image_grid_thw`
int64 `[n_images, 3]` holding `(1, H'/P, W'/P)` per image; one image yields `H'*W'/(P*P*merge^2)`
language-model tokens. Video input is refused (decided here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import ConfigError, InputError
from ..model.config import read_json

CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_CONFIG = "preprocessor_config.json"

# Suffixes that are recognisably video so that the error says "not supported" rather than
# "unreadable image".
_VIDEO_SUFFIXES = frozenset(
    {".mp4", ".mov", ".avi", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg", ".wmv", ".flv"}
)

ImageSource = str | Path | Image.Image


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 3136,
    max_pixels: int = 451584,
    max_aspect_ratio: float = 200,
) -> tuple[int, int]:
    """Target `(height, width)` for an image of `height` x `width` pixels.

    Both results are positive multiples of `factor`, as close to the input as rounding allows; an
    image whose rounded area exceeds `max_pixels` is scaled down (sides floored to multiples of
    `factor`) and one below `min_pixels` is scaled up (sides ceiled). Raises `InputError` for a
    non-positive side or an aspect ratio above `max_aspect_ratio`.
    """
    if height <= 0 or width <= 0:
        raise InputError(f"image has zero size ({width}x{height} pixels, width x height)")
    ratio = max(height, width) / min(height, width)
    if ratio > max_aspect_ratio:
        raise InputError(
            f"image aspect ratio {ratio:.1f} ({width}x{height} pixels, width x height) exceeds the "
            f"limit of {max_aspect_ratio:g}; crop or pad the image"
        )
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _describe(src: Any, index: int | None = None) -> str:
    """A name for an image in error messages: its path when known."""
    if isinstance(src, (str, Path)):
        return str(src)
    name = getattr(src, "filename", "") or ""
    if name:
        return str(name)
    return "image" if index is None else f"image #{index}"


def _to_rgb(img: Image.Image) -> Image.Image:
    has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
    if has_alpha:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def video_not_supported(src: Any = None) -> InputError:
    """The error every video input gets (decided here: this engine runs still images only)."""
    what = f" ({_describe(src)})" if src is not None else ""
    return InputError(f"video input{what} is not supported by this engine; pass still images only")


def load_image(src: ImageSource) -> Image.Image:
    """Open `src` (a path or an already-open pillow image) and return a fully decoded RGB image,
    upright according to the file's EXIF orientation when `src` is a path.

    Raises `InputError` naming the file when it is missing, unreadable, corrupt, truncated, a
    video, or has zero width or height.
    """
    name = _describe(src)
    if isinstance(src, Image.Image):
        img = src
        try:
            img.load()
        except (OSError, ValueError, SyntaxError) as e:
            raise InputError(f"{name}: corrupt or truncated image ({e})") from None
    elif isinstance(src, (str, Path)):
        path = Path(src)
        if path.suffix.lower() in _VIDEO_SUFFIXES:
            raise video_not_supported(path)
        if not path.is_file():
            raise InputError(f"{name}: image file not found (or not a regular file)")
        if path.stat().st_size == 0:
            raise InputError(f"{name}: image file is empty (0 bytes)")
        try:
            with Image.open(path) as opened:
                # Decode now: pillow opens lazily, and a truncated file only fails on load.
                opened.load()
                img = ImageOps.exif_transpose(opened)
        except UnidentifiedImageError:
            raise InputError(f"{name}: not a readable image (unknown or corrupt format)") from None
        except Image.DecompressionBombError as e:
            raise InputError(f"{name}: image is too large to decode safely ({e})") from None
        except (OSError, ValueError, SyntaxError) as e:
            raise InputError(f"{name}: corrupt or truncated image ({e})") from None
    else:
        raise InputError(
            f"unsupported image input of type {type(src).__name__}; pass a file path or a PIL image"
        )
    if img.width <= 0 or img.height <= 0:
        raise InputError(f"{name}: image has zero size ({img.width}x{img.height} pixels)")
    try:
        return _to_rgb(img)
    except (OSError, ValueError) as e:
        raise InputError(f"{name}: cannot convert image to RGB ({e})") from None


@dataclass(frozen=True)
class ImagePreprocessor:
    """Turns still images into the vision tower's inputs.

    Defaults are the release's; `from_pretrained` applies the overrides found in a checkpoint's
    `preprocessor_config.json`. Calling it returns `(pixel_values, image_grid_thw)`:
    `pixel_values` float32 `[sum_i t_i*h_i*w_i, num_channels*temporal_patch_size*patch_size**2]`
    and `image_grid_thw` int64 `[n_images, 3]`, rows of `(t=1, h, w)` in patches.
    """

    min_pixels: int = 3136
    max_pixels: int = 451584
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    num_channels: int = 3

    def __post_init__(self) -> None:
        where = "ImagePreprocessor"
        for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: {name}={value!r} must be a positive integer")
        if self.min_pixels > self.max_pixels:
            raise ConfigError(
                f"{where}: min_pixels={self.min_pixels} exceeds max_pixels={self.max_pixels}"
            )
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if len(value) != self.num_channels:
                raise ConfigError(f"{where}: {name}={value!r} must have {self.num_channels} entries")
        if any(s <= 0 for s in self.image_std):
            raise ConfigError(f"{where}: image_std={self.image_std!r} entries must be positive")
        # Lists from JSON become tuples so that instances stay hashable and comparable.
        object.__setattr__(self, "image_mean", tuple(float(v) for v in self.image_mean))
        object.__setattr__(self, "image_std", tuple(float(v) for v in self.image_std))

    @property
    def factor(self) -> int:
        """Side granularity of resized images in pixels (patch_size * merge_size)."""
        return self.patch_size * self.merge_size

    @property
    def row_size(self) -> int:
        """Values per pixel row: num_channels * temporal_patch_size * patch_size**2 (1176)."""
        return self.num_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_config_dict(cls, raw: dict, where: str = PREPROCESSOR_CONFIG) -> ImagePreprocessor:
        """Build from the contents of a `preprocessor_config.json`; unknown keys are ignored.

        `min_pixels`/`max_pixels` win over the transformers-style
        `size = {"shortest_edge": min, "longest_edge": max}`; a list-valued `size` (the release
        writes `[672, 672]`, which its processor never read) is ignored.
        """
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a JSON object at the top level")
        kwargs: dict[str, Any] = {}
        size = raw.get("size")
        if isinstance(size, dict):
            if size.get("shortest_edge") is not None:
                kwargs["min_pixels"] = size["shortest_edge"]
            if size.get("longest_edge") is not None:
                kwargs["max_pixels"] = size["longest_edge"]
        for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
            if raw.get(name) is not None:
                kwargs[name] = raw[name]
        for name in ("image_mean", "image_std"):
            value = raw.get(name)
            if value is None:
                continue
            if isinstance(value, (int, float)):
                value = [value] * 3
            if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
            ):
                raise ConfigError(f"{where}: {name}={value!r} must be a list of numbers")
            kwargs[name] = tuple(float(v) for v in value)
        for name, value in kwargs.items():
            if name not in ("image_mean", "image_std") and (
                isinstance(value, bool) or not isinstance(value, int)
            ):
                raise ConfigError(f"{where}: {name}={value!r} must be a positive integer")
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(str(e).replace("ImagePreprocessor", where, 1)) from None

    @classmethod
    def from_pretrained(cls, ckpt_dir: str | Path) -> ImagePreprocessor:
        """Defaults overridden by `ckpt_dir/preprocessor_config.json` when that file exists."""
        path = Path(ckpt_dir) / PREPROCESSOR_CONFIG
        if not path.exists():
            return cls()
        return cls.from_config_dict(read_json(path, PREPROCESSOR_CONFIG), str(path))

    def replace(self, **overrides: Any) -> ImagePreprocessor:
        """A copy with some settings changed."""
        current = {f.name: getattr(self, f.name) for f in fields(self)}
        current.update(overrides)
        return type(self)(**current)

    # ------------------------------------------------------------------------------------------

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """Resized `(height, width)` in pixels for an input of `height` x `width`."""
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def num_tokens_for_size(self, height: int, width: int) -> int:
        """Language-model tokens one `height` x `width` still image becomes."""
        h, w = self.target_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2

    def num_image_tokens(self, grid_thw: torch.Tensor | Sequence[int]) -> int:
        """Tokens for one grid `(t, h, w)`, or the total over a `[n, 3]` grid tensor."""
        return num_image_tokens(grid_thw, self.merge_size)

    def _normalise(self, img: Image.Image) -> torch.Tensor:
        """RGB pillow image -> float32 `[C, H, W]`, rescaled and normalised."""
        w, h = img.size
        data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
        x = data.view(h, w, self.num_channels).permute(2, 0, 1).to(torch.float32)
        # Rescale folded into the normalisation ((x - 255*mean) / (255*std)), as the oracle does,
        # so that un-resized images match it to float rounding.
        mean = torch.tensor(self.image_mean, dtype=torch.float32).view(-1, 1, 1) * 255.0
        std = torch.tensor(self.image_std, dtype=torch.float32).view(-1, 1, 1) * 255.0
        return (x - mean) / std

    def _patchify(self, x: torch.Tensor) -> torch.Tensor:
        """`[C, H, W]` -> `[(H/P)*(W/P), C*T*P*P]` rows in merge-block-major order."""
        c, h, w = x.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        x = x.reshape(c, gh // m, m, p, gw // m, m, p)
        # -> [block_row, block_col, in_block_row, in_block_col, C, py, px]
        x = x.permute(1, 4, 2, 5, 0, 3, 6)
        # A still image stands for `t` identical frames; the frame axis sits between C and y.
        x = x.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1)
        return x.reshape(gh * gw, c * t * p * p)

    def preprocess_one(
        self, src: ImageSource, index: int | None = None
    ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One still image -> (float32 `[h*w, row_size]`, grid `(1, h, w)`)."""
        name = _describe(src, index)
        if isinstance(src, torch.Tensor):
            if src.dim() >= 4:
                raise video_not_supported(name)
            raise InputError(f"{name}: tensor input is not supported; pass a file path or a PIL image")
        img = load_image(src)
        try:
            th, tw = self.target_size(img.height, img.width)
        except InputError as e:
            raise InputError(f"{name}: {e}") from None
        if (tw, th) != img.size:
            img = img.resize((tw, th), Image.Resampling.BICUBIC)
        rows = self._patchify(self._normalise(img))
        return rows, (1, th // self.patch_size, tw // self.patch_size)

    def __call__(self, images: ImageSource | Sequence[ImageSource]) -> tuple[torch.Tensor, torch.Tensor]:
        """Preprocess one image or a list of images (paths or pillow images), in order.

        Returns `pixel_values` float32 `[sum rows, row_size]` and `image_grid_thw` int64 `[n, 3]`.
        An empty list gives tensors with zero rows.
        """
        if isinstance(images, (str, Path, Image.Image)):
            images = [images]
        elif isinstance(images, torch.Tensor):
            images = [images]
        elif not isinstance(images, Sequence):
            raise InputError(
                f"unsupported image input of type {type(images).__name__}; pass paths or PIL images"
            )
        all_rows: list[torch.Tensor] = []
        grids: list[tuple[int, int, int]] = []
        for i, src in enumerate(images):
            rows, grid = self.preprocess_one(src, index=i)
            all_rows.append(rows)
            grids.append(grid)
        if not all_rows:
            return torch.zeros(0, self.row_size, dtype=torch.float32), torch.zeros(0, 3, dtype=torch.long)
        return torch.cat(all_rows, dim=0), torch.tensor(grids, dtype=torch.long)

    def preprocess_video(self, *args: Any, **kwargs: Any) -> None:
        """Always raises `InputError`: video is not supported by this engine."""
        raise video_not_supported()


def num_image_tokens(grid_thw: torch.Tensor | Sequence[int], merge_size: int = 2) -> int:
    """Language-model tokens for one grid `(t, h, w)` (t*h*w / merge_size**2), or the total over
    the rows of a `[n, 3]` grid tensor."""
    g = torch.as_tensor(grid_thw, dtype=torch.long)
    if g.dim() == 1:
        g = g.unsqueeze(0)
    if g.dim() != 2 or g.shape[1] != 3:
        raise InputError(f"image_grid_thw must have shape [3] or [n, 3], got {list(g.shape)}")
    return int(g.prod(dim=1).sum().item()) // merge_size**2
