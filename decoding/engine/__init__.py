"""The engine: requests and sequences (``sequence.py``), the scheduler (``scheduler.py``), the running batch, the one
owner of what a row is (``batch.py``), one step over the batch (``step.py``),
the build that makes the engine's parts once (``build.py``, ``parts.py``), the engine that steps them (``engine.py``)
and the thread that feeds it (``runner.py``).

The engine's public names load on first use, so importing a part (``decoding.engine.batch``) loads only that
part.
"""

from __future__ import annotations

import importlib
from typing import Any

# Whole module names (a baseline checkout's import rewriting finds them as such: bench/baseline.py).
_ENGINE, _SEQUENCE, _PADDING = "decoding.engine.engine", "decoding.engine.sequence", "decoding.model.padding"
_PUBLIC = {
    "Engine": _ENGINE, "EngineError": _SEQUENCE, "GenerationResult": _SEQUENCE, "Prepared": _SEQUENCE,
    "Request": _SEQUENCE, "StepOutput": _SEQUENCE, "encode_request": _SEQUENCE, "eos_token_ids": _SEQUENCE,
    "prefill_groups": _PADDING,
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'decoding.engine' has no attribute {name!r}")
