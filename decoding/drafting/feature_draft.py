"""The feature draft (EAGLE-style): a decoder layer or two that read the target's final hidden state.

A token-only draft of a small target tops out low (a 2-layer SmolLM2 draft agreed with the target on 41% of
tokens): it must re-derive from tokens what the target already computed. This draft is given it. Its input at
position t is the token x_t *and* f_{t-1}, the target's final hidden state that predicted x_t:

    g_t = norm(layer(fc([embed(x_t); f_{t-1}])))       next-token logits = head(g_t)

``g_t`` estimates f_t, so deeper draft levels feed it back as the next position's feature. The head is the
target's own LM head restricted to a vocabulary subset (the head dominates a tiny draft's cost).

On disk it is a directory like any draft: ``config.json`` (the body's decoder config), the weights in
``model.safetensors``, the tokenizer, and ``specbatch_draft.json`` with ``"architecture": "feature"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig

from decoding.model.loading import default_device, draft_metadata, load_model, resolve_dtype, resolve_model_path

WEIGHTS = "model.safetensors"


def layers_config(target_config: PretrainedConfig, layers: list[int]) -> PretrainedConfig:
    """A copy of a target's config for a draft made of its decoder ``layers`` (checked to exist)."""
    depth = target_config.num_hidden_layers
    if any(not 0 <= i < depth for i in layers):
        raise ValueError(f"layers {layers} out of range for a target with {depth} decoder layers")
    config = target_config.__class__.from_dict(target_config.to_dict())
    config.num_hidden_layers = len(layers)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [target_config.layer_types[i] for i in layers]
    return config


@dataclass
class FeatureDraftOutput:
    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]  # (g,) at every input position, as transformers' last entry


class FeatureDraft(nn.Module):
    reads_features = True

    def __init__(self, config: PretrainedConfig, head_rows: int) -> None:
        super().__init__()
        self.config = config
        self.body = AutoModel.from_config(config)  # embeddings, decoder layer(s), final norm
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden)
        self.lm_head = nn.Linear(hidden, head_rows, bias=False)

    @property
    def feature_size(self) -> int:
        return self.config.hidden_size

    def hidden(self, input_ids: torch.Tensor, features: torch.Tensor, **body_inputs) -> torch.Tensor:
        """g at every input position; ``body_inputs`` go to the decoder (mask, positions, cache)."""
        embeds = self.body.embed_tokens(input_ids)
        fused = self.fc(torch.cat([embeds, features.to(embeds.dtype)], -1))
        return self.body(inputs_embeds=fused, **body_inputs).last_hidden_state

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool = False,
        **body_inputs,
    ) -> FeatureDraftOutput:
        """The interface ``forward_tree`` drives a causal LM with, plus ``features`` [B, T, H]."""
        del output_hidden_states  # g is always returned: deeper levels need it as their feature
        hidden = self.hidden(input_ids, features, **body_inputs)
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return FeatureDraftOutput(self.lm_head(hidden[:, kept]), (hidden,))

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(directory)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(directory / WEIGHTS))

    @classmethod
    def load(cls, directory: str | Path, dtype: torch.dtype = torch.float32) -> FeatureDraft:
        directory = Path(directory)
        config = AutoConfig.from_pretrained(directory)
        config._attn_implementation = "sdpa"
        state = load_file(str(directory / WEIGHTS))
        model = cls(config, state["lm_head.weight"].shape[0])
        model.load_state_dict(state)
        return model.to(dtype).eval()

    @classmethod
    def from_target(cls, target: nn.Module, layers: list[int], head_rows: list[int]) -> FeatureDraft:
        """Initialised from the target: its embeddings, decoder ``layers``, final norm and LM head rows; ``fc``
        starts by passing the feature through (the token's embedding enters with a small weight)."""
        config = layers_config(target.config, layers)
        config._attn_implementation = "sdpa"
        draft = cls(config, len(head_rows)).to(next(target.parameters()).dtype)
        decoder = target.get_decoder()
        with torch.no_grad():
            draft.body.embed_tokens.weight.copy_(decoder.embed_tokens.weight)
            for mine, theirs in zip(draft.body.layers, layers):
                mine.load_state_dict(decoder.layers[theirs].state_dict())
            draft.body.norm.load_state_dict(decoder.norm.state_dict())
            draft.lm_head.weight.copy_(target.get_output_embeddings().weight[torch.tensor(head_rows)])
            hidden = config.hidden_size
            draft.fc.weight.zero_()
            draft.fc.weight[:, hidden:] = torch.eye(hidden)
            draft.fc.weight[:, :hidden] = torch.eye(hidden) * 0.1
            draft.fc.bias.zero_()
        return draft


def load_draft(name: str, dtype: str = "auto", device: torch.device | None = None,
               trust_remote_code: bool = False) -> torch.nn.Module:
    """A draft model: a causal LM, or a ``FeatureDraft`` where its training metadata says so."""
    if draft_metadata(name).get("architecture") != "feature":
        return load_model(name, dtype, device, trust_remote_code)
    device = device or default_device()
    return FeatureDraft.load(resolve_model_path(name), resolve_dtype(dtype, device)).to(device)
