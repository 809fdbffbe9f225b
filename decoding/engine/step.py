"""One engine step over the running batch: plan -> draft -> verify -> commit -> observe.

Each phase is a function of the batch returning a small typed result for the next:

- ``plan``: each row's draft depth (the length policy, within the row's room) and its sampling parameters;
- ``draft``: the root-level tokens (the pending token, and target-initialized siblings) and the drafter's tree;
- ``verify``: ONE target forward over every row's tree, then the acceptance rule for all rows as tensor
  operations on the device (``verify_batched.py``); the host reads back the accepted paths and next tokens, and
  the draft's ids where they are on the device, in one copy;
- ``commit``: the accepted paths' KV entries into place, the tokens into each sequence (stop conditions), the
  per-token statistics (a second copy: two floats per node);
- ``observe``: what the drafter and the length policy learn.

Every device -> host copy goes through ``HostReads`` (a test bounds them: paths, tokens, statistics and, opt-in,
log-probabilities; never a vocabulary-wide tensor).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from decoding.constraints.constrained import StepGrammar, advance, apply_masks, grammar_drafts, refills
from decoding.constraints.grammar import committed_masks
from decoding.drafting.drafters import Draft, DraftInputs
from decoding.drafting.length_policies import StepRecord, StepTiming
from decoding.engine.batch import Batch, BatchMetadata, JoinedRows
from decoding.engine.parts import EngineParts
from decoding.engine.sequence import Contexts, Sequence
from decoding.model.execution import host_reads_free
from decoding.model.lean_forward import LeanCausalLM
from decoding.model.padding import pad_rows
from decoding.verification.sampling import (
    NO_TOKEN,
    WarpParams,
    or_no_token,
    row_uniforms,
    token_logprobs,
    warp_probs,
)
from decoding.verification.tree import chain_ancestors
from decoding.verification.verify_batched import BatchVerdict, sample_from, sample_siblings, verify_batch

# Prompt positions whose logits one piece of a prompt-logprobs computation holds (float32 [chunk, V]).
PROMPT_LOGPROBS_CHUNK = 256


def _may_empty(seqs: list[Sequence]) -> bool:
    """Whether a row's processed law may have nothing left (``NO_TOKEN``): it bans tokens or follows a grammar."""
    return any(seq.params.bans_tokens or seq.grammar is not None for seq in seqs)


class HostReads:
    """Every device -> host copy of a step: a test bounds them, and on a GPU each is a wait for the device."""

    def __init__(self) -> None:
        self.bytes = {"state": 0, "stats": 0}
        self.count = 0

    def __call__(self, tensor: torch.Tensor, *, stats: bool = False) -> torch.Tensor:
        self.bytes["stats" if stats else "state"] += tensor.numel() * tensor.element_size()
        self.count += 1
        return tensor.to("cpu")


@dataclass(frozen=True)
class Plan:
    meta: BatchMetadata  # the step's facts about its rows (greedy, seeded, penalized, constrained, room)
    depths: torch.Tensor  # [B] host: the model's (or lookup's) draft depth per row
    lookup_depths: torch.Tensor | None  # [B] host: the lookup siblings' depth, where the tree has both
    sizes: torch.Tensor | None  # [B] host: the cut of the tree each row drafts (``parts.nested_trees``); None: whole
    warp: WarpParams  # the rows' warp (meta.row_warp) with penalties, where rows have them
    grammar_drafts: list[list[int]] | None = None  # per row: the grammar's own draft, for a lookup candidate

    @property
    def rows(self) -> slice:
        return self.meta.rows

    @property
    def row_warp(self) -> WarpParams:
        return self.meta.row_warp


@dataclass
class Drafted:
    draft: Draft
    marks: tuple[Any, Any]  # the step clock's marks around drafting (seconds: once verification's read waited)
    grammar: StepGrammar | None = None  # the tree's grammar masks, where some row has a constraint


@dataclass
class Verdict:
    paths: list[list[int]]  # accepted nodes per row, node 0 (the pending token) first
    next_tokens: list[int]  # the token the target adds after each path
    draft_tokens: list[list[int]]  # the tree's ids on the host
    drafted_nodes: torch.Tensor  # [B, N] host: valid nodes below the root level
    batch: BatchVerdict  # on the device
    raw_logits: torch.Tensor  # [B, N, V] on the device (log-probabilities, opt-in)
    states: torch.Tensor | None  # the target's last hidden states at the nodes (feature drafts)
    slot_of: torch.Tensor  # [N] host: each tree node's index in the forward
    timing: StepTiming


@dataclass(frozen=True)
class SourceMatches:
    """Per row, how deep each drafter's part of the tree agreed with the emitted tokens
    (``Step._matched_by_source``)."""

    model: list[int] | None = None
    lookup: list[int] | None = None
    by_size: list[list[int]] | None = None  # per cut of the tree (``parts.nested_trees``), the model's part of it


@dataclass
class Committed:
    emitted: list[list[int]]  # tokens each row emitted this step (before stop conditions cut them)
    kept: list[int]  # accepted draft tokens each row kept
    kept_tokens: list[list[int]]  # tokens each row kept this step (for streaming)


class Step:
    """The phases over the engine's parts and its batch (the running sequences are rows [0, B) of everything).

    The phases change nothing that outlives the step but in ``commit`` (the rows' tokens, cache entries and
    pending laws) and ``observe`` (what the drafter and the length policy learn)."""

    def __init__(self, parts: EngineParts, batch: Batch, reads: HostReads) -> None:
        self.parts, self.batch, self.to_host = parts, batch, reads
        self.target, self.cache, self.drafter, self.policy = parts.target, parts.cache, parts.drafter, parts.policy
        self.topology, self.sources, self.speculative = parts.topology, parts.sources, parts.speculative
        self.tokenizer, self.max_context, self.eos_ids = parts.tokenizer, parts.max_context, parts.eos_ids
        self.device = parts.cache.device
        self.runner = parts.runner
        self.clock = parts.runner.clock  # what the policy learns the phases cost, timed on the device
        self.steps = 0
        self._nested_trees: dict[torch.device, torch.Tensor] = {}  # ``parts.nested_trees`` on each draft device
        self.encode = lambda text: parts.tokenizer.encode(text, add_special_tokens=False)  # grammar drafts' text

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Host -> device without waiting: a blocking copy would also wait for the device's queue to drain."""
        return tensor.to(self.device, non_blocking=True)

    def _uniforms(self, seqs: list[Sequence], meta: BatchMetadata, count: int) -> torch.Tensor | None:
        """[B, count] uniforms on the device, each sampled row's from its own generator (greedy rows: 0); None
        when every row is greedy. A row draws the same count every step, whatever the others do."""
        if meta.all_greedy:
            return None
        return self._to_device(row_uniforms([s.generator for s in seqs], meta.sampled, count))

    def _warp(self, seqs: list[Sequence], prefill: bool = False) -> WarpParams:
        """Sampling parameters of ``seqs`` with the committed histories their penalties and bad words need (on the
        device)."""
        return WarpParams.from_params(
            [s.params for s in seqs], [s.prompt_ids for s in seqs],
            [[] if prefill else s.generated[:-1] for s in seqs], self.eos_ids, self.target.config.vocab_size,
            [s.bad_words for s in seqs],
        ).to(self.device)

    def _read_stats(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.to_host(tensor, stats=True)

    # ----------------------------------------------------------------------------------------------- prefill
    @torch.no_grad()
    def prefill(self, joining: list[Sequence], positions: list[int] | None = None) -> list[list[int]]:
        """Admit ``joining`` into new rows (with their claims, or promised ``positions``): one target forward over
        the part of their prompts not found cached, the first token of each (returned per joining sequence)."""
        rows = self.batch.admit(joining, positions)
        meta = self.batch.metadata(joining)
        cached = self.cache.host_lengths[rows]  # prompt positions each row took from the prefix cache
        ids, lengths = pad_rows([s.prompt_ids[skip:] for s, skip in zip(joining, cached)])
        width = ids.shape[1]
        valid = torch.arange(width)[None] < lengths[:, None]
        reads_states = self.drafter.capabilities.target_states
        # Rows asking for prompt logprobs need the law at every prompt position: from the last hidden states through
        # the LM head (the lean forward's head is the model's), only for those rows, chunk by chunk; a model run by
        # transformers' own forward (its head may scale or cap logits) gives its logits at every position instead.
        asking = [i for i, seq in enumerate(joining) if seq.params.prompt_logprobs is not None]
        by_head = bool(asking) and isinstance(self.target, LeanCausalLM)
        logits_positions = list(range(width)) if asking and not by_head else sorted(set((lengths - 1).tolist()))
        want_hidden = reads_states or by_head
        logits, hidden = self.runner.prefill(
            rows, self._to_device(ids), chain_ancestors(width), valid,
            logits_at=torch.tensor(logits_positions), want_hidden=want_hidden,
            hidden_at=torch.arange(width) if want_hidden else None,
        )
        states = hidden if reads_states else None
        self.cache.advance(rows, lengths.tolist())
        self.cache.register(rows)
        at = self._to_device(torch.tensor([logits_positions.index(n - 1) for n in lengths.tolist()]))
        raw = logits[torch.arange(len(joining), device=self.device), at].float()  # [B, V]
        for i in asking:
            joining[i].prompt_logprobs = self._prompt_logprobs(joining[i], cached[i], hidden[i] if by_head else None,
                                                               None if by_head else logits[i])
        last = self._warp(joining, prefill=True).penalize(raw) if meta.penalized else raw
        if meta.constrained:
            last = self._masked_first(joining, last, raw)
        tokens, scores = last.argmax(-1), last
        uniforms = self._uniforms(joining, meta, 1)
        if uniforms is not None:
            probs = warp_probs(last, meta.row_warp)
            greedy = meta.row_warp.greedy
            tokens = torch.where(greedy, tokens, sample_from(probs, uniforms[:, 0]))
            scores = torch.where(greedy[:, None], last, probs)
        if _may_empty(joining):
            tokens = or_no_token(tokens, last)
        self.batch.set_root_scores(rows, scores)
        emitted = []
        for i, (seq, token) in enumerate(zip(joining, self.to_host(tokens).tolist())):
            seq.forwards = 1
            if seq.params.logprobs is not None and token != NO_TOKEN:
                seq.logprobs += token_logprobs(raw[i : i + 1], [token], seq.params.logprobs, self._read_stats)
            seq.emit([token], [False], self.max_context, self.tokenizer)
            emitted.append(list(seq.generated))
        self.batch.joined(JoinedRows(rows, joining, positions, states))
        for seq, skip in zip(joining, cached):
            seq.claims, seq.cached_tokens = [], skip
        return emitted

    def _prompt_logprobs(self, seq: Sequence, cached: int, hidden: torch.Tensor | None, logits: torch.Tensor | None
                         ) -> list[dict | None]:
        """vLLM's prompt logprobs of ``seq`` (its first entry None) from its prefill's last hidden states [T, H]
        through the LM head, or its logits [T, V] at every position: in chunks of ``PROMPT_LOGPROBS_CHUNK``
        positions, so a long prompt never holds [T, V] float32 at once. ``cached``: prompt positions its prefill
        took from the prefix cache (0: such a row claims none); their entries cannot be computed and stay None."""
        prompt, top = seq.prompt_ids, seq.params.prompt_logprobs or 0
        entries: list[dict | None] = [None] * (1 + cached)
        head = self.target.get_output_embeddings() if hidden is not None else None
        for start in range(0, len(prompt) - 1 - cached, PROMPT_LOGPROBS_CHUNK):
            end = min(start + PROMPT_LOGPROBS_CHUNK, len(prompt) - 1 - cached)  # position t gives token t + 1
            chunk = head(hidden[start:end]) if head is not None else logits[start:end]
            entries += token_logprobs(chunk, prompt[cached + start + 1 : cached + end + 1], top, self._read_stats)
        return entries

    # -------------------------------------------------------------------------------------------------- plan
    def plan(self, seqs: list[Sequence]) -> Plan:
        """Each row's depth within its room (max_tokens, the context) and its sampling parameters."""
        meta = self.batch.metadata()
        contexts = self.cache.host_lengths[: len(seqs)]  # cached tokens, known on the host
        planned = self.policy.plan_rows([s.policy_memory for s in seqs], contexts, meta.reproducible)
        depths, lookup_depths = planned.depths, planned.lookup_depths
        depths = depths.minimum(meta.room)
        lookup_depths = lookup_depths.minimum(meta.room) if lookup_depths is not None else None
        row_drafts = None
        if meta.constrained and self.drafter.capabilities.grammar_drafts and self.topology.max_depth:
            # Each constrained row's grammar draft (within its room), and the lookup depth raised to hold it.
            row_drafts = grammar_drafts(seqs, meta.room.clamp(max=self.topology.max_depth).tolist(), self.encode)
            lengths = torch.tensor([len(draft) for draft in row_drafts])
            if lookup_depths is not None:
                lookup_depths = lookup_depths.maximum(lengths)
            else:  # a lookup-only tree
                depths = depths.maximum(lengths)
        # Penalties need each row's history: then the drafter warps with it (the target's logits get the same).
        warp = self._warp(seqs) if meta.penalized else meta.row_warp
        return Plan(meta, depths, lookup_depths, planned.sizes, warp, row_drafts)

    # ------------------------------------------------------------------------------------------------- draft
    def _roots(self, seqs: list[Sequence], plan: Plan, pending: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Root-level tokens [B, root_width]: the pending token, plus target-initialized siblings where a row
        drafts, drawn on the device; they stay there unless the drafter reads them on the host."""
        width = self.topology.root_width
        batch = len(seqs)
        if width == 1:
            return pending[:, None], torch.ones(batch, 1, dtype=torch.bool)
        uniforms = self._uniforms(seqs, plan.meta, width - 1)
        siblings = sample_siblings(
            self.batch.root_scores[:batch], self._to_device(pending), plan.row_warp.greedy, width - 1,
            self.speculative.replacement,
            uniforms if uniforms is not None else torch.zeros(batch, width - 1, device=self.device),
        )
        if self.drafter.capabilities.host_roots:
            siblings = self.to_host(siblings)
        drafts = (siblings >= 0) & (plan.depths > 0).to(siblings.device, non_blocking=True)[:, None]
        pending = pending.to(siblings.device, non_blocking=True)
        roots = torch.cat([pending[:, None], torch.where(drafts, siblings, 0)], 1)
        valid = torch.cat([torch.ones_like(drafts[:, :1]), drafts], 1)
        return roots, valid

    def draft(self, seqs: list[Sequence], plan: Plan) -> Drafted:
        started = self.clock.mark()
        pending = torch.tensor([s.generated[-1] for s in seqs])
        idle = not bool(plan.depths.any()) and (plan.lookup_depths is None or not bool(plan.lookup_depths.any()))
        if idle and self.topology.root_width == 1:  # a plain step: nothing to draft, no sibling to draw
            batch = len(seqs)
            roots, root_valid = pending[:, None], torch.ones(batch, 1, dtype=torch.bool)
            grammar = self._grammar_tree(seqs, plan, roots, root_valid)[0] if plan.meta.constrained else None
            return Drafted(Draft(roots, root_valid, torch.ones(batch, 1), None, 0), (started, self.clock.mark()),
                           grammar)
        roots, root_valid = self._roots(seqs, plan, pending)
        grammar = None
        if plan.meta.constrained:
            grammar, root_valid = self._grammar_tree(seqs, plan, roots, root_valid)
        draft = self._cut(plan, self.drafter.propose(DraftInputs(
            contexts=Contexts(seqs), roots=roots, root_valid=root_valid, pending=pending,  # type: ignore[arg-type]
            depths=plan.depths,
            topology=self.topology, warp=plan.warp, greedy=plan.meta.greedy,
            generators=[s.generator for s in seqs], replacement=self.speculative.replacement,
            stop=self.policy, rows=[s.draft_state for s in seqs], lookup_depths=plan.lookup_depths,
            grammar=grammar.view() if grammar is not None else None, grammar_drafts=plan.grammar_drafts,
            reproducible=torch.tensor(plan.meta.reproducible, dtype=torch.bool) if any(plan.meta.reproducible)
            else None,
        )))
        if grammar is not None:  # the levels the drafter did not walk (all of a host drafter's)
            grammar.finish(draft.tokens, draft.valid, [self.topology.level_slice(level)
                                                       for level in range(1, draft.depth + 1)])
        return Drafted(draft, (started, self.clock.mark()), grammar)

    def _cut(self, plan: Plan, draft: Draft) -> Draft:
        """``draft`` with each row's tree cut to its planned size (the drafter drafted the whole tree)."""
        if plan.sizes is None:
            return draft
        valid = draft.valid
        if valid.device not in self._nested_trees:  # copied once per device (a host draft's flags, a device's)
            self._nested_trees[valid.device] = self.parts.nested_trees.to(valid.device)
        cuts = self._nested_trees[valid.device][:, : valid.shape[1]]
        return dataclasses.replace(draft, valid=valid & cuts[plan.sizes.to(valid.device, non_blocking=True)])

    def _planned_nodes(self, plan: Plan, size: int) -> torch.Tensor | None:
        """[n] host: the nodes of the step's tree of ``size`` nodes that its planned cuts hold (the largest
        row's cut: the others are inside it), or None where that is the whole tree. Where verifications replay
        graphs, cut trees are captured at the full depth only (``Sources.cuts_at_full_depth``)."""
        if plan.sizes is None or (self.runner.replays and size != self.topology.size(self.topology.max_depth)):
            return None
        nodes = self.parts.nested_trees[int(plan.sizes.max()), :size].nonzero().flatten()
        return nodes if len(nodes) < size else None

    # ------------------------------------------------------------------------------------------------ verify
    def _verify_forward(self, plan: Plan, draft: Draft, tokens: torch.Tensor, valid: torch.Tensor,
                        ancestors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The target forward over the tree; (logits [B, N, V], states) on the device and each node's index in
        the forward on the host.

        Where the draft's flags are on the host, a node no row has (a candidate that stopped, an n-gram sibling
        without a match) is left out of the forward rather than padded: on a CPU each extra token of a small
        verify costs ~5% of a plain step. A node's ancestors are live wherever it is, so the live nodes form a
        tree of their own. A device draft's tree runs whole (its dead nodes as padding queries), so nothing is
        read back before the forward; so does every tree where verifications replay graphs captured at build
        (``ModelRunner.replays``), but for the cut of the tree the plan holds, known on the host: the whole trees and
        their cuts are what is captured.
        """
        size = draft.tokens.shape[1]
        want = self.drafter.capabilities.target_states
        slot_of = torch.arange(size)
        pruned = host_reads_free(draft.valid.device) and not self.runner.replays
        nodes = draft.valid.any(0).nonzero().flatten() if pruned \
            else self._planned_nodes(plan, size)
        if nodes is not None and len(nodes) < size:
            slot_of = torch.zeros(size, dtype=torch.long)
            slot_of[nodes] = torch.arange(len(nodes))
            live = self._to_device(nodes)
            logits, states = self.runner.verify(plan.rows, tokens[:, live], ancestors[nodes][:, nodes], valid[:, live],
                                              want_hidden=want)
            on_device = self._to_device(slot_of)  # back to tree positions; dead nodes' rows are never read
            return logits[:, on_device], states[:, on_device] if states is not None else None, slot_of
        logits, states = self.runner.verify(plan.rows, tokens, ancestors, valid, want_hidden=want)
        return logits, states, slot_of

    def verify(self, seqs: list[Sequence], plan: Plan, drafted: Drafted) -> Verdict:
        draft = drafted.draft
        batch, size = draft.tokens.shape
        started = self.clock.mark()
        ancestors = self.topology.sliced_ancestors(draft.depth)
        tokens, valid = self._to_device(draft.tokens), self._to_device(draft.valid)
        raw, states, slot_of = self._verify_forward(plan, draft, tokens, valid, ancestors)
        logits = plan.warp.penalize(raw, tokens, self._to_device(ancestors)) if plan.meta.penalized else raw
        if drafted.grammar is not None:
            logits = self._masked_tree(seqs, drafted.grammar, logits, raw)
        uniforms = self._uniforms(seqs, plan.meta, self.topology.size(self.topology.max_depth) + 1)
        verdict = verify_batch(
            logits, tokens, valid, self.topology, plan.row_warp, self.batch.root_scores[plan.rows],
            self._to_device(draft.draft_probs) if draft.draft_probs is not None else None,
            self.speculative.replacement, uniforms[:, [*range(size), -1]] if uniforms is not None else None,
            self._to_device(draft.point_mass) if draft.point_mass is not None else None, _may_empty(seqs),
            self.cache.execution,
        )
        # One copy: paths and next tokens, and the tree's ids and flags where they are on the device.
        parts = [verdict.path, verdict.next_token[:, None]]
        on_device = not host_reads_free(draft.tokens.device)  # then the tree's ids come back in the one copy
        if on_device:
            parts += [draft.tokens, draft.valid.long()]
        verified = self.clock.mark()  # the verification's work is done (CPU) or enqueued (GPU) by here
        host = self.to_host(torch.cat(parts, 1))  # waits for the device: every mark above has passed
        depth = verdict.path.shape[1]
        path_part = host[:, :depth]
        lengths = (path_part >= 0).sum(1)
        draft_tokens, draft_valid = (host[:, depth + 1 : depth + 1 + size], host[:, depth + 1 + size :].bool()) \
            if on_device else (draft.tokens, draft.valid)
        drafted_nodes = draft_valid & (self.topology.depths[:size] > 0)[None]
        context = sum(self.cache.host_lengths[:batch]) / batch
        timing = StepTiming(
            (batch, int(draft_valid.any(0).sum()), context), self.clock.seconds(started, verified),
            [(count, width, context) for count, width in draft.forward_shapes], self.clock.seconds(*drafted.marks),
        )
        return Verdict(
            paths=[path[:n] for path, n in zip(path_part.tolist(), lengths.tolist())],
            next_tokens=host[:, depth].tolist(), draft_tokens=draft_tokens.tolist(), drafted_nodes=drafted_nodes,
            batch=verdict, raw_logits=raw, states=states, slot_of=slot_of, timing=timing,
        )

    # ------------------------------------------------------------------------------------------------ commit
    def commit(self, seqs: list[Sequence], plan: Plan, drafted: Drafted, verdict: Verdict) -> Committed:
        """The accepted paths' KV entries into place; each row's new tokens, statistics and log-probabilities;
        the law each row's new pending token came from."""
        self.batch.root_scores[plan.rows] = verdict.batch.next_law
        paths = verdict.paths
        keep, counts = pad_rows([[int(verdict.slot_of[n]) for n in path] for path in paths], fill=0)
        self.cache.commit(plan.rows, keep, counts)
        drafted_nodes = [row.nonzero().flatten().tolist() for row in verdict.drafted_nodes] \
            if bool(verdict.drafted_nodes.any()) else [[] for _ in seqs]
        if any(drafted_nodes):  # a plain step has no statistics to read back
            target_probs, draft_probs = self.to_host(torch.stack(
                [verdict.batch.token_probs, self._to_device(drafted.draft.token_probs)]), stats=True).tolist()
        self.steps += 1
        node_depths = self.topology.depths.tolist()
        node_candidates = self.topology.candidate_index.tolist()
        grammar = drafted.grammar
        forced = grammar.forced(len(verdict.draft_tokens[0])) if grammar is not None else None
        all_emitted, all_kept, kept_tokens = [], [], []
        for row, (seq, path) in enumerate(zip(seqs, paths)):
            accepted_nodes = [n for n in path if node_depths[n] > 0]
            seq.forwards += 1
            new_tokens = [verdict.draft_tokens[row][n] for n in accepted_nodes] + [verdict.next_tokens[row]]
            # NO_TOKEN: the row's law had nothing left; it ends there (Sequence.emit), the tokens before it kept
            real = new_tokens[:-1] if new_tokens[-1] == NO_TOKEN else new_tokens
            all_emitted.append(real)
            if seq.params.logprobs is not None and real:  # opt-in: the target's log-probabilities at the path's nodes
                at_path = verdict.raw_logits[row, self._to_device(torch.tensor(path[: len(real)]))]
                seq.logprobs += token_logprobs(at_path, real, seq.params.logprobs, self._read_stats)
            before = len(seq.generated)
            kept = seq.emit(new_tokens, [True] * len(accepted_nodes) + [False], self.max_context, self.tokenizer)
            kept_tokens.append(seq.generated[before:])
            kept_nodes = set(accepted_nodes[:kept])  # a stop inside the accepted run drops the rest
            if forced is not None:
                seq.grammar_forced += sum(forced[row][node] for node in kept_nodes)
            row_drafted = drafted_nodes[row]
            seq.per_step_drafted.append(len(row_drafted))
            seq.per_step_accepted.append(len(kept_nodes))
            all_kept.append(len(kept_nodes))
            for node in row_drafted:
                seq.token_stats.append((
                    self.steps, node_depths[node], node_candidates[node], verdict.draft_tokens[row][node],
                    draft_probs[row][node], target_probs[row][node], node in kept_nodes,
                ))
        if grammar is not None:
            advance(seqs)
        return Committed(all_emitted, all_kept, kept_tokens)

    # ------------------------------------------------------------------------------------------- constraints
    def _masked_first(self, joining: list[Sequence], last: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """The first token's logits [B, V] under each constrained row's grammar (the raw logits stay as they are,
        for log-probabilities)."""
        masked = last.clone() if last is raw else last
        apply_masks(masked[:, None], committed_masks([s.grammar for s in joining], self.device),
                    any(s.grammar is not None and refills(s.params) for s in joining))
        return masked

    def _grammar_tree(self, seqs: list[Sequence], plan: Plan, roots: torch.Tensor, root_valid: torch.Tensor
                      ) -> tuple[StepGrammar, torch.Tensor]:
        """The step's grammar masks, walked at the root level; root-level siblings the grammar refuses are cut."""
        depth = int(plan.depths.max())
        if plan.lookup_depths is not None:
            depth = max(depth, int(plan.lookup_depths.max()))
        grammar = StepGrammar(seqs, self.topology.parents[: self.topology.size(depth)], self.device, self.to_host)
        cut, _ = grammar.view().walk(self.topology.level_slice(0), roots, root_valid)
        return grammar, root_valid & ~cut

    def _masked_tree(self, seqs: list[Sequence], grammar: StepGrammar, logits: torch.Tensor, raw: torch.Tensor
                     ) -> torch.Tensor:
        """The target's logits at every node under the grammar masks (the raw ones stay, for log-probabilities)."""
        if logits is raw and any(s.params.logprobs is not None for s in seqs):
            logits = raw.clone()
        grammar.mask(logits)
        return logits

    # ----------------------------------------------------------------------------------------------- observe
    def observe(self, seqs: list[Sequence], plan: Plan, drafted: Drafted, verdict: Verdict,
                committed: Committed) -> None:
        draft = drafted.draft
        path_tokens = [[verdict.draft_tokens[row][n] for n in path] for row, path in enumerate(verdict.paths)]
        topk = self.drafter.capabilities.target_topk
        search = self.drafter.search  # a layer-skipping draft: the cost of the set that drafted
        draft_scale = search.cost_scale_of(draft.candidate) if search is not None else 1.0
        self.drafter.observe([s.draft_state for s in seqs], verdict.paths, path_tokens, draft, self.topology,
                             verdict.states, verdict.raw_logits.topk(topk, dim=-1).indices if topk else None)
        size = draft.tokens.shape[1]
        matched = self._matched_by_source(draft.depth, verdict.draft_tokens, verdict.drafted_nodes, committed.emitted,
                                          plan.sizes is not None)
        depth_of = self.topology.depths[:size]
        self.policy.observe(StepRecord(
            rows=[s.policy_memory for s in seqs],
            planned_depth=plan.depths.tolist(),
            drafted_depth=(verdict.drafted_nodes * depth_of).amax(1).tolist() if size else [0] * len(seqs),
            accepted=committed.kept,
            lookup_planned=(plan.lookup_depths if plan.lookup_depths is not None else plan.depths).tolist(),
            model_matched=matched.model, lookup_matched=matched.lookup, timing=verdict.timing,
            fixed=plan.meta.reproducible, draft_scale=draft_scale,
            planned_size=plan.sizes.tolist() if plan.sizes is not None else None, size_matched=matched.by_size,
        ))

    def _matched_by_source(
        self, depth: int, tokens: list[list[int]], drafted: torch.Tensor, emitted: list[list[int]], cut: bool
    ) -> SourceMatches:
        """How deep the model's candidates (its chains or static tree), and the lookup siblings, agree with the
        tokens each row emitted: what each drafter alone would have had accepted, so the policy learns both from
        every step whichever won; with ``cut`` trees, also how deep each cut of the model's tree agrees. None where
        the tree has one drafter and one size (its accepted run says it)."""
        sources, topology = self.sources, self.topology
        both = bool(sources.model_width and sources.lookup_width)
        if not (both or cut) or depth == 0:
            return SourceMatches()
        size = topology.size(depth)
        node_depths = topology.depths[:size]
        target = torch.full((len(emitted), depth + 1), -1, dtype=torch.long)
        for row, row_tokens in enumerate(emitted):
            target[row, 1 : 1 + min(len(row_tokens), depth)] = torch.tensor(row_tokens[:depth])
        agree = (torch.tensor(tokens)[:, :size] == target[:, node_depths]) & drafted[:, :size]
        agree[:, 0] = True  # the pending token; target-initialized siblings' chains never count
        on_path = ~((~agree)[:, None, :] & topology.sliced_ancestors(depth)[None]).any(-1)  # [B, N]
        matched = torch.where(on_path, node_depths, 0)
        lookup = self._lookup_nodes[:size]

        def deepest(nodes: torch.Tensor) -> list[int]:
            return matched[:, nodes].amax(1).tolist() if bool(nodes.any()) else [0] * len(emitted)

        return SourceMatches(
            deepest(~lookup) if both else None, deepest(lookup) if both else None,
            [deepest(~lookup & nodes[:size]) for nodes in self.parts.nested_trees] if cut else None,
        )

    @cached_property
    def _lookup_nodes(self) -> torch.Tensor:
        """[N]: the lookup siblings' nodes (the last ``lookup_width`` chains of every level)."""
        topology = self.topology
        return (topology.depths > 0) & ~topology.model_nodes(topology.num_candidates - self.sources.lookup_width)
