"""specbatch bench on the tiny models: every configured row, consistent metrics, and the written files."""

from __future__ import annotations

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from matplotlib.image import imread

from bench import harness as benchmark
from bench.harness import BenchGrid, Models, Sweep, contenders, format_table, run_bench
from decoding.config import Config
from decoding.drafting.feature_draft import FeatureDraft, load_draft
from decoding.engine import Request
from decoding.model.loading import DRAFT_METADATA
from jobs import bench

PROMPTS = ["the cat sat on the mat. the cat sat", "abc abc abc abc", "hello world, hello world, hello"]


def _config(draft_path: str, **sampling) -> Config:
    return Config(
        model="tiny", batch_size=2,
        speculative={"method": "draft_model", "model": draft_path, "num_speculative_tokens": 3, "num_candidates": 2},
        sampling={"max_tokens": 8, **sampling},
    )


GRID = BenchGrid(sweeps=[  # every axis varies somewhere; kept small so the test stays fast
    Sweep(batch_sizes=[1], methods=["ngram", "draft_model"], num_candidates=[1, 2], candidate_init=["target"],
          length_policy=["static"]),
    Sweep(batch_sizes=[1], methods=["draft_model"], num_speculative_tokens=[2], candidate_init=["draft"],
          length_policy=["online", "heuristic"]),
    Sweep(batch_sizes=[2], num_candidates=[2], length_policy=["online"]),
])

EXPECTED = {  # (batch size, name) of every row GRID asks for
    (1, "transformers generate"),
    (1, "transformers assisted (prompt lookup)"),
    (1, "transformers assisted (draft)"),
    (1, "engine none"),
    # Width 1 builds the same chain whichever model starts it: one row, named init=draft.
    *{(1, f"engine {m} w{w} d3 init={i} static") for m in ("ngram", "draft_model")
      for w, i in ((1, "draft"), (2, "target"))},
    (1, "engine draft_model w2 d2 init=draft online"),
    (1, "engine draft_model w2 d2 init=draft heuristic"),
    (2, "transformers generate"),
    (2, "engine none"),
    (2, "engine draft_model w2 d3 init=draft online"),
}


@pytest.fixture
def models(target, tokenizer, draft, tiny_dirs) -> Models:
    return Models(target, tokenizer, draft, tiny_dirs["draft"])


def test_bench_runs_a_feature_draft_and_refuses_it_as_a_transformers_assistant(target, tokenizer, tiny_dirs,
                                                                               tmp_path):
    directory = tmp_path / "feature"
    FeatureDraft.from_target(target, [1], list(range(target.config.vocab_size))).save(directory)
    (directory / DRAFT_METADATA).write_text(json.dumps({"architecture": "feature", "vocab_subset": None}))
    draft = load_draft(str(directory))
    models = Models(target, tokenizer, draft, str(directory))
    sets = {"p": [Request("p0", prompt=PROMPTS[0])]}
    grid = BenchGrid(sweeps=[Sweep(batch_sizes=[1], methods=["draft_model"], num_candidates=[1],
                                   length_policy=["static"])])
    with pytest.raises(ValueError, match="--no-assisted"):
        run_bench(_config(str(directory)), sets, grid, models)
    grid = grid.model_copy(update={"assisted": False})
    rows = {r.name: r for r in run_bench(_config(str(directory)), sets, grid, models).rows}
    assert rows["engine draft_model w1 d3 init=draft static"].identical


def test_layer_skipping_and_recycling_contenders_are_named_and_never_assisted(tiny_dirs):
    grid = BenchGrid(sweeps=[
        Sweep(batch_sizes=[1], methods=["draft_model"], num_candidates=[1], num_speculative_tokens=[3],
              drafts=[{"model": "target", "quantization": "int4", "layer_skip": "auto"},
                      {"model": "target", "layer_skip": [1]}]),
        Sweep(batch_sizes=[1], methods=["recycle"], num_candidates=[2], num_speculative_tokens=[3],
              tree_nodes=[None, 12]),
    ])
    runs = contenders(_config(tiny_dirs["draft"]), grid)
    names = {c.name for c in runs}
    assert {"engine draft_model self-int4-skipauto w1 d3 init=draft online",
            "engine draft_model self-skip1 w1 d3 init=draft online",
            "engine recycle w2 d3 init=draft online", "engine recycle tree12 w2 d3 init=draft online"} <= names
    assert not any(c.kind == "assisted" and c.method == "recycle" for c in runs)  # transformers has no recycling


def test_grid_expands_to_every_configured_run(tiny_dirs):
    runs = contenders(_config(tiny_dirs["draft"]), GRID)
    assert {(c.batch_size, c.name) for c in runs} == EXPECTED
    assert len(runs) == len(EXPECTED)


def test_bench_rows_metrics_and_lossless_outputs(models, tiny_dirs):
    # A raw prompt and a chat prompt; two prompt sets are covered by the CLI test.
    chat = Request("c0", messages=[{"role": "user", "content": "say hi"}])
    sets = {"mixed": [Request("p0", prompt=PROMPTS[0]), chat]}
    seen = []
    result = run_bench(_config(tiny_dirs["draft"]), sets, GRID, models, progress=seen.append)
    assert result.prompt_sets == {"mixed": 2}
    assert len(seen) == len(result.rows) == len(EXPECTED)
    assert {(r.batch_size, r.name) for r in result.rows} == EXPECTED
    none = {(r.prompt_set, r.batch_size): r for r in result.rows if r.name == "engine none"}
    for row in result.rows:
        baseline = none[row.prompt_set, row.batch_size]
        assert row.prompts == len(sets[row.prompt_set])
        assert row.generated_tokens > 0 and row.tokens_per_s > 0 and row.seconds > 0
        assert row.speedup_vs_none == pytest.approx(row.tokens_per_s / baseline.tokens_per_s)
        assert row.speedup_vs_transformers is not None
        assert row.slower_than_none == (row.name.startswith("engine ") and row.name != "engine none"
                                        and row.tokens_per_s < baseline.tokens_per_s)
        assert row.draft_s >= 0 and row.target_s > 0 and row.other_s >= 0
        assert row.identical is not None
        if row.name != "transformers generate" or row.batch_size == 1:  # left padding may perturb transformers
            assert row.identical, f"{row.name} batch {row.batch_size} differs from greedy decoding"
        if row.name.startswith("engine"):
            # The hooks count the same target forwards as the engine's own per-sequence statistics.
            assert row.target_forwards_per_token * row.tokens_per_forward == pytest.approx(1.0)
        if row.name.startswith("engine") and row.method != "none":
            assert row.mean_acceptance_length >= 1.0 and row.draft_s > 0
            # No rate when nothing was drafted (a lookup without matches); a static draft model always drafts.
            assert row.acceptance_rate is None or 0.0 <= row.acceptance_rate <= 1.0
            if row.method == "draft_model" and row.length_policy == "static":
                assert row.acceptance_rate is not None
        elif row.name.startswith("engine"):
            assert row.mean_acceptance_length == 1.0 and row.acceptance_rate is None
    for row in result.rows:
        if row.name == "transformers generate" and row.batch_size == 1:
            assert row.speedup_vs_transformers == 1.0 and row.target_forwards_per_token == 1.0
        if row.name == "transformers assisted (draft)":
            # Forwards counted by the hooks; vLLM's acceptance length needs per-step counts it does not expose.
            assert row.draft_s > 0 and row.tokens_per_forward >= 1.0 and row.mean_acceptance_length is None
    table = format_table(result.rows)
    assert len(table.splitlines()) == len(result.rows) + 1
    flagged = sum(r.slower_than_none for r in result.rows)
    assert table.count("<< slower than engine none") == flagged
    assert result.environment["device"].startswith("CPU")


def test_sampling_bench_has_no_identity_check(models, tiny_dirs):
    grid = BenchGrid(sweeps=[Sweep(batch_sizes=[1], methods=["draft_model"])], assisted=False)
    result = run_bench(_config(tiny_dirs["draft"], temperature=0.8), {"s": [Request("a", prompt=PROMPTS[0])]},
                       grid, models)
    assert [r.name for r in result.rows] == [
        "transformers generate", "engine none", "engine draft_model w2 d3 init=draft online"
    ]
    assert all(r.identical is None and r.mismatches is None for r in result.rows)


def test_bench_cli_writes_table_csv_json_and_png(tmp_path, tiny_dirs, capsys):
    code = tmp_path / "code.jsonl"
    code.write_text("\n".join(json.dumps({"id": f"c{i}", "prompt": p}) for i, p in enumerate(PROMPTS)))
    news = tmp_path / "news.jsonl"
    news.write_text("\n".join(json.dumps({"id": f"n{i}", "document": p}) for i, p in enumerate(PROMPTS)))
    grid = tmp_path / "grid.yaml"
    grid.write_text("sweeps:\n- {batch_sizes: [1], num_candidates: [1, 2]}\n- {batch_sizes: [2]}\nassisted: false\n")
    out = tmp_path / "bench"
    argv = [
        "--input", str(code), "--input", str(news), "--max-prompts", "2", "--output", str(out), "--grid", str(grid),
        "--methods", "ngram", "--length-policies", "static", "--no-transformers",
        "--model", tiny_dirs["target"], "--sampling.max_tokens", "5", "--batch_size", "2",
        "--speculative.num_candidates", "2",
    ]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    names = ["engine none", "engine ngram w1 d5 init=draft static", "engine ngram w2 d5 init=draft static"]
    batched = [n for n in names if "w1" not in n]  # the batch-2 sweep keeps the config's width, 2
    expected = sorted([(s, 1, n) for s in ("code", "news") for n in names]
                      + [(s, 2, n) for s in ("code", "news") for n in batched])

    result = json.loads((out / "bench.json").read_text())
    assert sorted((r["prompt_set"], r["batch_size"], r["name"]) for r in result["rows"]) == expected
    assert result["prompt_sets"] == {"code": 2, "news": 2}
    assert result["config"]["model"] == tiny_dirs["target"]
    with (out / "bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["prompt_set"], int(r["batch_size"]), r["name"]) for r in rows) == expected
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)
    # Without transformers generate, outputs are checked against engine none at batch 1.
    assert all(r["identical"] == "True" for r in rows)
    image = imread(out / "bench.png")
    assert (out / "bench.png").stat().st_size > 0 and image.ndim == 3 and min(image.shape[:2]) > 100
    for name in names:
        assert name in printed


def test_bench_cli_rejects_bad_grid(tmp_path, capsys):
    grid = tmp_path / "grid.yaml"
    grid.write_text("sweeps:\n  - widths: [2]\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc"}))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--input", str(prompts), "--grid", str(grid)])
    assert exit_info.value.code == 2
    assert "widths" in capsys.readouterr().err


def test_prompt_sets_from_jsonl_csv_parquet(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"id": f"d{i}", "document": f"doc {i}"}) for i in range(4)))
    first, last = bench.read_prompt_set(str(jsonl), 2), bench.read_prompt_set(str(jsonl), 2, from_end=True)
    assert [r.id for r in first] == ["d0", "d1"] and [r.id for r in last] == ["d2", "d3"]
    assert last[1].messages == [{"role": "user", "content": bench.SUMMARIZE.format(document="doc 3")}]
    table = tmp_path / "chat.csv"
    table.write_text('messages\n"[{""role"": ""user"", ""content"": ""hi""}]"\n')
    (chat,) = bench.read_prompt_set(str(table), None)
    assert chat.id == "chat-0" and chat.messages == [{"role": "user", "content": "hi"}]
    pq.write_table(pa.table({"prompt": ["abc", "def"]}), tmp_path / "p.parquet")
    assert [(r.id, r.prompt) for r in bench.read_prompt_set(str(tmp_path / "p.parquet"), None)] == [
        ("p-0", "abc"), ("p-1", "def")
    ]


def test_contenders_take_turns_chunk_by_chunk(monkeypatch, tiny_dirs):
    calls = []

    def recording_runner(_models, contender):
        def turns(prompts, into, max_tokens=None):
            for step in range(2):  # two turns per chunk
                calls.append((contender.name, list(prompts), step))
                yield True
            into.outputs.update(prompts)

        return benchmark._Runner(turns)

    monkeypatch.setattr(benchmark, "_runner", recording_runner)
    group = [c for c in contenders(_config(tiny_dirs["draft"]), GRID) if c.batch_size == 2]
    names = [c.name for c in group]
    prompts = {f"p{i}": [i] for i in range(5)}

    def rotated(order: list[str], by: int) -> list[str]:
        return order[by % len(order):] + order[: by % len(order)]

    # Every contender decodes chunk k before anyone starts chunk k + 1, starting with a different contender each
    # time; by steps, each takes one step in turn, and who goes first rotates every step as well.
    rotations = [rotated(names, k) for k in range(3)]
    chunks = []
    for turns, order in (("chunk", [n for r in rotations for n in r for _ in range(2)]),
                         ("step", [n for r in rotations for step in range(2) for n in rotated(r, step)])):
        calls.clear()
        chunks.clear()
        totals = benchmark._interleaved(None, group, prompts, lambda done, count: chunks.append((done, count)),
                                        turns)
        assert chunks == [(1, 3), (2, 3), (3, 3)]
        assert [p for _, p, _ in calls] == [["p0", "p1"]] * 6 + [["p2", "p3"]] * 6 + [["p4"]] * 6
        assert [name for name, _, _ in calls] == order, turns
        assert all(total.outputs == prompts for total in totals)


def test_draft_choices_make_self_draft_and_lookup_sibling_contenders(models, tiny_dirs):
    grid = BenchGrid(transformers=False, sweeps=[Sweep(
        batch_sizes=[1], methods=["draft_model"], num_candidates=[1], length_policy=["static"],
        num_speculative_tokens=[3], drafts=[{"model": "target", "quantization": "int4"},
                                            {"ngram_candidates": 1}],
    )])
    runs = contenders(_config(tiny_dirs["draft"]), grid)
    names = {c.name for c in runs}
    assert "engine draft_model self-int4 w1 d3 init=draft static" in names
    assert "engine draft_model +lookup1 w1 d3 init=draft static" in names
    assert not any(c.kind == "assisted" and c.method == "draft_model" and c.config.speculative.model == "target"
                   for c in runs)  # transformers cannot assist with a self-draft
    prompts = {"tiny": [Request("p0", prompt="abc abc abc"), Request("p1", prompt="hello world")]}
    result = run_bench(_config(tiny_dirs["draft"]), prompts, grid, models)
    rows = {row.name: row for row in result.rows}
    assert rows["engine draft_model self-int4 w1 d3 init=draft static"].identical
    assert rows["engine draft_model self-int4 w1 d3 init=draft static"].tokens_per_forward > 1


def test_prefix_caching_on_and_off_run_side_by_side_from_a_cold_cache(models, tiny_dirs):
    """A sweep over enable_prefix_caching gives engine none and each engine contender in both modes; the warm-up's
    cached blocks are forgotten before the timed prompts, so the first chunk prefills its shared prefix in full."""
    shared = "the quick brown fox jumps over the lazy dog and the cat sat on the mat "  # 4 full blocks
    grid = BenchGrid(transformers=False, assisted=False, sweeps=[
        Sweep(batch_sizes=[2], methods=["ngram"], num_candidates=[1], length_policy=["static"],
              prefix_caching=[True, False])])
    names = {c.name for c in contenders(_config(tiny_dirs["draft"]), grid)}
    assert names == {"engine none", "engine none no-prefix-cache", "engine ngram w1 d3 init=draft static",
                     "engine ngram w1 d3 init=draft static no-prefix-cache"}
    sets = {"shared": [Request(f"q{i}", prompt=shared + question) for i, question in enumerate(["a", "b c", "d"])]}
    rows = {r.name: r for r in run_bench(_config(tiny_dirs["draft"]), sets, grid, models).rows}
    assert all(row.identical for row in rows.values())
    # The first chunk (2 rows): one prefills the 4 blocks, the other finds them; the second chunk finds them too.
    prompt_tokens = sum(len(shared + q) for q in ["a", "b c", "d"])
    for name in ("engine none", "engine ngram w1 d3 init=draft static"):
        assert rows[name].prefix_cache_hit_rate == pytest.approx(2 * 64 / prompt_tokens)
        assert rows[name + " no-prefix-cache"].prefix_cache_hit_rate == 0.0
    assert "prefix hit %" in format_table(list(rows.values()))


def test_llama_cpp_decodes_the_gguf_at_batch_1_beside_the_engine(target, tokenizer, tiny_dirs, monkeypatch,
                                                                   tmp_path) -> None:
    """Where llama-cpp-python is installed and the model is a GGUF, batch 1 adds llama.cpp decoding that file: the
    engine's prompt token ids, greedy, as many threads as torch, stopped at max_tokens or after an end token; its
    row is compared with the engine's outputs like any other. (llama.cpp itself stands in here: the package is
    not a dependency.)"""
    import sys
    import types

    import torch

    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    eos = target.generation_config.eos_token_id
    seen: dict = {"prompts": []}

    class FakeLlama:
        def __init__(self, model_path: str, **kwargs) -> None:
            seen.update(model_path=model_path, **kwargs)

        def generate(self, tokens: list[int], reset: bool, **sampling):
            seen["prompts"].append(list(tokens))
            seen["sampling"] = sampling
            yield from [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16] if len(seen["prompts"]) % 2 else [5, eos, 6, 7]

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    monkeypatch.setattr(benchmark.importlib.util, "find_spec", lambda name: object() if name == "llama_cpp" else None)
    monkeypatch.setattr(benchmark, "model_gguf", lambda model: gguf if model == "tiny" else None)
    config = Config(model="tiny", batch_size=1, speculative={"method": "none"}, sampling={"max_tokens": 8})
    grid = BenchGrid(sweeps=[Sweep(batch_sizes=[1, 2])], transformers=False, assisted=False)
    names = [(c.batch_size, c.name) for c in contenders(config, grid)]
    assert names == [(1, "llama.cpp generate"), (1, "engine none"), (2, "engine none")]
    assert (1, "llama.cpp generate") not in [(c.batch_size, c.name) for c in contenders(
        config, grid.model_copy(update={"llama_cpp": False}))]
    sets = {"p": [Request(f"p{i}", prompt=p) for i, p in enumerate(PROMPTS[:2])]}
    result = run_bench(config, sets, grid.model_copy(update={"sweeps": [Sweep(batch_sizes=[1])]}),
                       Models(target, tokenizer))
    rows = {r.name: r for r in result.rows}
    assert seen["model_path"] == str(gguf) and seen["n_threads"] == torch.get_num_threads()
    assert seen["sampling"] == {"repeat_penalty": 1.0, "temp": 0.0, "top_k": 1}
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS[:2]]
    assert all(ids in prompt_ids for ids in seen["prompts"][-2:])  # the timed prompts, after the warm-up
    # 8 tokens (max_tokens) from one prompt, 2 (up to and including the end token) from the other
    assert rows["llama.cpp generate"].generated_tokens == 10 and rows["llama.cpp generate"].mismatches == 2
    assert rows["llama.cpp generate"].speedup_vs_none is not None
