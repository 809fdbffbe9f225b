"""Draft-length policies: how deep to draft this step, and when to stop drafting early.

Every policy sees only draft-side signals and past steps, so verification stays lossless.
- static: always the configured depth.
- heuristic: transformers' schedule per sequence, +2 after a fully accepted step, -1 otherwise.
- online (default): no training. Estimates per-level acceptance from recent steps, takes verify and draft
  costs from a measured calibration (costs.py), and picks the depth (0 = no speculation) with the most expected
  tokens per second (on-the-fly draft-length adaptation, Liu, Park & Shen 2025), depth 0 unless another wins by
  a margin. It probes one level deeper now and then, within a small time budget, so it can come back from 0.
- threshold: SpecDec++ acceptance head; a candidate stops drafting once P(some drafted token is rejected)
  > threshold (that last token is still verified).
- decision: Lu et al.'s early-stop decision model; a candidate stops drafting after the token the model says
  to stop at.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from decoding.config import SpeculativeConfig
from decoding.drafting.costs import BatchCosts, LearnedCosts
from decoding.drafting.signal_head import DraftSignalMLP


@dataclass
class RowMemory:
    """What a length policy has learned of one sequence. It lives on the sequence (``Sequence.policy_memory``), so
    it joins and leaves the batch with it; a policy reads and updates the memories of the rows it plans."""

    depth: int | None = None  # the heuristic's depth (None: not planned yet)
    rates: np.ndarray | None = None  # the online policy's own counts, [2, keys, depth + 1] (None: none yet)
    steps: int = 0  # the online policy's steps of a seeded row (its probes count its own steps)


@dataclass(frozen=True)
class StepRecord:
    """What a policy learns from one verified step."""

    rows: list[RowMemory]  # the memory of each row of the step
    planned_depth: list[int]  # depth each row was given (after the engine's room limits)
    drafted_depth: list[int]  # deepest valid drafted level of each row
    accepted: list[int]  # accepted drafted tokens of each row
    # Heterogeneous trees: each drafter's depth and how far its best chain agreed with the emitted tokens.
    lookup_planned: list[int] | None = None
    model_matched: list[int] | None = None
    lookup_matched: list[int] | None = None
    # Trees cut to sizes (``Sources.model_sizes``): each row's planned size, and per size how far that cut of the
    # row's tree agreed with the emitted tokens (sizes above the row's own: its own tree's agreement, unused).
    planned_size: list[int] | None = None
    size_matched: list[list[int]] | None = None
    timing: StepTiming | None = None
    fixed: list[bool] | None = None  # rows planned as ``fixed`` (seeded sampling): they count their own steps
    draft_scale: float = 1.0  # the draft's forward cost relative to its calibration (a layer set: ``layer_skip.py``)


@dataclass(frozen=True)
class RowPlan:
    """A policy's plan for the rows of a step."""

    depths: torch.Tensor  # [B] the model's (or a lookup-only tree's) draft depth
    lookup_depths: torch.Tensor | None = None  # [B] the lookup siblings' depth; None: the tree has none
    sizes: torch.Tensor | None = None  # [B] the size each row's tree is cut to (``Sources.model_sizes``); None: whole


class LengthPolicy:
    needs_hidden_states = False
    cuts = False  # whether ``keep`` can end a candidate before its planned depth (a trained stop head)

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth

    def plan(self, rows: list[RowMemory]) -> torch.Tensor:
        """Planned depth per row before drafting."""
        return torch.full((len(rows),), self.max_depth, dtype=torch.long)

    def plan_rows(
        self, rows: list[RowMemory], contexts: list[int] | None = None, fixed: list[bool] | None = None
    ) -> RowPlan:
        """Each row's depths and tree size.

        ``contexts``: each row's cached tokens; ``fixed``: rows whose decisions must not depend on timing or
        other rows (seeded sampling).
        """
        del contexts, fixed
        return RowPlan(self.plan(rows))

    def keep(
        self, level: int, depths: torch.Tensor, token_probs: torch.Tensor, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whether each candidate [B, w] keeps its new token at ``level`` (1-based), and whether it drafts on.
        Every tensor is on the drafter's device (``depths`` too), and so are the answers.

        A stop decision only ever ends drafting *after* a token: the token that triggered it is already drafted
        and costs almost nothing to verify, while deciding on it before keeping it would mean a draft forward per
        step whose output is thrown away.
        """
        del hidden
        kept = (level <= depths)[:, None].expand_as(token_probs)
        return kept, kept & (level < depths)[:, None]

    def observe(self, record: StepRecord) -> None:
        del record

    def to(self, device: torch.device) -> LengthPolicy:
        """Models the policy runs inside the draft loop move to the drafter's device (``keep`` runs there)."""
        del device
        return self


class HeuristicPolicy(LengthPolicy):
    def plan(self, rows: list[RowMemory]) -> torch.Tensor:
        return torch.tensor([self.max_depth if r.depth is None else r.depth for r in rows], dtype=torch.long)

    def observe(self, record: StepRecord) -> None:
        for memory, drafted, accepted in zip(record.rows, record.drafted_depth, record.accepted):
            current = self.max_depth if memory.depth is None else memory.depth
            grown = current + 2 if drafted > 0 and accepted == drafted else current - 1
            memory.depth = min(self.max_depth, max(1, grown))


@dataclass(frozen=True)
class StepTiming:
    """What one step's forwards cost, as the engine timed them: (rows, tokens per row, context) per forward."""

    verify: tuple[int, float, float]
    verify_seconds: float
    drafts: list[tuple[int, float, float]]
    draft_seconds: float


@dataclass(frozen=True)
class Sources:
    """The drafters a tree is made of: a model's candidates and/or n-gram lookup candidates, per level."""

    root_width: int = 1
    model_width: int = 0  # model candidates per level (0: no model draft)
    lookup_width: int = 0  # lookup candidates per level
    prefix_tokens: int = 1  # typical catch-up tokens in the first draft forward
    # The model source's nodes at each depth 1.., in each size a row's tree can be cut to (smallest first; the last
    # is the whole tree; ``TreeTopology.nested_trees``). Empty: one size, ``model_width`` nodes a depth.
    model_sizes: tuple[tuple[int, ...], ...] = ()
    # Whether a cut tree is verified at the full depth only (verifications replay CUDA graphs captured at build:
    # one per cut, not one per cut and depth).
    cuts_at_full_depth: bool = False

    @property
    def sizes(self) -> int:
        return max(len(self.model_sizes), 1)

    @property
    def keys(self) -> list[tuple[str, int]]:
        """What acceptance is learnt for: the model source cut to each size, and the lookup siblings."""
        model = [("model", size) for size in range(self.sizes)] if self.model_width else []
        return model + ([("lookup", 0)] if self.lookup_width else [])

    def model_nodes(self, depth: int, size: int = -1) -> int:
        """The model source's nodes in a tree ``depth`` deep, cut to ``size`` (default: whole)."""
        return sum(self.model_sizes[size][:depth]) if self.model_sizes else self.model_width * depth


def _unit(values: np.ndarray) -> np.ndarray:
    """``values`` clipped to [0, 1] in place (``np.clip``'s dispatch costs more than the clipping here)."""
    return np.minimum(np.maximum(values, 0.0, out=values), 1.0, out=values)


def _level_counts(planned: list[int] | np.ndarray, matched: list[int] | np.ndarray, levels: int) -> np.ndarray:
    """[rows, 2, levels] bool: per row, the levels 1..min(matched + 1, planned) it reached and 1..min(matched,
    planned) it accepted. A level planned but not matched counts as a rejection, also where nothing was drafted
    there (a lookup with no or a short match): the step's verify forward was as wide as its deepest row, so that
    row paid for it and gained nothing."""
    last = np.minimum(np.asarray(matched)[:, None] + (1, 0), np.asarray(planned)[:, None])  # [rows, 2]
    level = np.arange(levels)
    return (level <= last[:, :, None]) & (level > 0)


class _Rates:
    """Per-level acceptance pseudo-counts ("reached level j", "accepted at level j"), exponentially decayed: the
    batch's, per drafter (a row's own are its ``RowMemory.rates``).

    numpy, not torch: a few numbers, read and updated at every step."""

    def __init__(self, depth: int, prior: float = 0.5, weight: float = 1.0, decay: float = 0.9) -> None:
        # ``prior`` with ``weight`` pseudo-steps: what an untried level is believed to accept.
        self.reached = np.full(depth + 1, weight)
        self.accepted = np.full(depth + 1, prior * weight)
        self.decay = decay

    def observe(self, planned: list[int], matched: list[int]) -> None:
        """One step of rows with these planned depths and matches (``_level_counts``)."""
        reached, accepted = _level_counts(planned, matched, len(self.reached)).sum(0)
        if not reached.any():  # a plain step says nothing: the evidence stays as it was
            return
        # Every level ages with each drafting step, also levels not reached: a level's lone old rejection fades
        # towards the rate pooled over all levels instead of pinning it (see ``rate``).
        self.reached = self.reached * self.decay + reached
        self.accepted = self.accepted * self.decay + accepted

    @property
    def rate(self) -> np.ndarray:
        """Per level, its own counts pulled towards the rate pooled over all levels with ``POOLED_STRENGTH``
        pseudo-steps. A draft's per-token agreement changes little with depth, so a level seldom drafted borrows
        the others' evidence: with its own counts alone, one rejection at depth 3 held a self-draft that accepted
        everything at depth 2 for 40 steps (only probes, every 8 to 16 steps, could lift it)."""
        pooled = (self.accepted[1:].sum() + 1e-3 * PRIOR_ACCEPTANCE) / (self.reached[1:].sum() + 1e-3)
        return _unit((self.accepted + POOLED_STRENGTH * pooled) / (self.reached + POOLED_STRENGTH))


# What an untried level is believed to accept, before the first step's evidence (one pseudo-step). Optimistic:
# trying a depth that does not pay costs a step or two, never trying one that does costs the run. At 0.5 the
# self-draft started plain and climbed one level per probe: depth 5 after about 100 of a request's 128 steps.
PRIOR_ACCEPTANCE = 0.8
POOLED_STRENGTH = 2.0
# The hold-back's memory, per row-step (about 30 steps of one row; one batch-64 step outweighs all before it),
# and the evidence it needs: two drafting steps at batch 16 or more, about 25 at batch 1.
GAIN_DECAY = 0.97
GAIN_EVIDENCE = 16.0
COST_REUSE_STEPS = 16


class OnlinePolicy(LengthPolicy):
    """Per row, the drafters and depth with the most expected tokens per second, learnt on the fly.

    Acceptance: per level and per drafter (model draft, n-gram lookup), for every row (code and prose differ in one
    batch) pulled towards the batch-wide rates. A drafter's level counts as accepted where its best chain agrees
    with the tokens the step emitted, so both drafters learn from every step whichever won. Costs: a calibration
    as the prior, corrected by the forwards the engine times (``LearnedCosts``: rows, tokens per row, context).
    Options per row: plain decoding, lookup, model draft, or both, at depths 1..max; the row takes the best
    option if it beats plain decoding by ``margin`` (the cost model's error), and probes one level deeper now and
    then (within ``probe_budget`` of the time) to keep the deeper rates fresh and to come back from depth 0.

    Reproducible seeded sampling: a row marked ``fixed`` (T > 0 with a seed) decides from its own past
    acceptance, a fixed prior instead of the batch's rates, the calibration alone (cached per machine) for costs,
    the engine's full batch for rows, and its own step count for probes: nothing timed, nothing of other rows.
    """

    def __init__(
        self,
        max_depth: int,
        sources: Sources,
        verify_cost: BatchCosts,
        draft_cost: BatchCosts | None,
        capacity: int = 1,
        draft_scale: Callable[[], float] | None = None,
        decay: float = 0.9,
        probe_every: int = 8,
        probe_budget: float = 0.02,
        margin: float = 0.05,
        row_strength: float = 2.0,
    ) -> None:
        super().__init__(max_depth)
        self.sources = sources
        self.prior_verify, self.prior_draft = verify_cost, draft_cost
        self.verify_cost = LearnedCosts(verify_cost)
        self.draft_cost = (LearnedCosts(draft_cost, until_timed=self.verify_cost) if draft_cost is not None
                           else None)
        self.capacity = capacity
        # The drafting forward's cost relative to the draft's calibration, which a layer-skipping draft changes as
        # it switches layer sets: draft costs are learnt and predicted in units of the calibrated draft.
        self.draft_scale = draft_scale or (lambda: 1.0)
        self.decay = decay
        self.probe_every = probe_every
        self.probe_budget = probe_budget
        self.margin = margin
        self.row_strength = row_strength
        self.batch_rates = {key: _Rates(max_depth, PRIOR_ACCEPTANCE, decay=decay) for key in sources.keys}
        # Per row (``RowMemory.rates``), [2, keys, depth + 1]: its own decayed ("reached", "accepted") counts per key
        # of ``Sources.keys`` and level (no prior: ``_row_rates`` pulls them towards the batch's). One array per row,
        # so a step stacks its rows and decides for all of them at once: row by row, planning took ~55 us a row.
        self.steps = 0
        # Realized goodput of the steps that drafted, relative to plain decoding's predicted for the same rows and
        # context: when drafting has not paid, rows decode plainly and draft only on probe steps (the cost model
        # alone drafted at 0.78x of plain at batch 16 on 2 CPU cores). Both token sums decay per row-step, so the
        # verdict weighs evidence as rows x steps: one batch-64 step counts as 64 steps of one row, whose gain
        # swings with every rejection.
        self.gain_tokens = 0.0
        self.gain_plain_tokens = 0.0
        self.gain_evidence = 0.0  # decayed row-steps behind the two sums
        self.gain_steps = 0
        # Plain steps' measured seconds over the cost model's prediction: the plain reference is anchored on plain
        # steps themselves (the model's one scale also absorbs the drafting steps' errors).
        self.plain_correction = 1.0
        self._cost_memo: dict[tuple, tuple[int, np.ndarray, bool]] = {}  # key -> (step, option costs, payable)

    # ------------------------------------------------------------------------------------------- costs
    def step_seconds(
        self, model_depth: int, lookup_depth: int, rows: int, context: float = 0.0, fixed: bool = False,
        size: int = -1,
    ) -> float:
        """Predicted seconds of one step in which every row drafts like this (``size``: the model's tree cut to
        ``Sources.model_sizes[size]``; the draft still drafts the whole tree, cutting it saves verification)."""
        src = self.sources
        verify = self.prior_verify if fixed else self.verify_cost
        draft = self.prior_draft if fixed else self.draft_cost
        tokens = src.root_width + src.model_nodes(model_depth, size) + src.lookup_width * lookup_depth
        seconds = verify(rows, tokens) if fixed else verify(rows, tokens, context)
        if model_depth and draft is not None:
            first = src.prefix_tokens + src.root_width
            later = src.model_width + (src.lookup_width if lookup_depth else 0)
            scale = self.draft_scale()
            for width in [first] + [later] * (model_depth - 1):
                seconds += scale * (draft(rows, width) if fixed else draft(rows, width, context))
        return seconds

    # ------------------------------------------------------------------------------------------ choices
    def _row_rates(self, rows: list[RowMemory], fixed: list[bool]) -> np.ndarray:
        """[R, keys, depth + 1]: each row's acceptance per key of ``Sources.keys`` and level, its own counts pulled
        towards the batch's rates (a seeded row's: towards a fixed prior) with ``row_strength`` pseudo-steps."""
        shape = (2, len(self.sources.keys), self.max_depth + 1)
        for memory in rows:
            if memory.rates is None:
                memory.rates = np.zeros(shape)
        counts = np.array([memory.rates for memory in rows])  # np.array: np.stack's dispatch costs more
        base = np.array([self.batch_rates[key].rate for key in self.sources.keys])[None]
        if any(fixed):
            base = np.where(np.array(fixed)[:, None, None], PRIOR_ACCEPTANCE, base)
        return _unit((counts[:, 1] + self.row_strength * base) / (counts[:, 0] + self.row_strength))

    @cached_property
    def _options(self) -> list[tuple[int, int, int]]:
        """(model depth, size, lookup depth) this tree can take, plain decoding first; in ``_expected_tokens``'s
        order."""
        depths, sizes, whole = range(1, self.max_depth + 1), range(self.sources.sizes), self.sources.sizes - 1
        model = [(d, size) for size in sizes for d in depths]
        options = [(0, whole, 0)]
        if self.sources.model_width:
            options += [(d, size, 0) for d, size in model]
        if self.sources.lookup_width:
            options += [(0, whole, d) for d in depths]
        if self.sources.model_width and self.sources.lookup_width:
            options += [(d, size, d) for d, size in model]
        return options

    @cached_property
    def _allowed(self) -> np.ndarray:
        """Per option of ``_options``: 1 where a step can run it, else 0 (``Sources.cuts_at_full_depth``)."""
        whole = self.sources.sizes - 1
        return np.array([not self.sources.cuts_at_full_depth or size == whole or max(m, lk) == self.max_depth
                         for m, size, lk in self._options], dtype=float)

    def _expected_tokens(self, rates: np.ndarray) -> np.ndarray:
        """[R, options]: per row (``_row_rates``) and option of ``_options``, 1 + expected accepted drafted tokens,
        where level j is reached if some drafter's chain still agrees there (every depth in one pass).

        A tree cut smaller never agrees further than a larger one holding it: each size's rates are at least the
        smaller sizes' (a size seldom planned keeps its prior otherwise)."""
        sizes = self.sources.sizes
        expected = [np.ones((len(rates), 1))]
        model = None
        if self.sources.model_width:  # the model's keys come first, one per size
            model = rates[:, :sizes, 1:]  # [R, sizes, depth]
            model = np.cumprod(np.maximum.accumulate(model, axis=1) if sizes > 1 else model, axis=2)
            expected.append((1 + np.cumsum(model, axis=2)).reshape(len(rates), -1))
        if self.sources.lookup_width:  # the lookup's key comes last
            lookup = np.cumprod(rates[:, -1, 1:], axis=1)
            expected.append(1 + np.cumsum(lookup, axis=1))
            if model is not None:
                both = 1 + np.cumsum(1 - (1 - model) * (1 - lookup[:, None]), axis=2)
                expected.append(both.reshape(len(rates), -1))
        return np.concatenate(expected, axis=1)

    def plan_rows(
        self, memories: list[RowMemory], contexts: list[int] | None = None, fixed: list[bool] | None = None
    ) -> RowPlan:
        """Per row: the model's depth, the lookup's (None where the tree has no lookup siblings) and the size its
        tree is cut to (None where it has one size)."""
        rows = len(memories)
        contexts = contexts or [0] * rows
        fixed = fixed or [False] * rows
        # Python lists, one tensor at the end: a tensor item assignment per row cost ~4 us a row. Rows are chosen
        # for all at once (``_row_rates``, ``_expected_tokens``); only probes go row by row.
        plans = [(0, self.sources.sizes - 1, 0)] * rows
        options = self._options
        costs: dict[tuple, np.ndarray] = {}  # per cost key, every option's seconds
        probe_costs: dict[tuple, float] = {}  # per (cost key, probe), its seconds
        keys, payable_rows = [], []
        step = self.steps + 1  # this step's number; ``observe`` counts it
        scale = self.draft_scale()  # a switch of the draft's layer set prices every option anew
        for row, (context, is_fixed) in enumerate(zip(contexts, fixed)):
            key = (self.capacity if is_fixed else rows, 0 if is_fixed else context // 64, is_fixed, scale)
            keys.append(key)
            if key not in costs:
                costs[key] = self._option_costs(key, context, step)
            if self._cost_memo[key][2]:
                payable_rows.append(row)
        if not payable_rows:
            return self._row_plan(plans)
        memories_payable = [memories[row] for row in payable_rows]
        fixed_payable = [fixed[row] for row in payable_rows]
        option_costs = np.array([costs[keys[row]] for row in payable_rows])  # [P, options]
        expected = self._expected_tokens(self._row_rates(memories_payable, fixed_payable))
        speed = expected / np.maximum(option_costs, 1e-9) * self._allowed
        best_options = speed.argmax(1)  # the first best, as ``max`` took it
        best_options[speed.max(1) < (1 + self.margin) * speed[:, 0]] = 0
        held_back = self.held_back
        gain = self.drafting_gain
        for row, memory, is_fixed, best in zip(payable_rows, memories_payable, fixed_payable, best_options.tolist()):
            key, plan = keys[row], options[best]
            # Probe one level deeper with every drafter, and the model's tree one size larger, now and then (a
            # drafter left out comes back in at depth 1), so unused depths, sizes and drafters keep being measured:
            # at most ``probe_budget`` of the time. Held back (drafting did not pay), the probe is the row's choice.
            model_depth, size, lookup_depth = plan
            deeper = (min(model_depth + 1, self.max_depth) if self.sources.model_width else 0,
                      min(size + 1, self.sources.sizes - 1),
                      min(lookup_depth + 1, self.max_depth) if self.sources.lookup_width else 0)
            if self.sources.cuts_at_full_depth and max(deeper[0], deeper[2]) < self.max_depth:
                deeper = (deeper[0], self.sources.sizes - 1, deeper[2])
            if best and not is_fixed and held_back:
                plan, deeper, best = options[0], plan, 0
            if deeper != plan:
                if (key, deeper) not in probe_costs:
                    model_depth, size, lookup_depth = deeper
                    probe_costs[key, deeper] = self.step_seconds(model_depth, lookup_depth, key[0], contexts[row],
                                                                 is_fixed, size)
                extra = probe_costs[key, deeper] / max(float(costs[key][best]), 1e-9) - 1
                if held_back and not is_fixed:  # drafting steps cost more than modelled: as much rarer
                    extra /= max(gain, 0.1)
                # Rows probe on the same steps: one row drafting deepens the whole batch's forwards, so probes on
                # different steps cost every step (0.59x of plain at batch 16); powers of two keep rows probing at
                # different rates in step. A seeded row counts its own steps (its choices must not depend on other
                # rows).
                period = 1 << math.ceil(math.log2(max(self.probe_every, extra / self.probe_budget, 1)))
                if (memory.steps + 1 if is_fixed else step) % period == 0:
                    plan = deeper
            plans[row] = plan
        return self._row_plan(plans)

    def _option_costs(self, key: tuple, context: int, step: int) -> np.ndarray:
        """Every option's predicted seconds for rows of this cost key (rows, context bucket, fixed, draft scale).

        Costs move slowly (corrections by timed steps): reused for COST_REUSE_STEPS steps, for ever from the fixed
        calibration. Every option's cost for every row bucket each step took 2% of a batch-16 step that drafted
        nothing."""
        batch, _, is_fixed, _ = key
        memo = self._cost_memo.get(key)
        if memo is None or (not is_fixed and step - memo[0] >= COST_REUSE_STEPS):
            option_costs = [self.step_seconds(m, lk, batch, context, is_fixed, size) for m, size, lk in self._options]
            # Whether any option could pay were every drafted token accepted: where none could (a large batch on a
            # few CPU cores), probing cannot find one either and only widens the batch's forwards.
            memo = self._cost_memo[key] = (step, np.array(option_costs), any(
                (1 + max(m, lk)) / max(c, 1e-9) >= (1 + self.margin) / max(option_costs[0], 1e-9)
                for (m, _, lk), c in zip(self._options[1:], option_costs[1:])))
        return memo[1]

    def _row_plan(self, plans: list[tuple[int, int, int]]) -> RowPlan:
        """The rows' (model depth, size, lookup depth) as a ``RowPlan``."""
        # numpy, then one tensor: torch.tensor of a list of tuples costs several times more.
        model_depths, sizes, lookup_depths = torch.from_numpy(np.array(plans, dtype=np.int64).reshape(-1, 3).T.copy())
        if not self.sources.model_width:  # a lookup-only tree: its depth is the tree's depth
            return RowPlan(lookup_depths)
        return RowPlan(model_depths, lookup_depths if self.sources.lookup_width else None,
                       sizes if self.sources.sizes > 1 else None)

    def plan(self, rows: list[RowMemory]) -> torch.Tensor:
        return self.plan_rows(rows).depths

    @property
    def drafting_gain(self) -> float:
        """Tokens per second of the drafting steps over plain decoding's (1 before any drafting step)."""
        return self.gain_tokens / self.gain_plain_tokens if self.gain_plain_tokens > 0 else 1.0

    @property
    def held_back(self) -> bool:
        """Drafting steps have realized less goodput than plain decoding (by more than the margin), over at least
        two steps and ``GAIN_EVIDENCE`` row-steps."""
        return (self.gain_steps >= 2 and self.gain_evidence >= GAIN_EVIDENCE
                and self.drafting_gain < 1 - self.margin)

    # ---------------------------------------------------------------------------------------- learning
    def _observe_gain(self, record: StepRecord) -> None:
        timing = record.timing
        if timing is None:
            return
        rows, context = len(record.rows), timing.verify[2]
        seconds = timing.verify_seconds + timing.draft_seconds
        plain = self.step_seconds(0, 0, rows, context)
        if not any(record.drafted_depth):
            self.plain_correction = 0.8 * self.plain_correction + 0.2 * seconds / max(plain, 1e-9)
            return
        decay = GAIN_DECAY**rows
        self.gain_tokens = decay * self.gain_tokens + rows + sum(record.accepted)
        self.gain_plain_tokens = decay * self.gain_plain_tokens + seconds / max(plain * self.plain_correction,
                                                                                1e-9) * rows
        self.gain_evidence = decay * self.gain_evidence + rows
        self.gain_steps += 1

    def _observed(self, record: StepRecord, key: tuple[str, int]) -> tuple[list[int], list[int]]:
        """(planned depths, matched depths) per row for the rates of ``key``."""
        name, size = key
        # Without per-drafter matches (a one-drafter tree), the accepted run is the drafter's match.
        if name == "lookup":
            matched = record.lookup_matched if record.lookup_matched is not None else record.accepted
            if not self.sources.model_width or record.lookup_planned is None:  # lookup alone: the planned depth
                return record.planned_depth, matched
            return record.lookup_planned, matched
        matched = record.model_matched if record.model_matched is not None else record.accepted
        if record.planned_size is None or record.size_matched is None:
            return record.planned_depth, matched
        # A size above the row's own says nothing this step (it was not drafted): as if not planned.
        planned = [depth if size <= own else 0 for depth, own in zip(record.planned_depth, record.planned_size)]
        return planned, record.size_matched[size]

    def observe(self, record: StepRecord) -> None:
        self.steps += 1
        for memory, is_fixed in zip(record.rows, record.fixed or []):
            if is_fixed:  # only a seeded row's probes count its own steps
                memory.steps += 1
        known = [row for row, memory in enumerate(record.rows) if memory.rates is not None]
        counts = np.array([record.rows[row].rates for row in known]) if known else None  # [M, 2, K, L]
        for k, key in enumerate(self.sources.keys):
            plans, got = self._observed(record, key)
            if not any(plans):  # nothing planned reaches no level: the rates stay as they are (``_Rates.observe``)
                continue
            self.batch_rates[key].observe(plans, got)
            if counts is None:
                continue
            # A row's own counts, as ``_Rates.observe`` of that row alone: every level aged, its levels added. Rows
            # that planned no level for this key are left as they are (a factor 1, nothing added).
            depth, taken = np.array(plans), np.array(got)
            if len(known) < len(plans):
                depth, taken = depth[known], taken[known]
            added = _level_counts(depth, taken, self.max_depth + 1)  # [M, 2, L]
            counts[:, :, k] = counts[:, :, k] * np.where(depth > 0, self.decay, 1.0)[:, None, None] + added
        for row, row_counts in zip(known, counts if counts is not None else []):
            record.rows[row].rates = row_counts
        if record.timing is not None:
            timing = record.timing
            self.verify_cost.observe([timing.verify], timing.verify_seconds)
            if self.draft_cost is not None and timing.drafts:
                self.draft_cost.observe(timing.drafts, timing.draft_seconds / record.draft_scale)
        self._observe_gain(record)


class _HeadPolicy(LengthPolicy):
    needs_hidden_states = True
    cuts = True

    def __init__(self, max_depth: int, head: DraftSignalMLP) -> None:
        super().__init__(max_depth)
        self.head = head

    def to(self, device: torch.device) -> LengthPolicy:
        self.head.to(device)
        return self

    @torch.no_grad()
    def predict(self, level: int, token_probs: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        if hidden is None:
            raise ValueError("trained length policies need the draft's hidden states")
        return torch.sigmoid(self.head(DraftSignalMLP.features(hidden, token_probs, level)))


class ThresholdPolicy(_HeadPolicy):
    """SpecDec++: a candidate drafts on while P(all its drafted tokens are accepted) >= 1 - threshold."""

    def __init__(self, max_depth: int, head: DraftSignalMLP, threshold: float) -> None:
        super().__init__(max_depth, head)
        self.threshold = threshold
        self.all_accepted: torch.Tensor | None = None

    def keep(self, level, depths, token_probs, hidden):
        accept = self.predict(level, token_probs, hidden)
        if level == 1 or self.all_accepted is None:
            self.all_accepted = torch.ones_like(accept)
        self.all_accepted = self.all_accepted * accept
        kept, deeper = super().keep(level, depths, token_probs, hidden)
        return kept, deeper & (1 - self.all_accepted <= self.threshold)


class DecisionPolicy(_HeadPolicy):
    """Lu et al.: a learned stop/continue decision after each drafted token."""

    def keep(self, level, depths, token_probs, hidden):
        kept, deeper = super().keep(level, depths, token_probs, hidden)
        return kept, deeper & (self.predict(level, token_probs, hidden) >= 0.5)


def make_policy(
    config: SpeculativeConfig,
    sources: Sources,
    costs: Callable[[], tuple[BatchCosts, BatchCosts | None]],
    capacity: int = 1,
    draft_scale: Callable[[], float] | None = None,
) -> LengthPolicy:
    """The configured policy; ``costs`` (verify, draft) is only measured when the online policy needs it;
    ``draft_scale``: the drafting forward's cost relative to the calibrated draft's, as it changes."""
    depth = config.max_depth
    if config.length_policy == "static" or depth == 0:
        return LengthPolicy(depth)
    if config.length_policy == "heuristic":
        return HeuristicPolicy(depth)
    if config.length_policy == "online":
        return OnlinePolicy(depth, sources, *costs(), capacity=capacity, draft_scale=draft_scale)
    if config.length_policy == "threshold":
        return ThresholdPolicy(depth, DraftSignalMLP.load(config.acceptance_head), config.stop_threshold)
    return DecisionPolicy(depth, DraftSignalMLP.load(config.decision_model))
