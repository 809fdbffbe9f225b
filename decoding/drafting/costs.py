"""Measured forward costs for the online length policy.

Costs are hardware facts, acceptance is a workload fact. The online policy adapts acceptance on the fly but
takes costs from a calibration measured once per (model, device, dtype, threads, rows) and cached, so its depth
decisions depend only on past steps and a fixed table: seeded sampling stays reproducible, and a noisy
neighbour on the machine cannot push the policy around.

Costs are measured for one row and for the engine's full batch, each over the tokens per row: a batch of 16
rows of 2 tokens is not priced like one row of 32 (per-row attention, cache and mask work).
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from decoding.model.execution import Execution
from decoding.model.kv_cache import CacheShape, PagedKVCache
from decoding.model.model_runner import ModelRunner
from decoding.paths import cache_dir
from decoding.verification.tree import chain_ancestors

log = logging.getLogger(__name__)

_CONTEXT = 32  # tokens already cached when timing, so attention over a cache is part of the cost
_ROUNDS = 5
# Of the measurement method and the forward it times (10: the lean forward over the paged cache): other tables are
# not reused.
_VERSION = 10
_memo: dict[tuple, list[tuple[int, float]]] = {}


@dataclass(frozen=True)
class CostTable:
    """Seconds per forward as a piecewise-linear function of the tokens in it."""

    points: list[tuple[int, float]]

    def __call__(self, tokens: float) -> float:
        points = self.points
        if not points:
            return 0.0
        if tokens <= points[0][0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if tokens <= x1:
                return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        if len(points) == 1:
            return points[0][1]
        (x0, y0), (x1, y1) = points[-2], points[-1]
        return y1 + max((y1 - y0) / (x1 - x0), 0.0) * (tokens - x1)


def _features(model: torch.nn.Module, batch: int, tokens: int, device: torch.device) -> torch.Tensor | None:
    """Zero feature inputs of the right shape for a feature draft (its cost does not depend on their values)."""
    if not getattr(model, "reads_features", False):
        return None
    return torch.zeros(batch, tokens, model.feature_size, device=device)


def forward_timers(
    model: torch.nn.Module, device: torch.device, batch: int, sizes: list[int], cached: int = _CONTEXT,
    captured: bool = False, execution: Execution | None = None,
) -> list[Callable[[], float]]:
    """Functions timing one forward of ``batch`` rows of ``size`` new tokens each (one per ``sizes``) after the
    same ``cached`` cached tokens (each warmed up once), run as ``execution`` says (default: the pool's default,
    ``PagedKVCache``). The context is prefilled once for all sizes: at 16 rows it is more tokens than a round of
    the forwards timed."""
    positions = cached + max(sizes)
    block_size = 16
    cache = PagedKVCache(CacheShape.of(model.config), batch * -(-positions // block_size), batch, positions,
                         block_size=block_size, dtype=next(model.parameters()).dtype, device=device,
                         execution=execution)
    rows = cache.add_rows([positions] * batch)
    vocab = model.config.vocab_size
    context = torch.randint(0, vocab, (batch, cached), device=device)
    runner = ModelRunner(model, cache, captured)  # replayed as the engine replays it (``captured``: its step shapes)
    runner.prefill(rows, context, chain_ancestors(cached), torch.ones(batch, cached, dtype=torch.bool),
                   logits_at=torch.tensor([cached - 1]), features=_features(model, batch, cached, device))
    cache.advance(rows, [cached] * batch)

    def timer(tokens: int) -> Callable[[], float]:
        ids = torch.randint(0, vocab, (batch, tokens), device=device)
        ancestors, valid = chain_ancestors(tokens), torch.ones(batch, tokens, dtype=torch.bool)
        features = _features(model, batch, tokens, device)

        def timed() -> float:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            # Uncommitted: every call rewrites the same slots, whatever its size.
            runner.verify(rows, ids, ancestors, valid, features=features)  # a draft level is the same forward
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - start

        timed()  # warm-up: kernels and allocations
        return timed

    return [timer(tokens) for tokens in sizes]


def forward_timer(
    model: torch.nn.Module, device: torch.device, batch: int, tokens: int, cached: int = _CONTEXT,
    captured: bool = False, execution: Execution | None = None,
) -> Callable[[], float]:
    """``forward_timers`` for one size."""
    return forward_timers(model, device, batch, [tokens], cached, captured, execution)[0]


def _sizes(max_tokens: int) -> list[int]:
    sizes, size = [], 1
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return [*sizes, max(max_tokens, 1)]


def calibrate(model: torch.nn.Module, max_tokens: int, batch: int = 1, disk_key: str | None = None,
              captured: bool = False, *, execution: Execution) -> CostTable:
    """Time forwards of ``batch`` rows of 1, 2, 4, ... ``max_tokens`` new tokens each, run as ``execution`` says;
    memoised per model object and cached on disk under ``disk_key``."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    setting = (str(device), str(dtype), torch.get_num_threads(), max_tokens, batch,
               captured and execution.graphs, execution.kernels, execution.compile)
    memo_key = (id(model), *setting)
    if memo_key in _memo:
        return CostTable(_memo[memo_key])
    # A table of this model measured up to more tokens holds these sizes too (an engine's tree size varies with its
    # configuration: the real-model tests calibrated the same target at 16, 11 and 6 tokens, 2-4 s each).
    larger = [key for key in _memo if key[:4] == memo_key[:4] and key[5:] == memo_key[5:] and key[4] >= max_tokens]
    if larger:
        return CostTable(_memo[min(larger, key=lambda key: key[4])])
    path = None
    if disk_key is not None:
        digest = hashlib.sha256(json.dumps([disk_key, _VERSION, *map(str, setting)]).encode()).hexdigest()[:16]
        path = cache_dir() / "costs" / f"{digest}.json"
        if path.exists():
            _memo[memo_key] = [tuple(p) for p in json.loads(path.read_text())]
            return CostTable(_memo[memo_key])
    log.info("calibrating forward costs of %s on %s, %d row(s) (once per machine)", disk_key or "model", device, batch)
    sizes = _sizes(max_tokens)
    timers = forward_timers(model, device, batch, sizes, captured=captured, execution=execution)
    # Interleaved rounds, median per size: a noisy moment spoils one sample of each size, not a whole size
    # (the table is cached for good, so one bad sample would steer the policy on every later run).
    rounds = [[timer() for timer in timers] for _ in range(_ROUNDS)]
    points = [(size, statistics.median(samples)) for size, samples in zip(sizes, zip(*rounds))]
    # Costs never shrink with more tokens; smoothing out timing noise keeps the policy's choices sane.
    for i in range(1, len(points)):
        points[i] = (points[i][0], max(points[i][1], points[i - 1][1]))
    _memo[memo_key] = points
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(points))
    return CostTable(points)


@dataclass(frozen=True)
class BatchCosts:
    """Seconds per forward of ``rows`` rows of ``tokens`` new tokens each: measured for one row and for the full
    batch, linear in the rows between the two."""

    one_row: CostTable
    full: CostTable
    full_rows: int

    def __call__(self, rows: int, tokens: float) -> float:
        single = self.one_row(tokens)
        if self.full_rows <= 1:
            return single
        return single + (self.full(tokens) - single) * (rows - 1) / (self.full_rows - 1)


def calibrate_batch(
    model: torch.nn.Module, max_tokens: int, full_rows: int, disk_key: str | None = None, captured: bool = False,
    *, execution: Execution,
) -> BatchCosts:
    """``BatchCosts`` up to ``max_tokens`` new tokens per row and ``full_rows`` rows (``captured``: the model's step
    shapes are captured at build, so they replay where ``execution`` replays graphs: ``ModelRunner``)."""
    one_row = calibrate(model, max_tokens, 1, disk_key, captured, execution=execution)
    full = calibrate(model, max_tokens, full_rows, disk_key, captured, execution=execution) if full_rows > 1 \
        else one_row
    return BatchCosts(one_row, full, full_rows)


class LearnedCosts:
    """Forward seconds learned on the fly from the forwards the engine actually times (Liu, Park & Shen 2025:
    adapt without offline benchmarking), starting from a calibration as the prior.

    seconds(rows, tokens, context) = a * prior(rows, tokens) + unit * (b * rows + c * rows * tokens) * context / 1024,
    with unit = prior(1, 1): ``a`` rescales the calibration to this device and load, ``b`` prices reading each row's
    cache (a plain step over ~700 cached tokens took 66 ms where the 32-token calibration said 34 ms), ``c`` the
    attention of each new token over it. Fitted by a Kalman filter on relative errors (10% timing noise), with a
    small random walk so the fit follows a machine whose speed drifts. Several forwards timed together are one
    observation of their sum.

    ``until_timed``: another model's learned costs (the draft's take the target's) to follow, scaled to this
    prior, until this model's own first forward is timed. Its forwards are then priced with what the other model
    learned about this device and context, not at the calibration's 32 cached tokens: at batch 64 on XSum (415
    cached tokens) the draft was priced at 165 ms a forward, ran at 720 ms, and one drafting step cost 2.7 s.
    """

    def __init__(
        self, prior: BatchCosts, noise: float = 0.1, drift: float = 1e-4, until_timed: LearnedCosts | None = None
    ) -> None:
        self.prior = prior
        self.until_timed = until_timed
        # Plain floats, neither torch nor numpy: three numbers, priced for every row and option and updated at
        # every step (numpy's per-call cost made observing a plain step ~0.1 ms, 7% of a launch-bound step).
        self.theta = [1.0, 0.0, 0.0]
        self.covariance = [[0.1, 0.0, 0.0], [0.0, 0.01, 0.0], [0.0, 0.0, 0.001]]
        self.noise = noise**2
        self.drift = drift
        self.observations = 0
        self._unit = prior(1, 1)

    def _prior_and_cache(self, rows: float, tokens: float, context: float) -> tuple[float, float]:
        """The prior's seconds, and the cache-reading unit relative to them."""
        prior = self.prior(rows, tokens)
        return prior, self._unit * rows * context / 1024 / max(prior, 1e-12)

    def __call__(self, rows: int, tokens: float, context: float = 0.0) -> float:
        if not self.observations and self.until_timed is not None:
            other = self.until_timed
            return other(rows, tokens, context) * self.prior(rows, tokens) / max(other.prior(rows, tokens), 1e-12)
        prior, cache = self._prior_and_cache(rows, tokens, context)
        a, b, c = self.theta
        return prior * max(a + cache * (b + c * tokens), 0.05)

    def observe(self, forwards: list[tuple[int, float, float]], seconds: float) -> None:
        """``forwards`` (rows, tokens per row, context) timed together took ``seconds``."""
        priors = [self._prior_and_cache(rows, tokens, context) for rows, tokens, context in forwards]
        expected = sum(prior for prior, _ in priors)
        if not forwards or expected <= 0 or seconds <= 0:
            return
        # Relative units: each forward's features (seconds per unit of each parameter, relative to the prior's
        # prediction: 1, cache, cache x tokens) weighted by its share of the prior's time.
        features = [0.0, 0.0, 0.0]
        for (prior, cache), (_, tokens, _) in zip(priors, forwards):
            share = prior / expected
            features[0] += share
            features[1] += share * cache
            features[2] += share * cache * tokens
        theta, covariance = self.theta, self.covariance
        error = seconds / expected - sum(t * f for t, f in zip(theta, features))
        spread = [sum(c * f for c, f in zip(row, features)) for row in covariance]
        denominator = self.noise + sum(f * s for f, s in zip(features, spread))
        gain = [s / denominator for s in spread]
        self.theta = [t + g * error for t, g in zip(theta, gain)]
        self.covariance = [[c - g * s + (self.drift if i == j else 0.0) for j, (c, s) in enumerate(zip(row, spread))]
                           for i, (row, g) in enumerate(zip(covariance, gain))]
        self.observations += 1
