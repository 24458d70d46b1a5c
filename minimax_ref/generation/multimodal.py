"""Images in prompts: marker placement and expansion, image inputs, and input embeddings.

Prompt assembly (spec `interface.md`, "Images"; `model.md`, "Image tokens")
-----------------------------------------------------------------------
* The image marker in raw prompts is the release's image token text `]<]image[>[` (`IMAGE_MARKER`),
  one marker per image, in the order of the images.
* Every marker expands to `<start of image>` + N x `<image>` + `<end of image>`, with
  N = t*h*w / merge**2 for that image's grid (64 for a 224x224 picture). Ids are read from the
  tokenizer, never written here.
* A prompt without markers gets its images placed before its text: a raw prompt becomes
  `markers + text` (any BOS from the tokenizer's post-processor stays first); a chat gets the
  markers at the start of its last user turn.
* A prompt whose marker count differs from its image count is an `InputError` naming both counts,
  and so is a marker with no image at all.
* Token-id prompts (lists of ints) with images must carry one image-token id per image, or be
  already expanded (the `prompt_token_ids` an earlier run printed); the brackets are then checked
  against the images' token counts. Token-id prompts without images are used as they are.

Image inputs (decided here)
---------------------------
Per prompt, images come from one of:
* a list of sources: file paths (`str`/`Path`) or pillow images; one source alone also works;
* already preprocessed tensors: `(pixel_values, image_grid_thw)` or the dict
  `{"pixel_values": ..., "image_grid_thw": ...}` (what `ImagePreprocessor` returns);
* image parts of chat messages, OpenAI style: `{"type": "image", "image": path_or_PIL}` (also
  `"path"`/`"url"` instead of `"image"`), `{"type": "image_url", "image_url": {"url": URL}}` and
  `{"type": "input_image", "image_url": URL}`. A URL is a local path, a `file://` URL or a
  `data:image/...;base64,` URL; remote (http/https) URLs are refused, as this engine never goes
  online. A part without a source (`{"type": "image"}`) is only a marker: the images then come from
  the `images` argument, in order. Parts with sources and an `images` argument together, or parts
  with and without sources in one conversation, are refused as ambiguous.
The number of images per prompt (a whole conversation counts as one prompt) is limited by the
runtime setting `max_images_per_prompt` (`model.runtime`; default 1, the seed's deployment; CLI
`--limit-images`). Video (video files, video parts, the `]<]video[>[` token) is refused: this engine
runs still images only (decided here; the Hopper recipe disables video too).

Preprocessing uses `model.image_preprocessor` when the caller has set one, else the checkpoint's
`preprocessor_config.json` (release defaults when absent).

Embeddings
----------
`embed_with_images` looks the ids up in the embedding table and replaces the rows of the
`<image>` tokens (the config's `image_token_id`), in order, with the merged image features of
`vision.encode_images`; images attend only within themselves in the tower, and image tokens take
ordinary text positions in the language model. `forward_with_images` is the full-sequence logits
entry: `model(ids, inputs_embeds=embed_with_images(model, ids, pixel_values, image_grid_thw))`.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import torch
from PIL import Image, UnidentifiedImageError

from ..errors import ConfigError, InputError
from ..model.vision import encode_images, tokens_per_image
from .chat import _IMAGE_PART_TYPES as IMAGE_PART_TYPES
from .chat import IMAGE
from .image import PREPROCESSOR_CONFIG, ImagePreprocessor, ImageSource, video_not_supported

IMAGE_MARKER = IMAGE
VIDEO_PART_TYPES = ("video", "video_url", "input_video")

#: Preprocessed images of one prompt: (pixel_values float32 [rows, C*T*P*P], image_grid_thw int64 [n, 3]).
PixelInputs = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ImageTokenIds:
    """Ids of the image tokens of a tokenizer (`video` is None when it lacks the video token)."""

    image: int
    start: int
    end: int
    video: int | None = None

    @classmethod
    def from_tokenizer(cls, tok: Any) -> ImageTokenIds:
        sp = tok.special_ids
        missing = [name for name in ("image", "image_start", "image_end") if getattr(sp, name) is None]
        if missing:
            raise InputError(f"tokenizer {getattr(tok, 'path', '')} lacks the image tokens {missing}; "
                             "it cannot encode prompts with images")
        return cls(sp.image, sp.image_start, sp.image_end, sp.video)


# ----------------------------------------------------------------------------------------------
# marker placement and expansion


def _message_parts(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    """(where, content) of every message, for scanning; malformed messages are left to
    `chat.normalize_messages`, which names them."""
    out = []
    for i, msg in enumerate(messages):
        if isinstance(msg, Mapping):
            out.append((f"messages[{i}]", msg.get("content")))
    return out


def _has_marker_in_content(content: Any) -> bool:
    if isinstance(content, str):
        return IMAGE_MARKER in content
    if isinstance(content, list):
        for part in content:
            if isinstance(part, str) and IMAGE_MARKER in part:
                return True
            if isinstance(part, Mapping):
                if part.get("type") in IMAGE_PART_TYPES:
                    return True
                if part.get("type") == "text" and IMAGE_MARKER in str(part.get("text", "")):
                    return True
    return False


def has_image_markers(prompt: str | Sequence[Mapping[str, Any]]) -> bool:
    """Whether a raw prompt or a conversation already says where its images go (a marker in the
    text, or an image part in a message)."""
    if isinstance(prompt, str):
        return IMAGE_MARKER in prompt
    return any(_has_marker_in_content(c) for _, c in _message_parts(prompt))


def place_images_first(prompt: str | Sequence[Mapping[str, Any]], n_images: int) -> Any:
    """`prompt` with `n_images` markers put before its text: a raw prompt gets them in front, a
    conversation at the start of its last user turn (a copy; the input is not changed)."""
    markers = IMAGE_MARKER * n_images
    if isinstance(prompt, str):
        return markers + prompt
    messages = [dict(m) if isinstance(m, Mapping) else m for m in prompt]
    for msg in reversed(messages):
        if isinstance(msg, dict) and msg.get("role") == "user":
            content = msg.get("content")
            if isinstance(content, list):
                msg["content"] = [{"type": "text", "text": markers}, *content]
            elif isinstance(content, str):
                msg["content"] = markers + content
            else:
                break  # let normalize_messages report the bad content
            return messages
    raise InputError(f"the conversation has no user turn to place its {n_images} image(s) in")


def expand_image_markers(ids: Sequence[int], image_tokens: Sequence[int], special: ImageTokenIds,
                         where: str = "prompt") -> list[int]:
    """Token ids with every image marker expanded to `start + N_i x image + end`.

    ids: the encoded prompt, one `special.image` id per image (marker form), or already expanded
      (it contains `special.start`; then it is checked against `image_tokens` and returned as is).
    image_tokens: N_i, the language-model tokens of each image, in order.
    Raises InputError (naming `where` and both counts) when the markers do not match the images,
    and for the video token.
    """
    ids = [int(t) for t in ids]
    if special.video is not None and special.video in ids:
        raise video_not_supported(f"{where}: video token at position {ids.index(special.video)}")
    n = len(image_tokens)
    if special.start in ids:
        _check_expanded(ids, image_tokens, special, where)
        return ids
    markers = [i for i, t in enumerate(ids) if t == special.image]
    if len(markers) != n:
        raise InputError(
            f"{where} has {len(markers)} image marker(s) ({IMAGE_MARKER}) but {n} image(s) were given; "
            "put exactly one marker per image, or no marker to place the images before the text")
    out: list[int] = []
    prev = 0
    for pos, count in zip(markers, image_tokens, strict=True):
        out += ids[prev:pos] + [special.start] + [special.image] * int(count) + [special.end]
        prev = pos + 1
    return out + ids[prev:]


def _check_expanded(ids: list[int], image_tokens: Sequence[int], special: ImageTokenIds, where: str) -> None:
    """An expanded prompt must hold, per image in order, `start + N_i x image + end` and no other
    image token."""
    found: list[int] = []
    i = 0
    while i < len(ids):
        t = ids[i]
        if t == special.start:
            j = i + 1
            while j < len(ids) and ids[j] == special.image:
                j += 1
            if j == len(ids) or ids[j] != special.end:
                raise InputError(f"{where}: image bracket opened at position {i} is not closed by the "
                                 "end-of-image token right after its image tokens")
            found.append(j - i - 1)
            i = j + 1
            continue
        if t in (special.image, special.end):
            raise InputError(f"{where}: image token at position {i} lies outside an image bracket")
        i += 1
    if found != [int(c) for c in image_tokens]:
        raise InputError(f"{where} is already expanded with image token counts {found}, but the given "
                         f"images need {[int(c) for c in image_tokens]}")


# ----------------------------------------------------------------------------------------------
# image inputs


def _from_url(url: str, where: str) -> ImageSource:
    """A local path (plain or `file://`) or a decoded `data:` URL image."""
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise InputError(f"{where}: only base64 data URLs are supported")
        if header[5:].startswith("video/"):
            raise video_not_supported(where)
        try:
            data = base64.b64decode(payload, validate=True)
            img = Image.open(io.BytesIO(data))
            img.load()
        except (binascii.Error, ValueError) as e:
            raise InputError(f"{where}: data URL is not valid base64 ({e})") from None
        except (UnidentifiedImageError, OSError, SyntaxError) as e:
            raise InputError(f"{where}: data URL does not hold a readable image ({e})") from None
        return img
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme in ("http", "https", "ftp"):
        raise InputError(f"{where}: remote image URL {url!r} is not fetched (this engine works offline); "
                         "download the image and pass its path")
    return url


def _part_source(part: Mapping[str, Any], where: str) -> ImageSource | None:
    """The image a message part carries, or None for a bare marker part."""
    for key in ("image", "path", "url"):
        value = part.get(key)
        if value is not None:
            return _from_url(value, where) if isinstance(value, str) else value
    url = part.get("image_url")
    if isinstance(url, Mapping):
        url = url.get("url")
    if url is None:
        return None
    if not isinstance(url, str):
        raise InputError(f"{where}.image_url: expected a URL string or {{'url': ...}}")
    return _from_url(url, where)


def message_images(messages: Sequence[Mapping[str, Any]]) -> list[ImageSource | None]:
    """The image parts of a conversation, in order: each part's source, or None for a bare part.
    Raises InputError for video parts."""
    found: list[ImageSource | None] = []
    for where, content in _message_parts(messages):
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
                continue
            kind = part.get("type")
            if kind in VIDEO_PART_TYPES:
                raise video_not_supported(f"{where}.content[{j}]")
            if kind in IMAGE_PART_TYPES:
                found.append(_part_source(part, f"{where}.content[{j}]"))
    return found


def rebase_image_paths(messages: Sequence[Mapping[str, Any]], base: Path) -> list[Any]:
    """A copy of `messages` whose relative image paths (in image parts) are taken relative to `base`
    (used for `--input-file` records, whose paths are relative to the file)."""

    def rebase(value: Any) -> Any:
        # Only plain relative paths move; URLs (file:, data:, http:) and absolute paths stay.
        if not isinstance(value, (str, Path)) or urlparse(str(value)).scheme or Path(value).is_absolute():
            return value
        return str(base / value)

    out: list[Any] = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if not isinstance(content, list):
            out.append(msg)
            continue
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES:
                part = dict(part)
                for key in ("image", "path", "url"):
                    if key in part:
                        part[key] = rebase(part[key])
                url = part.get("image_url")
                if isinstance(url, Mapping) and "url" in url:
                    part["image_url"] = {**url, "url": rebase(url["url"])}
                elif isinstance(url, str):
                    part["image_url"] = rebase(url)
            parts.append(part)
        out.append({**msg, "content": parts})
    return out


def _as_pixel_inputs(entry: Any) -> PixelInputs | None:
    """`(pixel_values, image_grid_thw)` when `entry` is already preprocessed, else None."""
    if isinstance(entry, Mapping):
        if "pixel_values_videos" in entry or "video_grid_thw" in entry:
            raise video_not_supported("pixel_values_videos")
        if "pixel_values" not in entry or "image_grid_thw" not in entry:
            raise InputError("preprocessed images must give both 'pixel_values' and 'image_grid_thw'")
        return entry["pixel_values"], entry["image_grid_thw"]
    if (isinstance(entry, (tuple, list)) and len(entry) == 2
            and all(isinstance(t, torch.Tensor) for t in entry)):
        return entry[0], entry[1]
    return None


def image_preprocessor(model: Any) -> ImagePreprocessor:
    """The preprocessor for `model`'s vision tower: `model.image_preprocessor` if set, else the
    checkpoint's `preprocessor_config.json`; without that file (decided here), the release's resizing and
    normalisation with the patch, temporal patch, merge and channel counts of the vision config."""
    vc = model.config.vision
    theirs = (vc.patch_size, vc.temporal_patch_size, vc.spatial_merge_size, vc.num_channels)
    pre = getattr(model, "image_preprocessor", None)
    where = "model.image_preprocessor"
    if pre is None:
        path = getattr(model, "ckpt_path", None)
        if path is None or not (Path(path) / PREPROCESSOR_CONFIG).exists():
            return ImagePreprocessor().replace(patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size,
                                               merge_size=vc.spatial_merge_size, num_channels=vc.num_channels)
        pre, where = ImagePreprocessor.from_pretrained(path), str(Path(path) / PREPROCESSOR_CONFIG)
    ours = (pre.patch_size, pre.temporal_patch_size, pre.merge_size, pre.num_channels)
    if ours != theirs:
        raise ConfigError(f"{where}: (patch_size, temporal_patch_size, merge_size, num_channels) = {ours} does not "
                          f"match config.json vision_config's {theirs}; the two files must describe the same tower")
    return pre


def _require_vision(model: Any, what: str) -> None:
    if getattr(model, "vision_tower", None) is None or getattr(model, "projector", None) is None:
        where = getattr(model, "ckpt_path", None)
        name = f"checkpoint {where}" if where is not None else "this model"
        raise InputError(f"{what}, but {name} has no vision tower (a text-only checkpoint); remove the "
                         "images or load a checkpoint with vision weights")


def _as_sources(entry: Any, where: str) -> list[Any]:
    """The image sources of an `images` entry that is not preprocessed tensors."""
    if entry is None:
        return []
    if isinstance(entry, (str, Path, Image.Image)):
        return [entry]
    if isinstance(entry, Sequence):
        return list(entry)
    raise InputError(f"{where}: images must be a list of file paths or PIL images, or "
                     f"(pixel_values, image_grid_thw); got {type(entry).__name__}")


def load_prompt_images(model: Any, entry: Any, prompt: Any = None, *, chat: bool = False,
                       where: str = "prompt") -> PixelInputs | None:
    """The images of one prompt, preprocessed: `(pixel_values, image_grid_thw)`, or None for none.

    entry: the prompt's `images` argument (see the module docstring), or None. prompt: the prompt
    itself; with `chat` its messages' image parts are sources too. Checks, in this order: video
    parts, that the model has a vision tower, the per-prompt limit (`model.runtime`), then loads
    and preprocesses (video files, unreadable or corrupt files raise InputError naming the file).
    """
    conversation = chat and isinstance(prompt, Sequence) and not isinstance(prompt, str)
    parts = message_images(prompt) if conversation else []
    pixels = _as_pixel_inputs(entry) if entry is not None else None
    if pixels is not None:
        _require_vision(model, f"{where} has images")
        pixels = (pixels[0], model.vision_tower.check_inputs(*pixels))
        sources: list[Any] = []
        count = len(pixels[1])
    else:
        sources = _as_sources(entry, where)
        count = len(sources)
    if parts and not all(p is None for p in parts):
        # Parts that carry their images; bare parts are only markers for the separate images.
        if any(p is None for p in parts):
            raise InputError(f"{where}: some image parts carry an image and some do not; give every part "
                             "its image, or none of them and pass the images separately")
        if count:
            raise InputError(f"{where}: images are given both in the messages and separately; use one")
        sources, count = parts, len(parts)
    if count == 0:
        return None
    _require_vision(model, f"{where} has {count} image(s)")
    rt = getattr(model, "runtime", None)
    limit = rt.max_images_per_prompt if rt is not None else 1
    if count > limit:
        raise InputError(f"{where} has {count} images but at most {limit} per prompt are allowed (raise "
                         "the limit with --limit-images, or load_model(..., max_images_per_prompt=N))")
    return pixels if pixels is not None else image_preprocessor(model)(sources)


# ----------------------------------------------------------------------------------------------
# embeddings


def embed_with_images(model: Any, input_ids: torch.Tensor | Sequence[int], pixel_values: torch.Tensor,
                      image_grid_thw: torch.Tensor) -> torch.Tensor:
    """Input embeddings of `input_ids` with the image features in place of the `<image>` tokens.

    input_ids: int `[T]` (or `[B, T]`; image tokens are then filled row by row) holding, in order,
      exactly as many `config.image_token_id` tokens as the images give features.
    pixel_values: `[rows, C*T*P*P]` (1176), image_grid_thw: int `[n, 3]`, as `ImagePreprocessor`
      returns them.
    Returns `[T, H]` (or `[B, T, H]`) in the model's compute dtype, on its device. Raises
    InputError for a text-only model and when the image-token count does not match.
    """
    _require_vision(model, "images were given")
    image_id = model.config.image_token_id
    if image_id is None:
        raise ConfigError("config.json has no image_token_index; cannot place image features")
    ids = torch.as_tensor(input_ids, dtype=torch.long).to(model.device)
    if ids.dim() not in (1, 2):
        raise InputError(f"input_ids must be [T] or [B, T], got shape {tuple(ids.shape)}")
    grid = model.vision_tower.check_inputs(pixel_values, image_grid_thw)
    slots = ids == image_id
    counts = tokens_per_image(grid, model.config.vision.spatial_merge_size)
    if int(slots.sum()) != sum(counts):
        raise InputError(f"input_ids hold {int(slots.sum())} image tokens (id {image_id}) but the "
                         f"{len(counts)} image(s) give {sum(counts)} features ({counts} per image)")
    x = model.embed(ids).clone()
    features = encode_images(model.vision_tower, model.projector, pixel_values, grid)
    x[slots] = features.to(x.dtype)
    return x


@torch.no_grad()
def forward_with_images(model: Any, input_ids: torch.Tensor, pixel_values: torch.Tensor,
                        image_grid_thw: torch.Tensor) -> torch.Tensor:
    """Full-sequence logits with images: float32 `[B, T, V]` for `input_ids` `[B, T]` (positions
    0..T-1, no cache); the images fill the `<image>` tokens in row-major order."""
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() != 2:
        raise InputError(f"input_ids must be [batch, seq], got shape {tuple(ids.shape)}")
    ids = ids.to(model.device)
    return model(ids, inputs_embeds=embed_with_images(model, ids, pixel_values, image_grid_thw))
