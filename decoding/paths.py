"""Where specbatch keeps what it builds once per machine: converted models, compiled kernels and layer stacks,
measured forward costs, local copies of remote models and adapters (``SPECBATCH_CACHE``, else
``$XDG_CACHE_HOME/specbatch``, else ``~/.cache/specbatch``).

Paths on any filesystem pyarrow knows (``s3://``, ``gs://``, ``hdfs://``, ...) are copied once per machine into the
cache (keyed by the URI) with pyarrow's own filesystem client: transformers and safetensors read local files.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pyarrow.fs as pafs
from filelock import FileLock

_DONE = ".specbatch-copied"


def cache_dir() -> Path:
    if "SPECBATCH_CACHE" in os.environ:
        return Path(os.environ["SPECBATCH_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specbatch"


def is_uri(path: str | None) -> bool:
    """A path with a scheme other than ``file://`` (those need a filesystem client)."""
    return bool(path) and "://" in path and not path.startswith("file://")


def localize(uri: str) -> str:
    """A local copy of the directory or file ``uri`` (made on first use)."""
    if not is_uri(uri):
        return uri.removeprefix("file://")
    target = cache_dir() / "remote" / hashlib.sha1(uri.encode()).hexdigest()[:16]
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    if (target / _DONE).exists():
        return str(target / name) if (target / name).is_file() else str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / _DONE).exists():
            shutil.rmtree(target, ignore_errors=True)  # an interrupted copy
            fs, path = pafs.FileSystem.from_uri(uri)
            kind = fs.get_file_info(path).type
            if kind == pafs.FileType.NotFound:
                raise FileNotFoundError(f"{uri} does not exist")
            local = target / name if kind == pafs.FileType.File else target
            target.mkdir()
            pafs.copy_files(path, str(local), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
            (target / _DONE).touch()
    return str(target / name) if (target / name).is_file() else str(target)
