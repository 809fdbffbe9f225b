"""``ProcessorConfig``: Ray Data LLM's ``vLLMEngineProcessorConfig`` (matched against Ray 2.60.0's source and docs),
field for field, for this engine.

A Ray Data LLM job switches by changing the import and the class name::

    config = specbatch.ProcessorConfig(
        model_source="smollm2-135m-instruct",
        engine_kwargs={"max_num_seqs": 16, "speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
        chat_template_stage={"enabled": True, "chat_template_kwargs": {"enable_thinking": False}},
        batch_size=32, concurrency=2,
    )

Every field of ``vLLMEngineProcessorConfig`` is taken, the older boolean flags (``apply_chat_template``,
``chat_template``, ``tokenize``, ``detokenize``, ``has_image``) and ``resources_per_bundle`` / ``experimental`` too.
What a field asks for that this engine does not do (images, pooling tasks, model parallelism, pre-quantized
checkpoints) is refused with one message naming the field, the value and what is supported instead; an unknown field
or ``engine_kwargs`` key is refused by name. docs/reference.md ("ProcessorConfig") lists what each field means here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from decoding.config import Config, format_validation_error
from frontend.engine_args import bundle_resources, config_fields

# engine_kwargs that would set what the processor's own fields set.
_PROCESSOR_FIELDS = {"model": "model_source", "batch_size": "max_num_seqs", "concurrency": "concurrency",
                     "num_gpus": "accelerator_type"}
# vLLM's SamplingParams defaults where this engine's Config defaults differ: rows built through ProcessorConfig take
# them for the fields they omit (Ray Data LLM constructs SamplingParams from the row's dict).
VLLM_SAMPLING_DEFAULTS = {"temperature": 1.0, "max_tokens": 16}
# vLLM's engine seed default (EngineArgs.seed): the run seed of a ProcessorConfig's engine.
VLLM_SEED = 0


class StageConfig(BaseModel):
    """A CPU stage of Ray Data LLM's pipeline (its ``_StageConfigBase``). The engine actor does these stages' work
    on its own request threads, so the pool fields (``batch_size``, ``concurrency``, ``num_cpus``, ``memory``,
    ``runtime_env``) have no separate actor pool to size here; ``enabled`` and the stage's own fields keep their
    meaning."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    batch_size: int | None = Field(None, ge=1)
    concurrency: int | tuple[int, int] | None = None
    runtime_env: dict[str, Any] | None = None
    num_cpus: float | None = Field(None, ge=0)
    memory: float | None = Field(None, ge=0)
    model_source: str | None = None


class ChatTemplateStageConfig(StageConfig):
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizerStageConfig(StageConfig):
    pass


class DetokenizeStageConfig(StageConfig):
    pass


class PrepareMultimodalStageConfig(StageConfig):
    enabled: bool = False
    model_config_kwargs: dict[str, Any] | None = None
    chat_template_content_format: str | None = "string"
    apply_sys_msg_formatting: bool | None = False


def _stage(value: Any, cls: type[StageConfig]) -> StageConfig:
    """A stage config given as a bool, a dict, one of these classes or Ray Data LLM's own (any pydantic model)."""
    if isinstance(value, bool):
        return cls(enabled=value)
    if isinstance(value, StageConfig):
        return cls.model_validate(value.model_dump(exclude_unset=True))
    if isinstance(value, Mapping):
        return cls.model_validate(dict(value))
    if hasattr(value, "model_dump"):  # ray.data.llm.ChatTemplateStageConfig and its siblings
        return cls.model_validate({k: v for k, v in value.model_dump().items() if v is not None})
    raise ValueError(f"expected a bool, a dict or {cls.__name__}, got {type(value).__name__}")


def _check_concurrency(value: int | tuple[int, int]) -> int | tuple[int, int]:
    low, high = (value, value) if isinstance(value, int) else value
    if low < 1 or high < low:
        raise ValueError("concurrency must be a positive int or (min, max) with 1 <= min <= max")
    return value


class ProcessorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    model_source: str = Field(description="model path, hub id, URI or alias (Config.model)")
    batch_size: int = Field(32, ge=1, description="rows per Ray Data batch sent to an engine actor")
    accelerator_type: str | None = Field(None, description="GPU type per actor (e.g. 'H100'); unset: CPU")
    concurrency: int | tuple[int, int] = Field(1, description="engine actors: n (a fixed pool) or (min, max)")
    runtime_env: dict[str, Any] | None = None
    max_pending_requests: int | None = Field(None, ge=1, description="rows an actor keeps in its engine at once")
    max_concurrent_batches: int = Field(8, ge=1, description="Ray Data batches an actor works on at once")
    max_tasks_in_flight_per_actor: int | None = Field(None, ge=1, description="unset: Ray Data's default")
    should_continue_on_error: bool = Field(False, description="false: a failed row fails the dataset")
    # Stage configs: a bool, a dict or a *StageConfig (validate_default: the defaults become configs too).
    chat_template_stage: Any = Field(True, validate_default=True)
    tokenize_stage: Any = Field(True, validate_default=True)
    detokenize_stage: Any = Field(True, validate_default=True)
    prepare_multimodal_stage: Any = Field(False, validate_default=True)
    prepare_image_stage: Any = Field(False, validate_default=True)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="vLLM's engine arguments")
    task_type: str = "generate"
    log_engine_metrics: bool = True
    dynamic_lora_loading_path: str | None = None
    placement_group_config: dict[str, Any] | None = None
    # Older Ray Data LLM releases' fields.
    resources_per_bundle: dict[str, float] | None = None
    experimental: dict[str, Any] = Field(default_factory=dict)
    apply_chat_template: bool = True
    chat_template: str | None = None
    tokenize: bool = True
    detokenize: bool = Field(True, description="generated_text from the tokens, whatever sampling's detokenize")
    has_image: bool = False

    @field_validator("concurrency")
    @classmethod
    def _concurrency(cls, value: int | tuple[int, int]) -> int | tuple[int, int]:
        return _check_concurrency(value)

    @field_validator("chat_template_stage", mode="after")
    @classmethod
    def _chat_stage(cls, value: Any) -> ChatTemplateStageConfig:
        return _stage(value, ChatTemplateStageConfig)

    @field_validator("tokenize_stage", mode="after")
    @classmethod
    def _tokenize_stage(cls, value: Any) -> TokenizerStageConfig:
        return _stage(value, TokenizerStageConfig)

    @field_validator("detokenize_stage", mode="after")
    @classmethod
    def _detokenize_stage(cls, value: Any) -> DetokenizeStageConfig:
        return _stage(value, DetokenizeStageConfig)

    @field_validator("prepare_multimodal_stage", "prepare_image_stage", mode="after")
    @classmethod
    def _multimodal_stage(cls, value: Any) -> PrepareMultimodalStageConfig:
        return _stage(value, PrepareMultimodalStageConfig)

    @model_validator(mode="after")
    def _resolve(self) -> ProcessorConfig:
        chat, tokenize, detokenize = self.chat_template_stage, self.tokenize_stage, self.detokenize_stage
        # The older flags, where set, apply to their stages (as Ray Data LLM did when it took both).
        if not self.apply_chat_template:
            chat.enabled = False
        if self.chat_template is not None and chat.chat_template is None:
            chat.chat_template = self.chat_template
        if not self.tokenize:
            tokenize.enabled = False
        if not self.detokenize:
            detokenize.enabled = False
        self.apply_chat_template, self.detokenize = chat.enabled, detokenize.enabled
        self.chat_template = chat.chat_template
        for name, stage in (("chat_template_stage", chat), ("tokenize_stage", tokenize),
                            ("detokenize_stage", detokenize)):
            if stage.model_source not in (None, self.model_source):
                raise ValueError(
                    f"{name}.model_source={stage.model_source!r}: the engine renders, tokenizes and detokenizes with "
                    f"the model's own tokenizer ({self.model_source!r}); give chat_template for another template")
            if stage.concurrency is not None:
                _check_concurrency(stage.concurrency)
        images = (("has_image", self.has_image), ("prepare_multimodal_stage", self.prepare_multimodal_stage.enabled),
                  ("prepare_image_stage", self.prepare_image_stage.enabled))
        for name, enabled in images:
            if enabled:
                raise ValueError(f"{name} enabled: specbatch generates from text only (no images, video or audio); "
                                 "give prompts or messages with text content")
        if self.task_type != "generate":
            raise ValueError(f"task_type={self.task_type!r}: specbatch generates text (task_type 'generate'); "
                             "embedding, classification and scoring models are not run")
        if unknown := set(self.experimental) - {"max_tasks_in_flight_per_actor"}:
            raise ValueError(f"experimental: {sorted(unknown)} unknown (accepted: max_tasks_in_flight_per_actor)")
        if self.max_tasks_in_flight_per_actor is None and "max_tasks_in_flight_per_actor" in self.experimental:
            self.max_tasks_in_flight_per_actor = int(self.experimental["max_tasks_in_flight_per_actor"])
        self.actor_resources()
        self.engine_config()  # refuse a bad engine_kwargs now, as Ray Data LLM does
        return self

    @property
    def chat_template_kwargs(self) -> dict[str, Any]:
        return dict(self.chat_template_stage.chat_template_kwargs or {})

    def actor_resources(self) -> dict[str, Any]:
        """What each engine actor reserves: ``num_gpus`` (1 with an ``accelerator_type``, else 0), and from
        ``placement_group_config`` / ``resources_per_bundle`` its one bundle's ``CPU``, ``GPU`` and custom resources
        (Ray Data LLM's single-worker engine reserves its bundle the same way)."""
        resources: dict[str, Any] = {"num_gpus": 1 if self.accelerator_type else 0}
        return {**resources, **bundle_resources(self.placement_group_config, self.resources_per_bundle)}

    def engine_config(self) -> Config:
        """The engine's ``Config``; ``ValueError`` naming the engine_kwargs field that does not fit."""
        kwargs = dict(self.engine_kwargs)
        for name, field in _PROCESSOR_FIELDS.items():
            if name in kwargs:
                raise ValueError(f"engine_kwargs.{name}: set it with {field}")
        fields = {"model": self.model_source, **config_fields(kwargs)}
        sampling = fields.pop("sampling", {})
        seed = sampling.pop("seed", VLLM_SEED)
        fields["sampling"] = {**VLLM_SAMPLING_DEFAULTS, "seed": seed, **sampling}
        resources = self.actor_resources()
        fields["num_gpus"] = resources["num_gpus"]
        if "num_cpus" in resources:
            fields.setdefault("num_cpus", resources["num_cpus"])
        fields["concurrency"] = self.concurrency
        if self.chat_template is not None:
            fields["chat_template"] = self.chat_template
        if self.chat_template_kwargs:
            fields["chat_template_kwargs"] = self.chat_template_kwargs
        if self.dynamic_lora_loading_path is not None:  # Ray Data LLM: a row's ``model`` names an adapter under it
            fields["lora"] = {"enable": True, **fields.get("lora", {}),
                              "dynamic_lora_loading_path": self.dynamic_lora_loading_path}
        try:
            return Config.model_validate(fields)
        except ValidationError as exc:
            raise ValueError(f"engine_kwargs: {format_validation_error(exc)}") from None
