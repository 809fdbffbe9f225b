"""Building an engine, once: models loaded, the draft and its tree, the KV pool sized, forward costs measured, graphs
captured. ``build_parts`` returns what ``Engine`` steps (``parts.EngineParts``); nothing here runs per step."""

from __future__ import annotations

import logging

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from decoding.config import Config
from decoding.drafting.costs import BatchCosts, calibrate_batch
from decoding.drafting.draft_model import model_view
from decoding.drafting.drafters import DraftContext, Drafter, draft_plan
from decoding.drafting.length_policies import Sources, make_policy
from decoding.engine.parts import EngineParts
from decoding.engine.sequence import eos_token_ids
from decoding.model.execution import Execution
from decoding.model.gguf_blocks import uses_blocks
from decoding.model.kv_cache import CacheShape, PagedKVCache
from decoding.model.lean_forward import LeanCausalLM
from decoding.model.loading import (
    SELF_DRAFT,
    default_device,
    load_model,
    load_tokenizer,
    resolve_draft,
    resolve_model_path,
)
from decoding.model.lora import Adapters, LoraSlots
from decoding.model.model_runner import ModelRunner
from decoding.paths import localize
from decoding.verification.tree import TreeTopology

log = logging.getLogger(__name__)

# The CPU pool's default ceiling (vLLM's CPU KV space default).
CPU_KV_BYTES = 4 << 30


def build_parts(
    config: Config,
    *,
    target: PreTrainedModel | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    draft: torch.nn.Module | None = None,
    device: torch.device | None = None,
) -> EngineParts:
    """The engine's parts for ``config``; a ``target``, ``tokenizer`` or ``draft`` given is used as it is (else
    loaded from the config's paths), on ``device`` (default: the target's, else the best one here)."""
    return _Builder(config, target, tokenizer, draft, device).build()


class _Builder:
    def __init__(self, config: Config, target: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase | None,
                 draft: torch.nn.Module | None, device: torch.device | None) -> None:
        spec = resolve_draft(config.speculative, config.model)
        self.config = config.model_copy(update={"speculative": spec})
        self.device = device or (target.device if target is not None else default_device())
        self.target, self.tokenizer, self.draft = target, tokenizer, draft

    def build(self) -> EngineParts:
        config, spec = self.config, self.config.speculative
        tokenizer = self.tokenizer or load_tokenizer(config.model, config.trust_remote_code)
        target_by_path = self.target is None  # its forward costs may be cached on disk under the path
        loaded = (self.target if self.target is not None
                  else load_model(config.model, config.dtype, self.device, config.trust_remote_code,
                                 config.quantization))
        target = model_view(loaded)
        max_context = int(getattr(loaded.config, "max_position_embeddings", 1 << 30))
        plan = draft_plan(DraftContext(config, self.device, loaded, tokenizer, self.draft, max_context))
        drafter, max_context = plan.drafter, plan.max_context
        topology = TreeTopology(plan.width, spec.max_depth, plan.root_width, plan.tree, plan.order)
        nested = topology.nested_trees(plan.model_chains, plan.sizes)
        if config.max_model_len:
            max_context = min(max_context, config.max_model_len)
        execution = self.execution(target)
        cache = self._cache(loaded, topology, max_context, execution, drafter)
        adapters = self._adapters(loaded)
        lora = adapters.slots if adapters is not None else None
        runner = ModelRunner(target, cache, captured=True, lora=lora)
        drafter.attach(cache)
        for draft_runner in drafter.runners:  # a self-draft (in the target's pool) follows each row's adapter
            if draft_runner.cache is cache:
                draft_runner.lora = lora
        # A recycling tree is the "model" source, with no forward to price.
        sources = Sources(
            plan.root_width, plan.model_candidates, plan.lookup_candidates, prefix_tokens=plan.prefix_tokens,
            model_sizes=_model_sizes(topology, nested, plan.model_chains) if plan.model_candidates else (),
            cuts_at_full_depth=runner.replays,  # a replayed verification's cuts are captured at full depth
        )
        for model in (target, *drafter.models):
            if isinstance(model, LeanCausalLM):
                model.prepare(execution)  # packed and compiled (or loaded) now, at build, never mid-run
        measured: list[tuple[BatchCosts, BatchCosts | None]] = []

        def costs() -> tuple[BatchCosts, BatchCosts | None]:
            if not measured:
                measured.append(self._calibrate(target, drafter, topology, execution, target_by_path,
                                                self.draft is None))
            return measured[0]

        search = drafter.search
        if search is not None:  # the layer sets are priced by their calibrated forwards (``layer_skip.py``)
            verify, _ = costs()
            search.price(verify, [self._calibrate_draft(view, drafter, topology, execution, target_by_path)
                                  for view in search.views])
        policy = make_policy(spec, sources, costs, capacity=config.batch_size,
                             draft_scale=(lambda: search.cost_scale) if search is not None else None)
        policy.to(self.device)  # a trained stop head reads the draft's states where they are
        parts = EngineParts(
            config=config, device=self.device, tokenizer=tokenizer, loaded_target=loaded, target=target,
            drafter=drafter, topology=topology, sources=sources, nested_trees=nested, cache=cache, policy=policy,
            max_context=max_context,
            eos_ids=eos_token_ids(tokenizer, loaded), runner=runner, adapters=adapters,
        )
        if runner.replays:
            _capture_graphs(parts)
        return parts

    def _adapters(self, loaded: PreTrainedModel) -> Adapters | None:
        """The LoRA adapters' registry and device slots, where ``lora.enable``."""
        lora = self.config.lora
        if not lora.enable:
            return None
        dtype = next(loaded.parameters()).dtype
        slots = LoraSlots(loaded.config, lora.max_loras, lora.max_lora_rank, self.device,
                          dtype if dtype.is_floating_point else torch.float32)
        return Adapters(lora.modules, lora.dynamic_lora_loading_path, lora.max_cpu_loras, slots, loaded.config,
                        localize)

    def execution(self, target: torch.nn.Module) -> Execution:
        """How the engine's forwards run (``execution.py``): decided once, here, and logged. Where it captures CUDA
        graphs, verifications run whole trees (only whole trees are captured)."""
        return Execution.resolve(self.config.execution, self.device, lean=isinstance(target, LeanCausalLM))

    def _cache(self, loaded: PreTrainedModel, topology: TreeTopology, max_context: int, execution: Execution,
               drafter: Drafter) -> PagedKVCache:
        """The target's pool: ``num_kv_blocks``, or as many blocks as the memory budget holds (never more than
        ``batch_size`` rows of the whole context need). It caches prompt prefixes unless the configuration says
        not to or the draft reads the target's state at every prompt position (a feature draft: a cached prefix
        has no states)."""
        config = self.config
        shape = CacheShape.of(loaded.config)
        dtype = next(loaded.parameters()).dtype
        positions = max_context + topology.size(topology.max_depth) + 1
        bytes_per_block = shape.bytes_per_token * dtype.itemsize * config.block_size
        blocks_needed = config.batch_size * -(-positions // config.block_size)
        blocks = config.num_kv_blocks
        if blocks is None:
            budget = config.kv_cache_memory_bytes
            if budget is None and self.device.type == "cuda":
                total = torch.cuda.get_device_properties(self.device).total_memory
                budget = int(total * config.gpu_memory_utilization) - torch.cuda.memory_allocated(self.device)
                if execution.graphs:  # captured after the pool is made: their memory is set aside first
                    budget -= execution.graph_memory_bytes
            budget = budget if budget is not None else CPU_KV_BYTES
            blocks = max(1, min(blocks_needed, budget // bytes_per_block))
        prefix_caching = config.enable_prefix_caching and not drafter.capabilities.target_states
        if config.enable_prefix_caching and not prefix_caching:
            log.info("prefix caching is off: the feature draft reads the target's state at every prompt position")
        return PagedKVCache(shape, blocks, config.batch_size, positions, block_size=config.block_size, dtype=dtype,
                            device=self.device, execution=execution, prefix_caching=prefix_caching,
                            salt=f"{getattr(loaded.config, '_name_or_path', '')}|{config.model}")

    def _calibrate(self, target: torch.nn.Module, drafter: Drafter, topology: TreeTopology, execution: Execution,
                   target_from_path: bool, draft_from_path: bool) -> tuple[BatchCosts, BatchCosts | None]:
        """Measured forward costs (cached on disk for models loaded by path) for the online policy."""
        config, spec = self.config, self.config.speculative
        verify = calibrate_batch(
            target, topology.size(topology.max_depth), config.batch_size,
            self._target_key(target) if target_from_path else None, captured=True, execution=execution,
        )
        if not drafter.models:
            return verify, None  # n-gram lookup and recycling cost next to nothing beside a forward
        model = drafter.search.views[0] if drafter.search is not None else drafter.model  # auto: the whole draft
        if spec.model == SELF_DRAFT or not draft_from_path:
            return verify, self._calibrate_draft(model, drafter, topology, execution, target_from_path)
        draft_key = f"{resolve_model_path(spec.model)}|{spec.quantization}"
        return verify, calibrate_batch(model, topology.root_width + 1, config.batch_size, draft_key,
                                       captured=drafter.captured, execution=execution)

    def _target_key(self, model: torch.nn.Module) -> str:
        """The target's costs' key on disk: its path, and whether it multiplies a GGUF's blocks."""
        path = resolve_model_path(self.config.model)
        return f"{path}|gguf-blocks" if uses_blocks(getattr(model, "inner", model)) else path

    def _calibrate_draft(self, model: torch.nn.Module, drafter: Drafter, topology: TreeTopology,
                         execution: Execution, target_from_path: bool) -> BatchCosts:
        """A self-draft's forward costs (``model``: the draft or one of its layer sets), cached on disk under the
        target's path, the quantization and the layers it runs."""
        config, spec = self.config, self.config.speculative
        draft_key = None  # the quantization and the layers are part of what was timed
        if spec.model == SELF_DRAFT and target_from_path:
            layers = getattr(getattr(model, "stack", None), "layers", None)
            draft_key = f"{self._target_key(model)}|self-draft|{spec.quantization}|{layers}"
        return calibrate_batch(model, topology.root_width + 1, config.batch_size, draft_key, captured=drafter.captured,
                               execution=execution)


def _model_sizes(topology: TreeTopology, nested: torch.Tensor, model_chains: int) -> tuple[tuple[int, ...], ...]:
    """``Sources.model_sizes``: the model's nodes at each depth 1.. in each cut of the tree (``nested``), where the
    tree has more than one size."""
    if len(nested) < 2:
        return ()
    model, depths = topology.model_nodes(model_chains), topology.depths
    return tuple(tuple(int((cut & model & (depths == level)).sum()) for level in range(1, topology.max_depth + 1))
                 for cut in nested)


def _capture_graphs(parts: EngineParts) -> None:
    """The target's decode and verification forwards, and a self-draft's levels, as CUDA graphs for every row and
    key bucket, captured now within one graph memory budget (``cuda_graphs.py``)."""
    topology, drafter = parts.topology, parts.drafter
    # Whole trees of every depth, and every cut of the deepest (``Step._planned_nodes``).
    tokens = [1, *(topology.size(depth) for depth in range(topology.max_depth + 1)),
              *(int(cut.sum()) for cut in parts.nested_trees)]
    captures = [(parts.runner, tokens, drafter.capabilities.target_states)]
    captures += [(runner, [topology.root_width, topology.num_candidates], parts.policy.needs_hidden_states)
                 for runner in drafter.runners if runner.replays]  # a self-draft's levels: roots, then widths

    def memory() -> int:
        return torch.cuda.memory_reserved(parts.device)

    started, budget = memory(), parts.cache.execution.graph_memory_bytes
    for runner, per_row, hidden in captures:
        runner.capture(per_row, hidden, budget - (memory() - started), memory)
