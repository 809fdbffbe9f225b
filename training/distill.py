"""train-draft: distil a small draft for any target from the target's own greedy continuations.

The draft (DistillSpec / FastDraft style) is a normal causal LM directory sharing the target's tokenizer:
a few of the target's decoder layers (or an ``init`` model), the target's embeddings (frozen) and final norm,
and an LM head restricted to the ``vocab_size`` tokens the target emits most (``specbatch_draft.json``): the
full head of a small-vocabulary-heavy model costs as much as several decoder layers.

Training is on prompt + continuation windows. The teacher stores the target's final hidden state at every
position, so each position gets the target's *exact* distribution over the subset (its LM head rows applied to
that state): a soft cross-entropy on continuation positions (``soft_weight``) and on prompt positions
(``prompt_weight``: dense extra signal from the prefill the teacher computed anyway), plus cross-entropy to the
target's greedy token on continuation positions (``hard_weight``). Validation reports the draft's top-1
agreement with the target on held-out continuations, which at temperature 0 *is* the per-token acceptance
rate, and the mean acceptance length it implies at ``eval_depth``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from decoding.drafting.feature_draft import FeatureDraft, layers_config
from decoding.model.loading import DEFAULT_MODEL, DRAFT_METADATA, load_model, load_tokenizer, resolve_model_path
from training.data import PromptSource, load_prompts
from training.runs import Progress, RunDir, require_same_tokenizer, set_threads
from training.teacher import TeacherExample, eos_ids, teacher_continuations

log = logging.getLogger("training")

_FINISH_RESERVE_S = 60.0  # final validation and saving, kept out of a time-budgeted run's training time


class DraftTrainingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str = DEFAULT_MODEL
    data: list[PromptSource] = Field(min_length=1)
    output: str
    architecture: Literal["layers", "feature"] = Field(
        "layers", description="layers: a causal LM of target layers; feature: EAGLE-style, reads the target's "
        "final hidden state (decoding/drafting/feature_draft.py)")
    init: str | None = Field(None, description="start from this model (same tokenizer) instead of target layers")
    layers: list[int] = Field([0, 1], min_length=1, description="target decoder layers copied into the draft")
    feature_weight: float = Field(1.0, ge=0, description="feature draft: smooth-L1 weight of its state against "
                                  "the target's")
    unroll: int = Field(3, ge=1, description="feature draft: draft levels trained, each fed the level above's "
                        "own states as at run time")
    vocab_size: int = Field(8192, ge=0, description="tokens the draft's head keeps; 0 keeps the full vocabulary")
    max_new_tokens: int = Field(128, ge=1, description="length of the target continuations trained on")
    generation_batch_size: int = Field(16, ge=1)
    context_tokens: int = Field(512, ge=1, description="prompt tokens kept before each continuation in training")
    batch_tokens: int = Field(8192, ge=1, description="tokens per optimizer step")
    epochs: float = Field(4.0, gt=0)
    time_budget_s: float | None = Field(
        None, gt=0, description="wall clock for the whole run: generation, then training until the budget is spent"
    )
    generation_share: float = Field(0.5, gt=0, le=1, description="most of the budget target generation may use")
    learning_rate: float = Field(3e-4, gt=0)
    warmup_steps: int = Field(20, ge=0)
    soft_weight: float = Field(1.0, ge=0, description="soft cross-entropy to the target on continuation positions")
    hard_weight: float = Field(1.0, ge=0, description="cross-entropy to the greedy token on continuation positions")
    prompt_weight: float = Field(1.0, ge=0, description="soft cross-entropy to the target on prompt positions")
    validation_prompts: int = Field(16, ge=1, description="prompts whose continuations are held out")
    eval_depth: int = Field(5, ge=1, description="draft depth of the acceptance length reported in metrics")
    eval_every: int = Field(100, ge=0, description="validate every this many steps (0: only before and after)")
    checkpoint_seconds: float = Field(60.0, gt=0)
    bf16: bool = Field(False, description="bfloat16 autocast for training forwards: only for CPUs with native bf16 "
                       "(AVX512-BF16/AMX); on AVX2-only CPUs it is emulated and about 30x slower than float32")
    seed: int = 0
    num_threads: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> DraftTrainingConfig:
        if self.soft_weight == 0 and self.hard_weight == 0:
            raise ValueError("soft_weight and hard_weight cannot both be 0")
        if self.architecture == "feature" and self.init is not None:
            raise ValueError("init applies to architecture 'layers' only")
        return self


# ---------------------------------------------------------------------------------------------- the draft model
def build_draft(target: PreTrainedModel, layers: list[int]) -> PreTrainedModel:
    """A shallow copy of the target's architecture: chosen decoder layers, embeddings, final norm; untied head."""
    config = layers_config(target.config, layers)
    config.tie_word_embeddings = False  # the draft trains its own head rows
    draft = AutoModelForCausalLM.from_config(config, dtype=next(target.parameters()).dtype)
    source = target.state_dict()
    state = {}
    for name in draft.state_dict():
        parts = name.split(".")
        if "layers" in parts:  # model.layers.<i>.… <- model.layers.<layers[i]>.…
            at = parts.index("layers") + 1
            parts[at] = str(layers[int(parts[at])])
        state[name] = source.get(".".join(parts), source.get("model.embed_tokens.weight") if name == "lm_head.weight"
                                 else None)
    missing = [name for name, value in state.items() if value is None]
    if missing:
        raise ValueError(f"cannot map target weights onto the draft: {missing[:5]}")
    draft.load_state_dict({k: v.clone() for k, v in state.items()})
    draft.generation_config = target.generation_config
    return draft.eval()


def choose_vocab_subset(examples: list[TeacherExample], size: int, vocab: int, always: set[int]) -> list[int]:
    """The tokens the target emits most, plus prompt tokens it may copy (counted at a quarter weight)."""
    counts: Counter[int] = Counter()
    for example in examples:
        counts.update({t: 4 * c for t, c in Counter(example.continuation).items()})
        counts.update(example.prompt)
    ranked = [t for t, _ in counts.most_common() if t not in always]
    chosen = set(always) | set(ranked[: max(size - len(always), 0)])
    filler = (t for t in range(vocab) if t not in chosen)  # tiny data: pad with low ids, harmless
    while len(chosen) < size:
        chosen.add(next(filler))
    return sorted(chosen)


@dataclass
class _Level:
    """One draft level's predictions: logits over the subset (and, for a feature draft, its states) at the flat
    positions ``at`` (row-major over the batch's unmasked positions, like the batch's teacher tensors)."""

    logits: torch.Tensor
    states: torch.Tensor | None
    at: torch.Tensor


class _Student(nn.Module):
    """The draft's body plus a trainable head over the vocabulary subset only, and the target's frozen head rows
    for the same subset (teacher logits = target hidden state @ those rows)."""

    def __init__(self, draft: PreTrainedModel, subset: list[int], teacher_head: torch.Tensor) -> None:
        super().__init__()
        self.body = draft.model
        self.body.embed_tokens.weight.requires_grad_(False)  # shared with the target: keep its geometry
        self.register_buffer("subset", torch.tensor(subset, dtype=torch.long), persistent=False)
        self.register_buffer("teacher_head", teacher_head, persistent=False)
        self.head = nn.Parameter(draft.get_output_embeddings().weight.detach()[self.subset].clone())

    def levels(self, batch: dict[str, torch.Tensor], count: int) -> list[_Level]:
        """A token draft conditions on true tokens only: every level predicts like the first, so one is enough."""
        del count
        mask = batch["mask"].bool()
        hidden = self.body(input_ids=batch["ids"], attention_mask=batch["mask"]).last_hidden_state
        return [_Level(hidden[mask] @ self.head.T, None, torch.ones(int(mask.sum()), dtype=torch.bool))]

    @torch.no_grad()
    def calibrate_scale(self, batch: dict[str, torch.Tensor], loss) -> float:
        """Rescale the head to the loss-minimising temperature on one batch.

        Copied from the target, a shallow draft is far over-confident (its logits spread about twice as wide as
        the target's), and Adam would need thousands of small steps to shrink the head's norm by itself.
        """
        level = self.levels(batch, 1)[0]
        scales = torch.linspace(0.05, 1.5, 30)
        best = float(min(scales, key=lambda scale: float(loss(_Level(level.logits * scale, None, level.at), batch))))
        self.head.mul_(best)
        return best

    def write_back(self, draft: PreTrainedModel) -> None:
        with torch.no_grad():
            draft.get_output_embeddings().weight[self.subset] = self.head.detach()


def _unroll_mask(valid: torch.Tensor, level: int) -> torch.Tensor:
    """Which keys the queries of draft level ``level`` (0 = reading true features) see, as at run time.

    Keys are ``level + 1`` blocks of the same T positions: block 0 computed from the target's features, block m
    from level m's. A level-k query at position j drafts k tokens past a root at j - k: it sees block 0 up to the
    root and, of each deeper block m, only position j - k + m (its own chain). Returns [B, 1, T, (level+1) T].
    """
    width = valid.shape[1]
    query, key = torch.arange(width)[:, None], torch.arange(width)[None, :]
    blocks = [(key <= query - level)[None] & valid[:, None, :]]
    blocks += [(key == query - level + m)[None].expand(len(valid), -1, -1) for m in range(1, level + 1)]
    return torch.cat(blocks, -1)[:, None]


class _FeatureStudent(nn.Module):
    """A ``FeatureDraft`` trained level by level: level k reads the states level k - 1 produced, one position
    back, through the keys it would see at run time (``_unroll_mask``). Embeddings and head stay the target's."""

    def __init__(self, draft: FeatureDraft, subset: list[int]) -> None:
        super().__init__()
        self.draft = draft
        draft.body.embed_tokens.weight.requires_grad_(False)
        draft.lm_head.weight.requires_grad_(False)  # maps the target's states to its logits: g should match them
        self.register_buffer("subset", torch.tensor(subset, dtype=torch.long), persistent=False)

    @property
    def teacher_head(self) -> torch.Tensor:
        return self.draft.lm_head.weight

    def levels(self, batch: dict[str, torch.Tensor], count: int) -> list[_Level]:
        mask = batch["mask"].bool()
        tokens, valid = batch["ids"][:, 1:], mask[:, 1:]  # input j: token j + 1 with the target's state at j
        positions = torch.arange(tokens.shape[1])[None].expand(len(tokens), -1)
        features = batch["states"][:, :-1]
        cache = DynamicCache()
        levels = []
        for level in range(count):
            states = self.draft.hidden(tokens, features, attention_mask=_unroll_mask(valid, level),
                                       position_ids=positions, cache=cache, use_cache=True)
            at = valid.clone()
            at[:, :level] = False  # no root that far back
            flat = torch.zeros_like(mask)
            flat[:, 1:] = at  # input j predicts what the target's state at j + 1 does
            kept = states[at]
            levels.append(_Level(self.draft.lm_head(kept), kept, flat[mask]))
            features = torch.cat([torch.zeros_like(states[:, :1]), states[:, :-1]], 1)
        return levels


# ------------------------------------------------------------------------------------------------------ batches
class _Window:
    """One training sequence: the last ``context`` prompt tokens + the continuation, with the target's hidden
    state at every position and the greedy token at continuation positions."""

    def __init__(self, example: TeacherExample, context: int, index: torch.Tensor) -> None:
        kept = min(context, len(example.prompt))
        self.ids = torch.tensor(example.prompt[-kept:] + example.continuation[:-1], dtype=torch.long)
        self.hidden = example.hidden[len(example.prompt) - kept :]
        self.continuation = torch.arange(len(self.ids)) >= kept - 1  # positions predicting continuation tokens
        self.labels = torch.full((len(self.ids),), -1, dtype=torch.long)
        self.labels[self.continuation] = index[torch.tensor(example.continuation)]  # -1: outside the subset

    def __len__(self) -> int:
        return len(self.ids)


def _batches(windows: list[_Window], batch_tokens: int, generator: torch.Generator) -> list[list[int]]:
    """Length-sorted groups (little padding) of about ``batch_tokens`` padded tokens, in random order."""
    order = sorted(range(len(windows)), key=lambda i: len(windows[i]))
    groups, current = [], []
    for i in order:
        if current and len(windows[i]) * (len(current) + 1) > batch_tokens:
            groups.append(current)
            current = []
        current.append(i)
    groups.append(current)
    return [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]


def _schedule(windows: list[_Window], config: DraftTrainingConfig, per_epoch: int, step: int):
    """Batches from ``step`` on, endlessly: epoch e is shuffled by seed + e, so a resumed run sees the same order."""
    while True:
        epoch, offset = divmod(step, per_epoch)
        generator = torch.Generator().manual_seed(config.seed + epoch)
        for group in _batches(windows, config.batch_tokens, generator)[offset:]:
            yield group
            step += 1


def _collate(windows: list[_Window]) -> dict[str, torch.Tensor]:
    """Right-padded ids, mask and teacher states; per-position targets in the row-major order of the unmasked
    positions."""
    width = max(len(w) for w in windows)
    ids = torch.zeros(len(windows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    states = windows[0].hidden.new_zeros(len(windows), width, windows[0].hidden.shape[-1])
    for r, w in enumerate(windows):
        ids[r, : len(w)] = w.ids
        mask[r, : len(w)] = 1
        states[r, : len(w)] = w.hidden
    return {"ids": ids, "mask": mask, "states": states, "hidden": states[mask.bool()],
            "continuation": torch.cat([w.continuation for w in windows]),
            "labels": torch.cat([w.labels for w in windows])}


def _loss(level: _Level, batch: dict[str, torch.Tensor], teacher_head: torch.Tensor,
          config: DraftTrainingConfig) -> torch.Tensor:
    logp = level.logits.float().log_softmax(-1)
    hidden = batch["hidden"][level.at]
    with torch.no_grad():
        teacher = (hidden.to(teacher_head.dtype) @ teacher_head.T).float().softmax(-1)
    soft = -(teacher * logp).sum(-1)
    continuation = batch["continuation"][level.at]
    labels = batch["labels"][level.at]
    known = labels >= 0  # greedy tokens outside the subset cannot be predicted: no hard loss there
    loss = config.soft_weight * soft[continuation].mean()
    if bool(known.any()):
        loss = loss + config.hard_weight * -logp[known, labels[known]].mean()
    if bool((~continuation).any()):
        loss = loss + config.prompt_weight * soft[~continuation].mean()
    if level.states is not None:
        loss = loss + config.feature_weight * nn.functional.smooth_l1_loss(level.states.float(), hidden.float())
    return loss


def _step_loss(student: _Student | _FeatureStudent, batch: dict[str, torch.Tensor],
               config: DraftTrainingConfig) -> torch.Tensor:
    levels = student.levels(batch, config.unroll)
    return sum(_loss(level, batch, student.teacher_head, config) for level in levels) / len(levels)


def acceptance_length(agree: list[list[bool]], depth: int) -> float:
    """Mean tokens per target forward of greedy chain speculation at ``depth`` along one continuation.

    ``agree[k][i]``: the level-k draft (k tokens past the root) predicts token i + 1 as the target does; a draft
    whose levels all predict alike (a token draft fed true tokens) may give one list for every level.
    """
    length = len(agree[0])
    position, forwards = 0, 0
    while position < length:
        run = 0
        while (run < depth and position + run < length - 1
               and agree[min(run, len(agree) - 1)][position + run]):
            run += 1
        position += run + 1
        forwards += 1
    return length / max(forwards, 1)


@torch.no_grad()
def evaluate(student: _Student | _FeatureStudent, windows: list[_Window], depth: int) -> dict[str, float]:
    """Top-1 agreement with the target (= greedy per-token acceptance) and the acceptance length it implies."""
    student.eval()
    agree_all, lengths, weights = [], [], []
    for w in windows:
        batch = _collate([w])
        continuation = batch["continuation"]
        by_level = []
        for level in student.levels(batch, depth):
            agree = torch.zeros_like(continuation)
            agree[level.at] = level.logits.argmax(-1) == batch["labels"][level.at]
            by_level.append(agree[continuation].tolist())
        agree_all += by_level[0]
        lengths.append(acceptance_length(by_level, depth))
        weights.append(len(by_level[0]))
    student.train()
    tokens = sum(weights)
    return {"agreement": sum(agree_all) / max(tokens, 1),
            "acceptance_length": sum(a * n for a, n in zip(lengths, weights, strict=True)) / max(tokens, 1)}


# ----------------------------------------------------------------------------------------------------- the run
def _initial_draft(config: DraftTrainingConfig, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase):
    if config.init is None:
        return build_draft(target, config.layers)
    require_same_tokenizer(tokenizer, load_tokenizer(config.init), config.init)
    draft = load_model(config.init, "float32", torch.device("cpu"))
    if draft.config.tie_word_embeddings:
        draft.config.tie_word_embeddings = False
        draft.lm_head.weight = nn.Parameter(draft.lm_head.weight.detach().clone())
    return draft.train()


def _lr(step: int, progress: float, config: DraftTrainingConfig) -> float:
    warm = min(1.0, (step + 1) / max(config.warmup_steps, 1))
    return config.learning_rate * warm * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def train_draft(config: DraftTrainingConfig, overwrite: bool = False) -> Path:
    """Run (or resume) the whole distillation; returns the finished draft directory."""
    started = time.perf_counter()
    set_threads(config.num_threads)
    torch.manual_seed(config.seed)
    run = RunDir(config.output, config, DRAFT_METADATA, overwrite)
    tokenizer = load_tokenizer(config.target)
    target = load_model(config.target, "float32", torch.device("cpu"))
    draft = _initial_draft(config, target, tokenizer) if config.architecture == "layers" else None
    prompts = load_prompts(config.data, tokenizer)
    setup_seconds = time.perf_counter() - started
    budget = config.time_budget_s
    examples, generation_seconds = teacher_continuations(
        target, prompts, run, max_new_tokens=config.max_new_tokens, batch_size=config.generation_batch_size,
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        seed=config.seed, budget_seconds=budget * config.generation_share if budget else None,
    )
    if len(examples) <= config.validation_prompts:
        raise ValueError(f"need more than validation_prompts={config.validation_prompts} prompts, got {len(examples)}")
    # Validation prompts are spread over the data (every n-th), so every source is represented.
    every = len(examples) / config.validation_prompts
    held = {int(i * every) for i in range(config.validation_prompts)}
    train_examples = [e for i, e in enumerate(examples) if i not in held]
    vocab = target.config.vocab_size
    subset = None
    if 0 < config.vocab_size < vocab:
        always = set(tokenizer.all_special_ids) | eos_ids(target)
        subset = choose_vocab_subset(train_examples, config.vocab_size, vocab, always)
    subset_ids = subset if subset is not None else list(range(vocab))
    if draft is None:
        student = _FeatureStudent(FeatureDraft.from_target(target, config.layers, subset_ids), subset_ids).train()
    else:
        teacher_head = target.get_output_embeddings().weight.detach()[subset_ids].clone()
        student = _Student(draft, subset_ids, teacher_head).train()
    del target  # free its memory for training
    index = torch.full((vocab,), -1, dtype=torch.long)
    index[student.subset] = torch.arange(len(student.subset))
    windows = [_Window(e, config.context_tokens, index) for e in train_examples]
    valid = [_Window(e, 1 << 30, index) for i, e in enumerate(examples) if i in held]  # full context, as served

    # Training gets what generation left, minus time to set up, validate and save (counted across resumes).
    train_budget = budget - setup_seconds - generation_seconds - _FINISH_RESERVE_S if budget else None
    if isinstance(student, _Student) and run.load_state("checkpoint.pt") is None:
        sample = _collate(windows[:: max(1, len(windows) // 16)])
        scale = student.calibrate_scale(sample, lambda level, batch: _loss(level, batch, student.teacher_head, config))
        log.info("head rescaled by %.2f to the target's confidence", scale)
    before = evaluate(student, valid, config.eval_depth)
    steps, total_steps, train_seconds = _optimize(student, windows, valid, config, run, train_budget)
    after = evaluate(student, valid, config.eval_depth)
    metrics = {
        "steps": steps, "planned_steps": total_steps, "train_examples": len(windows),
        "train_tokens": sum(len(w.labels) for w in windows), "validation_examples": len(valid),
        "validation_subset_coverage": float(torch.cat([w.labels[w.continuation] for w in valid]).ge(0).float().mean()),
        "validation_before": before, "validation": after, "generation_seconds": round(generation_seconds, 1),
        "train_seconds": round(train_seconds, 1), "total_seconds": round(time.perf_counter() - started, 1),
    }
    run.log_metrics(final=True, **metrics)
    log.info("validation agreement %.3f (before %.3f), acceptance length at depth %d: %.2f (before %.2f)",
             after["agreement"], before["agreement"], config.eval_depth, after["acceptance_length"],
             before["acceptance_length"])
    _save(run, draft, student, tokenizer, config, subset, metrics)
    return run.path


def _optimize(student: _Student | _FeatureStudent, windows: list[_Window], valid: list[_Window],
              config: DraftTrainingConfig, run: RunDir, budget: float | None) -> tuple[int, int, float]:
    """AdamW with warm-up and cosine decay over epochs (or the time budget, whichever ends first); checkpoints
    every ``checkpoint_seconds`` and on interruption. Returns (steps, planned steps, training seconds)."""
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    per_epoch = len(_batches(windows, config.batch_tokens, torch.Generator()))
    total_steps = max(1, math.ceil(config.epochs * per_epoch))
    step, seconds = 0, 0.0
    state = run.load_state("checkpoint.pt")
    if state is not None:
        student.load_state_dict(state["trainable"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        step, seconds = state["step"], state["train_seconds"]
        log.info("resumed training at step %d/%d", step, total_steps)

    def checkpoint() -> None:
        trainable = {n: p.detach() for n, p in student.named_parameters() if p.requires_grad}
        run.save_state("checkpoint.pt", {"trainable": trainable, "optimizer": optimizer.state_dict(), "step": step,
                                         "train_seconds": time.perf_counter() - loop_start})

    progress = Progress("train-draft", total_steps, done=step)
    loop_start = time.perf_counter() - seconds
    last_checkpoint = time.perf_counter()
    try:
        for group in _schedule(windows, config, per_epoch, step):
            seconds = time.perf_counter() - loop_start
            if step >= total_steps or (budget is not None and seconds >= budget):
                break
            lr = _lr(step, max(step / total_steps, seconds / budget if budget else 0.0), config)
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
            batch = _collate([windows[i] for i in group])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
                loss = _step_loss(student, batch, config)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            run.log_metrics(step=step, loss=loss.item(), lr=lr, seconds=round(seconds, 2))
            progress.update(step, loss=loss.item())
            if config.eval_every and step % config.eval_every == 0:
                validation = evaluate(student, valid, config.eval_depth)
                run.log_metrics(step=step, validation=validation)
                log.info("step %d: validation %s", step, validation)
            if time.perf_counter() - last_checkpoint > config.checkpoint_seconds:
                checkpoint()
                last_checkpoint = time.perf_counter()
    except KeyboardInterrupt:
        checkpoint()
        log.warning("interrupted at step %d; re-run the same command to resume", step)
        raise
    return step, total_steps, time.perf_counter() - loop_start


def _save(run: RunDir, draft: PreTrainedModel | None, student: _Student | _FeatureStudent,
          tokenizer: PreTrainedTokenizerBase, config: DraftTrainingConfig, subset: list[int] | None,
          metrics: dict) -> None:
    if isinstance(student, _FeatureStudent):
        student.draft.save(run.path)
    else:
        student.write_back(draft)
        draft.save_pretrained(run.path)
    tokenizer.save_pretrained(run.path)
    meta = {"architecture": config.architecture, "vocab_subset": subset, "target": config.target,
            "target_path": resolve_model_path(config.target),
            "training": config.model_dump(mode="json"), "metrics": metrics}
    # Written last: its presence marks the directory as a finished draft.
    (run.path / DRAFT_METADATA).write_text(json.dumps(meta))
    run.finish()
