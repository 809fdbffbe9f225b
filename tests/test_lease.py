"""Two drivers, one output directory: a live run's lease refuses a second run; a killed run's
lease does not hold the directory (dead process on this host at once, elsewhere once it expires)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from pipeline.store import LEASE, DirectoryInUse, Lease, LeaseLost, OutputStore, _live, check_fence


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


def test_a_lease_taken_by_another_run_is_never_renewed_over_it(tmp_path):
    """A run paused past its lease (SIGSTOP) and resumed: its heartbeat used to write its lease back over the run
    that had taken the directory."""
    from pipeline.store import LeaseLost

    store = OutputStore(str(tmp_path))
    lease = Lease(store, ttl=0.6)
    lease.acquire()
    try:
        lease.check()  # held
        store.write_json(LEASE, {**lease.record, "owner": "other", "expires": time.time() + 600})
        time.sleep(0.6)  # a few beats
        assert store.read_json(LEASE)["owner"] == "other"
        with pytest.raises(LeaseLost, match="taken by another run"):
            lease.check()
    finally:
        lease.release()
    assert store.read_json(LEASE)["owner"] == "other"  # release leaves another run's lease alone


def test_a_lapsed_lease_fences_commits(tmp_path):
    from pipeline.store import LeaseLost, check_fence

    store = OutputStore(str(tmp_path))
    store.fs.create_dir(store.root, recursive=True)
    store.write_json(LEASE, {"owner": "me", "expires": time.time() - 1})
    with pytest.raises(LeaseLost, match="lapsed"):
        check_fence(store.fs, store.root, "me", store.uri)
    store.write_json(LEASE, {"owner": "me", "expires": time.time() + 60})
    check_fence(store.fs, store.root, "me", store.uri)


def test_a_run_whose_lease_is_taken_commits_nothing_more_and_stops(ray_cluster, tiny_dirs, tmp_path):
    """Mid-run, another run takes the directory (as it may once this run's lease lapses): no part is committed
    after that (one may be between its check and its write), no summary.json is written, the run stops with
    LeaseLost, and the other run's lease stands."""
    import threading

    from decoding.config import Config
    from pipeline.job import run
    from pipeline.store import COMMITS, LeaseLost

    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": f"r{i:03d}", "prompt": "the cat sat"}) + "\n" for i in range(48)))
    config = Config.model_validate({"model": tiny_dirs["target"], "speculative": {"method": "none"},
                                    "sampling": {"max_tokens": 24, "ignore_eos": True}, "batch_size": 2})
    out = tmp_path / "out"
    store = OutputStore(str(out))
    taken: list[int] = []

    def take_over() -> None:
        while not (out / COMMITS).exists() or not any((out / COMMITS).iterdir()):
            time.sleep(0.005)
        held = store.read_json(LEASE)
        store.write_json(LEASE, {**held, "owner": "second-run", "pid": 1, "host": "elsewhere",
                                 "expires": time.time() + 600})
        taken.append(len(list((out / COMMITS).iterdir())))

    thief = threading.Thread(target=take_over, daemon=True)
    thief.start()
    with pytest.raises(LeaseLost, match=r"^output .* taken by another run") as lost:
        run(config, str(source), str(out), verbose=False)
    assert "Traceback" not in str(lost.value) and len(str(lost.value)) < 400
    thief.join(5)
    committed = len(list((out / COMMITS).iterdir()))
    assert taken and committed <= taken[0] + 1 and committed < 48 // 8
    assert not (out / "summary.json").exists()
    assert store.read_json(LEASE)["owner"] == "second-run"


def test_a_write_task_never_reads_the_lease_half_rewritten(tmp_path):
    """The lease is rewritten at every beat while write tasks check it before each commit: a check meeting a
    rewrite must see the old record or the new one (written in place, the file read back empty mid-write and the
    run failed as lapsed)."""
    store = OutputStore(str(tmp_path))
    lease = Lease(store)
    lease.acquire()
    try:
        stop = threading.Event()
        lost: list[Exception] = []

        def fence() -> None:
            while not stop.is_set():
                try:
                    check_fence(store.fs, store.root, lease.record["owner"], store.uri)
                except LeaseLost as exc:
                    lost.append(exc)
                    return

        readers = [threading.Thread(target=fence) for _ in range(2)]
        for reader in readers:
            reader.start()
        for _ in range(300):  # as many beats as a run of ~100 minutes at the default lease
            lease._write()
        stop.set()
        for reader in readers:
            reader.join()
        assert not lost, lost[0]
    finally:
        lease.release()
