"""Structured outputs: constraints parsed and refused by name, and decoding.constraints.grammar's state, tree masks,
forced tokens and logit masking, checked against fresh xgrammar matchers on the tiny and the real SmolLM2 tokenizers."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr
from engine_cases import make_config

from decoding import Engine, Request
from decoding.config import Constraint, SamplingParams, StructuredOutputs, load_config
from decoding.constraints.grammar import (
    GrammarError,
    RowGrammar,
    RowMasks,
    TreeMasks,
    bitmask_words,
    committed_masks,
    compiler_for,
    mask_logits,
    unpack,
)
from decoding.model.loading import DEFAULT_MODEL, load_tokenizer
from decoding.verification.tree import TreeTopology
from frontend.requests import RequestError, parse_request

REPO = Path(__file__).resolve().parents[1]

# Nested objects, arrays, enums, numbers; bounded so that a random walk through the grammar ends. Strings are
# bounded by a pattern: xgrammar 0.2.8 compiles a maxLength string to [^"\\\r\n]{0,n}, which lets raw control
# characters through (invalid JSON).
SHORT = {"type": "string", "pattern": "^[a-zA-Z0-9 ]{0,6}$"}
RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": SHORT,
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "country": {"type": "string", "enum": ["France", "Germany", "Italy"]},
        "tags": {"type": "array", "items": SHORT, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": SHORT, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "score", "country", "tags", "address"],
}
LIST_SCHEMA = {
    "type": "array",
    "items": {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"]},
    "minItems": 1, "maxItems": 2,
}


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(DEFAULT_MODEL)


def constraint(**fields):
    return StructuredOutputs.model_validate(fields).constraint


def row_grammar(tokenizer, **fields) -> RowGrammar:
    compiled = compiler_for(tokenizer, len(tokenizer)).compile(constraint(**fields))
    return RowGrammar(compiled, [tokenizer.eos_token_id])


def fresh(grammar: RowGrammar, tokens: list[int]) -> xgr.GrammarMatcher | None:
    """A new matcher of the same grammar walked along ``tokens``; None when it refuses one."""
    matcher = xgr.GrammarMatcher(grammar.compiled, override_stop_tokens=grammar.matcher.stop_token_ids)
    return matcher if all(not matcher.is_terminated() and matcher.accept_token(t) for t in tokens) else None


def fresh_mask(grammar: RowGrammar, tokens: list[int]) -> torch.Tensor:
    matcher = fresh(grammar, tokens)
    assert matcher is not None
    out = xgr.allocate_token_bitmask(1, grammar.vocab_size)
    matcher.fill_next_token_bitmask(out)
    return out[0]


def committed_mask(grammar: RowGrammar) -> torch.Tensor:
    out = torch.empty(1, bitmask_words(grammar.vocab_size), dtype=torch.int32)
    grammar.fill(out)
    return out[0]


# ------------------------------------------------------------------------------------------- configuration
def test_structured_outputs_take_vllms_names_in_config_rows_and_the_older_alias() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    as_text = SamplingParams.model_validate({"structured_outputs": {"json": json.dumps(schema)}})
    as_object = SamplingParams.model_validate({"guided_decoding": {"json": schema}})
    assert as_text.structured_outputs == as_object.structured_outputs
    assert as_text.structured_outputs.constraint.kind == "json"
    # A dump validates back (the engine merges a row onto the config's dump).
    assert SamplingParams.model_validate(as_text.model_dump()) == as_text
    assert load_config(overrides={"sampling.guided_decoding": '{choice: ["yes", "no"]}'}).sampling.structured_outputs \
        .choice == ["yes", "no"]
    for fields, kind in [({"regex": "[a-z]+"}, "regex"), ({"grammar": 'root ::= "x" | "y"'}, "grammar"),
                         ({"grammar": 'start: "x" | "y"'}, "grammar"), ({"json_object": True}, "json_object")]:
        assert StructuredOutputs.model_validate(fields).kind == kind
    # A row's constraint replaces the configured one, whichever name it comes under.
    parsed = parse_request("hi", None, {"guided_decoding": {"choice": ["a", "b"]}})
    assert parsed.sampling == {"structured_outputs": {"choice": ["a", "b"]}}


@pytest.mark.parametrize(("fields", "named", "reason"), [
    ({"regex": "(ab"}, "structured_outputs.regex", "parenthesis"),
    ({"json": "{not json"}, "structured_outputs.json", "not JSON"),
    ({"json": {"type": "object", "properties": {"a": {"type": "bogus"}}}}, "structured_outputs.json", "bogus"),
    ({"json": True}, "structured_outputs.json", "JSON object"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar", "undefined_rule"),
    ({"choice": []}, "structured_outputs.choice", "at least 1"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs", "exactly one"),
    ({"json_object": False}, "structured_outputs", "exactly one"),
    ({"whitespace_pattern": " *"}, "structured_outputs.whitespace_pattern", "not supported"),
    ({"structural_tag": "{}"}, "structured_outputs.structural_tag", "not supported"),
    ({"backend": "outlines"}, "structured_outputs.backend", "Extra inputs"),
])
def test_invalid_constraints_are_refused_naming_the_field(fields, named, reason) -> None:
    with pytest.raises(RequestError) as row_error:
        parse_request("hi", None, {"structured_outputs": fields})
    assert f"invalid sampling_params: invalid {named}" in str(row_error.value) and reason in str(row_error.value)
    with pytest.raises(ValueError) as config_error:
        load_config(overrides={"sampling.structured_outputs": json.dumps(fields)})
    assert f"invalid sampling.{named}" in str(config_error.value)
    with pytest.raises(RequestError, match="not both"):
        parse_request("hi", None, {"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}})


def test_the_engine_decodes_constrained_rows_and_refuses_invalid_ones_by_name(tokenizer, target) -> None:
    engine = Engine(make_config(method="none"), target=target, tokenizer=tokenizer)
    results = {r.id: r for r in engine.generate([
        Request(id="plain", prompt="abc"),
        Request(id="regex", prompt="abc", sampling={"structured_outputs": {"regex": "a+"}}),
        Request(id="alias", prompt="abc", sampling={"guided_decoding": {"choice": ["ab", "ba"]}}),
        Request(id="invalid", prompt="abc", sampling={"structured_outputs": {"regex": "(a"}}),
    ])}
    assert results["plain"].finish_reason != "error"
    assert re.fullmatch("a+", results["regex"].text) or results["regex"].finish_reason == "length"
    assert set(results["regex"].text) == {"a"}
    assert results["alias"].finish_reason == "stop" and results["alias"].text in ("ab", "ba")
    assert "invalid structured_outputs.regex" in results["invalid"].error


def test_xgrammar_loads_with_the_first_constraint_not_with_the_engine() -> None:
    """An engine actor's or model replica's modules and an engine decoding unconstrained rows leave xgrammar
    unimported (a quarter of a second of every actor's start); the first constrained row loads it."""
    code = """if True:
        import sys
        import pipeline.actor, deploy.server
        from decoding import Engine, Request
        from engine_cases import make_config
        from tiny import tiny_model, tiny_tokenizer
        engine = Engine(make_config(method="none"), target=tiny_model(), tokenizer=tiny_tokenizer())
        [plain] = engine.generate([Request(id="plain", prompt="abc")])
        print(plain.finish_reason != "error", "xgrammar" in sys.modules)
        [regex] = engine.generate([Request(id="regex", prompt="abc", sampling={"structured_outputs": {"regex": "a+"}})])
        print(set(regex.text), "xgrammar" in sys.modules)
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "False", "{'a'}", "True"], done.stdout


# ------------------------------------------------------------------------------------------- state and tree
def test_compilers_and_grammars_are_cached(tokenizer) -> None:
    compiler = compiler_for(tokenizer, len(tokenizer))
    assert compiler_for(tokenizer, len(tokenizer)) is compiler
    key = constraint(regex="[ab]+c")
    assert compiler.compile(key) is compiler.compile(constraint(regex="[ab]+c"))
    assert compiler.compile(key) is not compiler.compile(constraint(regex="[ab]+d"))
    with pytest.raises(GrammarError, match="structured_outputs.regex"):
        compiler.compile(Constraint("regex", "(", True))


def _random_tree(rng: random.Random, topology: TreeTopology, grammars: list[RowGrammar | None],
                 committed: list[list[int]], alphabet: list[int], depth: int):
    """Node tokens [B, N] and valid [B, N]: mostly tokens the grammar allows after the node's parent (as a
    constrained draft proposes), sometimes any token of ``alphabet`` (as a lookup continuation may)."""
    size = topology.size(depth)
    tokens = torch.zeros(len(grammars), size, dtype=torch.long)
    valid = torch.zeros(len(grammars), size, dtype=torch.bool)
    for row, grammar in enumerate(grammars):
        for node, parent in enumerate(topology.parents[:size]):
            valid[row, node] = node == 0 or (parent >= 0 and bool(valid[row, parent]) and rng.random() < 0.9)
            options = alphabet
            path = tokens[row, topology.ancestors[parent]].tolist() if parent >= 0 else []
            matcher = fresh(grammar, committed[row] + path) if grammar is not None else None
            if matcher is not None and not matcher.is_terminated() and rng.random() < 0.85:
                mask = xgr.allocate_token_bitmask(1, grammar.vocab_size)
                matcher.fill_next_token_bitmask(mask)
                allowed = unpack(mask[0], grammar.vocab_size)
                options = [t for t in alphabet if allowed[t]] or alphabet
            tokens[row, node] = rng.choice(options)
    return tokens, valid


def check_tree_masks(grammars: list[RowGrammar | None], committed: list[list[int]], topology: TreeTopology,
                     tokens: torch.Tensor, valid: torch.Tensor, depth: int) -> dict[str, int]:
    """Walk the tree level by level; every node's mask, refusal and end must be what a fresh matcher walked along
    the committed tokens and the node's path says, and every row's state must be unchanged after each level."""
    before = [committed_mask(g) if g is not None else None for g in grammars]
    tree = TreeMasks(grammars, topology.parents[: topology.size(depth)], torch.device("cpu"))
    seen = {"allowed": 0, "refused": 0, "terminal": 0}
    for level in range(depth + 1):
        nodes = topology.level_slice(level)
        masks = tree.level(nodes, tokens[:, nodes], valid[:, nodes])
        assert masks.packed.shape == (len(tree.constrained), nodes.stop - nodes.start, bitmask_words(
            grammars[tree.constrained[0]].vocab_size))
        for row, grammar in enumerate(grammars):
            if grammar is None:
                assert not tree.refused[row].any() and not tree.terminal[row].any()
                continue
            assert torch.equal(committed_mask(grammar), before[row])  # rolled back to the committed state
            index = tree.constrained.index(row)
            for offset, node in enumerate(range(nodes.start, nodes.stop)):
                if not valid[row, node]:
                    continue
                path = tokens[row, topology.ancestors[node]].tolist()
                matcher = fresh(grammar, committed[row] + path)
                assert bool(tree.refused[row, node]) == (matcher is None), (row, node, path)
                if matcher is None:
                    seen["refused"] += 1
                    continue
                assert bool(tree.terminal[row, node]) == matcher.is_terminated()
                if matcher.is_terminated():
                    seen["terminal"] += 1
                    continue
                seen["allowed"] += 1
                assert torch.equal(masks.packed[index, offset], fresh_mask(grammar, committed[row] + path))
    return seen


@pytest.mark.parametrize(("width", "root_width"), [(3, 1), (3, 3), (2, 2)])
def test_tree_masks_equal_fresh_matchers_along_each_path_tiny(tokenizer, width, root_width) -> None:
    rng = random.Random(width * 10 + root_width)
    topology = TreeTopology(width, 4, root_width)
    ids = {c: tokenizer.convert_tokens_to_ids(c) for c in "abcdefg ."}
    regex = row_grammar(tokenizer, regex="(ab|ac)c+ (de|fg)+\\.")
    choice = row_grammar(tokenizer, choice=["bad", "bed", "bead", "cab"])
    grammars: list[RowGrammar | None] = [regex, None, choice]
    committed = [[ids["a"]], [], [ids["b"]]]
    for grammar, tokens in zip(grammars, committed):
        if grammar is not None:
            assert grammar.commit(tokens) == len(tokens)
    alphabet = [ids[c] for c in "abcdefg ."] + [tokenizer.eos_token_id]
    totals = {"allowed": 0, "refused": 0, "terminal": 0}
    for _ in range(40):
        tokens, valid = _random_tree(rng, topology, grammars, committed, alphabet, 4)
        for key, count in check_tree_masks(grammars, committed, topology, tokens, valid, 4).items():
            totals[key] += count
    assert all(count > 10 for count in totals.values()), totals  # the trees reached every case


def test_tree_masks_equal_fresh_matchers_on_the_real_tokenizer(smollm2) -> None:
    """Trees over SmolLM2's vocabulary under a JSON schema: paths built from tokenizations of valid and invalid
    continuations of a committed prefix."""
    grammar = row_grammar(smollm2, json=RECORD_SCHEMA)
    committed = smollm2.encode('{"name": "Bo", "age": 4')
    assert grammar.commit(committed) == len(committed)
    pieces = ['2, "score": 1.5', ', "score": -3e2', '0}', ', "country": "Italy"', ', "name"', '1, "score": true',
              ', "tags": ["x"]', '5, "score": 0, "country": "Spain"']
    pool = sorted({t for piece in pieces for t in smollm2.encode(piece)})
    topology = TreeTopology(4, 5, 1)
    rng = random.Random(0)
    totals = {"allowed": 0, "refused": 0, "terminal": 0}
    for _ in range(12):
        size = topology.size(5)
        tokens = torch.zeros(1, size, dtype=torch.long)
        tokens[0, 0] = smollm2.encode("2")[0]
        for level in range(1, 6):  # each candidate follows a piece, with random detours into the pool
            nodes = topology.level_slice(level)
            for candidate, node in enumerate(range(nodes.start, nodes.stop)):
                piece = smollm2.encode(pieces[(candidate + level) % len(pieces)])
                follows = level - 1 < len(piece) and rng.random() < 0.8
                tokens[0, node] = piece[level - 1] if follows else rng.choice(pool)
        valid = torch.ones(1, size, dtype=torch.bool)
        for key, count in check_tree_masks([grammar], [committed], topology, tokens, valid, 5).items():
            totals[key] += count
    assert totals["allowed"] > 20 and totals["refused"] > 20, totals


def test_commit_stops_at_a_refused_token_and_terminates_on_a_stop_token(tokenizer) -> None:
    ids = [tokenizer.convert_tokens_to_ids(c) for c in "abc"]
    grammar = row_grammar(tokenizer, regex="(ab|ac)c+")
    assert grammar.accepts(ids + [ids[0]]) == 3 and grammar.commit([]) == 0
    assert grammar.commit([ids[0], ids[1], ids[1]]) == 2  # "abb": the second b is refused, the state stays at "ab"
    assert grammar.commit([ids[2]]) == 1 and grammar.completed and not grammar.terminated
    assert grammar.commit([tokenizer.eos_token_id, ids[2]]) == 1 and grammar.terminated
    assert torch.equal(committed_mask(grammar), torch.full((1,), -1, dtype=torch.int32))  # nothing reads it


def test_forced_tokens_are_the_runs_the_grammar_allows_alone(tokenizer, smollm2) -> None:
    ids = {c: tokenizer.convert_tokens_to_ids(c) for c in "abcdeflnopsy "}
    eos = tokenizer.eos_token_id
    choice = row_grammar(tokenizer, choice=["yes please", "no"])
    assert choice.forced() == []  # y or n
    assert choice.forced([ids["y"]]) == [ids[c] for c in "es please"] + [eos]
    assert choice.forced([ids["y"]], limit=3) == [ids[c] for c in "es "]
    assert choice.forced([ids["a"]]) == []  # "a" leaves the grammar
    regex = row_grammar(tokenizer, regex="(ab|ac)c+")
    assert regex.forced() == [ids["a"]]
    before = committed_mask(regex)
    regex.forced([ids["a"], ids["b"]])
    assert torch.equal(committed_mask(regex), before)  # rolled back

    # SmolLM2's byte-level BPE leaves several tokenizations of a JSON key allowed: no token is forced alone,
    # while the jump-forward text drafts the key whole.
    record = row_grammar(smollm2, json=RECORD_SCHEMA, disable_any_whitespace=True)
    opening = record.jump_forward(lambda text: smollm2.encode(text))
    assert smollm2.decode(opening) == '{"name": "'
    assert record.accepts(opening) == len(opening) and record.commit([]) == 0
    name = smollm2.encode('{"name": "Al", ')
    key = record.jump_forward(lambda text: smollm2.encode(text), after=name)
    assert smollm2.decode(key) == '"age": '
    assert len(record.forced(name)) < len(key) and '"age": '.startswith(smollm2.decode(record.forced(name)))
    labels = row_grammar(smollm2, choice=["Germany", "France"])
    (g,) = smollm2.encode("G")
    assert smollm2.decode(labels.jump_forward(lambda text: smollm2.encode(text), after=[g])) == "ermany"


def test_mask_logits_masks_constrained_rows_only(tokenizer) -> None:
    vocab = len(tokenizer) + 7  # the model's logits may be wider than the tokenizer: those tokens are never allowed
    compiled = compiler_for(tokenizer, vocab).compile(constraint(regex="[a-c]+d"))
    grammars = [RowGrammar(compiled, [2]), None, RowGrammar(compiled, [2]), None]
    grammars[2].commit([tokenizer.convert_tokens_to_ids("a")])
    topology = TreeTopology(2, 1, 1)
    tokens = torch.tensor([[3, 4, 6]] * 4)  # a, b, d
    tree = TreeMasks(grammars, topology.parents, torch.device("cpu"))
    for level in range(2):
        nodes = topology.level_slice(level)
        tree.level(nodes, tokens[:, nodes], torch.ones(4, nodes.stop - nodes.start, dtype=torch.bool))
    logits = torch.randn(4, 3, vocab)
    masked = logits.clone()
    mask_logits(masked, RowMasks(tree.rows, tree.packed))
    # The device path (unpacked masks) agrees with the CPU kernel's: a non-contiguous view takes it on a CPU.
    wide = torch.zeros(4, 3, 2 * vocab)
    wide[..., :vocab] = logits
    by_unpacking = wide[..., :vocab]
    mask_logits(by_unpacking, RowMasks(tree.rows, tree.packed))
    assert not by_unpacking.is_contiguous() and torch.equal(by_unpacking, masked)
    assert torch.equal(masked[[1, 3]], logits[[1, 3]])
    for index, row in enumerate(tree.constrained):
        reference = logits[row].clone()
        xgr.apply_token_bitmask_inplace(reference, tree.packed[index])
        assert torch.equal(masked[row], reference)
        assert torch.isinf(masked[row, :, len(tokenizer):]).all()
    words = tree.packed
    bits = ((words[..., None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten(-2)[..., :vocab]
    assert torch.equal(unpack(words, vocab), bits)
    unconstrained = logits[[1, 3]]
    mask_logits(unconstrained, committed_masks([None, None], torch.device("cpu")))
    assert torch.equal(unconstrained, logits[[1, 3]])


def _sample_constrained(grammar: RowGrammar, rng: torch.Generator, max_tokens: int, vocab: int) -> list[int]:
    """Sample under the masks from random logits until the grammar ends; the tokens, the stop token last."""
    out: list[int] = []
    while not grammar.terminated and len(out) < max_tokens:
        logits = torch.randn(1, 1, vocab, generator=rng)
        mask_logits(logits, committed_masks([grammar], torch.device("cpu")))
        token = int(torch.multinomial(logits[0, 0].softmax(-1), 1, generator=rng))
        assert grammar.commit([token]) == 1
        out.append(token)
    return out


@pytest.mark.parametrize("schema", [RECORD_SCHEMA, LIST_SCHEMA], ids=["record", "list"])
def test_constrained_samples_parse_and_validate(smollm2, schema) -> None:
    rng = torch.Generator().manual_seed(0)
    for _ in range(8):
        grammar = row_grammar(smollm2, json=schema, disable_any_whitespace=True)
        tokens = _sample_constrained(grammar, rng, 400, len(smollm2))
        assert tokens[-1] == smollm2.eos_token_id
        jsonschema.validate(json.loads(smollm2.decode(tokens[:-1])), schema)


def test_regex_and_choice_samples_match(tokenizer, smollm2) -> None:
    rng = torch.Generator().manual_seed(1)
    for tok in (tokenizer, smollm2):
        for _ in range(10):
            regex = row_grammar(tok, regex="(ab|ac)c{0,3} [a-e]{2}\\.")
            text = tok.decode(_sample_constrained(regex, rng, 50, len(tok))[:-1])
            assert re.fullmatch("(ab|ac)c{0,3} [a-e]{2}\\.", text), text
            choices = ["bad", "bed", "cab"]
            choice = row_grammar(tok, choice=choices)
            assert tok.decode(_sample_constrained(choice, rng, 50, len(tok))[:-1]) in choices
