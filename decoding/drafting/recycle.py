"""Token recycling (``speculative.method: recycle``): a table of each token's likely successors, filled from the
target's own verification logits, expanded into a static tree; no draft model, no training."""

from __future__ import annotations

import dataclasses
from functools import cache
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
from decoding.drafting.lookup import NgramDrafter
from decoding.verification.tree import TreeTopology, best_first_layout

if TYPE_CHECKING:
    from decoding.engine.batch import JoinedRows
    from decoding.engine.sequence import Sequence


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
        # One row past the vocabulary is a sink: writes of invalid nodes, and of a token's earlier nodes, land there
        # and no proposal reads it (draft tokens are vocabulary ids), so the table takes one static-shaped copy.
        self.table = torch.full((vocab_size + 1, width), -1, dtype=torch.long, device=device)
        self._last_writer = torch.empty(vocab_size + 1, dtype=torch.long, device=device)
        self.lookup = lookup if lookup_candidates else None
        self.lookup_candidates = lookup_candidates if self.lookup is not None else 0
        self.capabilities = Capabilities(target_topk=width, grammar_drafts=self.lookup is not None)

    def rows_joined(self, joined: JoinedRows) -> None:
        if self.lookup is not None:
            self.lookup.rows_joined(joined)

    def row_removed(self, row: int, last: int, seq: Sequence) -> None:
        if self.lookup is not None:
            self.lookup.row_removed(row, last, seq)

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
        if inputs.reproducible is not None:  # the table is every row's: a reproducible row drafts its lookups only
            depths = depths.masked_fill(inputs.reproducible.to(device), 0)
        levels = _recycled_levels(topology, topology.num_candidates - self.lookup_candidates, device)
        for level, (nodes, parents, ranks) in enumerate(levels[:recycle_depth], start=1):
            proposed = self.table[tokens[:, parents], ranks]  # [B, n]: each parent token's rank-th successor
            alive = valid[:, parents] & (proposed >= 0) & (depths >= level)[:, None]
            tokens[:, nodes] = torch.where(alive, proposed, 0)
            valid[:, nodes] = alive
        depth = max(recycle_depth, lookup_depth)
        size = topology.size(depth)
        return Draft(tokens[:, :size], valid[:, :size], draft.token_probs[:, :size], None, depth)

    def observe(self, rows: list[RowDraftState], paths: list[list[int]], path_tokens: list[list[int]], draft: Draft,
                topology: TreeTopology, target_states: torch.Tensor | None = None,
                target_topk: torch.Tensor | None = None) -> None:
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
