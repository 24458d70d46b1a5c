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

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module defining it
_EXPORTS = {
    "parse_output": "chat",
    "open_checkpoint": "checkpoint",
    "ModelConfig": "config", "RuntimeConfig": "config", "TextConfig": "config", "VisionConfig": "config",
    "load_model_config": "config",
    "DSparkDrafter": "drafter", "load_drafter": "drafter",
    "CheckpointError": "errors", "ConfigError": "errors", "InputError": "errors", "MiniMaxRefError": "errors",
    "QuantFormatError": "errors", "NumericsError": "errors",
    "GenerationResult": "generate", "SamplingParams": "generate", "generate": "generate", "generate_ids": "generate",
    "load_model": "loader",
    "Interventions": "model", "MiniMaxM3": "model", "Trace": "model",
    "OffloadConfig": "offload",
    "Scores": "score", "score": "score",
    "Tokenizer": "tokenizer", "load_tokenizer": "tokenizer",
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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'minimax_ref' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Importing a submodule binds it on its package; `generate` and `score` are both submodules and public
    functions, and the public name must stay the function (as `mr.generate(...)` promises)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:
    from .chat import parse_output
    from .checkpoint import open_checkpoint
    from .config import ModelConfig, RuntimeConfig, TextConfig, VisionConfig, load_model_config
    from .drafter import DSparkDrafter, load_drafter
    from .errors import CheckpointError, ConfigError, InputError, MiniMaxRefError, NumericsError, QuantFormatError
    from .generate import GenerationResult, SamplingParams, generate, generate_ids
    from .loader import load_model
    from .model import Interventions, MiniMaxM3, Trace
    from .offload import OffloadConfig
    from .score import Scores, score
    from .tokenizer import Tokenizer, load_tokenizer
