"""minimax-ref: a readable pure-PyTorch reference inference engine for MiniMax-M3 (minimax_m3_vl).

    import torch, minimax_ref as mr
    model = mr.load_model(path, device="cpu", dtype=torch.float32)
    logits = model(input_ids)                  # [B, S] -> fp32 [B, S, vocab]
    tok = mr.load_tokenizer(path)
    results = mr.generate(model, tok, ["Hello"], max_new_tokens=32)
"""

from .chat import parse_output
from .checkpoint import open_checkpoint
from .config import ModelConfig, RuntimeConfig, TextConfig, VisionConfig, load_model_config
from .drafter import DSparkDrafter, load_drafter
from .errors import CheckpointError, ConfigError, InputError, MiniMaxRefError, QuantFormatError
from .generate import GenerationResult, SamplingParams, generate, generate_ids
from .loader import load_model
from .model import MiniMaxM3, Trace
from .tokenizer import Tokenizer, load_tokenizer

__version__ = "0.1.0"

__all__ = [
    "load_model", "load_tokenizer", "load_drafter", "DSparkDrafter", "generate", "generate_ids", "parse_output",
    "open_checkpoint",
    "load_model_config", "MiniMaxM3", "Trace", "Tokenizer", "SamplingParams", "GenerationResult",
    "ModelConfig", "TextConfig", "VisionConfig", "RuntimeConfig",
    "MiniMaxRefError", "ConfigError", "CheckpointError", "QuantFormatError", "InputError",
]
