"""Model paths on any filesystem pyarrow knows (``s3://``, ``gs://``, ``hdfs://``, ...), as local copies
(``decoding.paths.localize``): transformers loads from a local directory, and the config handed to the engine
names the copy."""

from __future__ import annotations

from decoding.config import Config
from decoding.paths import is_uri, localize

__all__ = ["is_uri", "localize", "localize_models"]


def localize_models(config: Config) -> Config:
    """``config`` with every model path that is a URI replaced by its local copy."""
    spec = config.speculative
    fields = {name: getattr(spec, name) for name in ("model", "acceptance_head", "decision_model")}
    remote = {name: localize(value) for name, value in fields.items() if is_uri(value)}
    if not remote and not is_uri(config.model):
        return config
    return config.model_copy(update={
        "model": localize(config.model),
        "speculative": spec.model_copy(update=remote),
    })
