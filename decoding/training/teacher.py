"""The target's own greedy continuations of training prompts, with its top-k logits at every generated token.

Batches group prompts of similar length (little padding) and run in a seeded random order, so a time budget
that stops generation early keeps a representative sample. Each finished batch is saved as a work file with its
generation time, so an interrupted run regenerates nothing it already has and still accounts for that time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel

from decoding.training.runs import Progress, RunDir, log


@dataclass
class TeacherExample:
    prompt: list[int]
    continuation: list[int]  # greedy tokens, through the first EOS
    top_ids: torch.Tensor  # [len(continuation), k] int32: the target's top-k tokens before each continuation token
    top_logits: torch.Tensor  # [len(continuation), k] float16


class _TopKRecorder(LogitsProcessor):
    """Records the top-k of each step's logits; generate() then picks the argmax as usual (greedy)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        top = scores.float().topk(self.k, dim=-1)
        self.steps.append((top.indices.to(torch.int32), top.values.to(torch.float16)))
        return scores


def eos_ids(model: PreTrainedModel) -> set[int]:
    configured = model.generation_config.eos_token_id
    ids = configured if isinstance(configured, list) else [configured]
    return {int(i) for i in ids if i is not None}


@torch.no_grad()
def _generate_batch(
    target: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int, top_k: int, pad_id: int
) -> list[TeacherExample]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding: every row's next token sits at the same column
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    recorder = _TopKRecorder(top_k)
    out = target.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
        logits_processor=LogitsProcessorList([recorder]), pad_token_id=pad_id, top_p=None, top_k=None,
        temperature=None,
    )
    generated = out[:, width:]
    top_ids = torch.stack([s[0] for s in recorder.steps], 1)
    top_logits = torch.stack([s[1] for s in recorder.steps], 1)
    stops = eos_ids(target)
    examples = []
    for row, prompt in enumerate(prompts):
        tokens = generated[row].tolist()
        length = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
        examples.append(TeacherExample(prompt, tokens[:length], top_ids[row, :length], top_logits[row, :length]))
    return examples


def teacher_continuations(
    target: PreTrainedModel,
    prompts: list[list[int]],
    run: RunDir,
    *,
    max_new_tokens: int,
    batch_size: int,
    top_k: int,
    pad_id: int,
    seed: int = 0,
    budget_seconds: float | None = None,
) -> tuple[list[TeacherExample], float]:
    """Examples in prompt order (only the batches done within ``budget_seconds``) and the seconds they took."""
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [by_length[i : i + batch_size] for i in range(0, len(by_length), batch_size)]
    order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed)).tolist()
    examples: dict[int, TeacherExample] = {}
    spent = 0.0
    progress = Progress("teacher continuations", len(prompts))
    for number in order:
        batch = batches[number]
        name = f"teacher-{number:05d}.pt"
        done = run.load_state(name)
        if done is None or done["prompts"] != [prompts[i] for i in batch]:
            if budget_seconds is not None and spent >= budget_seconds:
                continue  # out of generation time: train on the batches generated so far
            start = time.perf_counter()
            generated = _generate_batch(target, [prompts[i] for i in batch], max_new_tokens, top_k, pad_id)
            done = {"prompts": [prompts[i] for i in batch], "examples": generated,
                    "seconds": time.perf_counter() - start}
            run.save_state(name, done)
        spent += done["seconds"]
        examples.update(zip(batch, done["examples"], strict=True))
        progress.update(len(examples), tokens=sum(len(e.continuation) for e in examples.values()))
    if len(examples) < len(prompts):
        log.warning("generation budget spent: training on %d of %d prompts", len(examples), len(prompts))
    return [examples[i] for i in sorted(examples)], spent
