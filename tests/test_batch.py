"""The engine's row owners, each on its own: the batch (rows joining and leaving in any order, the step's derived
flags), the scheduler (admission by rows and KV blocks), the step's phases on a tiny model, and the layout rule that
only the batch adds or removes rows."""

from __future__ import annotations

import ast
import random
import time
from pathlib import Path

import torch
from tiny import tiny_model, tiny_tokenizer

from decoding.config import Config, SamplingParams
from decoding.engine.batch import Batch, JoinedRows
from decoding.engine.build import build_parts
from decoding.engine.scheduler import Scheduler
from decoding.engine.sequence import Sequence
from decoding.engine.step import HostReads, Step
from decoding.model.kv_cache import CacheShape, PagedKVCache

REPO = Path(__file__).resolve().parents[1]


def sequence(request_id: str, prompt_len: int = 3, **params) -> Sequence:
    return Sequence(request_id, "x" * prompt_len, list(range(1, prompt_len + 1)), SamplingParams(**params),
                    torch.Generator().manual_seed(0), time.perf_counter())


def cache(rows: int = 8, blocks: int = 64) -> PagedKVCache:
    return PagedKVCache(CacheShape(1, 1, 4), blocks, rows, 32, block_size=4)


class Recorder:
    """A part keeping per-row state: a list mirroring the batch's rows, updated only through the batch's calls."""

    def __init__(self) -> None:
        self.rows: list[str] = []

    def rows_joined(self, joined: JoinedRows) -> None:
        assert joined.rows == slice(len(self.rows), len(self.rows) + len(joined.seqs))
        self.rows += [seq.request_id for seq in joined.seqs]

    def row_removed(self, row: int, last: int, seq: Sequence) -> None:
        assert self.rows[row] == seq.request_id and last == len(self.rows) - 1
        self.rows[row] = self.rows[last]
        self.rows.pop()


def test_rows_join_and_leave_in_any_order_and_every_part_keeps_the_same_rows() -> None:
    rng = random.Random(0)
    batch = Batch(8, SamplingParams(), cache(), run_seeded=False, max_context=64)
    recorder = Recorder()
    batch.listen(recorder)
    expected: dict[str, tuple[float, int, float]] = {}  # request -> (temperature, max_tokens, root score marker)
    count = 0
    for _ in range(200):
        if len(batch) < batch.capacity and (not len(batch) or rng.random() < 0.55):
            joining = []
            for _ in range(rng.randint(1, min(3, batch.capacity - len(batch)))):
                count += 1
                temperature = rng.choice([0.0, 0.5, 1.0])
                joining.append(sequence(f"r{count}", temperature=temperature, max_tokens=count))
            rows = batch.admit(joining, [8] * len(joining))
            batch.joined(JoinedRows(rows, joining, [8] * len(joining), None))
            batch.set_root_scores(rows, torch.tensor([[float(count - i)] for i in range(len(joining))][::-1]))
            for seq in joining:
                row = batch.row_of(seq.request_id)
                expected[seq.request_id] = (seq.params.temperature, seq.params.max_tokens,
                                            float(batch.root_scores[row, 0]))
        else:
            removed = batch.remove(rng.randrange(len(batch)))
            del expected[removed.request_id]
        ids = [seq.request_id for seq in batch.seqs]
        assert recorder.rows == ids
        assert batch.cache.active == len(batch) and sorted(ids) == sorted(expected)
        for row, request_id in enumerate(ids):
            temperature, max_tokens, score = expected[request_id]
            assert float(batch.warp_host.temperature[row]) == float(batch.warp_device.temperature[row]) == temperature
            assert int(batch.max_tokens[row]) == max_tokens
            assert float(batch.root_scores[row, 0]) == score


def test_the_step_metadata_derives_each_flag_once_from_the_rows() -> None:
    batch = Batch(4, SamplingParams(), cache(4), run_seeded=False, max_context=20)
    seqs = [
        sequence("greedy", max_tokens=10),
        sequence("tiny-temperature", temperature=1e-6, max_tokens=4),  # below vLLM's threshold: greedy
        sequence("seeded", temperature=1.0, seed=3, max_tokens=100),
        sequence("penalized", temperature=0.5, presence_penalty=0.5, max_tokens=10, prompt_len=12),
    ]
    batch.admit(seqs, [20] * 4)
    batch.cache.advance(slice(0, 4), [3, 3, 3, 12])
    seqs[0].generated = [5, 6]
    seqs[1].finish_reason = "length"
    meta = batch.metadata()
    assert meta.greedy.tolist() == [True, True, False, False]
    assert meta.row_warp.greedy.tolist() == [True, True, False, False]
    assert meta.sampled == [2, 3] and not meta.all_greedy
    assert meta.reproducible == [False, False, True, False]  # its own seed; no run seed
    assert meta.penalized and not meta.constrained
    # Room: max_tokens - generated - 1, and the context (max_context - 1 - cached); 0 for a finished row.
    assert meta.room.tolist() == [10 - 2 - 1, 0, 20 - 1 - 3, min(10 - 0 - 1, 20 - 1 - 12)]
    seeded_run = Batch(4, SamplingParams(), cache(4), run_seeded=True, max_context=20)
    seeded_run.admit([seqs[0], seqs[2], seqs[3]], [20] * 3)
    assert seeded_run.metadata().reproducible == [False, True, True]  # the run's seed: every sampled row
    # A prefill's metadata covers the joining rows, which sit at the end of the batch.
    assert batch.metadata(seqs[2:]).rows == slice(2, 4)


def test_the_scheduler_admits_in_order_while_rows_and_kv_blocks_are_free() -> None:
    pool = cache(rows=3, blocks=10)  # 10 blocks of 4 positions
    batch = Batch(3, SamplingParams(), pool, run_seeded=False, max_context=64)
    scheduler = Scheduler(batch, lambda seq: len(seq.prompt_ids) + seq.params.max_tokens)
    for request_id, prompt_len, max_tokens in [("a", 4, 8), ("b", 4, 8), ("c", 4, 12), ("d", 1, 1), ("e", 1, 1)]:
        scheduler.waiting.append(sequence(request_id, prompt_len, max_tokens=max_tokens))
    joining = scheduler.admit()
    # a and b take 3 blocks each; c needs 4 of the 4 left... then d would need 1 more: blocks stop d, not order.
    assert [seq.request_id for seq in joining] == ["a", "b", "c"]
    batch.admit(joining)  # with the claims admission made
    assert scheduler.admit() == []  # no row free
    batch.remove(0)
    assert [seq.request_id for seq in scheduler.admit()] == ["d"]  # first come, first served, one row free
    assert scheduler.drop_waiting("e") and not scheduler.drop_waiting("e")
    # Head of the line: a waiting request that does not fit holds back a smaller one behind it.
    small_pool = Batch(3, SamplingParams(), cache(rows=3, blocks=6), run_seeded=False, max_context=64)
    blocked = Scheduler(small_pool, lambda seq: len(seq.prompt_ids) + seq.params.max_tokens)
    blocked.waiting.append(sequence("first", 4, max_tokens=8))  # 3 blocks
    small_pool.admit(blocked.admit())
    blocked.waiting.extend([sequence("big", 4, max_tokens=12), sequence("small", 1, max_tokens=1)])  # 4 and 1
    assert blocked.admit() == [] and len(blocked.waiting) == 2
    small_pool.remove(0)
    assert [seq.request_id for seq in blocked.admit()] == ["big", "small"]


def test_step_phases_change_batch_state_only_in_commit() -> None:
    torch.manual_seed(0)
    config = Config(model="tiny", batch_size=2, max_model_len=64,
                    speculative={"method": "ngram", "num_speculative_tokens": 3, "length_policy": "static"})
    parts = build_parts(config, target=tiny_model(), tokenizer=tiny_tokenizer())
    batch = Batch(2, config.sampling, parts.cache, run_seeded=False, max_context=parts.max_context)
    step = Step(parts, batch, HostReads())
    seqs = [sequence("a", 5, max_tokens=3), sequence("b", 8, max_tokens=40)]
    for seq in seqs:  # a repeating prompt, so lookup drafts
        seq.prompt_ids = [3, 4, 5, 3, 4, 5, 3, 4][: len(seq.prompt_ids)]
    emitted = step.prefill(seqs, [40, 60])
    assert emitted == [seq.generated for seq in seqs] and all(len(tokens) == 1 for tokens in emitted)
    plan = step.plan(seqs)
    assert plan.rows == slice(0, 2)
    assert plan.depths.tolist()[0] == 3 - 1 - 1  # max_tokens 3, one token out: room for 1 draft token
    assert plan.depths.tolist()[1] == 3
    drafted = step.draft(seqs, plan)
    lengths, scores = list(parts.cache.host_lengths[:2]), batch.root_scores.clone()
    generated = [list(seq.generated) for seq in seqs]
    verdict = step.verify(seqs, plan, drafted)
    # Verification reads the batch and the cache; nothing that outlives the step has changed yet.
    assert parts.cache.host_lengths[:2] == lengths and torch.equal(batch.root_scores, scores)
    assert [seq.generated for seq in seqs] == generated
    committed = step.commit(seqs, plan, drafted, verdict)
    assert torch.equal(batch.root_scores[:2], verdict.batch.next_law)
    for seq, before, kept in zip(seqs, generated, committed.kept_tokens, strict=True):
        assert seq.generated[: len(before)] == before
        assert kept == seq.generated[len(before):]
    assert parts.cache.host_lengths[:2] == [n + len(path) for n, path in zip(lengths, verdict.paths)]


# Methods through which rows join and leave; only the batch calls them (the drafter mirrors the batch's rows into a
# draft cache of its own from within its own handlers, and a cost calibration sizes a scratch pool of its own).
ROW_CALLS = {"add_rows", "remove_row", "rows_joined", "row_removed"}
ALLOWED = {
    "decoding/engine/batch.py": None,  # anywhere
    # a drafter passes the rows on to its lookup siblings and to its draft cache
    "decoding/drafting/lookup.py": {"rows_joined", "row_removed"},
    "decoding/drafting/recycle.py": {"rows_joined", "row_removed"},
    "decoding/drafting/draft_model.py": {"rows_joined", "row_removed"},
    "decoding/drafting/costs.py": {"forward_timers"},
}


def row_calls(path: Path) -> list[tuple[str, int, str]]:
    """(calling function, line, method) for every call of a row method in ``path``."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr in ROW_CALLS):
                found.append((function, child.lineno, child.func.attr))
            visit(child, function)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_only_the_batch_adds_or_removes_rows() -> None:
    violations = []
    for path in sorted((REPO / "decoding").rglob("*.py")):
        name = str(path.relative_to(REPO))
        allowed = ALLOWED.get(name, set())
        for function, line, method in row_calls(path):
            if allowed is not None and function not in allowed:
                violations.append(f"{name}:{line} {function} calls {method}")
    assert violations == []


def test_the_row_rule_finds_a_call_outside_the_batch(tmp_path: Path) -> None:
    module = tmp_path / "example.py"
    module.write_text("class Engine:\n    def abort(self, row):\n        self.cache.remove_row(row)\n")
    assert row_calls(module) == [("abort", 3, "remove_row")]


def test_admission_is_fair_between_requests(target, tokenizer):
    """Eight sequences of one request (the n choices of one HTTP body) and then a small request, two rows: the
    small one takes the first row that frees, instead of waiting for all eight (first come, first served made a
    4-token request wait 216 s behind one n=128 request)."""
    from engine_cases import make_config

    from decoding import Engine, Request

    engine = Engine(make_config(method="none", batch_size=2, sampling={"max_tokens": 6, "ignore_eos": True}),
                    target=target, tokenizer=tokenizer)
    for choice in range(8):
        engine.add_request(Request(f"big-{choice}", prompt="the cat", group="big"))
    engine.add_request(Request("small", prompt="a dog", sampling={"max_tokens": 2, "ignore_eos": True}))
    order = []
    while engine.has_unfinished():
        order += [result.id for result in engine.step().finished]
    assert sorted(order) == sorted([f"big-{c}" for c in range(8)] + ["small"])
    assert order.index("small") <= 3, order  # FIFO: after six of the eight
    # Within a group, arrival order holds.
    assert [i for i in order if i.startswith("big")] == [f"big-{c}" for c in range(8)]


def test_the_fair_queue_picks_the_group_with_fewest_running_the_earliest_on_a_tie():
    from collections import Counter

    from decoding.engine.scheduler import FairQueue

    queue = FairQueue()
    for name, group in (("a0", "a"), ("b0", "b"), ("a1", "a"), ("c0", "c"), ("b1", "b")):
        seq = sequence(name)
        seq.group = group
        queue.append(seq)
    assert queue.next_for(Counter()).request_id == "a0"  # none running anywhere: the earliest group
    assert queue.next_for(Counter({"a": 2, "b": 1})).request_id == "c0"  # the only group with none running
    assert queue.next_for(Counter({"a": 2, "b": 1, "c": 1})).request_id == "b0"  # fewest, earliest of equals
    assert queue.next_for(Counter({"a": 1, "b": 3, "c": 1})).request_id == "a0"
    queue.pop(queue.next_for(Counter({"a": 3, "b": 2, "c": 2})))  # b0
    assert [seq.request_id for seq in queue] == ["a0", "a1", "b1", "c0"] and len(queue) == 4
