"""vLLM's sampling parameters in the engine: seeds, penalties (lossless w.r.t. the penalized law), token bans,
logprobs, detokenize, and refusal of what the engine cannot honour."""

from __future__ import annotations

import pytest
import torch
from engine_cases import (
    END,
    LAW_SAMPLES,
    PROMPTS,
    SMALL_VOCAB,
    chi_square_pvalue,
    make_config,
    reference_warp,
    run,
    sequence_law,
)
from pydantic import ValidationError
from transformers import RepetitionPenaltyLogitsProcessor

from decoding import Engine, Request
from decoding.config import SamplingParams
from decoding.verification.sampling import Penalties, WarpParams, warp_probs
from decoding.verification.tree import TreeTopology

MAX_TOKENS = 20


# ------------------------------------------------------------------------------------------------------- seeds
def _samples(engine_config, tokenizer, target, draft, rows: int, sampling=None) -> list[tuple[int, ...]]:
    engine = Engine(engine_config, target=target, tokenizer=tokenizer, draft=draft)
    requests = [Request(id=str(i), prompt="hello world", sampling=sampling) for i in range(rows)]
    return [tuple(r.token_ids) for r in engine.generate(requests)]


def test_rows_of_one_prompt_sample_independently_and_a_run_seed_reproduces(tokenizer, target, draft) -> None:
    fresh = make_config(method="draft_model", num_candidates=2, sampling={"temperature": 1.0, "max_tokens": 12})
    outputs = _samples(fresh, tokenizer, target, draft, 16)
    assert len(set(outputs)) >= 12  # vLLM: each row its own stream, not 16 copies of one sample
    assert _samples(fresh, tokenizer, target, draft, 16) != outputs  # seed null: fresh randomness each run

    seeded = make_config(method="draft_model", num_candidates=2,
                         sampling={"temperature": 1.0, "max_tokens": 12, "seed": 7})
    first = _samples(seeded, tokenizer, target, draft, 16)
    assert first == _samples(seeded, tokenizer, target, draft, 16)
    assert len(set(first)) >= 12

    # A per-row seed fixes that row alone, whatever the run seed.
    other = make_config(method="draft_model", num_candidates=2,
                        sampling={"temperature": 1.0, "max_tokens": 12, "seed": 8})
    pinned = _samples(seeded, tokenizer, target, draft, 2, sampling={"seed": 123})
    assert pinned == _samples(other, tokenizer, target, draft, 2, sampling={"seed": 123})
    assert pinned[0] == pinned[1]


# --------------------------------------------------------------------------------------------------- penalties
def test_penalties_at_tree_nodes_match_transformers_processor_on_each_node_history() -> None:
    """Each node is penalized as if its committed history plus its tree path were transformers' input_ids."""
    torch.manual_seed(0)
    vocab, topology = 9, TreeTopology(2, 3, 2)
    size = topology.size(3)
    tokens = torch.randint(0, vocab, (2, size))
    logits = torch.randn(2, size, vocab) * 3
    prompts, outputs = [[1, 2, 3], [4]], [[5, 5], []]
    params = [SamplingParams(repetition_penalty=1.7), SamplingParams(repetition_penalty=0.6)]
    penalties = Penalties.build(params, prompts, outputs, {0}, vocab)
    got = penalties.apply(logits, tokens, topology.ancestors)
    for row in range(2):
        processor = RepetitionPenaltyLogitsProcessor(params[row].repetition_penalty)
        for node in range(size):
            path = tokens[row, topology.ancestors[node]].tolist()
            ids = torch.tensor([prompts[row] + outputs[row] + path])
            expected = processor(ids, logits[row, node][None].clone())[0]
            assert torch.allclose(got[row, node], expected)

    frequency = Penalties.build([SamplingParams(frequency_penalty=0.5, presence_penalty=1.0, min_tokens=4)],
                                [[1]], [[3, 3]], {0}, vocab)
    out = frequency.apply(logits[:1], tokens[:1], topology.ancestors)
    for node in range(size):
        history = [3, 3] + tokens[0, topology.ancestors[node]].tolist()
        counts = torch.bincount(torch.tensor(history), minlength=vocab).float()
        expected = logits[0, node] - 0.5 * counts - 1.0 * (counts > 0)
        if len(history) < 4:  # min_tokens: EOS banned until four tokens are out
            expected[0] = -torch.inf
        assert torch.equal(out[0, node], expected)


def vllm_processed(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
                   bad_words: list[list[int]], eos: set[int]) -> torch.Tensor:
    """vLLM's sampler before temperature on one position, transcribed from its code (float64): allowed_token_ids,
    bad words (their other tokens ending the output), the min_tokens ban, logit_bias, then the repetition,
    frequency and presence penalties."""
    logits = logits.double().clone()
    if params.allowed_token_ids is not None:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[params.allowed_token_ids] = True
        logits[~keep] = -torch.inf
    for word in bad_words:
        before = word[:-1]
        if len(before) <= len(output) and output[len(output) - len(before):] == before:
            logits[word[-1]] = -torch.inf
    if len(output) < params.min_tokens:
        logits[sorted(params.stop_ids(eos))] = -torch.inf
    for token, bias in (params.logit_bias or {}).items():
        logits[token] += bias
    for token in set(prompt + output):
        value = logits[token]
        logits[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=len(logits)).double()
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


PROCESSING = {
    "logit_bias": {"logit_bias": {1: 3.5, 4: -2.0, 8: -100.0}},
    "allowed_token_ids": {"allowed_token_ids": [0, 2, 3, 5, 7]},
    "bad_words": {},  # words made from the tree's own paths, below
    "all": {"logit_bias": {3: 1.5, 6: 2.0}, "allowed_token_ids": [1, 2, 3, 4, 6, 8], "repetition_penalty": 1.4,
            "frequency_penalty": 0.3, "presence_penalty": 0.2, "min_tokens": 3},
}


@pytest.mark.parametrize("case", list(PROCESSING))
def test_processing_at_tree_nodes_is_vllms_on_each_node_history(case) -> None:
    """logit_bias, allowed_token_ids, bad words (with the penalties and min_tokens): every node of a tree gets
    vLLM's processing with its own history (the committed output, then its path), and a prefill's logits (no tree)
    with the committed history alone."""
    torch.manual_seed(1)
    vocab, topology = 9, TreeTopology(2, 3, 2)
    size = topology.size(3)
    tokens = torch.randint(0, vocab, (2, size))
    logits = torch.randn(2, size, vocab) * 3
    prompts, outputs = [[1, 2, 3], [4]], [[5, 6], []]
    paths = [[tokens[row, topology.ancestors[node]].tolist() for node in range(size)] for row in range(2)]
    deep = max(range(size), key=lambda node: len(paths[0][node]))
    # Bad words ending where a node's history does (some across the committed output), and some that never match.
    bad_words = [[paths[0][deep][-2:] + [7], [6, paths[0][0][0], 1], [0], [8, 8, 8, 8]],
                 [paths[1][deep][-1:] + [3], [5]]]
    params = [SamplingParams(**PROCESSING[case], bad_words=["x"] if case in ("bad_words", "all") else []),
              SamplingParams(**{**PROCESSING[case], "min_tokens": 0})]
    words = bad_words if params[0].bad_words else [[], []]
    penalties = Penalties.build(params, prompts, outputs, {2}, vocab, words)
    got = penalties.apply(logits, tokens, topology.ancestors)
    banned_by_words = 0
    for row in range(2):
        for node in range(size):
            history = outputs[row] + paths[row][node]
            expected = vllm_processed(logits[row, node], prompts[row], history, params[row], words[row], {2})
            torch.testing.assert_close(got[row, node].double(), expected, rtol=1e-6, atol=1e-5)
            plain = vllm_processed(logits[row, node], prompts[row], history, params[row], [], {2})
            banned_by_words += int((expected.isinf() & ~plain.isinf()).sum())
    assert banned_by_words > 0 if words[0] else banned_by_words == 0
    # The nodes of one level at a time (a drafter's), and a prefill's last position (its row's output only).
    level = topology.level_slice(2)
    torch.testing.assert_close(penalties.apply(logits[:, level], tokens, topology.ancestors, level), got[:, level])
    first = WarpParams.from_params(params, prompts, [[], []], {2}, vocab, words).penalize(logits[:, 0])
    for row in range(2):
        expected = vllm_processed(logits[row, 0], prompts[row], [], params[row], words[row], {2})
        torch.testing.assert_close(first[row].double(), expected, rtol=1e-6, atol=1e-5)
    assert penalties[torch.tensor([1])].apply(logits[1:], tokens[1:], topology.ancestors).equal(got[1:])


def test_min_p_warps_as_vllm_before_top_k_and_top_p() -> None:
    """min_p after temperature, before top-k and top-p (vLLM's order), on the rows that have it only; the facts a
    device warp needs (which rows filter) follow a selection of rows."""
    torch.manual_seed(0)
    logits = torch.randn(4, 3, 11) * 2
    params = [SamplingParams(temperature=0.7, min_p=0.3), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.3, min_p=0.05, top_p=0.8), SamplingParams(temperature=0.9, min_p=1.0,
                                                                                     top_k=3)]
    warp = WarpParams.from_params(params)
    assert warp.min_p_rows == (0, 2, 3)
    probs = warp_probs(logits, warp)
    for row, p in enumerate(params):
        for node in range(3):
            expected = reference_warp(logits[row, node], p.temperature, p.top_k, p.top_p, p.min_p)
            torch.testing.assert_close(probs[row, node].double(), expected, rtol=1e-5, atol=1e-6)
    assert (probs[0] > 0).sum() < (probs[1] > 0).sum()  # min_p dropped tokens
    assert torch.equal(probs[3] > 0, torch.nn.functional.one_hot(logits[3].argmax(-1), 11).bool())  # min_p 1
    picked = warp[torch.tensor([3, 1])]
    assert picked.min_p_rows == (0,) and picked.nucleus_rows == ()
    torch.testing.assert_close(warp_probs(logits[[3, 1]], picked), probs[[3, 1]])
    # Greedy rows' statistics are plain softmaxes: sampling_only turns every filter off on them.
    neutral = warp.sampling_only(torch.tensor([True, False, False, False]))
    torch.testing.assert_close(warp_probs(logits, neutral)[0], (logits[0] / 0.7).softmax(-1))


def _transformers(target, tokenizer, prompts, **kwargs) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                              **kwargs)
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


@pytest.mark.parametrize(("method", "width", "init"), [
    ("none", 1, "draft"), ("draft_model", 1, "draft"), ("draft_model", 2, "draft"), ("draft_model", 3, "target"),
    ("ngram", 2, "draft"),
])
def test_greedy_with_repetition_penalty_matches_transformers(method, width, init, tokenizer, target, draft) -> None:
    reference = _transformers(target, tokenizer, PROMPTS, repetition_penalty=1.3)
    assert reference != _transformers(target, tokenizer, PROMPTS)  # the penalty changes the outputs
    config = make_config(method=method, num_candidates=width, candidate_init=init, num_speculative_tokens=4,
                         length_policy="static", batch_size=3,
                         sampling={"max_tokens": MAX_TOKENS, "repetition_penalty": 1.3})
    results = run(config, tokenizer, target, draft if method == "draft_model" else None)
    assert [r.token_ids for r in results] == reference
    if method == "draft_model":  # speculation really ran, and its drafts were accepted under the penalty
        assert sum(sum(r.per_step_accepted) for r in results) > 0.3 * sum(len(r.token_ids) for r in results)


def test_min_tokens_ignore_eos_and_stop_token_ids(tokenizer, target, draft) -> None:
    prompts = PROMPTS[:4]
    config = make_config(method="draft_model", num_candidates=2, batch_size=4, sampling={"max_tokens": MAX_TOKENS})
    plain = run(config, tokenizer, target, draft, prompts)

    def with_params(**params):
        engine = Engine(config, target=target, tokenizer=tokenizer, draft=draft)
        return engine.generate([Request(id=str(i), prompt=p, sampling=params) for i, p in enumerate(prompts)])

    reference = _transformers(target, tokenizer, prompts, min_new_tokens=8)
    assert [r.token_ids for r in with_params(min_tokens=8)] == reference
    assert all(2 not in r.token_ids[:8] for r in with_params(min_tokens=8))

    ignoring = with_params(ignore_eos=True)
    assert all(len(r.token_ids) == MAX_TOKENS and r.finish_reason == "length" for r in ignoring)
    # Greedy: the stop token is the first one greedy decoding produces from some position on.
    stop_token = plain[0].token_ids[3]
    stopped = with_params(stop_token_ids=[stop_token])
    cut = plain[0].token_ids.index(stop_token) + 1
    assert stopped[0].token_ids == plain[0].token_ids[:cut] and stopped[0].finish_reason == "stop"


def processed_joint_law(model, prompt: list[int], sampling: dict) -> torch.Tensor:
    """Exact law of the first three generated tokens (END after EOS) under vLLM's processing of ``sampling``:
    presence/frequency penalties (on output tokens), logit_bias, then the warp with min-p, by enumerating
    prefixes (``engine_cases.sequence_law``)."""
    presence, frequency = sampling.get("presence_penalty", 0.0), sampling.get("frequency_penalty", 0.0)
    warp = {k: v for k, v in sampling.items() if k not in ("presence_penalty", "frequency_penalty")}

    def penalize(prefix: list[int], logits: torch.Tensor) -> None:
        counts = torch.bincount(torch.tensor(prefix, dtype=torch.long), minlength=SMALL_VOCAB)[:SMALL_VOCAB]
        logits -= frequency * counts + presence * (counts > 0)

    joint = torch.zeros(SMALL_VOCAB + 1, SMALL_VOCAB + 1, SMALL_VOCAB + 1, dtype=torch.float64)
    for tokens, weight in sequence_law(model, prompt, warp, 3, penalize):
        joint[tuple(tokens)] += weight
    return joint


WARP = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


@pytest.mark.parametrize(("processing", "width", "init"), [
    ({"presence_penalty": 1.5, "frequency_penalty": 0.5}, 2, "draft"),
    ({"presence_penalty": 1.5, "frequency_penalty": 0.5}, 3, "target"),
    ({"min_p": 0.3}, 3, "draft"),
    ({"min_p": 0.2, "top_p": 0.95}, 2, "target"),
    ({"logit_bias": {"1": 2.0, "4": -1.5, "2": -100}}, 2, "draft"),
    ({"logit_bias": {"0": 1.5, "3": -2.0}, "min_p": 0.1}, 3, "target"),
], ids=["penalties-w2", "penalties-w3-target", "min_p", "min_p-top_p", "logit_bias", "logit_bias-min_p"])
def test_sampling_follows_the_processed_target_law(processing, width, init, small_models, tokenizer) -> None:
    """Speculative sampling is lossless with respect to the processed target law: penalties, min_p and logit_bias
    on both sides; the unprocessed law is rejected by the same test."""
    target, draft = small_models
    prompt = [3, 4, 5, 3, 4, 5, 3]
    samples = LAW_SAMPLES
    config = make_config(
        method="draft_model", num_candidates=width, candidate_init=init, num_speculative_tokens=3,
        length_policy="static", batch_size=64, sampling={"max_tokens": 4, **WARP},  # the law of the first three
    )
    engine = Engine(config, target=target, tokenizer=tokenizer, draft=draft)
    results = engine.generate(
        [Request(id=str(i), prompt_token_ids=prompt, sampling={"seed": i, **processing}) for i in range(samples)]
    )
    drafted = sum(sum(r.per_step_drafted) for r in results)
    accepted = sum(sum(r.per_step_accepted) for r in results)
    assert drafted > samples and 0 < accepted < drafted  # speculation really happened, with rejections
    counts = torch.zeros(SMALL_VOCAB + 1, SMALL_VOCAB + 1, SMALL_VOCAB + 1)
    for result in results:
        tokens = result.token_ids + [END] * 3
        counts[tokens[0], tokens[1], tokens[2]] += 1
    law = processed_joint_law(target, prompt, {**WARP, **processing})
    assert chi_square_pvalue(counts, law) > 1e-3
    # The processing matters: the law without it is rejected by the same test.
    plain = processed_joint_law(target, prompt, {**WARP, **{k: v for k, v in processing.items() if k in WARP}})
    assert chi_square_pvalue(counts, plain) < 1e-6


# ------------------------------------------------------------------------------- greedy identity under speculation
SPECULATIVE = {
    "draft w2": {"method": "draft_model", "num_candidates": 2},
    "draft w3 target-init + lookup": {"method": "draft_model", "num_candidates": 3, "candidate_init": "target",
                                      "ngram_candidates": 1},
    "self-draft int4 w2": {"method": "draft_model", "model": "target", "quantization": "int4", "num_candidates": 2},
    "ngram w2": {"method": "ngram", "num_candidates": 2},
    "recycle w2": {"method": "recycle", "num_candidates": 2, "candidate_init": "target"},
    "recycling tree": {"method": "recycle", "num_candidates": 3, "tree_nodes": 10},
}
# Characters of the tiny tokenizer are its tokens: a = 3, ..., z = 28, " " = 29, "." = 30, "," = 31.
GREEDY_FIELDS = {
    "logit_bias": {"logit_bias": {"5": 4.0, "10": -100, "29": 1.0}},
    "allowed_token_ids": {"allowed_token_ids": [2, *range(3, 12), 29]},
    "bad_words": {"bad_words": ["kk", "db", "c", "q,", "abc"]},
    "min_p": {"min_p": 0.5},  # greedy rows ignore it
    "all": {"logit_bias": {"7": 3.0}, "bad_words": ["ee", "b"], "allowed_token_ids": [2, *range(3, 16), 29, 30],
            "repetition_penalty": 1.2, "min_p": 0.2},
}


@pytest.mark.parametrize("field", list(GREEDY_FIELDS))
def test_greedy_with_each_processing_is_plain_decodings_under_speculation(field, tokenizer, target, draft) -> None:
    """Greedy rows take the processed logits' argmax: speculative decoding (several drafters, batch 3) gives exactly
    plain decoding's tokens with each of logit_bias, allowed_token_ids, bad_words and min_p."""
    sampling = {"max_tokens": MAX_TOKENS, **GREEDY_FIELDS[field]}
    plain = run(make_config(method="none", batch_size=3, sampling=sampling), tokenizer, target)
    tokens = [r.token_ids for r in plain]
    unprocessed = [r.token_ids for r in run(make_config(method="none", batch_size=3,
                                                        sampling={"max_tokens": MAX_TOKENS}), tokenizer, target)]
    assert (tokens == unprocessed) == (field == "min_p")  # the processing changes greedy outputs
    for name, speculative in SPECULATIVE.items():
        config = make_config(**speculative, num_speculative_tokens=4, length_policy="static", batch_size=3,
                             sampling=sampling)
        results = run(config, tokenizer, target, draft if speculative.get("model") is None and
                      speculative["method"] == "draft_model" else None)
        assert [r.token_ids for r in results] == tokens, name
        assert sum(sum(r.per_step_accepted) for r in results) > 0, name  # speculation ran, drafts accepted
    params = SamplingParams(**GREEDY_FIELDS[field])
    for output in tokens:
        if params.allowed_token_ids is not None:
            assert set(output) <= set(params.allowed_token_ids)
        for word in params.bad_words:  # a word's tokens never end the output (its first may follow the prompt)
            ids = tokenizer.encode(word, add_special_tokens=False)
            assert not any(output[i : i + len(ids)] == ids for i in range(len(output)))


# -------------------------------------------------------------------------------------- logprobs, text, refusals
def test_logprobs_are_the_targets_and_text_options(tokenizer, target, draft) -> None:
    config = make_config(method="draft_model", num_candidates=2, length_policy="static",
                         sampling={"max_tokens": MAX_TOKENS})
    engine = Engine(config, target=target, tokenizer=tokenizer, draft=draft)
    (result,) = engine.generate([Request(id="a", prompt=PROMPTS[2], sampling={"logprobs": 3, "ignore_eos": True})])
    assert sum(result.per_step_accepted) > 0  # some tokens came from accepted drafts
    assert len(result.logprobs) == len(result.token_ids)
    ids = tokenizer(PROMPTS[2]).input_ids + result.token_ids
    with torch.no_grad():
        expected = target(torch.tensor([ids])).logits[0].log_softmax(-1)
    start = len(ids) - len(result.token_ids) - 1
    for i, entry in enumerate(result.logprobs):
        law = expected[start + i]
        assert entry["token_id"] == result.token_ids[i]
        assert abs(entry["logprob"] - float(law[entry["token_id"]])) < 1e-4
        assert [alt["token_id"] for alt in entry["top_logprobs"]] == law.topk(3).indices.tolist()
        for item in (entry, *entry["top_logprobs"]):  # vLLM's rank: 1 + the tokens strictly more likely
            assert item["rank"] == 1 + int((law > law[item["token_id"]]).sum())
            assert abs(item["logprob"] - float(law[item["token_id"]])) < 1e-4
        assert [alt["rank"] for alt in entry["top_logprobs"]] == [1, 2, 3]

    # Ray Data LLM's example sampling_params; skip_special_tokens; unknown fields and n are refused by name.
    requests = [
        Request(id="ray", prompt="abc", sampling={"temperature": 0.3, "max_tokens": 20, "detokenize": False}),
        Request(id="specials", prompt="abc", sampling={"skip_special_tokens": False, "ignore_eos": True,
                                                        "stop_token_ids": [2]}),
        Request(id="unknown", prompt="abc", sampling={"best_of": 2}),
        Request(id="n", prompt="abc", sampling={"n": 2}),
    ]
    results = {r.id: r for r in engine.generate(requests)}
    assert results["ray"].finish_reason != "error" and results["ray"].text == "" and results["ray"].token_ids
    specials = results["specials"]
    assert specials.text == tokenizer.decode(specials.token_ids, skip_special_tokens=False)
    assert "best_of" in results["unknown"].error
    assert results["n"].finish_reason == "error" and "n is 2" in results["n"].error


def test_include_stop_str_in_output_keeps_the_stop_string_in_the_text(tokenizer, target, draft, reference) -> None:
    """vLLM's include_stop_str_in_output: the text ends after the stop string instead of before it; the tokens and
    the finish reason are the same."""
    longest = max(range(len(PROMPTS)), key=lambda i: len(reference[i]))
    full = tokenizer.decode(reference[longest], skip_special_tokens=True)
    stop = full[6:8]
    config = make_config(method="draft_model", num_candidates=2, length_policy="static",
                         sampling={"max_tokens": len(reference[longest]), "stop": ["zz", stop]})
    engine = Engine(config, target=target, tokenizer=tokenizer, draft=draft)
    excluded, included = engine.generate([
        Request(id=str(flag), prompt=PROMPTS[longest], sampling={"include_stop_str_in_output": flag})
        for flag in (False, True)
    ])
    end = full.index(stop)
    assert excluded.text == full[:end] and included.text == full[: end + len(stop)]
    assert included.token_ids == excluded.token_ids and included.finish_reason == excluded.finish_reason == "stop"


@pytest.mark.parametrize(("sampling", "field"), [
    ({"logit_bias": {"35": 1.0}}, "logit_bias"), ({"allowed_token_ids": [3, 35]}, "allowed_token_ids"),
    ({"prompt_logprobs": 36}, "prompt_logprobs"), ({"bad_words": ["  "]}, "bad_words"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias"), ({"min_p": 2}, "min_p"),
    # Bans that leave allowed_token_ids nothing: EOS (2) before min_tokens, a bad word of one token ("a" is 3).
    ({"allowed_token_ids": [2], "min_tokens": 2}, "min_tokens"), ({"allowed_token_ids": [3], "bad_words": ["a"]},
                                                                   "bad_words"),
])
def test_a_request_past_the_vocabulary_or_a_bound_fails_alone_naming_the_field(sampling, field, tokenizer, target,
                                                                               reference) -> None:
    engine = Engine(make_config(method="ngram", batch_size=2), target=target, tokenizer=tokenizer)
    bad, good = engine.generate([Request(id="bad", prompt="abc", sampling=sampling),
                                 Request(id="good", prompt=PROMPTS[0])])
    assert bad.finish_reason == "error" and field in bad.error and bad.token_ids == []
    assert good.token_ids == reference[0]


# allowed_token_ids "a" (3): the bad word "aa" leaves nothing after the first "a", as the regex "ab+" does; the regex
# "b+" leaves nothing from the first token on. (expected tokens: what the row emits before it ends)
EMPTIED = {
    "bad-word": ({"allowed_token_ids": [3], "bad_words": ["aa"]}, [3]),
    "grammar": ({"allowed_token_ids": [3], "structured_outputs": {"regex": "ab+"}}, [3]),
    "grammar-first-token": ({"allowed_token_ids": [3], "structured_outputs": {"regex": "b+"}}, []),
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("case", list(EMPTIED))
def test_a_row_left_no_token_ends_with_an_error_never_an_arbitrary_token(case, method, temperature, tokenizer,
                                                                         target, draft) -> None:
    """A row whose processed law has nothing left at run time ends there, its tokens before kept, on the target's
    side whatever the draft proposed from its own emptied law (a model draft: uniform, or its argmax 0 greedily).
    Before, it drew token 0 greedily and any token at temperature 1."""
    sampling, expected = EMPTIED[case]
    config = make_config(method=method, num_candidates=2, num_speculative_tokens=3, length_policy="static",
                         sampling={"max_tokens": MAX_TOKENS, "temperature": temperature, "seed": 1})
    engine = Engine(config, target=target, tokenizer=tokenizer, draft=draft if method == "draft_model" else None)
    emptied, other = engine.generate([Request(id="emptied", prompt="abc", sampling=sampling),
                                      Request(id="other", prompt=PROMPTS[0])])
    assert emptied.finish_reason == "error" and "allowed_token_ids" in emptied.error, emptied
    assert emptied.token_ids == expected
    assert other.finish_reason in ("stop", "length") and other.token_ids


# ------------------------------------------------------------------------------------------- numerical safety
@pytest.mark.parametrize("sampling", [
    {"temperature": 1e-38}, {"temperature": 1e-45}, {"temperature": 9e-6}, {"temperature": 1.0, "top_p": 1e-46},
    {"temperature": 1.0, "top_p": 5e-324}, {"temperature": 2.0, "top_k": 1},
], ids=["t1e-38", "t1e-45", "t9e-6", "top_p1e-46", "top_p-denormal", "top_k1"])
def test_degenerate_sampling_is_the_greedy_row(sampling, tokenizer, target, draft) -> None:
    """vLLM's rule (temperature below 1e-5 is greedy) and a top_p that keeps only the most likely token give the
    greedy output exactly, speculating, on both sides of the draft; before, the last vocabulary id came out."""
    config = make_config(method="draft_model", num_candidates=2, num_speculative_tokens=3, length_policy="static",
                         sampling={"max_tokens": MAX_TOKENS, "ignore_eos": True})
    greedy = run(config, tokenizer, target, draft)
    engine = Engine(config, target=target, tokenizer=tokenizer, draft=draft)
    results = engine.generate([Request(id=str(i), prompt=p, sampling=sampling) for i, p in enumerate(PROMPTS)])
    assert [r.token_ids for r in results] == [r.token_ids for r in greedy]
    assert sum(sum(r.per_step_accepted) for r in results) > 0  # the draft's tokens were accepted too


def test_warping_never_gives_a_law_with_nan_or_no_mass() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 3, 11) * 30
    logits[1] = -torch.inf  # every token banned
    logits[2, 0, 4] = torch.nan
    params = [SamplingParams(temperature=1e-38), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, top_p=1e-300), SamplingParams(temperature=2.0, top_k=2**62)]
    warp = WarpParams.from_params(params)
    # A row with top_p below float32's smallest number: its tensor holds 0 and still keeps the most likely token.
    warp = WarpParams(warp.temperature, warp.top_k, torch.tensor([1.0, 1.0, 0.0, 1.0]))
    probs = warp_probs(logits, warp)
    assert not probs.isnan().any()
    assert torch.allclose(probs.sum(-1), torch.ones(4, 3))
    assert torch.equal(probs[1], torch.full((3, 11), 1 / 11))
    for node in (1, 2):  # top_p ~ 0: all mass on the most likely token
        assert probs[2, node].max() == 1.0 and probs[2, node].argmax() == logits[2, node].argmax()


@pytest.mark.parametrize(("field", "value"), [
    ("top_k", 2**63), ("top_k", -2), ("max_tokens", True), ("max_tokens", 4.0), ("max_tokens", "4"),
    ("min_tokens", 10**7), ("temperature", float("nan")), ("temperature", float("inf")), ("top_p", float("nan")),
    ("presence_penalty", float("-inf")), ("repetition_penalty", 1e-300), ("seed", 2**63), ("seed", 1.0),
    ("stop", ["x"] * 65), ("stop", ["x" * 1025]), ("stop", [""]), ("stop", [3]), ("stop_token_ids", [2**31]),
    ("stop_token_ids", [-1]), ("stop_token_ids", [0] * 1025), ("logprobs", 21), ("ignore_eos", "yes"),
    ("ignore_eos", 1), ("n", 0), ("min_p", 1.5), ("min_p", -0.1), ("min_p", "0.1"), ("logit_bias", {"x": 1.0}),
    ("logit_bias", {"1": "2"}), ("logit_bias", {"-3": 1.0}), ("logit_bias", {str(i): 1.0 for i in range(1025)}),
    ("logit_bias", [[1, 2.0]]), ("allowed_token_ids", []), ("allowed_token_ids", [2**31]), ("bad_words", ["\t"]),
    ("bad_words", "word"), ("bad_words", ["x" * 129]), ("prompt_logprobs", 21), ("prompt_logprobs", -1),
    ("include_stop_str_in_output", "true"),
])
def test_every_field_is_bounded_and_strictly_typed(field, value) -> None:
    with pytest.raises(ValidationError) as error:
        SamplingParams.model_validate({field: value})
    assert error.value.errors()[0]["loc"][0] == field
