"""The output directory (docs/reference.md) on any filesystem pyarrow knows, written by Ray Data write tasks.

Object stores have no atomic rename, so a part is committed by a marker instead: a write task writes
``token_stats/<part>.parquet``, then ``outputs/<part>.parquet``, then ``_commits/<part>.json``, a small file
listing the part's ids and its aggregate statistics. Each object appears whole or not at all on an object store;
on a local disk a torn marker does not parse and counts as absent. So a part is complete exactly when its marker
reads back and both files it names are listed; the finished ids and ``summary.json`` come from listing the
markers, and a run starts by deleting whatever no complete part accounts for (what a killed run left). Part
names are a hash of the part's ids: a retried write task or a restarted actor's batch rewrites the same part
instead of adding a second one.

Two drivers must not share a directory: the running one holds ``_lease.json``, renewed by a heartbeat; a
second run is refused while the lease is live. A killed run's lease expires (or, on its own host, is seen to
belong to a dead process at once). The lease is a fence: a part's marker and ``summary.json`` are written only
while ``_lease.json`` still names this run and has not lapsed, checked just before each write; a run paused past
its lease (while another took the directory) commits nothing more and stops, and its heartbeat never writes over
the other run's lease.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from ray.data import Datasink
from ray.data.block import Block

from pipeline.io import InputError, as_text, column_values, resolve
from pipeline.schema import ENGINE_READY, OUTPUT_SCHEMA, PRODUCER_NODE, TOKEN_STATS_SCHEMA, split_block
from pipeline.summary import part_stats

log = logging.getLogger(__name__)

OUTPUTS, TOKEN_STATS, COMMITS, RUNS, LEASE = "outputs", "token_stats", "_commits", "_runs", "_lease.json"
LEASE_SECONDS = float(os.environ.get("SPECBATCH_LEASE_SECONDS", "60"))


class DirectoryInUse(InputError):
    """The output directory is held by a live run."""


class LeaseLost(InputError):
    """This run's lease on the output directory lapsed or was taken by another run: it must write nothing more."""

    END = "run again to finish."

    @classmethod
    def own_message(cls, text: str) -> str:
        """The message ``check_fence`` wrote, out of the text Ray wraps it in."""
        start = text.find("output ")
        end = text.find(cls.END, start)
        return text[start : end + len(cls.END)] if start >= 0 and end >= 0 else text


def write_whole(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """``data`` at ``path`` such that a reader sees the old file or the new one, never a part: on a local disk
    written aside and renamed over it (a file written in place reads back empty meanwhile, and the lease read
    so by a committing write task failed a run as lapsed); an object store replaces an object whole anyway."""
    if isinstance(fs, pafs.LocalFileSystem):
        aside = f"{path}.{uuid.uuid4().hex}.tmp"
        with fs.open_output_stream(aside) as f:
            f.write(data)
        fs.move(aside, path)
        return
    with fs.open_output_stream(path) as f:
        f.write(data)


def check_fence(fs: pafs.FileSystem, root: str, owner: str, uri: str) -> None:
    """``LeaseLost`` unless ``_lease.json`` under ``root`` names ``owner`` and has not lapsed (a write task calls
    this just before it commits a part, the driver before ``summary.json``)."""
    held = OutputStore.read_json_at(fs, posixpath.join(root, LEASE))
    if not held or held.get("owner") != owner or held.get("expires", 0) < time.time():
        taken = held and held.get("owner") != owner
        raise LeaseLost(
            f"output {uri}: this run's lease " + (
                f"was taken by another run (pid {held.get('pid')} on {held.get('host')}, started "
                f"{held.get('started')})" if taken else "lapsed (the run was paused or its store unreachable)")
            + f"; it stopped before committing more. The parts it committed count; {LeaseLost.END}")


class OutputStore:
    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.fs, self.root = resolve(uri, "output")

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def prepare(self) -> list[dict[str, Any]]:
        """Create the folders and delete what no complete part accounts for (files a killed run left
        half-written, markers torn or naming missing files); the committed parts' markers. Only under the
        lease: a live writer's files look alike."""
        for folder in (OUTPUTS, TOKEN_STATS, COMMITS, RUNS):
            self.fs.create_dir(self.path(folder), recursive=True)
        markers = self.markers()
        committed = {marker["part"] for marker in markers}
        for folder in (OUTPUTS, TOKEN_STATS, COMMITS):
            for info in self._list(folder):
                if info.base_name.removesuffix(".json") not in committed:
                    self.fs.delete_file(info.path)
        return markers

    def markers(self) -> list[dict[str, Any]]:
        """The markers of complete parts: the marker reads back whole and both data files it names are there.
        Markers are read in parallel (on an object store each is a request)."""
        present = [{info.base_name for info in self._list(folder)} for folder in (OUTPUTS, TOKEN_STATS)]
        infos = [info for info in self._list(COMMITS) if info.base_name.endswith(".json")]
        with ThreadPoolExecutor(16) as pool:
            markers = pool.map(lambda info: self._read_json(info.path), infos)
            return [m for m in markers if isinstance(m, dict) and all(m.get("part") in names for names in present)]

    def committed_files(self, folder: str) -> list[str]:
        names = {marker["part"] for marker in self.markers()}
        return sorted(info.path for info in self._list(folder) if info.base_name in names)

    def read_outputs(self, columns: list[str] | None = None) -> pa.Table:
        return self._read_folder(OUTPUTS, OUTPUT_SCHEMA, columns)

    def read_token_stats(self, columns: list[str] | None = None) -> pa.Table:
        return self._read_folder(TOKEN_STATS, TOKEN_STATS_SCHEMA, columns)

    def write_json(self, relative: str, value: Any) -> None:
        write_whole(self.fs, self.path(relative), (json.dumps(value, indent=2) + "\n").encode())

    def read_json(self, relative: str) -> Any:
        return self._read_json(self.path(relative))

    @staticmethod
    def read_json_at(fs: pafs.FileSystem, path: str) -> Any:
        """The JSON file at ``path``; None when it is absent or does not parse."""
        try:
            with fs.open_input_stream(path) as f:
                return json.loads(f.read())
        except (OSError, ValueError):  # vanished, or torn by a killed writer on a local disk
            return None

    def runs(self) -> list[dict[str, Any]]:
        records = [self._read_json(info.path) for info in self._list(RUNS)]
        return sorted((r for r in records if r), key=lambda r: r["started"])

    def _read_folder(self, folder: str, schema: pa.Schema, columns: list[str] | None) -> pa.Table:
        files = self.committed_files(folder)
        if not files:
            return schema.empty_table().select(columns or schema.names)
        return concat_parts([pq.read_table(f, columns=columns, filesystem=self.fs) for f in files])

    def _list(self, folder: str) -> list[pafs.FileInfo]:
        selector = pafs.FileSelector(self.path(folder), allow_not_found=True)
        return [info for info in self.fs.get_file_info(selector) if info.type == pafs.FileType.File]

    def _read_json(self, path: str) -> Any:
        return self.read_json_at(self.fs, path)


def concat_parts(tables: list[pa.Table]) -> pa.Table:
    """Parts as one table. A carried-through column keeps each input file's own type in that file's parts
    (an ``extra`` column may be int in one file, string in another); where types clash, the column is read
    as JSON text, as the reader does for a column mixing types within one file."""
    types: dict[str, set[pa.DataType]] = {}
    for table in tables:
        for field in table.schema:
            if not pa.types.is_null(field.type):
                types.setdefault(field.name, set()).add(field.type)
    clashing = {name for name, kinds in types.items() if len(kinds) > 1}
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        pass
    texts = []
    for table in tables:
        for name in clashing & set(table.column_names):
            text = pa.array(as_text(column_values(table[name])), pa.string())
            table = table.set_column(table.column_names.index(name), name, text)
        texts.append(table)
    return pa.concat_tables(texts, promote_options="permissive")


class OutputSink(Datasink[list[dict[str, Any]]]):
    """Ray Data datasink of actor output blocks: each block becomes one committed part (see module doc)."""

    def __init__(self, store: OutputStore, run_id: str, owner: str) -> None:
        """``owner``: the run's lease owner; a part is committed only while the lease names it."""
        self.fs, self.root, self.run_id, self.owner, self.uri = store.fs, store.root, run_id, owner, store.uri
        self.written: list[dict[str, Any]] = []  # filled on the driver when the write completes

    def write(self, blocks: Iterable[Block], ctx: Any) -> list[dict[str, Any]]:
        # Block by block, never concatenated: parts from different input files may differ in carried columns.
        return [self._write_part(block) for block in blocks if block.num_rows]

    def _write_part(self, block: pa.Table) -> dict[str, Any]:
        metadata = block.schema.metadata or {}
        node = metadata.get(PRODUCER_NODE.encode(), b"").decode()
        engine_ready = float(metadata.get(ENGINE_READY.encode(), b"0").decode()) or None
        outputs, stats = split_block(block.replace_schema_metadata(None))
        ids = outputs["id"].to_pylist()
        part = f"part-{hashlib.sha1(chr(10).join(ids).encode()).hexdigest()[:24]}.parquet"
        pq.write_table(stats, posixpath.join(self.root, TOKEN_STATS, part), filesystem=self.fs)
        pq.write_table(outputs, posixpath.join(self.root, OUTPUTS, part), filesystem=self.fs)
        marker = {"part": part, "run": self.run_id, "node": node, "engine_ready": engine_ready, "ids": ids,
                  **part_stats(outputs, stats)}
        check_fence(self.fs, self.root, self.owner, self.uri)
        write_whole(self.fs, posixpath.join(self.root, COMMITS, part + ".json"),
                    json.dumps(marker).encode())  # last: the part counts from here on
        # To the driver only the sums: it must not hold every output id in memory.
        return {key: value for key, value in marker.items() if key != "ids"}

    def on_write_complete(self, write_result: Any) -> None:
        self.written = [marker for markers in write_result.write_returns for marker in markers]

    def get_name(self) -> str:
        return "WriteOutputs"


class Lease:
    """``_lease.json`` in the output directory: who runs there, renewed every ``ttl / 3`` seconds.

    There is no compare-and-swap on an object store: two runs starting within the same instant both write,
    then both read back after a pause, and only the one whose write stuck goes on."""

    def __init__(self, store: OutputStore, ttl: float = LEASE_SECONDS) -> None:
        self.store, self.ttl = store, ttl
        self.record = {"owner": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
                       "started": _now(), "expires": 0.0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        self.store.fs.create_dir(self.store.root, recursive=True)
        self._refuse_if_held()
        self._write()
        time.sleep(min(1.0, self.ttl / 10))
        self._refuse_if_held()
        self._thread = threading.Thread(target=self._heartbeat, name="lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        held = self.store.read_json(LEASE)
        if held and held.get("owner") == self.record["owner"]:
            self.store.fs.delete_file(self.store.path(LEASE))

    def _refuse_if_held(self) -> None:
        held = self.store.read_json(LEASE)
        if not held or held.get("owner") == self.record["owner"] or not _live(held):
            return
        until = datetime.fromtimestamp(held["expires"], timezone.utc).isoformat(timespec="seconds")
        raise DirectoryInUse(
            f"output {self.store.uri} is in use by another run (pid {held.get('pid')} on {held.get('host')}, "
            f"started {held.get('started')}); its lease is renewed while it runs and lapses at {until} if it stops. "
            "Wait for it to finish or choose another --output."
        )

    def _write(self) -> None:
        self.record["expires"] = time.time() + self.ttl
        self.store.write_json(LEASE, self.record)

    def check(self) -> None:
        """``LeaseLost`` unless this run still holds the lease (see ``check_fence``)."""
        check_fence(self.store.fs, self.store.root, self.record["owner"], self.store.uri)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.check()  # never renew a lease that lapsed or that another run took: it is theirs now
                self._write()
            except LeaseLost as exc:
                log.error("%s", exc)
                return
            except OSError:  # a transient store error: the next beat retries well before expiry
                log.warning("could not renew the lease on %s", self.store.uri, exc_info=True)


def _live(lease: dict[str, Any]) -> bool:
    if lease.get("expires", 0) < time.time():
        return False
    if lease.get("host") == socket.gethostname():  # on this host a dead process is visible at once
        try:
            os.kill(int(lease["pid"]), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, KeyError, ValueError):
            pass
    return True


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def new_run_id() -> str:
    return f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
