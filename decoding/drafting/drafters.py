"""The drafter interface: what the engine asks of every drafter, and the registry that builds one from the config.

Interface (after transformers' candidate generators): ``rows_joined`` when sequences join, ``propose`` a tree
below the root-level tokens the engine supplies, ``observe`` the verified outcome, ``row_removed`` when a
sequence leaves (swap-remove, mirroring the target cache). What one step's proposal needs later (how many levels a
draft forward ran, its catch-up prefix) travels in the ``Draft`` it returns, and what a drafter keeps of a row on
the host lives on the row's sequence (``RowDraftState``), never on the drafter. Verification
lives elsewhere (``verification/verify_batched.py``, with ``acceptance.py`` its readable oracle), as in vLLM.

Each drafter is a class in a file of its own (``lookup.py``, ``recycle.py``, ``draft_model.py``) that builds itself
from the config (``from_config``) and registers its ``speculative.method`` (``register_drafter``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from decoding.config import DRAFT_METHODS, Config
from decoding.model.kv_cache import PagedKVCache
from decoding.verification.sampling import WarpParams
from decoding.verification.tree import TreeTopology

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from decoding.constraints.constrained import GrammarView
    from decoding.drafting.layer_skip import LayerSkipSearch
    from decoding.engine.batch import JoinedRows
    from decoding.engine.sequence import Sequence
    from decoding.model.model_runner import ModelRunner


class StopRule(Protocol):
    """A length policy's rule inside the draft loop (``LengthPolicy.keep``): which candidates keep their new
    token and which draft on, from draft-side signals on the device. ``cuts``: whether it can end a candidate
    before its planned depth (then the loop asks whether any candidate is left, to spare a forward)."""

    cuts: bool
    needs_hidden_states: bool  # ``keep`` reads the draft's hidden state at each new node

    def keep(self, level: int, depths: torch.Tensor, token_probs: torch.Tensor, hidden: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class RowDraftState:
    """What drafters keep of one sequence on the host. It lives on the sequence (``Sequence.draft_state``), so it
    joins and leaves the batch with its row; a drafter resets its part in ``rows_joined`` and reads each row's in
    ``DraftInputs.rows`` and ``observe``."""

    uncached: list[int] = field(default_factory=list)  # a draft model's accepted tokens its cache does not hold yet
    # A feature draft: the target's state before each of ``uncached`` (on the device).
    uncached_states: list[torch.Tensor] = field(default_factory=list)
    history_length: int = 0  # the row's tokens in a device lookup's history (``TokenHistory``)


@dataclass
class DraftInputs:
    contexts: list[list[int]]  # committed tokens of each row, root-level tokens excluded
    roots: torch.Tensor  # [B, root_width] root-level tokens, the pending token first (host: capabilities.host_roots)
    root_valid: torch.Tensor  # [B, root_width], where ``roots`` is
    pending: torch.Tensor  # [B] host: each row's pending token (roots[:, 0])
    depths: torch.Tensor  # [B] planned depth (0 = no speculation)
    topology: TreeTopology
    warp: WarpParams  # on the drafter's device, with the penalties of each row's history
    greedy: torch.Tensor  # [B] bool on the host: rows that draw no random numbers
    generators: list[torch.Generator]
    replacement: bool
    stop: StopRule
    rows: list[RowDraftState]  # each row's drafter state (its sequence's)
    # [B] depth of the n-gram siblings of a model's tree (None: ``depths``): a row may draft with either alone.
    lookup_depths: torch.Tensor | None = None
    # Constrained rows (decoding.constraints.constrained): the tree's grammar masks, which the draft's laws get and
    # which cut what the grammar refuses, and per row the grammar's own draft for a lookup candidate ([] where none).
    grammar: GrammarView | None = None
    grammar_drafts: list[list[int]] | None = None
    # [B] bool on the host: sampled rows that must reproduce (their own seed, or the run's). Their drafts may depend
    # on their own row alone, never on state other rows fill (a recycling table): the tokens a seeded row samples
    # depend on what it was offered. None: no such row.
    reproducible: torch.Tensor | None = None

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
            rows=[self.rows[row] for row in row_ids],
            lookup_depths=self.lookup_depths[rows] if self.lookup_depths is not None else None,
            grammar=self.grammar.select(rows) if self.grammar is not None else None,
            grammar_drafts=[self.grammar_drafts[row] for row in row_ids] if self.grammar_drafts is not None else None,
            reproducible=self.reproducible[rows] if self.reproducible is not None else None,
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
class Capabilities:
    """What a drafter asks of the engine, declared once on its class (or in ``__init__``, where it depends on the
    configuration); the engine reads nothing else about a drafter.

    ``target_states``: ``rows_joined`` gets the target's final hidden state at every prompt position [B, T, H] and
    ``observe`` the one at every verified tree node [B, N, H] (prefix caching is then off: a cached prefix has no
    states). ``target_topk``: k > 0, ``observe`` gets the top-k token ids of the target's logits at every node.
    ``host_roots``: ``propose`` reads the root-level tokens on the host (else they stay on the device).
    ``grammar_drafts``: ``propose`` puts ``DraftInputs.grammar_drafts`` in a lookup candidate."""

    target_states: bool = False
    target_topk: int = 0
    host_roots: bool = False
    grammar_drafts: bool = False


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

    What it needs from the engine is its ``capabilities``.
    """

    capabilities = Capabilities()
    target_cache: PagedKVCache | None = None  # a self-draft's: it drafts in the target's cache (no catch-up tokens)
    own_cache: PagedKVCache | None = None  # a pool of its own, where joining rows take blocks too
    captured = False  # its models' step shapes are captured at build (a self-draft's levels: ``ModelRunner``)
    search: LayerSkipSearch | None = None  # a layer-skipping self-draft's choice of layers (``layer_skip.py``)

    @classmethod
    def from_config(cls, context: DraftContext) -> DraftPlan:
        return DraftPlan.chains(context, cls(), model_drafts=False)

    @property
    def models(self) -> list[torch.nn.Module]:
        """Every forward this drafter may run, to prepare, price and capture at build."""
        return []

    @property
    def runners(self) -> list[ModelRunner]:
        """The runners of ``models`` once attached (whose captured step shapes the build captures)."""
        return []

    def attach(self, target_cache: PagedKVCache) -> None:
        """The target's pool exists (made after ``from_config``, sized for the plan's tree)."""
        del target_cache

    # The batch tells the drafter when rows join and leave (``decoding.engine.batch.RowState``).
    def rows_joined(self, joined: JoinedRows) -> None:
        """Sequences joined the batch at ``joined.rows`` (their prefill ran: the target's states are there)."""
        del joined

    def row_removed(self, row: int, last: int, seq: Sequence) -> None:
        """``seq`` left ``row``; row ``last`` takes its place (``move_last_row``)."""
        del row, last, seq

    def propose(self, inputs: DraftInputs) -> Draft:
        return Draft.roots_only(inputs)

    def observe(self, rows: list[RowDraftState], paths: list[list[int]], path_tokens: list[list[int]], draft: Draft,
                topology: TreeTopology, target_states: torch.Tensor | None = None,
                target_topk: torch.Tensor | None = None) -> None:
        """The verified outcome: each row's drafter state, its accepted path (node indices, the pending token first)
        and its tokens; with ``capabilities.target_topk``, ``target_topk`` [B, N, k] on the device."""
        del rows, paths, path_tokens, draft, topology, target_states, target_topk
