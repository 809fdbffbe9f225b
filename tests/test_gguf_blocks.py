"""Weights in GGUF's 32-weight blocks (``decoding.model.gguf_blocks``): read from a GGUF tensor's bytes, dequantized
bit for bit as the ``gguf`` package dequantizes them, and multiplied as stored by ``specbatch::block_linear`` (the
C++ kernel: the one-token path, token tiles, and the dense path of a prefill) on SmolLM2-135M's and Llama-3-8B's
projection shapes; and a tiny Llama written as a GGUF (``tiny.gguf_pair``) decoding over its blocks, greedy and
sampled, as the float model of its dequantized weights does."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_cases import (
    PROMPTS,
    assert_speculative_sampling_follows_law,
    make_config,
    run,
    transformers_greedy,
)
from gguf import GGMLQuantizationType, GGUFWriter, quants
from tiny import gguf_pair, tiny_model

from decoding.config import Config
from decoding.model.attention import cpu_kernel
from decoding.model.gguf_blocks import LAYOUTS, dequantized, from_gguf, use_gguf_blocks, uses_blocks
from decoding.model.loading import load_model
from frontend.engine_args import config_fields

TYPES = list(LAYOUTS)
# [N, K]: SmolLM2-135M's k/v and down projections, Llama-3-8B's k/v projection.
SHAPES = {"smollm2-kv": (192, 576), "smollm2-down": (576, 1536), "llama3-8b-kv": (1024, 4096)}


def _quantized(type_name: str, shape: tuple[int, int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(the GGUF bytes of random weights quantized to ``type_name``, gguf's own dequantization of them)."""
    rng = np.random.default_rng(seed)
    kind = GGMLQuantizationType[type_name]
    if type_name == "Q4_K":  # gguf cannot quantize to it: random super-blocks, D and Dmin small and finite
        rows, cols = shape
        raw = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
        raw[:, :, 0:4] = (rng.random((rows, cols // 256, 2)) * 2e-3).astype(np.float16).view(np.uint8)
        raw = raw.reshape(rows, -1)
    elif type_name == "Q6_K":  # nor to this: random super-blocks (any int8 scales), D small and finite
        rows, cols = shape
        raw = rng.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
        raw[:, :, 208:210] = (rng.random((rows, cols // 256, 1)) * 1e-3).astype(np.float16).view(np.uint8)
        raw = raw.reshape(rows, -1)
    else:
        raw = quants.quantize(rng.standard_normal(shape, dtype=np.float32) * 0.05, kind)
    return raw, quants.dequantize(raw, kind)


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_kernel(), "the C++ kernels must build on this machine"


# K-quants' super-blocks are 256 weights: SmolLM2's 576-wide rows are no whole number of them
CASES = [(t, s) for t in TYPES for s in SHAPES if not t.endswith("_K") or SHAPES[s][1] % 256 == 0]


@pytest.mark.parametrize(("type_name", "shape_name"), CASES, ids=[f"{t}-{s}" for t, s in CASES])
def test_block_weights_dequantize_as_gguf_does_and_multiply_as_their_dequantized_weights(type_name,
                                                                                          shape_name) -> None:
    shape = SHAPES[shape_name]
    raw, expected = _quantized(type_name, shape)
    weight = from_gguf(raw, type_name, shape, name="blk.0.attn_k.weight")
    assert weight.shape == shape
    assert torch.equal(weight.dequantize(), torch.from_numpy(expected))  # bit for bit
    assert torch.equal(dequantized(weight.q, weight.d, weight.m, weight.bits), weight.dequantize())  # off a CPU
    # per block: the stored nibbles or int8, d and m (Q4_0's -8 d) widened to float32
    assert weight.nbytes == shape[0] * shape[1] // 32 * {"Q4_0": 24, "Q4_1": 24, "Q8_0": 36, "Q4_K": 24,
                                                         "Q6_K": 40}[type_name]
    dense = torch.from_numpy(expected)
    generator = torch.Generator().manual_seed(1)
    # one token, partial and whole tiles and vectors of tokens, a verification's or short prefill's broadcast form
    for tokens in (1, 3, 5, 16, 17, 40, 64, 100, 130):
        x = torch.randn(tokens, shape[1], generator=generator)
        reference = x.double() @ dense.double().T
        ours = weight.linear(x)
        assert ours.shape == (tokens, shape[0]) and ours.dtype == torch.float32
        # float32 sums in another order: within a few ulps of the outputs' scale
        torch.testing.assert_close(ours.double(), reference, rtol=0, atol=2e-5 * reference.abs().max().item())
        for form in (0, 1, 2):  # lanes, broadcast, dense: each form at every count, whichever the kernel picks
            ours = torch.ops.specbatch.block_linear_form(x, weight.q, weight.d, weight.m, weight.bits, form)
            torch.testing.assert_close(ours.double(), reference, rtol=0, atol=2e-5 * reference.abs().max().item())
    x = torch.randn(2, 3, shape[1], generator=generator)  # leading dimensions kept
    torch.testing.assert_close(weight.linear(x), (x.reshape(6, -1) @ dense.T).reshape(2, 3, -1), rtol=1e-4,
                               atol=1e-4)


def test_a_prefill_over_more_rows_than_one_dense_tile_multiplies_every_row() -> None:
    """A prefill (the kernel's dense threshold of tokens or more) over a head-sized weight: rows dequantized 4096 at
    a time, the last tile short."""
    raw, expected = _quantized("Q8_0", (4160, 64))
    weight = from_gguf(raw, "Q8_0", (4160, 64))
    x = torch.randn(torch.ops.specbatch.block_dense_from(), 64, generator=torch.Generator().manual_seed(2))
    reference = x.double() @ torch.from_numpy(expected).double().T
    torch.testing.assert_close(weight.linear(x).double(), reference, rtol=0, atol=2e-5 * reference.abs().max().item())
    assert torch.equal(weight.linear(x), torch.ops.specbatch.block_linear_form(x, weight.q, weight.d, weight.m, 8, 2))


@pytest.mark.parametrize("rows", [1, 7, 8, 29, 53])
def test_rows_beyond_whole_panels_and_transposed_tiles_are_multiplied(rows) -> None:
    """Weights whose rows leave a partial panel (24 rows) and a partial 8-row tile of the broadcast form's register
    transpose, at token counts that leave partial 8-token tiles and vectors."""
    raw, expected = _quantized("Q4_1", (rows, 64), seed=rows)
    weight = from_gguf(raw, "Q4_1", (rows, 64))
    generator = torch.Generator().manual_seed(rows)
    for tokens in (1, 5, 8, 9, 16, 23, 33, 64):
        x = torch.randn(tokens, 64, generator=generator)
        reference = x.double() @ torch.from_numpy(expected).double().T
        for form in (0, 1, 2):
            ours = torch.ops.specbatch.block_linear_form(x, weight.q, weight.d, weight.m, weight.bits, form)
            torch.testing.assert_close(ours.double(), reference, rtol=0, atol=2e-5 * reference.abs().max().item())


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_the_lanes_form_sums_a_token_alike_at_every_count(type_name) -> None:
    """The lanes form multiplies 4 rows a tile for a few tokens and a row a tile, 8 tokens at a time, for more, with
    the m terms (Q4_0, Q4_1, Q4_K) added after the scaled block sums: a token's outputs are the same bits at every
    count (a verification of several tokens a row scores as plain decoding of one does), rows beyond whole tiles
    included."""
    shape = (259, 512)  # 259 rows: a partial tile of rows after whole ones; 512: whole Q6_K super-blocks
    raw, _ = _quantized(type_name, shape, seed=3)
    weight = from_gguf(raw, type_name, shape)
    x = torch.randn(16, shape[1], generator=torch.Generator().manual_seed(3))
    alone = torch.cat([torch.ops.specbatch.block_linear_form(x[t:t + 1], weight.q, weight.d, weight.m, weight.bits, 0)
                       for t in range(len(x))])
    for tokens in range(2, len(x) + 1):
        together = torch.ops.specbatch.block_linear_form(x[:tokens], weight.q, weight.d, weight.m, weight.bits, 0)
        assert torch.equal(together, alone[:tokens]), tokens


@pytest.fixture
def form_record(monkeypatch, tmp_path) -> Path:
    """A record of the kernel form of the test's own; afterwards this process's form is the machine's record's again."""
    from decoding.model import gguf_blocks

    record = tmp_path / "block_forms.txt"
    monkeypatch.setattr(gguf_blocks, "_form_record", lambda: record)
    gguf_blocks.choose_block_forms.cache_clear()
    yield record
    monkeypatch.undo()
    gguf_blocks.choose_block_forms.cache_clear()
    gguf_blocks.choose_block_forms()


def test_the_kernel_form_is_timed_once_a_machine_and_followed_by_every_call(monkeypatch, form_record) -> None:
    """The count from which the broadcast form runs is one of the timed counts (or never), kept in a file beside the
    compiled kernel and read back without timing again; ``block_linear`` follows it: bit for bit the lanes form
    below it and the broadcast form from it."""
    from decoding.model import gguf_blocks

    timed = gguf_blocks._time_block_forms()
    assert timed in (*gguf_blocks.FORM_TOKENS, torch.ops.specbatch.block_dense_from())
    monkeypatch.setattr(gguf_blocks, "_quiet_block_forms", lambda: (timed, True))
    assert gguf_blocks.choose_block_forms() == timed
    assert form_record.read_text() == f"{timed} quiet"
    gguf_blocks.choose_block_forms.cache_clear()
    monkeypatch.setattr(gguf_blocks, "_quiet_block_forms", lambda: pytest.fail("timed again"))
    assert gguf_blocks.choose_block_forms() == timed
    raw, _ = _quantized("Q4_1", (48, 64))
    weight = from_gguf(raw, "Q4_1", (48, 64))
    x = torch.randn(21, 64, generator=torch.Generator().manual_seed(3))
    for start in (10, 20, 21):
        torch.ops.specbatch.set_block_broadcast_from(start)
        for tokens in (start - 1, start):
            lanes, broadcast = (torch.ops.specbatch.block_linear_form(x[:tokens], weight.q, weight.d, weight.m,
                                                                      4, form) for form in (0, 1))
            assert not torch.equal(lanes, broadcast)  # the forms sum in different orders: which one ran shows
            assert torch.equal(weight.linear(x[:tokens]), broadcast if tokens >= start else lanes)
    with pytest.raises(RuntimeError, match="tokens >= 1"):
        torch.ops.specbatch.set_block_broadcast_from(0)


def test_a_timing_on_a_busy_machine_is_kept_only_until_a_quiet_one_replaces_it(monkeypatch, form_record) -> None:
    """Beside other work the timing is retried, then recorded as busy; later processes keep that count (every process
    on the machine multiplies in one order) while their own timings stay busy, and the first quiet one replaces it.
    A bare count (a record from before quietness was recorded) counts as busy."""
    from decoding.model import gguf_blocks

    counts = iter([64, 16, 32, 12, 24, 8, 24, 8])
    monkeypatch.setattr(gguf_blocks, "_time_block_forms", lambda: next(counts))
    other_work = {"cpu_s": 1.0}  # CPU seconds other processes take during each timing
    monkeypatch.setattr(gguf_blocks, "_others_cpu_s", lambda: lambda: other_work["cpu_s"])

    def choose() -> int:
        gguf_blocks.choose_block_forms.cache_clear()
        return gguf_blocks.choose_block_forms()

    assert choose() == 32 and form_record.read_text() == "32 busy"  # the last of FORM_ATTEMPTS (3) busy timings
    assert choose() == 32 and form_record.read_text() == "32 busy"  # timed busy again (12, 24, 8): kept
    other_work["cpu_s"] = 0.0
    assert choose() == 24 and form_record.read_text() == "24 quiet"
    assert choose() == 24  # read back: not timed again (the next count would be 8)
    form_record.write_text("128")
    assert choose() == 8 and form_record.read_text() == "8 quiet"


def test_the_busy_measure_sees_other_processes_work_and_not_this_ones() -> None:
    """``_others_cpu_s`` counts the CPU a child process spends (0.3 s of its own CPU time, however long that takes on
    a loaded machine) and none of what this process spends."""
    import subprocess
    import sys

    from decoding.model import gguf_blocks

    others = gguf_blocks._others_cpu_s()
    assert others is not None  # Linux: /proc/stat
    subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 0.3: pass"], check=True)
    assert others() >= 0.25
    ours, machine, own = gguf_blocks._others_cpu_s(), gguf_blocks._machine_cpu_s(), time.process_time()
    while time.process_time() - own < 0.5:
        pass
    seen = ours()
    busy = gguf_blocks._machine_cpu_s() - machine
    assert seen <= busy - 0.45  # the machine's busy time less this process's 0.5 s (a tick either way)


def test_bad_block_tensors_are_refused_naming_the_tensor_and_the_type() -> None:
    raw, _ = _quantized("Q4_1", (8, 64))
    with pytest.raises(ValueError, match=r"blk\.3\.ffn_up\.weight: Q4_1 \[8, 64\] needs 320 bytes, the file holds 300"):
        from_gguf(raw.reshape(-1)[:300], "Q4_1", (8, 64), name="blk.3.ffn_up.weight")
    with pytest.raises(ValueError, match=r"output\.weight: Q8_0 rows of 48 weights are not whole blocks of 32"):
        from_gguf(raw, "Q8_0", (8, 48), name="output.weight")
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down\.weight: Q4_K rows of 64 weights are not whole blocks "
                                         r"of 256"):
        from_gguf(raw, "Q4_K", (8, 64), name="blk.0.ffn_down.weight")
    with pytest.raises(ValueError, match=r"token_embd\.weight: type Q5_K is not read as blocks"):
        from_gguf(raw, "Q5_K", (8, 64), name="token_embd.weight")
    corrupt = raw.copy()
    corrupt[0, 0:2] = np.frombuffer(np.float16(np.inf).tobytes(), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight: Q4_1 block scales are not finite"):
        from_gguf(corrupt, "Q4_1", (8, 64), name="blk.0.attn_q.weight")
    six, _ = _quantized("Q6_K", (2, 256))
    with pytest.raises(ValueError, match=r"output\.weight: Q6_K \[2, 256\] needs 420 bytes, the file holds 400"):
        from_gguf(six.reshape(-1)[:400], "Q6_K", (2, 256), name="output.weight")
    six[1, 208:210] = np.frombuffer(np.float16(np.nan).tobytes(), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"blk\.1\.attn_v\.weight: Q6_K block scales are not finite"):
        from_gguf(six, "Q6_K", (2, 256), name="blk.1.attn_v.weight")
    weight = from_gguf(raw, "Q4_1", (8, 64))
    with pytest.raises(RuntimeError, match="x has 32"):
        weight.linear(torch.randn(1, 32))


# ------------------------------------------------------------------------------------------- a model of GGUF blocks


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory, target):
    """(reference, blocks) of the tiny target written as a Q4_1 GGUF with a Q8_0 embedding and head."""
    return gguf_pair(target, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_a_gguf_model_multiplies_its_blocks_and_computes_its_dequantized_weights(gguf_models) -> None:
    reference, blocks = gguf_models
    assert uses_blocks(blocks) and not uses_blocks(reference)
    # every projection, the embedding and the head compute from blocks: the float weights left are the norms'
    assert sorted({name.split(".")[-2] for name, p in blocks.named_parameters() if p.numel()}) == [
        "input_layernorm", "norm", "post_attention_layernorm"]
    ids = torch.tensor([[1, 5, 9, 12, 3, 3, 7, 20, 4]])
    with torch.no_grad():
        ours, expected = blocks(ids).logits, reference(ids).logits
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


GGUF_SPECULATIVE = {
    "none": {"method": "none"},
    "self-draft": {"method": "draft_model", "model": "target", "quantization": "int4", "length_policy": "static"},
    "draft-model": {"method": "draft_model", "num_candidates": 2, "length_policy": "static"},
    "ngram": {"method": "ngram", "num_candidates": 2, "length_policy": "static"},
    "default": {"method": "draft_model", "model": "target", "quantization": "int4", "ngram_candidates": 1,
                "length_policy": "online"},
}


@pytest.mark.parametrize("speculative", GGUF_SPECULATIVE.values(), ids=GGUF_SPECULATIVE.keys())
def test_greedy_decoding_over_gguf_blocks_is_the_dequantized_models(speculative, gguf_models, tokenizer,
                                                                    draft) -> None:
    """transformers' greedy decoding of the float model holding the blocks' dequantized weights, token for token,
    for plain decoding and speculation over the blocks (the self-draft of a blocks target runs the blocks as they
    are: the int4 it names is not applied)."""
    reference, blocks = gguf_models
    expected = transformers_greedy(reference, tokenizer)
    results = run(make_config(**dict(speculative)), tokenizer, blocks, draft)
    assert [r.token_ids for r in results] == expected
    if speculative["method"] != "none" and speculative.get("length_policy") == "static":
        assert sum(sum(r.per_step_drafted) for r in results) > len(PROMPTS)  # speculation really happened


# K-quant files mix types as llama.cpp's Q4_K_M and Q6_K mixes do; 256-weight super-blocks need 256-wide inputs.
K_QUANT_MIXES = {"Q4_K-layers": ("Q4_K", "Q6_K", "Q6_K"), "Q6_K-layers": ("Q6_K", "Q8_0", "Q4_K")}


@pytest.mark.parametrize("mix", K_QUANT_MIXES.values(), ids=K_QUANT_MIXES.keys())
def test_greedy_decoding_over_k_quant_blocks_is_the_dequantized_models(mix, tokenizer, tmp_path) -> None:
    """A tiny Llama 256 wide written with Q4_K and Q6_K matrices (layers, embedding, head): every matrix multiplied
    as its blocks, and transformers' greedy tokens of the float model of gguf's dequantized weights, token for token,
    with plain decoding and with the self-draft (drafting asserted)."""
    layers, embedding, head = mix
    reference, blocks = gguf_pair(tiny_model(seed=3, hidden=256, intermediate=512), tmp_path / "k.gguf", layers,
                                  embedding, head)
    assert sorted({name.split(".")[-2] for name, p in blocks.named_parameters() if p.numel()}) == [
        "input_layernorm", "norm", "post_attention_layernorm"]
    expected = transformers_greedy(reference, tokenizer)
    for speculative in (GGUF_SPECULATIVE["none"], GGUF_SPECULATIVE["self-draft"]):
        results = run(make_config(**dict(speculative)), tokenizer, blocks, None)
        assert [r.token_ids for r in results] == expected
    assert sum(sum(r.per_step_drafted) for r in results) > len(PROMPTS)  # the self-draft drafted


def test_sampling_over_gguf_blocks_follows_the_dequantized_models_law(small_models, tokenizer, tmp_path) -> None:
    """Temperature 1 with a float draft over a blocks target: the sampled pairs follow the exact joint law of the
    dequantized model (chi-square), with drafts proposed, some kept and some rejected."""
    small_target, small_draft = small_models
    reference, blocks = gguf_pair(small_target, tmp_path / "small.gguf")
    assert_speculative_sampling_follows_law(reference, blocks, small_draft, tokenizer)


def test_a_gguf_that_does_not_fit_the_model_is_refused_naming_the_tensor(tmp_path, target) -> None:
    path = tmp_path / "wrong.gguf"
    writer = GGUFWriter(str(path), "llama")
    kind = GGMLQuantizationType.Q4_1
    writer.add_tensor("blk.1.ffn_up.weight", quants.quantize(np.zeros((64, 64), np.float32), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight: \[64, 64\] in the file, the model's mlp\.up_proj is "
                                         r"\[128, 64\]"):
        use_gguf_blocks(copy.deepcopy(target), path)


def test_quantization_gguf_is_taken_from_engine_kwargs_and_refused_where_the_model_is_no_gguf(tiny_dirs) -> None:
    assert config_fields({"quantization": "gguf"})["quantization"] == "gguf"
    with pytest.raises(ValueError, match=r"engine_kwargs\.quantization='fp8': 'gguf'"):
        config_fields({"quantization": "fp8"})
    with pytest.raises(ValueError, match=r"quantization: gguf .* model '.*target' is not a GGUF"):
        load_model(tiny_dirs["target"], "float32", torch.device("cpu"), quantization="gguf")
    assert load_model(tiny_dirs["target"], "float32", torch.device("cpu"), quantization="auto") is not None  # float
    # vLLM's None: what the checkpoint is, the default (a GGUF's blocks on a CPU; float weights where it is none)
    assert config_fields({"quantization": None})["quantization"] == "auto" == Config().quantization
    assert not uses_blocks(load_model(tiny_dirs["target"], "auto", torch.device("cpu"), quantization="auto"))


def test_a_gguf_file_named_as_the_model_is_converted_once_and_its_blocks_found(tmp_path, monkeypatch) -> None:
    """``model: path/to/file.gguf``: converted into the cache on first use (keyed by the file's path, size and
    modification time: a changed file is converted again), the file itself the model's GGUF for its blocks."""
    from decoding.model import loading

    converted = []

    def convert(gguf, target):
        converted.append(gguf)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")

    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "_convert_gguf", convert)
    path = tmp_path / "model.Q4_K_M.gguf"
    path.write_bytes(b"GGUF one")
    folder = loading.resolve_model_path(str(path))
    assert loading.resolve_model_path(str(path)) == folder and converted == [path]
    assert folder.startswith(str(tmp_path / "cache" / "models" / "gguf" / "model.Q4_K_M-"))
    assert loading.model_gguf(str(path)) == path
    path.write_bytes(b"GGUF, changed")
    assert loading.resolve_model_path(str(path)) != folder and len(converted) == 2
    assert loading.model_gguf(str(tmp_path / "folder")) is None
