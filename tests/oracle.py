"""The independent oracle: transformers 5.23's MiniMax-M3 implementation, loaded with the same
decoded weights as a minimax-ref model. Test-only."""

from __future__ import annotations

import torch


def hf_text_config(model, attn_impl: str = "eager"):
    """The transformers text config of minimax-ref `model`."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLConfig

    raw = dict(model.config.raw)
    raw.pop("quantization_config", None)
    vl = MiniMaxM3VLConfig(**{k: v for k, v in raw.items() if k in ("text_config", "vision_config")})
    tc = vl.text_config
    tc._attn_implementation = attn_impl
    return tc


def hf_text_model(model, attn_impl: str = "eager"):
    """A `MiniMaxM3VLForCausalLM` (fp32) carrying exactly the weights of minimax-ref `model`."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    hf = MiniMaxM3VLForCausalLM(hf_text_config(model, attn_impl)).eval()
    sd = {k: v.detach().float().clone() for k, v in hf_text_state_dict(model).items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary" not in k and "inv_freq" not in k]
    assert not missing and not unexpected, (missing, unexpected)
    return hf.float()


def hf_text_state_dict(model) -> dict:
    """minimax-ref `model`'s text weights under transformers' `MiniMaxM3VLForCausalLM` names (the tensors
    themselves, not copies; the experts' gate/up stacks are concatenated)."""
    sd = {}
    t = model.config.text
    sd["model.embed_tokens.weight"] = model.embed_tokens.weight
    sd["model.norm.weight"] = model.norm.weight
    sd["lm_head.weight"] = model.lm_head.weight
    for L, layer in enumerate(model.layers):
        p = f"model.layers.{L}."
        sd[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        a = layer.self_attn
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{n}.weight"] = getattr(a, n).weight
        sd[p + "self_attn.q_norm.weight"] = a.q_norm.weight
        sd[p + "self_attn.k_norm.weight"] = a.k_norm.weight
        if t.sparse_layers[L]:
            sd[p + "self_attn.indexer.q_proj.weight"] = a.index_q_proj.weight
            sd[p + "self_attn.indexer.k_proj.weight"] = a.index_k_proj.weight
            sd[p + "self_attn.indexer.q_norm.weight"] = a.index_q_norm.weight
            sd[p + "self_attn.indexer.k_norm.weight"] = a.index_k_norm.weight
        if t.moe_layers[L]:
            m = layer.block_sparse_moe
            sd[p + "mlp.gate.weight"] = m.gate.weight
            # transformers always builds the routing bias and a shared expert: a model without them is transformers'
            # with a zero bias (the same choice) and a zero shared expert (adding nothing)
            bias = m.gate.e_score_correction_bias
            sd[p + "mlp.gate.e_score_correction_bias"] = (bias if bias is not None
                                                          else torch.zeros(t.num_local_experts))
            sd[p + "mlp.experts.gate_up_proj"] = torch.cat([m.experts.w1, m.experts.w3], dim=1)
            sd[p + "mlp.experts.down_proj"] = m.experts.w2
            s = m.shared_experts
            if s is None:
                H, inter = t.hidden_size, t.shared_intermediate_size
                sd[p + "mlp.shared_experts.gate_up_proj.weight"] = torch.zeros(2 * inter, H)
                sd[p + "mlp.shared_experts.down_proj.weight"] = torch.zeros(H, inter)
            else:
                sd[p + "mlp.shared_experts.gate_up_proj.weight"] = torch.cat([s.gate_proj.weight, s.up_proj.weight],
                                                                             0)
                sd[p + "mlp.shared_experts.down_proj.weight"] = s.down_proj.weight
        else:
            d = layer.mlp
            sd[p + "mlp.gate_up_proj.weight"] = torch.cat([d.gate_proj.weight, d.up_proj.weight], 0)
            sd[p + "mlp.down_proj.weight"] = d.down_proj.weight
    return sd


def relative_max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to the logit scale (max |b|)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def release_to_transformers(release_name: str) -> str:
    """Rename a release tensor name the way transformers' checkpoint conversion mapping does."""
    import re

    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    for rule in get_checkpoint_conversion_mapping("minimax_m3_vl"):
        if type(rule).__name__ != "WeightRenaming":
            continue
        source, target = rule.source_patterns[0], rule.target_patterns[0]
        if re.search(source, release_name):
            return re.sub(source, target, release_name)
    raise AssertionError(f"no transformers renaming for {release_name}")


def hf_vl_model(model, attn_impl: str = "eager"):
    """A `MiniMaxM3SparseForConditionalGeneration` (fp32) carrying exactly the weights of minimax-ref
    `model` (a checkpoint with a vision tower): the text weights mapped as `hf_text_model` maps them,
    the vision tower and projector renamed from their release names by transformers' own conversion
    mapping."""
    from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig

    from minimax_ref.model.vision import PROJECTOR_RELEASE_NAMES, VISION_PREFIX

    raw = model.config.raw
    keys = ("text_config", "vision_config", "image_token_index", "video_token_index", "projector_hidden_size")
    cfg = MiniMaxM3VLConfig(**{k: raw[k] for k in keys if k in raw})
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = attn_impl
    hf = MiniMaxM3SparseForConditionalGeneration(cfg).eval()

    sd = {}
    text = hf_text_model(model, attn_impl)
    for name, value in text.state_dict().items():  # "model.X" -> "model.language_model.X"
        if "rotary" not in name and "inv_freq" not in name:
            sd[name if name.startswith("lm_head.") else "model.language_model." + name[len("model."):]] = value
    for key, value in model.vision_tower.state_dict().items():
        sd[release_to_transformers(VISION_PREFIX + key)] = value
    to_release = {local: release for release, local in PROJECTOR_RELEASE_NAMES.items()}
    for key, value in model.projector.state_dict().items():
        head = key[: key.index(".") + 1]
        sd[release_to_transformers(to_release[head] + key[len(head):])] = value
    sd = {k: v.detach().float().clone() for k, v in sd.items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary" not in k and "inv_freq" not in k]
    assert not missing and not unexpected, (missing, unexpected)
    return hf.float()
