"""Pre-quantized checkpoints (``decoding.model.packed_checkpoints``): the tiny Llama quantized round-to-nearest and
saved as AWQ, GPTQ (v1 and v2, 4 and 8 bits) and compressed-tensors (pack-quantized W4A16 and W8A16, int-quantized
W8A16) checkpoints, packed as each format's public layout specifies (compressed-tensors through its own package),
loads as the integers it stores and decodes as the float model of the same dequantized weights does."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize
from engine_cases import (
    MAX_TOKENS,
    PROMPTS,
    assert_speculative_sampling_follows_law,
    make_config,
    run,
    transformers_greedy,
)
from safetensors.torch import save_file

from decoding import Engine, Request
from decoding.model.gguf_blocks import uses_blocks
from decoding.model.loading import load_model
from decoding.model.packed_checkpoints import awq_columns, unpack
from frontend.engine_args import config_fields

CPU = torch.device("cpu")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _words(ints: np.ndarray, bits: int) -> np.ndarray:
    """[..., n * 32 / bits] unsigned integers -> [..., n] int32 words, integer i of a word at bits i * bits."""
    per = 32 // bits
    grouped = ints.astype(np.uint64).reshape(*ints.shape[:-1], -1, per)
    shifts = np.arange(per, dtype=np.uint64) * np.uint64(bits)
    return (grouped << shifts).sum(-1).astype(np.uint32).view(np.int32)


def _round_to_nearest(weight: torch.Tensor, bits: int, group: int, symmetric: bool):
    """(q [N, K] unsigned, zero [N, G], scale [N, G] float16) with w ~ (q - zero) * scale."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // group, group)
    top = (1 << bits) - 1
    if symmetric:
        zero = torch.full((rows, cols // group), float(1 << (bits - 1)))
        scale = (groups.abs().amax(-1) / ((1 << (bits - 1)) - 1)).clamp(min=1e-6).half()
    else:
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = ((high - low) / top).clamp(min=1e-6).half()
        zero = (-low / scale.float()).round().clamp(0, top)
    q = (groups / scale.float()[..., None] + zero[..., None]).round().clamp(0, top).reshape(rows, cols)
    return q.long(), zero.long(), scale


def _awq(q, zero, scale, bits):
    """AutoAWQ's GEMM layout: [K, N / 8] words, word c holding columns 8c + (0, 2, 4, 6, 1, 3, 5, 7) from nibble 0."""
    def pack(ints: np.ndarray) -> np.ndarray:  # [R, C] -> [R, C / 8]
        return _words(ints.reshape(ints.shape[0], -1, 8)[:, :, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(ints.shape), 4)

    return {"qweight": pack(q.T.numpy()), "qzeros": pack(zero.T.numpy()), "scales": scale.T.contiguous()}


def _gptq(q, zero, scale, bits, v1=True):
    """GPTQ's layout: qweight [K * bits / 32, N] packed along K, qzeros [G, N * bits / 32] along N (v1: z - 1)."""
    group = q.shape[1] // scale.shape[1]
    stored = (zero - 1) & ((1 << bits) - 1) if v1 else zero
    return {"qweight": _words(q.numpy(), bits).T.copy(),  # word [i, n]: q[n, 8i + j] at bits 4j (4 bits)
            "qzeros": _words(stored.T.numpy(), bits), "scales": scale.T.contiguous(),
            "g_idx": torch.arange(q.shape[1], dtype=torch.int32) // group}


def _compressed(q, zero, scale, bits, symmetric):
    """compressed-tensors' pack-quantized layout, packed by its own pack_to_int32 (signed q, offset when stored)."""
    offset = 1 << (bits - 1)
    out = {"weight_packed": pack_to_int32((q - offset).to(torch.int8), bits),
           "weight_scale": scale, "weight_shape": torch.tensor(list(q.shape))}
    if not symmetric:
        out["weight_zero_point"] = pack_to_int32((zero - offset).to(torch.int8), bits, packed_dim=0)
    return out


def _int_quantized(q, zero, scale, bits, symmetric):
    return {"weight": (q - 128).to(torch.int8), "weight_scale": scale}


def _ct_config(bits, group, symmetric, fmt):
    strategy = "group" if group else "channel"
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    return QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"]).model_dump(
        mode="json")


# name -> (bits, group (None: per output row), symmetric, the config's quantization_config, tensors of one layer)
FORMATS = {
    "awq-w4-g32": (4, 32, False, {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                  "version": "gemm"}, _awq),
    "gptq-w4-g64-asym": (4, 64, False, {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False,
                                        "sym": False}, _gptq),
    "gptq_v2-w4-g32-sym": (4, 32, True, {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
                                         "checkpoint_format": "gptq_v2"},
                           lambda q, z, s, b: _gptq(q, z, s, b, v1=False)),
    "gptq-w8-channel": (8, None, True, {"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": True}, _gptq),
    "gptq-w8-g32-asym": (8, 32, False, {"quant_method": "gptq", "bits": 8, "group_size": 32, "sym": False}, _gptq),
    "ct-w4a16-g32-sym": (4, 32, True, _ct_config(4, 32, True, "pack-quantized"),
                         lambda q, z, s, b: _compressed(q, z, s, b, True)),
    "ct-w4a16-g64-asym": (4, 64, False, _ct_config(4, 64, False, "pack-quantized"),
                          lambda q, z, s, b: _compressed(q, z, s, b, False)),
    "ct-w8a16-channel": (8, None, True, _ct_config(8, None, True, "pack-quantized"),
                         lambda q, z, s, b: _compressed(q, z, s, b, True)),
    "ct-int-w8a16-channel": (8, None, True, _ct_config(8, None, True, "int-quantized"),
                             lambda q, z, s, b: _int_quantized(q, z, s, b, True)),
}


def write_checkpoint(model, folder, name: str, tokenizer=None, layers=None):
    """``model`` quantized as FORMATS[name] into ``folder``; returns the float reference of its dequantized weights.
    ``layers``: per (layer index, linear) the tensors to write instead (to make bad checkpoints)."""
    bits, group, symmetric, quantization_config, pack = FORMATS[name]
    reference = copy.deepcopy(model)
    tensors = {}
    with torch.no_grad():
        for key, value in reference.state_dict().items():
            tensors[key] = value.detach().clone().half()  # checkpoints keep their float tensors in float16
        for index, layer in enumerate(reference.model.layers):
            for linear in LINEARS:
                module = layer.get_submodule(linear)
                q, zero, scale = _round_to_nearest(module.weight, bits, group or module.weight.shape[1], symmetric)
                module.weight.copy_((q - zero.repeat_interleave(q.shape[1] // zero.shape[1], 1)).float()
                                    * scale.float().repeat_interleave(q.shape[1] // scale.shape[1], 1))
                prefix = f"model.layers.{index}.{linear}"
                del tensors[f"{prefix}.weight"]
                packed = pack(q, zero, scale, bits)
                packed = (layers or {}).get((index, linear), packed)
                for suffix, value in packed.items():
                    tensors[f"{prefix}.{suffix}"] = torch.as_tensor(value).contiguous()
        for key, value in reference.state_dict().items():  # float tensors as the checkpoint rounds them
            if tensors.get(key, value).is_floating_point() and key in tensors:
                value.copy_(tensors[key].float())
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = reference.config.to_dict()
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return reference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, target):
    """name -> (folder, float reference) for every format."""
    root = tmp_path_factory.mktemp("packed")
    return {name: (root / name, write_checkpoint(target, root / name, name)) for name in FORMATS}


def test_packed_words_are_read_in_each_formats_order() -> None:
    # one word holding 0..7: packed from the lowest bits up (GPTQ, compressed-tensors), and as AutoAWQ packs it
    assert unpack(torch.tensor([[0x76543210]], dtype=torch.int32), 4, 1).tolist() == [list(range(8))]
    assert awq_columns(torch.tensor([[0x75316420]], dtype=torch.int32)).tolist() == [list(range(8))]
    assert unpack(torch.tensor([[-0x01020304]], dtype=torch.int32), 8, 1).tolist() == [[0xFC, 0xFC, 0xFD, 0xFE]]
    # compressed-tensors' own packing of signed 4-bit values, read back offset by 8
    values = torch.tensor([[-8, -1, 0, 7, 3, -5, 1, 2]], dtype=torch.int8)
    assert (unpack(pack_to_int32(values, 4), 4, 1) - 8).tolist() == values.tolist()


@pytest.mark.parametrize("name", FORMATS)
def test_a_packed_checkpoint_runs_its_integers_and_computes_its_dequantized_weights(name, checkpoints) -> None:
    folder, reference = checkpoints[name]
    model = load_model(str(folder), "auto", CPU)
    assert uses_blocks(model)
    # every quantized projection computes from its integers: the float weights left are the embedding's, the
    # head's and the norms'
    assert sorted({key.split(".")[-2] for key, p in model.named_parameters() if p.numel()}) == [
        "embed_tokens", "input_layernorm", "lm_head", "norm", "post_attention_layernorm"]
    for index, layer in enumerate(model.model.layers):
        for linear in LINEARS:
            expected = reference.model.layers[index].get_submodule(linear).weight
            x = torch.eye(expected.shape[1])
            assert torch.equal(layer.get_submodule(linear)(x).T, expected), (name, index, linear)  # bit for bit
    ids = torch.tensor([[1, 5, 9, 12, 3, 3, 7, 20, 4]])
    with torch.no_grad():
        ours, expected = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_compressed_tensors_dequantizes_as_the_package_does(checkpoints) -> None:
    """The package's own dequantize of the integers it packed, against the blocks the engine multiplies."""
    from safetensors.torch import load_file

    for name in ("ct-w4a16-g64-asym", "ct-w8a16-channel"):
        folder, _ = checkpoints[name]
        bits, group, symmetric = FORMATS[name][:3]
        tensors = load_file(str(folder / "model.safetensors"))
        model = load_model(str(folder), "auto", CPU)
        prefix = "model.layers.1.mlp.down_proj"
        rows, cols = tensors[f"{prefix}.weight_shape"].tolist()
        offset = 1 << (bits - 1)
        q = (unpack(tensors[f"{prefix}.weight_packed"], bits, 1) - offset).to(torch.int8)
        zero = (unpack(tensors[f"{prefix}.weight_zero_point"], bits, 0)[:rows] - offset
                if not symmetric else None)
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                                strategy="group" if group else "channel", group_size=group)
        expected = dequantize(q, tensors[f"{prefix}.weight_scale"].float(), zero, args, dtype=torch.float32)
        ours = model.model.layers[1].mlp.down_proj(torch.eye(cols)).T
        assert torch.equal(ours, expected), name


SPECULATIVE = {
    "none": {"method": "none"},
    "default": {"method": "draft_model", "model": "target", "quantization": "int4", "ngram_candidates": 1,
                "length_policy": "online"},
    "self-draft": {"method": "draft_model", "model": "target", "quantization": "int4", "length_policy": "static"},
    "draft-model": {"method": "draft_model", "num_candidates": 2, "length_policy": "static"},
    "ngram": {"method": "ngram", "num_candidates": 2, "length_policy": "static"},
}
CASES = [(name, "none") for name in FORMATS] + [(name, "default") for name in FORMATS] + [
    ("awq-w4-g32", "self-draft"), ("gptq-w8-channel", "draft-model"), ("ct-w4a16-g32-sym", "ngram")]


@pytest.fixture(scope="module")
def greedy_references(checkpoints, tokenizer) -> dict[str, list[list[int]]]:
    """transformers' greedy decoding of each format's float reference."""
    return {name: transformers_greedy(reference, tokenizer) for name, (_, reference) in checkpoints.items()}


@pytest.mark.parametrize(("name", "speculative"), CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_greedy_decoding_of_a_packed_checkpoint_is_its_dequantized_models(name, speculative, checkpoints,
                                                                          greedy_references, tokenizer,
                                                                          draft) -> None:
    """Plain decoding and speculation over the packed integers give transformers' greedy tokens of the float model
    holding the dequantized weights, token for token (the default and plain decoding therefore agree)."""
    folder, _ = checkpoints[name]
    model = load_model(str(folder), "auto", CPU)
    results = run(make_config(**SPECULATIVE[speculative]), tokenizer, model, draft)
    assert [r.token_ids for r in results] == greedy_references[name]
    if SPECULATIVE[speculative].get("length_policy") == "static":
        assert sum(sum(r.per_step_drafted) for r in results) > len(PROMPTS)  # speculation really happened


def test_sampling_over_a_packed_checkpoint_follows_its_dequantized_models_law(small_models, tokenizer,
                                                                              tmp_path) -> None:
    """Temperature 1 with a float draft over a GPTQ target: the sampled pairs follow the exact joint law of the
    dequantized model (chi-square), with drafts proposed, some kept and some rejected."""
    small_target, small_draft = small_models
    reference = write_checkpoint(small_target, tmp_path / "gptq", "gptq-w4-g64-asym")
    packed = load_model(str(tmp_path / "gptq"), "auto", CPU)
    assert_speculative_sampling_follows_law(reference, packed, small_draft, tokenizer)


def test_a_packed_checkpoint_runs_through_the_engine_by_its_path(tokenizer, tmp_path, target) -> None:
    folder = tmp_path / "awq"
    reference = write_checkpoint(target, folder, "awq-w4-g32", tokenizer)
    config = make_config(method="none").model_copy(update={"model": str(folder), "quantization": "awq"})
    results = Engine(config).generate([Request(id="a", prompt=PROMPTS[0])])
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=MAX_TOKENS)[0, ids.shape[1]:].tolist()
    assert results[0].token_ids == expected
    assert config_fields({"quantization": "awq"})["quantization"] == "awq"
    assert config_fields({"quantization": "compressed-tensors"})["quantization"] == "compressed-tensors"


def _bad(tmp_path, target, name, layers=None, **config_changes):
    folder = tmp_path / "bad"
    write_checkpoint(target, folder, name, layers=layers)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(config_changes)
    path.write_text(json.dumps(config))
    return str(folder)


def test_checkpoints_that_cannot_run_as_stored_are_refused_naming_the_field_or_tensor(tmp_path, target,
                                                                                      tiny_dirs) -> None:
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method 'bitsandbytes' is not read"):
        load_model(_bad(tmp_path, target, "awq-w4-g32", quant_method="bitsandbytes"), "auto", CPU)
    with pytest.raises(ValueError, match=r"quantization_config\.version 'gemv': AWQ's gemm layout"):
        load_model(_bad(tmp_path, target, "awq-w4-g32", version="gemv"), "auto", CPU)
    q, zero, scale = _round_to_nearest(target.model.layers[0].self_attn.q_proj.weight, 4, 64, False)
    act_order = {(0, "self_attn.q_proj"): {**_gptq(q, zero, scale, 4), "g_idx": (torch.arange(64) % 2).int()}}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.g_idx: act-order groups"):
        load_model(_bad(tmp_path, target, "gptq-w4-g64-asym", layers=act_order), "auto", CPU)
    q, zero, scale = _round_to_nearest(target.model.layers[1].mlp.up_proj.weight, 4, 16, False)
    small_groups = {(1, "mlp.up_proj"): _gptq(q, zero, scale, 4)}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.qweight: groups of 16 weights .* are not "
                                         r"whole blocks of 32"):
        load_model(_bad(tmp_path, target, "gptq-w4-g64-asym", layers=small_groups), "auto", CPU)
    truncated = dict(_gptq(*_round_to_nearest(target.model.layers[0].mlp.down_proj.weight, 4, 64, False), 4))
    truncated["qweight"] = truncated["qweight"][:-2]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.qweight: int32 \[14, 64\] where a "
                                         r"\[64, 128\] layer needs int32 \[16, 64\] \(truncated or corrupt\)"):
        load_model(_bad(tmp_path, target, "gptq-w4-g64-asym", layers={(0, "mlp.down_proj"): truncated}), "auto", CPU)
    activations = _ct_config(8, None, True, "int-quantized")
    activations["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "dynamic": True,
                                                                    "strategy": "token"}
    with pytest.raises(ValueError, match=r"config_groups\.group_0\.input_activations: activations are computed"):
        load_model(_bad(tmp_path, target, "ct-int-w8a16-channel", **activations), "auto", CPU)
    with pytest.raises(ValueError, match=r"quantization_config\.format 'float-quantized' is not read"):
        load_model(_bad(tmp_path, target, "ct-w8a16-channel", format="float-quantized"), "auto", CPU)
    folder = _bad(tmp_path, target, "awq-w4-g32")
    with pytest.raises(ValueError, match=r"quantization: gptq names another method than model .* was quantized with "
                                         r"\(awq\)"):
        load_model(folder, "auto", CPU, quantization="gptq")
    with pytest.raises(ValueError, match=r"quantization: awq checkpoints run on a CPU in float32 \(or on a GPU\): .* "
                                         r"the CPU in bfloat16"):
        load_model(folder, "bfloat16", CPU)
    with pytest.raises(ValueError, match=r"quantization: awq names another method .* \(full precision\)"):
        load_model(tiny_dirs["target"], "auto", CPU, quantization="awq")
    with pytest.raises(ValueError, match=r"engine_kwargs\.quantization='fp8'"):
        config_fields({"quantization": "fp8"})
