"""train-head and train-decision: learned draft-length policies on the draft's own signals.

Data comes from running the engine (target + draft, static depth, chain width 1) over prompts with a recording
length policy: for every drafted token it keeps exactly the features the runtime policies compute
(``DraftSignalMLP.features``: the draft's last hidden state at the token's parent position, q(x) under the warped
draft law, the level), and the engine's token statistics supply the outcome.

- acceptance head (SpecDec++, ``length_policy: threshold``): for tokens whose prefix was accepted, the soft label
  min(1, p(x)/q(x)) (at temperature 0: accepted or not), weighted BCE; the policy multiplies its predictions
  along a candidate and stops once P(some token rejected) exceeds ``stop_threshold``.
- decision model (Lu et al., ``length_policy: decision``): for every drafted token, the label "this token ends up
  accepted" (so it already accounts for its prefix), with class weights that move the policy's fixed 0.5
  cut-off to ``keep_cutoff``: keep drafting while P(accepted) >= keep_cutoff, about the cost of drafting and
  verifying one more token relative to the time per output token.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from decoding.config import Config
from decoding.drafting.length_policies import LengthPolicy, RowMemory
from decoding.drafting.signal_head import DraftSignalMLP
from decoding.engine import Engine, Request
from decoding.engine.sequence import Sequence
from decoding.model.loading import DEFAULT_MODEL, load_tokenizer
from training.data import PromptSource, load_prompts
from training.runs import Progress, RunDir, require_same_tokenizer, set_threads

log = logging.getLogger("training")

HEAD_MARKER = "head.json"  # written last by DraftSignalMLP.save: marks a finished artifact


class SignalTrainingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["acceptance_head", "decision_model"]
    target: str = DEFAULT_MODEL
    draft: str
    data: list[PromptSource] = Field(min_length=1)
    output: str
    depth: int = Field(8, ge=1, description="draft depth while collecting (deepest level the policy learns)")
    temperature: float = Field(0.0, ge=0.0, description="sampling temperature of the collection runs")
    max_tokens: int = Field(128, ge=2)
    batch_size: int = Field(16, ge=1)
    prompts_per_shard: int = Field(32, ge=1, description="prompts collected between resumable saves")
    width: int = Field(256, ge=8, description="hidden width of the MLP")
    epochs: int = Field(30, ge=1)
    learning_rate: float = Field(1e-3, gt=0)
    minibatch: int = Field(512, ge=1)
    validation_fraction: float = Field(0.1, gt=0, lt=1)
    rejection_weight: float = Field(1.0, gt=0, description="acceptance head: BCE weight of the rejection side")
    keep_cutoff: float = Field(0.3, gt=0, lt=1, description="decision model: keep drafting while P(accepted) >= it")
    seed: int = 0
    num_threads: int | None = Field(None, ge=1)


class _Recorder(LengthPolicy):
    """Static depth, but remembers each drafted token's features keyed by (request, step, level, candidate)."""

    needs_hidden_states = True

    def __init__(self, max_depth: int, step: int, running: Callable[[], list[Sequence]]) -> None:
        super().__init__(max_depth)
        self.step = step  # advances with the engine's step counter: plan() runs once per speculation step
        self.running = running  # the engine's rows, whose request ids key the features
        self.ids: list[str] = []
        self.features: dict[tuple[str, int, int, int], torch.Tensor] = {}

    def plan(self, rows: list[RowMemory]) -> torch.Tensor:
        self.step += 1
        request_of = {id(seq.policy_memory): seq.request_id for seq in self.running()}
        self.ids = [request_of[id(row)] for row in rows]
        return super().plan(rows)

    def keep(self, level, depths, token_probs, hidden):
        features = DraftSignalMLP.features(hidden, token_probs, level)
        for row, seq_id in enumerate(self.ids):
            for candidate in range(features.shape[1]):
                self.features[(seq_id, self.step, level, candidate)] = features[row, candidate].clone()
        return super().keep(level, depths, token_probs, hidden)


def _collect_shard(engine: Engine, prompts: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
    recorder = _Recorder(engine.policy.max_depth, engine.steps, lambda: engine.running)
    engine.policy = recorder
    results = engine.generate([Request(id=i, prompt_token_ids=ids) for i, ids in prompts])
    features, soft, accepted, parent_accepted = [], [], [], []
    for result in results:
        last_step = max((s[0] for s in result.token_stats), default=0)  # a stop string/EOS may cut its run
        chains: dict[int, list[tuple]] = {}
        for stat in result.token_stats:
            if stat[0] != last_step:
                chains.setdefault(stat[0], []).append(stat)
        for step, chain in chains.items():
            prefix_ok = True
            for _, depth, candidate, _, draft_prob, target_prob, ok in sorted(chain, key=lambda s: s[1]):
                features.append(recorder.features[(result.id, step, depth, candidate)])
                greedy = engine.config.sampling.temperature == 0
                soft.append(float(ok) if greedy else min(1.0, target_prob / max(draft_prob, 1e-9)))
                accepted.append(ok)
                parent_accepted.append(prefix_ok)
                prefix_ok = ok
    if not features:
        raise RuntimeError("the collection run drafted no tokens; are max_tokens and depth large enough?")
    return {"features": torch.stack(features), "soft": torch.tensor(soft), "accepted": torch.tensor(accepted),
            "parent_accepted": torch.tensor(parent_accepted)}


def collect(config: SignalTrainingConfig, run: RunDir) -> dict[str, torch.Tensor]:
    """Run the engine over the prompts in resumable shards; returns every drafted token's features and outcome."""
    tokenizer = load_tokenizer(config.target)
    require_same_tokenizer(tokenizer, load_tokenizer(config.draft), config.draft)
    engine_config = Config.model_validate({
        "model": config.target, "batch_size": config.batch_size,
        "speculative": {"method": "draft_model", "model": config.draft, "num_speculative_tokens": config.depth,
                        "num_candidates": 1, "length_policy": "static"},
        "sampling": {"temperature": config.temperature, "max_tokens": config.max_tokens, "seed": config.seed},
    })
    engine = Engine(engine_config, tokenizer=tokenizer, device=torch.device("cpu"))
    prompts = [(str(i), ids) for i, ids in enumerate(load_prompts(config.data, tokenizer))]
    shards = [prompts[i : i + config.prompts_per_shard] for i in range(0, len(prompts), config.prompts_per_shard)]
    progress = Progress("collect draft signals", len(prompts))
    parts = []
    for number, shard in enumerate(shards):
        name = f"signals-{number:05d}.pt"
        part = run.load_state(name)
        if part is None:
            part = _collect_shard(engine, shard)
            run.save_state(name, part)
        parts.append(part)
        progress.update(sum(len(s) for s in shards[: number + 1]), tokens=sum(len(p["soft"]) for p in parts))
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def labels(config: SignalTrainingConfig, data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(features, targets, weight of the positive side, weight of the negative side) for this kind."""
    if config.kind == "acceptance_head":
        rows = data["parent_accepted"]  # P(accept | prefix accepted): only tokens whose prefix survived
        return data["features"][rows], data["soft"][rows], torch.tensor(1.0), torch.tensor(config.rejection_weight)
    # Optimum of the weighted BCE is w1 P / (w1 P + w0 (1 - P)), which crosses 0.5 exactly at P = keep_cutoff.
    return (data["features"], data["accepted"].float(), torch.tensor(1 - config.keep_cutoff),
            torch.tensor(config.keep_cutoff))


def _bce(logits: torch.Tensor, y: torch.Tensor, w_pos: torch.Tensor, w_neg: torch.Tensor) -> torch.Tensor:
    return -(w_pos * y * F.logsigmoid(logits) + w_neg * (1 - y) * F.logsigmoid(-logits)).mean()


def fit(config: SignalTrainingConfig, features: torch.Tensor, y: torch.Tensor, w_pos: torch.Tensor,
        w_neg: torch.Tensor) -> tuple[DraftSignalMLP, dict[str, float]]:
    generator = torch.Generator().manual_seed(config.seed)
    order = torch.randperm(len(y), generator=generator)
    held = max(1, int(len(y) * config.validation_fraction))
    valid, train = order[:held], order[held:]
    model = DraftSignalMLP(features.shape[-1] - 3, config.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=1e-4)
    batches_per_epoch = math.ceil(len(train) / config.minibatch)
    total = config.epochs * batches_per_epoch
    progress = Progress(f"fit {config.kind}", total)
    step = 0
    # Early stopping: ten thousand correlated tokens from a hundred prompts are memorised within a few epochs
    # (training loss 0.03, held-out BCE 1.35 on the SmolLM2 draft): keep the epoch with the best held-out loss.
    best_loss, best_epoch, best_state = math.inf, 0, None
    for epoch in range(1, config.epochs + 1):
        shuffled = train[torch.randperm(len(train), generator=generator)]
        for start in range(0, len(shuffled), config.minibatch):
            batch = shuffled[start : start + config.minibatch]
            for group in optimizer.param_groups:  # cosine decay: a stable end point without tuning epochs
                group["lr"] = config.learning_rate * 0.5 * (1 + math.cos(math.pi * step / total))
            loss = _bce(model(features[batch]), y[batch], w_pos, w_neg)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            progress.update(step, loss=loss.item())
        with torch.no_grad():
            held_out_loss = float(_bce(model(features[valid]), y[valid], w_pos, w_neg))
        if held_out_loss < best_loss:
            best_loss, best_epoch = held_out_loss, epoch
            best_state = {name: value.clone() for name, value in model.state_dict().items()}
    model.load_state_dict(best_state)
    model.eval()
    with torch.no_grad():
        predicted = torch.sigmoid(model(features[valid]))
        decided = predicted >= 0.5
    metrics = {
        "examples": len(y), "validation_examples": held, "positive_rate": float(y.mean()), "best_epoch": best_epoch,
        "validation_bce": float(_bce(torch.logit(predicted.clamp(1e-6, 1 - 1e-6)), y[valid], w_pos, w_neg)),
        "validation_mean_prediction": float(predicted.mean()), "validation_mean_label": float(y[valid].mean()),
        "validation_decision_accuracy": float((decided == (y[valid] >= 0.5)).float().mean()),
        "validation_keep_rate": float(decided.float().mean()),
    }
    return model, metrics


def train_signal_model(config: SignalTrainingConfig, overwrite: bool = False) -> Path:
    """Collect (or resume collecting), fit and save a ``DraftSignalMLP``; returns its directory."""
    started = time.perf_counter()
    set_threads(config.num_threads)
    torch.manual_seed(config.seed)
    run = RunDir(config.output, config, HEAD_MARKER, overwrite)
    data = collect(config, run)
    collect_seconds = time.perf_counter() - started
    model, metrics = fit(config, *labels(config, data))
    metrics.update(collect_seconds=round(collect_seconds, 1), total_seconds=round(time.perf_counter() - started, 1))
    run.log_metrics(final=True, **metrics)
    log.info("%s: %s", config.kind, metrics)
    model.save(run.path, {"kind": config.kind, "target": config.target, "draft": config.draft,
                          "training": config.model_dump(mode="json"), "metrics": metrics})
    run.finish()
    return run.path
