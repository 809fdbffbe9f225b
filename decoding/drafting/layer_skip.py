"""The layer-skipping self-draft (SWIFT, Xia et al. 2025) and its on-the-fly choice of layers.

The target drafts for itself through some of its decoder layers (optionally quantized, as the whole self-draft), its
embedding, final norm and head, over the target's own KV pool: the entries it writes at tree positions are tentative
and verification rewrites them, as for the whole self-draft. No training, no extra weights.

Which layers to skip (``speculative.layer_skip: auto``) is found during the run, with no offline profiling (Liu, Park
and Shen 2025: adapt the drafter on the fly): a few candidate sets are tried on live steps, and the one with the
most tokens per second is kept, others retried now and then so the choice follows the text. Candidates skip an
eighth, a quarter, three eighths or half of the middle layers, evenly spread (the first and the last layer always
run: they change the hidden state most); the whole self-draft is a candidate too, so ``auto`` is never far behind it.

Tokens per second: the tokens a step emitted over its modelled seconds, priced from the build's calibration (the
verification of that tree, each draft forward at that candidate's measured cost). Acceptance is measured, costs are
a fixed per-machine table: the choice depends only on past steps, so seeded sampling reproduces (``costs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from decoding.drafting.costs import BatchCosts
from decoding.model.lean_forward import LeanCausalLM

# Shares of the middle layers the candidates skip, each set within the next.
SKIP_SHARES = (0.125, 0.25, 0.375, 0.5)
# Drafting steps a candidate runs per trial; drafting steps on the best before a neighbour is tried again (doubled
# after every retrial the best wins, up to MAX_BACKOFF times, so a model whose every skip loses pays little).
TRIAL_STEPS = 8
EXPLORE_EVERY = 96
MAX_BACKOFF = 8
# Each of a candidate's drafting steps weighs this much less at the next one: a trial's steps outweigh its past.
DECAY = 0.9


def skip_order(num_layers: int) -> list[int]:
    """The middle layers (the first and last always run) in the order they are skipped: each prefix spread evenly
    over them (the middle first, then the quarters, and so on)."""
    middle = list(range(1, num_layers - 1))
    order: list[int] = []
    parts = 1
    while len(order) < len(middle):
        for part in range(parts):
            index = min(len(middle) - 1, int((part + 0.5) * len(middle) / parts))
            if middle[index] not in order:
                order.append(middle[index])
        parts *= 2
        if parts > 2 * len(middle):  # whatever the halving missed, in order
            order += [layer for layer in middle if layer not in order]
    return order


def candidate_skips(num_layers: int) -> list[tuple[int, ...]]:
    """The skipped-layer sets ``auto`` tries, the whole draft (nothing skipped) first, each within the next."""
    order = skip_order(num_layers)
    found: list[tuple[int, ...]] = [()]
    for share in SKIP_SHARES:
        skipped = tuple(sorted(order[: round(len(order) * share)]))
        if skipped and skipped not in found:
            found.append(skipped)
    return found


def kept_layers(num_layers: int, skipped: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """The layers a draft skipping ``skipped`` runs; a set naming a layer the model lacks, or every layer, is
    refused."""
    beyond = [layer for layer in skipped if layer >= num_layers]
    if beyond:
        raise ValueError(f"speculative.layer_skip names layer(s) {beyond}: the target has {num_layers} layers (0 to "
                         f"{num_layers - 1})")
    dropped = set(skipped)
    kept = tuple(layer for layer in range(num_layers) if layer not in dropped)
    if not kept:
        raise ValueError(f"speculative.layer_skip skips all {num_layers} layers: the draft must run at least one")
    return kept


@dataclass
class _Candidate:
    skipped: tuple[int, ...]
    view: LeanCausalLM
    costs: BatchCosts | None = None  # its draft forwards' seconds (``price``)
    tokens: float = 0.0  # decayed sums over its drafting steps
    seconds: float = 0.0
    steps: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class LayerSkipSearch:
    """The candidate layer sets of ``auto`` (nested: each skips more) and which one drafts now: a climb over how many
    layers to skip. Each set from the whole draft on drafts ``TRIAL_STEPS`` steps while each beats the one before;
    then the best drafts, and after ``EXPLORE_EVERY`` drafting steps a neighbour (one more or one fewer skipped,
    in turn) is tried again, or at once when the best falls below what a neighbour last measured; a neighbour that
    wins becomes the best and the climb goes on in its direction."""

    def __init__(self, whole: LeanCausalLM, skips: list[tuple[int, ...]] | None = None) -> None:
        skips = skips if skips is not None else candidate_skips(whole.num_layers)
        self.candidates = [_Candidate(s, whole.with_layers(kept_layers(whole.num_layers, s))) for s in skips]
        self.verify_costs: BatchCosts | None = None
        self.current = 0
        self.best = 0
        self.left = TRIAL_STEPS  # drafting steps until the next decision
        self.climbing = 1  # the climb's direction while it improves; 0: settled on the best
        self.backoff = 1
        self.up_next = True  # which neighbour a settled search tries next

    @property
    def views(self) -> list[LeanCausalLM]:
        return [candidate.view for candidate in self.candidates]

    @property
    def model(self) -> LeanCausalLM:
        """The view drafting now."""
        return self.candidates[self.current].view

    @property
    def skipped(self) -> tuple[int, ...]:
        return self.candidates[self.current].skipped

    @property
    def cost_scale(self) -> float:
        """The drafting layer set's forward cost over the whole draft's (1 until priced)."""
        return self.cost_scale_of(self.current)

    def cost_scale_of(self, candidate: int) -> float:
        """``candidate``'s forward cost over the whole draft's (1 until priced)."""
        whole, chosen = self.candidates[0].costs, self.candidates[candidate].costs
        if whole is None or chosen is None:
            return 1.0
        return chosen(1, 1) / max(whole(1, 1), 1e-12)

    def price(self, verify: BatchCosts, drafts: list[BatchCosts]) -> None:
        """The build's calibration: verification seconds and each candidate's draft forward seconds."""
        self.verify_costs = verify
        for candidate, costs in zip(self.candidates, drafts):
            candidate.costs = costs

    def observe(self, candidate: int, rows: int, tree_tokens: int, forwards: list[tuple[int, int]], tokens: int
                ) -> None:
        """A drafting step by ``candidate``: ``rows`` rows verified ``tree_tokens`` nodes each after the draft
        forwards ``forwards`` (rows, tokens per row), and emitted ``tokens``."""
        chosen = self.candidates[candidate]
        if self.verify_costs is None or chosen.costs is None:
            return
        seconds = self.verify_costs(rows, tree_tokens) + sum(chosen.costs(r, t) for r, t in forwards)
        chosen.tokens = DECAY * chosen.tokens + tokens
        chosen.seconds = DECAY * chosen.seconds + seconds
        chosen.steps += 1
        if candidate != self.current:
            return
        self.left -= 1
        if self.left <= 0:
            self._decide()
        elif candidate == self.best and not self.climbing:
            # The text changed under the best: a neighbour that did better when last tried is tried again now.
            for neighbour in (self.best - 1, self.best + 1):
                other = self.candidates[neighbour] if 0 <= neighbour < len(self.candidates) else None
                if other is not None and other.steps and other.rate > chosen.rate:
                    self.backoff = 1
                    self._try(neighbour)
                    break

    def _decide(self) -> None:
        tried, best = self.current, self.best
        won = tried != best and self.candidates[tried].rate > self.candidates[best].rate
        if won:
            self.climbing = 1 if tried > best else -1
            self.best, self.backoff = tried, 1
        elif tried != best:
            self.climbing = 0
            self.backoff = min(2 * self.backoff, MAX_BACKOFF)
        step = self.best + self.climbing
        if self.climbing and 0 <= step < len(self.candidates):  # the climb goes on
            self._try(step)
            return
        self.climbing = 0
        if tried != self.best or len(self.candidates) == 1:  # a trial ended: back to the best for a while
            self.current, self.left = self.best, EXPLORE_EVERY * self.backoff
            return
        up, down = self.best + 1, self.best - 1  # the best drafted its while: a neighbour's turn
        neighbours = [n for n in ((up, down) if self.up_next else (down, up)) if 0 <= n < len(self.candidates)]
        self.up_next = not self.up_next
        self._try(neighbours[0])

    def _try(self, index: int) -> None:
        """A trial of ``index``: judged on its own new steps (what it measured before is of another text)."""
        self.candidates[index].tokens = self.candidates[index].seconds = 0.0
        self.current, self.left = index, TRIAL_STEPS
