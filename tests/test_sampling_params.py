"""vLLM's sampling parameters in the engine: seeds, penalties (lossless w.r.t. the penalized law), token bans,
logprobs, detokenize, and refusal of what the engine cannot honour."""

from __future__ import annotations

import pytest
import torch
from engine_cases import END, PROMPTS, SMALL_VOCAB, chi_square_pvalue, make_config, reference_warp, run
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


def penalized_joint_law(model, prompt: list[int], warp: dict, presence: float, frequency: float) -> torch.Tensor:
    """Exact law of the first three generated tokens (END after EOS) under vLLM's presence/frequency penalties
    (on output tokens), then the warp, by enumerating prefixes."""
    joint = torch.zeros(SMALL_VOCAB + 1, SMALL_VOCAB + 1, SMALL_VOCAB + 1, dtype=torch.float64)

    def extend(prefix: list[int], weight: float) -> None:
        if len(prefix) == 3 or (prefix and prefix[-1] == 2):
            tokens = prefix + [END] * (3 - len(prefix))
            joint[tokens[0], tokens[1], tokens[2]] += weight
            return
        with torch.no_grad():
            logits = model(torch.tensor([prompt + prefix])).logits[0, -1].double()
        counts = torch.bincount(torch.tensor(prefix, dtype=torch.long), minlength=SMALL_VOCAB)[:SMALL_VOCAB].double()
        logits = logits - frequency * counts - presence * (counts > 0)
        law = reference_warp(logits, **warp)
        for token in range(SMALL_VOCAB):
            if law[token] > 0:
                extend(prefix + [token], weight * float(law[token]))

    extend([], 1.0)
    return joint


@pytest.mark.parametrize(("width", "init"), [(2, "draft"), (3, "target")])
def test_sampling_with_presence_penalty_follows_the_penalized_target_law(width, init, tokenizer) -> None:
    from tiny import noisy_copy, tiny_model

    target = tiny_model(seed=3, vocab_size=SMALL_VOCAB)
    draft = noisy_copy(target, 0.6, seed=4)
    prompt = [3, 4, 5, 3, 4, 5, 3]
    warp = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    presence, frequency = 1.5, 0.5
    samples = 3000
    config = make_config(
        method="draft_model", num_candidates=width, candidate_init=init, num_speculative_tokens=3,
        length_policy="static", batch_size=64, sampling={"max_tokens": 3, **warp},
    )
    engine = Engine(config, target=target, tokenizer=tokenizer, draft=draft)
    penalties = {"presence_penalty": presence, "frequency_penalty": frequency}
    results = engine.generate(
        [Request(id=str(i), prompt_token_ids=prompt, sampling={"seed": i, **penalties}) for i in range(samples)]
    )
    drafted = sum(sum(r.per_step_drafted) for r in results)
    accepted = sum(sum(r.per_step_accepted) for r in results)
    assert drafted > samples and 0 < accepted < drafted  # speculation really happened, with rejections
    counts = torch.zeros(SMALL_VOCAB + 1, SMALL_VOCAB + 1, SMALL_VOCAB + 1)
    for result in results:
        tokens = result.token_ids + [END] * 3
        counts[tokens[0], tokens[1], tokens[2]] += 1
    law = penalized_joint_law(target, prompt, warp, presence, frequency)
    assert chi_square_pvalue(counts, law) > 1e-3
    # The penalty matters: the unpenalized law is rejected by the same test.
    plain = penalized_joint_law(target, prompt, warp, 0.0, 0.0)
    assert chi_square_pvalue(counts, plain) < 1e-6


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
    ("ignore_eos", 1), ("n", 0),
])
def test_every_field_is_bounded_and_strictly_typed(field, value) -> None:
    with pytest.raises(ValidationError) as error:
        SamplingParams.model_validate({field: value})
    assert error.value.errors()[0]["loc"][0] == field
