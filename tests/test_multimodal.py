"""Images in prompts, end to end: marker expansion by hand, logits against transformers'
MiniMaxM3SparseForConditionalGeneration, image isolation through the prompt path, the CLI, and the
errors of bad input."""

from __future__ import annotations

import base64
import dataclasses
import json

import pytest
import torch
from oracle import hf_vl_model, relative_max_error
from PIL import Image

from minimax_ref.cli import main
from minimax_ref.errors import ConfigError, InputError
from minimax_ref.generation.generate import encode_prompt, generate
from minimax_ref.generation.multimodal import (
    IMAGE_MARKER,
    embed_with_images,
    forward_with_images,
    load_prompt_images,
)
from minimax_ref.generation.tokenizer import load_tokenizer
from minimax_ref.model.vision import encode_images
from minimax_ref.weights.loader import load_model

TOL = 1e-4  # fp32 logits within 1e-4 of the oracle, relative to the logit scale


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.frombytes("RGB", (width, height), bytes(arr.flatten().tolist()))


@pytest.fixture(scope="module")
def vl_path(ckpt_factory):
    return ckpt_factory("tiny-vl", "bf16")


@pytest.fixture(scope="module")
def vl_model(vl_path):
    model = load_model(vl_path, dtype=torch.float32)
    # Most tests here put two images in one prompt.
    model.runtime = dataclasses.replace(model.runtime, max_images_per_prompt=2)
    return model


@pytest.fixture(scope="module")
def tok(vl_path):
    return load_tokenizer(vl_path)


@pytest.fixture(scope="module")
def png(tmp_path_factory):
    """An 84x56 PNG: already a multiple of 28 on both sides -> grid (1, 4, 6) -> 6 tokens."""
    path = tmp_path_factory.mktemp("images") / "pic.png"
    noise_image(84, 56, seed=1).save(path)
    return path


def expanded(tok, n: int) -> list[int]:
    sp = tok.special_ids
    return [sp.image_start] + [sp.image] * n + [sp.image_end]


# ----------------------------------------------------------------------------------------------
# prompt assembly, by hand


def test_marker_expansion_by_hand(tok):
    sp = tok.special_ids
    assert tok.encode(IMAGE_MARKER, add_special_tokens=False) == [sp.image]
    a, b = tok.encode("look at", add_special_tokens=False), tok.encode(" and tell", add_special_tokens=False)
    ids = encode_prompt(tok, f"look at{IMAGE_MARKER} and tell", image_tokens=[6])
    assert ids == a + [sp.image_start] + [sp.image] * 6 + [sp.image_end] + b

    # No marker: the images go before the text, in order.
    ids = encode_prompt(tok, "look at", image_tokens=[4, 16])
    assert ids == expanded(tok, 4) + expanded(tok, 16) + tok.encode("look at")

    # Token-id prompts: one image id per image, or already expanded (e.g. an earlier run's output).
    assert encode_prompt(tok, a + [sp.image] + b, image_tokens=[6]) == a + expanded(tok, 6) + b
    done = a + expanded(tok, 6) + b
    assert encode_prompt(tok, done, image_tokens=[6]) == done
    with pytest.raises(InputError, match=r"counts \[6\].*need \[4\]"):
        encode_prompt(tok, done, image_tokens=[4])
    # Without images, prompts are unchanged; a marker with no image is an error.
    assert encode_prompt(tok, a + [sp.image], image_tokens=[]) == a + [sp.image]
    with pytest.raises(InputError, match=r"prompt has 1 image marker.*but 0 image"):
        encode_prompt(tok, f"x{IMAGE_MARKER}", image_tokens=[])


def test_chat_places_images_at_start_of_last_user_turn(tok):
    messages = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "second"}]
    text = tok.decode(encode_prompt(tok, messages, chat=True, image_tokens=[4]))
    brackets = "]<]start of image[>[" + IMAGE_MARKER * 4 + "]<]end of image[>["
    assert text.count(brackets) == 1
    assert "]~b]user\nfirst[e~[" in text
    assert f"]~b]user\n{brackets}second[e~[" in text
    # An image part says where the image goes: right after "see ".
    parts = [{"role": "user", "content": [{"type": "text", "text": "see "}, {"type": "image"},
                                          {"type": "text", "text": " now"}]}]
    text = tok.decode(encode_prompt(tok, parts, chat=True, image_tokens=[4]))
    assert f"]~b]user\nsee {brackets} now[e~[" in text


def test_message_image_parts_match_images_argument(vl_model, tok, png):
    data_url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    ref_pixels, ref_grid = load_prompt_images(vl_model, [str(png)])
    ref_ids = encode_prompt(tok, "what is it", chat=True, image_tokens=[6])
    for part in ({"type": "image", "image": str(png)}, {"type": "image", "image": Image.open(png)},
                 {"type": "image_url", "image_url": {"url": png.as_uri()}},
                 {"type": "input_image", "image_url": data_url}):
        msg = [{"role": "user", "content": [part, {"type": "text", "text": "what is it"}]}]
        pixels, grid = load_prompt_images(vl_model, None, msg, chat=True)
        assert torch.equal(pixels, ref_pixels) and torch.equal(grid, ref_grid), part["type"]
        assert encode_prompt(tok, msg, chat=True, image_tokens=[6]) == ref_ids, part["type"]
    # Through generate: the same prompt and, greedily, the same token.
    kw = dict(max_new_tokens=1, temperature=0, chat=True)
    ref = generate(vl_model, tok, ["what is it"], images=[[str(png)]], **kw)[0]
    out = generate(vl_model, tok, [msg], **kw)[0]
    assert out.prompt_token_ids == ref.prompt_token_ids == ref_ids
    assert out.token_ids == ref.token_ids


# ----------------------------------------------------------------------------------------------
# numerics


def test_logits_with_images_match_transformers(vl_model, tok):
    """Two images of different grids inside text, 90 tokens: past the tiny preset's 4 x 16-token
    MSA budget, so the sparse block selection is exercised with image tokens in the context."""
    hf = hf_vl_model(vl_model)
    assert torch.equal(hf.lm_head.weight, vl_model.lm_head.weight)
    images = [noise_image(112, 84, seed=2), noise_image(56, 56, seed=3)]  # grids (1,6,8), (1,4,4)
    pixel_values, grid = load_prompt_images(vl_model, images)
    assert grid.tolist() == [[1, 6, 8], [1, 4, 4]]
    prompt = (f"Compare the first picture {IMAGE_MARKER} with the second one {IMAGE_MARKER} and describe "
              "every difference between them in detail, please, as a careful observer would do it.")
    ids = torch.tensor([encode_prompt(tok, prompt, image_tokens=[12, 4])])
    assert 64 < ids.shape[1] < 128 and int((ids == tok.special_ids.image).sum()) == 16
    with torch.no_grad():
        ours = forward_with_images(vl_model, ids, pixel_values, grid)
        theirs = hf(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid).logits
    err = relative_max_error(ours, theirs)
    print(f"max relative logit error vs transformers (2 images, {ids.shape[1]} tokens): {err:.2e}")
    assert err < TOL

    # Generation's cached prefill sees the same embeddings: its greedy first token is the argmax.
    # Preprocessed tensors are accepted in place of the images.
    for entry in (images, (pixel_values, grid)):
        out = generate(vl_model, tok, [prompt], images=[entry], max_new_tokens=1, temperature=0)[0]
        assert out.prompt_token_ids == ids[0].tolist()
        assert out.token_ids == [int(ours[0, -1].argmax())]


def test_a_tower_of_other_geometry_takes_images_without_a_preprocessor_file(ckpt_factory):
    """No preprocessor_config.json (synth writes none): the resizing follows the vision config's patch 16 and
    merge 3, not the release's 14 and 2; the logits still match transformers."""
    path = ckpt_factory("tiny-vl", "bf16", overrides={"vision_config": {"patch_size": 16, "spatial_merge_size": 3}})
    assert not (path / "preprocessor_config.json").exists()
    model, tok = load_model(path, dtype=torch.float32), load_tokenizer(path)
    pixel_values, grid = load_prompt_images(model, [noise_image(96, 48, seed=7)])  # multiples of 16 x 3 = 48
    assert grid.tolist() == [[1, 3, 6]]
    ids = torch.tensor([encode_prompt(tok, f"{IMAGE_MARKER} What is it?", image_tokens=[2])])
    with torch.no_grad():
        ours = forward_with_images(model, ids, pixel_values, grid)
        theirs = hf_vl_model(model)(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid).logits
    assert relative_max_error(ours, theirs) < TOL
    # a preprocessor file that describes another tower is refused naming both files
    (path / "preprocessor_config.json").write_text('{"patch_size": 14, "merge_size": 2}')
    try:
        with pytest.raises(ConfigError, match="preprocessor_config.json.*does not match config.json vision_config"):
            load_prompt_images(load_model(path, dtype=torch.float32), [noise_image(96, 48, seed=7)])
    finally:
        (path / "preprocessor_config.json").unlink()


def test_images_in_one_prompt_do_not_see_each_other(vl_model, tok):
    prompt = f"A: {IMAGE_MARKER} B: {IMAGE_MARKER} which is brighter?"
    image_a = noise_image(84, 56, seed=4)
    pv1, grid = load_prompt_images(vl_model, [image_a, noise_image(56, 56, seed=5)])
    pv2, grid2 = load_prompt_images(vl_model, [image_a, noise_image(56, 56, seed=6)])
    assert torch.equal(grid, grid2)
    ids = torch.tensor(encode_prompt(tok, prompt, image_tokens=[6, 4]))
    slots = (ids == tok.special_ids.image).nonzero().flatten()
    slots_a, slots_b = slots[:6], slots[6:]
    e1, e2 = embed_with_images(vl_model, ids, pv1, grid), embed_with_images(vl_model, ids, pv2, grid)
    assert e1.shape == (len(ids), vl_model.text.hidden_size) and e1.dtype == torch.float32

    # Image A's features are unchanged, equal to A encoded alone, and in its own slots, in order.
    n_a = int(grid[0].prod())
    alone = encode_images(vl_model.vision_tower, vl_model.projector, pv1[:n_a], grid[:1])
    torch.testing.assert_close(e2[slots_a], e1[slots_a], rtol=0, atol=1e-6)
    torch.testing.assert_close(e1[slots_a], alone, rtol=1e-6, atol=1e-6)
    assert (e2[slots_b] - e1[slots_b]).abs().max() > 1e-2
    text = torch.ones(len(ids), dtype=torch.bool)
    text[slots] = False
    assert torch.equal(e1[text], vl_model.embed(ids[text]))

    # Causality: logits up to the end of image A's bracket do not depend on image B.
    with torch.no_grad():
        l1 = forward_with_images(vl_model, ids[None], pv1, grid)
        l2 = forward_with_images(vl_model, ids[None], pv2, grid)
    end_a = int(slots_a[-1]) + 2
    torch.testing.assert_close(l2[0, :end_a], l1[0, :end_a], rtol=0, atol=1e-5)
    assert (l2[0, end_a:] - l1[0, end_a:]).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------
# command line


def test_cli_json_with_image(vl_path, tok, png, tmp_path, capsys):
    argv = ["generate", "--ckpt-path", str(vl_path), "--dtype", "float32", "--max-new-tokens", "2",
            "--temperature", "0", "--output-format", "json"]
    assert main([*argv, "--prompt", "describe", "--image", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_token_ids"] == expanded(tok, 6) + tok.encode("describe")
    assert len(out["token_ids"]) == 2

    # --input-file: 'images' relative to the file; --limit-images raises the per-prompt limit.
    (tmp_path / "pic.png").write_bytes(png.read_bytes())
    batch = tmp_path / "batch.jsonl"
    record = {"prompt": f"x{IMAGE_MARKER}y{IMAGE_MARKER}", "images": ["pic.png", "pic.png"], "id": "two"}
    batch.write_text(json.dumps(record) + "\n")
    assert main([*argv, "--input-file", str(batch), "--limit-images", "2"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[0])  # the result, then the summary line
    x, y = tok.encode("x"), tok.encode("y")
    assert out["id"] == "two" and out["prompt_token_ids"] == x + expanded(tok, 6) + y + expanded(tok, 6)


def test_cli_errors_name_the_culprit(vl_path, tmp_path, png, capsys):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    argv = ["generate", "--ckpt-path", str(vl_path), "--max-new-tokens", "1", "--prompt", "hi"]
    assert main([*argv, "--image", str(bad)]) == 2
    assert "broken.png" in capsys.readouterr().err
    assert main([*argv, "--image", str(png), "--image", str(png)]) == 2
    assert "2 images but at most 1" in capsys.readouterr().err
    assert main([*argv, "--image", str(tmp_path / "missing.png")]) == 2
    assert "missing.png" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# bad input


def test_bad_inputs(vl_model, tok, png, tmp_path):
    kw = dict(max_new_tokens=1)
    bad = tmp_path / "corrupt.png"
    bad.write_bytes(png.read_bytes()[:60])  # a truncated PNG
    with pytest.raises(InputError, match="corrupt.png"):
        generate(vl_model, tok, ["hi"], images=[[bad]], **kw)
    with pytest.raises(InputError, match=r"prompts\[0\] has 2 image marker\(s\).*but 1 image\(s\)"):
        generate(vl_model, tok, [f"a{IMAGE_MARKER}b{IMAGE_MARKER}"], images=[[png]], **kw)
    with pytest.raises(InputError, match=r"prompts\[1\] has 3 images but at most 2"):
        generate(vl_model, tok, ["a", "b"], images=[None, [png] * 3], **kw)
    with pytest.raises(InputError, match="one entry per prompt"):
        generate(vl_model, tok, ["a", "b"], images=[[png]], **kw)
    with pytest.raises(InputError, match="video"):
        generate(vl_model, tok, ["a"], images=[[tmp_path / "clip.mp4"]], **kw)
    with pytest.raises(InputError, match="video"):
        generate(vl_model, tok, [[{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]}]],
                 chat=True, **kw)
    with pytest.raises(InputError, match="video"):
        generate(vl_model, tok, ["a ]<]video[>["], images=[[png]], **kw)
    with pytest.raises(InputError, match="not fetched"):
        generate(vl_model, tok, [[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]], chat=True, **kw)
    pixel_values, grid = load_prompt_images(vl_model, [png])
    with pytest.raises(InputError, match="hold 0 image tokens .* give 6 features"):
        embed_with_images(vl_model, torch.tensor([1, 2, 3]), pixel_values, grid)


def test_text_only_checkpoint_refuses_images(tiny_bf16, png):
    model = load_model(tiny_bf16, dtype=torch.float32)
    tok = load_tokenizer(tiny_bf16)
    with pytest.raises(InputError, match=f"{tiny_bf16}.*no vision tower"):
        generate(model, tok, ["hi"], images=[[png]], max_new_tokens=1)
    with pytest.raises(InputError, match="no vision tower"):
        forward_with_images(model, torch.tensor([[1, 2]]), torch.zeros(16, 1176), torch.tensor([[1, 4, 4]]))


def test_requests_with_images_decode_in_a_batch_as_alone(vl_model, tok, png):
    """Continuous batching with images: prompts with and without images through two slots (refilled), each the
    tokens it gets alone."""
    prompts = ["what is it", "describe nothing", "and this one?", "count"]
    images = [[png], None, [png, png], [png]]
    kw = dict(max_new_tokens=[4, 6, 3, 5], temperature=[0, 0.9, 0, 1.0], seed=[1, 2, 3, 4], stop_ids=[])
    together = generate(vl_model, tok, prompts, images=images, max_batch_size=2, **kw)
    for i in range(len(prompts)):
        alone = generate(vl_model, tok, [prompts[i]], images=[images[i]], stop_ids=[],
                         **{k: [v[i]] for k, v in kw.items() if k != "stop_ids"})[0]
        assert together[i].token_ids == alone.token_ids, i
