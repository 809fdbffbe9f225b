"""Model paths on any filesystem pyarrow knows (``s3://``, ``gs://``, ``hdfs://``, ...), as local copies.

transformers loads from a local directory; a model given as a URI is copied once per machine into the cache
(keyed by the URI) with pyarrow's own filesystem client, and the config handed to the engine names the copy.
"""

from __future__ import annotations

import hashlib
import shutil

import pyarrow.fs as pafs
from filelock import FileLock

from decoding.config import Config
from decoding.paths import cache_dir

_DONE = ".specbatch-copied"


def is_uri(path: str | None) -> bool:
    """A path with a scheme other than ``file://`` (those need a filesystem client)."""
    return bool(path) and "://" in path and not path.startswith("file://")


def localize(uri: str) -> str:
    """A local copy of the model directory or file ``uri`` (made on first use)."""
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
                raise FileNotFoundError(f"model {uri} does not exist")
            local = target / name if kind == pafs.FileType.File else target
            target.mkdir()
            pafs.copy_files(path, str(local), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
            (target / _DONE).touch()
    return str(target / name) if (target / name).is_file() else str(target)


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
