"""specbatch bench's measuring modes on tiny models: another checkout's engine side by side, the framework's
overhead per step, the cost of the engine's forwards on a given shape, and the device-time accounting."""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel

from bench import harness as benchmark
from bench.baseline import _known_fields, convert_model, load_baseline
from bench.harness import BenchGrid, Models, Sweep, contenders, run_bench
from bench.measure import (
    Clock,
    ForwardBytes,
    count_launches,
    device_bandwidth,
    known_bandwidth,
    measured_bandwidth,
    weight_bytes,
)
from bench.overhead import (
    CYCLE,
    cycle_prompts,
    cycle_tokens,
    format_overhead,
    overhead_config,
    overhead_model,
    run_overhead,
)
from bench.shape_costs import SHAPES, format_shape_costs, random_model, run_shape_costs
from decoding.config import Config
from decoding.engine import Engine, Request
from decoding.model.quantize import quantized
from jobs import bench

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def baseline_tree(tmp_path_factory) -> Path:
    """A copy of this checkout's engine, as another checkout would hold it."""
    tree = tmp_path_factory.mktemp("baseline")
    shutil.copytree(REPO / "decoding", tree / "decoding", ignore=shutil.ignore_patterns("__pycache__"))
    return tree


@pytest.fixture(scope="session")
def baseline(baseline_tree):
    return load_baseline(baseline_tree)


# ---------------------------------------------------------------------------------------------------- baseline
def test_the_baseline_tree_is_its_own_package(baseline, baseline_tree):
    import decoding.engine.engine

    assert baseline.__name__ == "baseline_decoding"
    assert Path(baseline.engine.__file__).is_relative_to(baseline_tree)
    assert baseline.engine.Engine is not decoding.engine.engine.Engine
    # Its own imports resolve to its own modules, statements and importlib strings alike (the lazy names of its
    # __init__ go through importlib.import_module("decoding.engine.engine")).
    assert baseline.engine.engine.Config is baseline.config.Config is not decoding.engine.engine.Config
    assert baseline.Engine is baseline.engine.Engine
    assert all(Path(m.__file__).is_relative_to(baseline_tree)
               for name, m in sys.modules.items() if name.startswith("baseline_decoding") and m is not None)
    assert Path(sys.modules["decoding.engine.engine"].__file__).is_relative_to(REPO)
    assert load_baseline(baseline_tree) is baseline  # imported once
    with pytest.raises(ValueError, match="already imported"):
        load_baseline(REPO)
    with pytest.raises(FileNotFoundError):
        load_baseline(baseline_tree / "nowhere", alias="baseline_missing")


def test_configs_convert_to_the_baseline_keeping_the_fields_it_has(baseline):
    config = Config(model="tiny", batch_size=3, max_model_len=128, speculative={"method": "ngram"})
    converted = convert_model(config, baseline.config.Config)
    assert type(converted) is baseline.config.Config
    assert converted.model_dump() == config.model_dump()

    class Inner(BaseModel):
        kept: int = 0

    class Older(BaseModel):  # a baseline without ``dropped``, and without the nested ``inner.gone``
        inner: Inner | None = None
        name: str = ""

    data = {"inner": {"kept": 2, "gone": 1}, "name": "x", "dropped": True}
    assert _known_fields(data, Older) == {"inner": {"kept": 2}, "name": "x"}


def test_baseline_rows_follow_each_engine_and_decode_the_same(baseline, target, tokenizer):
    config = Config(model="tiny", batch_size=2, sampling={"max_tokens": 6},
                    speculative={"method": "ngram", "num_speculative_tokens": 3, "num_candidates": 1,
                                 "length_policy": "static"})
    grid = BenchGrid(sweeps=[Sweep(batch_sizes=[2])], assisted=False)
    names = [c.name for c in contenders(config, grid, baseline=True)]
    assert names == ["transformers generate", "engine none", "baseline engine none",
                     "engine ngram w1 d3 init=draft static", "baseline engine ngram w1 d3 init=draft static"]
    prompts = {"p": [Request("a", prompt="abc abc abc"), Request("b", prompt="the cat the cat"),
                     Request("c", prompt="hello")]}
    result = run_bench(config, prompts, grid, Models(target, tokenizer), baseline=baseline)
    rows = {row.name: row for row in result.rows}
    assert set(rows) == set(names)
    for name in ("baseline engine none", "baseline engine ngram w1 d3 init=draft static"):
        assert rows[name].identical
        assert rows[name].generated_tokens == rows[name.removeprefix("baseline ")].generated_tokens
        assert rows[name].decode_steps > 0 and rows[name].ms_per_step > 0
        assert not rows[name].slower_than_none  # only this engine's configurations are flagged
    assert rows["baseline engine ngram w1 d3 init=draft static"].drafted_per_step > 0
    # The copy's CPU attention kernel is the one already loaded: it runs, not the reference attention.
    from decoding.model import attention

    assert baseline.model.attention._kernel_state.get("loaded") == attention._kernel_state.get("loaded")


def test_results_of_an_engine_without_a_counter_convert_to_this_ones_stats():
    from types import SimpleNamespace

    from decoding import stats
    from decoding.stats import SpecDecodeStats

    class OlderStats:  # an older engine's counters: no grammar-forced tokens
        @dataclass(frozen=True)
        class SpecDecodeStats:
            num_spec_steps: int
            num_draft_tokens: int

            @classmethod
            def of(cls, result):
                return cls(len(result.per_step_drafted), sum(result.per_step_drafted))

    older = SimpleNamespace(per_step_drafted=[3, 2])
    assert benchmark.result_stats(OlderStats, older) == SpecDecodeStats(num_spec_steps=2, num_draft_tokens=5)
    current = SimpleNamespace(token_ids=[5, 6, 7], per_step_drafted=[2], per_step_accepted=[1], num_target_forwards=2,
                              acceptance_histogram=[0, 1, 0], num_grammar_forced_tokens=1)
    assert benchmark.result_stats(stats, current) == SpecDecodeStats.of(current)


# ----------------------------------------------------------------------------------------- device accounting
def test_clock_hands_each_span_its_seconds_when_settled():
    clock = Clock(torch.device("cpu"))
    seen = []
    with clock.span(seen.append):
        sum(range(10000))
    start = clock.mark()
    clock.add(start, start + 0.25, seen.append)
    assert seen == []  # nothing before the turn ends
    clock.settle()
    assert seen[0] > 0 and seen[1] == 0.25
    clock.settle()
    assert len(seen) == 2


def test_bandwidth_from_the_option_the_table_or_a_measured_copy():
    assert known_bandwidth("NVIDIA H100 80GB HBM3") == 3350.0
    assert known_bandwidth("NVIDIA H100 PCIe") == 2000.0
    assert known_bandwidth("NVIDIA H200") == 4800.0
    assert known_bandwidth("Some CPU") is None
    assert device_bandwidth(torch.device("cpu"), 123.0).gbs == 123.0
    measured = device_bandwidth(torch.device("cpu"))
    assert measured.source.startswith("measured") and measured.gbs > 0
    assert measured_bandwidth(torch.device("cpu"), megabytes=8, repeats=1) > 0


def test_weight_bytes_count_what_a_forward_reads(target):
    embedding = target.get_input_embeddings().weight
    every = sum(p.numel() * p.element_size() for p in target.parameters())
    # Untied: the input embedding is read as rows only.
    assert weight_bytes(target) == every - embedding.numel() * embedding.element_size()
    tied = overhead_model(overhead_config(layers=2, vocab_size=512))
    assert tied.lm_head.weight is tied.get_input_embeddings().weight
    assert weight_bytes(tied) == sum(p.numel() * p.element_size() for p in tied.parameters())  # once, as the head
    # A weight-only twin reads its packed weights, not the float ones it shares with the model.
    twin = quantized(random_model("tiny", torch.device("cpu"), torch.float32), "int4")
    packed = weight_bytes(twin)
    assert 0 < packed < weight_bytes(random_model("tiny", torch.device("cpu"), torch.float32)) / 4
    cost = ForwardBytes.of(target)
    config = target.config
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * 4
    assert cost.per_position == per_position and cost(10) == cost.weights + 10 * per_position


def test_every_contender_is_warmed_at_its_batch_size_and_the_first_rotates_every_step(monkeypatch):
    calls = []

    def recording_runner(_models, contender):
        def turns(prompts, into, max_tokens=None):
            for step in range(3):
                calls.append((contender.name, len(prompts), max_tokens, step))
                yield True

        return benchmark._Runner(turns)

    monkeypatch.setattr(benchmark, "_runner", recording_runner)
    config = Config(model="tiny", batch_size=2, speculative={"method": "ngram"})
    group = [c for c in contenders(config, BenchGrid(sweeps=[Sweep(batch_sizes=[2])], assisted=False))]
    names = [c.name for c in group]
    benchmark._interleaved(None, group, {"a": [1], "b": [2]}, lambda *_: None, "step", warm_up=[5])
    warm, timed = calls[: 3 * len(group)], calls[3 * len(group):]
    assert [(n, size, tokens) for n, size, tokens, _ in warm] == [
        (n, 2, benchmark.WARM_UP_TOKENS) for n in names for _ in range(3)]
    assert all(tokens is None for _, _, tokens, _ in timed)
    firsts = [timed[i][0] for i in range(0, len(timed), len(group))]
    assert firsts == [names[step % len(names)] for step in range(3)]


def test_bench_rows_report_decode_steps_bytes_and_bandwidth(target, tokenizer):
    config = Config(model="tiny", batch_size=1, sampling={"max_tokens": 6})
    grid = BenchGrid(sweeps=[Sweep(batch_sizes=[1], methods=["ngram"], length_policy=["static"])], assisted=False)
    prompt = [Request("a", prompt="abc abc abc abc")]
    result = run_bench(config, {"p": prompt}, grid, Models(target, tokenizer), bandwidth_gbs=50.0)
    assert result.environment["bandwidth_gbs"] == 50.0 and result.environment["timer"] == "perf_counter"
    cost = ForwardBytes.of(target)
    for row in result.rows:
        assert row.decode_steps > 0 and row.ms_per_step > 0
        # At least the weights and the prompt's cached positions, every step.
        assert row.bytes_per_step >= cost(len(tokenizer("abc abc abc abc").input_ids))
        assert row.bandwidth_fraction == pytest.approx(row.bytes_per_step / (row.ms_per_step / 1e3) / 50e9)
    plain = {r.name: r for r in result.rows}["engine none"]
    # One token a decode step; the step that admits the prompt emits the first token or two and is no decode step.
    assert plain.generated_tokens - 2 <= plain.decode_steps <= plain.generated_tokens - 1
    assert plain.drafted_per_step == 0

    # One decode step's launches: those of a fresh engine's first decode step on the prompt, counted alike (aten
    # operations on the CPU); one target forward a step, plain or verifying n-gram drafts.
    none = next(c for c in contenders(config, grid) if c.name == "engine none")
    engine = Engine(none.config, target=target, tokenizer=tokenizer)
    engine.add_request(Request("x", prompt="abc abc abc abc", sampling={"max_tokens": 64, "ignore_eos": True}))
    engine.step()  # admits the prompt
    assert plain.launches_per_step == count_launches(engine.step, target.device) > 0
    engine_rows = [row for row in result.rows if row.name != "transformers generate"]
    assert len(engine_rows) == 2 and {r.launches_per_step for r in result.rows if r not in engine_rows} == {None}
    for row in engine_rows:
        assert row.launches_per_layer == row.launches_per_step / target.config.num_hidden_layers


# ---------------------------------------------------------------------------------------------------- overhead
def test_the_overhead_model_has_smollm2s_structure_and_continues_its_cycle():
    model = overhead_model()
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.hidden_size, config.vocab_size) == (30, 9, 3, 16, 64, 49152)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    prompts = cycle_prompts(config.vocab_size, 2)
    cycle = cycle_tokens(config.vocab_size)
    out = model.generate(torch.tensor(prompts), max_new_tokens=2 * CYCLE, do_sample=False)
    for row, prompt in enumerate(prompts):
        start = cycle.index(prompt[-1]) + 1
        assert out[row, len(prompt):].tolist() == [cycle[(start + i) % CYCLE] for i in range(2 * CYCLE)]


def test_overhead_rows_ratios_and_full_depth_drafts(device):
    result = run_overhead(rounds=2, steps=3, batch_sizes=[1, 2], depth=3, device=device,
                          config=overhead_config(layers=2, vocab_size=512))
    rows = {(r.name, r.batch_size): r for r in result.rows}
    speculative = "engine ngram w1 d3 init=draft static"
    default = "engine draft_model self-int4 w1 d5 init=draft online"
    assert set(rows) == {("transformers generate", 1), ("engine none", 1), (default, 1), (speculative, 1),
                         ("transformers generate", 2), ("engine none", 2), (default, 2)}
    for (name, batch), row in rows.items():
        assert len(row.rounds_ms) == 2 and row.ms_per_step == min(row.rounds_ms) > 0
        assert row.median_ms_per_step == statistics.median(row.rounds_ms) and row.bytes_per_step > 0
        if name == "transformers generate":
            assert row.x_transformers is None and row.target is None and row.drafted_per_step is None
            assert row.decode_steps == 2 * 4  # per round: the iterations after the prefill (max_tokens steps + 2)
            continue
        reference = rows["transformers generate", 1 if name == speculative else batch]
        assert row.x_transformers == pytest.approx(row.ms_per_step / reference.ms_per_step)
        if name == default:  # measured per emitted token against plain decoding, not held to a target
            plain = rows["engine none", batch]
            # Every running row emits a token a step; the online policy's rows may draft and finish apart (it decides
            # by measured forward times), so only plain decoding's rows keep in step to the end.
            assert row.tokens_per_step >= 1 and plain.tokens_per_step == batch
            assert row.x_engine_none == pytest.approx(
                row.ms_per_step / row.tokens_per_step / (plain.ms_per_step / plain.tokens_per_step))
            assert row.target is None and row.meets_target is None
            continue
        assert row.x_engine_none is None
        assert row.target == (0.7 if name == speculative else 0.35 if batch == 1 else 0.7)
        assert row.meets_target == (row.x_transformers <= row.target)
    # The cycle makes lookup draft at full depth, and every draft is accepted.
    assert rows[speculative, 1].drafted_per_step == 3 and rows[speculative, 1].accepted_per_step == 3
    assert rows["engine none", 1].drafted_per_step == 0
    # Per round at least the steps asked for (the step admitting the prompt emits one token or two).
    assert rows["engine none", 1].decode_steps in (2 * 3, 2 * 4)
    assert result.environment["timer"] == ("CUDA events" if device.type == "cuda" else "perf_counter")
    assert len(format_overhead(result).splitlines()) == len(result.rows) + 1


def test_every_round_has_decode_steps_whatever_the_default_policy_decides(monkeypatch):
    """The default's online policy decides by the forward times it measures: on a loaded machine it may draft at
    full depth in the very step that admits a prompt, which then emits all its tokens but the ones kept back for
    decode steps. Pinned to that case (lookup at the default's full depth, every draft accepted on the cycle),
    every contender still has one figure per round."""
    import bench.overhead as overhead

    make = overhead._engine_config

    def drafting_default(batch_size: int, max_tokens: int, method: str | None = "none", depth: int = 1) -> Config:
        if method is None:  # the default configuration's row, drafting at its full depth every step
            return make(batch_size, max_tokens, "ngram", Config().speculative.num_speculative_tokens)
        return make(batch_size, max_tokens, method, depth)

    monkeypatch.setattr(overhead, "_engine_config", drafting_default)
    result = run_overhead(rounds=2, steps=1, batch_sizes=[1, 2], depth=0, device=torch.device("cpu"),
                          config=overhead_config(layers=2, vocab_size=512))
    assert [row.name for row in result.rows].count("engine ngram w1 d5 init=draft static") == 2
    assert all(len(row.rounds_ms) == 2 and row.decode_steps >= 2 for row in result.rows), result.rows


def test_overhead_cli_with_a_baseline_tree_writes_its_json(baseline_tree, baseline, tmp_path, capsys):
    out = tmp_path / "overhead"
    argv = ["--overhead", "--rounds", "2", "--steps", "2", "--batch-sizes", "1", "--depths", "2",
            "--baseline-tree", str(baseline_tree), "--output", str(out), "--device", "cpu"]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "overhead.json").read_text())
    names = [row["name"] for row in result["rows"]]
    default = "engine draft_model self-int4 w1 d5 init=draft online"
    assert names == ["transformers generate", "engine none", "baseline engine none", default, f"baseline {default}",
                     "engine ngram w1 d2 init=draft static", "baseline engine ngram w1 d2 init=draft static"]
    assert result["environment"]["compile_enabled"] is False  # the tests' setting: eager
    assert result["model"]["layers"] == 30
    for name in names:
        assert name in printed


# ------------------------------------------------------------------------------------------------- shape costs
def test_random_models_are_made_on_the_device_in_their_dtype(device):
    model = random_model("tiny", device, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {device.type}
    assert model.config.hidden_size == SHAPES["tiny"]["hidden_size"]
    assert SHAPES["llama3-8b"]["hidden_size"] == 4096 and SHAPES["llama3-8b"]["vocab_size"] == 128256


def test_shape_costs_time_target_verify_and_int4_draft(device):
    result = run_shape_costs("tiny", device, batch_sizes=[1, 2], context=32, depth=2, repeats=2)
    assert [(r.forward, r.batch_size) for r in result.rows] == [
        (name, batch) for batch in (1, 2) for name in ("target decode", "target verify d2", "int4 self-draft decode")]
    model = random_model("tiny", device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    dtype = next(model.parameters()).dtype
    config = model.config
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * dtype.itemsize
    assert result.weight_bytes["target"] == weight_bytes(model)
    assert 0 < result.weight_bytes["draft"] < result.weight_bytes["target"]
    for row in result.rows:
        weights = result.weight_bytes["draft" if "draft" in row.forward else "target"]
        assert row.bytes_per_step == weights + row.batch_size * 32 * per_position
        assert row.ms > 0 and row.bandwidth_fraction > 0
        assert row.tokens_per_row == (3 if "verify" in row.forward else 1)
        decode = next(r for r in result.rows if r.batch_size == row.batch_size and r.forward == "target decode")
        assert row.x_target_decode == pytest.approx(row.ms / decode.ms)
    assert len(format_shape_costs(result).splitlines()) == len(result.rows) + 1


def test_shape_costs_cli_writes_its_json(tmp_path, capsys):
    out = tmp_path / "costs"
    argv = ["--shape-costs", "tiny", "--batch-sizes", "1", "--context", "16", "--repeats", "1", "--output", str(out),
            "--device", "cpu", "--bandwidth-gbs", "10"]
    assert bench.main(argv) == 0
    result = json.loads((out / "shape_costs.json").read_text())
    assert result["shape"] == "tiny" and result["bandwidth_gbs"] == 10.0
    assert [r["forward"] for r in result["rows"]] == ["target decode", "target verify d5", "int4 self-draft decode"]
    assert "int4 self-draft decode" in capsys.readouterr().out
