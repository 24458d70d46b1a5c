"""The nano training pipeline (examples/nano): training through the engine's model, quantization-aware
training that sees exactly what the export writes, and (slow) the whole run on CPU at micro size:
data -> tokenizer -> 20 training steps -> export -> load_model -> generate with the CLI -> eval."""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `examples.nano`

from examples.nano import data as nd  # noqa: E402
from examples.nano import export as nx  # noqa: E402
from examples.nano import train as nt  # noqa: E402
from examples.nano.tokenizer import train_tokenizer  # noqa: E402
from minimax_ref.generation import chat  # noqa: E402
from minimax_ref.generation.tokenizer import load_tokenizer  # noqa: E402
from minimax_ref.model.config import parse_model_config  # noqa: E402
from minimax_ref.model.decoder import MiniMaxM3  # noqa: E402
from minimax_ref.research.trace import Trace  # noqa: E402
from minimax_ref.weights.loader import load_model  # noqa: E402
from minimax_ref.weights.quant import dequant_mxfp8, dequant_nvfp4, quantize_mxfp8, quantize_nvfp4  # noqa: E402


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """(generator, tokenizer dir, raw config, model) at the micro size, initialised as train.py does."""
    heldout = nd.make_heldout(0)
    gen = nd.TaskGenerator(heldout, fonts=("",))
    tok_dir = tmp_path_factory.mktemp("micro-tok")
    size = nt.SIZES["micro"]
    special = train_tokenizer(nd.tokenizer_texts(gen, 300, 0), size.text["vocab_size"], tok_dir)
    raw = nx.raw_config(size.text, size.vision, special)
    model = MiniMaxM3(parse_model_config(raw))
    nt.init_weights(model, 0)
    return gen, tok_dir, raw, model


def test_vectorised_nvfp4_fake_quant_is_the_codec():
    g = torch.Generator().manual_seed(0)
    w1, w3 = torch.randn(4, 32, 64, generator=g) * 0.05, torch.randn(4, 32, 64, generator=g) * 0.2
    w1[1] = 0.0
    w3[1] = 0.0
    pair = [max(float(w1[e].abs().max()), float(w3[e].abs().max())) for e in range(4)]
    want = torch.stack([dequant_nvfp4(*quantize_nvfp4(w1[e], global_amax=pair[e])) for e in range(4)])
    assert torch.equal(nt.fake_quant_weight(w1, "nvfp4", w3), want)
    want = torch.stack([dequant_nvfp4(*quantize_nvfp4(w3[e])) for e in range(4)])
    assert torch.equal(nt.fake_quant_weight(w3, "nvfp4"), want)
    w = torch.randn(16, 64, generator=g)
    assert torch.equal(nt.fake_quant_weight(w, "mxfp8"), dequant_mxfp8(*quantize_mxfp8(w)))


def test_one_training_step_reaches_every_trainable_parameter(micro):
    """The engine's forward is differentiable end to end: the LM loss reaches every weight but the
    indexer (its top-k is discrete), the indexer KL reaches the indexer, images reach the vision tower."""
    gen, tok_dir, raw, model = micro
    model = MiniMaxM3(parse_model_config(raw))
    nt.init_weights(model, 1)
    params = nt.make_trainable(model)
    tok = load_tokenizer(tok_dir)
    rng = random.Random(0)
    examples = [gen.image(rng, thinking="enabled"), gen.arithmetic(rng, thinking="enabled"),
                gen.tool(rng, stage="answer")]
    tokenized = [nd.tokenize_example(ex, tok) for ex in examples]
    T = max(len(t.ids) for t in tokenized)
    rows = [nd.PackedRow(t.ids + [0] * (T - len(t.ids)), t.loss + [False] * (T - len(t.ids)),
                         [t.image] if t.image else [], [t.kind]) for t in tokenized]
    batch = nd.collate(rows)
    assert T > 16 and batch["pixel_values"] is not None  # longer than the micro MSA's dense range
    capture = nt.IndexerCapture(model)
    trace = Trace(layers=set())
    loss, _, _ = nt.lm_loss(model, batch, torch.device("cpu"), trace)
    aux = sum(nt.indexer_kl(model.layers[i].self_attn, *capture.inputs[i], 8, torch.Generator().manual_seed(0))
              for i in capture.inputs)
    (loss + aux).backward()
    capture.remove()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert not missing and len(params) == sum(p.requires_grad for p in model.parameters())
    assert sorted(trace.routing) == [i for i, moe in enumerate(model.text.moe_layers) if moe]
    bias = model.layers[1].block_sparse_moe.gate.e_score_correction_bias
    before = bias.clone()
    nt.update_routing_bias(model, trace, 0.01)
    assert not torch.equal(before, bias) and bias.grad is None


def test_export_holds_exactly_what_qat_trains(micro, tmp_path):
    gen, tok_dir, raw, model = micro
    nt.enable_qat(model)
    expect_w1 = model.layers[1].block_sparse_moe.experts.w1.detach().clone()
    expect_q = model.layers[1].self_attn.q_proj.weight.detach().clone()
    nt.disable_qat(model)
    scales = {("layers.1.block_sparse_moe.experts", "w2", 0): 0.0125}
    # a tokenizer folder with some other chat template: the export writes the project's own
    old_tok = tmp_path / "tok"
    shutil.copytree(tok_dir, old_tok)
    (old_tok / "chat_template.jinja").write_text("{{ messages[0].content }}", encoding="utf-8")
    out = nx.write_checkpoint(model, raw, tmp_path / "ckpt", old_tok, input_scales=scales,
                              preprocessor={"min_pixels": 3136, "max_pixels": 25088})
    assert (out / "chat_template.jinja").read_text(encoding="utf-8") == chat.CHAT_TEMPLATE
    loaded = load_model(out, dtype=torch.float32)
    assert torch.equal(loaded.layers[1].block_sparse_moe.experts.w1, expect_w1)
    assert torch.equal(loaded.layers[1].self_attn.q_proj.weight, expect_q)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.bfloat16().float())
    assert torch.equal(loaded.layers[1].block_sparse_moe.gate.weight, model.layers[1].block_sparse_moe.gate.weight)
    assert float(loaded.layers[1].block_sparse_moe.experts.w2_input_scale[0]) == pytest.approx(0.0125)
    assert float(loaded.layers[1].block_sparse_moe.experts.w2_input_scale[1]) == 1.0  # not calibrated: 1.0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {nx.SHARD}
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_algo"] == "MIXED_PRECISION"


def test_a_frozen_part_keeps_its_stored_bytes(micro, tmp_path):
    """`write_checkpoint(keep=stored_tensors(...))` (what `train.py --train vision` passes for the frozen text model):
    the kept tensors are written byte for byte as the earlier checkpoint stored them, the others encoded from the
    model; a kept tensor the export does not write, or of another shape, is refused."""
    gen, tok_dir, raw, model = micro
    first = nx.write_checkpoint(model, raw, tmp_path / "first", tok_dir)
    again = MiniMaxM3(parse_model_config(raw))
    nt.load_init(again, first)
    with torch.no_grad():
        again.layers[0].self_attn.q_proj.weight.mul_(1.5)  # a change in the text model, which `keep` overrides
        again.lm_head.weight.add_(1.0)
    text = nx.stored_tensors(first, "language_model.")
    assert text and all(name.startswith("language_model.") for name in text)
    out = nx.write_checkpoint(again, raw, tmp_path / "second", tok_dir, keep=text)
    stored = nx.stored_tensors(out, "")
    assert all(torch.equal(stored[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
               for name, t in text.items())
    assert set(stored) - set(text)  # the rest (the vision tower) encoded from the model
    name = next(n for n in text if n.endswith("q_proj.weight"))
    with pytest.raises(ValueError, match="kept tensors"):
        nx.write_checkpoint(again, raw, tmp_path / "third", tok_dir, keep={name: text[name][:1]})
    with pytest.raises(ValueError, match="kept tensors"):
        nx.write_checkpoint(again, raw, tmp_path / "third", tok_dir, keep={"language_model.nothing": text[name]})


@pytest.mark.slow
def test_micro_pipeline_end_to_end(tmp_path, capsys):
    from examples.nano import eval as ne
    from minimax_ref.cli.main import main as cli_main

    out = tmp_path / "micro"
    nt.main(["--size", "micro", "--device", "cpu", "--steps", "20", "--out", str(out), "--workers", "0",
             "--log-every", "10", "--eval-every", "10", "--calib-batches", "2", "--qat-start", "0.5",
             "--drafter", "--drafter-minutes", "0.05"])
    run = json.loads((out / "nano_run.json").read_text())
    assert run["steps"] == 20 and run["qat"] and run["checkpoint_bytes"] < 2_000_000
    # the optional DSpark stage: exported, loaded, and lossless under greedy speculative decoding
    assert (out / "dspark" / "config.json").is_file() and run["drafter"]["greedy_identical"]
    assert run["drafter"]["mean_accepted_length"] >= 1.0
    log = [json.loads(line) for line in (tmp_path / "micro-run" / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert losses[-1] < losses[0]
    # the exported checkpoint computes what the trained (fake-quantized) model computed
    assert run["teacher_forced_eval_quantized"].keys() == run["teacher_forced_eval"].keys()

    model = load_model(out, dtype=torch.float32)
    assert model.vision_tower is not None and model.text.num_local_experts == 4
    capsys.readouterr()
    assert cli_main(["inspect", str(out)]) == 0
    assert "problems    0" in capsys.readouterr().out
    code = cli_main(["generate", "--ckpt-path", str(out), "--chat", "--thinking", "enabled", "--prompt",
                     "What is 17*23?", "--max-new-tokens", "12", "--output-format", "json", "--dtype", "float32"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and len(row["token_ids"]) <= 12 and row["finish_reason"] in ("stop", "length")

    ne.main(["--ckpt-path", str(out), "--dtype", "float32", "--n-cities", "2", "--n-orders", "2", "--n-arith", "2",
             "--n-long", "2", "--n-images", "2", "--max-new-tokens", "16", "--n-speculative", "2",
             "--out", str(tmp_path / "eval.json")])
    summary = json.loads((tmp_path / "eval.json").read_text())
    assert summary["seed_checks"]["arithmetic_17x23"]["pass"] in (True, False)
    assert "error" not in summary["seed_checks"]["tool_call_lisbon"]
    assert summary["copying"]["cities"]["n"] == 2 and summary["images"]["n"] == 2
    assert summary["long_name_copying"]["all"]["n"] == 2 and summary["long_name_copying"]["heldout"].endswith(
        "nano_run.json")
    assert summary["dspark"]["greedy_identical"]

    # the seed's pruning study, replayed on the micro model (keep 62.5 % of 4 experts = 2)
    from examples.nano import prune_study as ps

    capsys.readouterr()
    ps.main(["--ckpt-path", str(out), "--out", str(tmp_path / "study"), "--n-traces", "3", "--max-new-tokens", "8",
             "--n-cities", "2", "--n-orders", "2", "--n-arith", "2", "--batch", "4"])
    study = json.loads((tmp_path / "study" / "study.json").read_text())
    assert study["keep"] == 2 and study["score"]["traces"] == 3
    assert 0.0 <= study["score"]["top1_agreement"] <= 1.0 and study["bytes"]["pruned"] < study["bytes"]["full"]
    assert "| nano, pruned 2 of 4 | 2 |" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- vision pretraining


def test_place_targets_and_read_number_by_hand():
    from examples.nano import pretrain_vision as pv

    none = pv.NONE
    assert pv.place_targets([427, 5, 1000]).tolist() == [[4, 2, 7, none], [5, none, none, none], [1, 0, 0, 0]]
    rows = [[4, 2, 7, none], [5, none, none, none], [1, 0, 0, 0], [3, none, 4, none]]
    logits = torch.nn.functional.one_hot(torch.tensor(rows), none + 1).float()
    assert pv.read_number(logits) == ["427", "5", "1000", "3"]  # digits up to the first "none"
    with pytest.raises(ValueError, match="12345"):
        pv.place_targets([7, 12345])


def test_readout_reads_each_image_on_its_own():
    """Images back to back, padded inside the head: an image's logits do not depend on its neighbours."""
    from examples.nano import pretrain_vision as pv

    torch.manual_seed(0)
    head = pv.Readout(dim=12, width=16)
    counts = [2, 5, 3]
    tokens = torch.randn(sum(counts), 12)
    together = head(tokens, counts)
    assert together.shape == (3, pv.PLACES, pv.NONE + 1)
    parts = tokens.split(counts)
    for i, part in enumerate(parts):
        torch.testing.assert_close(head(part, [counts[i]])[0], together[i], rtol=1e-5, atol=1e-6)


def test_vision_pretraining_hands_its_tower_to_train_py(tmp_path):
    """A two-step CPU run writes the engine-named tower and projector, which `train.py --vision-init` loads
    (every tensor, bit for bit); a file that is not this model's vision tower is refused with the names."""
    from safetensors.torch import load_file, save_file

    from examples.nano import pretrain_vision as pv
    from minimax_ref.weights.embedded import default_checkpoint

    out = tmp_path / "vision"
    pv.main(["--device", "cpu", "--steps", "2", "--batch", "4", "--eval-images", "4", "--log-every", "1",
             "--fonts", "builtin", "--out", str(out)])
    run = json.loads((out / "vision_run.json").read_text())
    assert run["steps"] == 2 and run["images"] == 8 and set(run["eval"]) == {"heldout", "seed_427"}
    state = load_file(str(out / "vision.safetensors"))
    cfg = parse_model_config(json.loads((default_checkpoint() / "config.json").read_text()))
    model = MiniMaxM3(cfg)
    nt.init_weights(model, 1)
    nt.load_vision(model, out / "vision.safetensors")
    own = model.state_dict()
    assert state.keys() == {k for k in own if k.startswith(("vision_tower.", "projector."))}
    assert all(torch.equal(own[k], v) for k, v in state.items())
    state.pop("projector.linear_1.weight")
    save_file(state, str(tmp_path / "partial.safetensors"))
    with pytest.raises(SystemExit, match="missing \\['projector.linear_1.weight'\\]"):
        nt.load_vision(model, tmp_path / "partial.safetensors")
    with pytest.raises(SystemExit, match="no such file"):
        nt.load_vision(model, tmp_path / "absent.safetensors")


def test_drafter_continues_from_an_exported_dspark_folder():
    """`train_drafter.py --init DIR`: the shipped drafter's weights, decoded as inference reads them, land in
    the fresh drafter; a drafter of another shape is refused with what to do."""
    import minimax_ref as mr
    from examples.nano import train_drafter as td
    from minimax_ref.generation.drafter import DSparkDrafter, load_drafter
    from minimax_ref.model.config import parse_drafter_config
    from minimax_ref.weights.embedded import default_checkpoint

    ckpt = default_checkpoint()
    target = mr.load_model(ckpt, dtype=torch.float32)
    noise = mr.load_tokenizer(ckpt).special_ids.dspark_noise

    def fresh(ffn: int) -> DSparkDrafter:
        raw = td.drafter_raw_config(target, noise, 7, 1, ffn, 512, 32)
        drafter = DSparkDrafter(parse_drafter_config(raw, target.text), target.text.num_hidden_layers)
        td.init_drafter(drafter, 0)
        return drafter

    drafter = fresh(512)
    td.continue_from(drafter, ckpt / "dspark", target)
    want = load_drafter(ckpt / "dspark", target).state_dict()
    got = drafter.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k].float()) for k in want)
    assert all(p.requires_grad for p in drafter.parameters())
    with pytest.raises(SystemExit, match="another drafter shape"):
        td.continue_from(fresh(256), ckpt / "dspark", target)
