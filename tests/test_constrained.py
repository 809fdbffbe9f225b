"""Constraints in the step (decoding.constraints.constrained), on tiny random models: outputs follow their constraint,
greedy outputs equal plain constrained decoding for every method, width and batch size, sampling follows the constrained
target law, and the grammar's forced tokens are drafts the target always accepts."""

from __future__ import annotations

import itertools
import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr
from engine_cases import END, LAW_SAMPLES, PROMPTS, SMALL_VOCAB, chi_square_pvalue, make_config, on_device, sequence_law
from test_grammar import LIST_SCHEMA, RECORD_SCHEMA
from tiny import noisy_copy, tiny_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from decoding import Engine, Request
from decoding.config import StructuredOutputs
from decoding.constraints.grammar import compiler_for
from decoding.model.loading import DEFAULT_MODEL, load_tokenizer

MAX_TOKENS = 24
# One constraint per row, cycled over the prompts (None: an unconstrained row in the same batch).
CONSTRAINTS = [
    {"regex": "(hello|world)( [a-e]+)+\\."},
    {"choice": ["banana", "bandana", "cab", "zebra crossing"]},
    None,
    {"grammar": 'root ::= ("ab" | "ba") [a-c]* "."'},
]
PATTERNS = {"regex": "(hello|world)( [a-e]+)+\\.", "grammar": "(ab|ba)[a-c]*\\."}


def requests(sampling: dict | None = None) -> list[Request]:
    return [
        Request(id=str(i), prompt=prompt, sampling={
            **(sampling or {}),
            **({"structured_outputs": CONSTRAINTS[i % len(CONSTRAINTS)]} if CONSTRAINTS[i % len(CONSTRAINTS)] else {}),
        })
        for i, prompt in enumerate(PROMPTS)
    ]


def assert_follows(result, constraint: dict | None, tokenizer) -> None:
    """A constrained output that stopped is a complete match, the stop token last; one cut by max_tokens is not."""
    if constraint is None:
        return
    assert result.finish_reason in ("stop", "length"), result.error
    text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    kind = next(iter(constraint))
    complete = text in constraint["choice"] if kind == "choice" else re.fullmatch(PATTERNS[kind], text) is not None
    if result.finish_reason == "stop":
        assert result.token_ids[-1] == tokenizer.eos_token_id and complete, text
    else:
        assert len(result.token_ids) == MAX_TOKENS and result.token_ids[-1] != tokenizer.eos_token_id


@pytest.fixture(scope="module")
def plain_constrained(tokenizer, target) -> list[list[int]]:
    """Plain constrained decoding: method none, one row at a time."""
    engine = Engine(make_config(method="none", batch_size=1), target=target, tokenizer=tokenizer)
    results = engine.generate(requests())
    for i, result in enumerate(results):
        assert_follows(result, CONSTRAINTS[i % len(CONSTRAINTS)], tokenizer)
    assert {r.finish_reason for r in results} == {"stop", "length"}  # both endings are exercised
    return [r.token_ids for r in results]


SPECULATIVE = {
    "self_draft": {"method": "draft_model", "model": "target", "quantization": "int4"},
    "lookup_siblings": {"method": "draft_model", "ngram_candidates": 1},
    # a static recycling tree with a lookup chain (which carries a constrained row's grammar draft)
    "recycling_tree": {"method": "recycle", "tree_nodes": 10, "ngram_candidates": 1},
}
GREEDY_GRID = (
    [("none", 1, "draft")]
    + [("ngram", w, init) for w, init in itertools.product([1, 2], ["draft", "target"])]
    + [("draft_model", w, init) for w, init in itertools.product([1, 2, 4], ["draft", "target"])]
    + [("lookup_siblings", w, init) for w, init in [(1, "draft"), (2, "target")]]
    + [("self_draft", w, init) for w, init in [(1, "draft"), (2, "target")]]
    + [("recycling_tree", 3, "draft")]
)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize(("method", "width", "init"), GREEDY_GRID)
def test_greedy_equals_plain_constrained_decoding(method, width, init, batch_size, tokenizer, target, draft,
                                                  plain_constrained, device) -> None:
    speculative = {**SPECULATIVE.get(method, {"method": method}), "num_candidates": width, "candidate_init": init,
                   "length_policy": "static" if batch_size != 3 else "heuristic"}
    config = make_config(**speculative, batch_size=batch_size)
    uses_draft = config.speculative.method == "draft_model" and config.speculative.model != "target"
    engine = Engine(config, target=on_device(target, device), tokenizer=tokenizer,
                    draft=on_device(draft, device) if uses_draft else None)
    results = engine.generate(requests())
    assert [r.token_ids for r in results] == plain_constrained
    if method != "none":
        assert sum(sum(r.per_step_accepted) for r in results) > 0  # speculation really happened


def test_a_configured_constraint_applies_to_every_row(tokenizer, target, draft) -> None:
    choice = ["banana", "cab"]
    config = make_config(method="draft_model", num_candidates=2, sampling={
        "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 0, "guided_decoding": {"choice": choice}})
    results = Engine(config, target=target, tokenizer=tokenizer, draft=draft).generate(
        [Request(id=str(i), prompt=p) for i, p in enumerate(PROMPTS)])
    for result in results:
        assert result.finish_reason == "stop" and result.text in choice, result


@pytest.mark.parametrize("method", ["none", "ngram", "draft_model", "lookup_siblings"])
def test_sampled_choices_and_regexes_always_match(method, tokenizer, target, draft) -> None:
    config = make_config(**SPECULATIVE.get(method, {"method": method}), num_candidates=2, length_policy="static",
                         batch_size=8)
    sampled = [Request(id=f"{r.id}-{seed}", prompt=r.prompt, sampling={**r.sampling, "temperature": 1.0,
                                                                        "seed": seed})
               for seed in range(4) for r in requests()]
    results = Engine(config, target=target, tokenizer=tokenizer, draft=draft).generate(sampled)
    for request, result in zip(sampled, results):
        assert_follows(result, request.sampling.get("structured_outputs"), tokenizer)


def test_grammar_forced_tokens_are_drafts_the_target_always_accepts(tokenizer, target, draft) -> None:
    """After "h" the regex allows "ello " alone: those tokens are drafted (the grammar's own draft in a lookup
    candidate, the masked law of a draft model), accepted, counted as forced, and the output is plain constrained
    decoding's."""
    regex = "(hello|world) [a-c]{1,3}\\."
    prompts = ["zebra", "a", "so it goes"]
    batch = [Request(id=str(i), prompt=p, sampling={"structured_outputs": {"regex": regex}})
             for i, p in enumerate(prompts)]
    outputs = {}
    for method in ("none", "ngram", "draft_model", "lookup_siblings"):
        config = make_config(**SPECULATIVE.get(method, {"method": method}), length_policy="static",
                             num_speculative_tokens=6)
        results = Engine(config, target=target, tokenizer=tokenizer, draft=draft).generate(batch)
        outputs[method] = [r.token_ids for r in results]
        for result in results:
            assert re.fullmatch(regex, result.text), result.text
            forced = result.num_grammar_forced_tokens
            assert forced <= sum(result.per_step_accepted)
            assert result.spec_decode["num_grammar_forced_tokens"] == forced
            if method == "none":
                assert forced == 0 and not result.token_stats
            else:  # "ello " or "orld " and the ".", at least, as accepted drafts of probability 1
                assert forced >= 5, (method, result.text, forced)
                assert sum(1 for s in result.token_stats if s[5] == 1.0 and s[6]) >= forced
    assert all(tokens == outputs["none"] for tokens in outputs.values())


def test_a_constraint_cut_by_max_tokens_ends_with_length_and_bad_ones_are_error_rows(tokenizer, target) -> None:
    engine = Engine(make_config(method="ngram"), target=target, tokenizer=tokenizer)
    results = {r.id: r for r in engine.generate([
        Request(id="short", prompt="abc", sampling={"max_tokens": 5, "structured_outputs": {"regex": "[a-c]{12}"}}),
        Request(id="invalid", prompt="abc", sampling={"structured_outputs": {"regex": "(a"}}),
        Request(id="no-stop", prompt="abc", sampling={"ignore_eos": True, "guided_decoding": {"choice": ["ab"]}}),
        Request(id="stop-ids", prompt="abc", sampling={"ignore_eos": True, "stop_token_ids": [30],
                                                       "structured_outputs": {"regex": "[a-c]{2}"}}),
        # The tiny vocabulary has no "{": a grammar that needs one first is refused, one that needs it later ends.
        Request(id="unspellable", prompt="abc", sampling={"structured_outputs": {"regex": "\\{a"}}),
        Request(id="dead-end", prompt="abc", sampling={"structured_outputs": {"regex": "ab\\{"}}),
    ])}
    assert results["unspellable"].finish_reason == "error" and results["unspellable"].token_ids == []
    assert "structured_outputs.regex cannot be spelled" in results["unspellable"].error
    dead_end = results["dead-end"]
    assert dead_end.finish_reason == "error" and dead_end.token_ids[:2] == [3, 4], dead_end
    assert "structured_outputs.regex reached a point that no token" in dead_end.error
    assert results["short"].finish_reason == "length" and re.fullmatch("[a-c]{5}", results["short"].text)
    assert results["invalid"].finish_reason == "error"
    assert "invalid structured_outputs.regex" in results["invalid"].error
    assert results["no-stop"].finish_reason == "error" and "stop_token_ids" in results["no-stop"].error
    # With ignore_eos the grammar ends on the row's stop_token_ids instead.
    stop_ids = results["stop-ids"]
    assert stop_ids.finish_reason == "stop" and stop_ids.token_ids[-1] == 30 and len(stop_ids.token_ids) == 3


def test_min_tokens_never_outlasts_a_complete_grammar(tokenizer, target, draft) -> None:
    """min_tokens bans the stop tokens; where the grammar allows nothing else, the grammar wins and the row ends."""
    for method in ("none", "draft_model"):
        config = make_config(**SPECULATIVE.get(method, {"method": method}), length_policy="static")
        [result] = Engine(config, target=target, tokenizer=tokenizer, draft=draft).generate([Request(
            id="0", prompt="abc", sampling={"min_tokens": 10, "structured_outputs": {"choice": ["ab", "cab"]}})])
        assert result.finish_reason == "stop" and result.text in ("ab", "cab")


def test_rows_without_constraints_build_no_grammar(tokenizer, target, draft, monkeypatch) -> None:
    import decoding.engine.step

    def refuse(*args, **kwargs):
        raise AssertionError("grammar work in a step without constrained rows")

    for name in ("StepGrammar", "apply_masks", "grammar_drafts", "advance", "committed_masks"):
        monkeypatch.setattr(decoding.engine.step, name, refuse)
    for method in ("ngram", "lookup_siblings", "draft_model"):
        config = make_config(**SPECULATIVE.get(method, {"method": method}), num_candidates=2)
        results = Engine(config, target=target, tokenizer=tokenizer, draft=draft).generate(
            [Request(id=str(i), prompt=p) for i, p in enumerate(PROMPTS)])
        assert all(r.finish_reason in ("stop", "length") for r in results)


# ------------------------------------------------------------------------------------------------- JSON records
@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def json_models(smollm2):
    """A tiny random target over SmolLM2's vocabulary, and a noisy copy as its draft."""
    target = tiny_model(seed=5, vocab_size=len(smollm2))
    return target, noisy_copy(target, 0.3, seed=6)


SCHEMAS = {"record": RECORD_SCHEMA, "list": LIST_SCHEMA, "flat": {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog", 3]},
                   "value": {"type": "number"}, "count": {"type": "integer"}},
    "required": ["ok", "kind", "value", "count"],
}}


def json_requests(temperature: float, seeds: int, any_whitespace: bool = False) -> list[Request]:
    """Compact JSON rows; with ``any_whitespace`` every other row allows any whitespace between tokens, which a
    random model fills without end (those rows end by length, at 48 tokens: past the opening bracket it only adds
    whitespace, which is drafted and verified as the first tokens of it were)."""
    return [
        Request(id=f"{name}-{seed}", prompt=f"A {name} as JSON:", sampling={
            "temperature": temperature, "seed": seed, "max_tokens": 48 if spaced else 200,
            "structured_outputs": {"json": schema, "disable_any_whitespace": not spaced}})
        for name, schema in SCHEMAS.items() for seed in range(seeds)
        for spaced in [any_whitespace and seed % 2 == 1]
    ]


@pytest.mark.parametrize("method", ["none", "ngram", "draft_model", "lookup_siblings"])
def test_json_schema_outputs_parse_and_validate(method, smollm2, json_models) -> None:
    target, draft = json_models
    config = make_config(**SPECULATIVE.get(method, {"method": method}), num_candidates=2, length_policy="static",
                         batch_size=8)
    batch = json_requests(1.0, 4)
    results = Engine(config, target=target, tokenizer=smollm2, draft=draft).generate(batch)
    for request, result in zip(batch, results):
        assert result.finish_reason == "stop", (result.id, result.finish_reason, result.text[-80:])
        jsonschema.validate(json.loads(result.text), SCHEMAS[request.id.split("-")[0]])
    if method != "none":
        assert sum(sum(r.per_step_accepted) for r in results) > 0


def test_json_greedy_equals_plain_constrained_decoding(smollm2, json_models) -> None:
    target, draft = json_models
    batch = json_requests(0.0, 2, any_whitespace=True)
    outputs = {}
    for method, width, batch_size in [("none", 1, 1), ("ngram", 2, 4), ("draft_model", 2, 6),
                                      ("lookup_siblings", 1, 3)]:
        config = make_config(**SPECULATIVE.get(method, {"method": method}), num_candidates=width,
                             candidate_init="target", length_policy="static", batch_size=batch_size)
        results = Engine(config, target=target, tokenizer=smollm2, draft=draft).generate(batch)
        outputs[method] = [r.token_ids for r in results]
        for request, result in zip(batch, results):
            compact = request.sampling["structured_outputs"]["disable_any_whitespace"]
            assert result.finish_reason == "stop" or not compact, result.text
            if result.finish_reason == "stop":
                jsonschema.validate(json.loads(result.text), SCHEMAS[request.id.split("-")[0]])
    assert all(tokens == outputs["none"] for tokens in outputs.values())


# ----------------------------------------------------------------------------------------------------- sampling
SMALL = ["<pad>", "<s>", "</s>", "a", "b", "c"]  # the small models' vocabulary; id 2 is EOS
assert len(SMALL) == SMALL_VOCAB  # the conftest's small models, and END (= SMALL_VOCAB) in the laws
SMALL_REGEX = "(ab|c)[ac]?b?c?"  # "b" forced after "a"; EOS allowed once "ab" or "c" is out


def small_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({token: i for i, token in enumerate(SMALL)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def constrained_joint_law(model, tokenizer, prompt: list[int], warp: dict, regex: str, length: int) -> torch.Tensor:
    """Exact law of the first ``length`` generated tokens (END after EOS) under the regex: each prefix's logits
    masked by a fresh matcher walked along it, then warped."""
    compiled = compiler_for(tokenizer, len(SMALL)).compile(StructuredOutputs(regex=regex).constraint)
    joint = torch.zeros((END + 1,) * length, dtype=torch.float64)

    def grammar_mask(prefix: list[int], logits: torch.Tensor) -> None:
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[2])
        assert all(matcher.accept_token(t) for t in prefix)
        mask = xgr.allocate_token_bitmask(1, len(SMALL))
        matcher.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask[0])

    for tokens, weight in sequence_law(model, prompt, warp, length, grammar_mask):
        joint[tuple(tokens)] += weight
    return joint


FREE = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
CONSTRAINED_SAMPLING_GRID = [
    ("draft_model", 3, False, "target", FREE),
    ("draft_model", 2, True, "draft", {"temperature": 1.3, "top_k": 4, "top_p": 0.95}),
    ("ngram", 2, False, "draft", FREE),
    ("lookup_siblings", 2, True, "target", FREE),
]


@pytest.mark.parametrize(("method", "width", "replacement", "init", "warp"), CONSTRAINED_SAMPLING_GRID)
def test_sampling_follows_the_constrained_target_law(method, width, replacement, init, warp, small_models,
                                                     device) -> None:
    target, draft = small_models
    tokenizer = small_tokenizer()
    prompt = [3, 3, 3, 3]  # repetitive, so n-gram lookup proposes candidates too
    samples = LAW_SAMPLES
    config = make_config(
        **SPECULATIVE.get(method, {"method": method}), num_candidates=width, replacement=replacement,
        candidate_init=init, num_speculative_tokens=3, length_policy="static", batch_size=64,
        sampling={"max_tokens": 4, **warp},
    )
    engine = Engine(config, target=on_device(target, device), tokenizer=tokenizer,
                    draft=on_device(draft, device) if config.speculative.method == "draft_model" else None)
    results = engine.generate([
        Request(id=str(i), prompt_token_ids=prompt,
                sampling={"seed": i, "structured_outputs": {"regex": SMALL_REGEX}})
        for i in range(samples)
    ])
    drafted = sum(sum(r.per_step_drafted) for r in results)
    accepted = sum(sum(r.per_step_accepted) for r in results)
    assert drafted > samples / 2 and 0 < accepted < drafted  # speculation really happened, with rejections
    assert sum(r.num_grammar_forced_tokens for r in results) > 0  # and "b" after "a" was a free draft
    counts = torch.zeros((END + 1,) * 3)
    for result in results:
        counts[tuple((result.token_ids + [END] * 3)[:3])] += 1
    law = constrained_joint_law(target, tokenizer, prompt, warp, SMALL_REGEX, 3)
    assert chi_square_pvalue(counts, law) > 1e-3
