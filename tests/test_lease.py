"""Two drivers, one output directory: a live run's lease refuses a second run; a killed run's
lease does not hold the directory (dead process on this host at once, elsewhere once it expires)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from pipeline.store import LEASE, DirectoryInUse, Lease, OutputStore, _live


def test_second_run_into_a_held_directory_is_refused(tmp_path, capsys):
    from jobs.generate import main

    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "the cat"}\n')
    holder = Lease(OutputStore(str(tmp_path / "out")))
    holder.acquire()  # the live run
    try:
        with pytest.raises(SystemExit) as exit_:
            main(["--input", str(source), "--output", str(tmp_path / "out")])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"output {tmp_path / 'out'} is in use by another run" in err and "choose another --output" in err
        with pytest.raises(DirectoryInUse):
            Lease(OutputStore(str(tmp_path / "out"))).acquire()
        assert not list((tmp_path / "out").glob("_runs/*")), "the refused run must not touch the directory"
    finally:
        holder.release()
    assert not (tmp_path / "out" / LEASE).exists()
    second = Lease(OutputStore(str(tmp_path / "out")))
    second.acquire()  # free once released
    second.release()


def test_the_lease_is_renewed_while_the_run_lives(tmp_path):
    lease = Lease(OutputStore(str(tmp_path)), ttl=0.9)
    lease.acquire()
    try:
        first = json.loads((tmp_path / LEASE).read_text())["expires"]
        time.sleep(1.5)  # past the first expiry: only a heartbeat keeps it live
        renewed = json.loads((tmp_path / LEASE).read_text())
        assert renewed["expires"] > first and _live(renewed)
        with pytest.raises(DirectoryInUse):
            Lease(OutputStore(str(tmp_path)), ttl=0.9).acquire()
    finally:
        lease.release()


def test_a_killed_runs_lease_does_not_hold_the_directory(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store = OutputStore(str(tmp_path))
    lease = Lease(store)
    # Killed on this host: its process is gone, the lease is free at once though not expired.
    store.write_json(LEASE, {**lease.record, "owner": "killed", "pid": dead.pid, "expires": time.time() + 600})
    assert not _live(store.read_json(LEASE))
    lease.acquire()
    lease.release()
    # Killed on another host: free once its lease expires, held until then.
    other = {**lease.record, "owner": "other", "host": "elsewhere", "pid": 1}
    assert _live({**other, "expires": time.time() + 600})
    assert not _live({**other, "expires": time.time() - 1})
    store.write_json(LEASE, {**other, "expires": time.time() - 1})
    lease.acquire()
    lease.release()
