"""specbatch's engine: lossless multi-candidate speculative decoding over HuggingFace causal LMs (no Ray).

The engine's names load on first use: ``decoding.config`` and ``decoding.stats`` stay free of
torch, so Ray Data's read and write workers, which need only them, do not import torch and transformers (5 s of
CPU each, taken from the engine actor on a small node while it generates).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from decoding.config import Config, SamplingParams, SpeculativeConfig, load_config

if TYPE_CHECKING:
    from decoding.engine.engine import Engine, GenerationResult, Request, StepOutput

_FROM_ENGINE = ("Engine", "GenerationResult", "Request", "StepOutput")

__all__ = [
    "Config", "Engine", "GenerationResult", "Request", "SamplingParams", "SpeculativeConfig", "StepOutput",
    "load_config",
]


def __getattr__(name: str) -> Any:
    if name in _FROM_ENGINE:
        return getattr(importlib.import_module("decoding.engine.engine"), name)
    raise AttributeError(f"module 'decoding' has no attribute {name!r}")
