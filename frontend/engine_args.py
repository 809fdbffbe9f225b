"""vLLM's engine arguments (``engine_kwargs`` of Ray Data LLM's and Ray Serve LLM's configs) as this engine's
``Config`` fields, for the processor (``pipeline.processor_config``) and the server (``deploy.llm_config``) alike.

Arguments this engine shares keep vLLM's meaning (docs/reference.md, "ProcessorConfig"); those that only tune vLLM's
own scheduler and kernels are accepted and change nothing; a value asking for what the engine does not do is refused
naming the argument and the alternative; an unknown argument is refused by name.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, get_args

from decoding.config import Config, Quantization

log = logging.getLogger(__name__)

# vLLM engine arguments that tune vLLM's own scheduler, kernels and loading: this engine has no counterpart, and none
# of them changes what is generated (chunked prefill: the engine prefills in max_num_batched_tokens chunks anyway).
VLLM_TUNING = frozenset({
    "enable_chunked_prefill", "enforce_eager", "disable_log_stats", "swap_space", "distributed_executor_backend",
    "max_seq_len_to_capture", "disable_custom_all_reduce", "compilation_config", "cuda_graph_sizes",
    "async_scheduling", "max_num_partial_prefills", "long_prefill_token_threshold", "enable_log_requests",
    "disable_log_requests", "max_logprobs", "task_type",
})
# vLLM's LoRA engine arguments -> Config.lora fields.
VLLM_LORA = {"enable_lora": "enable", "max_lora_rank": "max_lora_rank", "max_loras": "max_loras",
             "max_cpu_loras": "max_cpu_loras"}
# engine_kwargs values that only name what the engine does anyway.
VLLM_NEUTRAL = {"kv_cache_dtype": {"auto"}, "generation_config": {"auto", "vllm"},
                "load_format": {"auto", "safetensors", "pt", "runai_streamer"},
                "tensor_parallel_size": {1}, "pipeline_parallel_size": {1},
                "data_parallel_size": {1}}
# What the engine supports instead, for each engine_kwargs value it refuses.
INSTEAD = {
    "kv_cache_dtype": "the KV cache is kept in the model's dtype ('auto')",
    "generation_config": "'auto' or 'vllm' (a request's sampling parameters set its decoding)",
    "load_format": "checkpoints load with transformers from safetensors or pytorch files ('auto')",
    "quantization": "'gguf' (a GGUF model's quantized blocks), 'awq', 'gptq', 'compressed-tensors' (a checkpoint's "
                    "packed integers; detected from its config), 'auto' or null, on a CPU; for another method give "
                    "the full-precision model",
    "tensor_parallel_size": "one engine runs on one device: use concurrency for more engines",
    "pipeline_parallel_size": "one engine runs on one device: use concurrency for more engines",
    "data_parallel_size": "use concurrency for more engines",
}
# vLLM's dtype spellings -> Config.dtype.
_DTYPES = {"half": "float16", "float": "float32"}


def config_fields(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``Config`` fields for ``engine_kwargs`` (without ``model``); ``ValueError`` naming what is refused. ``seed``
    becomes ``sampling.seed`` (the run seed)."""
    kwargs = dict(engine_kwargs)
    if kwargs.get("quantization") not in (None, *get_args(Quantization)):
        raise ValueError(f"engine_kwargs.quantization={kwargs['quantization']!r}: {INSTEAD['quantization']}")
    if "quantization" in kwargs and kwargs["quantization"] is None:
        kwargs["quantization"] = "auto"  # vLLM's None: what the checkpoint is (dtype float32 keeps float weights)
    for name, accepted in VLLM_NEUTRAL.items():
        if name in kwargs and kwargs[name] not in accepted:
            raise ValueError(f"engine_kwargs.{name}={kwargs[name]!r}: {INSTEAD[name]}")
        kwargs.pop(name, None)
    if tuning := sorted(VLLM_TUNING & set(kwargs)):
        log.info("engine_kwargs %s tune vLLM's own scheduler, kernels and loading; they change nothing here", tuning)
        for name in tuning:
            del kwargs[name]
    known = set(Config.model_fields) | {"speculative_config", "seed", *VLLM_LORA}
    if unknown := sorted(set(kwargs) - known):
        raise ValueError(f"engine_kwargs {unknown}: not an engine argument specbatch takes (it takes vLLM's listed "
                         "in docs/reference.md, \"ProcessorConfig\", and the fields of its Config)")
    fields: dict[str, Any] = {}
    lora = {field: kwargs.pop(name) for name, field in VLLM_LORA.items() if kwargs.get(name) is not None}
    if lora:
        fields["lora"] = {**kwargs.pop("lora", {}), **lora}
    if "speculative_config" in kwargs:
        speculative = dict(kwargs.pop("speculative_config") or {"method": "none"})
        if "method" not in speculative:  # vLLM infers it: a draft model, else n-gram lookup
            speculative["method"] = "draft_model" if speculative.get("model") else "ngram"
        fields["speculative"] = speculative
    if "max_num_seqs" in kwargs:
        fields["batch_size"] = kwargs.pop("max_num_seqs")
    if "dtype" in kwargs:
        dtype = kwargs.pop("dtype")
        fields["dtype"] = _DTYPES.get(dtype, dtype)
    if isinstance(kwargs.get("served_model_name"), list | tuple):  # vLLM takes several names; the first leads
        kwargs["served_model_name"] = kwargs["served_model_name"][0] if kwargs["served_model_name"] else None
    if "seed" in kwargs:
        kwargs["sampling"] = {**kwargs.get("sampling", {}), "seed": kwargs.pop("seed")}
    return {**fields, **kwargs}


def bundle_resources(placement_group_config: dict[str, Any] | None,
                     resources_per_bundle: dict[str, float] | None = None) -> dict[str, Any]:
    """What one engine's worker reserves from a placement group config (``bundle_per_worker`` or ``bundles``, and a
    ``strategy``) or an older ``resources_per_bundle``: its one bundle's ``num_gpus`` (at most 1), ``num_cpus``
    and custom ``resources``, as Ray's LLM libraries reserve a single-worker engine's bundle."""
    bundles: list[dict[str, float]] = []
    if placement_group_config is not None:
        config = dict(placement_group_config)
        if unknown := set(config) - {"bundles", "bundle_per_worker", "strategy"}:
            raise ValueError(f"placement_group_config: {sorted(unknown)} unknown "
                             "(accepted: bundle_per_worker, bundles, strategy)")
        if "bundle_per_worker" in config:
            bundles = [dict(config["bundle_per_worker"])]
        else:
            bundles = [dict(bundle) for bundle in config.get("bundles") or []]
        if len(bundles) > 1:
            raise ValueError(f"placement_group_config has {len(bundles)} bundles: one engine runs in one worker on "
                             "one device; use concurrency (replicas) for more engines")
    elif resources_per_bundle is not None:
        bundles = [dict(resources_per_bundle)]
    resources: dict[str, Any] = {}
    if bundles:
        counts = Counter(bundles[0])
        if counts.get("GPU", 0) > 1:
            raise ValueError(f"a bundle of {counts['GPU']:g} GPUs: one engine runs on one device; use concurrency "
                             "(replicas) for more engines")
        if "GPU" in counts:
            resources["num_gpus"] = counts.pop("GPU")
        if "CPU" in counts:
            resources["num_cpus"] = counts.pop("CPU")
        if counts:
            resources["resources"] = dict(counts)
    return resources
