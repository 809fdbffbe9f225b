"""Drafters propose candidate trees; verification lives elsewhere (``verification/verify_batched.py``, with
``acceptance.py`` its readable oracle), as in vLLM.

Interface (after transformers' candidate generators): ``rows_joined`` when sequences join, ``propose`` a tree
below the root-level tokens the engine supplies, ``observe`` the verified outcome, ``row_removed`` when a
sequence leaves (swap-remove, mirroring the target cache). What one step's proposal needs later (how many levels a
draft forward ran, its catch-up prefix) travels in the ``Draft`` it returns, never on the drafter.

A model draft runs its levels to the planned depth without reading anything back: which candidates go on is a
device mask, and the random numbers of every level are drawn before the first. Only on a CPU (where a read is free)
is a policy whose stop rule can end candidates early (a trained head) asked, level by level, whether any candidate
still drafts; on an accelerator every planned level runs.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from decoding.config import DRAFT_METHODS, Config
from decoding.drafting.feature_draft import load_draft
from decoding.drafting.layer_skip import LayerSkipSearch, kept_layers
from decoding.model.execution import host_reads_free
from decoding.model.forward import forward_tree
from decoding.model.kv_cache import CacheShape, PagedKVCache, Rows, joining_entries
from decoding.model.lean_forward import LeanCausalLM, lean_view, supports_lean_forward
from decoding.model.loading import (
    SELF_DRAFT,
    check_same_tokenizer,
    draft_vocab_subset,
    for_inference,
    load_tokenizer,
)
from decoding.model.padding import pad_rows
from decoding.model.quantize import quantized
from decoding.verification.sampling import WarpParams, row_uniforms, warp_probs
from decoding.verification.tree import TreeTopology, best_first_layout, chain_ancestors, with_prefix_chain
from decoding.verification.verify_batched import sample_from, sample_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from decoding.constraints.constrained import GrammarView
    from decoding.engine.batch import JoinedRows
    from decoding.engine.sequence import Sequence


class StopRule(Protocol):
    """A length policy's rule inside the draft loop (``LengthPolicy.keep``): which candidates keep their new
    token and which draft on, from draft-side signals on the device. ``cuts``: whether it can end a candidate
    before its planned depth (then the loop asks whether any candidate is left, to spare a forward)."""

    cuts: bool

    def keep(self, level: int, depths: torch.Tensor, token_probs: torch.Tensor, hidden: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class DraftInputs:
    contexts: list[list[int]]  # committed tokens of each row, root-level tokens excluded
    roots: torch.Tensor  # [B, root_width] root-level tokens, the pending token first (host or device: host_roots)
    root_valid: torch.Tensor  # [B, root_width], where ``roots`` is
    pending: torch.Tensor  # [B] host: each row's pending token (roots[:, 0])
    depths: torch.Tensor  # [B] planned depth (0 = no speculation)
    topology: TreeTopology
    warp: WarpParams  # on the drafter's device, with the penalties of each row's history
    greedy: torch.Tensor  # [B] bool on the host: rows that draw no random numbers
    generators: list[torch.Generator]
    replacement: bool
    stop: StopRule
    # [B] depth of the n-gram siblings of a model's tree (None: ``depths``): a row may draft with either alone.
    lookup_depths: torch.Tensor | None = None
    # Constrained rows (decoding.constraints.constrained): the tree's grammar masks, which the draft's laws get and
    # which cut what the grammar refuses, and per row the grammar's own draft for a lookup candidate ([] where none).
    grammar: GrammarView | None = None
    grammar_drafts: list[list[int]] | None = None

    @property
    def max_depth(self) -> int:
        """The deepest any row plans (0: no row drafts)."""
        return int(self.depths.max()) if len(self.depths) else 0

    def select(self, rows: torch.Tensor) -> DraftInputs:
        """These inputs for some rows (a host index tensor)."""
        row_ids = rows.tolist()
        return dataclasses.replace(
            self, contexts=[self.contexts[row] for row in row_ids], roots=self.roots[rows.to(self.roots.device)],
            root_valid=self.root_valid[rows.to(self.roots.device)], pending=self.pending[rows],
            depths=self.depths[rows], warp=self.warp[rows],
            greedy=self.greedy[rows], generators=[self.generators[row] for row in row_ids],
            lookup_depths=self.lookup_depths[rows] if self.lookup_depths is not None else None,
            grammar=self.grammar.select(rows) if self.grammar is not None else None,
            grammar_drafts=[self.grammar_drafts[row] for row in row_ids] if self.grammar_drafts is not None else None,
        )


@dataclass
class Draft:
    tokens: torch.Tensor  # [B, N] in topology order (on the drafter's device; a host drafter's on the host)
    valid: torch.Tensor  # [B, N], where ``tokens`` is
    token_probs: torch.Tensor  # [B, N] draft probability of each node's token (1 for root level)
    draft_probs: torch.Tensor | None  # [B, N, V] drafter's law at each node; None = deterministic proposals
    depth: int  # levels of the tree below the root level (its size: topology.size(depth))
    # [B, N] True where a node's token was proposed deterministically (an n-gram sibling in a model's tree): its
    # proposal law is one-hot, whatever ``draft_probs`` says at its parent. None: as ``draft_probs`` says.
    point_mass: torch.Tensor | None = None
    # For ``observe``: levels the draft model ran forwards on, the catch-up tokens fed before the tree, and the
    # (rows, tokens per row) of each draft forward (their costs, for the policy).
    forwarded_levels: int = 0
    prefix: int = 0
    forward_shapes: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    candidate: int = 0  # a layer-skipping draft's candidate layer set that drafted (``layer_skip.py``)

    @classmethod
    def roots_only(cls, inputs: DraftInputs, depth: int = 0) -> Draft:
        size = inputs.topology.size(depth)
        batch = inputs.roots.shape[0]
        tokens = inputs.roots.new_zeros(batch, size)
        valid = inputs.root_valid.new_zeros(batch, size)
        width = inputs.roots.shape[1]
        tokens[:, :width] = inputs.roots
        valid[:, :width] = inputs.root_valid
        return cls(tokens, valid, torch.ones(batch, size), None, depth)

    @classmethod
    def join(cls, batch: int, parts: list[tuple[torch.Tensor, Draft]]) -> Draft:
        """One draft of ``batch`` rows from drafts of some of them (each with its host row indices)."""
        depth = max(part.depth for _, part in parts)
        size = max(part.tokens.shape[1] for _, part in parts)
        laws = [part.draft_probs for _, part in parts if part.draft_probs is not None]
        marks = any(part.point_mass is not None for _, part in parts)
        some = parts[0][1]
        joined = cls(
            some.tokens.new_zeros(batch, size), some.valid.new_zeros(batch, size),
            some.token_probs.new_ones(batch, size),
            laws[0].new_zeros(batch, size, laws[0].shape[-1]) if laws else None, depth,
            some.valid.new_zeros(batch, size) if marks else None,
            forwarded_levels=max(part.forwarded_levels for _, part in parts),
            forward_shapes=[shape for _, part in parts for shape in part.forward_shapes], candidate=some.candidate,
        )
        device = joined.token_probs.device
        for rows, part in parts:
            width = part.tokens.shape[1]
            on = rows.to(device, non_blocking=True)
            joined.tokens[on, :width], joined.valid[on, :width] = part.tokens, part.valid
            joined.token_probs[on, :width] = part.token_probs.to(device, non_blocking=True)
            if joined.draft_probs is not None and part.draft_probs is not None:
                joined.draft_probs[on, :width] = part.draft_probs
            if joined.point_mass is not None and part.point_mass is not None:
                joined.point_mass[on, :width] = part.point_mass.to(device, non_blocking=True)
        return joined


@dataclass(frozen=True)
class DraftContext:
    """What a drafter builds itself from (``Drafter.from_config``): the config (its ``speculative`` block resolved),
    the device, the loaded target and tokenizer, a draft model given in memory, and the target's context limit."""

    config: Config
    device: torch.device
    target: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    draft: torch.nn.Module | None
    max_context: int


@dataclass(frozen=True)
class DraftPlan:
    """A drafter and the tree it drafts into, for the engine's build.

    Every level holds ``width`` nodes: ``model_candidates`` the drafter proposes, then ``lookup_candidates`` n-gram
    continuations; ``root_width`` of them at the root level. A static tree (``tree``: each node's parent, with its
    ``order``) replaces the chains below the pending token. ``sizes``: the cuts of the tree a row may draft (a
    static tree's halvings, the model's chains one by one). ``prefix_tokens``: tokens a draft catches up on before
    its tree (0 for a self-draft, which drafts in the target's cache). ``max_context``: the target's limit and the
    draft's."""

    drafter: Drafter
    root_width: int
    width: int
    model_candidates: int
    lookup_candidates: int
    sizes: list[int]
    max_context: int
    tree: tuple[int, ...] = ()
    order: tuple[int, ...] = ()
    prefix_tokens: int = 1

    @property
    def model_chains(self) -> int:
        """Chains of model nodes below the roots: none under a static tree (its nodes are the model's)."""
        return 0 if self.tree else self.model_candidates

    @classmethod
    def chains(cls, context: DraftContext, drafter: Drafter, *, model_drafts: bool, max_context: int | None = None,
               prefix_tokens: int = 1) -> DraftPlan:
        """The tree of ``num_candidates`` chains (and ``ngram_candidates`` lookup chains beside a model's), the
        model's if ``model_drafts`` (else lookups'), ``candidate_init: target`` putting them all at the root."""
        spec = context.config.speculative
        depth = spec.max_depth
        width = spec.num_candidates if depth else 1
        root_width = width if spec.candidate_init == "target" else 1
        lookups = (spec.ngram_candidates if model_drafts else width) if depth else 0
        return cls(
            drafter, root_width, width + (spec.ngram_candidates if depth else 0), width if model_drafts else 0,
            lookups, list(range(1, width + 1)) if model_drafts and depth else [width],
            context.max_context if max_context is None else max_context, prefix_tokens=prefix_tokens,
        )


# ``speculative.method`` -> the drafter class that builds itself from the config (``from_config``).
DRAFTERS: dict[str, type[Drafter]] = {}


def register_drafter(method: str):
    """Class decorator: ``method`` names the drafter in a config (``speculative.method``)."""
    def register(drafter: type[Drafter]) -> type[Drafter]:
        if DRAFTERS.get(method, drafter) is not drafter:
            raise ValueError(f"speculative.method '{method}' is registered already, to {DRAFTERS[method].__name__}")
        DRAFTERS[method] = drafter
        DRAFT_METHODS.add(method)
        return drafter
    return register


def draft_plan(context: DraftContext) -> DraftPlan:
    """The configured drafter and its tree (``speculative.method`` through the registry)."""
    return DRAFTERS[context.config.speculative.method].from_config(context)


@register_drafter("none")
class Drafter:
    """No drafting: plain autoregressive decoding through the same engine (method ``none``), and the interface every
    drafter implements. A new drafter subclasses it, builds itself in ``from_config`` and registers its method
    (``register_drafter``); the engine needs nothing else.

    ``reads_target_states``: the engine then hands ``rows_joined`` the target's final hidden state at every prompt
    position [B, T, H] and ``observe`` the one at every verified tree node [B, N, H].
    """

    uses_hidden_states = False
    reads_target_states = False
    reads_target_topk = 0  # k > 0: ``observe`` gets the top-k token ids of the target's logits at every node
    host_roots = False  # whether ``propose`` reads the root-level tokens on the host (else they stay on the device)
    takes_grammar_drafts = False  # whether ``propose`` puts DraftInputs.grammar_drafts in a lookup candidate
    target_cache: PagedKVCache | None = None  # a self-draft's: it drafts in the target's cache (no catch-up tokens)
    own_cache: PagedKVCache | None = None  # a pool of its own, where joining rows take blocks too
    graphs = False  # whether its model's forwards may replay CUDA graphs (``cuda_graphs.py``)
    search: LayerSkipSearch | None = None  # a layer-skipping self-draft's choice of layers (``layer_skip.py``)

    @classmethod
    def from_config(cls, context: DraftContext) -> DraftPlan:
        return DraftPlan.chains(context, cls(), model_drafts=False)

    @property
    def models(self) -> list[torch.nn.Module]:
        """Every forward this drafter may run, to prepare, price and capture at build."""
        return []

    def attach(self, target_cache: PagedKVCache) -> None:
        """The target's pool exists (made after ``from_config``, sized for the plan's tree)."""
        del target_cache

    # The batch tells the drafter when rows join and leave (``decoding.engine.batch.RowState``).
    def rows_joined(self, joined: JoinedRows) -> None:
        """Sequences joined the batch at ``joined.rows`` (their prefill ran: the target's states are there)."""
        del joined

    def row_removed(self, row: int, seq: Sequence) -> None:
        """``seq`` left ``row``; the last row takes its place."""
        del row, seq

    def propose(self, inputs: DraftInputs) -> Draft:
        return Draft.roots_only(inputs)

    def observe(self, paths: list[list[int]], path_tokens: list[list[int]], draft: Draft, topology: TreeTopology,
                target_states: torch.Tensor | None = None, target_topk: torch.Tensor | None = None) -> None:
        """The verified outcome: each row's accepted path (node indices, the pending token first) and its
        tokens; with ``reads_target_topk``, ``target_topk`` [B, N, k] on the device."""
        del paths, path_tokens, draft, topology, target_states, target_topk


class TokenHistory:
    """Each row's tokens (prompt, generated, the pending one last) on the device, for lookups there. Rows only grow
    while they run: each step appends what a row gained since the last (the whole prompt once), one small copy."""

    def __init__(self, device: torch.device) -> None:
        self.tokens = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.lengths: list[int] = []  # per row, the tokens on the device

    def rows_joined(self, joined: JoinedRows) -> None:
        self.lengths.extend(0 for _ in joined.seqs)

    def row_removed(self, row: int, seq: Sequence) -> None:
        last = len(self.lengths) - 1
        if row != last and last < self.tokens.shape[0]:  # (rows never looked up hold nothing)
            self.tokens[row] = self.tokens[last]
            self.lengths[row] = self.lengths[last]
        self.lengths.pop()

    def sync(self, contexts: SequenceABC[list[int]], pending: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's ``contexts[row]`` + its pending token on the device: ([B, longest] tokens, [B] lengths)."""
        rows = len(contexts)
        self.lengths += [0] * (rows - len(self.lengths))  # rows the batch never announced (a drafter used alone)
        # Only what a row gained is read (``Contexts.tail``): building whole contexts cost O(context) a row a step.
        tail = getattr(contexts, "tail", None) or (lambda row, start: (len(contexts[row]), contexts[row][start:]))
        added = []
        for row, token in enumerate(pending.tolist()):
            known = self.lengths[row]
            length, new = tail(row, known)
            if length + 1 < known:  # not this row's history any more: written anew
                known = self.lengths[row] = 0
                length, new = tail(row, 0)
            added.append(new + [token] if known <= length else [])
        lengths = [known + len(new) for known, new in zip(self.lengths, added)]
        longest = max(lengths, default=0)
        if self.tokens.shape[0] < rows or self.tokens.shape[1] < longest:  # grown by doubling
            grown = self.tokens.new_zeros(max(rows, self.tokens.shape[0]), max(64, 1 << (longest - 1).bit_length()))
            grown[: self.tokens.shape[0], : self.tokens.shape[1]] = self.tokens
            self.tokens = grown
        if any(added):
            ids, counts = pad_rows(added)
            columns = torch.tensor(self.lengths[:rows])[:, None] + torch.arange(ids.shape[1])[None]
            where = torch.arange(ids.shape[1])[None] < counts[:, None]
            device = self.tokens.device
            row_index = torch.arange(rows)[:, None].expand_as(columns)[where]
            self.tokens.index_put_((row_index.to(device), columns[where].to(device)), ids[where].to(device))
        self.lengths[:rows] = lengths
        return self.tokens[:rows, :longest], torch.tensor(lengths).to(self.tokens.device, non_blocking=True)


def lookup_continuations(history: torch.Tensor, lengths: torch.Tensor, depth: int, count: int, max_ngram: int,
                         min_ngram: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``NgramDrafter.continuations`` of every row at once, on the device with no read-back: ``count`` continuations
    [B, count, depth] and their valid flags, of each row's ``history[b, :lengths[b]]``.

    Each (n, start) where a row's last n tokens occurred before gets a priority: longer n first, then later starts.
    ``count`` times the best is taken and every other with the same first token dropped, which is the reference's
    order and its distinct first tokens."""
    batch, width = history.shape
    device = history.device
    priorities, firsts, begins = [], [], []
    for n in range(min(max_ngram, width - 1), min_ngram - 1, -1):
        span = width - n  # starts 0 .. width - n - 1; a continuation begins n after its start
        suffix = history.gather(1, (lengths[:, None] - n + torch.arange(n, device=device)).clamp(min=0))
        match = torch.ones(batch, span, dtype=torch.bool, device=device)
        for i in range(n):
            match &= history[:, i : i + span] == suffix[:, i : i + 1]
        start = torch.arange(span, device=device)
        match &= start[None] + n < lengths[:, None]  # an earlier occurrence, followed by a token of the row
        priorities.append(torch.where(match, n * width + start, -1))
        firsts.append(history[:, n : n + span])
        begins.append((start + n).expand(batch, span))
    tokens = history.new_zeros(batch, count, depth)
    if not priorities:
        return tokens, torch.zeros(batch, count, depth, dtype=torch.bool, device=device)
    priority, first, begin = torch.cat(priorities, 1), torch.cat(firsts, 1), torch.cat(begins, 1)
    starts, found = [], []
    for _ in range(count):
        best = priority.argmax(1, keepdim=True)
        found.append(priority.gather(1, best)[:, 0] >= 0)
        starts.append(begin.gather(1, best)[:, 0])
        priority = priority.masked_fill(first == first.gather(1, best), -1)
    positions = torch.stack(starts, 1)[:, :, None] + torch.arange(depth, device=device)  # [B, count, depth]
    valid = torch.stack(found, 1)[:, :, None] & (positions < lengths[:, None, None])
    tokens = history.gather(1, positions.clamp(max=width - 1).flatten(1)).view(batch, count, depth)
    return torch.where(valid, tokens, 0), valid


@register_drafter("ngram")
class NgramDrafter(Drafter):
    """Prompt lookup: continue the longest suffix that already occurred in prompt + output.

    Several earlier occurrences with different continuations become several candidates (most recent first).
    Proposals are deterministic, so verification treats their law as one-hot. With a ``device``, each row's tokens
    are kept there (``TokenHistory``) and looked up there (``lookup_continuations``), nothing read back; a
    constrained row's grammar draft and target-initialized roots are continued on the host (``continuations``,
    the readable reference the device lookup is tested against).
    """

    host_roots = True
    takes_grammar_drafts = True

    @classmethod
    def from_config(cls, context: DraftContext) -> DraftPlan:
        spec = context.config.speculative  # lookups on the device (beside a draft model, on the host)
        return DraftPlan.chains(context, cls(spec.prompt_lookup_max, spec.prompt_lookup_min, context.device),
                                model_drafts=False)

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, device: torch.device | None = None) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.history = TokenHistory(device) if device is not None else None

    def rows_joined(self, joined: JoinedRows) -> None:
        if self.history is not None:
            self.history.rows_joined(joined)

    def row_removed(self, row: int, seq: Sequence) -> None:
        if self.history is not None:
            self.history.row_removed(row, seq)

    def continuations(self, context: list[int], depth: int, width: int) -> list[list[int]]:
        tokens = np.asarray(context, dtype=np.int64)
        found: list[list[int]] = []
        firsts: set[int] = set()
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            for start in starts[::-1]:  # most recent occurrence first
                follow = tokens[start + n : start + n + depth].tolist()
                if follow and follow[0] not in firsts:
                    firsts.add(follow[0])
                    found.append(follow)
                    if len(found) == width:
                        return found
        return found

    def with_grammar_draft(self, context: list[int], chains: list[list[int]], draft: list[int], depth: int,
                           width: int) -> list[list[int]]:
        """``chains`` (continuations of ``context``) with a constrained row's grammar draft first, continued by
        lookup up to ``depth`` (the masks cut a continuation where it leaves the grammar); at most ``width``."""
        if not draft:
            return chains
        draft = draft[:depth]
        if len(draft) < depth:
            draft = draft + next(iter(self.continuations([*context, *draft], depth - len(draft), 1)), [])
        return [draft, *(chain for chain in chains if chain[0] != draft[0])][:width]

    def siblings(self, inputs: DraftInputs, count: int, offset: int, tokens: torch.Tensor, valid: torch.Tensor,
                 point_mass: torch.Tensor | None = None) -> int:
        """Write ``count`` lookup continuations of each row's pending token as the last candidates of every level of
        a tree ([B, >= offset + size] tensors, the tree from node ``offset``), to each row's lookup depth; returns
        the deepest written (on the device: the deepest planned). A constrained row's grammar draft goes first."""
        topology = inputs.topology
        depths = inputs.lookup_depths if inputs.lookup_depths is not None else inputs.depths
        first = topology.num_candidates - count
        host_rows = range(len(inputs.contexts))
        deepest = 0
        if self.history is not None and len(depths) and int(depths.max()) > 0:
            deepest = int(depths.max())
            history, lengths = self.history.sync(inputs.contexts, inputs.pending)
            chains, found = lookup_continuations(history, lengths, deepest, count, self.max_ngram, self.min_ngram)
            found &= (torch.arange(deepest) < depths[:, None]).to(found.device, non_blocking=True)[:, None]
            nodes = torch.tensor([[offset + topology.chain_node(level, candidate) for level in range(1, deepest + 1)]
                                  for candidate in range(first, first + count)], device=tokens.device)
            found = found.to(tokens.device)
            tokens[:, nodes] = torch.where(found, chains.to(tokens.device), tokens[:, nodes])
            valid[:, nodes] |= found
            if point_mass is not None:
                point_mass[:, nodes] |= found
            host_rows = [row for row, ahead in enumerate(inputs.grammar_drafts or []) if ahead]
        for row in host_rows:
            depth = int(depths[row])
            if depth == 0:
                continue
            pending = [*inputs.contexts[row], int(inputs.pending[row])]
            chains = self.continuations(pending, depth, count)
            if inputs.grammar_drafts is not None:
                chains = self.with_grammar_draft(pending, chains, inputs.grammar_drafts[row], depth, count)
            if self.history is not None:  # the device lookup's chains of this row give way
                valid[row, nodes] = False
                if point_mass is not None:
                    point_mass[row, nodes] = False
            placed = [(offset + topology.chain_node(level, candidate), token)
                      for candidate, chain in enumerate(chains, start=first) for level, token in enumerate(chain, 1)]
            if placed:
                index = torch.tensor([node for node, _ in placed], device=tokens.device)
                tokens[row, index] = torch.tensor([token for _, token in placed], device=tokens.device)
                valid[row, index] = True
                if point_mass is not None:
                    point_mass[row, index] = True
            deepest = max([deepest, *map(len, chains)])
        return deepest

    def propose(self, inputs: DraftInputs) -> Draft:
        topology, max_depth = inputs.topology, inputs.max_depth
        draft = Draft.roots_only(inputs, max_depth)
        if max_depth == 0:
            return draft
        if topology.root_width == 1:  # every candidate continues the pending token: the siblings of a lookup tree
            device = self.history.tokens.device if self.history is not None else draft.tokens.device
            draft = Draft(draft.tokens.to(device), draft.valid.to(device), draft.token_probs, None, max_depth)
            used = self.siblings(inputs, topology.num_candidates, 0, draft.tokens, draft.valid)
        else:
            used = self._per_root(inputs, draft)
        size = topology.size(used)
        return Draft(draft.tokens[:, :size], draft.valid[:, :size], draft.token_probs[:, :size], None, used)

    def _per_root(self, inputs: DraftInputs, draft: Draft) -> int:
        """Target-initialized roots: each root continued alone (context + root), on the host; the deepest written."""
        topology = inputs.topology
        used = 0
        for row, context in enumerate(inputs.contexts):
            depth = int(inputs.depths[row])
            if depth == 0:
                continue
            chains = [
                (self.continuations([*context, int(root)], depth, 1) or [[]])[0] if ok else []
                for root, ok in zip(inputs.roots[row].tolist(), inputs.root_valid[row].tolist())
            ]
            if inputs.grammar_drafts is not None and inputs.grammar_drafts[row]:  # the pending token's candidate
                pending = [*context, int(inputs.pending[row])]
                chains[0] = self.with_grammar_draft(pending, [], inputs.grammar_drafts[row], depth, 1)[0]
            for candidate, chain in enumerate(chains):
                for level, token in enumerate(chain, start=1):
                    node = topology.chain_node(level, candidate)
                    draft.tokens[row, node] = token
                    draft.valid[row, node] = True
                    used = max(used, level)
        return used


@register_drafter("recycle")
class RecycleDrafter(Drafter):
    """Token recycling (Luo et al. 2025): a ``[vocab, width]`` table of each token's likely next tokens, filled from
    the target's own verification logits and expanded into a static tree, with no draft model and no training.

    After every verification each verified node's token gets the top ``width`` tokens of the target's logits at
    that node (accepted or not: the target computed them anyway), so the table learns the text as it is decoded;
    one table serves every row. The tree is the topology's static tree (``best_first_tree``): a node of rank r
    proposes its parent token's r-th successor. A target-initialized tree has a chain per root instead, each
    continuing with first successors. Tokens never seen have no successors, and a branch ends there. The table,
    the tree and its update stay on the device: nothing is read back. Proposals are deterministic (one-hot laws),
    verified like lookups.

    ``lookup``: ``lookup_candidates`` n-gram continuations of the pending token join as the last candidates of every
    level, to the rows' lookup depths (a heterogeneous tree: recycling where text is new, lookup where it repeats).
    """

    @classmethod
    def from_config(cls, context: DraftContext) -> DraftPlan:
        config, spec, device = context.config, context.config.speculative, context.device
        lookup = NgramDrafter(spec.prompt_lookup_max, spec.prompt_lookup_min, device) if spec.ngram_candidates \
            else None
        drafter = cls(context.target.config.vocab_size, spec.num_candidates, device, lookup, spec.ngram_candidates)
        plan = DraftPlan.chains(context, drafter, model_drafts=True)
        depth = spec.max_depth
        if not depth or plan.root_width != 1:  # target-initialized roots: a chain per root
            return plan
        nodes = spec.tree_nodes or recycling_tree_nodes(device, config.batch_size, depth)
        tree, order = recycling_tree(plan.model_candidates, depth, nodes)  # a static tree under the pending token
        return dataclasses.replace(plan, tree=tree, order=order, width=spec.ngram_candidates,
                                   sizes=recycling_tree_sizes(len(tree), depth))

    def __init__(self, vocab_size: int, width: int, device: torch.device, lookup: NgramDrafter | None = None,
                 lookup_candidates: int = 0) -> None:
        self.reads_target_topk = width
        # One row past the vocabulary is a sink: writes of invalid nodes, and of a token's earlier nodes, land there
        # and no proposal reads it (draft tokens are vocabulary ids), so the table takes one static-shaped copy.
        self.table = torch.full((vocab_size + 1, width), -1, dtype=torch.long, device=device)
        self._last_writer = torch.empty(vocab_size + 1, dtype=torch.long, device=device)
        self.lookup = lookup if lookup_candidates else None
        self.lookup_candidates = lookup_candidates if self.lookup is not None else 0

    @property
    def takes_grammar_drafts(self) -> bool:  # type: ignore[override]
        return self.lookup is not None

    def rows_joined(self, joined: JoinedRows) -> None:
        if self.lookup is not None:
            self.lookup.rows_joined(joined)

    def row_removed(self, row: int, seq: Sequence) -> None:
        if self.lookup is not None:
            self.lookup.row_removed(row, seq)

    def propose(self, inputs: DraftInputs) -> Draft:
        topology = inputs.topology
        recycle_depth = inputs.max_depth
        lookup_depth = 0
        if self.lookup is not None and len(inputs.depths):
            lookup_depth = int((inputs.lookup_depths if inputs.lookup_depths is not None else inputs.depths).max())
        max_depth = max(recycle_depth, lookup_depth)
        draft = Draft.roots_only(inputs, max_depth)
        if max_depth == 0:
            return draft
        device = self.table.device
        tokens, valid = draft.tokens.to(device), draft.valid.to(device)
        if self.lookup is not None:  # the last candidates of every level; the recycled nodes below are the others
            lookup_depth = self.lookup.siblings(inputs, self.lookup_candidates, 0, tokens, valid)
        depths = inputs.depths.to(device)
        levels = _recycled_levels(topology, topology.num_candidates - self.lookup_candidates, device)
        for level, (nodes, parents, ranks) in enumerate(levels[:recycle_depth], start=1):
            proposed = self.table[tokens[:, parents], ranks]  # [B, n]: each parent token's rank-th successor
            alive = valid[:, parents] & (proposed >= 0) & (depths >= level)[:, None]
            tokens[:, nodes] = torch.where(alive, proposed, 0)
            valid[:, nodes] = alive
        depth = max(recycle_depth, lookup_depth)
        size = topology.size(depth)
        return Draft(tokens[:, :size], valid[:, :size], draft.token_probs[:, :size], None, depth)

    def observe(self, paths: list[list[int]], path_tokens: list[list[int]], draft: Draft, topology: TreeTopology,
                target_states: torch.Tensor | None = None, target_topk: torch.Tensor | None = None) -> None:
        if target_topk is None:
            return
        device = self.table.device
        sink = self.table.shape[0] - 1
        rows = torch.where(draft.valid.to(device), draft.tokens.to(device), sink).flatten()
        # A token at several nodes takes the last node's successors (row-major, as a sequential write would), found
        # with an order-independent max: no boolean-mask write (a device sync each step), no racing duplicates.
        order = torch.arange(rows.numel(), device=device)
        last = self._last_writer.fill_(-1).scatter_reduce_(0, rows, order, "amax")
        rows = torch.where(last[rows] == order, rows, sink)
        self.table.index_copy_(0, rows, target_topk.reshape(rows.numel(), -1))


# P(the target's next token is a token's rank-r successor in the table | its parent was accepted): the prior the
# static tree is shaped by. Measured greedy on SmolLM2-135M, chat and HumanEval, tables filled from empty: rank 0
# 0.25-0.46, rank 1 0.08-0.09, rank 2 0.05-0.06, rank 3 0.02-0.06, ranks 4-7 0.01-0.03; past rank 7 extrapolated.
RECYCLE_RANK_PRIOR = (0.38, 0.09, 0.05, 0.035, 0.025, 0.02, 0.016, 0.012, 0.01, 0.008, 0.007, 0.006, 0.005, 0.004,
                      0.003, 0.002)
# Tree tokens a step may verify over all its rows, on a CUDA device (bf16 GEMMs stay memory-bound up to a few
# hundred rows) and on a CPU (batch 1 on 2 cores, online policy: trees of 5 to 32 nodes all gave 1.04-1.07x of plain
# decoding on chat and 1.24-1.31x on code, the policy keeping larger ones shallow).
RECYCLE_STEP_TOKENS = {"cuda": 256, "cpu": 16}


def recycling_tree(width: int, depth: int, nodes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The static recycling tree (``TreeTopology.tree``) of ``nodes`` nodes, ``depth`` deep, a node having at most
    ``width`` children (the table's successors), and the order its nodes were taken (``tree_order``)."""
    return best_first_layout(RECYCLE_RANK_PRIOR[:width], depth, nodes)


def recycling_tree_sizes(nodes: int, depth: int) -> list[int]:
    """The sizes a row's recycling tree of ``nodes`` nodes can be cut to (``TreeTopology.nested_trees``): halvings
    down to a chain ``depth`` deep's worth of nodes, so the policy can trade acceptance for verification cost."""
    sizes = [nodes]
    while sizes[-1] // 2 >= max(depth, 2):
        sizes.append(sizes[-1] // 2)
    return sizes[::-1]


def recycling_tree_nodes(device: torch.device, rows: int, depth: int) -> int:
    """A recycling tree's nodes per row for ``rows`` rows on ``device``: the step's token budget shared by its
    rows, and at least a chain ``depth`` deep."""
    return max(depth, RECYCLE_STEP_TOKENS.get(device.type, RECYCLE_STEP_TOKENS["cuda"]) // max(rows, 1))


@cache
def _recycled_levels(topology: TreeTopology, chains: int, device: torch.device
                     ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per level: the nodes a recycling drafter fills (the static tree's, then the first ``chains`` chains), their
    parents and the rank of the parent token's successor each proposes, as index tensors on ``device``."""
    parents, depths = topology.parents, topology.depths.tolist()
    levels = []
    for level in range(1, topology.max_depth + 1):
        nodes = [n for n in topology.tree_nodes if depths[n] == level]
        ranks = [rank for n, rank in zip(topology.tree_nodes, topology.tree_ranks) if depths[n] == level]
        for candidate in range(chains):  # chain c: its root's c-th successor (or root c's first), then first ones
            nodes.append(topology.chain_node(level, candidate))
            ranks.append(candidate if level == 1 and topology.root_width == 1 else 0)
        levels.append(tuple(torch.tensor(values, dtype=torch.long, device=device)
                            for values in (nodes, [parents[n] for n in nodes], ranks)))
    return levels


_reduced_heads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _with_reduced_head(model: torch.nn.Module, subset: tuple[int, ...]) -> torch.nn.Module:
    """``model`` whose LM head has only the rows of ``subset``: the head dominates a tiny draft's cost.

    The cut head goes on a shallow copy whose module table is its own, so the caller's model stays whole. One
    view per (model, subset): engines sharing a draft share its view, its prepacked weights and measured costs.
    """
    views = _reduced_heads.setdefault(model, {})
    if subset not in views:
        full_head = model.get_output_embeddings()
        head = torch.nn.Linear(full_head.in_features, len(subset), bias=False)
        rows = torch.tensor(subset, dtype=torch.long, device=full_head.weight.device)
        head.weight = torch.nn.Parameter(full_head.weight.detach()[rows])
        view = copy.copy(model)
        view._modules = dict(model._modules)
        view.set_output_embeddings(head)
        views[subset] = view
    return views[subset]


# A self-draft forwards only the rows that draft while they are at most this share of the batch; more, and it
# forwards them all (the rows not drafting then ride along as padding queries of one node).
SOME_ROWS_MAX_SHARE = 0.5


def model_view(model: torch.nn.Module) -> torch.nn.Module:
    """The forward the engine runs a model through: the lean forward for the Llama family, else transformers'
    (with prepacked CPU weights and grouped-query SDPA)."""
    if isinstance(model, LeanCausalLM):
        return model
    return lean_view(model) if supports_lean_forward(model) else for_inference(model)


@register_drafter("draft_model")
class DraftModelDrafter(Drafter):
    """A small draft sharing the target's tokenizer, with its own paged cache kept on the accepted path.

    Tokens committed while the draft did not run on them (the last accepted leaf, steps at depth 0) wait in
    ``uncached`` and are fed as a causal prefix of the next draft tree, so no extra forward is spent on them.

    A feature draft (``FeatureDraft``) reads with each token the state before it: root-level nodes the target's
    state at the last committed position, deeper nodes the draft's own state at their parent. Only entries built
    from the target's states stay in its cache; accepted nodes below the root level wait in ``uncached`` with the
    target's states that verification computed for them, and are fed again as the next tree's prefix.
    """

    @classmethod
    def from_config(cls, context: DraftContext) -> DraftPlan:
        """The draft: the target itself (``model: target``, quantized and layer-skipping as configured), a draft
        given in memory, or one loaded from ``speculative.model`` (a causal LM or a feature draft)."""
        config, spec, loaded, draft = context.config, context.config.speculative, context.target, context.draft
        if spec.model == SELF_DRAFT:
            draft = loaded
        elif draft is None:
            check_same_tokenizer(context.tokenizer, load_tokenizer(spec.model, config.trust_remote_code), spec.model)
            draft = load_draft(spec.model, config.dtype, context.device, config.trust_remote_code)
        elif draft.config.vocab_size != loaded.config.vocab_size:
            raise ValueError(
                f"draft vocab size {draft.config.vocab_size} differs from the target's "
                f"{loaded.config.vocab_size}: the draft must share the target's tokenizer"
            )
        max_context = min(context.max_context, int(getattr(draft.config, "max_position_embeddings", 1 << 30)))
        subset = draft_vocab_subset(spec.model) if spec.model and spec.model != SELF_DRAFT else None
        draft = draft.to(context.device).eval()
        if spec.quantization:
            draft = quantized(draft, spec.quantization)
        search = None
        if spec.layer_skip is not None:
            view = model_view(draft)
            if not isinstance(view, LeanCausalLM):
                raise ValueError(f"speculative.layer_skip needs a target of the Llama family (the engine's lean "
                                 f"forward); model type '{loaded.config.model_type}' runs transformers' forward")
            if spec.layer_skip == "auto":
                search = LayerSkipSearch(view)
            else:
                draft = view.with_layers(kept_layers(view.num_layers, spec.layer_skip))
        lookup = NgramDrafter(spec.prompt_lookup_max, spec.prompt_lookup_min) if spec.ngram_candidates else None
        drafter = cls(draft, config.batch_size, context.device, subset, lookup, spec.ngram_candidates,
                      shares_target_cache=spec.model == SELF_DRAFT, search=search)
        return DraftPlan.chains(context, drafter, model_drafts=True, max_context=max_context,
                                prefix_tokens=0 if spec.model == SELF_DRAFT else 1)  # a self-draft never catches up

    def __init__(
        self, model: torch.nn.Module, capacity: int, device: torch.device, vocab_subset: list[int] | None = None,
        lookup: NgramDrafter | None = None, lookup_candidates: int = 0, shares_target_cache: bool = False,
        search: LayerSkipSearch | None = None,
    ) -> None:
        self.device = device
        # A self-draft (``shares_target_cache``) drafts in the target's own cache: the committed entries are what its
        # forward would compute with unquantized weights, its tree's entries are tentative positions the verify
        # forward overwrites, and nothing is committed but the target's. No prefill, no catch-up of tokens
        # committed while it did not draft, no second cache.
        self.shares_target_cache = shares_target_cache
        # Draft levels replay CUDA graphs where verifications do (``attach``), for a self-draft only: its levels
        # have fixed shapes (no catch-up prefix), captured at build beside the target's.
        self.graphs = False
        self.vocab_size = model.config.vocab_size
        self.reads_target_states = bool(getattr(model, "reads_features", False))
        # Heterogeneous tree: the last ``lookup_candidates`` candidates of every level are n-gram continuations.
        self.lookup = lookup if lookup_candidates else None
        self.lookup_candidates = lookup_candidates
        if self.lookup is not None and self.reads_target_states:
            raise ValueError("speculative.ngram_candidates is not supported with a feature draft (its deeper "
                             "levels read the draft's own states, which lookup nodes do not have)")
        self.vocab_subset = None
        if vocab_subset is not None:
            self.vocab_subset = torch.tensor(vocab_subset, dtype=torch.long)
            if not self.reads_target_states:  # a feature draft's head is stored cut
                model = _with_reduced_head(model, tuple(vocab_subset))
        self.model = model if self.reads_target_states else model_view(model)
        # ``layer_skip: auto``: which of the candidate layer sets drafts is chosen on the fly; ``model`` is it.
        self.search = search
        if search is not None:
            self.model = search.model
        self.capacity = capacity
        self.cache: PagedKVCache | None = None  # ``attach``
        self.uncached: list[list[int]] = []
        self.uncached_states: list[list[torch.Tensor]] = []  # feature draft: the target's state before each
        self.root_states = (  # feature draft: the target's state at each row's last committed position
            torch.zeros(capacity, model.feature_size, device=device) if self.reads_target_states else None
        )
        self.uses_hidden_states = False

    @property
    def takes_grammar_drafts(self) -> bool:  # type: ignore[override]
        return self.lookup is not None

    def attach(self, target_cache: PagedKVCache) -> None:
        """The target's cache is there: a self-draft drafts in it; another draft gets a cache of its own with as
        many positions as the target's pool (it never holds more of a row than the target does), caching prefixes
        where the target's does."""
        if self.shares_target_cache:
            self.target_cache = self.cache = target_cache
            self.graphs = target_cache.execution.graphs
        else:
            config = self.model.config
            self.cache = PagedKVCache(
                CacheShape.of(config), target_cache.num_blocks, target_cache.max_rows,
                target_cache.max_blocks_per_row * target_cache.block_size, block_size=target_cache.block_size,
                dtype=next(self.model.parameters()).dtype, device=self.device, execution=target_cache.execution,
                prefix_caching=target_cache.prefix_caching, salt=f"draft|{getattr(config, '_name_or_path', '')}",
            )
            self.own_cache = self.cache

    def rows_joined(self, joined: JoinedRows) -> None:
        rows, positions, target_states = joined.rows, joined.positions, joined.target_states
        prompts = [seq.prompt_ids for seq in joined.seqs]
        self.uncached.extend([] for _ in prompts)
        self.uncached_states.extend([] for _ in prompts)
        if self.target_cache is not None:  # the target's prefill filled the cache both read
            return
        added = self.cache.add_rows(joining_entries(self.cache, [seq.claims for seq in joined.seqs], positions))
        assert added == rows, "draft cache rows must mirror the target cache"
        cached = self.cache.host_lengths[rows]  # prompt positions each row took from the prefix cache
        prompts = [prompt[skip:] for prompt, skip in zip(prompts, cached)]
        states = None
        if self.reads_target_states:
            # Input t is token t + 1 with the target's state at t; the last state goes with the pending token.
            last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
            self.root_states[rows] = target_states[torch.arange(len(prompts), device=self.device), last]
            states, prompts = target_states, [p[1:] for p in prompts]
        ids, lengths = pad_rows(prompts)
        width = ids.shape[1]
        if width:
            valid = torch.arange(width)[None] < lengths[:, None]
            forward_tree(self.model, self.cache, rows, ids.to(self.device), chain_ancestors(width), valid,
                         logits_at=torch.tensor([width - 1]),
                         features=states[:, :width] if states is not None else None)
            self.cache.advance(rows, lengths.tolist())
        self.cache.register(rows)

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.vocab_subset is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), -torch.inf)
        full[..., self.vocab_subset.to(logits.device, non_blocking=True)] = logits
        return full

    def row_removed(self, row: int, seq: Sequence) -> None:
        del seq
        last = len(self.uncached) - 1
        if self.root_states is not None:
            self.root_states[row] = self.root_states[last]
        if self.target_cache is None:  # a shared cache has moved its rows already
            self.cache.remove_row(row)
        for waiting in (self.uncached, self.uncached_states):
            waiting[row] = waiting[-1]
            waiting.pop()

    @staticmethod
    def _uniforms(inputs: DraftInputs, width: int, levels: int) -> torch.Tensor | None:
        """[B, levels, width] uniforms on the device: each sampled row draws ``width`` per level it drafts (its
        planned depth), in level order, from its own generator, whatever the others do: a row's random stream
        must not depend on how deep others draft. None when no row samples."""
        depths = inputs.depths.tolist()
        sampled = [row for row, greedy in enumerate(inputs.greedy.tolist()) if not greedy and depths[row] > 0]
        if not sampled:
            return None
        uniforms = torch.zeros(len(depths), levels, width)
        for row in sampled:
            drawn = min(depths[row], levels)
            uniforms[row, :drawn] = row_uniforms([inputs.generators[row]], [0], width * drawn).view(drawn, width)
        return uniforms.to(inputs.warp.temperature.device, non_blocking=True)

    @staticmethod
    def _sample_level(inputs: DraftInputs, probs: torch.Tensor, width: int, uniforms: torch.Tensor | None,
                      sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One child per candidate below nodes with laws ``probs`` [B, w, V]; w == 1 means ``width`` children
        branch here. Greedy rows take the best tokens; ``sampled`` rows (device mask) invert their laws' CDFs at
        this level's ``uniforms`` [B, width]."""
        branching = probs.shape[1] == 1
        laws = probs.expand(-1, width, -1) if branching else probs
        tokens = laws[:, 0].topk(width).indices if branching else laws.argmax(-1)
        if uniforms is not None:
            if branching:
                drawn = sample_tokens(laws[:, 0], uniforms, inputs.replacement)
            else:
                drawn = sample_from(laws.reshape(-1, laws.shape[-1]), uniforms.reshape(-1)).view(laws.shape[:2])
            tokens = torch.where(sampled[:, None], drawn, tokens)
        return tokens, laws.gather(-1, tokens[..., None]).squeeze(-1)

    def propose(self, inputs: DraftInputs) -> Draft:
        drafting = inputs.depths > 0
        count = int(drafting.sum())
        if self.target_cache is None or count == 0 or count > SOME_ROWS_MAX_SHARE * len(drafting):
            return self._propose(inputs, slice(0, len(drafting)))
        # Few rows drafting: a self-draft forwards them alone, the others would pay a draft forward over their whole
        # context for nothing. A draft with a cache of its own runs every row, to keep its cache in step.
        some, rest = drafting.nonzero().flatten(), (~drafting).nonzero().flatten()
        return Draft.join(len(drafting), [(some, self._propose(inputs.select(some), some)),
                                          (rest, self._propose(inputs.select(rest), rest))])

    def _propose(self, inputs: DraftInputs, rows: Rows) -> Draft:
        """The tree of ``inputs``' rows, which are the cache's ``rows``."""
        topology = inputs.topology
        batch = inputs.roots.shape[0]
        model_depth = int(inputs.depths.max()) if batch else 0
        lookup_depth = 0
        if self.lookup is not None and batch:
            lookup_depth = int((inputs.lookup_depths if inputs.lookup_depths is not None else inputs.depths).max())
        if max(model_depth, lookup_depth) == 0:
            return Draft.roots_only(inputs)
        row_ids = range(rows.start, rows.stop) if isinstance(rows, slice) else rows.tolist()
        uncached = [self.uncached[row] for row in row_ids]
        prefix = max(len(u) for u in uncached)
        ancestors = with_prefix_chain(topology.sliced_ancestors(max(model_depth, lookup_depth)), prefix)
        total = ancestors.shape[0]
        # The tree's ids and flags start on the host (catch-up prefix, root-level tokens, lookup siblings) and go
        # to the device once; the levels, their laws and their sampling stay there.
        tokens = torch.zeros(batch, total, dtype=torch.long)
        valid = torch.zeros(batch, total, dtype=torch.bool)
        tokens[:, :prefix], waiting = pad_rows(uncached, prefix)
        valid[:, :prefix] = torch.arange(prefix)[None] < waiting[:, None]
        width = topology.root_width
        point_mass = None
        depth = 0
        if self.lookup is not None:
            # Filled before the model drafts, so each draft forward also runs the lookup nodes of its level: the
            # draft cache then holds every node a path can take, whichever candidate wins.
            point_mass = torch.zeros(batch, total, dtype=torch.bool)
            depth = self.lookup.siblings(inputs, self.lookup_candidates, prefix, tokens, valid, point_mass)
        device = self.device
        states = None  # feature draft: the state each node reads
        if self.root_states is not None:
            states = self.root_states.new_zeros(batch, total, self.root_states.shape[1])
            for row, waiting_states in enumerate(self.uncached_states[row] for row in row_ids):
                if waiting_states:
                    states[row, : len(waiting_states)] = torch.stack(waiting_states)
            states[:, prefix : prefix + width] = self.root_states[list(row_ids), None]
        tokens, valid = tokens.to(device, non_blocking=True), valid.to(device, non_blocking=True)
        tokens[:, prefix : prefix + width] = inputs.roots.to(device, non_blocking=True)
        valid[:, prefix : prefix + width] = inputs.root_valid.to(device, non_blocking=True)
        tree_ancestors = topology.ancestors.to(device) if inputs.warp.penalties is not None else None
        depths_on = inputs.depths.to(device, non_blocking=True)
        token_probs = torch.ones(batch, total, device=device)
        laws = torch.zeros(batch, total, self.vocab_size, device=device) if not bool(inputs.greedy.all()) else None
        model_width = topology.num_candidates - self.lookup_candidates
        uniforms = self._uniforms(inputs, model_width, model_depth)
        sampled = (~inputs.greedy).to(device, non_blocking=True)
        shapes: list[tuple[int, int]] = []
        forwarded = 0
        reads_free = host_reads_free(device)  # on an accelerator every level runs: no read to stop early
        start, end = 0, prefix + width
        extend = valid[:, prefix:end]  # the nodes drafted below
        for level in range(1, model_depth + 1):
            shapes.append((batch, end - start))
            logits, hidden = forward_tree(
                self.model, self.cache, rows, tokens[:, start:end], ancestors, valid, start,
                logits_at=torch.arange(max(start, prefix), end) - start,
                want_hidden=self.uses_hidden_states or states is not None,
                features=states[:, start:end] if states is not None else None, graphs=self.graphs,
            )
            forwarded = level
            parents = slice(max(start, prefix), end)
            parent_nodes = slice(parents.start - prefix, parents.stop - prefix)
            scores = inputs.warp.penalize(  # each node with its own history, as the target's verification does
                self._full_vocab(logits.float()), tokens[:, prefix:], tree_ancestors, parent_nodes,
            )
            if inputs.grammar is not None:  # the masks the target's laws get at the same nodes
                scores = inputs.grammar.mask(scores, parent_nodes, may_empty=self.vocab_subset is not None)
            probs = warp_probs(scores, inputs.warp)  # [B, w_parent, V]
            if laws is not None:
                laws[:, parents] = probs
            # The model's candidates come first in every level; the lookup siblings after them have their tokens.
            probs = probs[:, :model_width]
            hidden = hidden[:, :model_width] if hidden is not None else None
            level_uniforms = uniforms[:, level - 1] if uniforms is not None else None
            children, child_probs = self._sample_level(inputs, probs, model_width, level_uniforms, sampled)
            if extend.shape[1] == 1:
                extend = extend.expand(-1, model_width)
                hidden = hidden.expand(-1, model_width, -1) if hidden is not None else None
            keep, deeper = inputs.stop.keep(level, depths_on, child_probs,
                                            hidden.float() if self.uses_hidden_states else None)
            keep = extend[:, :model_width] & keep
            extend = keep & deeper
            if inputs.stop.cuts and reads_free and not bool(keep.any()):  # a trained stop rule ended every candidate
                break
            level_nodes = topology.level_slice(level)
            start, end = prefix + level_nodes.start, prefix + level_nodes.stop
            model_nodes = slice(start, start + model_width)
            tokens[:, model_nodes] = torch.where(keep, children, 0)
            valid[:, model_nodes] = keep
            token_probs[:, model_nodes] = child_probs
            if states is not None:
                states[:, model_nodes] = hidden
            if inputs.grammar is not None:  # cut what the grammar refuses; nothing grows below a token that ends it
                cut, closed = inputs.grammar.walk(level_nodes, tokens[:, start:end], valid[:, start:end])
                valid[:, start:end] &= ~cut
                extend = extend & ~closed[:, :model_width]
            depth = max(depth, level)
            if inputs.stop.cuts and reads_free and not bool(extend.any()):
                break
        size = prefix + topology.size(depth)
        return Draft(
            tokens[:, prefix:size], valid[:, prefix:size], token_probs[:, prefix:size],
            laws[:, prefix:size] if laws is not None else None, depth,
            point_mass[:, prefix:size].to(device, non_blocking=True) if point_mass is not None else None,
            forwarded_levels=forwarded, prefix=prefix, forward_shapes=shapes,
            candidate=self.search.current if self.search is not None else 0,
        )

    @property
    def models(self) -> list[torch.nn.Module]:
        """Every forward this drafter may run (a layer-skip search's candidates), to prepare and capture at build."""
        return self.search.views if self.search is not None else [self.model]

    def observe(self, paths: list[list[int]], path_tokens: list[list[int]], draft: Draft, topology: TreeTopology,
                target_states: torch.Tensor | None = None, target_topk: torch.Tensor | None = None) -> None:
        """Keep the accepted path's final entries in the draft cache; the rest of the path waits for next time.

        Final: what the draft ran on with the inputs it will always have; for a token draft every level it ran,
        for a feature draft only the root level (deeper levels read its own states, not the target's).
        """
        if self.search is not None and draft.forwarded_levels:
            self.search.observe(draft.candidate, len(paths), draft.tokens.shape[1], draft.forward_shapes,
                                sum(len(path) for path in paths))
            self.model = self.search.model
        if self.target_cache is not None:  # the target has committed this step in the cache both read
            return
        ran = draft.forwarded_levels > 0
        final_nodes = 0
        if ran:
            final_nodes = (topology.root_width if self.root_states is not None
                           else topology.size(draft.forwarded_levels - 1))
        keeps = []
        for row, path in enumerate(paths):
            if ran:
                keeps.append(list(range(len(self.uncached[row]))) + [draft.prefix + n for n in path if n < final_nodes])
                self.uncached[row], self.uncached_states[row] = [], []
            waiting = [i for i, node in enumerate(path) if node >= final_nodes]
            self.uncached[row] += [path_tokens[row][i] for i in waiting]
            if self.root_states is not None:
                before = [self.root_states[row].clone(), *target_states[row, path[:-1]]]  # the state before each node
                self.uncached_states[row] += [before[i] for i in waiting]
                self.root_states[row] = target_states[row, path[-1]]
        if not ran:
            return
        keep, counts = pad_rows(keeps)
        self.cache.commit(slice(0, len(paths)), keep, counts)
