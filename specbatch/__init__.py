"""specbatch: distributed batch generation with lossless multi-candidate speculative decoding.

The public Python API (SPEC "Python API"), re-exported from the four rooms where it lives::

    import ray
    import specbatch

    processor = specbatch.build_processor(specbatch.Config(), preprocess=lambda row: {"prompt": row["text"]})
    ds = processor(ray.data.from_items([{"text": "The capital of France is"}]))
"""

from decoding.config import Config, SamplingParams, SpeculativeConfig, load_config
from decoding.engine import Engine, GenerationResult, Request
from pipeline.job import run as generate
from pipeline.processor import Processor, build_processor

__all__ = [
    "Config", "Engine", "GenerationResult", "Processor", "Request", "SamplingParams", "SpeculativeConfig",
    "build_processor", "generate", "load_config",
]
