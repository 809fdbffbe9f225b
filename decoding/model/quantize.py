"""Weight-only quantization of a draft (``speculative.quantization: int4 | int8``).

A quantized copy of a model reads its linear layers through torch's weight-only kernels, the path gpt-fast uses:
int4 groupwise (``aten._weight_int4pack_mm_for_cpu`` on CPU, ``aten._weight_int4pack_mm`` on CUDA) and int8 per
output channel (``aten._weight_int8pack_mm``). Everything else (embeddings, norms, attention) is the original
module's, shared, not copied. The source model is left exactly as loaded: with ``speculative.model: target`` the
target verifies in full precision and only its quantized twin drafts, so outputs stay those of the target.

Why it drafts well for the default model: SmolLM2-135M-Instruct ships as a Q4_1 GGUF (blocks of 32 input
weights, ``w = d * q + m``), and int4 groupsize 32 with an asymmetric (min, scale) per group is the same grid,
so quantizing the converted weights again loses next to nothing.
"""

from __future__ import annotations

import copy
import functools
import itertools
import weakref
from collections.abc import Callable
from typing import Literal

import torch

Scheme = Literal["int4", "int8"]
# One quantized twin per (model, scheme, groupsize): engines sharing a target share its draft's packed weights.
_twins: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, torch.nn.Module]] = weakref.WeakKeyDictionary()


def int4_groupwise(
    weight: torch.Tensor, groupsize: int, param_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] int32 in 0..15, scales_and_zeros [K / groupsize, N, 2]) with w ~ (q - 8) * scale + zero.

    Asymmetric per group: scale = (max - min) / 15, zero = min + 8 * scale (the layout the int4 kernels read).
    """
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // groupsize, groupsize)
    low = groups.amin(-1, keepdim=True)
    high = groups.amax(-1, keepdim=True)
    # The kernels read scale and zero in bf16: round them first, then place each weight on the grid they make.
    scale = ((high - low) / 15).clamp(min=1e-12).to(param_dtype).float()
    zero = (low + 8 * scale).to(param_dtype).float()
    q = ((groups - zero) / scale + 8).round().clamp(0, 15).to(torch.int32).reshape(rows, cols)
    scales_and_zeros = torch.cat([scale, zero], -1).permute(1, 0, 2).contiguous()  # [K / g, N, 2]
    return q, scales_and_zeros


def int8_per_channel(
    weight: torch.Tensor, param_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] int8, scales [N]) with w ~ q * scale, symmetric per output channel."""
    scale = (weight.float().abs().amax(-1) / 127).clamp(min=1e-12).to(param_dtype).float()
    q = (weight.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def int4_fits(weight: torch.Tensor, groupsize: int) -> bool:
    """Whether the int4 kernels take this [N, K] weight: the CPU packing wants N % 16 == 0, both want whole groups
    along K; the CUDA packing tiles K by 128 (gpt-fast's constraint; not run here: no GPU in this project's CI)."""
    rows, cols = weight.shape
    tile = 128 if weight.device.type == "cuda" else groupsize
    return rows % 16 == 0 and cols % groupsize == 0 and cols % tile == 0


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, groupsize: int) -> torch.Tensor:
    """``x @ w.T`` for an int4-packed ``w`` (x [..., K]; returns x's dtype)."""
    flat = x.reshape(-1, x.shape[-1]).to(scales_and_zeros.dtype)
    if flat.device.type == "cpu":
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, groupsize, scales_and_zeros)
    else:
        out = torch.ops.aten._weight_int4pack_mm(flat, packed, groupsize, scales_and_zeros)
    return out.to(x.dtype).reshape(*x.shape[:-1], -1)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for an int8 per-channel ``w`` (x [..., K]; returns x's dtype)."""
    flat = x.reshape(-1, x.shape[-1]).to(scales.dtype)
    return torch.ops.aten._weight_int8pack_mm(flat, q, scales).to(x.dtype).reshape(*x.shape[:-1], -1)


def _int4_linear(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, groupsize: int, bias: torch.Tensor | None,
    x: torch.Tensor,
) -> torch.Tensor:
    out = int4_matmul(x, packed, scales_and_zeros, groupsize)
    return out + bias if bias is not None else out


def _int8_linear(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    out = int8_matmul(x, q, scales)
    return out + bias if bias is not None else out


# The kernels' activations: torch 2.13's CPU int4/int8 kernels are fast only for bf16 inputs (one 576 x 1536
# layer, one row, one thread: int4 67 us with bf16, 1794 us with float32, 1857 us with float16; the float32 layer
# prepacked for oneDNN: 87 us). A kernel returns its input's dtype: given bf16, it casts nothing.
ACTIVATION_DTYPE = torch.bfloat16


def _kernel(
    weight: torch.Tensor, bias: torch.Tensor | None, scheme: Scheme, groupsize: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x @ weight.T + bias`` through a weight-only kernel (the float ``weight`` is only read)."""
    dtype = ACTIVATION_DTYPE
    if scheme == "int8" or not int4_fits(weight, groupsize):  # a shape the int4 kernels cannot take: int8
        q, scales = int8_per_channel(weight)
        return functools.partial(_int8_linear, q, scales.to(dtype), bias)
    q, scales_and_zeros = int4_groupwise(weight, groupsize)
    if weight.device.type == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    else:  # the CUDA kernel packs two int4 per byte, tiled
        packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
    return functools.partial(_int4_linear, packed, scales_and_zeros.to(dtype), groupsize, bias)


def quantize_linear(module: torch.nn.Linear, scheme: Scheme, groupsize: int = 32, exact_top: int = 0) -> None:
    """Make ``module`` (a copy the caller owns) compute through a weight-only kernel; its float weight stays
    shared with the source model, never modified. ``exact_top`` > 0: the largest ``exact_top`` outputs of each
    row are computed again with the float weight (``_exact_top_linear``), for an LM head."""
    kernel = _kernel(module.weight.detach(), module.bias, scheme, groupsize)
    if exact_top:
        kernel = functools.partial(_exact_top_linear, kernel, module.weight.detach(), module.bias, exact_top)
    module.forward = kernel


def _exact_top_linear(
    kernel: Callable[[torch.Tensor], torch.Tensor], weight: torch.Tensor, bias: torch.Tensor | None, top: int,
    x: torch.Tensor,
) -> torch.Tensor:
    """``kernel(x)`` with each row's ``top`` largest outputs recomputed from the float ``weight``.

    Why, for a draft's LM head: the head is a third of an int4 self-draft's bytes, and an int4 head alone drafts
    worse (greedy agreement with the float target 0.90 / 0.94 / 0.89 on chat / code / news against 0.98 / 0.99 /
    0.98 with an int8 head, SmolLM2-135M, 8 held-out prompts each, same int4 layers). Reading the int4 head and
    rescoring its top 8 with the float rows (8 x 576 weights a row) agrees 0.98 / 0.99 / 0.98, as the int8 head
    does, for the int4 head's cost (0.78 against ~2 ms a draft token at one row). The result is still one
    deterministic function of ``x``, so a law drafted from it is verified exactly like any other draft's."""
    logits = kernel(x)
    chosen = logits.topk(min(top, logits.shape[-1]), -1).indices
    exact = (weight[chosen] @ x.to(weight.dtype)[..., None]).squeeze(-1)
    if bias is not None:
        exact = exact + bias[chosen]
    return logits.scatter(-1, chosen, exact.to(logits.dtype))


# Linears of one block that read the same input, by their names in Llama-family models (Qwen, Mistral, ...).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedSiblings:
    """Sibling linears (q/k/v, gate/up) run as one kernel call over their concatenated weights.

    The first sibling called computes every sibling's output for its input; the others, called with that same
    tensor, take theirs. A sibling called with another input (a model that does not share it) computes again:
    never wrong, only slower. Row-wise quantization makes the fused weights the separate ones, exactly.
    Why: a decode step of the int4 twin is mostly per-call overhead (7 calls of tens of microseconds per layer).
    """

    def __init__(self, modules: list[torch.nn.Linear], kernel: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``kernel``: computes the modules' outputs side by side (their weights' rows one after the other)."""
        self.kernel = kernel
        self.sizes = [m.out_features for m in modules]
        self.input: torch.Tensor | None = None
        self.outputs: dict[int, torch.Tensor] = {}
        for index, module in enumerate(modules):
            module.forward = functools.partial(self.forward, index)

    def forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self.input or index not in self.outputs:
            self.input = x
            self.outputs = dict(enumerate(self.kernel(x).split(self.sizes, -1)))
        out = self.outputs.pop(index)
        if not self.outputs:
            self.input = None  # release the input once every sibling has its output
        return out


def siblings_bias(modules: list[torch.nn.Linear]) -> torch.Tensor | None:
    """The biases of ``modules`` side by side (a missing one: zeros); None where none has one."""
    if all(m.bias is None for m in modules):
        return None
    like = next(m.bias for m in modules if m.bias is not None)
    return torch.cat([m.bias.detach() if m.bias is not None else like.new_zeros(m.out_features) for m in modules])


def siblings_weight(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of ``modules`` side by side."""
    return torch.cat([m.weight.detach() for m in modules]), siblings_bias(modules)


def fused_kernel(modules: list[torch.nn.Module]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The one kernel computing ``modules``' outputs side by side (``x -> cat([m(x) for m in modules], -1)``),
    when they are exactly one FusedSiblings group in its order; else None."""
    owners = [getattr(getattr(m.forward, "func", None), "__self__", None) for m in modules]
    first = owners[0]
    if not isinstance(first, FusedSiblings) or any(owner is not first for owner in owners):
        return None
    if [m.forward.args for m in modules] != [(index,) for index in range(len(first.sizes))]:
        return None
    return first.kernel


def kernel_parts(
    kernel: Callable[[torch.Tensor], torch.Tensor] | None,
) -> tuple[Literal["int4", "int8", "blocks"], tuple[torch.Tensor, ...], int, torch.Tensor | None] | None:
    """(scheme, its weight tensors, groupsize, bias) of a weight-only kernel, GGUF blocks' included (their
    "groupsize": bits a weight; tensors q, d and m, where the type stores m); None for anything else."""
    from decoding.model.gguf_blocks import block_linear

    if not isinstance(kernel, functools.partial):
        return None
    if kernel.func is block_linear:
        q, d, m, bits, bias = kernel.args
        return "blocks", (q, d) if m is None else (q, d, m), bits, bias
    if kernel.func is _int4_linear:
        packed, scales_and_zeros, groupsize, bias = kernel.args
        return "int4", (packed, scales_and_zeros), groupsize, bias
    if kernel.func is _int8_linear:
        q, scales, bias = kernel.args
        return "int8", (q, scales), 0, bias
    return None


def is_weight_only(module: torch.nn.Module) -> bool:
    """Whether ``module`` computes through torch's weight-only kernels (bf16 activations), alone or in a
    FusedSiblings group."""
    forward = vars(module).get("forward")
    owner = getattr(getattr(forward, "func", None), "__self__", None)
    kernel = owner.kernel if isinstance(owner, FusedSiblings) else forward
    return isinstance(kernel, functools.partial) and kernel.func in (_int4_linear, _int8_linear)


def _sibling_groups(parent: torch.nn.Module) -> list[list[torch.nn.Linear]]:
    children = dict(parent.named_children())
    groups = []
    for names in SIBLINGS:
        members = [children.get(name) for name in names]
        if all(isinstance(m, torch.nn.Linear) for m in members) and len({m.in_features for m in members}) == 1:
            groups.append(members)
    return groups


def quantized(
    model: torch.nn.Module, scheme: Scheme, groupsize: int = 32, head: Scheme | None = "int4", exact_top: int = 8
) -> torch.nn.Module:
    """A twin of ``model`` whose linear layers run weight-only quantized (``head``: the LM head's scheme, None
    keeps it float; ``exact_top``: how many of a quantized head's largest logits are recomputed in float).

    On SmolLM2-135M-Instruct (``python -m jobs.eval_self_draft``, 4 + 4 + 4 chat/HumanEval/XSum prompts, one
    thread, 256 cached tokens), greedy agreement with the float target / decode forward cost vs the target's:
    int4 g32 + int8 head 0.98 / 0.98 / 0.97 at 0.39; int4 g32 + int4 head 0.90 / 0.95 / 0.85 at 0.35; int4 g64 +
    int8 head 0.74 / 0.88 / 0.73 (off the GGUF's 32-weight blocks); int8 + int8 head 0.97 / 0.97 / 0.95 at 0.53.
    The default int4 head with its top 8 exact drafts as the int8 head does for the int4 head's cost
    (``_exact_top_linear``).

    Modules and config are copied, parameters and buffers shared: the twin costs only its quantized weights.
    """
    key = (scheme, groupsize, head, exact_top)
    twins = _twins.setdefault(model, {})
    if key in twins:
        return twins[key]
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    twin = copy.deepcopy(model, shared)
    output = twin.get_output_embeddings() if hasattr(twin, "get_output_embeddings") else None
    for parent in twin.modules():
        for group in _sibling_groups(parent):
            FusedSiblings(group, _kernel(*siblings_weight(group), scheme, groupsize))
    for module in twin.modules():
        if isinstance(module, torch.nn.Linear) and module is not output and "forward" not in vars(module):
            quantize_linear(module, scheme, groupsize)
    if output is not None and head is not None:
        quantize_linear(output, head, groupsize, exact_top)
    twins[key] = twin
    return twin
