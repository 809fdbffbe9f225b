"""The output directory: ``outputs/`` and ``token_stats/`` parts written atomically, and resuming.

A part is one processed block, named by a hash of its ids, written to both folders under the same name:
token_stats first, outputs last, each to a temporary name then renamed. So a part whose outputs file
exists is complete, and a killed run leaves at worst a temporary file or a token_stats file without its
outputs; ``prepare`` removes both and returns the finished ids for the next run to skip.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.schema import OUTPUT_SCHEMA, TOKEN_STATS_SCHEMA, split_block


class OutputStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.outputs = self.root / "outputs"
        self.token_stats = self.root / "token_stats"

    def prepare(self) -> set[str]:
        """Create the folders, drop what an interrupted run left half-written; the ids already done."""
        for folder in (self.outputs, self.token_stats):
            folder.mkdir(parents=True, exist_ok=True)
            for leftover in folder.glob("*.tmp"):
                leftover.unlink()
        for stats in self.token_stats.glob("*.parquet"):
            if not (self.outputs / stats.name).exists():
                stats.unlink()
        return set(self.read_outputs(["id"])["id"].to_pylist())

    def write(self, block: pa.Table) -> pa.Table:
        """Write one actor output block as a part; returns its outputs table."""
        outputs, stats = split_block(block)
        digest = hashlib.sha1("\n".join(sorted(outputs["id"].to_pylist())).encode()).hexdigest()[:20]
        name = f"part-{digest}.parquet"
        _write_atomic(stats, self.token_stats / name)
        _write_atomic(outputs, self.outputs / name)  # last: its presence marks the part complete
        return outputs

    def read_outputs(self, columns: list[str]) -> pa.Table:
        return _read_folder(self.outputs, OUTPUT_SCHEMA, columns)

    def read_token_stats(self, columns: list[str]) -> pa.Table:
        return _read_folder(self.token_stats, TOKEN_STATS_SCHEMA, columns)

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.root / "summary.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, path)
        return path


def _write_atomic(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def _read_folder(folder: Path, schema: pa.Schema, columns: list[str]) -> pa.Table:
    files = sorted(folder.glob("*.parquet"))
    if not files:
        return schema.empty_table().select(columns)
    return pa.concat_tables(pq.read_table(f, columns=columns) for f in files)
