"""Reading prompt datasets (docs/reference.md): Parquet, JSONL or CSV; a file, a directory or a glob, on any filesystem
pyarrow knows (a local path, s3://, gs://, hdfs://, ...).

Ray Data's stock readers cannot tell a row's position in its file, which the derived ids need, and
pyarrow's JSON reader rejects a whole file when one row has a value of another type. So the files are
read by a small ``FileBasedDatasource`` (Ray Data's reader base class: listing, parallel read tasks,
retries) that numbers rows and turns undecodable rows into per-row errors instead of failing the read.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
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

log = logging.getLogger(__name__)

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
# Read as text whatever they look like: "007" is an id and "42" a prompt, not numbers.
_CSV_TEXT_COLUMNS = {"id": pa.string(), "prompt": pa.string()}
# Deepest JSON record read: request columns are held to MAX_DEPTH later, carried-through columns may nest more.
RECORD_DEPTH = 2 * MAX_DEPTH
# A JSON escape of a UTF-16 surrogate: alone (without its pair) it decodes to a str no UTF-8 encoder accepts.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


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


def without_output(fs: pafs.FileSystem, files: list[str], input_uri: str, output_uri: str) -> list[str]:
    """The input files outside the output directory: a job never reads its own parts, markers or summary as
    input when its output lies inside its input directory. ``InputError`` when the input lies inside the output
    (or is it)."""
    out_fs, output = resolve(output_uri, "output")
    if out_fs.type_name != fs.type_name:
        return files
    _, source = resolve(input_uri, "input")
    if _inside(source, output):
        raise InputError(f"input {input_uri} lies inside the output directory {output_uri}: the job would read "
                         "its own files as input; choose another output directory")
    kept = [f for f in files if not _inside(f, output)]
    if len(kept) < len(files):
        log.info("input: %d files inside the output directory %s are not read", len(files) - len(kept), output_uri)
    if not kept:
        raise InputError(f"input {input_uri} holds no files outside the output directory {output_uri}")
    return kept


def _inside(path: str, directory: str) -> bool:
    path, directory = posixpath.normpath(path), posixpath.normpath(directory)
    return path == directory or path.startswith(directory.rstrip("/") + "/")


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
    files: list[str], base: str, *, skip: frozenset[str], rows_per_block: int,
    filesystem: pafs.FileSystem | None = None, tasks: int | None = None,
) -> ray.data.Dataset:
    """Rows of the files whose id is not in ``skip``, in blocks of at most ``rows_per_block`` rows of one file.

    The read does all per-row preparation itself (ids, resume filter) and asks for no CPU: CPU actors hold the
    cluster's CPUs, and any other CPU-bound stage before them would wait forever. Each file is read by a task of
    its own, so no block mixes files (whose column types may differ; a task reading several concatenates them, and
    fails when they clash). Ray Data joins what one read task yields into one block (20,000 rows of one file: one
    block), so a streaming repartition, which asks for no CPU either, cuts it into blocks of ``rows_per_block``
    rows. Those blocks are the actors' calls and the output parts. ``tasks``: read tasks in flight at once (None:
    unbounded).
    """
    source = PromptFiles(files, base, skip, filesystem or pafs.LocalFileSystem())
    ds = ray.data.read_datasource(source, num_cpus=0, override_num_blocks=len(files), concurrency=tasks)
    ds = ds.repartition(target_num_rows_per_block=rows_per_block)
    # Dataset.repartition takes neither remote args nor a concurrency: set on its logical operator.
    ds._logical_plan.dag.ray_remote_args["num_cpus"] = 0
    object.__setattr__(ds._logical_plan.dag, "compute", ray.data.TaskPoolStrategy(size=tasks))
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
        table = prompt_rows(data, path, self._base, self._skip)
        if table.num_rows:
            yield table


def prompt_rows(data: pa.Buffer, path: str, base: str, skip: frozenset[str]) -> pa.Table:
    """The rows ``PromptFiles`` makes of one file's bytes, less those whose id is in ``skip``."""
    name = posixpath.relpath(path, base) if base else path
    try:
        table = normalize(valid_text(parse_file(data, FORMATS[_suffix(path)])))
    except Exception as exc:  # any parser's error on a corrupt file: one error row instead of a failed job
        table = pa.table({"id": [name], READ_ERROR: [f"unreadable input file {name}: {exc}"]})
    table = with_ids(table, name)
    if skip:
        table = table.filter(pc.invert(pc.is_in(table["id"], pa.array(list(skip), pa.string()))))
    return table


def rows_left(files: list[str], base: str, skip: frozenset[str], filesystem: pafs.FileSystem) -> bool:
    """Whether any row of the files has an id outside ``skip`` (read here, in this process)."""
    for path in files:
        with filesystem.open_input_stream(path) as f:
            if prompt_rows(f.read_buffer(), path, base, skip).num_rows:
                return True
    return False


def parse_file(data: pa.Buffer, kind: str) -> pa.Table:
    """The file's rows; what cannot be read of a row (or of a Parquet row group) is that row's ``READ_ERROR``.
    Raises only when nothing can be isolated (no footer, no header)."""
    if kind == "parquet":
        return read_parquet_row_groups(data)
    if kind == "csv":
        try:
            return _read_csv(data.to_pybytes())
        except pa.ArrowInvalid:  # a row with invalid UTF-8 or another number of fields: find it
            return read_csv_rows(data.to_pybytes())
    return read_json_records(data.to_pybytes())


def count_records(data: bytes, kind: str) -> int:
    """The rows ``parse_file`` makes of a JSON or CSV file, without building them: its records (a quoted CSV value
    may hold line breaks), or the one error row of a CSV file without a header."""
    if kind == "csv":
        records = _csv_records(data)
        return len(records) - 1 if records else 1
    lines = [line for line in data.splitlines() if line.strip()]
    if lines and lines[0].lstrip().startswith(b"["):  # one JSON array, as read_json_records reads it
        with contextlib.suppress(ValueError, RecursionError, TypeError):
            return len(json.loads(data))
    return len(lines)


def _csv_records(data: bytes) -> list[list[str]]:
    """The non-empty CSV records of ``data``; bytes that are not UTF-8 are kept as surrogate escapes."""
    return [r for r in csv.reader(io.StringIO(data.decode("utf-8", "surrogateescape"), newline="")) if r]


def _read_csv(data: bytes) -> pa.Table:
    options = pa_csv.ConvertOptions(column_types=_CSV_TEXT_COLUMNS)
    return pa_csv.read_csv(pa.BufferReader(data), convert_options=options)


def read_csv_rows(data: bytes) -> pa.Table:
    """A CSV file that Arrow's reader refuses, record by record: a record that is not valid UTF-8 text or has
    another number of fields than the header becomes a row with a ``READ_ERROR``; the other records are read by
    Arrow as usual (types inferred, ``id`` and ``prompt`` as text)."""
    records = _csv_records(data)
    if not records:
        raise ValueError("no CSV header")
    header, *rows = records
    _encoded(header, "the CSV header")
    good, errors, ids = io.StringIO(newline=""), {}, {}
    writer = csv.writer(good)
    writer.writerow(header)
    id_field = header.index("id") if "id" in header else None
    for number, row in enumerate(rows):
        try:
            if len(row) != len(header):
                raise ValueError(f"it has {len(row)} fields, the header {len(header)}")
            _encoded(row, "it")
        except ValueError as exc:
            errors[number] = f"undecodable CSV record {number + 1}: {exc}"
            if id_field is not None and id_field < len(row) and _text(row[id_field]):
                ids[number] = row[id_field]  # the row keeps its id where it can
        else:
            writer.writerow(row)
    return interleave(_read_csv(good.getvalue().encode()), errors, len(rows), ids)


def _encoded(values: list[str], what: str) -> None:
    if not all(_text(value) for value in values):
        raise ValueError(f"{what} is not valid UTF-8 text")


def _text(value: object) -> bool:
    """Whether ``value`` is a string UTF-8 can encode (no lone surrogate)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_parquet_row_groups(data: pa.Buffer) -> pa.Table:
    """A Parquet file row group by row group: the rows of a row group that cannot be read become error rows."""
    parquet = pq.ParquetFile(pa.BufferReader(data))
    tables, errors, ids, offset = [], {}, {}, 0
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        try:
            tables.append(parquet.read_row_group(group))
        except Exception as exc:  # a corrupt page or column chunk
            errors.update((offset + row, f"unreadable row group {group}: {exc}") for row in range(rows))
            with contextlib.suppress(Exception):  # the rows keep their ids where that column reads
                column = column_values(parquet.read_row_group(group, columns=["id"])["id"])
                ids.update((offset + row, value) for row, value in enumerate(as_text(column)))
        offset += rows
    good = pa.concat_tables(tables) if tables else parquet.schema_arrow.empty_table()
    return interleave(good, errors, offset, ids)


def interleave(good: pa.Table, errors: dict[int, str], total: int, ids: dict[int, str] | None = None) -> pa.Table:
    """``total`` rows in file order: row ``i`` is an error row (``READ_ERROR`` = ``errors[i]``, its id from ``ids``
    if there, nothing else) where ``errors`` has it, else the next row of ``good``."""
    if not errors:
        return good
    failed = pa.table({READ_ERROR: pa.array(list(errors.values()), pa.string())})
    if ids:
        failed = failed.append_column("id", pa.array([ids.get(row) for row in errors], pa.string()))
    both = pa.concat_tables([good, failed], promote_options="permissive")
    order, next_good, next_failed = [], 0, good.num_rows
    for row in range(total):
        if row in errors:
            order.append(next_failed)
            next_failed += 1
        else:
            order.append(next_good)
            next_good += 1
    return both.take(pa.array(order, pa.int64()))


def valid_text(table: pa.Table) -> pa.Table:
    """Rows holding text that is not valid UTF-8 (Parquet does not check it on reading, and a later conversion of
    the whole block would fail) become error rows naming the column; their value is dropped."""
    errors: dict[int, str] = {}
    for index, name in enumerate(table.column_names):
        column = table.column(index)
        try:
            column.validate(full=True)
            continue
        except pa.ArrowInvalid:
            pass
        bad = []
        for row in range(len(column)):
            try:
                column[row].as_py()
            except UnicodeDecodeError:
                bad.append(row)
                errors.setdefault(row, f"undecodable row {row}: column {name!r} is not valid UTF-8 text")
        mask = pc.is_in(pa.array(range(len(column))), pa.array(bad, pa.int64()))
        table = table.set_column(index, name, pc.if_else(mask, pa.nulls(len(column), column.type), column))
    if not errors:
        return table
    messages = pa.array([errors.get(row) for row in range(table.num_rows)], pa.string())
    if READ_ERROR in table.column_names:
        messages = pc.coalesce(table[READ_ERROR], messages)
        return table.set_column(table.column_names.index(READ_ERROR), READ_ERROR, messages)
    return table.append_column(READ_ERROR, messages)


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
    column = table["id"]
    given = column if column.type == pa.string() else pa.array(as_text(column_values(column)), pa.string())
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
        not_utf8: UnicodeDecodeError | None = None
        try:
            encoding = json.detect_encoding(line)  # as json.loads decodes bytes (a BOM, UTF-16)
            try:
                text = line.decode(encoding, "surrogatepass")
            except UnicodeDecodeError as exc:  # read on, its bad bytes as lone surrogates: the row keeps its id
                text, not_utf8 = line.decode(encoding, "surrogateescape"), exc
            try:
                record = json.loads(text)
            except RecursionError:  # json recurses per nesting level
                raise ValueError(f"nested deeper than {RECORD_DEPTH} levels") from None
            if not isinstance(record, dict):
                raise ValueError(f"expected a JSON object, got {type(record).__name__}")
            if too_deep(record, RECORD_DEPTH):  # before Arrow and pydantic recurse into it
                raise ValueError(f"nested deeper than {RECORD_DEPTH} levels")
            if not_utf8 is not None or _SURROGATE_ESCAPE.search(line):  # a lone surrogate is no text for Arrow
                json.dumps(record, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            record = {"id": record["id"]} if _text(record.get("id")) else {}  # the row keeps its id where it can
            error = f"undecodable JSON record {number}: " + (
                str(not_utf8) if not_utf8 is not None else "a string holds a lone surrogate (\\ud800-\\udfff)")
        except ValueError as exc:
            record, error = {}, f"undecodable JSON record {number}: {not_utf8 or exc}"
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
    """Each value as text: strings as they are, bytes as UTF-8 (hex where they are not), anything else as JSON
    (dates, decimals and other types JSON lacks as their ``str``)."""
    return [_value_text(v) for v in values]


def _value_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return value.hex()
    return json.dumps(value, default=str)


def column_values(column: pa.ChunkedArray | pa.Array) -> list[Any]:
    """The column as Python values; a value Python cannot hold (a string that is not UTF-8, a date past year 9999)
    is None."""
    try:
        return column.to_pylist()
    except (ValueError, ArithmeticError):
        pass
    values = []
    for item in column:
        try:
            values.append(item.as_py())
        except (ValueError, ArithmeticError):
            values.append(None)
    return values
