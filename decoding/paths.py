"""Where specbatch keeps what it builds once per machine: converted models, compiled kernels and layer stacks,
measured forward costs (``SPECBATCH_CACHE``, else ``$XDG_CACHE_HOME/specbatch``, else ``~/.cache/specbatch``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    if "SPECBATCH_CACHE" in os.environ:
        return Path(os.environ["SPECBATCH_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specbatch"
