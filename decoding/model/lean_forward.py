"""The one lean forward of target and draft for the Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM).

gpt-fast style: one loop over the layers calling the kernels directly, over a flat batch of tokens (every row's
nodes one after the other, no padding rows), with attention over the paged cache (``attention.py``). It reads the
transformers model's own modules and weights as loaded (nothing copied, nothing changed), including a quantized
twin's weight-only kernels (``quantize.py``), whose q|k|v and gate|up run as one kernel call each.

How a forward runs is the engine's ``execution.Execution``, passed with every forward: on a CPU the decoder layers
run as one graph compiled ahead of time (``compiled_forward.py``; the eager loop spends most of a small model's step
in Python and dispatch), with the C++ attention kernel; on CUDA the fused Triton layer (``triton_kernels.py``,
``fused_stack``), which the model's runner replays as CUDA graphs (``model_runner.py``). ``compile: off``, or a
compilation that fails, keeps the eager loop: the same function, only slower.

Numerics: fused and compiled operations may round differently from transformers' in the last bits; the tests hold
greedy outputs to transformers' ``generate`` except at near-ties.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from transformers.activations import ACT2FN

from decoding.model.attention import (
    AttentionMetadata,
    DenseLayout,
    cpu_kernel,
    dense_layout,
    forget_linear_weights,
    kernel_loaded,
    pack_linear_weights,
    packs,
    paged_attention,
    pools_zero_filled,
)
from decoding.model.compiled_forward import compiled_stack
from decoding.model.execution import Execution, Kernels
from decoding.model.gguf_blocks import multiply_blocks
from decoding.model.lora import GROUPS, LoraBatch
from decoding.model.quantize import (
    ACTIVATION_DTYPE,
    fused_kernel,
    int4_matmul,
    int8_matmul,
    is_weight_only,
    kernel_parts,
)

log = logging.getLogger(__name__)

LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_views: weakref.WeakKeyDictionary[nn.Module, LeanCausalLM] = weakref.WeakKeyDictionary()


def supports_lean_forward(model: nn.Module) -> bool:
    """A causal LM of the Llama family with the standard decoder layer (no sliding window shorter than the
    context); others keep transformers' forward."""
    config = getattr(model, "config", None)
    base = getattr(model, "model", None)
    if config is None or base is None or getattr(config, "model_type", None) not in LEAN_MODEL_TYPES:
        return False
    if getattr(config, "pretraining_tp", 1) != 1 or not hasattr(base, "rotary_emb"):
        return False
    for layer in base.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return False
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return False
        window = getattr(attn, "sliding_window", None)
        if window is not None and window < config.max_position_embeddings:
            return False
    return True


def lean_view(model: nn.Module) -> nn.Module:
    """``model``'s lean forward where it has one (one view per model, shared by the engines built on it), else
    ``model`` (transformers' forward runs it)."""
    if not supports_lean_forward(model):
        return model
    if model not in _views:
        _views[model] = LeanCausalLM(model)
    return _views[model]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm, formula for formula."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


@dataclass(frozen=True)
class Projection:
    """How a linear projection computes: float weights (``F.linear``), a weight-only kernel (``quantize.py``) or
    a GGUF file's blocks (``gguf_blocks.py``; ``bits`` a weight). Its tensors are passed to the layer function as
    inputs, so one compiled graph serves every layer."""

    kind: Literal["float", "int4", "int8", "blocks"]
    groupsize: int = 0
    bias: bool = False
    bits: int = 0
    offset: bool = False  # blocks: whether they store m (w = d q + m), a third tensor

    def apply(self, x: torch.Tensor, tensors: list[torch.Tensor], packed: bool = False, triton: bool = False
              ) -> torch.Tensor:
        """``packed``: float weights may run their oneDNN-packed copies (the CPU kernels' execution); ``triton``:
        blocks go through the Triton GEMM (the fused layer's execution) instead of the C++ kernel."""
        bias = tensors[-1] if self.bias else None
        if self.kind == "float":
            if packed and packs(tensors[0]):  # the weight's oneDNN-packed copy
                return torch.ops.specbatch.packed_linear(x, tensors[0], bias)
            return nn.functional.linear(x, tensors[0], bias)
        if self.kind == "blocks":  # q, d and m (None where the blocks have none)
            out = multiply_blocks(x, tensors[0], tensors[1], tensors[2] if self.offset else None, self.bits, triton)
        elif self.kind == "int4":
            out = int4_matmul(x, tensors[0], tensors[1], self.groupsize)
        else:
            out = int8_matmul(x, tensors[0], tensors[1])
        return out + bias if bias is not None else out

    @property
    def count(self) -> int:
        weights = {"float": 1, "int4": 2, "int8": 2, "blocks": 2 + self.offset}[self.kind]
        return weights + self.bias

    @classmethod
    def of(cls, modules: list[nn.Module], fused: Callable | None) -> tuple[Projection, list[torch.Tensor]]:
        """The projection computing ``modules``' outputs side by side, and its tensors. Float weights of several
        modules are concatenated once here (a copy: one GEMM instead of several per layer)."""
        kernel = fused if fused is not None else (vars(modules[0]).get("forward") if len(modules) == 1 else None)
        parts = kernel_parts(kernel) if kernel is not None else None
        if parts is not None:
            kind, tensors, groupsize, bias = parts
            projection = (cls(kind, bias=bias is not None, bits=groupsize, offset=len(tensors) == 3)
                          if kind == "blocks"
                          else cls(kind, groupsize, bias is not None))
            return projection, [*tensors, *([bias] if bias is not None else [])]
        if not all(type(m) is nn.Linear for m in modules):
            raise TypeError("not a plain or weight-only linear")
        weight = modules[0].weight if len(modules) == 1 else torch.cat([m.weight for m in modules]).detach()
        if all(m.bias is None for m in modules):
            return cls("float"), [weight]
        bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in modules])
        return cls("float", bias=True), [weight, bias.detach()]


@dataclass(frozen=True)
class LayerSpec:
    """What is the same in every decoder layer: the compiled layer function's constants."""

    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    qk_norm: bool  # Qwen3: RMSNorm over each head's query and key before the rotary
    eps: float
    scale: float
    act: str
    head_dim: int
    q_heads: int
    kv_heads: int
    kernel_dtype: torch.dtype | None  # a quantized twin's kernels take bf16; None: the hidden states' dtype


def _layer_tensors(layer: nn.Module, act: str) -> tuple[LayerSpec, list[torch.Tensor]]:
    attn, mlp = layer.self_attn, layer.mlp
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    qkv, qkv_tensors = Projection.of(linears[:3], fused_kernel(linears[:3]))
    o, o_tensors = Projection.of([attn.o_proj], None)
    gate_up, gate_up_tensors = Projection.of(linears[4:6], fused_kernel(linears[4:6]))
    down, down_tensors = Projection.of([mlp.down_proj], None)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    spec = LayerSpec(
        qkv=qkv, o=o, gate_up=gate_up, down=down, qk_norm=q_norm is not None,
        eps=layer.input_layernorm.variance_epsilon, scale=attn.scaling, act=act,
        head_dim=attn.head_dim, q_heads=attn.q_proj.out_features // attn.head_dim,
        kv_heads=attn.k_proj.out_features // attn.head_dim,
        kernel_dtype=ACTIVATION_DTYPE if all(is_weight_only(m) for m in linears) else None,
    )
    norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    if q_norm is not None:
        norms += [q_norm.weight, k_norm.weight]
    return spec, [t.detach() for t in (*norms, *qkv_tensors, *o_tensors, *gate_up_tensors, *down_tensors)]


@dataclass(frozen=True)
class LayerWeights:
    """One layer's tensors, in the order ``_layer_tensors`` lists them."""

    norm1: torch.Tensor
    norm2: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: list[torch.Tensor]
    o: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]

    @classmethod
    def of(cls, spec: LayerSpec, weights: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> LayerWeights:
        norm1, norm2, *rest = weights
        q_norm = k_norm = None
        if spec.qk_norm:
            q_norm, k_norm, *rest = rest
        qkv, rest = rest[: spec.qkv.count], rest[spec.qkv.count :]
        o, rest = rest[: spec.o.count], rest[spec.o.count :]
        return cls(norm1, norm2, q_norm, k_norm, qkv, o, rest[: spec.gate_up.count], rest[spec.gate_up.count :])


def _adapted(out: torch.Tensor, lora: LoraBatch | None, group: str, layer: int, x: torch.Tensor,
             cpu_kernels: bool = False) -> torch.Tensor:
    """A projection's output ``out`` (in the hidden states' dtype) plus each token's adapter delta, if any
    (``cpu_kernels``: by the per-token C++ kernel, ``LoraBatch.delta``)."""
    delta = lora.delta(group, layer, x, per_token=cpu_kernels and kernel_loaded()) if lora is not None else None
    return out if delta is None else out + delta.to(out.dtype)


def decoder_layer(
    spec: LayerSpec, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
    block_tables: torch.Tensor, row_starts: torch.Tensor, prefix_len: torch.Tensor, tree_mask: torch.Tensor,
    max_keys: int, keys: torch.Tensor, values: torch.Tensor, *weights: torch.Tensor,
    layout: DenseLayout | None = None, cpu_kernels: bool = True, lora: LoraBatch | None = None, layer: int = 0,
) -> torch.Tensor:
    """One decoder layer over flat tokens ``hidden`` [N, H] (the unit that is compiled). ``layout``: the reference
    attention's per-forward part (``attention.dense_layout``), where the kernel does not run; ``cpu_kernels``: the
    C++ attention kernel and packed weights run (else the reference); ``lora``: the tokens' adapters, added to each
    projection in float over whatever computes it (a quantized twin's kernels too), ``layer`` the pool layer."""
    w = LayerWeights.of(spec, weights)
    tokens, dtype = hidden.shape[0], spec.kernel_dtype or hidden.dtype
    x = _rms_norm(hidden, w.norm1, spec.eps).to(dtype)
    qkv = _adapted(spec.qkv.apply(x, w.qkv, cpu_kernels).to(hidden.dtype), lora, "qkv", layer, x, cpu_kernels)
    qkv = qkv.view(tokens, -1, spec.head_dim)
    q, k, v = qkv.split([spec.q_heads, spec.kv_heads, spec.kv_heads], 1)
    if w.q_norm is not None:
        q, k = _rms_norm(q, w.q_norm, spec.eps), _rms_norm(k, w.k_norm, spec.eps)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    meta = AttentionMetadata(slots, block_tables, row_starts, prefix_len, tree_mask, max_keys)
    attended = paged_attention(keys, values, q, k, v.contiguous(), meta, spec.scale, layout, cpu=cpu_kernels)
    attended = attended.reshape(tokens, -1).to(dtype)
    hidden = hidden + _adapted(spec.o.apply(attended, w.o, cpu_kernels).to(hidden.dtype), lora, "o", layer, attended,
                               cpu_kernels)
    x = _rms_norm(hidden, w.norm2, spec.eps).to(dtype)
    gate_up = spec.gate_up.apply(x, w.gate_up, cpu_kernels)
    if lora is not None:
        gate_up = _adapted(gate_up.to(hidden.dtype), lora, "gate_up", layer, x, cpu_kernels)
    gate, up = gate_up.chunk(2, -1)
    activated = (ACT2FN[spec.act](gate) * up).to(dtype)
    return hidden + _adapted(spec.down.apply(activated, w.down, cpu_kernels).to(hidden.dtype), lora, "down", layer,
                             activated, cpu_kernels)


def fused_stack(
    specs: list[LayerSpec], counts: list[int], final_eps: float, hidden: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor, prefix_len: torch.Tensor,
    tree_mask: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, weights: list[torch.Tensor],
    layers: tuple[int, ...], lora: LoraBatch | None = None,
) -> torch.Tensor:
    """The decoder layers and the final norm with the fused Triton kernels (``triton_kernels.py``), about ten
    launches a layer: add + RMSNorm, the qkv GEMM, rotary + the new keys and values into their slots, attention
    over the paged pool (and its split reduction), the o GEMM, add + RMSNorm, the gate|up GEMM, SiLU x up, the down
    GEMM (whose output the next layer's norm adds). Each row has ``N / rows`` tokens; sequence lengths are read on
    the device, so one captured graph serves every context. ``layers``: each layer's index in the pool; ``lora``: the
    tokens' adapters (``decoder_layer``'s), their deltas added to each GEMM's output."""
    from decoding.model import triton_kernels as tk  # Triton loads where this path runs (``execution.py``)

    tokens = hidden.shape[0]
    per_row = tokens // block_tables.shape[0]
    cos, sin = cos.reshape(tokens, -1), sin.reshape(tokens, -1)
    residual, delta, at = hidden, None, 0
    for index, spec, count in zip(layers, specs, counts):
        w = LayerWeights.of(spec, weights[at : at + count])
        at += count
        dtype = spec.kernel_dtype or hidden.dtype
        residual, x = tk.add_rms_norm(residual, delta, w.norm1, spec.eps)
        x = x.to(dtype)
        qkv = _adapted(spec.qkv.apply(x, w.qkv, triton=True).to(hidden.dtype), lora, "qkv", index, x)
        q = tk.rotary_write_kv(qkv, cos, sin, slots, keys[index], values[index], spec.q_heads, spec.kv_heads,
                               spec.head_dim, w.q_norm, w.k_norm, spec.eps)
        attended = tk.paged_attention(q, keys[index], values[index], block_tables, prefix_len, tree_mask, spec.scale,
                                      per_row)
        attended = attended.view(tokens, -1).to(dtype)
        o = _adapted(spec.o.apply(attended, w.o, triton=True).to(hidden.dtype), lora, "o", index, attended)
        residual, x = tk.add_rms_norm(residual, o, w.norm2, spec.eps)
        x = x.to(dtype)
        gate_up = spec.gate_up.apply(x, w.gate_up, triton=True)
        if lora is not None:
            gate_up = _adapted(gate_up.to(hidden.dtype), lora, "gate_up", index, x)
        if spec.act == "silu":
            activated = tk.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, -1)
            activated = ACT2FN[spec.act](gate) * up
        activated = activated.to(dtype)
        down = spec.down.apply(activated, w.down, triton=True)
        delta = _adapted(down.to(hidden.dtype), lora, "down", index, activated)
    return tk.add_rms_norm(residual, delta, weights[at], final_eps)[1]


class LayerStack(nn.Module):
    """The decoder layers and the final norm over flat tokens, every weight an input: the part of the forward that
    is compiled (one graph, whatever the batch; the same function runs eagerly where it is not). ``layers``: the
    pool layer each runs over (default: one after the other; a layer-skipping draft runs some of the target's
    layers over the target's pool)."""

    def __init__(self, specs: list[LayerSpec], counts: list[int], final_eps: float,
                 layers: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.specs, self.counts, self.final_eps = specs, counts, final_eps
        self.layers = layers if layers is not None else tuple(range(len(specs)))

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
        block_tables: torch.Tensor, row_starts: torch.Tensor, prefix_len: torch.Tensor, tree_mask: torch.Tensor,
        keys: torch.Tensor, values: torch.Tensor, weights: list[torch.Tensor], max_keys: int = 0,
        kernels: Kernels = "cpu", lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """``kernels``: how attention and the layer's small operations run (``execution.Execution.kernels``; the
        compiled stack is the CPU kernels'); ``lora``: the tokens' adapters (``decoder_layer``)."""
        if kernels == "triton":
            return fused_stack(self.specs, self.counts, self.final_eps, hidden, cos, sin, slots, block_tables,
                               prefix_len, tree_mask, keys, values, weights, self.layers, lora)
        layout = None
        if kernels != "cpu":  # the reference attention: its metadata part once, not per layer
            meta = AttentionMetadata(slots, block_tables, row_starts, prefix_len, tree_mask, max_keys)
            layout = dense_layout(meta, keys.shape[-1], zero_filled=pools_zero_filled(keys.device))
        at = 0
        for index, spec, count in zip(self.layers, self.specs, self.counts):
            hidden = decoder_layer(spec, hidden, cos, sin, slots, block_tables, row_starts, prefix_len, tree_mask,
                                   max_keys, keys[index], values[index], *weights[at : at + count], layout=layout,
                                   cpu_kernels=kernels == "cpu", lora=lora, layer=index)
            at += count
        return _rms_norm(hidden, weights[at], self.final_eps)


class AdaptedStack(nn.Module):
    """``stack`` with LoRA adapters of rank ``rank``: each token's adapter index and the adapter tensors are inputs
    too (``LoraBatch``'s, flat: each group's A in ``groups`` order, then each group's parts' B), so the compiled
    stack serves every set of adapters that targets ``groups``. It runs the per-token kernel (``LoraBatch.delta``):
    it is compiled only where the CPU kernels are."""

    def __init__(self, stack: LayerStack, groups: tuple[str, ...], rank: int) -> None:
        super().__init__()
        self.stack, self.groups, self.rank = stack, groups, rank
        self.specs, self.counts, self.final_eps, self.layers = stack.specs, stack.counts, stack.final_eps, stack.layers

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
        block_tables: torch.Tensor, row_starts: torch.Tensor, prefix_len: torch.Tensor, tree_mask: torch.Tensor,
        keys: torch.Tensor, values: torch.Tensor, weights: list[torch.Tensor], index: torch.Tensor,
        lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
    ) -> torch.Tensor:
        b, at = {}, 0
        for group in self.groups:
            b[group] = lora_b[at : at + len(GROUPS[group])]
            at += len(GROUPS[group])
        lora = LoraBatch(dict(zip(self.groups, lora_a)), b, None, index, self.rank)
        return self.stack(hidden, cos, sin, slots, block_tables, row_starts, prefix_len, tree_mask, keys, values,
                          weights, lora=lora)

    @staticmethod
    def inputs(lora: LoraBatch) -> list[torch.Tensor]:
        """``lora`` as the compiled adapted stack's trailing inputs."""
        groups = [group for group in GROUPS if group in lora.a]
        return [lora.index, *(lora.a[g] for g in groups), *(b for g in groups for b in lora.b[g])]


class LeanCausalLM(nn.Module):
    """``model``'s forward over the paged cache, on ``model``'s own modules and weights."""

    reads_features = False

    def __init__(self, model: nn.Module, parts: tuple[LayerStack, list[torch.Tensor], LeanCausalLM] | None = None
                 ) -> None:
        """``parts``: (stack, weights, whole) of a view running some of ``whole``'s layers (``with_layers``)."""
        super().__init__()
        self.inner = model
        self.config = model.config
        base = model.model
        if parts is None:
            layers = [_layer_tensors(layer, model.config.hidden_act) for layer in base.layers]
            self.weights = [t for _, tensors in layers for t in tensors] + [base.norm.weight.detach()]
            self.stack = LayerStack([spec for spec, _ in layers], [len(tensors) for _, tensors in layers],
                                    base.norm.variance_epsilon)
            self._whole = self
        else:
            self.stack, self.weights, self._whole = parts
        self._subsets: dict[tuple[int, ...], LeanCausalLM] = {}
        first = self.stack.specs[0]
        self.head_dim, self.q_heads, self.kv_heads = first.head_dim, first.q_heads, first.kv_heads
        self._compiled: Callable[[list[torch.Tensor]], torch.Tensor] | None = None
        self._compile_tried = False
        # The stack compiled with adapters, per set of groups they target (compiled on first use, then cached).
        self._adapted: dict[tuple[str, ...], Callable[[list[torch.Tensor]], torch.Tensor] | None] = {}
        self._packed = False
        head = model.get_output_embeddings()
        # A float head (a quantized twin's head keeps its own forward: int4 with its top logits exact).
        float_head = type(head) is nn.Linear and "forward" not in vars(head)
        self.head_weight = head.weight if float_head else None

    @property
    def num_layers(self) -> int:
        """The model's decoder layers (those of its pool), whichever of them this forward runs."""
        return len(self._whole.stack.specs)

    def with_layers(self, layers: tuple[int, ...]) -> LeanCausalLM:
        """This forward running only ``layers`` (ascending indices of the model's decoder layers) over the same pool,
        then the final norm and the head: a layer-skipping draft (SWIFT). It shares every weight and packed copy;
        one view per subset. Its entries at the positions it runs are tentative: the whole forward rewrites them."""
        whole = self._whole
        layers = tuple(layers)
        if layers == tuple(range(whole.num_layers)):
            return whole
        if not layers or list(layers) != sorted(set(layers)) or layers[-1] >= whole.num_layers or layers[0] < 0:
            raise ValueError(f"layers {list(layers)}: expected distinct ascending indices below {whole.num_layers}")
        if layers not in whole._subsets:
            stack, weights = whole.stack, []
            starts = [0, *itertools.accumulate(stack.counts)]
            for index in layers:
                weights += whole.weights[starts[index] : starts[index] + stack.counts[index]]
            subset = LayerStack([stack.specs[i] for i in layers], [stack.counts[i] for i in layers], stack.final_eps,
                                layers)
            whole._subsets[layers] = LeanCausalLM(whole.inner, (subset, [*weights, whole.weights[-1]], whole))
        return whole._subsets[layers]

    def prepare(self, execution: Execution) -> None:
        """What ``execution`` needs before the first forward, done at build: the CPU kernels' packed weights, the
        layer stack compiled (or loaded) for this machine."""
        if self._whole is not self:  # a subset's weights are the whole forward's: packed there, once
            self._whole.prepare(dataclasses.replace(execution, compile=False))
            if execution.compile:
                self.compiled()
            return
        if execution.cpu_kernel and not self._packed:
            self._packed = True
            float_weights = [w for spec_weights in self._float_weights() for w in spec_weights]
            packed = pack_linear_weights(float_weights + ([self.head_weight.detach()] if self.head_weight is not None
                                                           else []))
            weakref.finalize(self, forget_linear_weights, packed)
        if execution.compile:
            self.compiled()

    def get_output_embeddings(self) -> nn.Module:
        return self.inner.get_output_embeddings()

    def _float_weights(self) -> list[list[torch.Tensor]]:
        """Each layer's float projection weights (not biases, not norms, not quantized kernels' tensors)."""
        found, at = [], 0
        for spec, count in zip(self.stack.specs, self.stack.counts):
            tensors = self.weights[at : at + count]
            at += count
            index = 4 if spec.qk_norm else 2
            layer = []
            for projection in (spec.qkv, spec.o, spec.gate_up, spec.down):
                if projection.kind == "float":
                    layer.append(tensors[index])
                index += projection.count
            found.append(layer)
        return found

    @property
    def device(self) -> torch.device:
        return self.weights[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.weights[0].dtype

    def compiled(self) -> Callable[[list[torch.Tensor]], torch.Tensor] | None:
        """The layer stack compiled for this machine (on a CPU with the paged kernel, where compilation works),
        compiled on first use or loaded from the cache; None: the eager stack runs."""
        if not self._compile_tried:
            self._compile_tried = True
            if self.device.type == "cpu" and cpu_kernel():
                self._compiled = compiled_stack(self.stack, self.weights, self.config)
        return self._compiled

    def compiled_adapted(self, lora: LoraBatch) -> Callable[[list[torch.Tensor]], torch.Tensor] | None:
        """The layer stack compiled with adapters of ``lora``'s groups, where the plain one compiles (None: the
        eager stack runs them). The first forward with adapters of a new set of groups compiles it (about a
        minute for SmolLM2-135M on 2 cores; cached on disk for later processes)."""
        groups = tuple(group for group in GROUPS if group in lora.a)
        if groups not in self._adapted:
            self._adapted[groups] = (compiled_stack(AdaptedStack(self.stack, groups, lora.rank), self.weights,
                                                    self.config, lora)
                                     if self.compiled() is not None else None)
        return self._adapted[groups]

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, keys: torch.Tensor,
        values: torch.Tensor, logits_nodes: torch.Tensor, hidden_nodes: torch.Tensor | None, *, execution: Execution,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``input_ids``/``positions`` [B, T] (every row as many tokens); logits at each row's ``logits_nodes``
        [B * k, V] and hidden states at its ``hidden_nodes`` [B * k', H] (node indices on the host), eagerly, as
        ``execution`` (its pool's) says. A runner's ``GraphedForward`` replays the same forward."""
        batch, per_row = input_ids.shape
        device = input_ids.device
        flat = torch.arange(batch)[:, None] * per_row
        return self.flat_forward(input_ids.flatten(), positions.flatten(), meta, keys, values,
                    (flat + logits_nodes[None]).flatten().to(device, non_blocking=True),
                    (flat + hidden_nodes[None]).flatten().to(device, non_blocking=True)
                    if hidden_nodes is not None else None, execution=execution, lora=lora)

    @torch.no_grad()
    def flat_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        keys: torch.Tensor, values: torch.Tensor, logits_at: torch.Tensor | None,
        hidden_at: torch.Tensor | None = None, *, execution: Execution, lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Flat tokens [N] at ``positions`` [N]; returns (logits at ``logits_at`` [M, V], last hidden states at
        ``hidden_at`` [K, H]), each None when not asked for. ``keys``/``values``: the cache's [layers, ...] pools.
        ``lora``: the tokens' adapters (the compiled stack with adapter inputs runs them, ``compiled_adapted``)."""
        base = self.inner.model
        hidden = base.embed_tokens(input_ids)  # [N, H]
        cos, sin = base.rotary_emb(hidden, positions[None])
        cos, sin = cos[0][:, None], sin[0][:, None]  # [N, 1, D]: broadcast over heads
        inputs = [hidden, cos, sin, meta.slots, meta.block_tables, meta.row_starts, meta.prefix_len, meta.tree_mask,
                  keys, values]
        compiled = None
        if execution.compile:
            compiled = self.compiled() if lora is None else self.compiled_adapted(lora)
        if compiled is not None:
            hidden = compiled(inputs + self.weights + (AdaptedStack.inputs(lora) if lora is not None else []))
        else:
            hidden = self.stack(*inputs, self.weights, meta.max_keys, kernels=execution.kernels, lora=lora)
        logits = None
        if logits_at is not None:
            kept = hidden[logits_at]
            if self.head_weight is not None and execution.cpu_kernel and kernel_loaded():
                logits = torch.ops.specbatch.packed_linear(kept, self.head_weight.detach(), self.inner.lm_head.bias)
            else:
                logits = self.inner.lm_head(kept)
        return logits, hidden[hidden_at] if hidden_at is not None else None
