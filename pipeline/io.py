"""Reading prompt datasets (SPEC "Input"): Parquet, JSONL or CSV; a file, a directory or a glob.

Ray Data's stock readers cannot tell a row's position in its file, which SPEC's derived ids need, and
pyarrow's JSON reader rejects a whole file when one row has a value of another type. So the files are
read by a small ``FileBasedDatasource`` (Ray Data's reader base class: listing, parallel read tasks,
retries) that numbers rows and turns undecodable rows into per-row errors instead of failing the read.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import ray.data
from ray.data.datasource import FileBasedDatasource

from pipeline.schema import READ_ERROR

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
# Read as text whatever they look like: "007" is an id and "42" a prompt, not numbers.
_CSV_TEXT_COLUMNS = {"id": pa.string(), "prompt": pa.string()}


class InputError(ValueError):
    """An input path that names no readable prompt files."""


def list_input_files(path: str) -> tuple[list[str], str]:
    """The input's files, sorted, and the directory that derived ids name them relative to."""
    if any(ch in path for ch in "*?["):
        files = sorted(os.path.abspath(p) for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        base = os.path.dirname(path[: min(path.find(ch) for ch in "*?[" if ch in path)])
    elif os.path.isdir(path):
        files = sorted(os.path.abspath(p) for p in Path(path).rglob("*") if p.is_file() and p.suffix in FORMATS)
        base = path
    elif os.path.isfile(path):
        files, base = [os.path.abspath(path)], os.path.dirname(path)
    else:
        raise InputError(f"input {path} does not exist")
    if not files:
        raise InputError(f"input {path} holds no {'/'.join(FORMATS)} files")
    unsupported = [f for f in files if Path(f).suffix not in FORMATS]
    if unsupported:
        raise InputError(f"unsupported input file {unsupported[0]} (expected {', '.join(FORMATS)})")
    return files, os.path.abspath(base or ".")


def read_prompts(files: list[str], base: str, *, skip: frozenset[str], rows_per_block: int) -> ray.data.Dataset:
    """Rows of the files whose id is not in ``skip``, in blocks of ``rows_per_block``.

    The read does all per-row preparation itself (ids, resume filter, block size) and asks for no CPU:
    CPU actors hold the cluster's CPUs, and any other CPU-bound stage before them would wait forever.
    """
    return ray.data.read_datasource(PromptFiles(files, base, skip, rows_per_block), num_cpus=0)


class PromptFiles(FileBasedDatasource):
    """Prompt files of any supported format; every row gets a string ``id`` (derived: ``file:row``)."""

    def __init__(self, files: list[str], base: str, skip: frozenset[str], rows_per_block: int) -> None:
        super().__init__(files)
        self._base = base
        self._skip = skip
        self._rows_per_block = rows_per_block

    def _read_stream(self, f: pa.NativeFile, path: str) -> Iterator[pa.Table]:
        data = f.read_buffer()
        kind = FORMATS[Path(path).suffix]
        if kind == "parquet":
            table = pq.read_table(pa.BufferReader(data))
        elif kind == "csv":
            options = pa_csv.ConvertOptions(column_types=_CSV_TEXT_COLUMNS)
            table = pa_csv.read_csv(pa.BufferReader(data), convert_options=options)
        else:
            table = read_json_records(data.to_pybytes())
        table = with_ids(table, os.path.relpath(path, self._base).replace(os.sep, "/"))
        if self._skip:
            table = table.filter(pc.invert(pc.is_in(table["id"], pa.array(list(self._skip), pa.string()))))
        for start in range(0, table.num_rows, self._rows_per_block):
            yield table.slice(start, self._rows_per_block)


def with_ids(table: pa.Table, name: str) -> pa.Table:
    """Rows without an ``id`` (no column, null or empty) get ``name:row``, stable across runs."""
    derived = pa.array([f"{name}:{row}" for row in range(table.num_rows)], pa.string())
    if "id" not in table.column_names:
        return table.add_column(0, "id", derived)
    given = table["id"] if table["id"].type == pa.string() else pa.array(_as_text(table["id"].to_pylist()))
    missing = pc.or_kleene(pc.is_null(given), pc.equal(given, ""))
    return table.set_column(table.column_names.index("id"), "id", pc.if_else(missing, derived, given))


def read_json_records(data: bytes) -> pa.Table:
    """JSON Lines (or one JSON array) of objects. A line that is not a JSON object, or a prompt that is
    not a string where others are, becomes a row with a ``READ_ERROR``; a column whose values mix
    types elsewhere is stored as JSON text (``sampling_params`` and ``messages`` accept that form)."""
    lines = [line for line in data.splitlines() if line.strip()]
    if lines and lines[0].lstrip().startswith(b"["):  # one JSON array rather than JSON Lines
        with contextlib.suppress(ValueError):
            lines = [json.dumps(record).encode() for record in json.loads(data)]
    records: list[dict[str, Any]] = []
    errors: list[str | None] = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)  # bytes: invalid UTF-8 raises too, a ValueError like bad JSON
            if not isinstance(record, dict):
                raise ValueError(f"expected a JSON object, got {type(record).__name__}")
        except ValueError as exc:
            record, error = {}, f"undecodable JSON record {number}: {exc}"
        else:
            error = None
        records.append(record)
        errors.append(error)
    names = list(dict.fromkeys(key for record in records for key in record))
    columns = {name: _column([record.get(name) for record in records], name, errors) for name in names}
    columns[READ_ERROR] = pa.array(errors, pa.string())
    return pa.table(columns)


def _column(values: list[Any], name: str, errors: list[str | None]) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        pass
    if name == "prompt":  # the engine's message for a non-string prompt, without losing the other rows
        for row, value in enumerate(values):
            if value is not None and not isinstance(value, str):
                errors[row] = errors[row] or f"prompt must be a string, got {type(value).__name__}"
        return pa.array([v if isinstance(v, str) else None for v in values], pa.string())
    return pa.array(_as_text(values), pa.string())


def _as_text(values: list[Any]) -> list[str | None]:
    return [v if v is None or isinstance(v, str) else json.dumps(v) for v in values]
