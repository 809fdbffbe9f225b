"""Pre-quantized checkpoints (AWQ, GPTQ, compressed-tensors) run as the integers they store, never dequantized.

Each format stores, per linear layer, integers q of 4 or 8 bits packed into int32 words, a scale s and a zero
point z per group of consecutive input weights (or per output row), with ``w = (q - z) * s``. That is the
``w = d * q + m`` of a GGUF block with ``d = s`` and ``m = -z * s`` (exact in float32: s is a float16 or bfloat16,
z an integer under 2^9), so the layers become ``gguf_blocks.BlockWeight``s, 32 input weights a block, a group
spanning whole blocks, and ``specbatch::block_linear`` multiplies them as it multiplies a GGUF's.

For a weight [N, K] (N outputs, K inputs, groups of g inputs):

- ``awq`` (``version: gemm``): ``qweight`` [K, N / 8] packs 8 outputs a word in the order 0 2 4 6 1 3 5 7;
  ``qzeros`` [K / g, N / 8] likewise; ``scales`` [K / g, N].
- ``gptq`` (``checkpoint_format`` gptq or gptq_v2): ``qweight`` [K * bits / 32, N] packs along K; ``qzeros``
  [K / g, N * bits / 32] along N, holding z - 1 in gptq (v1); ``scales`` [K / g, N]; ``g_idx`` must be k // g.
- ``compressed-tensors`` ``pack-quantized``: ``weight_packed`` [N, K * bits / 32] packs along K, q offset by
  2^(bits - 1) (signed q stored unsigned); ``weight_scale`` [N, K / g] (group), [N, 1] (channel) or [1] (tensor);
  ``weight_zero_point`` packed along N where asymmetric; ``int-quantized``: ``weight`` int8 [N, K].

Words pack their integers from the lowest bits up. Everything else in the checkpoint (embedding, norms, an
unquantized head) loads as float32. GPTQ's act-order (``g_idx`` other than k // g) and activation quantization are
refused by name: their groups are not runs of consecutive weights, or their activations are not float.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from decoding.model.gguf_blocks import BLOCK, BlockWeight, check_block_kernels, pack_nibbles, use_blocks

log = logging.getLogger(__name__)

METHODS = ("awq", "gptq", "compressed-tensors")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's word holds output columns 8c + AWQ_ORDER[i] in nibble i


def checkpoint_method(folder: str | Path) -> str | None:
    """The quantization method of the checkpoint in ``folder`` (its config.json's ``quantization_config``), None for
    a full-precision one. Raises ``ValueError`` naming the field for a method not read here."""
    config = _quantization_config(Path(folder))
    if config is None:
        return None
    method = str(config.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(f"{Path(folder) / 'config.json'}: quantization_config.quant_method {method!r} is not read "
                         f"(supported: {', '.join(METHODS)}; or give the full-precision model)")
    return method


def _quantization_config(folder: Path) -> dict[str, Any] | None:
    path = folder / "config.json"
    return json.loads(path.read_text()).get("quantization_config") if path.is_file() else None


class _Tensors:
    """The checkpoint's tensors by name, across its safetensors files (each opened once), noting which were read."""

    def __init__(self, folder: Path) -> None:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{folder}: a quantized checkpoint is read from .safetensors files; none found")
        self.file_of = {}  # tensor name -> its file's open handle
        for path in files:
            handle = safe_open(str(path), "pt")
            self.file_of.update(dict.fromkeys(handle.keys(), handle))
        self.read: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.file_of:
            raise ValueError(f"{name}: missing from the checkpoint")
        self.read.add(name)
        return self.file_of[name].get_tensor(name)

    def sized(self, name: str, layer: tuple[int, int], dims: tuple[int | None, ...],
              dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``name`` of a [N, K] ``layer``, checked to be ``dims`` (None: any size) of ``dtype``."""
        tensor = self[name]
        fits = tensor.dim() == len(dims) and all(d is None or d == n for d, n in zip(dims, tensor.shape))
        if not fits or (dtype is not None and tensor.dtype != dtype):
            wanted = ", ".join("*" if d is None else str(d) for d in dims)
            raise ValueError(f"{name}: {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)} where a "
                             f"[{layer[0]}, {layer[1]}] layer needs "
                             f"{str(dtype).removeprefix('torch.') + ' ' if dtype else ''}[{wanted}] "
                             "(truncated or corrupt)")
        return tensor


def unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned ``bits``-wide integers packed in int32 ``words`` along ``dim`` (integer i of a word at bits
    [i * bits, (i + 1) * bits)), as int32; that dimension grows 32 / bits times."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    ints = (words.movedim(dim, -1).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return ints.flatten(-2).movedim(-1, dim)


def to_blocks(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, bits: int, name: str) -> BlockWeight:
    """The blocks of ``w = (q - zero) * scale``: ``q`` [N, K] unsigned integers of ``bits``, ``zero`` and ``scale``
    [N, G] per group of K / G consecutive input weights. Raises ``ValueError`` naming ``name`` where the groups are
    not whole blocks of 32."""
    rows, cols = q.shape
    groups = scale.shape[1]
    if cols % groups or (cols // groups) % BLOCK:
        raise ValueError(f"{name}: groups of {cols / groups:g} weights (rows of {cols}, {groups} groups) are not "
                         f"whole blocks of {BLOCK}")
    if zero.shape != scale.shape:
        raise ValueError(f"{name}: zero points {list(zero.shape)} do not match the scales {list(scale.shape)}")
    per_block = cols // groups // BLOCK
    d = scale.float().repeat_interleave(per_block, 1).contiguous()
    if not torch.isfinite(d).all():
        raise ValueError(f"{name}: scales are not finite (corrupt)")
    if bits == 4:
        m = (-zero.float() * scale.float()).repeat_interleave(per_block, 1).contiguous()
        return BlockWeight(pack_nibbles(q), d, m, 4)
    # 8-bit blocks hold signed q: w = s (q - 128) + s (128 - z)
    offset = 128 - zero.float()
    m = (offset * scale.float()).repeat_interleave(per_block, 1).contiguous() if offset.any() else None
    return BlockWeight((q - 128).to(torch.int8).contiguous(), d, m, 8)


def _bits(value: Any, name: str) -> int:
    if value not in (4, 8):
        raise ValueError(f"quantization_config.{name}: {value!r} bits are not read (4 or 8)")
    return int(value)


def awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ's [R, C / 8] int32 words as the [R, C] 4-bit integers they hold, columns in order."""
    order = torch.tensor([AWQ_ORDER.index(column) for column in range(8)])  # the nibble holding each column
    return unpack(words, 4, 1).view(words.shape[0], -1, 8)[:, :, order].reshape(words.shape[0], -1)


def _awq(tensors: _Tensors, module: str, shape: tuple[int, int], config: dict[str, Any]) -> BlockWeight:
    rows, cols = shape
    name = f"{module}.qweight"
    bits = _bits(config.get("bits", config.get("w_bit", 4)), "bits")
    if bits != 4:
        raise ValueError(f"{name}: AWQ is read with 4 bits, the config says {bits}")
    scale = tensors.sized(f"{module}.scales", shape, (None, rows))
    q = awq_columns(tensors.sized(name, shape, (cols, rows // 8), torch.int32))
    zero = awq_columns(tensors.sized(f"{module}.qzeros", shape, (scale.shape[0], rows // 8), torch.int32))
    return to_blocks(q.T, zero.T, scale.T, 4, name)


def _gptq(tensors: _Tensors, module: str, shape: tuple[int, int], config: dict[str, Any]) -> BlockWeight:
    rows, cols = shape
    name = f"{module}.qweight"
    bits = _bits(config.get("bits", 4), "bits")
    per_word = 32 // bits
    scale = tensors.sized(f"{module}.scales", shape, (None, rows)).T
    q = unpack(tensors.sized(name, shape, (cols // per_word, rows), torch.int32), bits, 0).T  # [N, K]
    zeros = tensors.sized(f"{module}.qzeros", shape, (scale.shape[1], -(-rows // per_word)), torch.int32)
    zero = unpack(zeros, bits, 1)[:, :rows].T
    if config.get("checkpoint_format", "gptq") == "gptq":  # v1 stores z - 1 (and adds the 1 back when it reads)
        zero = zero + 1
    if f"{module}.g_idx" in tensors:
        g_idx = tensors.sized(f"{module}.g_idx", shape, (cols,))
        if not torch.equal(g_idx.long(), torch.arange(cols) // -(-cols // scale.shape[1])):
            raise ValueError(f"{module}.g_idx: act-order groups (desc_act) are not runs of consecutive weights; "
                             "re-quantize with desc_act: false")
    return to_blocks(q, zero, scale, bits, name)


def _compressed(tensors: _Tensors, module: str, shape: tuple[int, int], config: dict[str, Any]) -> BlockWeight:
    rows, cols = shape
    if f"{module}.weight_g_idx" in tensors:
        raise ValueError(f"{module}.weight_g_idx: act-order groups are not runs of consecutive weights; "
                         "re-quantize without actorder")
    scale = tensors[f"{module}.weight_scale"]
    scale = scale.reshape(1, 1).expand(rows, 1) if scale.numel() == 1 else scale  # per tensor: one for every row
    if scale.dim() != 2 or scale.shape[0] != rows:
        raise ValueError(f"{module}.weight_scale: {list(scale.shape)}, the model's layer is [{rows}, {cols}]")
    zero_name = f"{module}.weight_zero_point"
    if f"{module}.weight_packed" in tensors:
        name, bits = f"{module}.weight_packed", config["bits"]
        stored = tensors.sized(f"{module}.weight_shape", shape, (2,))
        if stored.tolist() != [rows, cols]:
            raise ValueError(f"{module}.weight_shape: {stored.tolist()}, the model's layer is [{rows}, {cols}]")
        q = unpack(tensors.sized(name, shape, (rows, -(-cols * bits // 32)), torch.int32), bits, 1)[:, :cols]
        if zero_name in tensors:
            zeros = tensors.sized(zero_name, shape, (-(-rows * bits // 32), scale.shape[1]), torch.int32)
            zero = unpack(zeros, bits, 0)[:rows]
        else:
            zero = torch.full(scale.shape, 1 << (bits - 1))
    else:  # int-quantized: signed int8 weights as they are
        name, bits = f"{module}.weight", 8
        q = tensors.sized(name, shape, (rows, cols), torch.int8).int() + 128
        zero = tensors.sized(zero_name, shape, scale.shape, torch.int8).int() + 128 if zero_name in tensors else \
            torch.full(scale.shape, 128)
    return to_blocks(q, zero, scale, bits, name)


def _compressed_config(config: dict[str, Any]) -> dict[str, Any]:
    """The one weight scheme a compressed-tensors config's groups share; refusals name the field."""
    fmt = config.get("format")
    if fmt not in ("pack-quantized", "int-quantized", "naive-quantized"):
        raise ValueError(f"quantization_config.format {fmt!r} is not read (pack-quantized, int-quantized)")
    schemes = []
    for group, scheme in (config.get("config_groups") or {}).items():
        if scheme.get("input_activations"):
            raise ValueError(f"quantization_config.config_groups.{group}.input_activations: activations are "
                             "computed in float here (weight-only schemes: W4A16, W8A16)")
        weights = scheme.get("weights") or {}
        if weights.get("type", "int") != "int":
            raise ValueError(f"quantization_config.config_groups.{group}.weights.type {weights.get('type')!r}: "
                             "integer weights only")
        if weights.get("strategy", "group") not in ("group", "channel", "tensor"):
            raise ValueError(f"quantization_config.config_groups.{group}.weights.strategy "
                             f"{weights.get('strategy')!r} is not read (group, channel, tensor)")
        schemes.append(_bits(weights.get("num_bits"), f"config_groups.{group}.weights.num_bits"))
    if len(set(schemes)) != 1:
        raise ValueError("quantization_config.config_groups: one weight bit width for every group is read, "
                         f"got {schemes or 'none'}")
    return {"bits": schemes[0]}


READERS: dict[str, Callable[[_Tensors, str, tuple[int, int], dict[str, Any]], BlockWeight]] = {
    "awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed}
# The tensor whose name marks a quantized linear layer, per method (compressed-tensors' int-quantized: an int8
# ``weight`` beside a ``weight_scale``).
MARKERS = {"awq": (".qweight",), "gptq": (".qweight",), "compressed-tensors": (".weight_packed", ".weight_scale")}


def _quantized_modules(tensors: _Tensors, method: str) -> list[str]:
    found = set()
    for key in tensors.file_of:
        for marker in MARKERS[method]:
            if key.endswith(marker):
                found.add(key.removesuffix(marker))
    return sorted(found)


def load_packed_model(folder: str | Path, device: torch.device, dtype: torch.dtype,
                      trust_remote_code: bool = False) -> torch.nn.Module:
    """The causal LM in ``folder`` (an AWQ, GPTQ or compressed-tensors checkpoint) on ``device``, its float tensors
    in ``dtype`` and its quantized linear layers computing from their packed integers (``use_blocks``). Raises
    ``ValueError`` naming the tensor or the config field it cannot read."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    folder = Path(folder)
    method = checkpoint_method(folder)
    if method is None:
        raise ValueError(f"{folder}: no quantization_config in config.json")
    check_block_kernels(device, method)
    raw = dict(_quantization_config(folder))
    if method == "awq" and str(raw.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"quantization_config.version {raw['version']!r}: AWQ's gemm layout is read")
    if method == "awq" and not raw.get("zero_point", True):
        raise ValueError("quantization_config.zero_point false: AWQ is read with zero points")
    settings = _compressed_config(raw) if method == "compressed-tensors" else raw
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    del config.quantization_config
    with no_init_weights():  # every weight is read from the checkpoint or replaced by blocks
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa",
                                                 trust_remote_code=trust_remote_code)
    tensors = _Tensors(folder)
    modules = _quantized_modules(tensors, method)
    layers = dict(model.named_modules())
    linears = {}
    for module in modules:
        if not isinstance(layers.get(module), torch.nn.Linear):
            raise ValueError(f"{module}: quantized weights the model has no linear layer for")
        linears[module] = READERS[method](tensors, module, tuple(layers[module].weight.shape), settings)
    floats = {key: tensors[key] for key in tensors.file_of if key not in tensors.read}
    quantized_weights = {f"{module}.weight" for module in modules}
    missing, unexpected = model.load_state_dict(floats, strict=False)
    if unexpected:
        raise ValueError(f"{unexpected[0]}: a tensor the model has no parameter for ({method} checkpoint)")
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if left := sorted(set(missing) - quantized_weights - tied):
        raise ValueError(f"{left[0]}: missing from the checkpoint")
    moved = use_blocks(model, linears, device)  # first: the float weights it frees never reach the device
    model.to(device=device, dtype=dtype)
    log.info("%s checkpoint: %d linear layers multiplied from their packed integers", method, moved)
    return model.eval()
