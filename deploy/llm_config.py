"""``LLMConfig``: Ray Serve LLM's model configuration (matched against Ray 2.60.0's ``ray.serve.llm.LLMConfig``), field
for field, for this engine; ``ServingArgs`` is its ``LLMServingArgs``, what ``build_openai_app`` takes.

    LLMConfig(
        model_loading_config={"model_id": "smollm2", "model_source": "smollm2-135m-instruct"},
        engine_kwargs={"max_num_seqs": 16, "speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
        deployment_config={"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}},
        specbatch={"graceful_shutdown_timeout_s": 30},
    )

``model_id`` is the name clients send as ``model``; ``model_source`` the model (path, hub id, URI or alias; default
``model_id``); ``engine_kwargs`` vLLM's engine arguments as the processor takes them (``frontend.engine_args``);
``deployment_config`` Serve's deployment options for the model's replicas; ``specbatch`` this engine's own
``Config`` fields; ``lora_config`` lets requests name adapters (``Config.lora``). What a field asks for that this
engine does not do (another engine or server class, accelerator configs, model parallelism) is refused naming the
field and the alternative.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from decoding.config import Config, LoraConfig, ModelName, format_validation_error, read_yaml_file
from frontend.engine_args import bundle_resources, config_fields

# Serve's deployment options a model's replicas take from deployment_config (Ray Serve LLM's list).
DEPLOYMENT_OPTIONS = frozenset({
    "name", "num_replicas", "ray_actor_options", "max_ongoing_requests", "autoscaling_config", "max_queued_requests",
    "user_config", "health_check_period_s", "health_check_timeout_s", "graceful_shutdown_wait_loop_s",
    "graceful_shutdown_timeout_s", "logging_config", "request_router_config",
})
# Ray Serve LLM's experimental_configs keys: both tune its own router and streaming.
EXPERIMENTAL = frozenset({"stream_batching_interval_ms", "num_ingress_replicas"})
# Ray Serve LLM's LoraConfig fields (the download's timeout and retries: adapters are read once, by pyarrow).
LORA_CONFIG = frozenset({"dynamic_lora_loading_path", "max_num_adapters_per_replica", "download_timeout_s",
                         "max_download_tries"})


class ModelLoadingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_id: ModelName = Field(description="the name clients send as `model`")
    model_source: str | None = Field(None, description="path, hub id, URI or alias; default: model_id")
    tokenizer_source: str | None = None

    @field_validator("model_source", mode="before")
    @classmethod
    def _mirror(cls, value: Any) -> Any:
        # Ray's CloudMirrorConfig ({bucket_uri: s3://...}): this engine reads URIs itself.
        return value.get("bucket_uri") if isinstance(value, dict) else value

    @property
    def source(self) -> str:
        return self.model_source or self.model_id


class LLMConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    model_loading_config: ModelLoadingConfig
    llm_engine: str = "vLLM"
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="vLLM's engine arguments")
    accelerator_type: str | None = Field(None, description="one GPU of this type per replica; unset: CPU replicas")
    accelerator_config: dict[str, Any] | None = None
    placement_group_config: dict[str, Any] | None = None
    lora_config: dict[str, Any] | None = None
    deployment_config: dict[str, Any] = Field(default_factory=dict, description="Serve's deployment options")
    runtime_env: dict[str, Any] | None = None
    server_cls: Any = None
    experimental_configs: dict[str, Any] = Field(default_factory=dict)
    log_engine_metrics: bool | None = True
    callback_config: dict[str, Any] | None = None
    specbatch: dict[str, Any] = Field(default_factory=dict, description="this engine's own Config fields")

    def model_post_init(self, _: Any) -> None:
        loading = self.model_loading_config
        if loading.tokenizer_source not in (None, loading.source):
            raise ValueError(f"model_loading_config.tokenizer_source={loading.tokenizer_source!r}: the engine uses "
                             "the model's own tokenizer; give a model directory holding the one to use")
        if self.llm_engine.lower() != "vllm":
            raise ValueError(f"llm_engine={self.llm_engine!r}: specbatch is its own engine and takes vLLM's "
                             "engine_kwargs ('vLLM')")
        for name, instead in (("server_cls", "the server is specbatch's OpenAI server"),
                              ("accelerator_config", "set accelerator_type, and engine_kwargs for the engine")):
            if getattr(self, name):
                raise ValueError(f"{name}={getattr(self, name)!r}: {instead}")
        if self.callback_config and any(value for value in self.callback_config.values()):
            raise ValueError("callback_config: no callbacks run in specbatch's replicas")
        if unknown := set(self.experimental_configs) - EXPERIMENTAL:
            raise ValueError(f"experimental_configs: {sorted(unknown)} unknown (accepted: {sorted(EXPERIMENTAL)})")
        if unknown := set(self.deployment_config) - DEPLOYMENT_OPTIONS:
            raise ValueError(f"deployment_config: {sorted(unknown)} are not Serve deployment options "
                             f"(accepted: {sorted(DEPLOYMENT_OPTIONS)})")
        self.engine_config()

    @property
    def model_id(self) -> str:
        return self.model_loading_config.model_id

    def engine_config(self) -> Config:
        """The engine's ``Config``: the model, ``model_id`` as its served name, ``engine_kwargs`` as vLLM's
        arguments, the replicas from ``deployment_config``, then the ``specbatch`` fields over them."""
        served = self.engine_kwargs.get("served_model_name")
        if served not in (None, self.model_id, [self.model_id]):
            raise ValueError(f"engine_kwargs.served_model_name={served!r}: the model's name is "
                             f"model_loading_config.model_id ({self.model_id!r})")
        fields: dict[str, Any] = {"model": self.model_loading_config.source,
                                  **config_fields({k: v for k, v in self.engine_kwargs.items()
                                                   if k != "served_model_name"}),
                                  "served_model_name": self.model_id}
        resources = bundle_resources(self.placement_group_config)
        fields["num_gpus"] = resources.get("num_gpus", 1 if self.accelerator_type else 0)
        if "num_cpus" in resources:
            fields["num_cpus"] = resources["num_cpus"]
        scaling = self.deployment_config.get("autoscaling_config")
        if scaling:
            fields["concurrency"] = (int(scaling.get("min_replicas", 1)), int(scaling.get("max_replicas", 1)))
        elif "num_replicas" in self.deployment_config and self.deployment_config["num_replicas"] != "auto":
            fields["concurrency"] = int(self.deployment_config["num_replicas"])
        if "graceful_shutdown_timeout_s" in self.deployment_config:
            fields["graceful_shutdown_timeout_s"] = self.deployment_config["graceful_shutdown_timeout_s"]
        if self.lora_config is not None:
            fields["lora"] = self._lora(fields.get("lora", {}))
        fields.update(self.specbatch)
        try:
            return Config.model_validate(fields)
        except ValidationError as exc:
            raise ValueError(f"llm config {self.model_id!r}: {format_validation_error(exc)}") from None

    def _lora(self, lora: dict[str, Any]) -> dict[str, Any]:
        """Ray Serve LLM's ``lora_config`` as ``Config.lora`` (over what ``engine_kwargs`` gave): requests name
        adapters under ``dynamic_lora_loading_path``; ``max_num_adapters_per_replica`` adapters stay loaded in a
        replica (``max_cpu_loras``; the device slots, ``max_loras``, at most as many)."""
        given = dict(self.lora_config or {})
        if unknown := set(given) - LORA_CONFIG:
            raise ValueError(f"lora_config: {sorted(unknown)} unknown (accepted: {sorted(LORA_CONFIG)})")
        fields = {**lora, "enable": True}
        if given.get("dynamic_lora_loading_path") is not None:
            fields["dynamic_lora_loading_path"] = given["dynamic_lora_loading_path"]
        if given.get("max_num_adapters_per_replica") is not None:
            held = given["max_num_adapters_per_replica"]
            fields["max_cpu_loras"] = held
            if isinstance(held, int):
                fields["max_loras"] = min(fields.get("max_loras", LoraConfig.model_fields["max_loras"].default), held)
        return fields

    def replica_options(self, base: dict[str, Any], runtime_env: dict[str, Any]) -> dict[str, Any]:
        """Serve's options for the model's replicas: ``base`` (the engine's own, from its Config) with
        ``deployment_config`` over it, the accelerator type, the custom resources and ``runtime_env`` added."""
        options = {**base, **{k: v for k, v in self.deployment_config.items() if k != "ray_actor_options"}}
        if "autoscaling_config" in self.deployment_config:
            options.pop("num_replicas", None)
            options["autoscaling_config"] = {**base.get("autoscaling_config", {}),
                                             **self.deployment_config["autoscaling_config"]}
        actor = {**base.get("ray_actor_options", {}), **self.deployment_config.get("ray_actor_options", {})}
        if self.accelerator_type:
            actor["accelerator_type"] = self.accelerator_type
        if resources := bundle_resources(self.placement_group_config).get("resources"):
            actor["resources"] = {**actor.get("resources", {}), **resources}
        user = dict(self.runtime_env or {})
        actor["runtime_env"] = {**user, "env_vars": {**runtime_env.get("env_vars", {}), **(user.get("env_vars") or {})}}
        options["ray_actor_options"] = actor
        return options


class ServingArgs(BaseModel):
    """Ray Serve LLM's ``LLMServingArgs``: the models, and the router's own deployment options."""

    model_config = ConfigDict(extra="forbid")

    llm_configs: list[LLMConfig]
    ingress_deployment_config: dict[str, Any] = Field(default_factory=dict)
    ingress_cls_config: dict[str, Any] = Field(default_factory=dict)

    @field_validator("llm_configs", mode="before")
    @classmethod
    def _files(cls, value: Any) -> Any:
        """An entry may be the path of a YAML file holding one LLMConfig, as in Ray Serve LLM."""
        if not isinstance(value, list) or not value:
            raise ValueError("llm_configs: a non-empty list of LLMConfigs (objects, dicts or YAML file paths)")
        loaded = []
        for entry in value:
            if isinstance(entry, str | Path):
                path = Path(entry)
                if not path.is_file():
                    raise ValueError(f"llm_configs: {str(entry)!r} is not a file")
                entry = read_yaml_file(path)
            loaded.append(entry.model_dump() if isinstance(entry, BaseModel) and not isinstance(entry, LLMConfig)
                          else entry)
        return loaded

    @field_validator("llm_configs")
    @classmethod
    def _distinct(cls, value: list[LLMConfig]) -> list[LLMConfig]:
        ids = [config.model_id for config in value]
        if duplicated := sorted({name for name in ids if ids.count(name) > 1}):
            raise ValueError(f"llm_configs: model_id {duplicated} given more than once")
        return value

    @field_validator("ingress_cls_config")
    @classmethod
    def _ingress(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("ingress_cls"):
            raise ValueError("ingress_cls_config.ingress_cls: the router is specbatch's own")
        return value
