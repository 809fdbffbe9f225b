"""specbatch: distributed batch generation with lossless multi-candidate speculative decoding.

The public Python API (docs/reference.md, "Python API"), re-exported from the four rooms where it lives::

    import ray
    import specbatch

    config = specbatch.ProcessorConfig(model_source="smollm2-135m-instruct")  # Ray Data LLM's fields
    processor = specbatch.build_processor(config, preprocess=lambda row: {"prompt": row["text"]})
    ds = processor(ray.data.from_items([{"text": "The capital of France is"}]))

The engine's names load on first use (as ``decoding``'s do): a driver that builds a processor or runs a job never
builds an engine itself, and importing torch and transformers cost it 6-7 CPU-seconds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import decoding
from decoding.config import Config, SamplingParams, SpeculativeConfig, load_config
from pipeline.job import run as generate
from pipeline.processor import Processor, build_llm_processor, build_processor
from pipeline.processor_config import (
    ChatTemplateStageConfig,
    DetokenizeStageConfig,
    PrepareMultimodalStageConfig,
    ProcessorConfig,
    TokenizerStageConfig,
)

if TYPE_CHECKING:
    from decoding.engine.engine import Engine, GenerationResult, Request

# Ray Data LLM's class name, so a job switches by changing its import alone.
vLLMEngineProcessorConfig = ProcessorConfig  # noqa: N816

__all__ = [
    "ChatTemplateStageConfig", "Config", "DetokenizeStageConfig", "Engine", "GenerationResult",
    "PrepareMultimodalStageConfig", "Processor", "ProcessorConfig", "Request", "SamplingParams", "SpeculativeConfig",
    "TokenizerStageConfig", "build_llm_processor", "build_processor", "generate", "load_config",
    "vLLMEngineProcessorConfig",
]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "GenerationResult", "Request"):
        return getattr(decoding, name)
    raise AttributeError(f"module 'specbatch' has no attribute {name!r}")
