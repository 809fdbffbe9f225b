"""Weights in GGUF's 32-weight blocks (``decoding.model.gguf_blocks``): read from a GGUF tensor's bytes, dequantized
bit for bit as the ``gguf`` package dequantizes them, and multiplied as stored by ``specbatch::block_linear`` (the
C++ kernel: the one-token path, token tiles, and the dense path of a prefill) on SmolLM2-135M's and Llama-3-8B's
projection shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from decoding.model.attention import cpu_kernel
from decoding.model.gguf_blocks import LAYOUTS, from_gguf

TYPES = list(LAYOUTS)
# [N, K]: SmolLM2-135M's k/v and down projections, Llama-3-8B's k/v projection.
SHAPES = {"smollm2-kv": (192, 576), "smollm2-down": (576, 1536), "llama3-8b-kv": (1024, 4096)}


def _quantized(type_name: str, shape: tuple[int, int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(the GGUF bytes of random weights quantized to ``type_name``, gguf's own dequantization of them)."""
    weights = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * 0.05
    kind = GGMLQuantizationType[type_name]
    raw = quants.quantize(weights, kind)
    return raw, quants.dequantize(raw, kind)


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert cpu_kernel(), "the C++ kernels must build on this machine"


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("type_name", TYPES)
def test_block_weights_dequantize_as_gguf_does_and_multiply_as_their_dequantized_weights(type_name, shape) -> None:
    raw, expected = _quantized(type_name, shape)
    weight = from_gguf(raw, type_name, shape, name="blk.0.attn_k.weight")
    assert weight.shape == shape
    assert torch.equal(weight.dequantize(), torch.from_numpy(expected))  # bit for bit
    # per block: the stored nibbles or int8, d and m (Q4_0's -8 d) widened to float32
    assert weight.nbytes == shape[0] * shape[1] // 32 * {"Q4_0": 24, "Q4_1": 24, "Q8_0": 36}[type_name]
    dense = torch.from_numpy(expected)
    generator = torch.Generator().manual_seed(1)
    for tokens in (1, 3, 5, 16, 40):  # one token, token tiles with a partial one, the dense path of a prefill
        x = torch.randn(tokens, shape[1], generator=generator)
        reference = x.double() @ dense.double().T
        ours = weight.linear(x)
        assert ours.shape == (tokens, shape[0]) and ours.dtype == torch.float32
        # float32 sums in another order: within a few ulps of the outputs' scale
        torch.testing.assert_close(ours.double(), reference, rtol=0, atol=2e-5 * reference.abs().max().item())
    x = torch.randn(2, 3, shape[1], generator=generator)  # leading dimensions kept
    torch.testing.assert_close(weight.linear(x), (x.reshape(6, -1) @ dense.T).reshape(2, 3, -1), rtol=1e-4,
                               atol=1e-4)


def test_bad_block_tensors_are_refused_naming_the_tensor_and_the_type() -> None:
    raw, _ = _quantized("Q4_1", (8, 64))
    with pytest.raises(ValueError, match=r"blk\.3\.ffn_up\.weight: Q4_1 \[8, 64\] needs 320 bytes, the file holds 300"):
        from_gguf(raw.reshape(-1)[:300], "Q4_1", (8, 64), name="blk.3.ffn_up.weight")
    with pytest.raises(ValueError, match=r"output\.weight: Q8_0 rows of 48 weights are not whole blocks of 32"):
        from_gguf(raw, "Q8_0", (8, 48), name="output.weight")
    with pytest.raises(ValueError, match=r"token_embd\.weight: type Q5_K is not read as blocks"):
        from_gguf(raw, "Q5_K", (8, 64), name="token_embd.weight")
    corrupt = raw.copy()
    corrupt[0, 0:2] = np.frombuffer(np.float16(np.inf).tobytes(), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight: Q4_1 block scales are not finite"):
        from_gguf(corrupt, "Q4_1", (8, 64), name="blk.0.attn_q.weight")
    weight = from_gguf(raw, "Q4_1", (8, 64))
    with pytest.raises(RuntimeError, match="x has 32"):
        weight.linear(torch.randn(1, 32))
