"""The whole engine with the fused Triton layer (``execution.kernels: triton``), on this CPU under Triton's
interpreter (``conftest.py`` turns it on): greedy outputs equal transformers' and the engine's own plain decoding for
every kind of draft, and sampling follows the target's law while the engine really drafts. The interpreter runs each
kernel program in Python, so these runs are short (few prompts, few tokens) on models of two query heads sharing one
kv head: the smallest shapes that take every kernel path (grouped-query attention; two layers where a draft skips
one), each kernel program interpreted for half the heads of the shared tiny models."""

from __future__ import annotations

import pytest
import torch
from engine_cases import (
    PROMPTS,
    SMALL_VOCAB,
    chi_square_pvalue,
    exact_joint_law,
    law_requests,
    make_config,
    sampled_pairs,
)
from tiny import noisy_copy, tiny_model

from decoding import Config, Engine, Request
from decoding.config import ExecutionConfig

TRITON = ExecutionConfig(kernels="triton")
SHORT = {"max_tokens": 10}


def with_triton(config: Config) -> Config:
    return config.model_copy(update={"execution": TRITON})


@pytest.fixture(scope="module")
def target():
    return tiny_model(heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def draft(target):
    return noisy_copy(target, 0.05)


@pytest.fixture(scope="module")
def small_models():  # one layer: sampling reads only the last layer's logits
    target = tiny_model(seed=7, layers=1, vocab_size=SMALL_VOCAB, heads=2, kv_heads=1)
    return target, noisy_copy(target, 0.6, seed=4)


@pytest.fixture(scope="module")
def short_reference(tokenizer, target) -> list[list[int]]:
    """transformers' greedy decoding of the first prompts, 10 tokens each, in float32 on this CPU."""
    outputs = []
    for prompt in PROMPTS[:4]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        generated = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10)
        outputs.append(generated[0, ids.shape[1]:].tolist())
    return outputs


@pytest.mark.parametrize("speculative", [
    {"method": "none"},
    {"method": "ngram", "num_candidates": 2},
    {"method": "draft_model", "model": "target", "quantization": "int4", "num_candidates": 2,
     "candidate_init": "target"},
    {"method": "draft_model", "num_candidates": 1, "ngram_candidates": 1},
    {"method": "draft_model", "model": "target", "quantization": None, "layer_skip": [0]},
    # a static tree of 70 nodes and a lookup chain: tree masks of two words
    {"method": "recycle", "num_candidates": 4, "tree_nodes": 70, "ngram_candidates": 1},
], ids=["none", "ngram", "self-draft", "draft-and-lookup", "layer-skip", "recycling-tree"])
def test_greedy_with_the_triton_kernels_matches_transformers(speculative, tokenizer, target, draft,
                                                             short_reference) -> None:
    config = with_triton(make_config(**speculative, length_policy="static", num_speculative_tokens=3,
                                     batch_size=4, sampling=SHORT))
    uses_draft = config.speculative.method == "draft_model" and config.speculative.model != "target"
    engine = Engine(config, target=target, tokenizer=tokenizer, draft=draft if uses_draft else None)
    assert engine.cache.execution.kernels == "triton" and engine.cache.execution.interpret
    results = engine.generate([Request(id=str(i), prompt=p) for i, p in enumerate(PROMPTS[:4])])
    assert [r.token_ids for r in results] == short_reference
    if speculative["method"] != "none":  # drafts were verified (a self-draft's mostly kept)
        assert sum(sum(r.per_step_drafted) for r in results) > 0
        if speculative.get("model") == "target" and "layer_skip" not in speculative:  # a whole one's
            assert sum(sum(r.per_step_accepted) for r in results) > 0


def test_sampling_with_the_triton_kernels_follows_the_target_law(small_models, tokenizer) -> None:
    """n-gram candidates (two per level) on a repetitive prompt at temperature 1: the joint law of the first two
    tokens is the target's (exact law by enumeration), with drafts really verified, some rejected."""
    target, _ = small_models
    # A first token of 3, 4 or 5 (82% here) has a continuation in the prompt for the lookup to draft. 160 samples:
    # against a law at Cohen's w = 0.5 from the target's (lambda = n w^2 = 40), the test at p < 1e-3 over 6-15
    # pooled cells has power 0.90-0.98 (noncentral chi-square); 120 samples would leave 0.71-0.89.
    prompt, warp, samples = [3, 4, 5, 3], {"temperature": 1.0, "top_k": 0, "top_p": 1.0}, 160
    # Three tokens: the first from the prefill, then a step with room for one drafted token (and the third).
    config = with_triton(make_config(method="ngram", num_candidates=2, num_speculative_tokens=2,
                                     length_policy="static", batch_size=160, sampling={"max_tokens": 3, **warp}))
    engine = Engine(config, target=target, tokenizer=tokenizer)
    results = engine.generate(law_requests(engine, prompt, samples))
    drafted = sum(sum(r.per_step_drafted) for r in results)
    accepted = sum(sum(r.per_step_accepted) for r in results)
    assert drafted > samples / 2 and 0 < accepted < drafted  # speculation really happened, with rejections
    assert chi_square_pvalue(sampled_pairs(results, (0, 1)), exact_joint_law(target, prompt, warp, (0, 1))) > 1e-3


def test_greedy_over_gguf_blocks_with_the_triton_kernels_is_the_dequantized_models(tokenizer, target, tmp_path,
                                                                                   monkeypatch) -> None:
    """A target of GGUF blocks (Q4_1 layers, Q8_0 embedding and head): its projections go through the Triton block
    GEMM in the fused layer, and n-gram speculation over them gives transformers' greedy tokens of the float model
    holding the dequantized weights."""
    from tiny import gguf_pair

    from decoding.model import triton_kernels as tk
    from decoding.model.attention import cpu_kernel

    calls = []
    block_linear = tk.block_linear
    monkeypatch.setattr(tk, "block_linear", lambda *args: calls.append(args[-1]) or block_linear(*args))

    assert cpu_kernel()  # the embedding and the head compute from their blocks outside the layer stack
    reference, blocks = gguf_pair(target, tmp_path / "tiny.gguf")
    expected = []
    for prompt in PROMPTS[:2]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        generated = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10)
        expected.append(generated[0, ids.shape[1]:].tolist())
    config = with_triton(make_config(method="ngram", num_candidates=2, length_policy="static",
                                     num_speculative_tokens=3, batch_size=2, sampling=SHORT))
    engine = Engine(config, target=blocks, tokenizer=tokenizer)
    assert engine.cache.execution.kernels == "triton"
    results = engine.generate([Request(id=str(i), prompt=p) for i, p in enumerate(PROMPTS[:2])])
    assert [r.token_ids for r in results] == expected
    assert sum(sum(r.per_step_drafted) for r in results) > 0
    assert calls and set(calls) == {4}  # the layers' 4-bit blocks went through the Triton GEMM
