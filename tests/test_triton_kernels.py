"""The Triton layer kernels (``triton_kernels.py``) against the lean forward's torch operations and the reference
attention: on a GPU where there is one, else under Triton's interpreter (``conftest.py`` turns it on); and every
kernel compiled for sm_90 without a GPU, as CI builds them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decoding.drafting.recycle import recycling_tree, recycling_tree_nodes
from decoding.model import triton_kernels as tk
from decoding.model.attention import AttentionMetadata, reference_attention, write_slots
from decoding.model.kv_cache import CacheShape, PagedKVCache
from decoding.model.lean_forward import _rms_norm, _rotate_half
from decoding.verification.tree import TreeTopology, chain_ancestors

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SHAPES = {"smollm2": tk.SMOLLM2_135M, "llama3_8b": tk.LLAMA3_8B}
BLOCK_SIZE = 16
NAN = float("nan")


def _random(*shape: int, dtype: torch.dtype, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(DEVICE)


def _assert_matches(actual: torch.Tensor, expected: torch.Tensor, ulps: int = 1) -> None:
    """float32: close; bf16: each element within ``ulps`` bf16 ulps of the expected one (NaN where it is NaN)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, equal_nan=True)
        return
    a, e = actual.float(), expected.float()
    assert torch.equal(a.isnan(), e.isnan())
    a, e = a.nan_to_num(), e.nan_to_num()
    ulp = 2.0 ** (torch.floor(torch.log2(e.abs().clamp(min=2.0**-126))) - 7)
    worst = ((a - e).abs() / ulp).max().item()
    assert worst <= ulps, f"{worst} bf16 ulps apart"


def test_kernels_run_on_a_gpu_or_interpreted() -> None:
    assert torch.cuda.is_available() or tk.INTERPRET


# ------------------------------------------------------------------------------------- elementwise kernels
@pytest.fixture(params=sorted({1, 2, tk.ROWS_PER_PROGRAM}), ids=lambda rows: f"rows{rows}")
def rows_per_program(request, monkeypatch) -> int:
    """Each elementwise kernel and the split combine at the rows a program takes on a GPU (1) and under the
    interpreter, and 2: the elementwise tests' 2-3 tokens then fill a tile and leave one partial."""
    monkeypatch.setattr(tk, "ROWS_PER_PROGRAM", request.param)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_add_rms_norm_is_the_residual_add_and_transformers_rms_norm(shape, dtype, rows_per_program) -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = _random(3, shape.hidden, dtype=dtype, generator=generator, scale=3.0)
    delta = _random(3, shape.hidden, dtype=dtype, generator=generator)
    weight = 1 + _random(shape.hidden, dtype=dtype, generator=generator, scale=0.1)
    residual, normed = tk.add_rms_norm(hidden, delta, weight, 1e-5)
    _assert_matches(residual, hidden + delta, ulps=0)
    _assert_matches(normed, _rms_norm(hidden + delta, weight, 1e-5))
    same, normed = tk.add_rms_norm(hidden, None, weight, 1e-6)
    assert same is hidden
    _assert_matches(normed, _rms_norm(hidden, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_silu_mul_is_silu_of_gate_times_up(shape, dtype, rows_per_program) -> None:
    generator = torch.Generator().manual_seed(1)
    gate_up = _random(2, 2 * shape.intermediate, dtype=dtype, generator=generator, scale=4.0)
    gate, up = gate_up.chunk(2, -1)
    _assert_matches(tk.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)


def _reference_rotary(qkv, cos, sin, slots, keys, values, shape, q_norm, k_norm, eps) -> torch.Tensor:
    """The lean forward's steps: split, optional per-head RMSNorm, rotary, write k and v into their slots."""
    q, k, v = qkv.view(len(qkv), -1, shape.head_dim).split([shape.q_heads, shape.kv_heads, shape.kv_heads], 1)
    if q_norm is not None:
        q, k = _rms_norm(q, q_norm, eps), _rms_norm(k, k_norm, eps)
    cos, sin = cos[:, None], sin[:, None]
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    write_slots(keys, values, k, v, slots // BLOCK_SIZE, slots % BLOCK_SIZE)
    return q


@pytest.mark.parametrize(("dtype", "cos_dtype", "pool_dtype"), [
    (torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32, torch.bfloat16),  # float rotary tables: q comes back in float32
])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_rotary_write_kv_rotates_q_and_k_and_writes_k_and_v_into_their_slots(
    shape, qk_norm, dtype, cos_dtype, pool_dtype, rows_per_program
) -> None:
    generator = torch.Generator().manual_seed(2)
    tokens, blocks, eps = 3, 4, 1e-6
    width = (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim
    qkv = _random(tokens, width, dtype=dtype, generator=generator, scale=2.0)
    angles = torch.rand(tokens, shape.head_dim // 2, generator=generator) * 100
    cos = torch.cat([angles.cos()] * 2, -1).to(cos_dtype).to(DEVICE)
    sin = torch.cat([angles.sin()] * 2, -1).to(cos_dtype).to(DEVICE)
    slots = torch.randperm(blocks * BLOCK_SIZE, generator=generator)[:tokens].to(DEVICE)
    q_norm = 1 + _random(shape.head_dim, dtype=dtype, generator=generator, scale=0.1) if qk_norm else None
    k_norm = 1 + _random(shape.head_dim, dtype=dtype, generator=generator, scale=0.1) if qk_norm else None
    pools = [torch.full((blocks, shape.kv_heads, shape.head_dim, BLOCK_SIZE), NAN, dtype=pool_dtype, device=DEVICE),
             torch.full((blocks, shape.kv_heads, BLOCK_SIZE, shape.head_dim), NAN, dtype=pool_dtype, device=DEVICE)]
    expected_pools = [pool.clone() for pool in pools]
    q = tk.rotary_write_kv(qkv, cos, sin, slots, *pools, shape.q_heads, shape.kv_heads, shape.head_dim, q_norm,
                           k_norm, eps)
    expected_q = _reference_rotary(qkv, cos, sin, slots, *expected_pools, shape, q_norm, k_norm, eps)
    assert q.is_contiguous()
    _assert_matches(q, expected_q.contiguous())
    for pool, expected in zip(pools, expected_pools):  # the slots written, nothing else
        _assert_matches(pool, expected)


# ----------------------------------------------------------------------------------------------- attention
def test_splits_aim_at_two_programs_per_sm_with_enough_keys_each() -> None:
    assert tk.attention_splits(rows=1, kv_heads=8, tiles=1, max_positions=4096) == 16  # 256 keys a split
    assert tk.attention_splits(rows=4, kv_heads=8, tiles=1, max_positions=32768) == 9  # 288 programs
    assert tk.attention_splits(rows=64, kv_heads=3, tiles=1, max_positions=2048) == 2
    assert tk.attention_splits(rows=64, kv_heads=8, tiles=1, max_positions=4096) == 1  # 512 programs already
    assert tk.attention_splits(rows=2, kv_heads=8, tiles=1, max_positions=200) == 1  # too few keys to split
    assert tk.query_tile(1, 3) == 16 and tk.query_tile(10, 4) == 64 and tk.query_tile(20, 4) == tk.BLOCK_M_MAX


def _tree(kind: str) -> tuple[torch.Tensor, int]:
    """(ancestors, nodes) of a forward: a decode step, a prefill chain, or a verification tree."""
    if kind == "decode":
        return chain_ancestors(1), 1
    if kind == "chain":
        return chain_ancestors(9), 9
    topology = {"tree4": TreeTopology(3, 1), "tree10": TreeTopology(3, 3), "tree17": TreeTopology(4, 4),
                "tree20": TreeTopology(3, 6, root_width=2)}[kind]
    return topology.ancestors, len(topology.parents)


def _attention_case(shape, dtype: torch.dtype, kind: str, lengths: list[int], padding: int, seed: int):
    """A pool holding ``lengths`` committed positions per row (random keys and values, NaN everywhere else: the
    kernel must never let an unseen position in), the forward's metadata (real rows from
    ``PagedKVCache.tree_metadata`` with some tree nodes missing, then ``padding`` CUDA-graph padding rows) and
    its queries, keys and values."""
    generator = torch.Generator().manual_seed(seed)
    rows_count = len(lengths)
    cache = PagedKVCache(CacheShape(1, shape.kv_heads, shape.head_dim), num_blocks=96, max_rows=rows_count,
                         max_positions=512, block_size=BLOCK_SIZE, dtype=dtype, device=DEVICE)
    cache.keys.fill_(NAN)
    cache.values.fill_(NAN)
    rows = cache.add_rows([512] * rows_count)
    cache.ensure(rows, lengths)
    for row, length in enumerate(lengths):
        slots = torch.tensor([cache.slot_of(row, p) for p in range(length)], dtype=torch.long)
        k = _random(length, shape.kv_heads, shape.head_dim, dtype=dtype, generator=generator)
        v = _random(length, shape.kv_heads, shape.head_dim, dtype=dtype, generator=generator)
        write_slots(cache.keys[0], cache.values[0], k, v, slots // BLOCK_SIZE, slots % BLOCK_SIZE)
    cache.advance(rows, lengths)
    ancestors, nodes = _tree(kind)
    if kind == "chain":  # a ragged prefill: rows of 9, 4, 1, ... prompt tokens
        valid = torch.arange(nodes)[None] < torch.tensor([max(1, 9 - 5 * r) for r in range(rows_count)])[:, None]
    else:
        valid = torch.rand(rows_count, nodes, generator=generator) < 0.8
        valid[:, 0] = True
        valid &= (ancestors <= valid[:, None]).all(-1)  # a node's ancestors are valid
    meta, _ = cache.tree_metadata(rows, ancestors, valid, 0, nodes)
    if padding:
        tokens, words = padding * nodes, meta.tree_mask.shape[1]
        meta = AttentionMetadata(
            slots=torch.cat([meta.slots, meta.slots.new_zeros(tokens)]),
            block_tables=torch.cat([meta.block_tables, meta.block_tables.new_zeros(padding, cache.max_blocks_per_row)]),
            row_starts=torch.arange(0, (rows_count + padding) * nodes + 1, nodes, dtype=torch.int32, device=DEVICE),
            prefix_len=torch.cat([meta.prefix_len, meta.prefix_len.new_ones(tokens)]),
            tree_mask=torch.cat([meta.tree_mask, meta.tree_mask.new_zeros(tokens, words)]), max_keys=meta.max_keys,
        )
    tokens = len(meta.slots)
    q = _random(tokens, shape.q_heads, shape.head_dim, dtype=dtype, generator=generator)
    k = _random(tokens, shape.kv_heads, shape.head_dim, dtype=dtype, generator=generator)
    v = _random(tokens, shape.kv_heads, shape.head_dim, dtype=dtype, generator=generator)
    return cache, meta, nodes, q, k, v


def _check_attention(shape, dtype, kind, lengths, padding, splits, seed=0) -> None:
    cache, meta, per_row, q, k, v = _attention_case(shape, dtype, kind, lengths, padding, seed)
    keys, values = cache.keys[0], cache.values[0]
    scale = shape.head_dim**-0.5
    expected = reference_attention(keys, values, q, k, v, meta, scale)  # writes the forward's keys and values
    out = tk.paged_attention(q, keys, values, meta.block_tables, meta.prefix_len, meta.tree_mask, scale, per_row,
                             splits)
    assert out.dtype == dtype and out.shape == q.shape and torch.isfinite(out).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        return
    # bf16: as close to the float32 result over the same inputs as the bf16 reference is.
    exact = reference_attention(keys.float(), values.float(), q.float(), k.float(), v.float(), meta, scale)
    reference_error = (expected.float() - exact).abs().max().item()
    assert reference_error < 0.05
    torch.testing.assert_close(out.float(), exact, rtol=0, atol=2 * reference_error)


ROWS = {  # committed lengths: empty, one, at and around block boundaries
    "smollm2": [0, 1, 15, 16, 47, 130],
    "llama3_8b": [1, 16, 33],
}


# (kind, splits): every kind once, each split mode over several kinds (None: the automatic choice, 2 here).
FLOAT32_CASES = [("decode", 1), ("decode", 3), ("decode", None), ("chain", 3), ("tree4", None), ("tree10", 1),
                 ("tree17", 3), ("tree20", None)]
BF16_CASES = [("decode", 3), ("chain", 1), ("tree10", None)]


@pytest.mark.parametrize(("kind", "splits"), FLOAT32_CASES)
@pytest.mark.parametrize("shape_name", SHAPES)
def test_paged_attention_matches_the_reference_in_float32(shape_name, kind, splits) -> None:
    _check_attention(SHAPES[shape_name], torch.float32, kind, ROWS[shape_name], padding=1, splits=splits)


@pytest.mark.parametrize(("kind", "splits"), BF16_CASES)
@pytest.mark.parametrize("shape_name", SHAPES)
def test_paged_attention_matches_the_reference_in_bf16(shape_name, kind, splits) -> None:
    _check_attention(SHAPES[shape_name], torch.bfloat16, kind, ROWS[shape_name], padding=1, splits=splits)


def test_paged_attention_covers_keys_past_one_split(rows_per_program) -> None:
    """A row longer than a split's range (its keys combined across splits; 20 splits: more than the combine
    reads at once, most of them past the row), split and unsplit; 18 queries: a partial last tile of the
    combine's programs at 16 and at 2 queries a program."""
    for splits in (1, 4, 20):
        _check_attention(tk.SMOLLM2_135M, torch.float32, "decode", [300, 2], padding=0, splits=splits)


def _largest_cuda_tree() -> TreeTopology:
    """The largest tree the engine builds on CUDA by default: batch 1's recycling tree (``recycling_tree_nodes``)
    under the pending token, with a lookup sibling at every level."""
    depth = 5
    tree, order = recycling_tree(8, depth, recycling_tree_nodes(torch.device("cuda"), 1, depth))
    return TreeTopology(1, depth, 1, tree, order)


@pytest.mark.parametrize("topology", [TreeTopology(16, 5, 1), _largest_cuda_tree()], ids=["81-chains", "262-cuda"])
def test_paged_attention_covers_trees_of_many_mask_words(topology: TreeTopology) -> None:
    """Trees past one 64-node mask word: 81 nodes in chains (the second word reaching past the first's 64
    positions) and the largest tree the engine builds on CUDA (262 nodes, five words), split and unsplit."""
    nodes = topology.size(topology.max_depth)
    cache, meta, per_row, q, k, v = _attention_case(tk.SMOLLM2_135M, torch.float32, "chain", [5], 0, seed=3)
    meta, _ = cache.tree_metadata(slice(0, 1), topology.ancestors, torch.ones(1, nodes, dtype=torch.bool), 0, nodes)
    assert meta.tree_mask.shape[1] == -(-nodes // 64) and (meta.tree_mask[:, -1] != 0).any()
    generator = torch.Generator().manual_seed(4)
    q = _random(nodes, 9, 64, dtype=torch.float32, generator=generator)
    k, v = (_random(nodes, 3, 64, dtype=torch.float32, generator=generator) for _ in range(2))
    expected = reference_attention(cache.keys[0], cache.values[0], q, k, v, meta, 0.125)
    for splits in (1, 2):
        out = tk.paged_attention(q, cache.keys[0], cache.values[0], meta.block_tables, meta.prefix_len,
                                 meta.tree_mask, 0.125, nodes, splits)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_query_that_sees_no_key_gets_zeros_split_or_not() -> None:
    """No valid forward has one, but every split then holds a neutral partial: the combine must not divide 0 by 0
    or weigh by exp(-inf - -inf)."""
    cache, meta, per_row, q, k, v = _attention_case(tk.SMOLLM2_135M, torch.float32, "decode", [20], 0, seed=5)
    expected = reference_attention(cache.keys[0], cache.values[0], q, k, v, meta, 0.125)
    blind = torch.zeros_like(meta.prefix_len)
    for splits in (1, 2):
        seen = tk.paged_attention(q, cache.keys[0], cache.values[0], meta.block_tables, meta.prefix_len,
                                  meta.tree_mask, 0.125, per_row, splits)
        torch.testing.assert_close(seen, expected, rtol=1e-5, atol=1e-5)
        out = tk.paged_attention(q, cache.keys[0], cache.values[0], meta.block_tables, blind, meta.tree_mask, 0.125,
                                 per_row, splits)
        assert torch.equal(out, torch.zeros_like(out))


# ---------------------------------------------------------------------------------------- quantized blocks
# [N, K]: SmolLM2's k/v and down projections (three and nine programs of output rows); Llama-3-8B's input widths
# (q|k|v's 4096, down's 14336) over one tile of output rows (more rows only add programs).
BLOCK_SHAPES = {"smollm2-kv": (192, 576), "smollm2-down": (576, 1536), "llama3-8b-qkv-rows": (64, 4096),
                "llama3-8b-down-rows": (64, 14336)}


def _blocks(kind: str, shape: tuple[int, int]):
    """Random blocks of ``kind``: GGUF Q4_1 (4-bit, m), Q8_0 (8-bit, no m), Q6_K (8-bit, a d each half-block), or
    8-bit with zero points (m)."""
    from gguf import GGMLQuantizationType, quants

    from decoding.model.gguf_blocks import from_gguf
    from decoding.model.packed_checkpoints import to_blocks

    generator = torch.Generator().manual_seed(7)
    weights = torch.randn(shape, generator=generator) * 0.05
    if kind == "int8-zero-points":
        q = torch.randint(0, 256, shape, generator=generator)
        groups = shape[1] // 32
        zero = torch.randint(100, 156, (shape[0], groups), generator=generator)
        scale = (torch.rand(shape[0], groups, generator=generator) * 1e-3).half()
        return to_blocks(q, zero, scale, 8, "w")
    if kind == "Q6_K":  # gguf cannot quantize to it: random super-blocks, D small and finite
        raw = torch.randint(0, 256, (shape[0], shape[1] // 256, 210), generator=generator, dtype=torch.uint8)
        raw[:, :, 208:210] = (torch.rand(shape[0], shape[1] // 256, 1, generator=generator) * 1e-3).half().view(
            torch.uint8)
        return from_gguf(raw.reshape(shape[0], -1).numpy(), kind, shape)
    kind_type = GGMLQuantizationType[kind]
    return from_gguf(quants.quantize(weights.numpy(), kind_type), kind, shape)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q6_K", "int8-zero-points"])
def test_block_linear_multiplies_quantized_blocks_as_their_dequantized_weights(kind) -> None:
    """The Triton GEMM over 32-weight blocks (4-bit nibbles or int8, d and m per block or half-block) against the
    product of the dequantized weights: float32 to float32 rounding (sums in another order), bf16 activations to the
    bf16 rounding of the output; a single token, a partial token tile and several tiles."""
    from decoding.model.gguf_blocks import dequantized

    generator = torch.Generator().manual_seed(3)
    for name, shape in BLOCK_SHAPES.items():
        if kind == "Q6_K" and shape[1] % 256:
            continue  # rows of 256-weight super-blocks: SmolLM2's 576 inputs are none
        weight = _blocks(kind, shape)
        dense = dequantized(weight.q, weight.d, weight.m, weight.bits).double()
        q, d, m = (t.to(DEVICE) if t is not None else None for t in (weight.q, weight.d, weight.m))
        # the interpreter's time grows with the width: the long rows run one token of each dtype
        cases = ((1, torch.float32), (40, torch.float32), (5, torch.bfloat16)) if shape[1] < 4096 else (
            (1, torch.float32), (1, torch.bfloat16))
        for tokens, dtype in cases:
            x = torch.randn(tokens, shape[1], generator=generator).to(dtype)
            out = tk.block_linear(x.to(DEVICE), q, d, m, weight.bits).cpu()
            assert out.shape == (tokens, shape[0]) and out.dtype == dtype
            if dtype == torch.float32:
                expected = x.double() @ dense.T
                torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6 * expected.abs().max().item())
            else:  # weights rounded to bf16 for the tensor cores, sums in float32, the output rounded to bf16
                expected = x.double() @ dense.to(torch.bfloat16).double().T
                torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
        if name == "smollm2-kv":
            x = torch.randn(2, 3, shape[1], generator=generator)  # leading dimensions kept
            torch.testing.assert_close(tk.block_linear(x.to(DEVICE), q, d, m, weight.bits).cpu().double(),
                                       (x.double() @ dense.T), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ sm_90 builds
_COMPILE = """
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from decoding.model import triton_kernels as tk

assert not tk.INTERPRET
shapes = [tk.SMOLLM2_135M, tk.LLAMA3_8B, tk.KernelShape(576, 9, 3, 64, 1536, dtype="fp32")]
for shape in shapes:
    for kernel, signature, constexprs in tk.sm90_compile_specs(shape):
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        assert len(compiled.asm["cubin"]) > 0, kernel.__name__
        mma = bool(re.search(r"\\bw?gmma|\\bmma\\.sync", compiled.asm["ptx"]))
        print(kernel.__name__, shape.dtype, constexprs.get("BLOCK_M", ""), "mma" if mma else "no-mma")
"""


def test_every_kernel_compiles_for_sm90_without_a_gpu() -> None:
    """Every kernel at the SmolLM2 and Llama-3-8B shapes (bf16) and float32, built to a cubin for an H100 in a
    process without the interpreter; bf16 attention multiplies on the tensor cores."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.split("\n")
    kernels = {line.split()[0] for line in lines if line}
    assert {kernel.__name__ for kernel in tk.KERNELS} <= kernels
    assert len([line for line in lines if line]) == 3 * len(tk.sm90_compile_specs(tk.SMOLLM2_135M))
    blocks = [line.split() for line in lines if line.startswith("_block_linear_kernel")]
    assert len(blocks) == 9 and all(words[-1] == "mma" for words in blocks if words[1] == "bf16")
    attention = [line.split() for line in lines if line.startswith("_paged_attention_kernel")]
    assert all(words[-1] == "mma" for words in attention if words[1] == "bf16")
