"""minimax-ref: a readable pure-PyTorch reference inference engine for MiniMax-M3 (minimax_m3_vl).

    import torch, minimax_ref as mr
    model = mr.load_model(path, device="cpu", dtype=torch.float32)   # path=None: the embedded default
    logits = model(input_ids)                  # [B, S] -> fp32 [B, S, vocab]
    tok = mr.load_tokenizer(path)                                     # path=None: the embedded default's
    results = mr.generate(model, tok, ["Hello"], max_new_tokens=32)
    scores = mr.score(model, tok, [("The capital of France is", " Paris.")])   # per-token NLL + summary

The public names are imported on first use (PEP 562), so `import minimax_ref` and the `minimax-ref`
program start without importing torch: a Ctrl-C in the first seconds reaches the CLI's handler.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

__version__ = "0.1.0"

# public name -> the module defining it
_EXPORTS = {
    "parse_output": "generation.chat",
    "open_checkpoint": "weights.checkpoint",
    "ModelConfig": "model.config", "RuntimeConfig": "model.config", "TextConfig": "model.config",
    "VisionConfig": "model.config", "load_model_config": "model.config",
    "DSparkDrafter": "generation.drafter", "load_drafter": "generation.drafter",
    "CheckpointError": "errors", "ConfigError": "errors", "InputError": "errors", "MiniMaxRefError": "errors",
    "QuantFormatError": "errors", "NumericsError": "errors",
    "GenerationResult": "generation.generate", "SamplingParams": "generation.generate",
    "generate": "generation.generate", "generate_ids": "generation.generate",
    "load_model": "weights.loader",
    "MiniMaxM3": "model.decoder",
    "Interventions": "research.trace", "Trace": "research.trace",
    "OffloadConfig": "weights.offload",
    "Scores": "research.score", "score": "research.score",
    "Tokenizer": "generation.tokenizer", "load_tokenizer": "generation.tokenizer",
}

__all__ = [
    "load_model", "load_tokenizer", "load_drafter", "DSparkDrafter", "generate", "generate_ids", "parse_output",
    "open_checkpoint",
    "load_model_config", "MiniMaxM3", "Trace", "Interventions", "OffloadConfig", "score", "Scores", "Tokenizer",
    "SamplingParams",
    "GenerationResult",
    "ModelConfig", "TextConfig", "VisionConfig", "RuntimeConfig",
    "MiniMaxRefError", "ConfigError", "CheckpointError", "QuantFormatError", "InputError", "NumericsError",
]


def __getattr__(name: str) -> _Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'minimax_ref' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, "__version__"})




if _TYPE_CHECKING:
    from .errors import CheckpointError, ConfigError, InputError, MiniMaxRefError, NumericsError, QuantFormatError
    from .generation.chat import parse_output
    from .generation.drafter import DSparkDrafter, load_drafter
    from .generation.generate import GenerationResult, SamplingParams, generate, generate_ids
    from .generation.tokenizer import Tokenizer, load_tokenizer
    from .model.config import ModelConfig, RuntimeConfig, TextConfig, VisionConfig, load_model_config
    from .model.decoder import MiniMaxM3
    from .research.score import Scores, score
    from .research.trace import Interventions, Trace
    from .weights.checkpoint import open_checkpoint
    from .weights.loader import load_model
    from .weights.offload import OffloadConfig
