"""Prefix caching: full prompt blocks shared by content between rows, reference-counted, cached while no row holds
them and evicted least recently released first; the engine's outputs are the same with it on and off."""

from __future__ import annotations

import pytest
import torch
from engine_cases import (
    END,
    LAW_SAMPLES,
    SMALL_VOCAB,
    chi_square_pvalue,
    law_requests,
    make_config,
    on_device,
    sequence_law,
)

from decoding import Config, Engine, Request
from decoding.drafting.feature_draft import FeatureDraft
from decoding.model.kv_cache import CacheShape, PagedKVCache

SHAPE = CacheShape(num_layers=1, kv_heads=1, head_dim=4)


def pool(blocks: int = 8, rows: int = 4, caching: bool = True, salt: str = "") -> PagedKVCache:
    return PagedKVCache(SHAPE, num_blocks=blocks, max_rows=rows, max_positions=128, block_size=16,
                        prefix_caching=caching, salt=salt)


def prefill(cache: PagedKVCache, prompt: list[int], positions: int = 64) -> slice:
    """Admit a row for ``prompt`` as the engine does: claim, add, write the uncached part, register."""
    claim = cache.claim(prompt, positions)
    assert claim is not None
    rows = cache.add_rows([claim])
    cache.ensure(rows, [len(prompt)])
    cache.advance(rows, [len(prompt) - cache.host_lengths[rows.start]])
    cache.register(rows)
    return rows


# ------------------------------------------------------------------------------------------------------- the pool


def test_a_block_key_names_its_whole_prefix() -> None:
    cache = pool()
    first, second = list(range(40)), list(range(40))
    second[3] = 99  # the first block differs: every later key differs too, though blocks 2 and 3 are equal
    assert cache.prefix_keys(first) == cache.prefix_keys(list(range(40)))
    assert len(cache.prefix_keys(first)) == 2  # full blocks only: the last 8 tokens have no key
    assert all(a != b for a, b in zip(cache.prefix_keys(first), cache.prefix_keys(second)))
    assert pool(salt="another model").prefix_keys(first)[0] != cache.prefix_keys(first)[0]
    assert pool(caching=False).prefix_keys(first) == []


def test_a_row_takes_the_cached_blocks_of_its_prompt_and_they_outlive_it() -> None:
    cache = pool()
    prompt = list(range(40))  # blocks 0-15, 16-31 full; 32-39 partial
    prefill(cache, prompt)
    assert cache.row_blocks[0] == [1, 2, 3] and cache.blocks_cached == 2  # the partial block is never shared
    rows = prefill(cache, prompt + [7, 7])
    assert cache.host_lengths[rows.start] == 42 and cache.row_blocks[1][:2] == [1, 2]  # 32 positions cached
    assert cache.refs[1] == cache.refs[2] == 2 and cache.blocks_in_use == 4
    assert (cache.prefix_queries, cache.prefix_hits) == (82, 32)
    cache.remove_row(1)
    cache.remove_row(0)
    assert cache.blocks_in_use == 0 and cache.blocks_cached == 2  # cached, free to evict
    claim = cache.claim(prompt, 64)
    assert claim.blocks == [1, 2]  # no row holds them, they are still there


def test_the_last_prompt_token_is_always_computed() -> None:
    """A prompt of whole blocks takes all but its last block from the cache: the prefill needs one token's logits."""
    cache = pool()
    prompt = list(range(32))
    prefill(cache, prompt)
    assert cache.blocks_cached == 2
    assert cache.claim(prompt, 64).blocks == [1]


def test_a_prefix_that_ends_mid_block_shares_only_its_full_blocks() -> None:
    cache = pool()
    prefill(cache, list(range(24)) + [50] * 20)
    assert cache.claim(list(range(24)) + [60] * 20, 64).blocks == [1]


def test_a_block_computed_twice_is_cached_once() -> None:
    """Two rows of one prefill compute the same block: the first registered stays cached, the other is freed with
    its row."""
    cache = pool()
    prompt = list(range(20))
    claims = [cache.claim(prompt, 32), cache.claim(prompt, 32)]
    rows = cache.add_rows(claims)
    cache.ensure(rows, [20, 20])
    cache.advance(rows, [20, 20])
    cache.register(rows)
    assert cache.blocks_cached == 1 and cache.row_blocks[0][0] != cache.row_blocks[1][0]
    cache.remove_row(1)
    cache.remove_row(0)
    assert cache.blocks_cached == 1 and cache.blocks_in_use == 0 and len(cache._free) == cache.num_blocks - 1


def test_claimed_blocks_are_held_until_the_row_joins_and_promised_blocks_bound_admission() -> None:
    cache = pool(blocks=4)
    prompt = list(range(33))
    rows = prefill(cache, prompt, positions=48)  # 3 blocks: 2 cached
    cache.remove_row(rows.start)
    assert cache.blocks_in_use == 0 and cache.blocks_cached == 2
    held = cache.claim(prompt, 48)  # takes the 2 cached blocks, promised 1 more
    assert held.blocks == [1, 2] and cache.blocks_promised == 3
    assert cache.claim(list(range(100, 133)), 48) is None  # 3 new blocks: only 1 left to promise
    other = cache.claim(list(range(100, 116)), 16)
    assert other is not None and cache.blocks_promised == 4
    cache.add_rows([other])
    cache.ensure(slice(0, 1), [16])  # the free block: the held ones are not evicted
    assert cache.row_blocks[0] == [3] and cache.blocks_cached == 2
    cache.release_claim(held)
    assert cache.blocks_promised == 1 and cache.refs[1] == cache.refs[2] == 0


def test_eviction_takes_the_least_recently_released_tail_first() -> None:
    cache = pool(blocks=4)
    cache.lazy_pages = False  # as on a GPU: free blocks go before cached ones (the CPU's rule: the next test)
    first, second = list(range(33)), list(range(200, 217))
    a = prefill(cache, first, positions=33)  # blocks 1, 2 cached, 3 its own
    cache.remove_row(a.start)  # released tail first: 2 is evicted before 1
    b = prefill(cache, second, positions=17)  # blocks 3 (cached) and 4
    cache.remove_row(b.start)
    assert cache.blocks_cached == 3 and cache.blocks_in_use == 0
    rows = cache.add_rows([cache.claim(list(range(300, 320)), 32)])  # 2 blocks: the free one, then an eviction
    cache.ensure(rows, [32])
    assert cache.row_blocks[0] == [4, 2] and cache.blocks_cached == 2
    assert cache.blocks_in_use + len(cache._free) + len(cache._evictable) == cache.num_blocks
    cache.remove_row(rows.start)
    assert cache.claim(first, 33).blocks == [1]  # the prefix outlived its extension


def test_a_cpu_pool_reuses_cached_blocks_before_touching_new_pages() -> None:
    """A CPU pool's pages are committed when first written: its resident memory stays the peak of blocks in use."""
    cache = pool(blocks=8)
    rows = prefill(cache, list(range(32)), positions=32)
    cache.remove_row(rows.start)
    rows = cache.add_rows([cache.claim(list(range(100, 110)), 16)])
    cache.ensure(rows, [10])
    assert cache.row_blocks[0] == [2] and cache.peak_blocks == 2  # a cached block, not block 3


def test_a_pool_without_caching_shares_nothing() -> None:
    cache = pool(caching=False)
    prefill(cache, list(range(40)))
    rows = prefill(cache, list(range(40)))
    assert cache.host_lengths[rows.start] == 40 and cache.blocks_cached == 0 and cache.prefix_hits == 0
    assert cache.prefix_queries == 0


def test_reset_forgets_every_prefix() -> None:
    cache = pool()
    rows = prefill(cache, list(range(40)))
    cache.remove_row(rows.start)
    cache.reset_prefix_cache()
    assert cache.blocks_cached == 0 and cache.claim(list(range(40)), 64).blocks == []


# ----------------------------------------------------------------------------------------------------- the engine

BASE = "the quick brown fox jumps over the lazy dog and then "  # 52 characters: 3 full blocks and 4
PREFIXED = [
    BASE + "runs",
    BASE + "sleeps all day",
    BASE[:20] + "cat naps in the sun",  # shares one full block and 4 characters
    BASE[:40] + "zzz",  # shares two blocks and 8 characters: a prefix ending mid-block
    "so it goes",
    BASE + "runs",  # the same prompt again
    BASE + BASE + "x",
    BASE[:32],  # whole blocks only: its last block is computed again
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prefixed_reference(tokenizer, target) -> list[list[int]]:
    outputs = []
    for prompt in PREFIXED:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS)
        outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs


def _engine(config: Config, tokenizer, target, draft, device) -> Engine:
    return Engine(config, target=on_device(target, device), tokenizer=tokenizer, draft=on_device(draft, device))


def _config(caching: bool, batch_size: int, sampling: dict | None = None, **speculative) -> Config:
    config = make_config(batch_size=batch_size, num_speculative_tokens=4, length_policy="static",
                         sampling=sampling or {"max_tokens": MAX_TOKENS}, **speculative)
    return config.model_copy(update={"enable_prefix_caching": caching})


DRAFTERS = {
    "none": {"method": "none"},
    "ngram w2": {"method": "ngram", "num_candidates": 2},
    "draft w1": {"method": "draft_model", "num_candidates": 1},
    "draft w2 target-init": {"method": "draft_model", "num_candidates": 2, "candidate_init": "target"},
    "draft w4 + lookup": {"method": "draft_model", "num_candidates": 4, "ngram_candidates": 1},
    "self-draft int8 w2": {"method": "draft_model", "model": "target", "quantization": "int8", "num_candidates": 2},
    "recycle w2": {"method": "recycle", "num_candidates": 2},
    "feature draft w2": {"method": "draft_model", "num_candidates": 2},
}


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_outputs_are_the_same_with_and_without_prefix_caching(
    drafter, batch_size, tokenizer, target, draft, prefixed_reference, device
) -> None:
    if drafter == "feature draft w2":
        draft = FeatureDraft.from_target(target, [0], list(range(target.config.vocab_size)))
    outputs, hits = {}, {}
    for caching in (True, False):
        engine = _engine(_config(caching, batch_size, **DRAFTERS[drafter]), tokenizer, target, draft, device)
        results = engine.generate([Request(str(i), prompt=p) for i, p in enumerate(PREFIXED)])
        outputs[caching] = [r.token_ids for r in results]
        hits[caching] = engine.cache.prefix_hits
        if drafter != "none":
            assert sum(sum(r.per_step_drafted) for r in results) > 0  # it speculated
    assert outputs[True] == outputs[False] == prefixed_reference
    assert hits[False] == 0
    if drafter == "feature draft w2":  # a cached prefix has no target states for it to read: caching is off
        assert hits[True] == 0
    else:  # with caching, rows found shared blocks cached: at batch 8 every row joins in one step
        assert hits[True] >= 16 * 8


def test_rows_that_leave_and_rejoin_find_their_prefix_cached(tokenizer, target, draft, prefixed_reference) -> None:
    """Two rows at a time: later prompts join after the rows that cached their prefix have left."""
    engine = _engine(_config(True, 2, method="draft_model", num_candidates=2), tokenizer, target, draft, None)
    for i, prompt in enumerate(PREFIXED):
        engine.add_request(Request(str(i), prompt=prompt))
    tokens: dict[str, list[int]] = {}
    cached_while_idle = False
    while engine.has_unfinished():
        out = engine.step()
        for request_id, new in out.new_tokens.items():
            tokens.setdefault(request_id, []).extend(new)
        cached_while_idle |= any(engine.cache.refs[b] == 0 for b in engine.cache._key_of)
        assert engine.cache.blocks_in_use <= engine.cache.num_blocks
    assert [tokens[str(i)] for i in range(len(PREFIXED))] == prefixed_reference
    assert cached_while_idle and engine.cache.prefix_hits >= 3 * 16 * 2


def test_seeded_rows_reproduce_with_and_without_prefix_caching(tokenizer, target, draft, device) -> None:
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 1.0}
    outputs = {}
    for caching in (True, False):
        engine = _engine(_config(caching, 4, sampling, method="draft_model", num_candidates=2), tokenizer, target,
                         draft, device)
        results = engine.generate([Request(str(i), prompt=p, sampling={"seed": 10 + i})
                                   for i, p in enumerate(PREFIXED)])
        assert sum(sum(r.per_step_drafted) for r in results) > sum(sum(r.per_step_accepted) for r in results) > 0
        outputs[caching] = [r.token_ids for r in results]
        assert (engine.cache.prefix_hits > 0) == caching
    assert outputs[True] == outputs[False]


def test_many_distinct_prefixes_evict_and_admit_no_later_than_without_caching(tokenizer, target) -> None:
    """A small pool and prompts of several blocks, eight prefixes asked three questions each: cached blocks are
    evicted as rows need them, the pool is never over-promised, and no request joins later than it would without
    caching."""
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    prompts = [f"{words[i // 3]} " * 8 + f"{words[(3 * i) % 8]} {words[(5 * i) % 8]}" for i in range(24)]
    joined_at: dict[bool, dict[str, int]] = {}
    outputs = {}
    for caching in (True, False):
        config = _config(caching, 3, method="ngram", num_candidates=2).model_copy(update={"num_kv_blocks": 16})
        engine = Engine(config, target=target, tokenizer=tokenizer)
        for i, prompt in enumerate(prompts):
            engine.add_request(Request(str(i), prompt=prompt, sampling={"max_tokens": 8}))
        joined, tokens, step = {}, {}, 0
        while engine.has_unfinished():
            out = engine.step()
            step += 1
            for request_id, new in out.new_tokens.items():
                joined.setdefault(request_id, step)
                tokens.setdefault(request_id, []).extend(new)
            assert not [r for r in out.finished if r.finish_reason == "error"]
            cache = engine.cache
            assert cache.blocks_in_use <= cache.num_blocks and cache.blocks_promised <= cache.num_blocks
        joined_at[caching], outputs[caching] = joined, tokens
        if caching:
            assert engine.cache.prefix_hits > 0 and engine.cache.blocks_cached < 8 * 3  # some were evicted
    assert outputs[True] == outputs[False]
    assert all(joined_at[True][i] <= joined_at[False][i] for i in joined_at[False])


# ------------------------------------------------------------------------------------------------ sampled laws


@pytest.mark.parametrize("speculative", [
    {"method": "draft_model", "num_candidates": 3, "candidate_init": "target"},
    {"method": "draft_model", "model": "target", "quantization": "int4", "num_candidates": 2},
    {"method": "ngram", "num_candidates": 2},
    {"method": "recycle", "num_candidates": 2},
], ids=["draft", "self-draft", "ngram", "recycle"])
def test_sampling_follows_the_target_law_with_cached_prefixes(speculative, small_models, tokenizer, device) -> None:
    """Every row after the first takes the prompt's first block from the cache; the law is still the target's."""
    target, draft = small_models
    prompt = [3, 4, 5, 3] * 4 + [4, 5, 3]  # one full block, then 3 tokens
    warp = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    samples = LAW_SAMPLES
    config = make_config(**speculative, num_speculative_tokens=3, length_policy="static", batch_size=64,
                         sampling={"max_tokens": 3, **warp})
    uses_draft = config.speculative.method == "draft_model" and config.speculative.model != "target"
    engine = Engine(config, target=on_device(target, device), tokenizer=tokenizer,
                    draft=on_device(draft, device) if uses_draft else None)
    results = engine.generate(law_requests(engine, prompt, samples))
    assert engine.cache.prefix_hits == 16 * (samples - 1)
    drafted = sum(sum(r.per_step_drafted) for r in results)
    accepted = sum(sum(r.per_step_accepted) for r in results)
    assert drafted > samples and 0 < accepted < drafted  # speculation really happened, with rejections
    law = torch.zeros(SMALL_VOCAB + 1, SMALL_VOCAB + 1, dtype=torch.float64)
    for tokens, weight in sequence_law(target, prompt, warp, 3):
        law[tokens[1], tokens[2]] += weight
    counts = torch.zeros(SMALL_VOCAB + 1, SMALL_VOCAB + 1)
    for result in results:
        tokens = result.token_ids + [END] * 3
        counts[tokens[1], tokens[2]] += 1
    assert chi_square_pvalue(counts, law) > 1e-3


@pytest.mark.parametrize("forward", ["lean", "transformers"])
@pytest.mark.parametrize("drafter", ["none", "draft w2 target-init", "self-draft int8 w2"])
def test_prompt_logprobs_cover_every_prompt_token_whatever_the_cache_holds(
    drafter, forward, tokenizer, target, draft, prefixed_reference, device, monkeypatch
) -> None:
    """vLLM's prompt_logprobs: one entry per prompt token, the first None, each other the target's raw
    log-probability of the token given those before it (a full forward's log_softmax) with its rank and the top
    alternatives. A row asking takes nothing from the prefix cache (a cached prefix has no logits), whatever others
    cached before it, while the rows beside it still do; its tokens are the same. ``transformers``: a target run by
    transformers' own forward, whose logits come at every prompt position instead of through the LM head."""
    from decoding.engine import step
    from decoding.model import lean_forward

    monkeypatch.setattr(step, "PROMPT_LOGPROBS_CHUNK", 7)  # several chunks a prompt
    if forward == "transformers":
        monkeypatch.setattr(lean_forward, "supports_lean_forward", lambda model: False)
    engine = _engine(_config(True, 3, **DRAFTERS[drafter]), tokenizer, target, draft, device)
    assert (type(engine.target).__name__ == "LeanCausalLM") == (forward == "lean")
    first = engine.generate([Request("cached", prompt=PREFIXED[0])])[0]  # caches BASE's three blocks
    asked = {1: 3, 5: 0, 6: 2}  # a shared prefix, the very prompt cached, a longer one
    requests = [Request(str(i), prompt=PREFIXED[i], sampling={"prompt_logprobs": asked.get(i)}) for i in (1, 5, 6, 3)]
    results = {r.id: r for r in engine.generate(requests)}
    assert first.prompt_logprobs is None and results["3"].prompt_logprobs is None
    assert results["3"].num_cached_tokens == 32  # beside them, a row not asking takes the cached blocks
    for i, top in asked.items():
        result = results[str(i)]
        assert result.token_ids == prefixed_reference[i] and result.num_cached_tokens == 0
        ids = result.prompt_token_ids
        with torch.no_grad():
            laws = target(torch.tensor([ids])).logits[0].log_softmax(-1)
        entries = result.prompt_logprobs
        assert len(entries) == len(ids) and entries[0] is None
        for position, entry in enumerate(entries[1:]):
            law = laws[position]
            assert entry["token_id"] == ids[position + 1]
            assert entry["logprob"] == pytest.approx(float(law[ids[position + 1]]), abs=1e-4)
            assert entry["rank"] == 1 + int((law > law[ids[position + 1]]).sum())
            alternatives = entry["top_logprobs"]
            assert [alt["token_id"] for alt in alternatives] == (law.topk(top).indices.tolist() if top else [])
            assert [alt["rank"] for alt in alternatives] == list(range(1, top + 1))
    if drafter != "none":
        assert sum(sum(r.per_step_drafted) for r in results.values()) > 0  # it speculated


def test_rows_of_different_cache_salts_share_no_cached_block(tokenizer, target, draft) -> None:
    """vLLM's cache_salt: a prompt's blocks are found again only by rows of its own salt (no salt is a salt of its
    own), and a salted row decodes what an unsalted one does."""
    engine = _engine(_config(True, 1), tokenizer, target, draft, torch.device("cpu"))

    def cached(salt: str | None) -> tuple[int, list[int]]:
        [result] = engine.generate([Request(f"{salt}-{engine.steps}", prompt=BASE + "runs", cache_salt=salt)])
        return result.num_cached_tokens, result.token_ids

    first, plain = cached(None)
    assert first == 0 and cached(None)[0] > 0
    assert cached("tenant-a") == (0, plain)  # another salt: nothing shared, the same output
    assert cached("tenant-a")[0] > 0 and cached("tenant-b")[0] == 0
    [refused] = engine.generate([Request("bad", prompt="x", cache_salt="")])
    assert refused.finish_reason == "error" and "cache_salt" in refused.error
