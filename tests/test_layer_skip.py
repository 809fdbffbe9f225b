"""The layer-skipping self-draft (decoding/drafting/layer_skip.py): a layer subset computes the model without those
layers over the target's pool, greedy outputs equal plain decoding's and samples follow the target's law whichever
layers draft, ``auto`` tries its candidates on live steps and keeps the fastest, and bad settings are refused."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_cases import (
    LAW_SAMPLES,
    PROMPTS,
    SMALL_VOCAB,
    assert_pairs_follow_target_law,
    law_requests,
    make_config,
    run,
)
from pydantic import ValidationError
from tiny import tiny_model, tiny_tokenizer
from transformers import GemmaConfig, GemmaForCausalLM

from decoding import Engine, Request
from decoding.config import SpeculativeConfig
from decoding.drafting import layer_skip
from decoding.drafting.costs import BatchCosts, CostTable
from decoding.drafting.layer_skip import LayerSkipSearch, candidate_skips, kept_layers
from decoding.model.execution import Execution
from decoding.model.forward import forward_tree
from decoding.model.kv_cache import CacheShape, PagedKVCache
from decoding.model.lean_forward import lean_view
from decoding.verification.tree import chain_ancestors

LAYERS = 6


@pytest.fixture(scope="module")
def deep_target():
    return tiny_model(seed=11, layers=LAYERS)


@pytest.fixture(scope="module")
def plain(tokenizer, deep_target) -> list[list[int]]:
    """The engine's own plain greedy decoding of ``PROMPTS`` on the six-layer target."""
    return [r.token_ids for r in run(make_config(method="none"), tokenizer, deep_target)]


def _without_layers(model, kept: tuple[int, ...]):
    """``model`` as transformers runs it with only the ``kept`` decoder layers (a shallow copy)."""
    twin = copy.copy(model)
    twin._modules = dict(model._modules)
    twin.model = copy.copy(model.model)
    twin.model._modules = dict(model.model._modules)
    twin.model.layers = torch.nn.ModuleList([model.model.layers[i] for i in kept])
    twin.config = copy.copy(model.config)
    twin.config.num_hidden_layers = len(kept)
    twin.model.config = twin.config
    return twin


@pytest.mark.parametrize("kernels", ["cpu", "reference"])
def test_a_layer_subset_is_the_model_without_the_skipped_layers(deep_target, kernels) -> None:
    """The subset view over the whole model's pool computes what transformers computes with only those layers, and
    the whole view, sharing every weight, still computes the whole model."""
    whole = lean_view(deep_target)
    kept = (0, 2, 3, 5)
    subset = whole.with_layers(kept)
    assert subset is whole.with_layers(kept) and whole.with_layers(tuple(range(LAYERS))) is whole
    assert subset.num_layers == LAYERS and subset.stack.layers == kept
    assert all(any(w is v for v in whole.weights) for w in subset.weights)  # shared, not copied
    execution = Execution.resolve(None, torch.device("cpu"), quiet=True)
    if kernels == "reference":
        execution = Execution("cpu", "reference", False, False, 0)
    ids = torch.tensor([[5, 9, 12, 7, 3, 22, 14, 8, 30, 4, 11]])
    tokens = ids.shape[1]

    def logits_of(view) -> torch.Tensor:
        cache = PagedKVCache(CacheShape.of(deep_target.config), 2, 1, 32, block_size=16, dtype=torch.float32,
                             device=torch.device("cpu"), execution=execution)
        rows = cache.add_rows([tokens])
        logits, _ = forward_tree(view, cache, rows, ids, chain_ancestors(tokens), torch.ones(1, tokens, dtype=bool))
        return logits[0]

    with torch.no_grad():
        skipped = _without_layers(deep_target, kept)(ids, use_cache=False).logits[0]
        torch.testing.assert_close(logits_of(subset), skipped, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits_of(whole), deep_target(ids).logits[0], atol=1e-4, rtol=1e-4)


def test_the_configuration_refuses_what_cannot_skip_layers() -> None:
    assert SpeculativeConfig(layer_skip=[4, 1]).layer_skip == [1, 4]
    assert SpeculativeConfig(layer_skip="auto").layer_skip == "auto"
    assert SpeculativeConfig(method="ngram", layer_skip="auto").layer_skip is None  # another method: off
    for bad, words in [({"layer_skip": []}, "empty"), ({"layer_skip": [1, 1]}, "twice"),
                       ({"model": "some/draft", "layer_skip": "auto"}, "model 'target'"),
                       ({"layer_skip": [-1]}, "layer_skip"), ({"layer_skip": "half"}, "layer_skip")]:
        with pytest.raises(ValidationError, match=words):
            SpeculativeConfig(**bad)
    with pytest.raises(ValueError, match=r"layer\(s\) \[6, 9\]: the target has 6 layers"):
        kept_layers(6, [1, 6, 9])
    with pytest.raises(ValueError, match="skips all 2 layers"):
        kept_layers(2, [0, 1])


def test_an_engine_refuses_layers_the_target_lacks_and_a_target_without_the_lean_forward(tokenizer, deep_target
                                                                                           ) -> None:
    config = make_config(method="draft_model", model="target", layer_skip=[2, LAYERS])
    with pytest.raises(ValueError, match=r"names layer\(s\) \[6\]"):
        Engine(config, target=deep_target, tokenizer=tokenizer)
    torch.manual_seed(0)
    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=16)).eval()
    with pytest.raises(ValueError, match="layer_skip needs a target of the Llama family.*'gemma'"):
        Engine(make_config(method="draft_model", model="target", layer_skip=[1]), target=gemma,
               tokenizer=tiny_tokenizer())


def test_candidates_keep_the_first_and_last_layers_and_start_with_the_whole_draft() -> None:
    assert candidate_skips(30)[0] == ()
    for layers in (4, 6, 16, 30, 32):
        found = candidate_skips(layers)
        assert len(found) == len(set(found)) >= 2
        for skipped in found[1:]:
            assert 0 not in skipped and layers - 1 not in skipped and list(skipped) == sorted(set(skipped))
        assert [len(s) for s in found] == sorted(len(s) for s in found)  # more skipped, further down
    assert candidate_skips(2) == [()]


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize(("skip", "quantization", "width", "init", "policy"), [
    ([2, 3], None, 1, "draft", "static"), ([1, 4], "int4", 2, "target", "static"),
    ([3], None, 2, "draft", "online"), ("auto", None, 1, "draft", "static"), ("auto", "int4", 2, "target", "online"),
])
def test_greedy_outputs_are_plain_decoding_s_whichever_layers_draft(
    skip, quantization, width, init, policy, batch_size, tokenizer, deep_target, plain
) -> None:
    config = make_config(method="draft_model", model="target", quantization=quantization, layer_skip=skip,
                         num_candidates=width, candidate_init=init, length_policy=policy, num_speculative_tokens=3,
                         batch_size=batch_size)
    engine = Engine(config, target=deep_target, tokenizer=tokenizer)
    results = engine.generate([Request(id=str(i), prompt=p) for i, p in enumerate(PROMPTS)])
    assert [r.token_ids for r in results] == plain
    if policy == "static":
        assert sum(sum(r.per_step_drafted) for r in results) > 0
    search = engine.drafter.search
    if skip == "auto":
        assert search is not None and len(search.candidates) == 3
        if policy == "static" and batch_size == 1:  # enough drafting steps for the climb to try a skip
            assert search.candidates[0].steps > 0 and search.candidates[1].steps > 0
    else:
        assert search is None and engine.drafter.model.stack.layers == kept_layers(LAYERS, skip)


@pytest.mark.parametrize("skip", [[1, 2, 4], "auto"])
def test_sampling_with_skipped_layers_follows_the_target_s_law(skip, monkeypatch, tokenizer) -> None:
    """At temperature 1 a draft skipping layers is often rejected, and the samples still follow the target's exact
    joint law; ``auto`` tries layer sets on the way."""
    monkeypatch.setattr(layer_skip, "TRIAL_STEPS", 2)
    monkeypatch.setattr(layer_skip, "EXPLORE_EVERY", 4)
    target = tiny_model(seed=3, vocab_size=SMALL_VOCAB, layers=LAYERS)
    prompt = [3, 4, 5, 3, 4, 5, 3]
    warp = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    samples = LAW_SAMPLES
    config = make_config(method="draft_model", model="target", layer_skip=skip, num_candidates=2,
                         num_speculative_tokens=3, length_policy="static", batch_size=64,
                         sampling={"max_tokens": 4, **warp})
    engine = Engine(config, target=target, tokenizer=tokenizer)
    results = engine.generate(law_requests(engine, prompt, samples))
    drafted = sum(sum(r.per_step_drafted) for r in results)
    accepted = sum(sum(r.per_step_accepted) for r in results)
    assert drafted > samples and 0 < accepted < drafted  # speculation really happened, with rejections
    if skip == "auto":  # the climb tried a set skipping layers
        assert engine.drafter.search.candidates[1].steps > 0
    assert_pairs_follow_target_law(target, prompt, warp, results)


def test_a_seeded_run_with_auto_reproduces(monkeypatch, tokenizer, deep_target) -> None:
    """The layer sets are chosen from acceptance and the calibrated costs, never from timing: a seeded sampled run
    reproduces, layer switches included."""
    monkeypatch.setattr(layer_skip, "TRIAL_STEPS", 2)
    monkeypatch.setattr(layer_skip, "EXPLORE_EVERY", 3)
    config = make_config(method="draft_model", model="target", layer_skip="auto", num_speculative_tokens=3,
                         length_policy="static", batch_size=3,
                         sampling={"max_tokens": 24, "temperature": 1.0, "seed": 5})
    runs = []
    for _ in range(2):
        engine = Engine(config, target=deep_target, tokenizer=tokenizer)
        runs.append([r.token_ids for r in engine.generate([Request(id=str(i), prompt=p)
                                                           for i, p in enumerate(PROMPTS)])])
        assert engine.drafter.search.candidates[1].steps > 0  # the climb tried a set skipping layers
    assert runs[0] == runs[1]


def _priced_search(deep_target) -> LayerSkipSearch:
    search = LayerSkipSearch(lean_view(deep_target))
    flat = CostTable([(1, 1.0)])
    search.price(BatchCosts(flat, flat, 1), [BatchCosts(CostTable([(1, cost)]), CostTable([(1, cost)]), 1)
                                             for cost in (0.5, 0.4, 0.3)])
    return search


def test_auto_climbs_to_the_fastest_layer_set_and_follows_the_text(deep_target) -> None:
    """Synthetic steps of one row, one draft forward each: the tokens a layer set's steps emit decide, priced at its
    calibrated cost. The climb tries sets skipping more while they win, settles on the best, retries its neighbours
    less often each time they lose, and moves when the text changes which set is best."""
    search = _priced_search(deep_target)
    assert search.cost_scale == 1.0 and search.skipped == ()
    emits = {0: 3, 1: 3, 2: 2}  # tokens/s: 3 / 1.5 = 2.0, 3 / 1.4 = 2.14, 2 / 1.3 = 1.54

    def steps(count: int) -> list[int]:
        drafted = []
        for _ in range(count):
            drafted.append(search.current)
            search.observe(search.current, 1, 4, [(1, 1)], emits[search.current])
        return drafted

    trial, period = layer_skip.TRIAL_STEPS, layer_skip.EXPLORE_EVERY
    assert steps(3 * trial) == [0] * trial + [1] * trial + [2] * trial  # 1 beat the whole draft, 2 lost to 1
    assert search.best == 1 and search.cost_scale == pytest.approx(0.4 / 0.5)
    assert steps(2 * period) == [1] * 2 * period  # a neighbour lost: twice as long before the next retrial
    assert steps(trial) == [2] * trial
    assert steps(4 * period) == [1] * 4 * period
    assert steps(trial) == [0] * trial  # the other neighbour's turn
    assert steps(period) == [1] * period
    emits.update({1: 2})  # the text changed: skipping one layer now costs more than it saves (2 / 1.4 = 1.43)
    drafted = steps(period)
    assert search.best == 0 and drafted[:trial + 8].count(0) >= trial and drafted[-trial:] == [0] * trial
    emits.update({1: 4, 2: 4})  # and again: now skipping more pays (4 / 1.4 = 2.86, 4 / 1.3 = 3.08)
    drafted = steps(4 * period)  # its trials mix the new steps with the decayed old ones: it may take two
    assert search.best == 2 and drafted[-trial:] == [2] * trial


def test_the_skip_order_spreads_every_prefix_over_the_middle_layers() -> None:
    order = layer_skip.skip_order(30)
    assert sorted(order) == list(range(1, 29))
    assert order[:3] == [15, 8, 22] and all(1 <= layer <= 28 for layer in order)
    assert layer_skip.skip_order(2) == [] and layer_skip.skip_order(3) == [1]
