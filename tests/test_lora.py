"""LoRA adapters: PEFT folders read and checked (``decoding.model.lora``), applied to every row of a batch by one
masked matmul pair per projection (or, on a CPU, the per-token C++ kernel), equal to PEFT's own forward (the
reference) for each adapter alone and mixed."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import peft  # a test dependency (pyproject's dev extra): the reference implementation
import pytest
import torch
from tiny import tiny_model

from decoding import Config, Engine, Request
from decoding.model.lora import AdapterError, LoraSlots, SlotTable, adapted, projection_shapes, read_adapter

# name -> PEFT LoraConfig fields: ranks 8 and 16, q/v only and all-linear, rslora.
ADAPTERS = {
    "qv8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "all16": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"},
    "rs16": {"r": 16, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
             "use_rslora": True},
}
MAX_RANK = 16
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base():
    return tiny_model(seed=11)


def _make_adapter(model, fields: dict, path, seed: int, scale: float = 1.0) -> torch.nn.Module:
    """A PEFT adapter over a copy of ``model`` with random A and B (PEFT's init_lora_weights=False, B times
    ``scale``), saved to ``path``; returns the PEFT model (the reference)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **fields)
    model = peft.get_peft_model(copy.deepcopy(model), config).eval()
    if scale != 1.0:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.mul_(scale)
    model.save_pretrained(path)
    return model


def _adapters_of(model, root) -> dict[str, tuple[str, torch.nn.Module]]:
    """``ADAPTERS`` over ``model``, saved under ``root``: name -> (path, PEFT model)."""
    return {name: (str(root / name), _make_adapter(model, fields, root / name, seed))
            for seed, (name, fields) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    return _adapters_of(base, tmp_path_factory.mktemp("adapters"))


@torch.no_grad()
def test_each_adapter_alone_and_all_mixed_with_base_rows_equal_peft(base, adapters):
    slots = LoraSlots(base.config, max_loras=3, max_rank=MAX_RANK)
    for slot, (name, (path, _)) in enumerate(adapters.items(), start=1):
        adapter = read_adapter(name, path, base.config, MAX_RANK)
        assert adapter.rank == ADAPTERS[name]["r"]
        slots.load(slot, adapter)
    ids = torch.randint(3, base.config.vocab_size, (8, 12), generator=torch.Generator().manual_seed(0))
    expected = {"base": base(ids).logits}
    for name, (_, reference) in adapters.items():
        expected[name] = reference(ids).logits
        assert (expected[name] - expected["base"]).abs().max() > 0.1, name  # the adapter changes the logits
    # Each adapter alone (every row on its slot), then 8 rows of all three and the base in one forward.
    layouts = [[slot] * 8 for slot in (0, 1, 2, 3)] + [[0, 1, 2, 3, 3, 2, 1, 0]]
    names = ["base", *adapters]
    for layout in layouts:
        token_slots = torch.tensor(layout)[:, None].expand(ids.shape).flatten()
        with adapted(base, slots.batch(token_slots)):
            logits = base(ids).logits
        for row, slot in enumerate(layout):
            torch.testing.assert_close(logits[row], expected[names[slot]][row], rtol=1e-5, atol=1e-5)


def test_the_base_slot_adds_nothing_and_a_cleared_slot_is_the_base(base, adapters):
    slots = LoraSlots(base.config, max_loras=2, max_rank=MAX_RANK)
    assert slots.batch(torch.tensor([0, 0])) is None  # no adapter row: the forward runs without
    slots.load(1, read_adapter("qv8", adapters["qv8"][0], base.config, MAX_RANK))
    x = torch.randn(5, base.config.hidden_size)
    lora = slots.batch(torch.tensor([0, 1, 1, 0, 2]))
    assert set(lora.a) == {"qkv"}  # qv8 targets q and v only: the other groups are left out
    delta = lora.projection_delta("q_proj", 0, x)
    assert delta[[0, 3, 4]].abs().max() == 0 and delta[[1, 2]].abs().max() > 0
    assert lora.projection_delta("k_proj", 0, x).abs().max() == 0  # nor k_proj
    assert lora.projection_delta("o_proj", 0, x) is None
    fused = lora.delta("qkv", 0, x)
    torch.testing.assert_close(fused[:, : base.config.hidden_size], delta)
    slots.clear(1)
    assert slots.batch(torch.tensor([0, 1, 1, 0, 2])).projection_delta("q_proj", 0, x) is None


@torch.no_grad()
def test_the_per_token_kernel_and_the_compiled_adapted_stack_compute_the_masked_deltas(base, adapters, monkeypatch):
    """The C++ ``lora_delta`` (each token against its own adapter's rows) equals the masked matmul pair for every
    group, adapters of ranks 8 and 16 and base tokens interleaved; and the layer stack compiled with adapter inputs
    (what a CPU engine runs) computes the eager stack's logits for a batch of all three adapters and the base."""
    from decoding.config import ExecutionConfig
    from decoding.model.attention import cpu_kernel
    from decoding.model.execution import Execution
    from decoding.model.forward import forward_tree
    from decoding.model.kv_cache import CacheShape, PagedKVCache
    from decoding.model.lean_forward import LeanCausalLM
    from decoding.model.lora import GROUPS
    from decoding.verification.tree import chain_ancestors

    assert cpu_kernel()
    slots = LoraSlots(base.config, max_loras=3, max_rank=MAX_RANK)
    for slot, (name, (path, _)) in enumerate(adapters.items(), start=1):
        slots.load(slot, read_adapter(name, path, base.config, MAX_RANK))
    token_slots = torch.tensor([0, 1, 2, 3, 3, 2, 1, 0, 2, 2, 2, 2, 2, 1])
    lora = slots.batch(token_slots)
    generator = torch.Generator().manual_seed(3)
    for group in GROUPS:
        features = base.config.intermediate_size if group == "down" else base.config.hidden_size
        x = torch.randn(len(token_slots), features, generator=generator)
        for layer in range(base.config.num_hidden_layers):
            masked, per_token = lora.delta(group, layer, x), lora.delta(group, layer, x, per_token=True)
            torch.testing.assert_close(per_token, masked, rtol=1e-5, atol=1e-5)
            assert per_token[token_slots == 0].abs().max() == 0

    monkeypatch.delenv("SPECBATCH_COMPILE")  # the tests' eager default: each execution says here
    cpu = torch.device("cpu")
    outputs = []
    for compile_ in ("off", "auto"):
        execution = Execution.resolve(ExecutionConfig(compile=compile_), cpu)
        lean = LeanCausalLM(base)
        lean.prepare(execution)
        cache = PagedKVCache(CacheShape.of(base.config), 8, 2, 32, execution=execution)
        rows = cache.add_rows([16, 16])
        ids = torch.randint(3, base.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
        batch = slots.batch(torch.tensor([0] * 3 + [1] * 4 + [3] * 7))
        logits, _ = forward_tree(lean, cache, rows, ids, chain_ancestors(7), torch.ones(2, 7, dtype=torch.bool),
                                 lora=batch)
        outputs.append(logits)
        if execution.compile:
            assert lean.compiled_adapted(batch) is not None
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)


def test_shapes_follow_the_model_config(base):
    hidden, intermediate = base.config.hidden_size, base.config.intermediate_size
    kv = base.config.num_key_value_heads * hidden // base.config.num_attention_heads
    assert projection_shapes(base.config) == {
        "q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
        "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)}


def _edited(adapters, tmp_path, name: str = "qv8", **fields):
    path = tmp_path / "edited"
    shutil.copytree(adapters[name][0], path)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return path


@pytest.mark.parametrize(("fields", "named"), [
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"use_dora": True}, "use_dora"),
    ({"bias": "all"}, "bias"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"peft_type": "PREFIX_TUNING"}, "peft_type"),
    ({"target_modules": ["embed_tokens"]}, "embed_tokens"),
    ({"target_modules": ["q_proj"]}, "target_modules does not name"),
    ({"r": "8"}, "r must be"),
    ({"lora_alpha": "x"}, "lora_alpha"),
])
def test_what_cannot_be_applied_is_refused_naming_the_field(base, adapters, tmp_path, fields, named):
    with pytest.raises(AdapterError, match=named) as refused:
        read_adapter("bad", _edited(adapters, tmp_path, **fields), base.config, MAX_RANK)
    assert "'bad'" in str(refused.value)


def test_a_rank_above_max_lora_rank_is_refused(base, adapters):
    with pytest.raises(AdapterError, match="r = 16 is above max_lora_rank = 8"):
        read_adapter("all16", adapters["all16"][0], base.config, 8)


def test_missing_pickled_truncated_and_mismatched_adapters_are_refused_naming_the_file(base, adapters, tmp_path):
    with pytest.raises(AdapterError, match="adapter_config.json not found"):
        read_adapter("gone", tmp_path / "nowhere", base.config, MAX_RANK)
    pickled = _edited(adapters, tmp_path)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(AdapterError, match=r"adapter_model\.bin \(pickle\) is not read"):
        read_adapter("pickled", pickled, base.config, MAX_RANK)
    truncated = tmp_path / "truncated"
    shutil.copytree(adapters["qv8"][0], truncated)
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(AdapterError, match="could not be read"):
        read_adapter("truncated", truncated, base.config, MAX_RANK)
    other = tiny_model(seed=1, layers=3)
    other.config.intermediate_size = 96
    wider = tmp_path / "wider"
    _make_adapter(tiny_model(seed=1, layers=3), {"r": 4, "target_modules": ["down_proj"]}, wider, 0)
    with pytest.raises(AdapterError, match="layer 2.*the base model has 2"):
        read_adapter("wider", wider, base.config, MAX_RANK)
    with pytest.raises(AdapterError, match="down_proj has lora_A .*base_model_name_or_path"):
        read_adapter("wider", wider, other.config, MAX_RANK)


def test_slots_go_to_the_least_recently_used_idle_adapter_and_a_full_table_waits():
    table = SlotTable(max_loras=2)
    assert table.acquire("a") == (1, True) and table.acquire("b") == (2, True)
    assert table.acquire("a") == (1, False)  # resident: no write
    assert table.acquire("c") is None  # both slots in use by running rows: the row waits
    table.release("b")
    assert table.acquire("c") == (2, True) and table.slot_of("b") is None  # b was idle: replaced
    for _ in range(2):
        table.release("a")
    table.release("c")
    assert table.acquire("b") == (1, True)  # a is now the least recently used idle adapter
    with pytest.raises(ValueError, match="in use"):
        table.evict("b")
    table.release("b")
    table.evict("b")
    assert table.slot_of("b") is None and table.acquire("d") == (1, True)


# ------------------------------------------------------------------------------------------- in the engine
ENGINE_PROMPTS = ["abc abc abc abc", "hello world", "one two one two one", "so it goes, so it goes"]
ENGINE_TOKENS = 16
# name -> PEFT's greedy generation of each of ENGINE_PROMPTS (None: the base model)
METHODS = {"none": {"method": "none"},
           "self-draft int4": {"method": "draft_model", "model": "target", "num_speculative_tokens": 3},
           "ngram": {"method": "ngram", "num_speculative_tokens": 3},
           "recycle": {"method": "recycle", "num_speculative_tokens": 3}}


@pytest.fixture(scope="module")
def peft_greedy(base, adapters, tokenizer) -> dict[str | None, list[list[int]]]:
    return _peft_greedy(base, adapters, tokenizer)


def _peft_greedy(base, adapters, tokenizer) -> dict[str | None, list[list[int]]]:
    """transformers + PEFT ``generate(do_sample=False)`` of each prompt under each adapter and the base."""
    expected = {}
    for name, model in [(None, base)] + [(name, reference) for name, (_, reference) in adapters.items()]:
        outputs = []
        for prompt in ENGINE_PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=ENGINE_TOKENS, eos_token_id=2, pad_token_id=0)
            outputs.append(generated[0, ids.shape[1]:].tolist())
        expected[name] = outputs
    assert all(expected[name] != expected[None] for name in adapters)  # each adapter changes the generation
    return expected


def _engine(base, tokenizer, adapters, speculative: dict, lora: dict | None = None, **fields):
    """An engine over ``base`` with ``adapters`` as its modules (and ``lora``'s other fields), static draft lengths."""
    config = Config.model_validate({
        "model": "in-memory", "batch_size": 8, "speculative": {**speculative, "length_policy": "static"},
        "sampling": {"max_tokens": ENGINE_TOKENS},
        "lora": {"enable": True, "max_lora_rank": MAX_RANK, "modules": {n: p for n, (p, _) in adapters.items()},
                 **(lora or {})},
        **fields,
    })
    return Engine(config, target=base, tokenizer=tokenizer)


def _requests(layout: list[str | None]):
    return [Request(id=f"{row}", prompt=ENGINE_PROMPTS[row % len(ENGINE_PROMPTS)], lora=name)
            for row, name in enumerate(layout)]


# Each adapter alone, then 8 rows of the three and the base in one batch.
LAYOUTS = [[name] * 4 for name in ADAPTERS] + [[None, "qv8", "all16", "rs16", "rs16", "all16", "qv8", None]]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_engine_outputs_equal_peft_for_each_adapter_alone_and_mixed(base, adapters, tokenizer, peft_greedy,
                                                                          method):
    engine = _engine(base, tokenizer, adapters, METHODS[method])
    drafted = accepted = 0
    for layout in LAYOUTS:
        results = engine.generate(_requests(layout))
        for row, (name, result) in enumerate(zip(layout, results)):
            assert result.error is None, result.error
            assert result.lora == name
            assert result.token_ids == peft_greedy[name][row % len(ENGINE_PROMPTS)], (method, name, row)
            drafted += sum(result.per_step_drafted)
            accepted += sum(result.per_step_accepted)
    assert (drafted > 0) == (method != "none")  # speculation happened under the adapters
    if method == "self-draft int4":  # the int4 twin drafts with each row's adapter: 0.44 here, 0.12 without it
        assert accepted / drafted > 0.3


@pytest.fixture(scope="module")
def two_head_base():
    """The Triton tests' base: two query heads sharing one kv head (grouped-query attention, as in
    test_engine_triton), so the interpreter runs half the rotary and attention programs of ``base``'s four; its
    projections, and so the adapters' shapes, are ``base``'s."""
    return tiny_model(seed=11, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def two_head_adapters(two_head_base, tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    return _adapters_of(two_head_base, tmp_path_factory.mktemp("two-head-adapters"))


@pytest.fixture(scope="module")
def two_head_peft_greedy(two_head_base, two_head_adapters, tokenizer) -> dict[str | None, list[list[int]]]:
    return _peft_greedy(two_head_base, two_head_adapters, tokenizer)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_with_the_triton_kernels_equals_peft_for_each_adapter_alone_and_mixed(
        two_head_base, two_head_adapters, two_head_peft_greedy, tokenizer, method):
    """The fused Triton layer (under the interpreter here: eight tokens) adds the same deltas: each adapter alone
    (two rows: the interpreter's time grows with the rows), then the three and the base in one batch of eight."""
    base, adapters, peft_greedy = two_head_base, two_head_adapters, two_head_peft_greedy
    engine = _engine(base, tokenizer, adapters, METHODS[method], execution={"kernels": "triton"},
                     sampling={"max_tokens": 8})
    assert engine.cache.execution.kernels == "triton"
    drafted = 0
    for layout in [[name] * 2 for name in ADAPTERS] + LAYOUTS[-1:]:
        results = engine.generate(_requests(layout))
        for row, (name, result) in enumerate(zip(layout, results)):
            assert result.token_ids == peft_greedy[name][row % len(ENGINE_PROMPTS)][:8], (method, name, row)
        drafted += sum(sum(r.per_step_drafted) for r in results)
    assert (drafted > 0) == (method != "none")


@pytest.mark.parametrize("method", ["none", "self-draft int4"])
def test_captured_graphs_replay_adapter_rows_as_peft_computes_them(base, adapters, tokenizer, peft_greedy, method,
                                                                   monkeypatch):
    """Graphs captured at build, as a CUDA engine captures them (the eager stand-in recorder on this CPU): the
    shapes with adapter rows beside the base's, before any adapter is loaded; then a mixed batch's verifications (and
    the self-draft's levels) replay the adapter graphs, which read the slots loaded since, and a batch of base rows
    replays the base's; the tokens are PEFT's."""
    from test_forward import _capture_at_build

    from decoding.model import cuda_graphs

    _capture_at_build(monkeypatch)
    replayed: list[bool] = []  # whether each replay carried adapter rows
    replay = cuda_graphs._Graph.replay
    monkeypatch.setattr(cuda_graphs._Graph, "replay", lambda graph, inputs: (
        replayed.append(inputs.adapter_slots is not None) or replay(graph, inputs)))
    engine = _engine(base, tokenizer, adapters, METHODS[method])
    runners = [engine.stepper.runner] + ([engine.drafter.runner] if method != "none" else [])
    for runner in runners:
        shapes = runner.graphs.graphs
        assert runner.replays and {s.adapters for s in shapes} == {False, True}
        assert {dataclasses.replace(s, adapters=False) for s in shapes if s.adapters} == {
            s for s in shapes if not s.adapters}
    for layout in (LAYOUTS[-1], [None] * 4):
        results = engine.generate(_requests(layout))
        for row, (name, result) in enumerate(zip(layout, results)):
            assert result.token_ids == peft_greedy[name][row % len(ENGINE_PROMPTS)], (method, name, row)
        if method != "none":
            assert sum(sum(r.per_step_drafted) for r in results) > 0
    assert True in replayed and False in replayed


def test_greedy_through_transformers_forward_equals_peft(base, adapters, tokenizer, peft_greedy, monkeypatch):
    """A model without the lean forward runs transformers' own, the deltas added by hooks."""
    from decoding.model import lean_forward

    monkeypatch.setattr(lean_forward, "supports_lean_forward", lambda model: False)
    engine = _engine(base, tokenizer, adapters, METHODS["ngram"])
    assert not isinstance(engine.target, lean_forward.LeanCausalLM)
    layout = LAYOUTS[-1]
    results = engine.generate(_requests(layout))
    for row, (name, result) in enumerate(zip(layout, results)):
        assert result.token_ids == peft_greedy[name][row % len(ENGINE_PROMPTS)], (name, row)
    assert sum(sum(r.per_step_drafted) for r in results) > 0


def test_sampling_with_an_adapter_and_speculation_follows_the_adapted_law(tokenizer, tmp_path):
    """n-gram candidates (two per level) at temperature 1 under an adapter: the joint law of the first two tokens
    is the adapted target's (PEFT's model, exact law by enumeration), with drafts verified and some rejected."""
    from engine_cases import SMALL_VOCAB, chi_square_pvalue, exact_joint_law, sampled_pairs

    target = tiny_model(seed=7, layers=1, vocab_size=SMALL_VOCAB, heads=2, kv_heads=1)
    reference = _make_adapter(target, {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}, tmp_path / "a", 3)
    prompt, warp, samples = [3, 4, 5, 3], {"temperature": 1.0, "top_k": 0, "top_p": 1.0}, 160
    laws = {name: exact_joint_law(model, prompt, warp, (0, 1)) for name, model in (("adapted", reference),
                                                                                    ("base", target))}
    # The adapter moves the law far enough (total variation) that a run without it fails the test.
    assert (laws["adapted"] - laws["base"]).abs().sum() / 2 > 0.3
    engine = _engine(target, tokenizer, {"a": (str(tmp_path / "a"), reference)},
                     {"method": "ngram", "num_candidates": 2, "num_speculative_tokens": 2}, batch_size=80,
                     sampling={"max_tokens": 3, **warp})
    results = engine.generate([Request(id=str(i), prompt_token_ids=prompt, sampling={"seed": i}, lora="a")
                               for i in range(samples)])
    drafted = sum(sum(r.per_step_drafted) for r in results)
    accepted = sum(sum(r.per_step_accepted) for r in results)
    assert drafted > samples / 2 and 0 < accepted < drafted  # speculation really happened, with rejections
    assert chi_square_pvalue(sampled_pairs(results, (0, 1)), laws["adapted"]) > 1e-3


def _generate(model, tokenizer, prompt: str, tokens: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=tokens, eos_token_id=2, pad_token_id=0)
    return generated[0, ids.shape[1]:].tolist()


def test_prefix_blocks_are_never_shared_across_adapters_or_with_the_base(base, adapters, tokenizer):
    """Rows of two adapters and the base with one prompt: each finds only blocks its own adapter computed."""
    prompt = "the quick brown fox jumps over the lazy dog, said the quick brown fox"  # 4 full blocks of 16
    expected = {None: _generate(base, tokenizer, prompt, ENGINE_TOKENS)}
    expected.update({name: _generate(adapters[name][1], tokenizer, prompt, ENGINE_TOKENS) for name in ("qv8", "rs16")})
    engine = _engine(base, tokenizer, adapters, METHODS["ngram"])

    def run(names: list[str | None]) -> list[int]:
        results = engine.generate([Request(id=str(i), prompt=prompt, lora=name) for i, name in enumerate(names)])
        for name, result in zip(names, results):
            assert result.error is None and result.token_ids == expected[name], name
        return [result.num_cached_tokens for result in results]

    assert run([None]) == [0]
    assert run(["qv8", "rs16", None]) == [0, 0, 64]  # only the base row finds the base's blocks
    assert run(["rs16", "qv8", None]) == [64, 64, 64]  # and each adapter's rows their own adapter's


def _broken(adapters, tmp_path, name: str, **edits) -> str:
    folder = tmp_path / name
    shutil.copytree(adapters["qv8"][0], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **edits}))
    return str(folder)


def test_an_adapter_that_cannot_be_had_fails_its_row_alone(base, adapters, tokenizer, peft_greedy, tmp_path):
    """Unknown, corrupt, missing, too high a rank, an unreadable URI: that row's error names it; the others run."""

    corrupt = tmp_path / "corrupt"
    shutil.copytree(adapters["qv8"][0], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    modules = {**{n: p for n, (p, _) in adapters.items()}, "corrupt": str(corrupt),
               "missing": str(tmp_path / "nowhere"), "wide": _broken(adapters, tmp_path, "wide", r=64),
               "remote": "nosuchscheme://bucket/adapter"}
    engine = _engine(base, tokenizer, adapters, METHODS["ngram"], lora={"modules": modules})
    names = ["qv8", "unknown", "corrupt", None, "missing", "wide", "remote", "rs16"]
    results = engine.generate(_requests(names))
    errors = {name: result.error for name, result in zip(names, results)}
    assert "unknown adapter 'unknown'" in errors["unknown"]
    assert "'corrupt'" in errors["corrupt"] and "could not be read" in errors["corrupt"]
    assert "'missing'" in errors["missing"] and "adapter_config.json not found" in errors["missing"]
    assert "'wide'" in errors["wide"] and "max_lora_rank = 16" in errors["wide"]
    assert "'remote'" in errors["remote"] and "nosuchscheme://bucket/adapter" in errors["remote"]
    for row, (name, result) in enumerate(zip(names, results)):
        if name in (None, "qv8", "rs16"):
            assert result.error is None and result.token_ids == peft_greedy[name][row % len(ENGINE_PROMPTS)]
        else:
            assert result.finish_reason == "error" and result.token_ids == []


def test_more_adapters_than_slots_queue_and_all_finish(base, adapters, tokenizer, peft_greedy):
    """One device slot, three adapters in one batch: rows wait for the slot, none fails, every output is right."""
    engine = _engine(base, tokenizer, adapters, METHODS["ngram"], lora={"max_loras": 1})
    layout = LAYOUTS[-1]
    results = engine.generate(_requests(layout))
    for row, (name, result) in enumerate(zip(layout, results)):
        assert result.error is None and result.token_ids == peft_greedy[name][row % len(ENGINE_PROMPTS)], (name, row)


def test_adapters_are_refused_where_lora_is_off(base, tokenizer):
    engine = Engine(Config.model_validate({"model": "in-memory", "speculative": {"method": "none"}}), target=base,
                    tokenizer=tokenizer)
    [result] = engine.generate([Request(id="0", prompt="ab", lora="qv8")])
    assert "LoRA adapters are not enabled" in result.error
    with pytest.raises(ValueError, match="enable is false"):
        Config.model_validate({"lora": {"modules": {"a": "/x"}}})


# ----------------------------------------------------------------------------------------------- the surfaces
def test_vllm_ray_data_llm_and_serve_llm_lora_fields_make_the_lora_section():
    from deploy.llm_config import LLMConfig
    from jobs.serve import parse
    from pipeline.processor_config import ProcessorConfig

    processor = ProcessorConfig(model_source="m", dynamic_lora_loading_path="s3://bucket/adapters",
                                engine_kwargs={"enable_lora": True, "max_lora_rank": 32, "max_loras": 2,
                                               "max_cpu_loras": 8})
    assert processor.engine_config().lora.model_dump() == {
        "enable": True, "max_loras": 2, "max_lora_rank": 32, "max_cpu_loras": 8, "modules": {},
        "dynamic_lora_loading_path": "s3://bucket/adapters", "allow_runtime_lora_updating": False}
    assert not ProcessorConfig(model_source="m", engine_kwargs={"enable_lora": False}).engine_config().lora.enable
    serve_llm = LLMConfig(model_loading_config={"model_id": "m"}, engine_kwargs={"max_lora_rank": 8},
                          lora_config={"dynamic_lora_loading_path": "/adapters", "max_num_adapters_per_replica": 2})
    lora = serve_llm.engine_config().lora
    assert (lora.enable, lora.dynamic_lora_loading_path, lora.max_cpu_loras, lora.max_loras, lora.max_lora_rank) == (
        True, "/adapters", 2, 2, 8)
    _, _, config = parse(["--lora-modules", "a=/x", '{"name": "b", "path": "s3://x/b"}'])
    assert config.lora.enable and config.lora.modules == {"a": "/x", "b": "s3://x/b"}
    with pytest.raises(SystemExit):
        parse(["--lora-modules", "no-path"])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        Config.model_validate({"lora": {"enable": True, "max_loras": 8, "max_cpu_loras": 4}})


@pytest.fixture(scope="module")
def job_config(tiny_dirs, target, tmp_path_factory) -> tuple[Config, dict[str, str]]:
    """The pipeline's tiny target (``tiny_dirs``) with two adapters of it and n-gram drafting."""
    root = tmp_path_factory.mktemp("job-adapters")
    for seed, name in enumerate(("qv8", "rs16")):
        _make_adapter(target, ADAPTERS[name], root / name, seed)
    config = Config.model_validate({
        "model": tiny_dirs["target"], "batch_size": 4, "sampling": {"max_tokens": 12},
        "speculative": {"method": "ngram", "num_speculative_tokens": 3, "length_policy": "static"},
        "lora": {"enable": True, "max_lora_rank": MAX_RANK, "dynamic_lora_loading_path": str(root)},
    })
    return config, {"qv8": str(root / "qv8"), "rs16": str(root / "rs16")}


def test_rows_name_adapters_by_their_lora_column_or_ray_data_llms_model(job_config):
    """The actor's rows: a ``lora`` column, or (Ray Data LLM's rows) ``model`` unless it names the base; output rows
    say which adapter produced them and equal the engine's; a bad name is that row's error alone."""
    import pyarrow as pa

    from pipeline.actor import GenerationActor
    from pipeline.schema import RowOptions

    config, _ = job_config
    prompts = ["the cat sat", "one two one two", "abc abc abc", "so it goes"]
    expected = Engine(config).generate([Request(str(i), prompt=p, lora=name) for i, (p, name) in
                                        enumerate(zip(prompts, [None, "qv8", "rs16", "qv8"]))])
    actor = GenerationActor(config.model_dump(mode="json"), options=RowOptions(metrics=False))
    block = actor(pa.table({"id": ["0", "1", "2", "3", "4"], "prompt": [*prompts, "ab"],
                            "lora": [None, "qv8", "rs16", "qv8", "missing"]}))
    assert block["lora"].to_pylist() == [None, "qv8", "rs16", "qv8", "missing"]
    assert block["generated_tokens"].to_pylist()[:4] == [r.token_ids for r in expected]
    assert block["finish_reason"][4].as_py() == "error" and "'missing'" in block["error"][4].as_py()
    ray_llm = GenerationActor(config.model_dump(mode="json"), options=RowOptions(metrics=False, ray_data_llm_rows=True))
    block = ray_llm(pa.table({"prompt": prompts, "model": [config.model, "qv8", "rs16", "qv8"]}))
    assert block["lora"].to_pylist() == [None, "qv8", "rs16", "qv8"]
    assert block["generated_tokens"].to_pylist() == [r.token_ids for r in expected]


def test_a_job_breaks_its_acceptance_statistics_down_per_adapter(ray_cluster, job_config, tmp_path):
    from pipeline.job import run
    from pipeline.report import load_run, summarize

    config, _ = job_config
    rows = [{"id": str(i), "prompt": "one two one two one two", "lora": [None, "qv8", "rs16"][i % 3]}
            for i in range(6)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = run(config, str(tmp_path / "in.jsonl"), str(tmp_path / "out"))
    per_adapter = {entry["lora"]: entry for entry in summary["adapters"]}
    assert set(per_adapter) == {None, "qv8", "rs16"} and all(e["rows"] == 2 for e in per_adapter.values())
    for total in ("generated_tokens", "num_draft_tokens", "num_accepted_draft_tokens", "num_spec_steps"):
        assert sum(e[total] for e in per_adapter.values()) == summary[total], total
    assert per_adapter["qv8"]["num_draft_tokens"] > 0 and per_adapter["rs16"]["num_draft_tokens"] > 0
    table = summarize(load_run(tmp_path / "out"))
    assert {label.split(":")[0] for label in table if label.startswith(("adapter", "base model"))} == {
        "adapter qv8", "adapter rs16", "base model (no adapter)"}


def test_the_ray_data_llm_lora_example_runs(ray_cluster, monkeypatch, capsys):
    import runpy

    monkeypatch.setattr(ray_cluster, "init", lambda *args, **kwargs: None)  # the session's cluster runs it
    runpy.run_path(str(REPO / "examples" / "ray_data_llm_lora.py"), run_name="__main__")
    lines = capsys.readouterr().out.strip().splitlines()
    assert sorted(line.split(":")[0] for line in lines) == ["0 [base]", "1 [random-adapter]", "2 [base]",
                                                            "3 [random-adapter]"], lines


def test_the_lora_benchmark_measures_each_contender(tiny_dirs, tmp_path, monkeypatch):
    import tempfile

    from bench.lora import format_lora, run_lora_bench

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    config = Config.model_validate({"model": tiny_dirs["target"], "batch_size": 4, "speculative": {"method": "none"},
                                    "sampling": {"max_tokens": 4, "ignore_eos": True}})
    rows = run_lora_bench(config, [Request("p", prompt="the cat")], [1, 2], rank=4, rounds=1, progress=lambda _: None)
    assert [(r.contender, r.adapters, r.rows) for r in rows] == [
        ("base", 0, 4), ("1 adapters", 1, 4), ("2 adapters", 2, 4), ("mixed: base rows", 1, 4),
        ("merged weights", 0, 4)]
    assert all(r.tokens_per_s > 0 for r in rows) and rows[0].vs_base == 1.0
    assert "one adapter batched / its merged weights" in format_lora(rows)
    assert not list(tmp_path.iterdir())  # the adapters it wrote are removed
