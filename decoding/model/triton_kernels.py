"""Triton kernels for the Llama-family decoder layer on CUDA: a layer is about ten launches.

add+RMSNorm, q|k|v GEMM (cuBLAS, or ``block_linear`` over a quantized checkpoint's 32-weight blocks), rotary + KV
write, attention (+ a split reduction), o GEMM, add+RMSNorm, gate|up GEMM, SiLU*mul, down GEMM. Every wrapper
allocates its outputs with ``torch.empty``, reads nothing back from the device and sizes its grid from shapes and
Python ints only, so a CUDA graph can capture it.

Numerics: elementwise kernels compute in float32 and round to the model dtype where the reference (the lean
forward's torch operations, op by op) rounds, so they match it to the last bit but for the order of sums
(RMSNorm's mean). Attention computes scores and the online softmax in float32 (``tl.dot`` with float32
accumulation; bf16/fp16 operands use the tensor cores, float32 ones full precision, not TF32), and rounds the
probabilities to the values' dtype before multiplying them with the values, as flash attention does.

Attention's work decomposition (flash-decoding): one program per (row, kv head, query tile, key split). A query
tile holds up to ``BLOCK_M`` of the row's (node, head-in-group) pairs, so all query heads of a kv head and all of a
row's tree nodes share each key/value tile read from the pool through the block table (nothing is gathered or
copied). Sequence lengths are read on the device: each program bounds its keys by its queries' ``prefix_len`` and
tree words, so one compiled kernel serves every context length. Key tiles below every query's ``prefix_len`` run
unmasked, tiles below the tree queries' prefixes compare positions with ``prefix_len`` only, and only the few
tiles past them load tree-mask words and mask their key/value loads. When rows x kv heads x query tiles
give too few programs for the GPU, the keys are split into contiguous ranges whose float32 partials (accumulator,
running max, running sum) a second kernel combines; a split past its row's keys writes a neutral partial.

Under Triton's interpreter (``TRITON_INTERPRET=1``, how the tests run without a GPU) bf16 ``tl.dot`` and fp32->bf16
casts are wrong or truncating, so there the kernels upcast ``tl.dot`` operands and round bf16 by bit arithmetic.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# Triton decides at import whether @triton.jit kernels are interpreted; the flag selects the interpreter's
# workarounds at compile time (a constexpr), so compiled kernels carry none of them.
INTERPRET = _interpreting()

# Attention tiles: queries per program at most, keys per inner step (>= 16 for tl.dot).
BLOCK_M_MAX = 64
BLOCK_N = 64
# Programs the attention aims at before splitting keys: about two per SM of a 132-SM H100.
TARGET_PROGRAMS = 2 * 132
# Fewest keys a split covers (below that the partials' traffic and the combine outweigh the parallelism).
MIN_SPLIT_KEYS = 256

# Rows each program of the elementwise kernels (add+RMSNorm, rotary + KV write, SiLU*mul: tokens) and of the split
# combine (a token's query heads) takes: one on a GPU; the interpreter costs Python time per operation whatever a
# tile's size, so there a program takes 16 (the engine's Triton test over a 70-node tree: 33 s with one row a
# program, most of it these kernels).
ROWS_PER_PROGRAM = 16 if INTERPRET else 1

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _helper(fn):
    """A function the kernels call: compiled with them on a GPU; under the interpreter a plain Python function,
    which the kernel calls directly (a jit helper there is patched again on every call: a third of the
    interpreter's time in the engine tests)."""
    return fn if INTERPRET else triton.jit(fn)


@_helper
def _cast(x, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """``x`` (float32) rounded to nearest even into ``dtype``; EMULATE: bf16 by bit arithmetic (the interpreter's
    own cast truncates)."""
    if EMULATE and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(x != x, bits >> 16, rounded)  # NaN stays NaN
        y = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(dtype)
    return y


# ------------------------------------------------------------------------------------------------ add + RMSNorm
@triton.jit
def _add_rms_norm_kernel(
    hidden_ptr, delta_ptr, weight_ptr, residual_ptr, out_ptr, tokens, size, eps,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, EMULATE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    in_row = cols < size
    ok = (rows < tokens) & in_row
    at = rows * size + cols
    x = tl.load(hidden_ptr + at, mask=ok, other=0.0).to(tl.float32)
    dtype: tl.constexpr = hidden_ptr.dtype.element_ty
    if HAS_DELTA:
        d = tl.load(delta_ptr + at, mask=ok, other=0.0).to(tl.float32)
        residual = _cast(x + d, dtype, EMULATE)
        tl.store(residual_ptr + at, residual, mask=ok)
        x = residual.to(tl.float32)
    variance = tl.sum(x * x, 1)[:, None] / size
    inv = tl.div_rn(1.0, tl.sqrt_rn(variance + eps))  # torch's rsqrt on a CPU: 1 / sqrt, both rounded
    normed = _cast(x * inv, dtype, EMULATE).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, _cast(w * normed, out_ptr.dtype.element_ty, EMULATE), mask=ok)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual, normed) of ``hidden`` [N, H] (+ ``delta``): residual = hidden + delta in hidden's dtype (hidden
    itself without delta), normed = transformers' Llama RMSNorm of it (in weight x hidden's promoted dtype)."""
    tokens, size = hidden.shape
    hidden = hidden.contiguous()
    residual = hidden if delta is None else torch.empty_like(hidden)
    out = torch.empty(tokens, size, dtype=torch.promote_types(weight.dtype, hidden.dtype), device=hidden.device)
    block = triton.next_power_of_2(size)
    _add_rms_norm_kernel[(triton.cdiv(tokens, ROWS_PER_PROGRAM),)](
        hidden, hidden if delta is None else delta.contiguous(), weight, residual, out, tokens, size, eps,
        HAS_DELTA=delta is not None, BLOCK=block, ROWS=ROWS_PER_PROGRAM, EMULATE=INTERPRET,
        num_warps=8 if block >= 4096 else 4,
    )
    return residual, out


# ---------------------------------------------------------------------------------------- rotary + KV write
@triton.jit
def _rotary_write_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, slots_ptr, k_ptr, v_ptr, q_out_ptr, q_norm_ptr, k_norm_ptr, tokens, eps,
    stride_xn, stride_cn, stride_sn, stride_kb, stride_kh, stride_kd, stride_vb, stride_vh, stride_vo,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NORM: tl.constexpr, NORM_DTYPE: tl.constexpr, ROWS: tl.constexpr,
    EMULATE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    head = tl.program_id(1)  # q heads, then k heads (each also copies its v head)
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, BLOCK_D)[None, :]
    in_head = d < HEAD_DIM
    ok = (token < tokens) & in_head
    partner = tl.where(d < HALF, d + HALF, d - HALF)  # rotate_half: cat(-x[D/2:], x[:D/2])
    base = qkv_ptr + token * stride_xn + head * HEAD_DIM
    x = tl.load(base + d, mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(base + partner, mask=ok, other=0.0).to(tl.float32)
    if NORM:  # Qwen3: RMSNorm over the head before the rotary, rounded as transformers' RMSNorm rounds
        is_q = (tl.zeros([1, BLOCK_D], tl.int32) + head) < Q_HEADS
        in_dtype: tl.constexpr = qkv_ptr.dtype.element_ty
        inv = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, 1)[:, None] / HEAD_DIM + eps))
        w = (tl.load(q_norm_ptr + d, mask=in_head & is_q, other=0.0).to(tl.float32)
             + tl.load(k_norm_ptr + d, mask=in_head & ~is_q, other=0.0).to(tl.float32))
        wp = (tl.load(q_norm_ptr + partner, mask=in_head & is_q, other=0.0).to(tl.float32)
              + tl.load(k_norm_ptr + partner, mask=in_head & ~is_q, other=0.0).to(tl.float32))
        x = _cast(w * _cast(x * inv, in_dtype, EMULATE).to(tl.float32), NORM_DTYPE, EMULATE).to(tl.float32)
        xp = _cast(wp * _cast(xp * inv, in_dtype, EMULATE).to(tl.float32), NORM_DTYPE, EMULATE).to(tl.float32)
    dtype: tl.constexpr = q_out_ptr.dtype.element_ty
    c = tl.load(cos_ptr + token * stride_cn + d, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + token * stride_sn + d, mask=ok, other=0.0).to(tl.float32)
    xp = tl.where(d < HALF, -xp, xp)
    rotated = _cast(_cast(x * c, dtype, EMULATE).to(tl.float32) + _cast(xp * s, dtype, EMULATE).to(tl.float32),
                    dtype, EMULATE)
    if head < Q_HEADS:
        tl.store(q_out_ptr + (token * Q_HEADS + head) * HEAD_DIM + d, rotated, mask=ok)
    else:
        kv = head - Q_HEADS
        slot = tl.load(slots_ptr + token, mask=token < tokens, other=0)
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        key = _cast(rotated.to(tl.float32), k_ptr.dtype.element_ty, EMULATE)
        tl.store(k_ptr + block * stride_kb + kv * stride_kh + d * stride_kd + offset, key, mask=ok)
        value = tl.load(base + KV_HEADS * HEAD_DIM + d, mask=ok, other=0.0)  # this head's v, kv_heads heads on
        value = _cast(value.to(tl.float32), v_ptr.dtype.element_ty, EMULATE)
        tl.store(v_ptr + block * stride_vb + kv * stride_vh + offset * stride_vo + d, value, mask=ok)


def rotary_write_kv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None, eps: float = 0.0,
) -> torch.Tensor:
    """Rotate q and k of ``qkv`` [N, (q_heads + 2 kv_heads) * head_dim] (after Qwen3's per-head RMSNorm where
    ``q_norm``/``k_norm`` are given) by ``cos``/``sin`` [N, (1,) head_dim], write rotated k and raw v into their
    ``slots`` [N] of the pools; returns q rotated [N, q_heads, head_dim] (in qkv x cos's promoted dtype)."""
    tokens = qkv.shape[0]
    qkv = qkv.reshape(tokens, -1)
    cos, sin = cos.reshape(tokens, -1), sin.reshape(tokens, -1)
    assert qkv.stride(1) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    norm = q_norm is not None
    norm_dtype = torch.promote_types(q_norm.dtype, qkv.dtype) if norm else qkv.dtype
    q_out = torch.empty(tokens, q_heads, head_dim, dtype=torch.promote_types(norm_dtype, cos.dtype),
                        device=qkv.device)
    _rotary_write_kv_kernel[(triton.cdiv(tokens, ROWS_PER_PROGRAM), q_heads + kv_heads)](
        qkv, cos, sin, slots, k_cache, v_cache, q_out, q_norm if norm else qkv, k_norm if norm else qkv, tokens, eps,
        qkv.stride(0), cos.stride(0), sin.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[-1], NORM=norm, NORM_DTYPE=_TL_DTYPES[norm_dtype], ROWS=ROWS_PER_PROGRAM,
        EMULATE=INTERPRET, num_warps=1,
    )
    return q_out


# ---------------------------------------------------------------------------------------------- SiLU * mul
@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, tokens, size, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                     EMULATE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    ok = (rows < tokens) & (cols < size)
    gate = tl.load(gate_up_ptr + rows * 2 * size + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + rows * 2 * size + size + cols, mask=ok, other=0.0).to(tl.float32)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    silu = _cast(gate / (1.0 + tl.exp(-gate)), dtype, EMULATE).to(tl.float32)
    tl.store(out_ptr + rows * size + cols, _cast(silu * up, dtype, EMULATE), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of ``gate_up`` [N, 2I] (gate first) -> [N, I], each product rounded as torch rounds it."""
    tokens, width = gate_up.shape
    gate_up = gate_up.contiguous()
    size = width // 2
    out = torch.empty(tokens, size, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(size))
    _silu_mul_kernel[(triton.cdiv(tokens, ROWS_PER_PROGRAM), triton.cdiv(size, block))](
        gate_up, out, tokens, size, BLOCK=block, ROWS=ROWS_PER_PROGRAM, EMULATE=INTERPRET)
    return out


# ----------------------------------------------------------------------------------------------- attention
@_helper
def _softmax_step(s, v, m_i, l_i, acc, FP32: tl.constexpr, UPCAST: tl.constexpr, EMULATE: tl.constexpr):
    """One key tile of the online softmax (``s`` in log2 units, -inf where invisible). A query that has seen no
    key yet keeps max -inf, sum 0, accumulator 0 (exponents taken against 0, never -inf - -inf)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if FP32:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    elif UPCAST:
        acc = tl.dot(_cast(p, v.dtype, EMULATE).to(tl.float32), v.to(tl.float32), acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@_helper
def _scores(q, kt, scale_log2, FP32: tl.constexpr, UPCAST: tl.constexpr):
    if FP32:
        s = tl.dot(q, kt, input_precision="ieee")
    elif UPCAST:
        s = tl.dot(q.to(tl.float32), kt.to(tl.float32))
    else:
        s = tl.dot(q, kt)
    return s * scale_log2


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, prefix_ptr, mask_ptr, out_ptr, part_acc_ptr, part_stat_ptr,
    scale_log2, per_row, kv_heads, tiles, words, max_positions, chunk, splits,
    stride_qn, stride_qh, stride_kb, stride_kh, stride_kd, stride_vb, stride_vh, stride_vo, stride_tr, stride_mn,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, FP32: tl.constexpr, UPCAST: tl.constexpr, EMULATE: tl.constexpr,
):
    pid = tl.program_id(0)
    tile = pid % tiles
    kv = (pid // tiles) % kv_heads
    row = pid // (tiles * kv_heads)
    split = tl.program_id(1)

    # The tile's queries: m = node * GROUP + head in group.
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < per_row * GROUP
    token = (row * per_row + m // GROUP).to(tl.int64)
    head = kv * GROUP + m % GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :], mask=m_ok[:, None],
                other=0.0)
    prefix = tl.load(prefix_ptr + token, mask=m_ok, other=0)
    # Each query's reach: its prefix, or past its last nonzero tree word.
    reach = prefix
    for w in range(words):
        word = tl.load(mask_ptr + token * stride_mn + w, mask=m_ok, other=0)
        reach = tl.where(word != 0, prefix + 64 * (w + 1), reach)
    bound = tl.minimum(tl.max(tl.where(m_ok, reach, 0), 0), max_positions)
    below = tl.minimum(tl.min(tl.where(m_ok, prefix, max_positions), 0), bound)  # every query sees [0, below)
    # Below the smallest prefix of a query with tree bits, visibility is p < prefix alone.
    tree_low = tl.minimum(tl.min(tl.where(m_ok & (reach > prefix), prefix, max_positions), 0), bound)

    # Keys [start, stop) in three runs of tiles: whole tiles every query sees; whole tiles below tree_low (every
    # position seen by some query, so written); the rest, by the full rule, loading only positions some query sees.
    start = split * chunk
    stop = tl.minimum(start + chunk, bound)
    seen_end = start + tl.maximum(tl.minimum(stop, below) - start, 0) // BLOCK_N * BLOCK_N
    prefix_end = seen_end + tl.maximum(tl.minimum(stop, tree_low) - seen_end, 0) // BLOCK_N * BLOCK_N
    n = tl.arange(0, BLOCK_N)
    table_row = tables_ptr + row.to(tl.int64) * stride_tr
    k_base = k_ptr + kv.to(tl.int64) * stride_kh
    v_base = v_ptr + kv.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for key in range(start, seen_end, BLOCK_N):
        p = key + n
        block = tl.load(table_row + p // BLOCK_SIZE).to(tl.int64)
        kt = tl.load(k_base + block[None, :] * stride_kb + d[:, None] * stride_kd + (p % BLOCK_SIZE)[None, :])
        v = tl.load(v_base + block[:, None] * stride_vb + (p % BLOCK_SIZE)[:, None] * stride_vo + d[None, :])
        s = _scores(q, kt, scale_log2, FP32, UPCAST)
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, FP32, UPCAST, EMULATE)
    for key in range(seen_end, prefix_end, BLOCK_N):
        p = key + n
        block = tl.load(table_row + p // BLOCK_SIZE).to(tl.int64)
        kt = tl.load(k_base + block[None, :] * stride_kb + d[:, None] * stride_kd + (p % BLOCK_SIZE)[None, :])
        v = tl.load(v_base + block[:, None] * stride_vb + (p % BLOCK_SIZE)[:, None] * stride_vo + d[None, :])
        s = tl.where(p[None, :] < prefix[:, None], _scores(q, kt, scale_log2, FP32, UPCAST), float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, FP32, UPCAST, EMULATE)
    for key in range(prefix_end, stop, BLOCK_N):
        p = key + n
        rel = p[None, :] - prefix[:, None]
        in_tree = (rel >= 0) & (rel < 64 * words) & (m_ok & (reach > prefix))[:, None]
        rel = tl.where(in_tree, rel, 0)
        word = tl.load(mask_ptr + token[:, None] * stride_mn + rel // 64, mask=in_tree, other=0)
        visible = (p[None, :] < prefix[:, None]) | (((word >> (rel % 64).to(tl.int64)) & 1) != 0)
        seen = (tl.max(visible.to(tl.int32), 0) > 0) & (p < stop)
        visible = visible & seen[None, :]
        block = tl.load(table_row + p // BLOCK_SIZE, mask=seen, other=0).to(tl.int64)
        kt = tl.load(k_base + block[None, :] * stride_kb + d[:, None] * stride_kd + (p % BLOCK_SIZE)[None, :],
                     mask=seen[None, :], other=0.0)
        v = tl.load(v_base + block[:, None] * stride_vb + (p % BLOCK_SIZE)[:, None] * stride_vo + d[None, :],
                    mask=seen[:, None], other=0.0)
        s = tl.where(visible, _scores(q, kt, scale_log2, FP32, UPCAST), float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, FP32, UPCAST, EMULATE)

    if SPLIT:  # float32 partials [N, heads, splits, D] and (max, sum) [N, heads, splits, 2]
        part = (token * (kv_heads * GROUP) + head) * splits + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=m_ok[:, None])
        tl.store(part_stat_ptr + part * 2, m_i, mask=m_ok)
        tl.store(part_stat_ptr + part * 2 + 1, l_i, mask=m_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out = _cast(out, out_ptr.dtype.element_ty, EMULATE)
        tl.store(out_ptr + token[:, None] * (kv_heads * GROUP * HEAD_DIM) + head[:, None] * HEAD_DIM + d[None, :],
                 out, mask=m_ok[:, None])


@triton.jit
def _combine_splits_kernel(part_acc_ptr, part_stat_ptr, out_ptr, queries, splits, HEAD_DIM: tl.constexpr,
                           BLOCK_S: tl.constexpr, ROWS: tl.constexpr, EMULATE: tl.constexpr):
    query = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # token * heads + head: an output row
    live = query < queries
    d = tl.arange(0, HEAD_DIM)
    first = query * splits
    top = tl.full([ROWS, BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, splits, BLOCK_S):  # the largest running max over the splits
        s = s0 + tl.arange(0, BLOCK_S)
        ok = live[:, None] & (s[None, :] < splits)
        top = tl.maximum(top, tl.load(part_stat_ptr + (first[:, None] + s[None, :]) * 2, mask=ok,
                                      other=float("-inf")))
    top = tl.max(top, 1)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: all weights 0
    norm = tl.zeros([ROWS, BLOCK_S], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_S, HEAD_DIM], tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ok = live[:, None] & (s[None, :] < splits)
        at = first[:, None] + s[None, :]
        weight = tl.exp2(tl.load(part_stat_ptr + at * 2, mask=ok, other=float("-inf")) - top[:, None])
        norm += weight * tl.load(part_stat_ptr + at * 2 + 1, mask=ok, other=0.0)
        acc += weight[:, :, None] * tl.load(part_acc_ptr + at[:, :, None] * HEAD_DIM + d[None, None, :],
                                            mask=ok[:, :, None], other=0.0)
    total = tl.sum(norm, 1)
    out = tl.sum(acc, 1) / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + query[:, None] * HEAD_DIM + d[None, :], _cast(out, out_ptr.dtype.element_ty, EMULATE),
             mask=live[:, None])


def query_tile(per_row: int, group: int) -> int:
    """Queries per attention program: a row's (node, head-in-group) pairs, a power of two in [16, BLOCK_M_MAX]."""
    return min(BLOCK_M_MAX, max(16, triton.next_power_of_2(per_row * group)))


def attention_splits(rows: int, kv_heads: int, tiles: int, max_positions: int) -> int:
    """Key splits for ``rows`` x ``kv_heads`` x ``tiles`` programs over at most ``max_positions`` keys a row: enough
    for about TARGET_PROGRAMS programs, each split covering at least MIN_SPLIT_KEYS keys."""
    programs = rows * kv_heads * tiles
    if programs >= TARGET_PROGRAMS:
        return 1
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, programs), triton.cdiv(max_positions, MIN_SPLIT_KEYS)))


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    prefix_len: torch.Tensor, tree_mask: torch.Tensor, scale: float, per_row: int, splits: int | None = None,
) -> torch.Tensor:
    """Attention of ``q`` [N, q_heads, D] (rows of ``per_row`` queries) over each row's visible keys in the pools
    (keys [blocks, kv_heads, D, block_size], values [blocks, kv_heads, block_size, D]; the new tokens' entries
    already written), visibility as ``attention.AttentionMetadata`` describes; [N, q_heads, D] in q's dtype.
    ``splits``: key splits (None: ``attention_splits``)."""
    tokens, q_heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[-1]
    group = q_heads // kv_heads
    rows = block_tables.shape[0]
    assert tokens == rows * per_row and q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    max_positions = block_tables.shape[1] * block_size
    block_m = query_tile(per_row, group)
    tiles = triton.cdiv(per_row * group, block_m)
    if splits is None:  # interpreted, programs run one after another: splitting only adds the combine's work
        splits = 1 if INTERPRET else attention_splits(rows, kv_heads, tiles, max_positions)
    chunk = triton.cdiv(triton.cdiv(max_positions, splits), BLOCK_N) * BLOCK_N  # split ranges align with tiles
    out = torch.empty(tokens, q_heads, head_dim, dtype=q.dtype, device=q.device)
    if splits > 1:
        part_acc = torch.empty(tokens, q_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_stat = torch.empty(tokens, q_heads, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_stat = out
    _paged_attention_kernel[(rows * kv_heads * tiles, splits)](
        q, k_cache, v_cache, block_tables, prefix_len, tree_mask, out, part_acc, part_stat,
        scale * 1.4426950408889634, per_row, kv_heads, tiles, tree_mask.shape[1], max_positions, chunk, splits,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        tree_mask.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=BLOCK_N, SPLIT=splits > 1,
        FP32=q.dtype == torch.float32, UPCAST=INTERPRET, EMULATE=INTERPRET, num_warps=4,
    )
    if splits > 1:
        _combine_splits_kernel[(triton.cdiv(tokens * q_heads, ROWS_PER_PROGRAM),)](
            part_acc, part_stat, out, tokens * q_heads, splits, HEAD_DIM=head_dim,
            BLOCK_S=min(16, triton.next_power_of_2(splits)), ROWS=ROWS_PER_PROGRAM, EMULATE=INTERPRET, num_warps=2,
        )
    return out


# ------------------------------------------------------------------------------ GEMM over quantized blocks
# Tiles of the block GEMM: tokens (>= 16 for tl.dot), output rows, input weights (two 32-weight blocks).
BLOCKS_M = 16
BLOCKS_N = 64
BLOCKS_K = 64


@triton.jit
def _block_linear_kernel(
    x_ptr, q_ptr, d_ptr, m_ptr, out_ptr, tokens, rows, cols, stride_xm, stride_om,
    BITS: tl.constexpr, HAS_M: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FP32: tl.constexpr, UPCAST: tl.constexpr, EMULATE: tl.constexpr,
):
    """out[t, n] = sum_k x[t, k] W[n, k], W[n, k] = d[n, g] q[n, k] + m[n, g] with g = k // GROUP (32: a d and m a
    block; 16: a half-block's, Q6_K): each weight tile decoded once in registers (4-bit: byte j of a block holds
    weights j and j + 16) and multiplied on the tensor cores."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < tokens, rn < rows
    rn64 = rn.to(tl.int64)
    scales = cols // GROUP
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    for k0 in range(0, cols, BLOCK_K):
        if BITS == 4:
            i = tl.arange(0, BLOCK_K // 2)  # the tile's bytes: block k0 / 32 + i // 16, weights i % 16 and + 16
            low_k = k0 + (i // 16) * 32 + i % 16
            byte = tl.load(q_ptr + rn64[:, None] * (cols // 2) + (k0 // 2 + i)[None, :], mask=n_ok[:, None],
                           other=0).to(tl.int32)
            low_at = rn64[:, None] * scales + (low_k // GROUP)[None, :]
            d_low = tl.load(d_ptr + low_at, mask=n_ok[:, None], other=0.0)
            m_low = tl.load(m_ptr + low_at, mask=n_ok[:, None], other=0.0) if HAS_M else 0.0
            if GROUP == 32:  # a byte's two weights share their block's d and m: loaded once
                d_high, m_high = d_low, m_low
            else:
                high_at = rn64[:, None] * scales + ((low_k + 16) // GROUP)[None, :]
                d_high = tl.load(d_ptr + high_at, mask=n_ok[:, None], other=0.0)
                m_high = tl.load(m_ptr + high_at, mask=n_ok[:, None], other=0.0) if HAS_M else 0.0
            w_low = (byte & 15).to(tl.float32) * d_low + m_low
            w_high = (byte >> 4).to(tl.float32) * d_high + m_high
            x_low = tl.load(x_ptr + rm[:, None] * stride_xm + low_k[None, :], mask=m_ok[:, None], other=0.0)
            x_high = tl.load(x_ptr + rm[:, None] * stride_xm + (low_k + 16)[None, :], mask=m_ok[:, None], other=0.0)
            acc = _block_dot(x_low, w_low, acc, dtype, FP32, UPCAST, EMULATE)
            acc = _block_dot(x_high, w_high, acc, dtype, FP32, UPCAST, EMULATE)
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            q = tl.load(q_ptr + rn64[:, None] * cols + k[None, :], mask=n_ok[:, None], other=0).to(tl.float32)
            at = rn64[:, None] * scales + (k // GROUP)[None, :]
            w = q * tl.load(d_ptr + at, mask=n_ok[:, None], other=0.0)
            if HAS_M:
                w += tl.load(m_ptr + at, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None], other=0.0)
            acc = _block_dot(x, w, acc, dtype, FP32, UPCAST, EMULATE)
    out = _cast(acc, out_ptr.dtype.element_ty, EMULATE)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


@_helper
def _block_dot(x, w, acc, dtype: tl.constexpr, FP32: tl.constexpr, UPCAST: tl.constexpr, EMULATE: tl.constexpr):
    """acc + x @ w.T: float32 in full precision (not TF32); bf16/fp16 weights rounded to x's dtype for the tensor
    cores (as a dequantized checkpoint in that dtype would hold them)."""
    if FP32:
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    elif UPCAST:
        acc = tl.dot(x.to(tl.float32), tl.trans(_cast(w, dtype, EMULATE).to(tl.float32)), acc)
    else:
        acc = tl.dot(x, tl.trans(w.to(dtype)), acc)
    return acc


def block_linear(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int
                 ) -> torch.Tensor:
    """``x @ W.T`` for the 32-weight blocks (q, d, m) of ``bits`` a weight (``gguf_blocks.BlockWeight``; d and m a
    block or a half-block): x [..., K] in float32, bf16 or fp16, out in x's dtype."""
    lead, cols = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, cols)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    tokens, rows = flat.shape[0], q.shape[0]
    out = torch.empty(tokens, rows, dtype=x.dtype, device=x.device)
    block_k = BLOCKS_K if cols % BLOCKS_K == 0 else 32
    grid = (triton.cdiv(tokens, BLOCKS_M), triton.cdiv(rows, BLOCKS_N))
    _block_linear_kernel[grid](
        flat, q, d, d if m is None else m, out, tokens, rows, cols, flat.stride(0), out.stride(0),
        BITS=bits, HAS_M=m is not None, GROUP=cols // d.shape[1], BLOCK_M=BLOCKS_M, BLOCK_N=BLOCKS_N,
        BLOCK_K=block_k, FP32=x.dtype == torch.float32, UPCAST=INTERPRET, EMULATE=INTERPRET, num_warps=4,
    )
    return out.view(*lead, rows)


# ------------------------------------------------------------------------------------ sm_90 compile specs
@dataclass(frozen=True)
class KernelShape:
    """A model's layer shape, for compiling every kernel ahead of time (CI has no GPU)."""

    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    dtype: str = "bf16"
    block_size: int = 16


SMOLLM2_135M = KernelShape(hidden=576, q_heads=9, kv_heads=3, head_dim=64, intermediate=1536)
LLAMA3_8B = KernelShape(hidden=4096, q_heads=32, kv_heads=8, head_dim=128, intermediate=14336)


def sm90_compile_specs(shape: KernelShape) -> list[tuple[object, dict[str, str], dict[str, object]]]:
    """(kernel, signature, constexprs) for every kernel at ``shape``, as ``triton.compile(ASTSource(...))`` takes
    them: attention for a decode step (split) and a 20-node tree (unsplit), and with Qwen3's q/k norms."""
    t = shape.dtype
    ptr = f"*{t}"
    tl_dtype = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[t]
    norm = {"hidden_ptr": ptr, "delta_ptr": ptr, "weight_ptr": ptr, "residual_ptr": ptr, "out_ptr": ptr,
            "tokens": "i32", "size": "i32", "eps": "fp32"}
    block = triton.next_power_of_2(shape.hidden)
    specs: list[tuple[object, dict[str, str], dict[str, object]]] = [
        (_add_rms_norm_kernel, norm, {"HAS_DELTA": True, "BLOCK": block, "ROWS": 1, "EMULATE": False}),
        (_add_rms_norm_kernel, norm, {"HAS_DELTA": False, "BLOCK": block, "ROWS": 1, "EMULATE": False}),
        (_silu_mul_kernel, {"gate_up_ptr": ptr, "out_ptr": ptr, "tokens": "i32", "size": "i32"},
         {"BLOCK": min(1024, triton.next_power_of_2(shape.intermediate)), "ROWS": 1, "EMULATE": False}),
    ]
    rotary = {"qkv_ptr": ptr, "cos_ptr": ptr, "sin_ptr": ptr, "slots_ptr": "*i64", "k_ptr": ptr, "v_ptr": ptr,
              "q_out_ptr": ptr, "q_norm_ptr": ptr, "k_norm_ptr": ptr, "tokens": "i32", "eps": "fp32",
              **{name: "i32" for name in ("stride_xn", "stride_cn", "stride_sn", "stride_kb", "stride_kh",
                                          "stride_kd", "stride_vb", "stride_vh", "stride_vo")}}
    for qk_norm in (False, True):
        specs.append((_rotary_write_kv_kernel, rotary, {
            "Q_HEADS": shape.q_heads, "KV_HEADS": shape.kv_heads, "HEAD_DIM": shape.head_dim,
            "BLOCK_D": triton.next_power_of_2(shape.head_dim), "BLOCK_SIZE": shape.block_size, "NORM": qk_norm,
            "NORM_DTYPE": tl_dtype, "ROWS": 1, "EMULATE": False}))
    attention = {"q_ptr": ptr, "k_ptr": ptr, "v_ptr": ptr, "tables_ptr": "*i32", "prefix_ptr": "*i32",
                 "mask_ptr": "*i64", "out_ptr": ptr, "part_acc_ptr": "*fp32", "part_stat_ptr": "*fp32",
                 "scale_log2": "fp32",
                 **{name: "i32" for name in ("per_row", "kv_heads", "tiles", "words", "max_positions", "chunk",
                                             "splits", "stride_qn", "stride_qh", "stride_kb", "stride_kh",
                                             "stride_kd", "stride_vb", "stride_vh", "stride_vo", "stride_tr",
                                             "stride_mn")}}
    group = shape.q_heads // shape.kv_heads
    for per_row, split in ((1, True), (20, False)):
        specs.append((_paged_attention_kernel, attention, {
            "GROUP": group, "HEAD_DIM": shape.head_dim, "BLOCK_SIZE": shape.block_size,
            "BLOCK_M": query_tile(per_row, group), "BLOCK_N": BLOCK_N, "SPLIT": split, "FP32": t == "fp32",
            "UPCAST": False, "EMULATE": False}))
    specs.append((_combine_splits_kernel, {"part_acc_ptr": "*fp32", "part_stat_ptr": "*fp32", "out_ptr": ptr,
                                           "queries": "i32", "splits": "i32"},
                  {"HEAD_DIM": shape.head_dim, "BLOCK_S": 16, "ROWS": 1, "EMULATE": False}))
    blocks = {"x_ptr": ptr, "d_ptr": "*fp32", "m_ptr": "*fp32", "out_ptr": ptr,
              **{name: "i32" for name in ("tokens", "rows", "cols", "stride_xm", "stride_om")}}
    for bits, q_type, group in ((4, "*u8", 32), (8, "*i8", 32), (8, "*i8", 16)):  # Q4_x, Q8_0, Q6_K
        specs.append((_block_linear_kernel, {**blocks, "q_ptr": q_type}, {
            "BITS": bits, "HAS_M": bits == 4, "GROUP": group, "BLOCK_M": BLOCKS_M, "BLOCK_N": BLOCKS_N,
            "BLOCK_K": BLOCKS_K, "FP32": t == "fp32", "UPCAST": False, "EMULATE": False}))
    return specs


KERNELS = [_add_rms_norm_kernel, _rotary_write_kv_kernel, _silu_mul_kernel, _paged_attention_kernel,
           _combine_splits_kernel, _block_linear_kernel]
