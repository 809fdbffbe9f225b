"""Prompt lookup (``speculative.method: ngram``), and the n-gram siblings other drafters put beside their own
candidates: each row's tokens kept on the device, the longest earlier suffix match continued."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING

import numpy as np
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
from decoding.model.padding import pad_rows
from decoding.model.rows import move_last_row

if TYPE_CHECKING:
    from decoding.engine.batch import JoinedRows
    from decoding.engine.sequence import Sequence


class TokenHistory:
    """Each row's tokens (prompt, generated, the pending one last) on the device, for lookups there. Rows only grow
    while they run: each step appends what a row gained since the last (the whole prompt once), one small copy. How
    many of a row's tokens are there is the row's (``RowDraftState.history_length``), so it moves with its row."""

    def __init__(self, device: torch.device) -> None:
        self.tokens = torch.zeros(0, 0, dtype=torch.long, device=device)

    def rows_joined(self, joined: JoinedRows) -> None:
        for seq in joined.seqs:
            seq.draft_state.history_length = 0

    def row_removed(self, row: int, last: int) -> None:
        move_last_row(row, last, self.tokens)  # (rows never looked up hold no tokens)

    def sync(self, contexts: SequenceABC[list[int]], pending: torch.Tensor, states: list[RowDraftState]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's ``contexts[row]`` + its pending token on the device: ([B, longest] tokens, [B] lengths)."""
        rows = len(contexts)
        # Only what a row gained is read (``Contexts.tail``): building whole contexts cost O(context) a row a step.
        tail = getattr(contexts, "tail", None) or (lambda row, start: (len(contexts[row]), contexts[row][start:]))
        known = [state.history_length for state in states]
        added = []
        for row, token in enumerate(pending.tolist()):
            length, new = tail(row, known[row])
            if length + 1 < known[row]:  # not this row's history: written anew
                known[row] = 0
                length, new = tail(row, 0)
            added.append(new + [token] if known[row] <= length else [])
        lengths = [have + len(new) for have, new in zip(known, added)]
        longest = max(lengths, default=0)
        if self.tokens.shape[0] < rows or self.tokens.shape[1] < longest:  # grown by doubling, never narrowed
            width = max(64, self.tokens.shape[1], 1 << (longest - 1).bit_length())
            grown = self.tokens.new_zeros(max(rows, self.tokens.shape[0]), width)
            grown[: self.tokens.shape[0], : self.tokens.shape[1]] = self.tokens
            self.tokens = grown
        if any(added):
            ids, counts = pad_rows(added)
            columns = torch.tensor(known)[:, None] + torch.arange(ids.shape[1])[None]
            where = torch.arange(ids.shape[1])[None] < counts[:, None]
            device = self.tokens.device
            row_index = torch.arange(rows)[:, None].expand_as(columns)[where]
            self.tokens.index_put_((row_index.to(device), columns[where].to(device)), ids[where].to(device))
        for state, length in zip(states, lengths):
            state.history_length = length
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

    capabilities = Capabilities(host_roots=True, grammar_drafts=True)

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

    def row_removed(self, row: int, last: int, seq: Sequence) -> None:
        if self.history is not None:
            self.history.row_removed(row, last)

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
            history, lengths = self.history.sync(inputs.contexts, inputs.pending, inputs.rows)
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
