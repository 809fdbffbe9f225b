"""A draft model (``speculative.method: draft_model``): a small model sharing the target's tokenizer, the target
itself through quantized weights (the self-draft) or some of its layers, or a feature draft.

A model draft runs its levels to the planned depth without reading anything back: which candidates go on is a
device mask, and the random numbers of every level are drawn before the first. Only on a CPU (where a read is free)
is a policy whose stop rule can end candidates early (a trained head) asked, level by level, whether any candidate
still drafts; on an accelerator every planned level runs.
"""

from __future__ import annotations

import copy
import logging
import math
import weakref
from typing import TYPE_CHECKING

import torch

from decoding.drafting.drafters import (
    Capabilities,
    Draft,
    DraftContext,
    Drafter,
    DraftInputs,
    DraftPlan,
    RowDraftState,
    register_drafter,
)
from decoding.drafting.feature_draft import load_draft
from decoding.drafting.layer_skip import LayerSkipSearch, kept_layers
from decoding.drafting.lookup import NgramDrafter
from decoding.model.execution import host_reads_free
from decoding.model.gguf_blocks import uses_blocks
from decoding.model.kv_cache import CacheShape, PagedKVCache, Rows, joining_entries
from decoding.model.lean_forward import LeanCausalLM, lean_view, supports_lean_forward
from decoding.model.loading import (
    SELF_DRAFT,
    check_same_tokenizer,
    draft_vocab_subset,
    for_inference,
    load_tokenizer,
)
from decoding.model.model_runner import ModelRunner
from decoding.model.padding import pad_rows, prefill_groups
from decoding.model.quantize import quantized
from decoding.model.rows import move_last_row
from decoding.verification.sampling import row_uniforms, warp_probs
from decoding.verification.tree import TreeTopology, chain_ancestors, with_prefix_chain
from decoding.verification.verify_batched import sample_from, sample_tokens

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from decoding.engine.batch import JoinedRows
    from decoding.engine.sequence import Sequence


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

    Tokens committed while the draft did not run on them (the last accepted leaf, steps at depth 0) wait in the
    row's ``RowDraftState.uncached`` and are fed as a causal prefix of the next draft tree, so no extra forward is
    spent on them.

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
        if spec.quantization and spec.model == SELF_DRAFT and uses_blocks(draft):
            log.info("the target multiplies a GGUF's quantized blocks: its self-draft runs them as they are "
                     "(speculative.quantization %s ignored)", spec.quantization)
        elif spec.quantization:
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
        # A self-draft's levels have fixed shapes (no catch-up prefix): they are captured at build beside the
        # target's, and replay where the target's forwards do (``ModelRunner``).
        self.captured = shares_target_cache
        self._runners: dict[int, ModelRunner] = {}  # per model it may run (a layer-skip search's views), ``attach``
        self.vocab_size = model.config.vocab_size
        reads_states = bool(getattr(model, "reads_features", False))
        # Heterogeneous tree: the last ``lookup_candidates`` candidates of every level are n-gram continuations.
        self.lookup = lookup if lookup_candidates else None
        self.lookup_candidates = lookup_candidates
        if self.lookup is not None and reads_states:
            raise ValueError("speculative.ngram_candidates is not supported with a feature draft (its deeper "
                             "levels read the draft's own states, which lookup nodes do not have)")
        self.vocab_subset = None
        if vocab_subset is not None:
            self.vocab_subset = torch.tensor(vocab_subset, dtype=torch.long)
            if not reads_states:  # a feature draft's head is stored cut
                model = _with_reduced_head(model, tuple(vocab_subset))
        self.model = model if reads_states else model_view(model)
        # ``layer_skip: auto``: which of the candidate layer sets drafts is chosen on the fly; ``model`` is it.
        self.search = search
        if search is not None:
            self.model = search.model
        self.capacity = capacity
        self.cache: PagedKVCache | None = None  # ``attach``
        self.root_states = (  # feature draft: the target's state at each row's last committed position
            torch.zeros(capacity, model.feature_size, device=device) if reads_states else None
        )
        self.capabilities = Capabilities(target_states=reads_states, grammar_drafts=self.lookup is not None)

    def attach(self, target_cache: PagedKVCache) -> None:
        """The target's cache is there: a self-draft drafts in it; another draft gets a cache of its own with as
        many positions as the target's pool (it never holds more of a row than the target does), caching prefixes
        where the target's does."""
        if self.shares_target_cache:
            self.target_cache = self.cache = target_cache
        else:
            config = self.model.config
            self.cache = PagedKVCache(
                CacheShape.of(config), target_cache.num_blocks, target_cache.max_rows,
                target_cache.max_positions_per_row, block_size=target_cache.block_size,
                dtype=next(self.model.parameters()).dtype, device=self.device, execution=target_cache.execution,
                prefix_caching=target_cache.prefix_caching, salt=f"draft|{getattr(config, '_name_or_path', '')}",
            )
            self.own_cache = self.cache
        self._runners = {id(model): ModelRunner(model, self.cache, self.captured) for model in self.models}

    @property
    def runner(self) -> ModelRunner:
        """The runner of the model drafting now."""
        return self._runners[id(self.model)]

    @property
    def runners(self) -> list[ModelRunner]:
        return list(self._runners.values())

    def rows_joined(self, joined: JoinedRows) -> None:
        rows, positions, target_states = joined.rows, joined.positions, joined.target_states
        prompts = [seq.prompt_ids for seq in joined.seqs]
        for seq in joined.seqs:
            seq.draft_state.uncached, seq.draft_state.uncached_states = [], []
        if self.target_cache is not None:  # the target's prefill filled the cache both read
            return
        added = self.cache.add_rows(joining_entries(self.cache, [seq.claims for seq in joined.seqs], positions))
        assert added == rows, "draft cache rows must mirror the target cache"
        cached = self.cache.host_lengths[rows]  # prompt positions each row took from the prefix cache
        prompts = [prompt[skip:] for prompt, skip in zip(prompts, cached)]
        states = None
        if self.capabilities.target_states:
            # Input t is token t + 1 with the target's state at t; the last state goes with the pending token.
            last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
            self.root_states[rows] = target_states[torch.arange(len(prompts), device=self.device), last]
            states, prompts = target_states, [p[1:] for p in prompts]
        # No row padded past the positions its blocks were promised for (its prefill budget is the target's).
        for group in prefill_groups([len(p) for p in prompts], padding_floor=math.inf,
                                    limits=self.cache.paddable(rows)):
            ids, lengths = pad_rows(prompts[group])
            width = ids.shape[1]
            if width:
                some = slice(rows.start + group.start, rows.start + group.stop)
                valid = torch.arange(width)[None] < lengths[:, None]
                self.runner.prefill(some, ids.to(self.device), chain_ancestors(width), valid,
                                    logits_at=torch.tensor([width - 1]),
                                    features=states[group, :width] if states is not None else None)
                self.cache.advance(some, lengths.tolist())
        self.cache.register(rows)

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.vocab_subset is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), -torch.inf)
        full[..., self.vocab_subset.to(logits.device, non_blocking=True)] = logits
        return full

    def row_removed(self, row: int, last: int, seq: Sequence) -> None:
        del seq
        move_last_row(row, last, self.root_states)
        if self.target_cache is None:  # a shared cache has moved its rows already
            self.cache.remove_row(row)

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
        uncached = [state.uncached for state in inputs.rows]
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
            for row, waiting_states in enumerate(state.uncached_states for state in inputs.rows):
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
            logits, hidden = self.runner.draft_level(
                rows, tokens[:, start:end], ancestors, valid, start=start,
                logits_at=torch.arange(max(start, prefix), end) - start,
                want_hidden=inputs.stop.needs_hidden_states or states is not None,
                features=states[:, start:end] if states is not None else None,
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
                                            hidden.float() if inputs.stop.needs_hidden_states else None)
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

    def observe(self, rows: list[RowDraftState], paths: list[list[int]], path_tokens: list[list[int]], draft: Draft,
                topology: TreeTopology, target_states: torch.Tensor | None = None,
                target_topk: torch.Tensor | None = None) -> None:
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
        for row, (state, path) in enumerate(zip(rows, paths)):
            if ran:
                keeps.append(list(range(len(state.uncached))) + [draft.prefix + n for n in path if n < final_nodes])
                state.uncached, state.uncached_states = [], []
            waiting = [i for i, node in enumerate(path) if node >= final_nodes]
            state.uncached += [path_tokens[row][i] for i in waiting]
            if self.root_states is not None:
                before = [self.root_states[row].clone(), *target_states[row, path[:-1]]]  # the state before each node
                state.uncached_states += [before[i] for i in waiting]
                self.root_states[row] = target_states[row, path[-1]]
        if not ran:
            return
        keep, counts = pad_rows(keeps)
        self.cache.commit(slice(0, len(paths)), keep, counts)
