"""train-draft, train-head, train-decision end to end on tiny models: artifacts the engine loads and uses."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from tiny import tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from decoding import Config, Engine, Request
from decoding.drafting.feature_draft import FeatureDraft, load_draft
from decoding.drafting.signal_head import DraftSignalMLP
from decoding.model.loading import DEFAULT_DRAFT, DRAFT_METADATA, resolve_draft
from jobs import eval_draft, train_decision, train_head
from jobs import train_draft as train_draft_job
from training.data import PromptSource
from training.distill import (
    DraftTrainingConfig,
    _FeatureStudent,
    acceptance_length,
    build_draft,
    train_draft,
)
from training.runs import METRICS_FILE, RunDir, RunError
from training.signals import SignalTrainingConfig, fit
from training.teacher import teacher_continuations

WORDS = "abc abd the cat sat on the mat. a bad cab, a dab. so it goes, so it goes. banana bandana. one two one"
PROMPTS = [WORDS[i : i + 5 + (i * 7) % 23] for i in range(0, 80, 3)]
TINY_DRAFT = ["--layers", "[0]", "--vocab_size", "20", "--max_new_tokens", "16", "--generation_batch_size", "8",
              "--epochs", "10", "--batch_tokens", "256", "--validation_prompts", "3", "--warmup_steps", "2",
              "--learning_rate", "3e-3", "--prompt_weight", "0.5"]
TINY_SIGNALS = ["--depth", "4", "--max_tokens", "16", "--batch_size", "8", "--epochs", "3", "--width", "32",
                "--prompts_per_shard", "10"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return str(path)


@pytest.fixture(scope="module")
def trained_draft(tmp_path_factory, tiny_dirs, prompts_file, ray_cluster) -> Path:
    output = tmp_path_factory.mktemp("draft") / "draft"
    argv = ["--target", tiny_dirs["target"], "--data", prompts_file, "--output", str(output), "--num-cpus", "1"]
    assert train_draft_job.main(argv + TINY_DRAFT) == 0
    return output


@pytest.fixture(scope="module")
def feature_draft(tmp_path_factory, tiny_dirs, prompts_file, ray_cluster) -> Path:
    output = tmp_path_factory.mktemp("feature") / "feature"
    argv = ["--target", tiny_dirs["target"], "--data", prompts_file, "--output", str(output), "--num-cpus", "1",
            "--architecture", "feature", "--layers", "[1]", "--unroll", "2"]
    assert train_draft_job.main(argv + TINY_DRAFT[2:]) == 0
    return output


def run_engine(target_dir: str, tokenizer, target, **speculative) -> list:
    config = Config.model_validate({"model": target_dir, "batch_size": 4, "sampling": {"max_tokens": 20},
                                    "speculative": {"num_candidates": 1, **speculative}})
    engine = Engine(config, target=target, tokenizer=tokenizer)
    return engine.generate([Request(id=str(i), prompt=p) for i, p in enumerate(PROMPTS[:6])])


def assert_drafts_losslessly(results: list, tokenizer, target, target_dir: str) -> None:
    plain = run_engine(target_dir, tokenizer, target, method="none")
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    assert sum(sum(r.per_step_drafted) for r in results) > 0


# ----------------------------------------------------------------------------------------------------- train-draft
def test_train_draft_makes_a_draft_the_engine_uses(trained_draft, tiny_dirs, tokenizer, target):
    meta = json.loads((trained_draft / DRAFT_METADATA).read_text())
    assert len(meta["vocab_subset"]) == 20 and meta["target"] == tiny_dirs["target"]
    assert meta["training"]["layers"] == [0] and meta["metrics"]["steps"] == meta["metrics"]["planned_steps"]
    validation = meta["metrics"]["validation"]
    assert validation["agreement"] > meta["metrics"]["validation_before"]["agreement"]  # it learned something
    assert (trained_draft / METRICS_FILE).read_text().count('"step"') == meta["metrics"]["steps"]
    assert not (trained_draft / ".specbatch-work").exists()
    results = run_engine(tiny_dirs["target"], tokenizer, target, method="draft_model", model=str(trained_draft),
                         num_speculative_tokens=3, length_policy="static")
    assert_drafts_losslessly(results, tokenizer, target, tiny_dirs["target"])
    proposed = {s[3] for r in results for s in r.token_stats}
    assert proposed <= set(meta["vocab_subset"])  # the reduced head was applied


def test_train_draft_makes_a_feature_draft_the_engine_uses(feature_draft, tiny_dirs, tokenizer, target):
    meta = json.loads((feature_draft / DRAFT_METADATA).read_text())
    assert meta["architecture"] == "feature" and len(meta["vocab_subset"]) == 20
    validation, before = meta["metrics"]["validation"], meta["metrics"]["validation_before"]
    assert validation["agreement"] > before["agreement"]  # it learned something
    draft = load_draft(str(feature_draft))
    assert isinstance(draft, FeatureDraft) and draft.config.num_hidden_layers == 1
    for width in (1, 2):
        results = run_engine(tiny_dirs["target"], tokenizer, target, method="draft_model", model=str(feature_draft),
                             num_speculative_tokens=3, length_policy="static", num_candidates=width)
        assert_drafts_losslessly(results, tokenizer, target, tiny_dirs["target"])
        assert {s[3] for r in results for s in r.token_stats} <= set(meta["vocab_subset"])
        assert sum(sum(r.per_step_accepted) for r in results) > 0


def test_feature_draft_proposes_at_run_time_what_training_simulates(feature_draft, tiny_dirs, tokenizer, target):
    """The engine's draft cache (target states for what it kept, re-fed prefixes, its own states below the root)
    must give the tokens that training's level-by-level simulation predicts for the same context: else training
    optimises, and validation reports, something the engine never runs."""
    draft = load_draft(str(feature_draft))
    subset = torch.tensor(json.loads((feature_draft / DRAFT_METADATA).read_text())["vocab_subset"])
    student = _FeatureStudent(draft, subset.tolist()).eval()
    depth = 3
    results = run_engine(tiny_dirs["target"], tokenizer, target, method="draft_model", model=str(feature_draft),
                         num_speculative_tokens=depth, length_policy="static")
    checked = 0
    for result in results:
        sequence = torch.tensor([result.prompt_token_ids + result.token_ids])
        with torch.no_grad():
            states = target(sequence, output_hidden_states=True).hidden_states[-1]
            levels = student.levels({"ids": sequence, "mask": torch.ones_like(sequence), "states": states}, depth)
        predicted = []  # predicted[k][p]: level k's token after position p + k of the sequence
        for level in levels:
            row = torch.full((sequence.shape[1],), -1)
            row[level.at] = subset[level.logits.argmax(-1)]
            predicted.append(row)
        root = len(result.prompt_token_ids)  # the first generated token came from the prefill
        stats = result.token_stats  # step by step, level by level
        for drafted, accepted in zip(result.per_step_drafted, result.per_step_accepted, strict=True):
            chain, stats = stats[:drafted], stats[drafted:]
            for stat in chain[: accepted + 1]:  # levels whose parent was accepted: conditioned on true tokens
                level = stat[1] - 1
                assert stat[3] == int(predicted[level][root + level]), (result.id, stat[0], level)
                checked += 1
            root += accepted + 1
    assert checked > 20


def test_eval_draft_compares_drafts_side_by_side(trained_draft, feature_draft, tiny_dirs, prompts_file, tmp_path,
                                                capsys):
    config = tmp_path / "draft.yaml"
    config.write_text(yaml.safe_dump({"target": tiny_dirs["target"], "output": str(trained_draft),
                                      "data": [{"path": prompts_file, "limit": len(PROMPTS) - 3}]}))
    output = tmp_path / "eval.json"
    argv = ["--config", str(config), "--draft", str(trained_draft), "--draft", str(feature_draft), "--depths", "1,2",
            "--thresholds", "0.5", "--max-tokens", "12", "--threads", "1", "--output", str(output)]
    assert eval_draft.main(argv) == 0
    report = json.loads(output.read_text())
    rows = {row["method"]: row for row in report["rows"]}
    for label in ("draft", "feature"):  # the directories' names
        for depth in (1, 2):
            assert rows[f"{label}: static depth {depth}"]["identical_to_generate"] == "3/3"
        assert report["costs"][label]["draft_cost_ratio"] > 0
    assert rows["engine none"]["mean_acceptance_length"] == 1.0
    assert "| feature: static depth 2 |" in capsys.readouterr().out


def test_teacher_hidden_states_reproduce_the_targets_predictions(tmp_path, tokenizer, target):
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:5]]
    run = RunDir(tmp_path, DraftTrainingConfig(data=[PromptSource(path="unused")], output=str(tmp_path)), "done")
    examples, _ = teacher_continuations(target, prompts, run, max_new_tokens=10, batch_size=3, pad_id=0)
    for prompt, example in zip(prompts, examples, strict=True):
        assert example.prompt == prompt and example.hidden.shape[0] == len(prompt) + len(example.continuation) - 1
        logits = target.lm_head(example.hidden.float())
        # The state at each position gives the target's next-token law there: greedy tokens at the continuation,
        # and teacher-forced logits equal to a plain forward over the prompt.
        assert logits[len(prompt) - 1 :].argmax(-1).tolist() == example.continuation
        with torch.no_grad():
            reference = target(torch.tensor([prompt])).logits[0, :-1]
        torch.testing.assert_close(logits[: len(prompt) - 1], reference, atol=0.1, rtol=0.05)


def test_build_draft_with_every_layer_reproduces_the_target(target):
    draft = build_draft(target, [0, 1])
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    torch.testing.assert_close(draft(ids).logits, target(ids).logits)
    assert not draft.config.tie_word_embeddings


def test_acceptance_length_simulates_greedy_chains():
    assert acceptance_length([[True] * 10], 5) == 10 / 2  # 6 tokens, then 4 (the last token has no successor)
    assert acceptance_length([[False] * 4], 5) == 1.0
    assert acceptance_length([[True, False, True, True, False, False]], 5) == 6 / 3
    # Per level: level 0 right everywhere, level 1 wrong everywhere: every chain accepts exactly one token.
    assert acceptance_length([[True] * 6, [False] * 6], 5) == 6 / 3


def test_interrupted_draft_training_resumes(tmp_path, tiny_dirs, prompts_file, monkeypatch, caplog):
    config = DraftTrainingConfig(target=tiny_dirs["target"], data=[PromptSource(path=prompts_file)],
                                 output=str(tmp_path / "draft"), layers=[1], vocab_size=20, max_new_tokens=12,
                                 generation_batch_size=8, epochs=4, batch_tokens=256, validation_prompts=3)
    real_step, calls = torch.optim.AdamW.step, []

    def interrupt_at_step_4(optimizer, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_step(optimizer, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", interrupt_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        train_draft(config)
    checkpoint = torch.load(tmp_path / "draft/.specbatch-work/checkpoint.pt", weights_only=False)
    assert checkpoint["step"] == 3
    assert not (tmp_path / "draft" / DRAFT_METADATA).exists()

    with pytest.raises(RunError, match="different config"):
        train_draft(config.model_copy(update={"vocab_size": 24}))

    # Resuming regenerates no teacher data and continues from step 3.
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    monkeypatch.setattr("training.teacher._generate_batch", lambda *a: pytest.fail("regenerated"))
    with caplog.at_level(logging.INFO, logger="training"):
        train_draft(config)
    assert "resumed training at step 3" in caplog.text
    meta = json.loads((tmp_path / "draft" / DRAFT_METADATA).read_text())
    assert meta["metrics"]["steps"] == meta["metrics"]["planned_steps"]
    records = [json.loads(line) for line in (tmp_path / "draft" / METRICS_FILE).read_text().splitlines()]
    steps = [record["step"] for record in records if "loss" in record]
    assert steps == list(range(1, meta["metrics"]["steps"] + 1))  # nothing repeated, nothing lost

    with pytest.raises(RunError, match="finished artifact"):
        train_draft(config)


# ------------------------------------------------------------------------------------ tokenizer mismatch refused
@pytest.fixture(scope="module")
def foreign_draft(tmp_path_factory) -> str:
    """A model with a vocabulary of the same size but different token ids."""
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<s>", "</s>", *"zyxwvutsrqponmlkjihgfedcba .,"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>")
    path = tmp_path_factory.mktemp("foreign") / "draft"
    tiny_model(seed=3).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("job", [train_draft_job, train_head, train_decision])
def test_tokenizer_mismatch_is_refused(job, tmp_path, tiny_dirs, prompts_file, foreign_draft, ray_cluster, capsys):
    model_option = ["--init", foreign_draft] if job is train_draft_job else ["--draft", foreign_draft]
    argv = ["--target", tiny_dirs["target"], "--data", prompts_file, "--output", str(tmp_path / "out"),
            "--num-cpus", "1", *model_option]
    assert job.main(argv) == 2
    assert "does not share the target's tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "out" / ".specbatch-work" / "teacher-00000.pt").exists()  # refused before any work


# --------------------------------------------------------------------------------------- train-head / decision
@pytest.mark.parametrize(("job", "kind", "policy", "field"), [
    (train_head, "acceptance_head", "threshold", "acceptance_head"),
    (train_decision, "decision_model", "decision", "decision_model"),
])
def test_signal_models_train_and_drive_the_engine(job, kind, policy, field, trained_draft, tiny_dirs, prompts_file,
                                                  tokenizer, target, ray_cluster):
    argv = ["--target", tiny_dirs["target"], "--draft", str(trained_draft), "--data", prompts_file,
            "--num-cpus", "1", *TINY_SIGNALS]
    assert job.main(argv) == 0
    output = trained_draft / kind  # the default: next to the draft
    meta = json.loads((output / "head.json").read_text())
    assert meta["kind"] == kind and meta["training"]["depth"] == 4
    assert meta["metrics"]["examples"] > 50 and 0 < meta["metrics"]["positive_rate"] < 1
    assert DraftSignalMLP.load(output).hidden_size == target.config.hidden_size
    results = run_engine(tiny_dirs["target"], tokenizer, target, method="draft_model", model=str(trained_draft),
                         num_speculative_tokens=4, length_policy=policy, **{field: str(output)})
    assert_drafts_losslessly(results, tokenizer, target, tiny_dirs["target"])


def test_signal_collection_resumes_from_saved_shards(trained_draft, tiny_dirs, prompts_file, tmp_path, monkeypatch):
    from training import signals

    config = signals.SignalTrainingConfig(
        kind="decision_model", target=tiny_dirs["target"], draft=str(trained_draft),
        data=[PromptSource(path=prompts_file)], output=str(tmp_path / "decision"), depth=3, max_tokens=12,
        batch_size=8, prompts_per_shard=10, epochs=2, width=16,
    )
    real, shards = signals._collect_shard, []

    def interrupt_after_two(engine, prompts):
        if len(shards) == 2:
            raise KeyboardInterrupt
        shards.append(1)
        return real(engine, prompts)

    monkeypatch.setattr(signals, "_collect_shard", interrupt_after_two)
    with pytest.raises(KeyboardInterrupt):
        signals.train_signal_model(config)
    assert sorted(p.name for p in (tmp_path / "decision/.specbatch-work").glob("signals-*.pt")) == [
        "signals-00000.pt", "signals-00001.pt"]
    shards.clear()
    monkeypatch.setattr(signals, "_collect_shard", lambda engine, prompts: shards.append(1) or real(engine, prompts))
    signals.train_signal_model(config)
    assert len(shards) == 1  # only the third shard was collected again
    assert (tmp_path / "decision" / "head.pt").exists()


# ---------------------------------------------------------------------------------------- the default draft alias
def test_default_draft_alias_falls_back_to_ngram_until_trained(tmp_path, monkeypatch, caplog, trained_draft,
                                                               tiny_dirs, tokenizer, target):
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path))
    config = Config.model_validate({"model": tiny_dirs["target"], "speculative": {
        "method": "draft_model", "model": DEFAULT_DRAFT, "num_speculative_tokens": 3}})
    with caplog.at_level(logging.WARNING, logger="decoding.model.loading"):
        spec = resolve_draft(config.speculative)
    assert spec.method == "ngram" and spec.model is None
    assert "no trained draft" in caplog.text and "specbatch train-draft" in caplog.text

    shutil.copytree(trained_draft, tmp_path / "models" / DEFAULT_DRAFT)  # what train-draft writes by default
    spec = resolve_draft(config.speculative)
    assert spec == config.speculative
    results = run_engine(tiny_dirs["target"], tokenizer, target,
                         **{**spec.model_dump(), "num_candidates": 1, "length_policy": "static"})
    assert_drafts_losslessly(results, tokenizer, target, tiny_dirs["target"])


def test_time_budget_caps_generation_and_training(tmp_path, tiny_dirs, prompts_file):
    config = DraftTrainingConfig(target=tiny_dirs["target"], data=[PromptSource(path=prompts_file)],
                                 output=str(tmp_path / "draft"), layers=[0], vocab_size=20, max_new_tokens=8,
                                 generation_batch_size=8, validation_prompts=3, time_budget_s=1e-9,
                                 generation_share=1.0)
    meta = json.loads((train_draft(config) / DRAFT_METADATA).read_text())
    # One batch of 8 prompts is generated before the budget is checked again (any batch outlasts a nanosecond,
    # however fast the machine); none is left for training.
    assert meta["metrics"]["train_examples"] + meta["metrics"]["validation_examples"] == 8
    assert meta["metrics"]["steps"] == 0


def test_signal_fit_keeps_the_epoch_with_the_best_held_out_loss():
    # Labels independent of the features: whatever the MLP learns beyond the base rate is memorisation, which
    # drives the held-out loss far above the base rate's entropy of 0.62 unless the fit stops early (2.2-2.4
    # without early stopping, 0.68 with it).
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1000, 64 + 3, generator=generator)
    y = (torch.rand(1000, generator=generator) < 0.7).float()
    config = SignalTrainingConfig(kind="acceptance_head", draft="d", data=[PromptSource(path="p")], output="o",
                                  epochs=40, minibatch=64)
    _, metrics = fit(config, features, y, torch.tensor(1.0), torch.tensor(1.0))
    held_out_rate = metrics["validation_mean_label"]
    entropy = -(held_out_rate * math.log(held_out_rate) + (1 - held_out_rate) * math.log(1 - held_out_rate))
    assert metrics["validation_bce"] < entropy + 0.15, metrics
    assert 1 <= metrics["best_epoch"] < config.epochs


def test_sigterm_stops_a_run_whose_launcher_ignored_sigint(tmp_path, tiny_dirs, prompts_file):
    """`ray job stop` (SIGTERM) stops a run cleanly even when it was launched with SIGINT ignored (nohup, a
    background job of a script): Ray cancels a running task with interrupt_main(), a no-op while the worker, which
    inherits that disposition, ignores SIGINT; the run then went on until it finished."""
    output = tmp_path / "draft"
    argv = [sys.executable, "-m", "jobs.train_draft", "--target", tiny_dirs["target"], "--data", prompts_file,
            "--output", str(output), "--num-cpus", "1", "--layers", "[0]", "--vocab_size", "20",
            "--max_new_tokens", "8", "--epochs", "100000", "--batch_tokens", "256", "--validation_prompts", "3",
            "--checkpoint_seconds", "1"]
    env = {**os.environ, "RAY_ADDRESS": "local"}  # a cluster of its own, never another test's

    def launch_like_nohup() -> None:
        os.setsid()
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    # A file, not a pipe: Ray forwards worker logs to stderr, and a full pipe would block the run.
    log = tmp_path / "stderr.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(argv, env=env, preexec_fn=launch_like_nohup, stdout=subprocess.DEVNULL,
                                   stderr=stderr, cwd=Path(__file__).resolve().parents[1])
    try:
        checkpoint = output / ".specbatch-work" / "checkpoint.pt"
        deadline = time.monotonic() + 600  # a bound against a hang only: beside a busy loop 180 s was too short
        while not checkpoint.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert checkpoint.exists(), "training never reached its first checkpoint"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 130
        assert "interrupted; re-run the same command to resume" in log.read_text()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
