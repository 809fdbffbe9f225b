"""Weights kept in GGUF's 32-weight blocks (Q4_0, Q4_1, Q8_0), multiplied as they are stored.

A block of one output row holds 32 consecutive input weights with ``w = d * q + m``:

| type | bytes a block | layout | q | m |
| --- | --- | --- | --- | --- |
| Q4_0 | 18 | d (f16), 16 bytes of nibbles | 0..15 | -8 d |
| Q4_1 | 20 | d (f16), m (f16), 16 bytes of nibbles | 0..15 | m |
| Q8_0 | 34 | d (f16), 32 int8 | -128..127 | 0 |

Byte j of a 4-bit block holds weight j in its low nibble and weight j + 16 in its high one. ``BlockWeight`` keeps
the nibbles (or int8) as stored and d, m widened to float32 (exactly), so its dequantized weights are bit for bit
what the ``gguf`` package's ``dequantize`` gives, and ``specbatch::block_linear`` (``csrc/quantized_linear.cpp``)
reads 4.5 or 8.5 bits a weight where a float32 copy reads 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
# type name -> (bytes a block, bits a weight, whether the block stores m)
LAYOUTS = {"Q4_0": (18, 4, False), "Q4_1": (20, 4, True), "Q8_0": (34, 8, False)}


@dataclass(frozen=True)
class BlockWeight:
    """A [N, K] weight in 32-weight blocks: ``q`` [N, K * bits / 8] (uint8 nibbles, or int8), ``d`` and ``m``
    [N, K / 32] float32 (``m`` None: zero)."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * 8 // self.bits

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` (x [..., K] float32)."""
        return torch.ops.specbatch.block_linear(x, self.q, self.d, self.m, self.bits)

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K]."""
        return torch.ops.specbatch.block_dequantize(self.q, self.d, self.m, self.bits)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)


def from_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, int], name: str = "tensor") -> BlockWeight:
    """The blocks of a GGUF tensor of ``type_name`` and logical ``shape`` [N, K] (``raw``: its bytes, as the
    ``gguf`` reader's ``data`` gives them). Raises ``ValueError`` naming the tensor and the type where the bytes
    do not hold whole blocks of that shape."""
    if type_name not in LAYOUTS:
        raise ValueError(f"{name}: type {type_name} is not read as blocks (supported: {', '.join(LAYOUTS)})")
    block_bytes, bits, has_m = LAYOUTS[type_name]
    rows, cols = shape
    if cols % BLOCK:
        raise ValueError(f"{name}: {type_name} rows of {cols} weights are not whole blocks of {BLOCK}")
    blocks = cols // BLOCK
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if data.size != rows * blocks * block_bytes:
        raise ValueError(f"{name}: {type_name} [{rows}, {cols}] needs {rows * blocks * block_bytes} bytes, "
                         f"the file holds {data.size} (truncated or corrupt)")
    data = data.reshape(rows, blocks, block_bytes)
    d = data[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    start = 2
    m = None
    if has_m:
        m = data[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        start = 4
    elif type_name == "Q4_0":
        m = -8 * d  # exact: d (q - 8) = d q - 8 d for 4-bit q
    q = np.ascontiguousarray(data[:, :, start:]).reshape(rows, blocks * (block_bytes - start))
    q_tensor = torch.from_numpy(q.view(np.int8) if bits == 8 else q)
    if not (np.isfinite(d).all() and (m is None or np.isfinite(m).all())):
        raise ValueError(f"{name}: {type_name} block scales are not finite (corrupt)")
    return BlockWeight(q_tensor, torch.from_numpy(d), torch.from_numpy(m) if m is not None else None, bits)
