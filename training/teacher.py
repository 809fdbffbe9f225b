"""The target's own greedy continuations of training prompts, with its final hidden state at every position.

The final hidden state h (the input of the LM head) is the densest teacher signal there is: the target's logits
at any position are ``lm_head(h)``, so the draft can be distilled against the target's exact distribution over
its vocabulary subset at every prompt *and* continuation position, for the price of storing one vector per token.
The prefill computes those states for the prompt anyway; a forward hook on the decoder keeps them.

Batches group prompts of similar length (little padding) and run in a seeded random order, so a time budget
that stops generation early keeps a representative sample. Each finished batch is saved as a work file with its
generation time, so an interrupted run regenerates nothing it already has and still accounts for that time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from training.runs import Progress, RunDir, log


@dataclass
class TeacherExample:
    prompt: list[int]
    continuation: list[int]  # greedy tokens, through the first EOS
    # [len(prompt) + len(continuation) - 1, H] bfloat16: the target's final hidden state at every position whose
    # next token is known (position i predicts token i + 1 of prompt + continuation).
    hidden: torch.Tensor


def eos_ids(model: PreTrainedModel) -> set[int]:
    configured = model.generation_config.eos_token_id
    ids = configured if isinstance(configured, list) else [configured]
    return {int(i) for i in ids if i is not None}


@torch.no_grad()
def _generate_batch(
    target: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int, pad_id: int
) -> list[TeacherExample]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding: every row's next token sits at the same column
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    states: list[torch.Tensor] = []
    hook = target.get_decoder().register_forward_hook(
        lambda module, args, output: states.append(output.last_hidden_state.to(torch.bfloat16))
    )
    try:
        out = target.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
            pad_token_id=pad_id, top_p=None, top_k=None, temperature=None,
        )
    finally:
        hook.remove()
    hidden = torch.cat(states, 1)  # [B, width + generated - 1, H]: prefill, then one state per decode step
    generated = out[:, width:]
    stops = eos_ids(target)
    examples = []
    for row, prompt in enumerate(prompts):
        tokens = generated[row].tolist()
        length = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
        start = width - len(prompt)
        examples.append(TeacherExample(prompt, tokens[:length], hidden[row, start : width + length - 1].clone()))
    return examples


def teacher_continuations(
    target: PreTrainedModel,
    prompts: list[list[int]],
    run: RunDir,
    *,
    max_new_tokens: int,
    batch_size: int,
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
            generated = _generate_batch(target, [prompts[i] for i in batch], max_new_tokens, pad_id)
            done = {"prompts": [prompts[i] for i in batch], "examples": generated,
                    "seconds": time.perf_counter() - start}
            run.save_state(name, done)
        spent += done["seconds"]
        examples.update(zip(batch, done["examples"], strict=True))
        progress.update(len(examples), tokens=sum(len(e.continuation) for e in examples.values()))
    if len(examples) < len(prompts):
        log.warning("generation budget spent: training on %d of %d prompts", len(examples), len(prompts))
    return [examples[i] for i in sorted(examples)], spent
