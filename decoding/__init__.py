"""specbatch's engine: lossless multi-candidate speculative decoding over HuggingFace causal LMs (no Ray)."""

from decoding.config import Config, SamplingParams, SpeculativeConfig, load_config
from decoding.engine import Engine, GenerationResult, Request, StepOutput

__all__ = [
    "Config",
    "Engine",
    "GenerationResult",
    "Request",
    "SamplingParams",
    "SpeculativeConfig",
    "StepOutput",
    "load_config",
]
