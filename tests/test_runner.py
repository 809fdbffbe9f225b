"""The engine loop both adapters share (decoding.engine.runner): results through sinks, and its progress log."""

from __future__ import annotations

import logging
from concurrent.futures import Future

import pytest

from decoding import Config, Engine, GenerationResult, Request
from decoding.engine.runner import EngineRunner
from decoding.model.loading import CPU_THREADS_ENV, worker_threads

PROMPTS = ["abc abc abc abc", "hello world", "banana bandana banana", "zebra", "one two one two one"]


def test_the_runner_delivers_every_result_and_logs_how_full_its_batch_was(tokenizer, target, caplog) -> None:
    config = Config.model_validate({"model": "in-memory", "batch_size": 2, "sampling": {"max_tokens": 6}})
    runner = EngineRunner(lambda: Engine(config, target=target, tokenizer=tokenizer))
    expected = Engine(config, target=target, tokenizer=tokenizer).generate(
        [Request(str(i), prompt=p) for i, p in enumerate(PROMPTS)])
    with caplog.at_level(logging.INFO, logger="decoding.engine.runner"):
        futures: list[Future] = []
        for i, prompt in enumerate(PROMPTS):
            request, future = Request(str(i), prompt=prompt), Future()
            futures.append(future)
            runner.submit(request, runner.prepare(request),
                          lambda event, future=future: future.set_result(event)
                          if isinstance(event, GenerationResult) else None)
        results = [future.result(timeout=60) for future in futures]
        runner.close()
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine: ")]
    assert lines, "no progress line when the engine went idle"
    # Five requests of up to 6 tokens through 2 rows: the batch is full but for the last request's steps.
    tokens = sum(int(line.split(", ")[1].split()[0]) for line in lines)
    assert tokens == sum(len(r.token_ids) for r in results)
    rows = float(lines[-1].split(", ")[-1].split()[0])
    assert 1.0 < rows <= 2.0


def test_an_observer_that_raises_fails_no_request_and_is_logged_once(tokenizer, target, caplog) -> None:
    """Metrics that raise (Ray's export refused a model named in other than ASCII) fail neither a step nor a request:
    the first failure is logged, every one counted. Before, the runner took a failure in the step's observer for
    the engine's, and every request from then on, and /health, failed."""

    class Broken:
        def submitted(self, request_id: str, prompt_tokens: int) -> None:
            raise RuntimeError("observer broke")

        def aborted(self, request_id: str) -> None:
            raise RuntimeError("observer broke")

        def stepped(self, output) -> None:
            raise RuntimeError("observer broke")

    config = Config.model_validate({"model": "in-memory", "batch_size": 2, "sampling": {"max_tokens": 6}})
    expected = Engine(config, target=target, tokenizer=tokenizer).generate(
        [Request(str(i), prompt=p) for i, p in enumerate(PROMPTS)])
    runner = EngineRunner(lambda: Engine(config, target=target, tokenizer=tokenizer), observer=Broken())
    futures: list[Future] = []
    with caplog.at_level(logging.ERROR, logger="decoding.engine.runner"):
        for i, prompt in enumerate(PROMPTS):
            request, future = Request(str(i), prompt=prompt), Future()
            futures.append(future)
            runner.submit(request, runner.prepare(request), lambda event, future=future: None if future.done()
                          else future.set_result(event) if isinstance(event, GenerationResult | BaseException)
                          else None)
        events = [future.result(timeout=60) for future in futures]
        runner.close()
    assert [event.token_ids for event in events] == [r.token_ids for r in expected]
    assert runner.failure is None and runner.observer_failures == len(PROMPTS) + runner.steps
    assert sum("observer" in record.getMessage() for record in caplog.records) == 1


def test_a_step_stuck_in_one_requests_constraint_fails_that_request_alone(tokenizer, target, monkeypatch) -> None:
    """The watchdog: a step that runs past limits.step_timeout_s inside one request's grammar work is stopped; that
    request fails alone, naming the limit, and the others (one constrained too) finish with the outputs they would
    have had. Before, the step ran on and every request on the engine waited for it."""
    import time

    from decoding.constraints.grammar import RowGrammar
    from decoding.engine.runner import RequestRejected

    config = Config.model_validate({"model": "in-memory", "batch_size": 4, "sampling": {"max_tokens": 8},
                                    "speculative": {"method": "ngram", "num_speculative_tokens": 3}})
    constrained = {"structured_outputs": {"regex": "(ran|sat) (far|home)\\."}, "max_tokens": 8}
    requests = [Request("plain", prompt="the cat sat"), Request("regex", prompt="a dog", sampling=constrained),
                Request("slow", prompt="a dog", sampling=constrained), Request("other", prompt="far away home")]
    expected = {r.id: r.token_ids for r in Engine(config, target=target, tokenizer=tokenizer).generate(
        [r for r in requests if r.id != "slow"])}
    commit = RowGrammar.commit

    def stuck(self, tokens):  # a grammar's work that never ends, in Python (a C call returns before it is stopped)
        while self.owner == "slow":
            time.sleep(0.01)
        return commit(self, tokens)

    monkeypatch.setattr(RowGrammar, "commit", stuck)
    runner = EngineRunner(lambda: Engine(config, target=target, tokenizer=tokenizer), step_timeout_s=1.0)
    futures: dict[str, Future] = {}
    for request in requests:
        futures[request.id] = future = Future()
        runner.submit(request, runner.prepare(request), lambda event, future=future: future.set_result(event)
                      if isinstance(event, GenerationResult | BaseException) else None)
    outcomes = {name: future.result(timeout=60) for name, future in futures.items()}
    assert isinstance(outcomes["slow"], RequestRejected), outcomes["slow"]
    assert "limits.step_timeout_s (1 s)" in str(outcomes["slow"])
    assert {name: outcome.token_ids for name, outcome in outcomes.items() if name != "slow"} == expected
    assert outcomes["regex"].finish_reason in ("stop", "length") and runner.failure is None
    assert runner.step_running_for() == 0.0  # idle and healthy: a server's /health is ok again
    runner.close()


def test_an_engines_cpu_threads_come_from_num_cpus_then_the_environment_then_the_cores_split(monkeypatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.delenv(CPU_THREADS_ENV, raising=False)
    assert [worker_threads(None, 1), worker_threads(None, 4), worker_threads(None, 16), worker_threads(3, 4)] == [
        8, 2, 1, 3]
    monkeypatch.setenv(CPU_THREADS_ENV, "2")
    assert [worker_threads(None, 1), worker_threads(None, 16), worker_threads(3, 4)] == [2, 2, 3]
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(CPU_THREADS_ENV, bad)
        with pytest.raises(ValueError, match=f"{CPU_THREADS_ENV}='{bad}'"):
            worker_threads(None, 1)
