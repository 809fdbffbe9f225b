"""What an engine is built from (``build.py`` makes it once; ``Engine`` and ``Step`` only read it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from decoding.config import Config, SpeculativeConfig
from decoding.drafting.drafters import Drafter
from decoding.drafting.length_policies import LengthPolicy, Sources
from decoding.model.kv_cache import PagedKVCache
from decoding.model.lora import Adapters
from decoding.model.model_runner import ModelRunner
from decoding.verification.tree import TreeTopology


@dataclass
class EngineParts:
    config: Config  # with the draft resolved (``models.resolve_draft``)
    device: torch.device
    tokenizer: PreTrainedTokenizerBase
    loaded_target: PreTrainedModel  # as loaded: a self-draft quantizes these weights, never the view below
    target: torch.nn.Module  # the forward that runs it (the lean forward where the architecture has one)
    drafter: Drafter
    topology: TreeTopology
    sources: Sources  # who proposes the tree's candidates (root, model, lookup)
    # [K, N] host: the tree cut to each size a row can be planned with (``TreeTopology.nested_trees``; K = 1 when
    # the model's tree has one size)
    nested_trees: torch.Tensor
    cache: PagedKVCache  # the target's pool
    policy: LengthPolicy
    max_context: int  # positions a sequence may reach (the model's, the draft's, max_model_len)
    eos_ids: set[int]
    runner: ModelRunner  # the target's forwards over ``cache``
    adapters: Adapters | None = None  # LoRA adapters (``lora.enable``)

    @property
    def speculative(self) -> SpeculativeConfig:
        return self.config.speculative

    @property
    def capacity(self) -> int:
        return self.config.batch_size
