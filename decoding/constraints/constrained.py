"""Constraints in the step: the grammar masks at every node of the candidate tree, for the constrained rows only.

A constrained row keeps a ``RowGrammar`` (``Sequence.grammar``) at its committed tokens before the pending one: the
pending token is the root of each step's tree, so every node's path from that state is its ancestors and itself.
In each step:

- plan: the grammar's own drafts (``grammar_drafts``): the tokens it allows alone after the pending token, then its
  jump-forward text, tokenized; a drafter with lookup candidates proposes them as one (point-mass proposals);
- draft: ``StepGrammar`` walks the tree level by level on the host; a drafter masks the laws it samples each level
  from (``GrammarView.mask``) and cuts what the grammar refuses (``GrammarView.walk``: a lookup continuation that
  leaves the grammar ends where it leaves, nothing grows below a token that ends the grammar);
- verify: the target's logits at every node get the same masks, after penalties and before warping, as the draft's;
- commit: each grammar advances by the tokens its row committed (``advance``), and accepted draft tokens that the
  grammar allowed alone are counted (``Sequence.grammar_forced``).

A cut node is one whose token the masked laws give probability 0, on the target's side and on the draft's (a model
never draws one; a lookup's point mass is then rejected with nothing left to subtract from the target's law), so
leaving it out changes no outcome of the acceptance rule. A step without constrained rows builds nothing here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from decoding.config import SamplingParams
from decoding.constraints.grammar import (
    CONSTRAINT_FIELDS,
    DEFAULT_BUDGET,
    ConstraintWork,
    GrammarBudget,
    GrammarCompiler,
    GrammarError,
    RowGrammar,
    RowMasks,
    TreeMasks,
    mask_logits,
    unpack,
)
from decoding.model.execution import host_reads_free
from decoding.params import EngineError

if TYPE_CHECKING:
    from decoding.engine.sequence import Sequence as Row


class Constraints:
    """The engine's grammar compiler, built at the first constrained request from the preparing thread's own
    tokenizer (a fast tokenizer must not be shared between threads), and each row's grammar from it."""

    def __init__(self, vocab_size: int, budget: GrammarBudget = DEFAULT_BUDGET) -> None:
        self.vocab_size, self.budget = vocab_size, budget
        self.work = ConstraintWork()  # whose grammar the step works on (the runner's watchdog reads it)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def row_grammar(self, params: SamplingParams, stop_ids: set[int], tokenizer: PreTrainedTokenizerBase,
                    owner: str = "") -> RowGrammar | None:
        """The grammar of a row with ``params`` (``owner``: its request id), or None without a constraint;
        ``EngineError`` naming the field."""
        if params.structured_outputs is None:
            return None
        if not stop_ids:
            raise EngineError("invalid sampling_params: structured_outputs ends its output with a stop token, and "
                              "ignore_eos leaves none: give stop_token_ids")
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(tokenizer, self.vocab_size, self.budget)
        try:
            compiled = self._compiler.compile(params.structured_outputs.constraint)
        except GrammarError as exc:
            raise EngineError(f"invalid sampling_params: {exc}") from None
        grammar = RowGrammar(compiled, stop_ids, self._compiler.byte_tokens, owner, self.work)
        if not grammar.allows_any():
            field = CONSTRAINT_FIELDS[params.structured_outputs.constraint.kind]
            raise EngineError(f"invalid sampling_params: {field} cannot be spelled with this model's vocabulary "
                              "(no token may start it)")
        return grammar


def refills(params: SamplingParams) -> bool:
    """Whether a constrained row's emptied law is refilled with what its grammar allows: where min_tokens is its only
    ban, that is the stop tokens of a complete grammar, and the grammar wins (the row stops). With allowed_token_ids
    or bad_words, what the grammar allows may be what the request forbids: the law stays empty."""
    return bool(params.min_tokens) and params.allowed_token_ids is None and not params.bad_words


def apply_masks(logits: torch.Tensor, masks: RowMasks, may_empty: bool) -> None:
    """Mask ``logits`` [B, n, V] in place (see ``grammar.mask_logits``). ``may_empty``: a constrained node may have
    no finite logit left (a min_tokens ban on the stop tokens a complete grammar allows, see ``refills``, or a draft
    whose vocabulary lacks every allowed token); such a node's law becomes uniform over the allowed tokens, on both
    sides alike, so it never puts mass on a token the grammar refuses. A node emptied otherwise stays empty: its
    row ends there (``decoding.verification.sampling.NO_TOKEN``)."""
    mask_logits(logits, masks)
    if not may_empty or masks.rows.numel() == 0:
        return
    constrained = logits.index_select(0, masks.rows)
    dead = constrained.amax(-1, keepdim=True) == -torch.inf
    if host_reads_free(logits.device) and not bool(dead.any()):
        return
    allowed = unpack(masks.packed, logits.shape[-1])
    logits.index_copy_(0, masks.rows, torch.where(dead & allowed, 0.0, constrained))


class StepGrammar:
    """The grammar masks of one step's tree (``TreeMasks``) over the batch, walked level by level by whichever
    part of the step has a level's tokens: the step the root level, a drafter the levels it draws, the step again
    the levels a drafter left (``finish``)."""

    def __init__(self, seqs: list[Row], parents: Sequence[int], device: torch.device,
                 to_host: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.tree = TreeMasks([seq.grammar for seq in seqs], parents, device)
        self.batch = len(seqs)
        self.to_host = to_host
        # The target's laws may lose every allowed token to min_tokens alone (see refills).
        self.may_empty = any(seq.grammar is not None and refills(seq.params) for seq in seqs)
        self.walked_to = [0] * self.batch  # per row: nodes before this were walked
        self.index = {row: index for index, row in enumerate(self.tree.constrained)}

    def view(self) -> GrammarView:
        return GrammarView(self, list(range(self.batch)))

    def finish(self, tokens: torch.Tensor, valid: torch.Tensor, levels: Sequence[slice]) -> None:
        """Walk what the drafter left of the tree (``tokens``, ``valid`` [B, N]), cutting in ``valid`` in place."""
        for nodes in levels:
            rows = [row for row in range(self.batch) if self.walked_to[row] < nodes.stop]
            if not rows or nodes.start >= tokens.shape[1]:
                continue
            index = torch.tensor(rows)
            on = index.to(valid.device, non_blocking=True)
            cut, _ = GrammarView(self, rows).walk(nodes, tokens[on, nodes], valid[on, nodes])
            valid[on, nodes] = valid[on, nodes] & ~cut

    def mask(self, logits: torch.Tensor) -> None:
        """The target's logits at every node [B, N, V], masked in place."""
        size = logits.shape[1]
        apply_masks(logits, RowMasks(self.tree.rows, self.tree.packed[:, :size]), self.may_empty)

    def forced(self, size: int) -> list[list[bool]]:
        """[B][size]: nodes whose token was the only one the grammar allowed after their parent."""
        return self.tree.forced()[:, :size].tolist()


class GrammarView:
    """``StepGrammar`` for some rows of the batch (a drafter's inputs), in their order."""

    def __init__(self, step: StepGrammar, rows: list[int]) -> None:
        self.step, self.rows = step, rows
        local = [(i, step.index[row]) for i, row in enumerate(rows) if row in step.index]
        device = step.tree.device
        self.local_rows = torch.tensor([i for i, _ in local], dtype=torch.long).to(device, non_blocking=True)
        self.packed_rows = torch.tensor([j for _, j in local], dtype=torch.long).to(device, non_blocking=True)
        self.constrained = bool(local)

    def select(self, rows: torch.Tensor) -> GrammarView:
        return GrammarView(self.step, [self.rows[row] for row in rows.tolist()])

    def mask(self, logits: torch.Tensor, nodes: slice, may_empty: bool = False) -> torch.Tensor:
        """``logits`` [b, n, V]: the laws at tree ``nodes`` of these rows, masked in place (and returned)."""
        if self.constrained:
            packed = self.step.tree.packed.index_select(0, self.packed_rows)[:, nodes]
            apply_masks(logits, RowMasks(self.local_rows, packed), may_empty or self.step.may_empty)
        return logits

    def walk(self, nodes: slice, tokens: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Walk one level's ``nodes`` (their ``tokens`` and ``valid`` [b, n] for these rows, on any device); returns
        (cut, closed) [b, n] on that device: ``cut`` the nodes to drop (the grammar refuses their token, or one
        above it), ``closed`` those with nothing below (cut, or ending the grammar)."""
        device = tokens.device
        count = tokens.shape[1]
        if not self.constrained:
            nothing = torch.zeros(tokens.shape, dtype=torch.bool).to(device, non_blocking=True)
            return nothing, nothing
        if device.type != "cpu":
            host = self.step.to_host(torch.cat([tokens, valid.long()], 1))
            tokens, valid = host[:, :count], host[:, count:].bool()
        step = self.step
        rows = torch.tensor(self.rows, dtype=torch.long)
        every_tokens = torch.zeros(step.batch, count, dtype=torch.long)
        every_valid = torch.zeros(step.batch, count, dtype=torch.bool)
        every_tokens[rows], every_valid[rows] = tokens, valid
        step.tree.level(nodes, every_tokens, every_valid)
        for row in self.rows:
            step.walked_to[row] = max(step.walked_to[row], nodes.stop)
        cut = step.tree.refused[rows][:, nodes] & valid
        closed = cut | step.tree.terminal[rows][:, nodes]
        return cut.to(device, non_blocking=True), closed.to(device, non_blocking=True)


def grammar_drafts(seqs: list[Row], limits: Sequence[int], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Per row, the grammar's proposal after its pending token (at most ``limits[row]`` tokens; [] without a
    constraint): the tokens it allows alone, then its jump-forward text. The first are certain under the masks;
    the text's tokenization is a likely continuation, verified like any lookup."""
    drafts = []
    for seq, limit in zip(seqs, limits):
        grammar = seq.grammar
        if grammar is None or limit <= 0:
            drafts.append([])
            continue
        after = [seq.generated[-1]]
        with grammar.working():
            forced = grammar.forced(after, limit)
            room = limit - len(forced)
            drafts.append(forced + (grammar.jump_forward(encode, after + forced, room) if room > 0 else []))
    return drafts


def advance(seqs: list[Row]) -> None:
    """Each unfinished constrained row's grammar advanced to its new pending token (which stays out). A row whose
    grammar reached a state that no token of the vocabulary continues (its masked laws had nothing left) ends as
    an error row with the text so far."""
    for seq in seqs:
        grammar = seq.grammar
        if grammar is None or seq.finish_reason is not None:
            continue
        tokens = seq.generated[seq.grammar_committed :]
        with grammar.working():
            accepted = grammar.commit(tokens[:-1])
            follows = accepted == len(tokens) - 1 and grammar.accepts(tokens[-1:])
        seq.grammar_committed += accepted
        if not follows:
            field = CONSTRAINT_FIELDS[seq.params.structured_outputs.constraint.kind]  # type: ignore[union-attr]
            seq.finish_reason = "error"
            seq.error = f"{field} reached a point that no token of this model's vocabulary continues"
