"""``ProcessorConfig``: Ray Data LLM's ``vLLMEngineProcessorConfig``, field for field, for this engine.

A Ray Data LLM job switches by changing the import and the class name::

    config = specbatch.ProcessorConfig(
        model_source="smollm2-135m-instruct",
        engine_kwargs={"max_num_seqs": 16, "speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
        batch_size=32, concurrency=2,
    )

The fields mean what they mean there (Ray 2.60): ``batch_size`` is rows per Ray Data batch, ``concurrency`` the
engine actors (an int ``n`` an autoscaling pool of 1 to ``n``, a pair ``(m, n)`` one of ``m`` to ``n``),
``accelerator_type`` puts each actor on one GPU of that type (unset: CPU), ``max_concurrent_batches`` the batches
an actor works on at once. ``engine_kwargs`` are vLLM's engine arguments: ``speculative_config`` (vLLM's dict;
unset, the engine's default speculation), ``max_num_seqs`` (sequences decoded together), ``dtype``, ``seed``,
``served_model_name``, and any field of specbatch's ``Config`` (``sampling``, ``num_cpus``, ...). vLLM arguments
that only tune vLLM's own memory and scheduler are accepted and change nothing here (``TUNING_ONLY``); any other
is refused by name.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from decoding.config import Config, format_validation_error

log = logging.getLogger(__name__)

# vLLM engine arguments that tune vLLM's own scheduler and kernels: this engine has no counterpart, and none of
# them changes what is generated.
TUNING_ONLY = frozenset({
    "enable_chunked_prefill", "enforce_eager", "disable_log_stats", "swap_space",
    "distributed_executor_backend",
})
# vLLM's dtype spellings -> Config.dtype.
_DTYPES = {"half": "float16", "float": "float32"}
# engine_kwargs that would set what the processor's own fields set.
_PROCESSOR_FIELDS = {"model": "model_source", "batch_size": "max_num_seqs", "concurrency": "concurrency",
                     "num_gpus": "accelerator_type"}


class ProcessorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_source: str = Field(description="model path, hub id, URI or alias (Config.model)")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="vLLM's engine arguments")
    batch_size: int = Field(32, ge=1, description="rows per Ray Data batch sent to an engine actor")
    concurrency: int | tuple[int, int] = Field(1, description="engine actors: n (autoscaling 1..n) or (min, max)")
    accelerator_type: str | None = Field(None, description="GPU type per actor (e.g. 'H100'); unset: CPU")
    runtime_env: dict[str, Any] | None = None
    max_concurrent_batches: int = Field(8, ge=1, description="Ray Data batches an actor works on at once")
    max_tasks_in_flight_per_actor: int | None = Field(None, ge=1, description="unset: Ray Data's default")
    should_continue_on_error: bool = Field(False, description="false: a failed row fails the dataset")
    apply_chat_template: bool = True
    chat_template: str | None = None
    detokenize: bool = Field(True, description="generated_text from the tokens, whatever sampling's detokenize")
    # Ray 2.60's spelling of the three above: a bool, or a dict with `enabled` and (chat) the template options.
    chat_template_stage: bool | dict[str, Any] = True
    detokenize_stage: bool | dict[str, Any] = True
    log_engine_metrics: bool = True
    task_type: Literal["generate"] = "generate"

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, value: int | tuple[int, int]) -> int | tuple[int, int]:
        low, high = (1, value) if isinstance(value, int) else value
        if low < 1 or high < low:
            raise ValueError("concurrency must be a positive int or (min, max) with 1 <= min <= max")
        return value

    @model_validator(mode="after")
    def _stages(self) -> ProcessorConfig:
        for name, allowed in (("chat_template_stage", {"enabled", "chat_template", "chat_template_kwargs"}),
                              ("detokenize_stage", {"enabled"})):
            stage = getattr(self, name)
            if isinstance(stage, dict) and (unknown := set(stage) - allowed):
                raise ValueError(f"{name}: {sorted(unknown)} not supported (the engine actor does this stage's work; "
                                 f"accepted: {sorted(allowed)})")
        chat = self.chat_template_stage
        if chat is False or (isinstance(chat, dict) and not chat.get("enabled", True)):
            object.__setattr__(self, "apply_chat_template", False)
        if isinstance(chat, dict) and chat.get("chat_template"):
            object.__setattr__(self, "chat_template", chat["chat_template"])
        detokenize = self.detokenize_stage
        if detokenize is False or (isinstance(detokenize, dict) and not detokenize.get("enabled", True)):
            object.__setattr__(self, "detokenize", False)
        self.engine_config()  # refuse a bad engine_kwargs now, as Ray Data LLM does
        return self

    def engine_config(self) -> Config:
        """The engine's ``Config``; ``ValueError`` naming the engine_kwargs field that does not fit."""
        kwargs = dict(self.engine_kwargs)
        for name, field in _PROCESSOR_FIELDS.items():
            if name in kwargs:
                raise ValueError(f"engine_kwargs.{name}: set it with {field}")
        tuning = sorted(TUNING_ONLY & set(kwargs))
        if tuning:
            log.info("engine_kwargs %s tune vLLM's own caches and scheduler; they change nothing here", tuning)
        for name in tuning:
            del kwargs[name]
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if kwargs.pop(name, 1) != 1:
                raise ValueError(f"engine_kwargs.{name}: one engine runs on one device (use concurrency for more)")
        if kwargs.pop("task_type", "generate") != "generate":
            raise ValueError("engine_kwargs.task_type: only 'generate' is supported")
        if kwargs.pop("trust_remote_code", False):
            raise ValueError("engine_kwargs.trust_remote_code: models load without remote code")
        fields: dict[str, Any] = {"model": self.model_source}
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
        if "seed" in kwargs:
            fields["sampling"] = {**kwargs.pop("sampling", {}), "seed": kwargs.pop("seed")}
        fields.update(kwargs)
        fields["num_gpus"] = 1 if self.accelerator_type else 0
        fields["concurrency"] = (1, self.concurrency) if isinstance(self.concurrency, int) else self.concurrency
        if self.chat_template is not None:
            fields["chat_template"] = self.chat_template
        if isinstance(self.chat_template_stage, dict) and self.chat_template_stage.get("chat_template_kwargs"):
            fields["chat_template_kwargs"] = self.chat_template_stage["chat_template_kwargs"]
        try:
            return Config.model_validate(fields)
        except ValidationError as exc:
            raise ValueError(f"engine_kwargs: {format_validation_error(exc)}") from None
