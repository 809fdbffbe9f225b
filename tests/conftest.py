"""Shared fixtures: tiny random models (in memory and saved as model directories) and a local Ray cluster."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny import noisy_copy, tiny_model, tiny_tokenizer  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


# Engine tests run on every device this machine has: the CUDA path is tested wherever a GPU is present.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="session", params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def target():
    return tiny_model()


@pytest.fixture(scope="session")
def draft(target):
    return noisy_copy(target, 0.05)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, tokenizer, target, draft) -> dict[str, str]:
    """Target and draft saved as ordinary model directories, for code that loads models by path."""
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, model in (("target", target), ("draft", draft)):
        path = root / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = str(path)
    return paths


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session (starting one costs seconds)."""
    import ray

    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    ray.init(num_cpus=4, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.exists():
        pytest.fail(f"../shared not found at {SHARED}")
    return SHARED


# Tiny models gain nothing from threads, and on a shared 2-core machine spinning OpenMP threads cost a lot.
torch.set_num_threads(1)
