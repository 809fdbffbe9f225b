"""What the engine tests share: their prompts, a configuration builder, runs on a chosen device, and the
reference of a sampled law (transformers' warpers transcribed) with its chi-square check."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import torch
from scipy.stats import chi2

from decoding import Config, Engine, Request
from decoding.verification.tree import TreeTopology

PROMPTS = [
    "abc abc abc abc",
    "hello world",
    "the quick brown fox jumps over the lazy dog. the quick brown",
    "a",
    "banana bandana banana",
    "so it goes, so it goes",
    "zebra",
    "one two one two one",
]


MAX_TOKENS = 24


def make_config(**speculative) -> Config:
    batch_size = speculative.pop("batch_size", 4)
    sampling = speculative.pop("sampling", {"max_tokens": MAX_TOKENS})
    if speculative.get("method") == "draft_model":
        speculative.setdefault("model", "in-memory")
    return Config.model_validate(
        {"model": "in-memory", "batch_size": batch_size, "speculative": speculative, "sampling": sampling}
    )


def price_drafts_to_pay(monkeypatch, target: torch.nn.Module, draft_share: float = 0.05) -> None:
    """Fixes the online policy's calibration (``build.calibrate_batch``) at costs where drafting pays: a
    verification nearly flat in its tokens, a draft forward ``draft_share`` of the target's. Its first steps then
    draft on any machine under any load (calibrated beside the other test worker, the real model's int4 self-draft
    was priced too dear to draft at all in 64 steps); what it learns from the forwards it times steers it after."""
    from decoding.drafting.costs import BatchCosts, CostTable
    from decoding.engine import build

    def costs(model: torch.nn.Module, max_tokens: int, full_rows: int, *args, **kwargs) -> BatchCosts:
        scale = 1.0 if model is build.model_view(target) else draft_share
        most = max(max_tokens, 2)
        return BatchCosts(one_row=CostTable([(1, 0.010 * scale), (most, 0.011 * scale)]),
                          full=CostTable([(1, 0.020 * scale), (most, 0.022 * scale)]), full_rows=full_rows)

    monkeypatch.setattr(build, "calibrate_batch", costs)


_MOVED: dict[tuple[int, str], torch.nn.Module] = {}


def on_device(model, device: torch.device | None):
    """The model on ``device`` (a copy, made once: the session's models stay on the CPU for the references)."""
    if model is None or device is None or device.type == "cpu":
        return model
    key = (id(model), str(device))
    if key not in _MOVED:
        _MOVED[key] = copy.deepcopy(model).to(device)
    return _MOVED[key]


def lookup_flags(topology: TreeTopology, results: list, lookups: int) -> list[bool]:
    """Whether each drafted token of the lookup siblings (the last ``lookups`` chains of every level, after a static
    tree's nodes) was accepted, from the results' token statistics (step, depth, candidate, ..., accepted)."""
    first = topology.num_candidates - lookups
    return [stat[-1] for r in results for stat in r.token_stats if stat[2] >= topology.tree_width(stat[1]) + first]


def transformers_greedy(model, tokenizer, prompts=PROMPTS) -> list[list[int]]:
    """transformers' greedy decoding of ``prompts``, one prompt at a time (the reference the engine's tokens equal)."""
    outputs = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=MAX_TOKENS)
        outputs.append(generated[0, ids.shape[1]:].tolist())
    return outputs


def run(config: Config, tokenizer, target, draft=None, prompts=PROMPTS, device=None) -> list:
    engine = Engine(config, target=on_device(target, device), tokenizer=tokenizer, draft=on_device(draft, device))
    return engine.generate([Request(id=str(i), prompt=p) for i, p in enumerate(prompts)])


# --------------------------------------------------------------------------------------------------------- sampled laws


SMALL_VOCAB = 6  # ids 0..5; id 2 is EOS

# Seeded rows a sampling-law test draws: the fewest that keep the chi-square test's power. A law whose chi-square
# divergence from the exact one is D >= 0.05 must fail the test (p < 1e-3) with probability >= 0.99: with N rows the
# statistic is noncentral chi-square with lambda = N * D, and at df <= 20 (every test here keeps at most 17) that
# takes lambda >= 60, so N = 1,200. Faults injected into verification, measured on the 7 x 7 pairs with two
# draft-initialized candidates: the residual updated after the first rejection only, D = 0.053-0.055 (p ~ 1e-12 at
# 1,200 rows); no residual at all, D = 0.19-0.27; rejected tokens left in q, D = 0.78. (With target-initialized
# candidates the first of these moves the law less, D = 0.006; the draft-initialized cases fail for it.)
LAW_SAMPLES = 1200


END = SMALL_VOCAB  # "no token": the sequence already ended


def reference_warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0,
                   logit_bias: dict | None = None) -> torch.Tensor:
    """An independent transcription of vLLM's sampler on raw logits: ``logit_bias`` added first (keys as JSON or
    Python give them), then transformers' warpers in vLLM's order: temperature, min-p, top-k, then top-p."""
    logits = logits.double().clone()
    for token, bias in (logit_bias or {}).items():
        logits[int(token)] += bias
    logits = logits / temperature
    if min_p:
        probs = logits.softmax(-1)
        logits[probs < min_p * probs.max()] = -torch.inf
    if top_k:
        logits[logits < logits.topk(top_k).values[-1]] = -torch.inf
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for token in order.tolist():
        keep[token] = True
        mass += float(probs[token])
        if mass >= top_p:
            break
    probs = probs * keep
    return probs / probs.sum()


def sequence_law(model, prompt: list[int], warp: dict, length: int,
                 mask: Callable[[list[int], torch.Tensor], None] | None = None) -> Iterator[tuple[list[int], float]]:
    """Every sequence of ``length`` generated tokens (END after EOS) with its exact probability under the target's
    warped law, by enumerating prefixes; ``mask(prefix, logits)`` may constrain each prefix's logits in place."""

    def extend(prefix: list[int], weight: float) -> Iterator[tuple[list[int], float]]:
        if len(prefix) == length or (prefix and prefix[-1] == 2):
            yield prefix + [END] * (length - len(prefix)), weight
            return
        with torch.no_grad():
            logits = model(torch.tensor([prompt + prefix])).logits[0, -1].float()
        if mask is not None:
            mask(prefix, logits)
        law = reference_warp(logits, **warp)
        for token in range(len(law)):
            if law[token] > 0:
                yield from extend(prefix + [token], weight * float(law[token]))

    return extend([], 1.0)


def exact_joint_law(model, prompt: list[int], warp: dict, positions: tuple[int, int]) -> torch.Tensor:
    """Exact law of generated tokens at ``positions`` (0-based), END after EOS, by enumerating prefixes."""
    joint = torch.zeros(SMALL_VOCAB + 1, SMALL_VOCAB + 1, dtype=torch.float64)
    for tokens, weight in sequence_law(model, prompt, warp, max(positions) + 1):
        joint[tokens[positions[0]], tokens[positions[1]]] += weight
    return joint


def chi_square_pvalue(counts: torch.Tensor, law: torch.Tensor) -> float:
    counts, law = counts.flatten().double(), law.flatten()
    total = counts.sum()
    assert counts[law == 0].sum() == 0, "sampled an outcome of probability 0"
    expected = law * total
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return float(chi2.sf(statistic, int(keep.sum()) - 1))


def law_requests(engine: Engine, prompt: list[int], samples: int) -> list[Request]:
    """``samples`` seeded rows of ``prompt`` for a sampled-law test. Under ``recycle`` they take their own streams
    of a fixed run seed instead, unseeded: it keeps seeded rows off the table every row fills (they would draft no
    recycled node), and the fixed run seed keeps the test as deterministic."""
    if engine.config.speculative.method == "recycle":
        engine.run_seed = 0
        return [Request(id=str(i), prompt_token_ids=prompt) for i in range(samples)]
    return [Request(id=str(i), prompt_token_ids=prompt, sampling={"seed": i}) for i in range(samples)]


def sampled_pairs(results: list, positions: tuple[int, int]) -> torch.Tensor:
    """How often each pair of tokens was generated at ``positions`` (0-based) over ``results``, END after EOS."""
    counts = torch.zeros(SMALL_VOCAB + 1, SMALL_VOCAB + 1)
    for result in results:
        tokens = result.token_ids + [END] * (max(positions) + 1)
        counts[tokens[positions[0]], tokens[positions[1]]] += 1
    return counts


def assert_pairs_follow_target_law(target, prompt: list[int], warp: dict, results: list) -> None:
    """The sampled tokens at positions (0, 1) and (1, 2) of ``results`` (END after EOS) follow ``target``'s exact
    joint law there (chi-square, p > 1e-3)."""
    for positions in ((0, 1), (1, 2)):
        counts = sampled_pairs(results, positions)
        assert chi_square_pvalue(counts, exact_joint_law(target, prompt, warp, positions)) > 1e-3, positions


def assert_speculative_sampling_follows_law(reference, target, draft, tokenizer) -> None:
    """Temperature 1 with ``draft`` proposing for ``target`` (two candidates, three tokens deep, ``LAW_SAMPLES``
    seeded rows of one prompt): drafts were proposed, some kept and some rejected, and the sampled pairs follow
    ``reference``'s exact joint law (the float model ``target`` must compute)."""
    prompt, samples, warp = [3, 4, 5, 3, 4, 5, 3], LAW_SAMPLES, {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    config = make_config(method="draft_model", num_candidates=2, num_speculative_tokens=3, length_policy="static",
                         batch_size=64, sampling={"max_tokens": 4, **warp})
    engine = Engine(config, target=target, tokenizer=tokenizer, draft=draft)
    results = engine.generate(law_requests(engine, prompt, samples))
    drafted = sum(sum(r.per_step_drafted) for r in results)
    accepted = sum(sum(r.per_step_accepted) for r in results)
    assert drafted > samples and 0 < accepted < drafted
    assert_pairs_follow_target_law(reference, prompt, warp, results)
