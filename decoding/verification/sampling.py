"""Logit processing shared by target and draft: penalties and token bans, then temperature, top-k, top-p.

Both sides must use the identical processing: speculative sampling is lossless with respect to the *processed*
target law. Penalties depend on the tokens before each position, so inside a candidate tree every node is
penalized with its own history (the committed tokens plus its ancestors in the tree), on both sides.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from decoding.config import GREEDY_TEMPERATURE, SamplingParams
from decoding.model.attention import kernel_loaded
from decoding.model.execution import Execution, host_reads_free

# The token of a row whose processed law has nothing left (every token banned or masked, e.g. allowed_token_ids
# against a grammar, or a bad word of two tokens whose first is all allowed_token_ids leaves): the row ends with an
# error (decoding.engine.sequence) instead of drawing a token its request forbids.
NO_TOKEN = -1


def or_no_token(tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``tokens`` [B, ...] drawn from processed ``logits`` [B, ..., V], ``NO_TOKEN`` where those are all -inf."""
    return tokens.masked_fill(logits.amax(-1) == -torch.inf, NO_TOKEN)


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
    """vLLM's logit processing before temperature as tensors, for the rows of one step: ``logit_bias``, the bans
    (``allowed_token_ids``, ``bad_words``, ``min_tokens``) and the penalties.

    Semantics follow vLLM (and transformers' ``RepetitionPenaltyLogitsProcessor`` for the repetition penalty): the
    bias is added to the raw logits first; then repetition over prompt and output tokens (positive logits divided,
    negative multiplied), frequency (minus count in the output) and presence (minus once per token seen in the
    output); tokens outside ``allowed_token_ids`` are banned (-inf), and so are the stop tokens (EOS unless
    ``ignore_eos``, and ``stop_token_ids``) while fewer than ``min_tokens`` tokens are out, and a bad word's last
    token where the output so far ends with the word's other tokens (always, for a word of one token). vLLM bans
    before biasing and penalizing: a ban is -inf whatever comes after it, so the order is the same.
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
    bias: torch.Tensor | None = None  # [B, V] logit_bias (0 where none); None: no row has one
    banned: torch.Tensor | None = None  # [B, V] bool: outside allowed_token_ids, one-token bad words
    # Bad words of two tokens or more (None: no row has one), W per row at most: the tokens before the last, newest
    # first [B, W, L] (-1 past a word's), how many [B, W] (0: no word), the last one [B, W]; and each row's last L
    # committed output tokens, newest first [B, L] (-1 before its first).
    word_prefix: torch.Tensor | None = None
    word_length: torch.Tensor | None = None
    word_last: torch.Tensor | None = None
    output_tail: torch.Tensor | None = None

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
        eos_ids: Collection[int], vocab: int, bad_words: Sequence[Sequence[Sequence[int]]] = (),
    ) -> Penalties | None:
        """``outputs``: each row's committed output tokens; ``bad_words``: each row's bad words as token sequences
        (``decoding.params.bad_words_token_ids``; none by default). None when no row has a penalty or a ban."""
        if not any(p.penalized for p in params):
            return None
        batch = len(params)
        bad_words = bad_words or [()] * batch
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
        bias = None
        if any(p.logit_bias for p in params):
            bias = torch.zeros(batch, vocab)
            for row, p in enumerate(params):
                if p.logit_bias:
                    bias[row, torch.tensor(list(p.logit_bias))] = torch.tensor(list(p.logit_bias.values()))
        singles = [[word[0] for word in words if len(word) == 1] for words in bad_words]
        banned = None
        if any(p.allowed_token_ids is not None for p in params) or any(singles):
            banned = torch.zeros(batch, vocab, dtype=torch.bool)
            for row, (p, tokens) in enumerate(zip(params, singles)):
                if p.allowed_token_ids is not None:
                    banned[row] = True
                    banned[row, torch.tensor(p.allowed_token_ids)] = False
                banned[row, torch.tensor(tokens, dtype=torch.long)] = True
        return cls(
            presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
            frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
            repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
            min_tokens=torch.tensor([p.min_tokens for p in params], dtype=torch.long),
            output_counts=counts, prompt_seen=seen, stop_ids=stops, bias=bias, banned=banned,
            **_word_tables([[word for word in words if len(word) > 1] for words in bad_words], outputs),
        )

    def to(self, device: torch.device) -> Penalties:
        return Penalties(**{f.name: _optional(getattr(self, f.name), lambda t: t.to(device))
                            for f in dataclasses.fields(self)})

    def __getitem__(self, rows: torch.Tensor | slice) -> Penalties:
        return Penalties(**{f.name: _optional(getattr(self, f.name), lambda t: t[rows])
                            for f in dataclasses.fields(self)})

    def apply(
        self, logits: torch.Tensor, tokens: torch.Tensor | None = None, ancestors: torch.Tensor | None = None,
        nodes: slice = slice(None),
    ) -> torch.Tensor:
        """Processed copy of ``logits`` [B, k, V] at tree ``nodes``; ``tokens`` [B, N] and ``ancestors`` [N, N] give
        each node's uncommitted history (itself and its ancestors). Without a tree: committed history only."""
        batch, vocab = logits.shape[0], logits.shape[-1]
        counts = self.output_counts[:, None].expand(batch, logits.shape[1], vocab).clone()
        if tokens is not None:
            size = tokens.shape[1]
            path = ancestors[:size, :size][nodes].float()  # [k, N]
            index = tokens[:, None, :].expand(batch, path.shape[0], size)
            counts.scatter_add_(-1, index, path[None].expand(batch, -1, -1).contiguous())
        out = logits.float()
        if self.bias is not None:
            out = out + self.bias[:, None]
        repetition = self.repetition[:, None, None]
        seen = counts.gt(0) | self.prompt_seen[:, None]
        out = torch.where(seen, torch.where(out > 0, out / repetition, out * repetition), out)
        out = out - self.frequency[:, None, None] * counts - self.presence[:, None, None] * counts.gt(0)
        produced = counts.sum(-1)  # output tokens before each node's child
        banned = self.stop_ids[:, None] & (produced < self.min_tokens[:, None])[..., None]
        if self.banned is not None:
            banned = banned | self.banned[:, None]
        if self.word_last is not None:
            banned = banned | self._bad_word_bans(logits.shape, tokens, ancestors, nodes)
        return out.masked_fill(banned, -torch.inf)

    def _bad_word_bans(self, shape: torch.Size, tokens: torch.Tensor | None, ancestors: torch.Tensor | None,
                       nodes: slice) -> torch.Tensor:
        """[B, k, V] bool: the last token of each bad word whose other tokens end a node's history (the committed
        output, then its path in the tree: each node its own history, as for the counts)."""
        batch, width, vocab = shape
        prefix, length, last, tail = self.word_prefix, self.word_length, self.word_last, self.output_tail
        reach = prefix.shape[-1]
        back = torch.arange(reach, device=prefix.device)  # how far back from the newest token
        if tokens is None:
            window = tail[:, None].expand(batch, width, reach)
        else:
            # The node at depth d - j on each node's path is its j-th newest token; past its root, the output's.
            size = tokens.shape[1]
            tree = ancestors[:size, :size]
            depths = tree.sum(-1) - 1  # [N]: strict ancestors
            wanted = depths[nodes][:, None] - back[None]  # [k, L]
            pick = tree[nodes][:, None, :] & (depths[None, None, :] == wanted[..., None])  # [k, L, N]
            in_tree = pick.any(-1)
            node = pick.to(torch.int8).argmax(-1)  # [k, L]
            from_tree = tokens[:, node.flatten()].view(batch, width, reach)
            from_output = tail[:, (-wanted - 1).clamp(min=0, max=reach - 1).flatten()].view(batch, width, reach)
            window = torch.where(in_tree[None], from_tree, from_output)
        same = (window[:, None] == prefix[:, :, None]) | (back >= length[..., None])[:, :, None]  # [B, W, k, L]
        match = same.all(-1) & (length > 0)[..., None]  # [B, W, k]
        hits = torch.zeros(batch, width, vocab, device=prefix.device)
        hits.scatter_add_(-1, last[:, None, :].expand(batch, width, -1), match.transpose(1, 2).float())
        return hits > 0


def _optional(tensor: torch.Tensor | None, op: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    return None if tensor is None else op(tensor)


def _word_tables(words: Sequence[Sequence[Sequence[int]]], outputs: Sequence[Sequence[int]]
                 ) -> dict[str, torch.Tensor | None]:
    """``Penalties``' bad word tables from each row's words of two tokens or more and its committed output."""
    if not any(words):
        return {}
    batch = len(words)
    most = max(len(row) for row in words)
    reach = max(len(word) - 1 for row in words for word in row)
    prefix = torch.full((batch, most, reach), -1, dtype=torch.long)
    length = torch.zeros(batch, most, dtype=torch.long)
    last = torch.zeros(batch, most, dtype=torch.long)
    tail = torch.full((batch, reach), -1, dtype=torch.long)
    for row, (row_words, output) in enumerate(zip(words, outputs)):
        for index, word in enumerate(row_words):
            prefix[row, index, : len(word) - 1] = torch.tensor(list(word[-2::-1]))
            length[row, index], last[row, index] = len(word) - 1, word[-1]
        recent = list(output[-reach:])[::-1]
        tail[row, : len(recent)] = torch.tensor(recent, dtype=torch.long)
    return {"word_prefix": prefix, "word_length": length, "word_last": last, "output_tail": tail}


@dataclass(frozen=True)
class WarpParams:
    """Per-row sampling parameters as tensors, so a ragged batch warps in one call."""

    temperature: torch.Tensor  # [B] float; 0 = greedy
    top_k: torch.Tensor  # [B] long; 0 = off
    top_p: torch.Tensor  # [B] float; 1 = off
    penalties: Penalties | None = None  # None: no row has a penalty, a bias or a ban
    # What warping branches on, known on the host: read from device tensors, each would stall the step until the
    # GPU caught up (the CUDA run of test_a_step_reads_back_only_paths_tokens_and_statistics caught three such
    # reads a call). Computed here from host tensors; parameters on a device must be given them.
    max_top_k: int | None = None  # at least every row's top_k (0: no row has top-k)
    # The rows that may filter by top-p (at least those with top_p < 1): only they are sorted, a sort over the
    # vocabulary costing ~0.8 s for 64 rows of a 6-node tree here (2-core CPU, float32).
    nucleus_rows: tuple[int, ...] | None = None
    min_p: torch.Tensor | None = None  # [B] float; 0 = off; None: no row has min-p
    min_p_rows: tuple[int, ...] | None = None  # the rows that may filter by min-p (at least those with min_p > 0)

    def __post_init__(self) -> None:
        if self.min_p is None:
            object.__setattr__(self, "min_p_rows", ())
        if None not in (self.max_top_k, self.nucleus_rows, self.min_p_rows):
            return
        if self.top_k.device.type != "cpu":
            raise ValueError("WarpParams on a device need max_top_k, nucleus_rows and min_p_rows from the host")
        if self.max_top_k is None:
            object.__setattr__(self, "max_top_k", max(0, int(self.top_k.max())) if len(self.top_k) else 0)
        if self.nucleus_rows is None:
            object.__setattr__(self, "nucleus_rows", tuple((self.top_p < 1).nonzero().flatten().tolist()))
        if self.min_p_rows is None:
            object.__setattr__(self, "min_p_rows", tuple((self.min_p > 0).nonzero().flatten().tolist()))

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]] = (),
        outputs: Sequence[Sequence[int]] = (), eos_ids: Collection[int] = (), vocab: int = 0,
        bad_words: Sequence[Sequence[Sequence[int]]] = (),
    ) -> WarpParams:
        """``prompts``/``outputs`` (committed tokens per row), ``eos_ids``, ``vocab`` and ``bad_words`` (each row's
        token sequences) feed the penalties and bans."""
        penalties = Penalties.build(params, prompts, outputs, eos_ids, vocab, bad_words) if vocab else None
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            penalties=penalties,
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
        )

    @property
    def greedy(self) -> torch.Tensor:
        """[B] bool where this warp's tensors are: rows that sample greedily (``SamplingParams`` sets a tiny
        temperature to 0, so temperature 0 is exactly ``SamplingParams.greedy``)."""
        return self.temperature == 0

    def to(self, device: torch.device) -> WarpParams:
        """The same parameters on ``device`` (penalties included): logits are warped where the model ran."""
        return dataclasses.replace(
            self, temperature=self.temperature.to(device), top_k=self.top_k.to(device), top_p=self.top_p.to(device),
            penalties=self.penalties.to(device) if self.penalties is not None else None,
            min_p=_optional(self.min_p, lambda t: t.to(device)),
        )

    def __getitem__(self, rows: torch.Tensor | slice) -> WarpParams:
        """The warp of some rows, their penalties with them. ``rows``: a slice, or an index tensor on the host
        (moved to this warp's device without waiting). An index already on the device keeps the facts exact only
        where no row filters by top-p or min-p; else every row it picks counts as one that may."""
        if isinstance(rows, slice):
            picked: list[int] | None = list(range(len(self.temperature))[rows])
        elif rows.device.type == "cpu":
            picked = rows.tolist()
            rows = rows.to(self.temperature.device, non_blocking=True)
        else:
            picked = None

        def facts(some: tuple[int, ...] | None) -> tuple[int, ...]:
            if picked is None:
                return tuple(range(len(rows))) if some else ()
            chosen = set(some or ())
            return tuple(i for i, row in enumerate(picked) if row in chosen)

        return WarpParams(self.temperature[rows], self.top_k[rows], self.top_p[rows],
                          self.penalties[rows] if self.penalties is not None else None,
                          self.max_top_k, facts(self.nucleus_rows), _optional(self.min_p, lambda t: t[rows]),
                          facts(self.min_p_rows))

    def sampling_only(self, greedy: torch.Tensor) -> WarpParams:
        """These parameters with top-k, top-p and min-p off on the ``greedy`` rows ([B] bool where the tensors are):
        their laws are plain softmaxes (statistics at temperature 1, unwarped). The host facts stay upper bounds."""
        return dataclasses.replace(
            self, top_k=torch.where(greedy, 0, self.top_k), top_p=torch.where(greedy, 1.0, self.top_p),
            min_p=_optional(self.min_p, lambda t: torch.where(greedy, 0.0, t)), penalties=None,
        )

    def penalize(
        self, logits: torch.Tensor, tokens: torch.Tensor | None = None, ancestors: torch.Tensor | None = None,
        nodes: slice = slice(None),
    ) -> torch.Tensor:
        """``logits`` [B, V] or [B, k, V] with penalties, bias and bans applied (see ``Penalties.apply``)."""
        if self.penalties is None:
            return logits
        if logits.dim() == 2:
            return self.penalties.apply(logits[:, None])[:, 0]
        return self.penalties.apply(logits, tokens, ancestors, nodes)


def _on_rows(flat: torch.Tensor, rows: tuple[int, ...],
             rule: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
    """``flat`` [B, ...] with ``rule(sub, index)`` applied to its ``rows`` only: ``sub`` holds those rows, ``index``
    their indices on the device (None: every row, ``sub`` is ``flat``), for ``rule`` to pick their parameters."""
    every_row = len(rows) == flat.shape[0]
    index = None if every_row else torch.tensor(rows).to(flat.device, non_blocking=True)
    sub = rule(flat if index is None else flat.index_select(0, index), index)
    return sub if index is None else flat.index_copy(0, index, sub)


def _picked(values: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return values if index is None else values.index_select(0, index)


def _min_p(params: WarpParams) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    def rule(sub: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        # vLLM's: a token less likely than min_p times the most likely one is dropped (a row with no finite logit
        # compares nothing: it stays as it is).
        probs = sub.softmax(-1)
        floor = probs.amax(-1, keepdim=True) * _picked(params.min_p, index)[:, None, None]
        return sub.masked_fill(probs < floor, -torch.inf)
    return rule


def _top_p(params: WarpParams) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    def rule(sub: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        sorted_logits, order = torch.sort(sub, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing the threshold stays in); a row
        # with top_p 1 keeps everything, whatever the rounding of its cumulative sums.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        top_p = _picked(params.top_p, index)[:, None, None]
        drop_sorted = (mass_before >= top_p) & (top_p < 1)
        drop_sorted[..., 0] = False  # the most likely token stays, however small top_p (1e-46 is 0 in float32)
        return sub.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), -torch.inf)
    return rule


def warp_probs(logits: torch.Tensor, params: WarpParams) -> torch.Tensor:
    """Warped float32 probabilities for logits [B, ..., V] with per-row params, in vLLM's order: temperature,
    min-p, top-k, top-p. Greedy rows get temperature 1."""
    shape = logits.shape
    flat = logits.float().reshape(shape[0], -1, shape[-1])
    # Greedy rows (temperature 0, which SamplingParams makes of any temperature below GREEDY_TEMPERATURE) warp at 1;
    # no row divides by less than GREEDY_TEMPERATURE, so float32 logits stay finite.
    temperature = params.temperature.clamp(min=GREEDY_TEMPERATURE)
    temperature = torch.where(params.temperature > 0, temperature, torch.ones_like(temperature))
    flat = flat / temperature[:, None, None]
    # Which rows need a filter is known on the host (choosing them on the device would wait for it). Top-k runs
    # over every row when any needs it, each row masked by its own k, as vLLM's sampler does; min-p and top-p only
    # over the rows that may need them, each masked by its own value.
    if params.min_p_rows:
        flat = _on_rows(flat, params.min_p_rows, _min_p(params))
    if params.max_top_k:
        top_k = params.top_k.clamp(max=shape[-1])
        kth = torch.topk(flat, min(params.max_top_k, shape[-1]), dim=-1).values  # [B, N, kmax], descending
        index = (top_k.clamp(min=1, max=kth.shape[-1]) - 1)[:, None, None].expand(-1, flat.shape[1], 1)
        threshold = kth.gather(-1, index)
        threshold = torch.where((top_k > 0)[:, None, None], threshold, torch.full_like(threshold, -torch.inf))
        flat = flat.masked_fill(flat < threshold, -torch.inf)
    if params.nucleus_rows:
        flat = _on_rows(flat, params.nucleus_rows, _top_p(params))
    probs = flat.softmax(-1)
    # softmax makes a whole row NaN when no finite logit is left (every token banned) or one is not finite: such a
    # row becomes uniform, the same on both sides, so sampling never reads NaN and speculation stays lossless.
    empty = probs[..., :1].isnan()
    if not host_reads_free(probs.device) or bool(empty.any()):  # a device fills without reading the mask back
        probs = probs.masked_fill(empty, 1.0 / shape[-1])
    return probs.reshape(shape)


def argmax_logsumexp(logits: torch.Tensor, with_logsumexp: bool = True, execution: Execution | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(argmax, float32 log-sum-exp or None) over the last dimension of ``logits``; where ``execution`` runs the
    CPU kernels, one pass of the kernel per row (``specbatch::argmax_logsumexp``), the same answers as torch's."""
    if (execution is not None and execution.cpu_kernel and logits.device.type == "cpu"
            and logits.dtype == torch.float32 and logits.shape[-1] and kernel_loaded()):
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


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int,
                   read: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.cpu) -> list[dict]:
    """vLLM's ``logprobs`` entries: for each token, its log-probability under the model's raw law at the position
    before it (``logits`` [k, V], one row per token, on any device), its ``rank`` there (1 + the tokens more
    likely), and the ``top`` most likely tokens with theirs. Computed where ``logits`` are; ``read`` brings the
    [k, 2 + 2 top] result to the host in one copy (a step's ``HostReads``), never a vocabulary-wide tensor."""
    logprobs = logits.float().log_softmax(-1)
    ids = torch.tensor(list(tokens), dtype=torch.long).to(logits.device, non_blocking=True)[:, None]
    chosen = logprobs.gather(-1, ids)
    parts = [chosen.double(), ((logprobs > chosen).sum(-1, keepdim=True) + 1).double()]
    if top:
        best = logprobs.topk(top, dim=-1)
        parts += [best.values.double(), best.indices.double()]  # float64 holds every token id exactly
    host = read(torch.cat(parts, -1)).tolist()
    entries = []
    for token, row in zip(tokens, host):
        values, ids_ = row[2 : 2 + top], row[2 + top :]
        alternatives = [  # ranks from the top values alone: every token more likely than one of them is among them
            {"token_id": int(t), "logprob": v, "rank": 1 + sum(other > v for other in values[:i])}
            for i, (t, v) in enumerate(zip(ids_, values))
        ]
        entries.append({"token_id": token, "logprob": row[0], "rank": int(row[1]), "top_logprobs": alternatives})
    return entries
