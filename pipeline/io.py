"""Reading prompt datasets (docs/reference.md): Parquet, JSONL or CSV; a file, a directory or a glob, on any filesystem
pyarrow knows (a local path, s3://, gs://, hdfs://, ...).

Ray Data's stock readers cannot tell a row's position in its file, which the derived ids need, and
pyarrow's JSON reader rejects a whole file when one row has a value of another type. So the files are
read by a small ``FileBasedDatasource`` (Ray Data's reader base class: listing, parallel read tasks,
retries) that numbers rows and turns undecodable rows into per-row errors instead of failing the read.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray.data
from ray.data.datasource import FileBasedDatasource

from frontend.requests import MAX_DEPTH, too_deep
from pipeline.schema import READ_ERROR

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
# Read as text whatever they look like: "007" is an id and "42" a prompt, not numbers.
_CSV_TEXT_COLUMNS = {"id": pa.string(), "prompt": pa.string()}
# Deepest JSON record read: request columns are held to MAX_DEPTH later, carried-through columns may nest more.
RECORD_DEPTH = 2 * MAX_DEPTH


class InputError(ValueError):
    """An input or output path that cannot be used: no such file, bucket or filesystem scheme."""


def resolve(uri: str, what: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and in-filesystem path of a local path or URI; ``InputError`` naming the
    scheme or bucket when there is no such filesystem or bucket."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
        scheme = uri.split("://", 1)[0]
        raise InputError(f"{what} {uri}: unknown or unavailable filesystem scheme '{scheme}://' ({exc})") from None
    if fs.type_name in ("s3", "gcs"):
        bucket = path.split("/", 1)[0]
        try:
            missing = fs.get_file_info(bucket).type == pafs.FileType.NotFound
        except OSError as exc:
            raise InputError(f"{what} {uri}: cannot reach bucket '{bucket}' ({exc})") from None
        if missing:
            raise InputError(f"{what} {uri}: bucket '{bucket}' does not exist")
    return fs, path.rstrip("/")


def list_input_files(uri: str) -> tuple[pafs.FileSystem, list[str], str]:
    """The input's filesystem, its files (sorted, in-filesystem paths) and the directory that derived ids
    name them relative to."""
    fs, path = resolve(uri, "input")
    if any(ch in path for ch in "*?["):
        prefix = path[: min(path.find(ch) for ch in "*?[" if ch in path)]
        base = posixpath.dirname(prefix) if "/" in prefix else ""
        listed = _list_files(fs, base or ".")
        pattern = _glob_regex(path)
        files = sorted(f for f in listed if pattern.fullmatch(f))
    else:
        kind = fs.get_file_info(path).type
        if kind == pafs.FileType.Directory:
            files, base = sorted(f for f in _list_files(fs, path) if _suffix(f) in FORMATS), path
        elif kind == pafs.FileType.File:
            files, base = [path], posixpath.dirname(path)
        else:
            raise InputError(f"input {uri} does not exist")
    if not files:
        raise InputError(f"input {uri} holds no {'/'.join(FORMATS)} files")
    unsupported = [f for f in files if _suffix(f) not in FORMATS]
    if unsupported:
        raise InputError(f"unsupported input file {unsupported[0]} (expected {', '.join(FORMATS)})")
    return fs, files, base


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """A glob as shells and ``glob.glob(recursive=True)`` read it: ``*`` and ``?`` stay within one path
    component, ``**/`` spans any number of them (fnmatch's ``*`` would cross ``/``)."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                out.append(re.escape("["))
                i += 1
            else:
                body = pattern[i + 1:end]
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def _list_files(fs: pafs.FileSystem, directory: str) -> list[str]:
    infos = fs.get_file_info(pafs.FileSelector(directory, recursive=True, allow_not_found=True))
    return [info.path for info in infos if info.type == pafs.FileType.File]


def _suffix(path: str) -> str:
    return posixpath.splitext(path)[1]


def read_prompts(
    files: list[str], base: str, *, skip: frozenset[str], rows_per_block: int, filesystem: pafs.FileSystem | None = None
) -> ray.data.Dataset:
    """Rows of the files whose id is not in ``skip``, in blocks of at most ``rows_per_block`` rows of one file.

    The read does all per-row preparation itself (ids, resume filter) and asks for no CPU: CPU actors hold the
    cluster's CPUs, and any other CPU-bound stage before them would wait forever. Each file is read by a task of
    its own, so no block mixes files (whose column types may differ; a task reading several concatenates them, and
    fails when they clash). Ray Data joins what one read task yields into one block (20,000 rows of one file: one
    block), so a streaming repartition, which asks for no CPU either, cuts it into blocks of ``rows_per_block``
    rows. Those blocks are the actors' calls and the output parts.
    """
    source = PromptFiles(files, base, skip, filesystem or pafs.LocalFileSystem())
    ds = ray.data.read_datasource(source, num_cpus=0, override_num_blocks=len(files))
    ds = ds.repartition(target_num_rows_per_block=rows_per_block)
    ds._logical_plan.dag.ray_remote_args["num_cpus"] = 0  # Dataset.repartition takes no remote args
    return ds


class PromptFiles(FileBasedDatasource):
    """Prompt files of any supported format; every row gets a string ``id`` (derived: ``file:row``).

    Every block has a string ``prompt`` (when the file has prompts) and a ``READ_ERROR`` column, whatever the
    file's own types: a file that cannot be parsed at all is one error row named after the file, so the other
    files' rows still run."""

    def __init__(self, files: list[str], base: str, skip: frozenset[str], filesystem: pafs.FileSystem) -> None:
        super().__init__(files, filesystem=filesystem)
        self._base = base
        self._skip = skip

    def _read_stream(self, f: pa.NativeFile, path: str) -> Iterator[pa.Table]:
        data = f.read_buffer()  # outside the try: an I/O error is Ray Data's to retry, not an error row
        name = posixpath.relpath(path, self._base) if self._base else path
        try:
            table = normalize(parse_file(data, FORMATS[_suffix(path)]))
        except Exception as exc:  # any parser's error on a corrupt file: one error row instead of a failed job
            table = pa.table({"id": [name], READ_ERROR: [f"unreadable input file {name}: {exc}"]})
        table = with_ids(table, name)
        if self._skip:
            table = table.filter(pc.invert(pc.is_in(table["id"], pa.array(list(self._skip), pa.string()))))
        if table.num_rows:
            yield table


def parse_file(data: pa.Buffer, kind: str) -> pa.Table:
    if kind == "parquet":
        return pq.read_table(pa.BufferReader(data))
    if kind == "csv":
        options = pa_csv.ConvertOptions(column_types=_CSV_TEXT_COLUMNS)
        return pa_csv.read_csv(pa.BufferReader(data), convert_options=options)
    return read_json_records(data.to_pybytes())


def normalize(table: pa.Table) -> pa.Table:
    """A ``prompt`` of another type than string (a file whose prompts are all numbers) becomes per-row
    errors, and every table gets a ``READ_ERROR`` column: files of one input then give blocks of one shape."""
    errors = table[READ_ERROR] if READ_ERROR in table.column_names else pa.nulls(table.num_rows, pa.string())
    if "prompt" in table.column_names and not pa.types.is_string(table["prompt"].type):
        prompt = table["prompt"]
        if pa.types.is_large_string(prompt.type):
            table = table.set_column(table.column_names.index("prompt"), "prompt", prompt.cast(pa.string()))
        else:
            got = f"prompt must be a string, got {_type_name(prompt.type)}"
            errors = pc.if_else(pc.and_(pc.is_null(errors), pc.is_valid(prompt)), got, errors)
            nulls = pa.nulls(table.num_rows, pa.string())
            table = table.set_column(table.column_names.index("prompt"), "prompt", nulls)
    if READ_ERROR in table.column_names:
        return table.set_column(table.column_names.index(READ_ERROR), READ_ERROR, errors)
    return table.append_column(READ_ERROR, errors)


def _type_name(arrow_type: pa.DataType) -> str:
    # The Python type name, as the engine and the JSON reader say it ("got int").
    for test, name in ((pa.types.is_integer, "int"), (pa.types.is_floating, "float"), (pa.types.is_boolean, "bool"),
                       (pa.types.is_list, "list"), (pa.types.is_struct, "dict"), (pa.types.is_null, "NoneType")):
        if test(arrow_type):
            return name
    return str(arrow_type)


def with_ids(table: pa.Table, name: str) -> pa.Table:
    """Rows without an ``id`` (no column, null or empty) get ``name:row``, stable across runs."""
    derived = pa.array([f"{name}:{row}" for row in range(table.num_rows)], pa.string())
    if "id" not in table.column_names:
        return table.add_column(0, "id", derived)
    given = table["id"] if table["id"].type == pa.string() else pa.array(as_text(table["id"].to_pylist()))
    missing = pc.or_kleene(pc.is_null(given), pc.equal(given, ""))
    return table.set_column(table.column_names.index("id"), "id", pc.if_else(missing, derived, given))


def read_json_records(data: bytes) -> pa.Table:
    """JSON Lines (or one JSON array) of objects. A line that is not a JSON object, or a prompt that is
    not a string where others are, becomes a row with a ``READ_ERROR``; a column whose values mix
    types elsewhere is stored as JSON text (``sampling_params`` and ``messages`` accept that form)."""
    lines = [line for line in data.splitlines() if line.strip()]
    if lines and lines[0].lstrip().startswith(b"["):  # one JSON array rather than JSON Lines
        with contextlib.suppress(ValueError, RecursionError):
            lines = [json.dumps(record).encode() for record in json.loads(data)]
    records: list[dict[str, Any]] = []
    errors: list[str | None] = []
    for number, line in enumerate(lines, 1):
        try:
            try:
                record = json.loads(line)  # bytes: invalid UTF-8 raises too, a ValueError like bad JSON
            except RecursionError:  # json recurses per nesting level
                raise ValueError(f"nested deeper than {RECORD_DEPTH} levels") from None
            if not isinstance(record, dict):
                raise ValueError(f"expected a JSON object, got {type(record).__name__}")
            if too_deep(record, RECORD_DEPTH):  # before Arrow and pydantic recurse into it
                raise ValueError(f"nested deeper than {RECORD_DEPTH} levels")
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
    return pa.array(as_text(values), pa.string())


def as_text(values: list[Any]) -> list[str | None]:
    return [v if v is None or isinstance(v, str) else json.dumps(v) for v in values]
