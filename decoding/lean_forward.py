"""A draft's forward as one loop over its layers (gpt-fast style), for Llama-architecture drafts.

A batch-1 draft forward of the int4 twin of SmolLM2-135M (30 layers) cost 21.3 ms, of which 8.5 ms was Python
in transformers' forward around the kernels (decorators, keyword plumbing, output capture, module hooks) and
a further few ms small tensor ops it spends per layer (torch.profiler over 40 draft forwards, this project's
CPU). The kernels themselves (int4 GEMMs, attention, int8 head) took under 7 ms. This loop calls the same
modules' kernels with nothing around them, and a quantized twin's fused q|k|v and gate|up kernels directly, fed
bf16 (no cast back and forth around each kernel), with rotary over the query and key heads in one pass: 16.8 ->
15.8 ms at 64 cached tokens (transformers' forward of the same twin: 18.7-19.2 ms, same process).

Only for drafts: its numbers may differ from transformers' in the last float bits (RMSNorm through torch's
fused ``rms_norm``), which changes nothing about what the engine outputs (verification accepts against the
law the draft actually drafted from), but the target always runs transformers' own forward, so greedy outputs
equal transformers' decoding exactly.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaRMSNorm

from decoding import compiled_layers
from decoding.kv_cache import SlotKVCache
from decoding.models import attention_function
from decoding.quantize import ACTIVATION_DTYPE, fused_kernel, int4_parts, is_weight_only


@dataclass
class LeanOutput:
    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor] | None


def lean_view(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with the lean forward where it supports it (its layers compiled where decoding.compiled_layers
    can), else ``model``. One view per model: engines sharing a draft share its view, and so the forward costs
    measured on it."""
    if not supports_lean_forward(model):
        return model
    if model not in _lean_views:
        _lean_views[model] = LeanLlama(model, compile_layers=True)
    return _lean_views[model]


def supports_lean_forward(model: torch.nn.Module) -> bool:
    """A plain Llama causal LM (SmolLM2 and most Llama-family checkpoints); others keep transformers' forward."""
    if not isinstance(model, LlamaForCausalLM):
        return False
    base = model.model
    return (
        all(type(layer) is LlamaDecoderLayer for layer in base.layers)
        and all(type(norm) is LlamaRMSNorm for norm in [base.norm, *(layer.input_layernorm for layer in base.layers),
                                                         *(layer.post_attention_layernorm for layer in base.layers)])
        and getattr(model.config, "pretraining_tp", 1) == 1
    )


def _rms_norm(norm: LlamaRMSNorm, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


@dataclass
class _Projections:
    """One layer's input projections as single calls (q|k|v and gate|up side by side) and the dtype its linears
    read: a quantized twin's kernels take bf16 and return it, so feeding them bf16 casts nothing twice."""

    qkv: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    dtype: torch.dtype | None  # None: the hidden states' own
    query_heads: int
    rotated_heads: int  # query and key heads, rotated together

    @classmethod
    def of(cls, layer: LlamaDecoderLayer) -> _Projections:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        return cls(
            _side_by_side([attn.q_proj, attn.k_proj, attn.v_proj]), _side_by_side([mlp.gate_proj, mlp.up_proj]),
            ACTIVATION_DTYPE if all(is_weight_only(m) for m in linears) else None,
            attn.q_proj.out_features // attn.head_dim,
            (attn.q_proj.out_features + attn.k_proj.out_features) // attn.head_dim,
        )


def _side_by_side(modules: list[torch.nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
    kernel = fused_kernel(modules)
    if kernel is not None:
        return kernel
    return lambda x: torch.cat([module(x) for module in modules], -1)


_lean_views: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


class LeanLlama(torch.nn.Module):
    """``model``'s forward as forward_tree calls it, over ``model``'s own modules (nothing copied)."""

    def __init__(self, model: LlamaForCausalLM, compile_layers: bool = False) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config
        self.attention = attention_function(model.config)
        self.projections = [_Projections.of(layer) for layer in model.model.layers]
        self.compiled: compiled_layers.CompiledLayers | None = None
        self.layer_inputs: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = []
        if compile_layers and compiled_layers.enabled():
            self._compile_layers()

    def _compile_layers(self) -> None:
        """Compiled layer graphs, where every layer is plain int4 on a CPU with SiLU gating (the quantized twin
        of a Llama model); else the eager loop stays."""
        base = self.inner.model
        if getattr(self.config, "hidden_act", None) != "silu":
            return
        inputs, groupsizes = [], set()
        for layer, projections in zip(base.layers, self.projections):
            attn, mlp = layer.self_attn, layer.mlp
            parts = [int4_parts(projections.qkv), int4_parts(vars(attn.o_proj).get("forward")),
                     int4_parts(projections.gate_up), int4_parts(vars(mlp.down_proj).get("forward"))]
            if any(part is None for part in parts):
                return
            (qkv, qkv_scales, _), (o, o_scales, _), (gate_up, gate_up_scales, _), (down, down_scales, _) = parts
            groupsizes |= {part[2] for part in parts}
            inputs.append(((layer.input_layernorm.weight, qkv, qkv_scales),
                           (o, o_scales, layer.post_attention_layernorm.weight, gate_up, gate_up_scales, down,
                            down_scales)))
        first = base.layers[0]
        norms = [norm for layer in base.layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        if len(groupsizes) != 1 or len({norm.variance_epsilon for norm in norms}) != 1:
            return
        shape = compiled_layers.LayerShape(
            hidden=self.config.hidden_size, head_dim=first.self_attn.head_dim,
            query_heads=self.projections[0].query_heads,
            kv_heads=self.projections[0].rotated_heads - self.projections[0].query_heads,
            intermediate=first.mlp.gate_proj.out_features, groupsize=groupsizes.pop(),
            eps=first.input_layernorm.variance_epsilon,
        )
        # Distinct example tensors (one passed twice would be traced as one aliased input), drawn from no
        # generator (a seeded caller's random stream stays as it was).
        hidden, attended = torch.zeros(2, shape.hidden), torch.zeros(2, shape.hidden)
        cos, sin = torch.zeros(2, shape.head_dim), torch.zeros(2, shape.head_dim)
        examples = ((hidden, *inputs[0][0], cos, sin), (hidden, attended, *inputs[0][1]))
        self.compiled = compiled_layers.compiled_layers(shape, examples)
        if self.compiled is not None:
            self.layer_inputs = inputs

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.inner.get_output_embeddings()

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache: SlotKVCache,
        use_cache: bool = True, output_hidden_states: bool = False, logits_to_keep: torch.Tensor | int = 0,
    ) -> LeanOutput:
        del use_cache  # always: the slot cache is written and read
        base = self.inner.model
        hidden = base.embed_tokens(input_ids)
        cos, sin = base.rotary_emb(hidden, position_ids)
        # Rotary as x * cos + roll(x) * sin', sin' = sin with its first half negated: rotate_half(x) * sin in
        # two ops instead of four, over the query and key heads at once (43 -> ~15 us of a layer's ~550).
        half = cos.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), -1)
        if self.compiled is not None:
            hidden = self._compiled_layers(hidden, cos, sin, attention_mask, cache)
        else:
            hidden = self._eager_layers(hidden, cos, sin, attention_mask, cache)
        hidden = _rms_norm(base.norm, hidden)
        if isinstance(logits_to_keep, torch.Tensor):
            kept = hidden[:, logits_to_keep]
        else:
            kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        return LeanOutput(self.inner.lm_head(kept), (hidden,) if output_hidden_states else None)

    def _compiled_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         attention_mask: torch.Tensor, cache: SlotKVCache) -> torch.Tensor:
        batch, length, width = hidden.shape
        hidden, cos, sin = hidden.reshape(-1, width), cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
        for index, (layer, projections, (before, after)) in enumerate(
                zip(self.inner.model.layers, self.projections, self.layer_inputs)):
            attn = layer.self_attn
            q_and_k, v = self.compiled.before_attention(hidden, *before, cos, sin)
            q_and_k = q_and_k.view(batch, length, -1, attn.head_dim).transpose(1, 2)
            v = v.view(batch, length, -1, attn.head_dim).transpose(1, 2)
            q, k = q_and_k[:, :projections.query_heads], q_and_k[:, projections.query_heads:]
            k, v = cache.layers[index].update(k, v)
            out, _ = self.attention(attn, q, k, v, attention_mask, scaling=attn.scaling)
            hidden = self.compiled.after_attention(hidden, out.reshape(-1, width), *after)
        return hidden.view(batch, length, width)

    def _eager_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      attention_mask: torch.Tensor, cache: SlotKVCache) -> torch.Tensor:
        batch, length, _ = hidden.shape
        half = cos.shape[-1] // 2
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        for index, (layer, projections) in enumerate(zip(self.inner.model.layers, self.projections)):
            attn, mlp = layer.self_attn, layer.mlp
            dtype = projections.dtype or hidden.dtype
            x = _rms_norm(layer.input_layernorm, hidden).to(dtype)
            heads = projections.qkv(x).to(hidden.dtype).unflatten(-1, (-1, attn.head_dim)).transpose(1, 2)
            query_heads, rotated = projections.query_heads, projections.rotated_heads
            q_and_k = heads[:, :rotated]
            q_and_k = torch.addcmul(q_and_k * cos, q_and_k.roll(half, -1), sin)
            q, k = q_and_k[:, :query_heads], q_and_k[:, query_heads:]
            k, v = cache.layers[index].update(k, heads[:, rotated:])
            out, _ = self.attention(attn, q, k, v, attention_mask, scaling=attn.scaling)
            hidden = hidden + attn.o_proj(out.reshape(batch, length, -1).to(dtype))  # the sum in hidden's dtype
            x = _rms_norm(layer.post_attention_layernorm, hidden).to(dtype)
            gate, up = projections.gate_up(x).to(hidden.dtype).chunk(2, -1)
            hidden = hidden + mlp.down_proj((mlp.act_fn(gate) * up).to(dtype))
        return hidden
