"""A draft's forward as one loop over its layers (gpt-fast style), for Llama-architecture drafts.

A batch-1 draft forward of the int4 twin of SmolLM2-135M (30 layers) cost 21.3 ms, of which 8.5 ms was Python
in transformers' forward around the kernels (decorators, keyword plumbing, output capture, module hooks) and
a further few ms small tensor ops it spends per layer (torch.profiler over 40 draft forwards, this project's
CPU). The kernels themselves (int4 GEMMs, attention, int8 head) took under 7 ms. This loop calls the same
modules' kernels with nothing around them.

Only for drafts: its numbers may differ from transformers' in the last float bits (RMSNorm through torch's
fused ``rms_norm``), which changes nothing about what the engine outputs (verification accepts against the
law the draft actually drafted from), but the target always runs transformers' own forward, so greedy outputs
equal transformers' decoding exactly.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaRMSNorm

from decoding.kv_cache import SlotKVCache
from decoding.models import attention_function


@dataclass
class LeanOutput:
    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor] | None


def lean_view(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with the lean forward where it supports it, else ``model``. One view per model: engines sharing
    a draft share its view, and so the forward costs measured on it."""
    if not supports_lean_forward(model):
        return model
    if model not in _lean_views:
        _lean_views[model] = LeanLlama(model)
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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rms_norm(norm: LlamaRMSNorm, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


_lean_views: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


class LeanLlama(torch.nn.Module):
    """``model``'s forward as forward_tree calls it, over ``model``'s own modules (nothing copied)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config
        self.attention = attention_function(model.config)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.inner.get_output_embeddings()

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache: SlotKVCache,
        use_cache: bool = True, output_hidden_states: bool = False, logits_to_keep: torch.Tensor | int = 0,
    ) -> LeanOutput:
        del use_cache  # always: the slot cache is written and read
        base = self.inner.model
        batch, length = input_ids.shape
        hidden = base.embed_tokens(input_ids)
        cos, sin = base.rotary_emb(hidden, position_ids)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        for index, layer in enumerate(base.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = _rms_norm(layer.input_layernorm, hidden)
            # q, k and v of one input (fused into one kernel call by a quantized twin's FusedSiblings)
            q = attn.q_proj(x).view(batch, length, -1, attn.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(batch, length, -1, attn.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(batch, length, -1, attn.head_dim).transpose(1, 2)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            k, v = cache.layers[index].update(k, v)
            out, _ = self.attention(attn, q, k, v, attention_mask, scaling=attn.scaling)
            hidden = hidden + attn.o_proj(out.reshape(batch, length, -1))
            x = _rms_norm(layer.post_attention_layernorm, hidden)
            hidden = hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
        hidden = _rms_norm(base.norm, hidden)
        if isinstance(logits_to_keep, torch.Tensor):
            kept = hidden[:, logits_to_keep]
        else:
            kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        return LeanOutput(self.inner.lm_head(kept), (hidden,) if output_hidden_states else None)
