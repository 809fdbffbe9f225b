"""Weights kept in GGUF's 32-weight blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), multiplied as they are stored.

A block of one output row holds 32 consecutive input weights with ``w = d * q + m``:

| type | bytes a block | layout | q | m |
| --- | --- | --- | --- | --- |
| Q4_0 | 18 | d (f16), 16 bytes of nibbles | 0..15 | -8 d |
| Q4_1 | 20 | d (f16), m (f16), 16 bytes of nibbles | 0..15 | m |
| Q8_0 | 34 | d (f16), 32 int8 | -128..127 | 0 |
| Q4_K | 144 for 8 blocks | D, Dmin (f16), 8 scales and 8 mins of 6 bits, 128 bytes of nibbles | 0..15 | -Dmin min |
| Q6_K | 210 for 8 blocks | 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, D (f16) | -32..31 | 0 |

Q4_K's block b has d = D * scale_b and m = -Dmin * min_b (exact in float32: an f16 times a 6-bit integer); its
nibbles are stored a 64-weight pair of blocks at a time (32 bytes: block 2i low, block 2i + 1 high) and are put in
the order below when read. Q6_K scales each half-block of 16 weights (d = D * scale, exact): its blocks keep two d
a block, and its 6-bit q - 32 as int8 (8.5 + 1 bits a weight against the file's 6.56: no kernel reads 6 bits).

Byte j of a 4-bit block holds weight j in its low nibble and weight j + 16 in its high one. ``BlockWeight`` keeps
the nibbles (or int8) as stored and d, m widened to float32 (exactly), so its dequantized weights are bit for bit
what the ``gguf`` package's ``dequantize`` gives, and ``specbatch::block_linear`` (``csrc/quantized_linear.cpp``)
reads 4.5 or 8.5 bits a weight where a float32 copy reads 32.

``use_gguf_blocks`` makes a Llama-family model loaded from a GGUF (transformers dequantizes it to float32) multiply
its linear layers, embedding and LM head from the file's own blocks instead, and drops the float copies: the
projections become weight-only kernels the lean forward reads (``kernel_parts``), q|k|v and gate|up fused.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

log = logging.getLogger(__name__)

BLOCK = 32
# type name -> (weights a stored block, bytes a stored block, bits a weight, whether the block stores m)
LAYOUTS = {"Q4_0": (32, 18, 4, False), "Q4_1": (32, 20, 4, True), "Q8_0": (32, 34, 8, False),
           "Q4_K": (256, 144, 4, True), "Q6_K": (256, 210, 8, False)}


@dataclass(frozen=True)
class BlockWeight:
    """A [N, K] weight in 32-weight blocks: ``q`` [N, K * bits / 8] (uint8 nibbles, or int8), ``d`` and ``m``
    [N, K / 32] float32, or [N, K / 16] (a d and m each half-block; Q6_K), ``m`` None: zero."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * 8 // self.bits

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` (x [..., K]: float32 on a CPU; on a GPU also bf16 or fp16)."""
        return block_linear(self.q, self.d, self.m, self.bits, None, x)

    def to(self, device: torch.device) -> BlockWeight:
        return BlockWeight(*(t.to(device) if t is not None else None for t in (self.q, self.d, self.m)), self.bits)

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K] (the C++ kernel on a CPU; torch operations elsewhere, the same values)."""
        if self.q.device.type == "cpu":
            return torch.ops.specbatch.block_dequantize(self.q, self.d, self.m, self.bits)
        return dequantized(self.q, self.d, self.m, self.bits)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)

    def rows(self, index: torch.Tensor) -> BlockWeight:
        """The output rows ``index`` (a gather: whole rows of blocks)."""
        return BlockWeight(self.q[index], self.d[index], self.m[index] if self.m is not None else None, self.bits)

    @staticmethod
    def stacked(weights: list[BlockWeight]) -> BlockWeight:
        """Weights of one input size and one type, their output rows one after the other."""
        return BlockWeight(torch.cat([w.q for w in weights]), torch.cat([w.d for w in weights]),
                           torch.cat([w.m for w in weights]) if weights[0].m is not None else None, weights[0].bits)

    def kernel(self, bias: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> x @ W.T + bias``, a module's forward (``quantize.kernel_parts`` reads its tensors back)."""
        return functools.partial(block_linear, self.q, self.d, self.m, self.bits, bias)


def dequantized(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int) -> torch.Tensor:
    """The float32 [N, K] weights of blocks (q, d, m) by torch operations: d * q + m, each product exact (d holds at
    most 17 significant bits, q 8), so one rounding as in the C++ kernel's fused multiply-add."""
    rows = q.shape[0]
    if bits == 4:
        pairs = q.view(rows, -1, BLOCK // 2)  # byte j of a block: weight j low, weight j + 16 high
        ints = torch.cat([pairs & 15, pairs >> 4], -1).float()
    else:
        ints = q.view(rows, -1, BLOCK).float()
    ints = ints.reshape(rows, d.shape[1], -1)  # one d and m a block or half-block
    weights = ints * d[..., None]
    if m is not None:
        weights = weights + m[..., None]
    return weights.reshape(rows, -1)


def multiply_blocks(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int,
                    triton: bool = False) -> torch.Tensor:
    """``x @ W.T`` for the blocks (q, d, m) of ``bits`` a weight: the C++ kernel on a CPU (x float32), the Triton GEMM
    on a GPU (x in the model's dtype) or where ``triton`` asks for it (the fused Triton layer's execution)."""
    if x.device.type == "cpu" and not triton:
        return torch.ops.specbatch.block_linear(x, q, d, m, bits)
    from decoding.model import triton_kernels as tk

    return tk.block_linear(x, q, d, m, bits)


def block_linear(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int, bias: torch.Tensor | None,
                 x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T + bias`` for the blocks (q, d, m) of ``bits`` a weight (a module's forward; ``multiply_blocks``)."""
    out = multiply_blocks(x, q, d, m, bits)
    return out + bias if bias is not None else out


class BlockEmbedding(nn.Module):
    """An embedding table kept in blocks (buffers, shared by the model's copies): each looked-up row dequantized
    (as ``gguf`` dequantizes it)."""

    def __init__(self, weight: BlockWeight) -> None:
        super().__init__()
        self.register_buffer("q", weight.q, persistent=False)
        self.register_buffer("d", weight.d, persistent=False)
        self.register_buffer("m", weight.m, persistent=False)
        self.bits = weight.bits
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = BlockWeight(self.q, self.d, self.m, self.bits).rows(ids.reshape(-1))
        return rows.dequantize().view(*ids.shape, self.embedding_dim)


def from_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, int], name: str = "tensor") -> BlockWeight:
    """The blocks of a GGUF tensor of ``type_name`` and logical ``shape`` [N, K] (``raw``: its bytes, as the
    ``gguf`` reader's ``data`` gives them). Raises ``ValueError`` naming the tensor and the type where the bytes
    do not hold whole blocks of that shape."""
    if type_name not in LAYOUTS:
        raise ValueError(f"{name}: type {type_name} is not read as blocks (supported: {', '.join(LAYOUTS)})")
    stored, block_bytes, bits, has_m = LAYOUTS[type_name]
    rows, cols = shape
    if cols % stored:
        raise ValueError(f"{name}: {type_name} rows of {cols} weights are not whole blocks of {stored}")
    blocks = cols // stored
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if data.size != rows * blocks * block_bytes:
        raise ValueError(f"{name}: {type_name} [{rows}, {cols}] needs {rows * blocks * block_bytes} bytes, "
                         f"the file holds {data.size} (truncated or corrupt)")
    data = data.reshape(rows, blocks, block_bytes)
    if type_name in ("Q4_K", "Q6_K"):
        return (_q4_k if type_name == "Q4_K" else _q6_k)(data, name)
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


def _q4_k(data: np.ndarray, name: str) -> BlockWeight:
    """The 32-weight blocks of Q4_K super-blocks ``data`` [N, S, 144] (ggml's ``block_q4_K``)."""
    rows, supers, _ = data.shape
    big_d, big_min = (data[:, :, i:i + 2].copy().view(np.float16)[..., 0].astype(np.float32) for i in (0, 2))
    low, high, rest = (data[:, :, 4 + 4 * i:8 + 4 * i] for i in range(3))  # the 12 bytes of 6-bit scales and mins
    scales = np.concatenate([low & 0x3F, (rest & 0x0F) | ((low >> 2) & 0x30)], -1).astype(np.float32)
    mins = np.concatenate([high & 0x3F, (rest >> 4) | ((high >> 2) & 0x30)], -1).astype(np.float32)
    d = (big_d[..., None] * scales).reshape(rows, supers * 8)
    m = -(big_min[..., None] * mins).reshape(rows, supers * 8)
    pairs = data[:, :, 16:].reshape(rows, supers, 4, 1, 32)
    q = (pairs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F  # [N, S, 4, 2, 32]
    if not (np.isfinite(d).all() and np.isfinite(m).all()):
        raise ValueError(f"{name}: Q4_K block scales are not finite (corrupt)")
    return BlockWeight(pack_nibbles(torch.from_numpy(q.reshape(rows, -1))), torch.from_numpy(np.ascontiguousarray(d)),
                       torch.from_numpy(np.ascontiguousarray(m)), 4)


def _q6_k(data: np.ndarray, name: str) -> BlockWeight:
    """The 32-weight blocks of Q6_K super-blocks ``data`` [N, S, 210] (ggml's ``block_q6_K``): weight i of a
    128-weight half holds nibble (i // 64) of low byte i % 64 and bit pair (i // 32) of high byte i % 32."""
    rows, supers, _ = data.shape
    low = data[:, :, :128].reshape(rows, supers, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    high = data[:, :, 128:192].reshape(rows, supers, 2, 1, 32) >> np.array(
        [0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    q = ((low & 0x0F).reshape(rows, supers, 2, 128) | (high & 3).reshape(rows, supers, 2, 128) << 4).astype(np.int8)
    scales = data[:, :, 192:208].copy().view(np.int8).astype(np.float32)
    big_d = data[:, :, 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    d = (big_d[..., None] * scales).reshape(rows, supers * 16)
    if not np.isfinite(d).all():
        raise ValueError(f"{name}: Q6_K block scales are not finite (corrupt)")
    return BlockWeight(torch.from_numpy((q - 32).reshape(rows, -1)), torch.from_numpy(np.ascontiguousarray(d)), None, 8)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers 0..15 as the [N, K / 2] bytes of 4-bit blocks (byte j of a block: weight j in its low nibble,
    weight j + 16 in its high one)."""
    rows, cols = q.shape
    halves = q.to(torch.uint8).view(rows, cols // BLOCK, 2, BLOCK // 2)
    return (halves[:, :, 0] | halves[:, :, 1] << 4).reshape(rows, cols // 2)


def uses_blocks(model: nn.Module) -> bool:
    """Whether ``model`` computes from a GGUF's blocks (``use_gguf_blocks``)."""
    return any(isinstance(module, BlockEmbedding) or getattr(vars(module).get("forward"), "func", None) is block_linear
               for module in model.modules())


# A Llama-family GGUF's names for each decoder layer's linear layers: (module, child) in transformers' layer.
LAYER_LINEARS = {
    "attn_q": ("self_attn", "q_proj"), "attn_k": ("self_attn", "k_proj"), "attn_v": ("self_attn", "v_proj"),
    "attn_output": ("self_attn", "o_proj"), "ffn_gate": ("mlp", "gate_proj"), "ffn_up": ("mlp", "up_proj"),
    "ffn_down": ("mlp", "down_proj"),
}
def read_blocks(path: str | Path) -> dict[str, BlockWeight]:
    """Every matrix of a block type in the GGUF at ``path``, by its GGUF name (other types are left to the float
    weights transformers dequantized)."""
    from gguf import GGUFReader

    found, left = {}, set()
    for tensor in GGUFReader(str(path)).tensors:
        if tensor.tensor_type.name in LAYOUTS and len(tensor.shape) == 2:
            cols, rows = (int(n) for n in tensor.shape)  # GGUF lists the innermost dimension first
            found[tensor.name] = from_gguf(tensor.data, tensor.tensor_type.name, (rows, cols), tensor.name)
        elif len(tensor.shape) == 2 and tensor.tensor_type.name not in ("F32", "F16", "BF16"):
            left.add(tensor.tensor_type.name)
    if left:
        log.info("%s: matrices of type %s stay as the float weights transformers dequantized", path,
                 ", ".join(sorted(left)))
    return found


def _rotary_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's permutation of q and k (each head's rotary halves interleaved), as
    transformers' GGUF loader undoes it on the float weights: row (h, i, j) of the result is row (h, j, i) of the
    file, j over each head's half-dimension."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


# Token counts at which the C++ kernel's lanes and broadcast forms are timed against each other.
FORM_TOKENS = (8, 12, 16, 24, 32, 64)


# A timing during which other processes took more than this share of one core is a busy machine's: it chose the lanes
# form everywhere (128) beside a test suite where a quiet timing chooses the broadcast form from 12 tokens, and the
# lanes form decodes batch 16 and 64 of the default model 8% and 6% slower (2-core AVX-512 EPYC).
BUSY_SHARE = 0.25
FORM_ATTEMPTS = 3


@functools.cache
def choose_block_forms() -> int:
    """The number of tokens from which ``specbatch::block_linear`` multiplies in its broadcast form rather than its
    lanes form, set in the kernel. Timed once per machine, source and thread count on a quiet machine, then read
    from a file beside the compiled kernel: every process on a machine picks the same form for a call, so sums run
    in one order. A timing the machine's other work disturbed is kept, marked busy, until a process that finds the
    machine quiet times again and replaces it."""
    from filelock import FileLock

    path = _form_record()
    with FileLock(str(path.with_suffix(".lock"))):  # one process times, the others wait and read
        recorded = _recorded_form(path)
        if recorded is not None and recorded[1]:
            tokens = recorded[0]
        else:
            tokens, quiet = _quiet_block_forms()
            if recorded is not None and not quiet:
                tokens = recorded[0]  # one busy timing is as good as another: keep the machine's
            else:
                partial = path.with_suffix(f".{os.getpid()}.tmp")
                partial.write_text(f"{tokens} {'quiet' if quiet else 'busy'}")
                partial.replace(path)
                log.info("block kernel: the broadcast form from %d tokens on this machine (%s, timed on a %s "
                         "machine)", tokens, path, "quiet" if quiet else "busy")
    torch.ops.specbatch.set_block_broadcast_from(tokens)
    return tokens


def _form_record() -> Path:
    """The file beside the compiled kernel that records this machine's count for this process's thread count."""
    from decoding.model.attention import kernel_folder

    return kernel_folder() / f"block_forms_{torch.get_num_threads()}_threads.txt"


def _recorded_form(path: Path) -> tuple[int, bool] | None:
    """The recorded count and whether it was timed on a quiet machine (a bare count, as recorded before quietness
    was, counts as busy), or None."""
    try:
        tokens, *quiet = path.read_text().split()
        return int(tokens), quiet == ["quiet"]
    except (OSError, ValueError):
        return None


def _quiet_block_forms() -> tuple[int, bool]:
    """``_time_block_forms`` until a timing runs on a quiet machine (``FORM_ATTEMPTS`` tries): its count and whether
    it did."""
    for _ in range(FORM_ATTEMPTS):
        others = _others_cpu_s()
        started = time.perf_counter()
        tokens = _time_block_forms()
        elapsed = time.perf_counter() - started
        busy = others() if others else 0.0
        if busy <= BUSY_SHARE * elapsed:
            return tokens, True
    return tokens, False


def _others_cpu_s() -> Callable[[], float] | None:
    """A function giving the CPU seconds other processes have taken since this call (the machine's less this
    process's), or None where the machine's are not to be read."""
    try:
        start = _machine_cpu_s() - time.process_time()
    except (OSError, ValueError, IndexError):
        return None
    return lambda: max(0.0, _machine_cpu_s() - time.process_time() - start)


def _machine_cpu_s() -> float:
    """The CPU seconds every core has spent busy since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _time_block_forms(repeats: int = 8) -> int:
    """The count from which the broadcast form costs least: of ``FORM_TOKENS`` (or the kernel's dense threshold,
    ``block_dense_from``: never), the threshold whose choice of form at every count sums to the least time, each form
    timed (best of ``repeats`` alternating calls) on Q4_1 weights of SmolLM2's three projection shapes."""
    generator = torch.Generator().manual_seed(0)
    weights = []
    for rows, cols in ((576, 576), (1536, 576), (576, 1536)):
        d = torch.rand(rows, cols // BLOCK, generator=generator) * 1e-2
        weights.append((torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator), d, -8 * d))
    costs = []  # per count: (lanes, broadcast) seconds
    for tokens in FORM_TOKENS:
        xs = [torch.randn(tokens, q.shape[1] * 2, generator=generator) for q, _, _ in weights]
        best = [float("inf"), float("inf")]
        for repeat in range(repeats + 1):
            for form in (0, 1):
                started = time.perf_counter()
                for x, (q, d, m) in zip(xs, weights):
                    torch.ops.specbatch.block_linear_form(x, q, d, m, 4, form)
                if repeat:  # the first pass warms the caches
                    best[form] = min(best[form], time.perf_counter() - started)
        costs.append(best)
    totals = [sum(lanes for lanes, _ in costs[:at]) + sum(broadcast for _, broadcast in costs[at:])
              for at in range(len(costs) + 1)]
    at = totals.index(min(totals))
    return FORM_TOKENS[at] if at < len(FORM_TOKENS) else torch.ops.specbatch.block_dense_from()


def _dropped(module: nn.Linear) -> None:
    """The float weight's memory freed (the module computes from its blocks now)."""
    module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)


def check_block_kernels(device: torch.device, method: str) -> None:
    """Raises ``ValueError`` naming ``quantization: method`` where blocks cannot be multiplied on ``device``: a CPU
    needs the C++ kernels (whose form switch is then set, ``choose_block_forms``), a CUDA GPU Triton."""
    if device.type == "cpu":
        from decoding.model.attention import cpu_kernel

        if not cpu_kernel():
            raise ValueError(f"quantization: {method} needs the C++ kernels, which could not be built here (a C++ "
                             "compiler)")
        choose_block_forms()
    elif device.type == "cuda":
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            raise ValueError(f"quantization: {method} on a GPU needs Triton (pip install triton)")
    else:
        raise ValueError(f"quantization: {method} runs on a CPU or a CUDA GPU, not {device.type}")


def use_blocks(model: nn.Module, linears: dict[str, BlockWeight], device: torch.device | None = None) -> int:
    """Each linear layer of ``model`` named in ``linears`` (by module path, e.g. ``model.layers.0.mlp.up_proj``)
    computing from its blocks, in place: q|k|v and gate|up fused where all of a group have blocks of one kind, float
    weights freed, the blocks on ``device`` (default: the layer's). Returns how many moved. Raises ``ValueError``
    naming the module where it is no linear layer or its shape differs."""
    from decoding.model.quantize import SIBLINGS, FusedSiblings, siblings_bias

    modules = dict(model.named_modules())
    taken: dict[str, tuple[nn.Linear, BlockWeight]] = {}
    for name, weight in linears.items():
        module = modules.get(name)
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{name}: quantized weights the model has no linear layer for")
        if weight.shape != tuple(module.weight.shape):
            raise ValueError(f"{name}: [{weight.shape[0]}, {weight.shape[1]}] in the checkpoint, the model's layer is "
                             f"{list(module.weight.shape)}")
        taken[name] = (module, weight.to(device or module.weight.device))
    alone = dict(taken)
    for name in taken:
        parent, _, child = name.rpartition(".")
        group = next((group for group in SIBLINGS if group[0] == child), ())  # named by its first member
        members = [alone.get(f"{parent}.{c}") for c in group]
        if members and all(members) and len({(w.bits, w.m is None, w.d.shape[1]) for _, w in members}) == 1:
            siblings = [module for module, _ in members]
            FusedSiblings(siblings, BlockWeight.stacked([w for _, w in members]).kernel(siblings_bias(siblings)))
            for c in group:
                alone.pop(f"{parent}.{c}")
    for module, weight in alone.values():
        module.forward = weight.kernel(module.bias)
    for module, _ in taken.values():
        _dropped(module)
    return len(taken)


def use_gguf_blocks(model: nn.Module, path: str | Path) -> nn.Module:
    """``model`` (a Llama-family causal LM that transformers loaded from the GGUF at ``path``) computing its linear
    layers, its embedding and its LM head from the file's blocks, in place; float copies of what moved are freed.
    Raises ``ValueError`` naming the tensor where the file's tensors do not match the model's modules."""
    device = next(model.parameters()).device
    check_block_kernels(device, "gguf")
    blocks = read_blocks(path)
    config = model.config
    base = model.model
    prefix = next(name for name, module in model.named_modules() if module is base.layers)
    linears = {}
    for index, layer in enumerate(base.layers):
        for short, (parent, child) in LAYER_LINEARS.items():
            name = f"blk.{index}.{short}.weight"
            module = getattr(getattr(layer, parent), child)
            if name not in blocks:
                continue
            weight = blocks.pop(name)
            if weight.shape != tuple(module.weight.shape):
                raise ValueError(f"{name}: [{weight.shape[0]}, {weight.shape[1]}] in the file, the model's "
                                 f"{parent}.{child} is {list(module.weight.shape)}")
            if short in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if short == "attn_q" else config.num_key_value_heads
                weight = weight.rows(_rotary_rows(weight.shape[0], heads))
            linears[f"{prefix}.{index}.{parent}.{child}"] = weight
    moved = use_blocks(model, linears)
    embedding = blocks.pop("token_embd.weight", None)
    head = blocks.pop("output.weight", embedding if getattr(config, "tie_word_embeddings", False) else None)
    lm_head = model.get_output_embeddings()
    if head is not None:
        if head.shape != tuple(lm_head.weight.shape):
            raise ValueError(f"output.weight: [{head.shape[0]}, {head.shape[1]}] in the file, the model's lm_head "
                             f"is {list(lm_head.weight.shape)}")
        lm_head.forward = head.to(device).kernel(lm_head.bias)
        _dropped(lm_head)  # a tied embedding keeps the float table until it is replaced below
    if embedding is not None:
        if embedding.shape != tuple(base.embed_tokens.weight.shape):
            raise ValueError(f"token_embd.weight: [{embedding.shape[0]}, {embedding.shape[1]}] in the file, the "
                             f"model's embed_tokens is {list(base.embed_tokens.weight.shape)}")
        base.embed_tokens = BlockEmbedding(embedding.to(device))
    if blocks:
        raise ValueError(f"{next(iter(blocks))}: a block tensor the model has no module for")
    log.info("GGUF blocks: %d linear layers, embedding %s, head %s multiplied as stored", moved,
             "yes" if embedding is not None else "float", "yes" if head is not None else "float")
    return model
