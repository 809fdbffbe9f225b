"""LoRA adapters: PEFT folders read and checked (``decoding.model.lora``), applied to every row of a batch by one
masked matmul pair per projection, equal to PEFT's own forward (the reference) for each adapter alone and mixed."""

from __future__ import annotations

import copy
import json
import shutil

import peft  # a test dependency (pyproject's dev extra): the reference implementation
import pytest
import torch
from tiny import tiny_model

from decoding.model.lora import PROJECTIONS, AdapterError, LoraSlots, SlotTable, projection_shapes, read_adapter

# name -> PEFT LoraConfig fields: ranks 8 and 16, q/v only and all-linear, rslora.
ADAPTERS = {
    "qv8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "all16": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"},
    "rs16": {"r": 16, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
             "use_rslora": True},
}
MAX_RANK = 16


@pytest.fixture(scope="module")
def base():
    return tiny_model(seed=11)


def _make_adapter(model, fields: dict, path, seed: int) -> torch.nn.Module:
    """A PEFT adapter over a copy of ``model`` with random A and B (PEFT's init_lora_weights=False), saved to
    ``path``; returns the PEFT model (the reference)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **fields)
    model = peft.get_peft_model(copy.deepcopy(model), config).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: (str(root / name), _make_adapter(base, fields, root / name, seed))
            for seed, (name, fields) in enumerate(ADAPTERS.items())}


def _with_slots(model, slots: LoraSlots, token_slots: torch.Tensor):
    """Hooks on ``model``'s projections adding each token's adapter delta; returns the handles to remove."""
    mask = slots.mask(token_slots.flatten())
    handles = []
    for layer, block in enumerate(model.model.layers):
        for projection in PROJECTIONS:
            module = getattr(block.self_attn, projection, None) or getattr(block.mlp, projection)

            def hook(_, inputs, output, layer=layer, projection=projection):
                x = inputs[0].reshape(-1, inputs[0].shape[-1])
                return output + slots.delta(x, mask, layer, projection).reshape(output.shape)

            handles.append(module.register_forward_hook(hook))
    return handles


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
        token_slots = torch.tensor(layout)[:, None].expand(ids.shape)
        handles = _with_slots(base, slots, token_slots)
        try:
            logits = base(ids).logits
        finally:
            for handle in handles:
                handle.remove()
        for row, slot in enumerate(layout):
            torch.testing.assert_close(logits[row], expected[names[slot]][row], rtol=1e-5, atol=1e-5)


def test_the_base_slot_adds_nothing_and_a_cleared_slot_is_the_base(base, adapters):
    slots = LoraSlots(base.config, max_loras=2, max_rank=MAX_RANK)
    slots.load(1, read_adapter("qv8", adapters["qv8"][0], base.config, MAX_RANK))
    x = torch.randn(5, base.config.hidden_size)
    mask = slots.mask(torch.tensor([0, 1, 1, 0, 2]))
    delta = slots.delta(x, mask, 0, "q_proj")
    assert delta[[0, 3, 4]].abs().max() == 0 and delta[[1, 2]].abs().max() > 0
    assert slots.delta(x, mask, 0, "k_proj").abs().max() == 0  # qv8 does not target k_proj
    slots.clear(1)
    assert slots.delta(x, mask, 0, "q_proj").abs().max() == 0


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
