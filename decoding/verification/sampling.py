"""Logit processing shared by target and draft: penalties and token bans, then temperature, top-k, top-p.

Both sides must use the identical processing: speculative sampling is lossless with respect to the *processed*
target law. Penalties depend on the tokens before each position, so inside a candidate tree every node is
penalized with its own history (the committed tokens plus its ancestors in the tree), on both sides.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from decoding.config import GREEDY_TEMPERATURE, SamplingParams
from decoding.model.attention import kernel_loaded


def run_seed(configured: int | None) -> int:
    """The run's seed (vLLM): the configured one, or fresh randomness when it is null."""
    return configured if configured is not None else secrets.randbits(63)


def row_seed(run: int, key: str) -> int:
    """A row's own seed, derived from (run seed, row key): rows with equal prompts still draw independently."""
    digest = hashlib.blake2b(f"{run}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def row_generator(params: SamplingParams, run: int, key: str) -> torch.Generator:
    """The row's random stream: its own ``seed`` when it gave one (vLLM), else derived from (run seed, key)."""
    return torch.Generator().manual_seed(params.seed if params.seed is not None else row_seed(run, key))


@dataclass(frozen=True)
class Penalties:
    """vLLM's penalties and ``min_tokens`` ban as tensors, for the rows of one step.

    Semantics follow vLLM (and transformers' ``RepetitionPenaltyLogitsProcessor`` for the repetition penalty):
    repetition over prompt and output tokens (positive logits divided, negative multiplied), then frequency
    (minus count in the output) and presence (minus once per token seen in the output); the stop tokens (EOS
    unless ``ignore_eos``, and ``stop_token_ids``) are banned while fewer than ``min_tokens`` tokens are out.
    transformers' processors take one value for the whole batch and one history per row; a tree needs per-row
    values and a history per node, so the same formulas run here over [B, nodes, V] at once (the tests check them
    against ``RepetitionPenaltyLogitsProcessor`` node by node, and greedy outputs against ``generate``).
    """

    presence: torch.Tensor  # [B]
    frequency: torch.Tensor  # [B]
    repetition: torch.Tensor  # [B]; 1 = off
    min_tokens: torch.Tensor  # [B] long
    output_counts: torch.Tensor  # [B, V] committed output tokens
    prompt_seen: torch.Tensor  # [B, V] bool
    stop_ids: torch.Tensor  # [B, V] bool: tokens min_tokens bans

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
        eos_ids: Collection[int], vocab: int,
    ) -> Penalties | None:
        """``outputs``: each row's committed output tokens; None when no row has a penalty or a ban."""
        if not any(p.penalized for p in params):
            return None
        batch = len(params)
        counts = torch.zeros(batch, vocab)
        seen = torch.zeros(batch, vocab, dtype=torch.bool)
        stops = torch.zeros(batch, vocab, dtype=torch.bool)
        for row, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
            if output:
                counts[row].index_add_(0, torch.tensor(output, dtype=torch.long), torch.ones(len(output)))
            if p.repetition_penalty != 1.0:
                seen[row, torch.tensor(list(prompt), dtype=torch.long)] = True
            if p.min_tokens:
                stops[row, torch.tensor(sorted(p.stop_ids(eos_ids)), dtype=torch.long)] = True
        return cls(
            presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
            frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
            repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
            min_tokens=torch.tensor([p.min_tokens for p in params], dtype=torch.long),
            output_counts=counts, prompt_seen=seen, stop_ids=stops,
        )

    def to(self, device: torch.device) -> Penalties:
        return Penalties(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})

    def __getitem__(self, rows: torch.Tensor | slice) -> Penalties:
        return Penalties(**{f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)})

    def apply(
        self, logits: torch.Tensor, tokens: torch.Tensor | None = None, ancestors: torch.Tensor | None = None,
        nodes: slice = slice(None),
    ) -> torch.Tensor:
        """Penalized copy of ``logits`` [B, k, V] at tree ``nodes``; ``tokens`` [B, N] and ``ancestors`` [N, N]
        give each node's uncommitted history (itself and its ancestors). Without a tree: committed history only."""
        batch, vocab = logits.shape[0], logits.shape[-1]
        counts = self.output_counts[:, None].expand(batch, logits.shape[1], vocab).clone()
        if tokens is not None:
            size = tokens.shape[1]
            path = ancestors[:size, :size][nodes].float()  # [k, N]
            index = tokens[:, None, :].expand(batch, path.shape[0], size)
            counts.scatter_add_(-1, index, path[None].expand(batch, -1, -1).contiguous())
        out = logits.float()
        repetition = self.repetition[:, None, None]
        seen = counts.gt(0) | self.prompt_seen[:, None]
        out = torch.where(seen, torch.where(out > 0, out / repetition, out * repetition), out)
        out = out - self.frequency[:, None, None] * counts - self.presence[:, None, None] * counts.gt(0)
        produced = counts.sum(-1)  # output tokens before each node's child
        banned = self.stop_ids[:, None] & (produced < self.min_tokens[:, None])[..., None]
        return out.masked_fill(banned, -torch.inf)


@dataclass(frozen=True)
class WarpParams:
    """Per-row sampling parameters as tensors, so a ragged batch warps in one call."""

    temperature: torch.Tensor  # [B] float; 0 = greedy
    top_k: torch.Tensor  # [B] long; 0 = off
    top_p: torch.Tensor  # [B] float; 1 = off
    penalties: Penalties | None = None  # None: no row has a penalty or a ban
    # What warping branches on, known on the host: read from device tensors, each would stall the step until the
    # GPU caught up (the CUDA run of test_a_step_reads_back_only_paths_tokens_and_statistics caught three such
    # reads a call). Computed here from host tensors; parameters on a device must be given them.
    max_top_k: int | None = None  # at least every row's top_k (0: no row has top-k)
    # The rows that may filter by top-p (at least those with top_p < 1): only they are sorted, a sort over the
    # vocabulary costing ~0.8 s for 64 rows of a 6-node tree here (2-core CPU, float32).
    nucleus_rows: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_top_k is not None and self.nucleus_rows is not None:
            return
        if self.top_k.device.type != "cpu":
            raise ValueError("WarpParams on a device need max_top_k and nucleus_rows from the host")
        object.__setattr__(self, "max_top_k", max(0, int(self.top_k.max())) if len(self.top_k) else 0)
        object.__setattr__(self, "nucleus_rows", tuple((self.top_p < 1).nonzero().flatten().tolist()))

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]] = (),
        outputs: Sequence[Sequence[int]] = (), eos_ids: Collection[int] = (), vocab: int = 0,
    ) -> WarpParams:
        """``prompts``/``outputs`` (committed tokens per row), ``eos_ids`` and ``vocab`` feed the penalties."""
        penalties = Penalties.build(params, prompts, outputs, eos_ids, vocab) if vocab else None
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            penalties=penalties,
        )

    @property
    def greedy(self) -> torch.Tensor:
        """[B] bool where this warp's tensors are: rows that sample greedily (``SamplingParams`` sets a tiny
        temperature to 0, so temperature 0 is exactly ``SamplingParams.greedy``)."""
        return self.temperature == 0

    def to(self, device: torch.device) -> WarpParams:
        """The same parameters on ``device`` (penalties included): logits are warped where the model ran."""
        return WarpParams(self.temperature.to(device), self.top_k.to(device), self.top_p.to(device),
                          self.penalties.to(device) if self.penalties is not None else None,
                          self.max_top_k, self.nucleus_rows)

    def __getitem__(self, rows: torch.Tensor | slice) -> WarpParams:
        """The warp of some rows, their penalties with them. ``rows``: a slice, or an index tensor on the host
        (moved to this warp's device without waiting). An index already on the device keeps the facts exact only
        where no row filters by top-p; else every row it picks counts as one that may."""
        nucleus = set(self.nucleus_rows or ())
        if isinstance(rows, slice):
            picked: list[int] | None = list(range(len(self.temperature))[rows])
        elif rows.device.type == "cpu":
            picked = rows.tolist()
            rows = rows.to(self.temperature.device, non_blocking=True)
        else:
            picked = None
        if picked is not None:
            nucleus_rows = tuple(i for i, row in enumerate(picked) if row in nucleus)
        else:
            nucleus_rows = tuple(range(len(rows))) if nucleus else ()
        return WarpParams(self.temperature[rows], self.top_k[rows], self.top_p[rows],
                          self.penalties[rows] if self.penalties is not None else None,
                          self.max_top_k, nucleus_rows)

    def penalize(
        self, logits: torch.Tensor, tokens: torch.Tensor | None = None, ancestors: torch.Tensor | None = None,
        nodes: slice = slice(None),
    ) -> torch.Tensor:
        """``logits`` [B, V] or [B, k, V] with penalties and bans applied (see ``Penalties.apply``)."""
        if self.penalties is None:
            return logits
        if logits.dim() == 2:
            return self.penalties.apply(logits[:, None])[:, 0]
        return self.penalties.apply(logits, tokens, ancestors, nodes)


def warp_probs(logits: torch.Tensor, params: WarpParams) -> torch.Tensor:
    """Warped float32 probabilities for logits [B, ..., V] with per-row params; greedy rows get temperature 1."""
    shape = logits.shape
    flat = logits.float().reshape(shape[0], -1, shape[-1])
    # Greedy rows (temperature 0, which SamplingParams makes of any temperature below GREEDY_TEMPERATURE) warp at 1;
    # no row divides by less than GREEDY_TEMPERATURE, so float32 logits stay finite.
    temperature = params.temperature.clamp(min=GREEDY_TEMPERATURE)
    temperature = torch.where(params.temperature > 0, temperature, torch.ones_like(temperature))
    flat = flat / temperature[:, None, None]
    # Which rows need a filter is known on the host (choosing them on the device would wait for it). Top-k runs
    # over every row when any needs it, each row masked by its own k, as vLLM's sampler does; top-p only over the
    # rows that may need it, each masked by its own p.
    if params.max_top_k:
        top_k = params.top_k.clamp(max=shape[-1])
        kth = torch.topk(flat, min(params.max_top_k, shape[-1]), dim=-1).values  # [B, N, kmax], descending
        index = (top_k.clamp(min=1, max=kth.shape[-1]) - 1)[:, None, None].expand(-1, flat.shape[1], 1)
        threshold = kth.gather(-1, index)
        threshold = torch.where((top_k > 0)[:, None, None], threshold, torch.full_like(threshold, -torch.inf))
        flat = flat.masked_fill(flat < threshold, -torch.inf)
    if params.nucleus_rows:
        every_row = len(params.nucleus_rows) == shape[0]
        rows = None if every_row else torch.tensor(params.nucleus_rows).to(flat.device, non_blocking=True)
        sub = flat if rows is None else flat.index_select(0, rows)
        sorted_logits, order = torch.sort(sub, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing the threshold stays in); a row
        # with top_p 1 keeps everything, whatever the rounding of its cumulative sums.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        top_p = (params.top_p if rows is None else params.top_p.index_select(0, rows))[:, None, None]
        drop_sorted = (mass_before >= top_p) & (top_p < 1)
        drop_sorted[..., 0] = False  # the most likely token stays, however small top_p (1e-46 is 0 in float32)
        sub = sub.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), -torch.inf)
        flat = sub if rows is None else flat.index_copy(0, rows, sub)
    probs = flat.softmax(-1)
    # softmax makes a whole row NaN when no finite logit is left (every token banned) or one is not finite: such a
    # row becomes uniform, the same on both sides, so sampling never reads NaN and speculation stays lossless.
    empty = probs[..., :1].isnan()
    if probs.device.type != "cpu" or bool(empty.any()):  # a device fills without reading the mask back
        probs = probs.masked_fill(empty, 1.0 / shape[-1])
    return probs.reshape(shape)


def argmax_logsumexp(logits: torch.Tensor, with_logsumexp: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(argmax, float32 log-sum-exp or None) over the last dimension of ``logits``; on a CPU one pass of the
    kernel per row (``specbatch::argmax_logsumexp``) where it is loaded, the same answers as torch's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[-1] and kernel_loaded():
        index, lse = torch.ops.specbatch.argmax_logsumexp(logits.reshape(-1, logits.shape[-1]), with_logsumexp)
        return index.view(logits.shape[:-1]), lse.view(logits.shape[:-1]) if with_logsumexp else None
    return logits.argmax(-1), logits.float().logsumexp(-1) if with_logsumexp else None


def row_uniforms(generators: Sequence[torch.Generator], rows: Sequence[int], count: int) -> torch.Tensor:
    """[B, count] uniforms on the host, B = len(generators): each row of ``rows`` draws ``count`` from its own
    generator, the others are 0. A row draws the same count whatever the others do (seeded rows reproduce)."""
    uniforms = torch.zeros(len(generators), count)
    for row in rows:
        uniforms[row] = torch.rand(count, generator=generators[row])
    return uniforms


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[dict]:
    """vLLM's ``logprobs``: for each token, its log-probability under the model's raw law at the position before
    it (``logits`` [k, V], one row per token) and the ``top`` most likely tokens there."""
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
    best = logprobs.topk(top, dim=-1) if top else None
    entries = []
    for i, (token, value) in enumerate(zip(tokens, chosen)):
        alternatives = [] if best is None else [
            {"token_id": t, "logprob": v} for t, v in zip(best.indices[i].tolist(), best.values[i].tolist())
        ]
        entries.append({"token_id": token, "logprob": value, "top_logprobs": alternatives})
    return entries
