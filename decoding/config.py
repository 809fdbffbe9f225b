"""The one configuration model of specbatch, loadable from YAML with CLI overrides (docs/reference.md lists its
fields)."""

from __future__ import annotations

import json
import os
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# The drafters a config may name: the built-in ones, and any a plugin registers (``drafting.drafters.register_drafter``
# adds its method here when its module is imported, before a config names it).
DRAFT_METHODS = {"none", "ngram", "draft_model", "recycle"}


class SpeculativeConfig(_Strict):
    method: str = Field("draft_model", description="none | ngram | draft_model | recycle, or a registered drafter's")
    # The default needs no training and serves any target: the target drafts for itself through an int4 copy of
    # its weights (on chat prompts a lookup sibling beside it cost 10% at batch 1, on code and news it changed
    # little, so it is left out by default). A trained draft is a path or
    # the alias `specbatch train-draft` makes (smollm2-135m-instruct-draft; without it the engine falls back to
    # ngram with a warning, models.resolve_draft).
    model: str | None = Field("target", description="draft model path or alias, or 'target' (self-draft)")
    # vLLM's speculative_config.quantization: the draft's weights only, weight-only (int4 groupwise, int8 per
    # channel); null keeps them as loaded. With model 'target' it makes the target its own draft.
    quantization: Literal["int4", "int8"] | None = "int4"
    # n-gram lookup continuations added as extra siblings of a draft_model or recycle tree, verified in the same
    # forward.
    ngram_candidates: int = Field(0, ge=0, le=8)
    num_speculative_tokens: int = Field(5, ge=0, le=32, description="maximum draft depth")
    num_candidates: int = Field(1, ge=1, le=16, description="width: candidates verified per step")
    candidate_init: Literal["target", "draft"] = "draft"
    replacement: bool = False
    length_policy: Literal["static", "heuristic", "online", "threshold", "decision"] = "online"
    acceptance_head: str | None = None
    decision_model: str | None = None
    # SWIFT: the self-draft runs only some of the target's layers. A list names the layers it skips (indices from
    # 0); 'auto' finds the set during the run among a few candidates, by measured tokens per second.
    layer_skip: Literal["auto"] | list[Annotated[int, Field(ge=0)]] | None = None
    # recycle: nodes per row of the static recycling tree (num_candidates: successors kept per token, the most
    # children a node has); null sizes it by the device and batch_size.
    tree_nodes: int | None = Field(None, ge=1, le=1024)
    # SpecDec++: stop drafting once the predicted P(at least one rejection) exceeds this.
    stop_threshold: float = Field(0.7, gt=0.0, lt=1.0)
    # ngram lookup: longest and shortest suffix matched against prompt + output.
    prompt_lookup_max: int = Field(4, ge=1)
    prompt_lookup_min: int = Field(1, ge=1)

    @field_validator("method")
    @classmethod
    def _known_method(cls, method: str) -> str:
        if method not in DRAFT_METHODS:
            raise ValueError(f"unknown method '{method}': one of {', '.join(sorted(DRAFT_METHODS))} (a drafter "
                             "plugin's module must be imported before a config names it)")
        return method

    @model_validator(mode="after")
    def _check_method(self) -> SpeculativeConfig:
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative.model is required when speculative.method is 'draft_model'")
        # The defaults of quantization and ngram_candidates belong to the default self-draft: a config that names
        # another draft or method without setting them gets vLLM's neutral values; set explicitly, they must fit.
        # Lookup siblings join a model's tree: other methods have none (method ngram drafts with lookup alone), so
        # a config switched to another method, as bench and the draft fallback do, keeps validating.
        explicit = self.model_fields_set
        self_draft = self.method == "draft_model" and self.model == "target"
        for name in ("quantization", "ngram_candidates"):
            if (not self_draft and name not in explicit) or (name == "ngram_candidates" and
                                                            self.method not in ("draft_model", "recycle")):
                object.__setattr__(self, name, None if name == "quantization" else 0)
        if self.method != "recycle":  # like lookup siblings: off for other methods
            object.__setattr__(self, "tree_nodes", None)
        if self.method != "draft_model":  # like lookup siblings: a self-draft's option, off for other methods
            object.__setattr__(self, "layer_skip", None)
        elif self.layer_skip is not None and self.model != "target":
            raise ValueError("speculative.layer_skip needs speculative.model 'target' (the target drafting for "
                             "itself with some of its layers)")
        if isinstance(self.layer_skip, list):
            if not self.layer_skip:
                raise ValueError("speculative.layer_skip is an empty list: give the layers to skip, 'auto' or null")
            if len(set(self.layer_skip)) != len(self.layer_skip):
                raise ValueError(f"speculative.layer_skip lists a layer twice: {self.layer_skip}")
            object.__setattr__(self, "layer_skip", sorted(self.layer_skip))
        if self.length_policy == "threshold" and not self.acceptance_head:
            raise ValueError("speculative.acceptance_head is required for length_policy 'threshold'")
        if self.length_policy == "decision" and not self.decision_model:
            raise ValueError("speculative.decision_model is required for length_policy 'decision'")
        if self.length_policy in ("threshold", "decision") and self.method != "draft_model":
            raise ValueError(f"length_policy '{self.length_policy}' needs method 'draft_model'")
        return self

    @property
    def max_depth(self) -> int:
        """The deepest a tree drafts: ``num_speculative_tokens``, or 0 for plain decoding (method none)."""
        return self.num_speculative_tokens if self.method != "none" else 0


# vLLM's rule: a temperature below this samples greedily (dividing logits by less overflows float32).
GREEDY_TEMPERATURE = 1e-5
# Bounds on list fields a request sends: each stop string is matched against every new token's text.
MAX_STOPS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# logit_bias entries (OpenAI's bound); allowed_token_ids as long as the largest vocabularies (262,144 tokens).
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 18
# Bad words are matched against every tree node's history, each against as many tokens as it spells.
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 128
# vLLM's bound on each bias (it clamps rather than refuses).
MAX_LOGIT_BIAS_VALUE = 100.0
_TOKEN_ID = Annotated[int, Field(ge=0, lt=2**31)]
_STOP = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
_BAD_WORD = Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]
_DECIMAL = re.compile(r"-?[0-9]+")


# Deepest nesting accepted in a value a request carries (a JSON schema included): deeper values are refused before
# anything recurses into them (json, pydantic, Arrow, the grammar compiler).
MAX_DEPTH = 32


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` (dicts and lists) nests deeper than ``limit``, found without recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list | tuple) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _printable(name: str) -> str:
    if not name.isprintable():
        raise ValueError(f"a model's name must not hold control characters such as line breaks (got {quote(name)})")
    return name


# A model's name as clients send it (``served_model_name``, a router's ``model_id``): it comes back in responses,
# log lines and metric labels, so no control character (a line break would end a log line or an exported label).
# Any other character is fine: labels are escaped, and Ray's metrics export gets it as ASCII (frontend.metrics).
ModelName = Annotated[str, Field(min_length=1), AfterValidator(_printable)]
# The target weights a model may run as stored (Config.quantization); vLLM's engine_kwargs.quantization takes them.
Quantization = Literal["auto", "gguf", "awq", "gptq", "compressed-tensors"]


CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputs(BaseModel):
    """vLLM's ``StructuredOutputsParams``: one constraint on the generated text (``constraints/grammar.py``
    compiles it).

    ``json`` is a JSON schema (an object or its JSON text), ``regex`` a regular expression, ``choice`` a list of
    strings the output is exactly one of, ``grammar`` an EBNF (GBNF) or Lark grammar, ``json_object: true`` any
    JSON object. A constraint that does not parse is refused here, naming the field.
    """

    # "json" would shadow BaseModel.json: the field is schema_ under the wire name "json".
    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_by_name=True,
                              serialize_by_alias=True, frozen=True)

    schema_: dict[str, Any] | str | None = Field(None, alias="json", description="JSON schema (object or JSON text)")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    # JSON without whitespace between tokens (xgrammar's any_whitespace=False: separators ", " and ": ").
    disable_any_whitespace: bool = False
    # Properties a schema does not declare are never generated whatever this says (the grammar engine's strict
    # mode); vLLM's flag aligns its other backends with that.
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    @field_validator("whitespace_pattern", "structural_tag")
    @classmethod
    def _unsupported(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported (json, regex, choice, grammar and json_object are)")
        return value

    @field_validator("schema_", mode="before")
    @classmethod
    def _schema_object(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except RecursionError:
                raise ValueError(f"the schema nests deeper than {MAX_DEPTH} levels") from None
            except ValueError as exc:
                raise ValueError(f"the schema is not JSON ({exc})") from None
        if isinstance(value, bool):  # JSON Schema's true (anything) / false (nothing): not a record format
            raise ValueError("the schema must be a JSON object")
        if isinstance(value, dict) and too_deep(value):
            raise ValueError(f"the schema nests deeper than {MAX_DEPTH} levels")
        return value

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        given = [kind for kind in CONSTRAINT_KINDS if self.spec(kind) is not None]
        if len(given) != 1:
            found = f"got {', '.join(given)}" if given else "got none"
            raise ValueError(f"structured outputs take exactly one of {', '.join(CONSTRAINT_KINDS)} ({found})")
        from decoding.constraints.grammar import (  # xgrammar loads when a constraint appears
            GrammarError,
            check_constraint,
        )

        try:
            check_constraint(self.constraint)
        except GrammarError as exc:
            raise ValueError(str(exc)) from None
        return self

    def spec(self, kind: str) -> Any:
        """The value of constraint ``kind``; None when unset (``json_object: false`` counts as unset)."""
        if kind == "json":
            return self.schema_
        value = getattr(self, kind)
        return value if value is not False else None

    @property
    def kind(self) -> str:
        return next(kind for kind in CONSTRAINT_KINDS if self.spec(kind) is not None)

    @property
    def constraint(self) -> Constraint:
        """The hashable key a compiled grammar is cached under."""
        kind, spec = self.kind, self.spec(self.kind)
        text = json.dumps(spec) if kind in ("json", "choice") else spec if kind != "json_object" else ""
        return Constraint(kind, text, not self.disable_any_whitespace)


@dataclass(frozen=True)
class Constraint:
    """A row's constraint in canonical form: ``kind`` (one of CONSTRAINT_KINDS), ``text`` (the schema as
    JSON, the regex, the choices as a JSON list, the grammar; empty for json_object), ``any_whitespace``."""

    kind: str
    text: str
    any_whitespace: bool = True


# vLLM's older field names, each accepted for its current one (Ray Data LLM's examples use guided_decoding).
OLDER_NAMES = {"guided_decoding": "structured_outputs"}


class SamplingParams(_Strict):
    """vLLM's ``SamplingParams`` names (config ``sampling``, per-row ``sampling_params``, the HTTP request fields).

    These field declarations are the one set of limits: vLLM's (``SamplingParams._verify_args`` and its OpenAI
    server), tighter where an engine step needs it (list lengths, ``n``, ``max_tokens``, ``repetition_penalty``).
    ``decoding.params.resolve_sampling`` applies them for the pipeline, the server and the engine alike, with the
    checks that need the model. Fields the engine cannot honour are refused by name (``extra="forbid"``), never
    ignored. Every field is strictly typed (``max_tokens: 4.0`` or ``true`` is refused, as JSON clients expect),
    so a valid value can never fail inside an engine step.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)

    # Bounds tighter than vLLM's are an engine's: n (vLLM 16384) and max_tokens each size rows and queues, top_k and
    # seed become int64 tensors, the list lengths bound the per-token stop checks.
    n: int = Field(1, ge=1, le=128, description="sequences per request (the server's choices)")
    # vLLM's [0, 2] (OpenAI's range); finite, so that dividing logits by it stays finite.
    temperature: float = Field(0.0, ge=0.0, le=2.0, description=f"below {GREEDY_TEMPERATURE:g}: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="the most likely token is always kept")
    top_k: int = Field(0, ge=-1, lt=2**63, description="0 or -1 (vLLM) disables top-k")
    max_tokens: int = Field(256, ge=1, le=1_000_000)
    min_tokens: int = Field(0, ge=0, le=1_000_000, description="EOS and stop_token_ids are banned until this many")
    # Config: the run seed (null = fresh randomness); per row: that row's own seed (vLLM's semantics).
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: list[_STOP] = Field(default_factory=list, max_length=MAX_STOPS)
    stop_token_ids: list[_TOKEN_ID] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # vLLM's is any finite value above 0; logits are divided or multiplied by it in float32, and dividing by a
    # value near 0 overflows them: the factor and its inverse stay within 100.
    repetition_penalty: float = Field(1.0, ge=0.01, le=100.0)
    # vLLM's min_p: after temperature, tokens less likely than min_p times the most likely one are dropped (before
    # top-k and top-p).
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="0 disables min-p")
    # Added to the raw logits before anything else, each clamped to [-100, 100] as vLLM does; keys are token ids,
    # JSON's string keys ("50256") included.
    logit_bias: dict[_TOKEN_ID, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # Only these tokens may be generated.
    allowed_token_ids: list[_TOKEN_ID] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    # vLLM's: a word's last token is banned where the output so far ends with its other tokens (a one-token word:
    # always); each word counts with and without a leading space (decoding.params.bad_words_token_ids).
    bad_words: list[_BAD_WORD] = Field(default_factory=list, max_length=MAX_BAD_WORDS)
    # 20: vLLM's default max_logprobs (its -1, the whole vocabulary, is not offered).
    logprobs: int | None = Field(None, ge=0, le=20, description="top alternatives returned with each token")
    # Per prompt token (the first None): its log-probability given the tokens before it, and the top alternatives.
    # A row asking for them takes nothing from the prefix cache (a cached prefix has no logits), as in vLLM.
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="top alternatives per prompt token")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    # A constraint on the output (decoding.constraints.grammar); also under its older name (OLDER_NAMES).
    structured_outputs: StructuredOutputs | None = None

    @staticmethod
    def current_names(data: Mapping[str, Any]) -> dict[str, Any]:
        """``data`` with every older field name (``OLDER_NAMES``) replaced by vLLM's current one, the only place
        that renames: a request's fields are renamed before they are merged onto configured ones, so that an older
        name replaces a configured value under the current name. Both names given is refused."""
        data = dict(data)
        for older, current in OLDER_NAMES.items():
            if older not in data:
                continue
            value = data.pop(older)
            if value is not None and data.get(current) is not None:
                raise ValueError(f"give {current} or its older name {older}, not both")
            if value is not None:
                data[current] = value
        return data

    @model_validator(mode="before")
    @classmethod
    def _older_names(cls, data: Any) -> Any:
        return cls.current_names(data) if isinstance(data, Mapping) else data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        stops = [value] if isinstance(value, str) else value
        # An empty stop string would end every sequence before its first token.
        if isinstance(stops, list) and any(stop == "" for stop in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_id_keys(cls, value: Any) -> Any:
        # JSON objects have string keys: a decimal string is the token id it spells; a key neither an integer nor
        # one is refused here. A bigger mapping is refused by its bound first, before any key is read.
        if not isinstance(value, Mapping):
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
        keys = [key for key in value if isinstance(key, str)]
        if bad := [key for key in keys if not _DECIMAL.fullmatch(key)]:
            raise ValueError(f"keys must be token ids (integers or their decimal strings), got {quote(bad[0])}")
        return {int(key) if isinstance(key, str) else key: bias for key, bias in value.items()} if keys else value

    @field_validator("logit_bias")
    @classmethod
    def _clamped(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value is None:
            return None
        return {token: min(MAX_LOGIT_BIAS_VALUE, max(-MAX_LOGIT_BIAS_VALUE, bias)) for token, bias in value.items()}

    @field_validator("bad_words")
    @classmethod
    def _spelled_words(cls, value: list[str]) -> list[str]:
        if any(not word.strip() for word in value):
            raise ValueError("bad words must have a character other than whitespace")
        return list(dict.fromkeys(value))  # vLLM's: each word once

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, value: int) -> int:
        return 0 if value == -1 else value

    @field_validator("temperature")
    @classmethod
    def _tiny_is_greedy(cls, value: float) -> float:
        return 0.0 if value < GREEDY_TEMPERATURE else value

    @model_validator(mode="after")
    def _check_consistent(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize: true (use stop_token_ids to stop on tokens)")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def bans_tokens(self) -> bool:
        """Whether some token may be banned outright (-inf) before the grammar's masks: min_tokens, allowed_token_ids,
        bad_words."""
        return bool(self.min_tokens or self.allowed_token_ids is not None or self.bad_words)

    @property
    def penalized(self) -> bool:
        """Whether logits need the penalty / ban pass (decoding.verification.sampling.Penalties): penalties,
        logit_bias and the bans."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
            or self.bans_tokens
        )

    def stop_ids(self, eos_ids: Any) -> set[int]:
        """Tokens that end the sequence: EOS (unless ignore_eos) and stop_token_ids, as vLLM."""
        return set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_ids))


class ExecutionConfig(_Strict):
    """How forwards run, resolved once when the engine is built (``decoding.model.execution``) and logged.

    ``graphs``: auto replays the target's forwards (decode steps, verifications, a self-draft's levels) as CUDA
    graphs captured at build on CUDA; off runs them launch by launch. ``kernels``: auto is the C++ attention kernel
    on a CPU and the fused Triton kernels on CUDA; reference is the readable torch path; triton runs the Triton
    kernels (on a CPU under Triton's interpreter: slow, for tests). ``compile``: auto compiles the layer stack ahead
    of time on a CPU (with the C++ kernel); off keeps it eager. ``graph_memory_mb``: device memory the graphs
    captured at build may take (set aside before the KV pool is sized).
    """

    graphs: Literal["auto", "off"] = "auto"
    kernels: Literal["auto", "reference", "triton"] = "auto"
    compile: Literal["auto", "off"] = "auto"
    graph_memory_mb: int = Field(1024, ge=0, le=1 << 20)


class LoraConfig(_Strict):
    """LoRA adapters (PEFT folders) applied per row over the one base model (``decoding.model.lora``).

    ``max_loras``: adapters resident on the device at once (a row whose adapter finds no free slot waits);
    ``max_lora_rank``: the largest rank (slots are this wide); ``max_cpu_loras``: adapters kept read on the host
    (least recently used first out); ``modules``: adapter name -> folder or URI; ``dynamic_lora_loading_path``: a
    folder or URI under which any other name is looked up as ``<path>/<name>``."""

    enable: bool = False
    max_loras: int = Field(4, ge=1, le=256)
    max_lora_rank: int = Field(16, ge=1, le=512)
    max_cpu_loras: int = Field(16, ge=1, le=1 << 16)
    modules: dict[Annotated[str, Field(min_length=1, max_length=256)], str] = Field(default_factory=dict)
    dynamic_lora_loading_path: str | None = None
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: the server's /v1/load_lora_adapter and /v1/unload_lora_adapter work.
    allow_runtime_lora_updating: bool = Field(
        default_factory=lambda: os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"))

    @model_validator(mode="after")
    def _cpu_holds_the_device(self) -> LoraConfig:
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if not self.enable and (self.modules or self.dynamic_lora_loading_path):
            what = "modules" if self.modules else "dynamic_lora_loading_path"
            raise ValueError(f"{what} names adapters, but enable is false: set lora.enable: true")
        return self


class LimitsConfig(_Strict):
    """Bounds on the work one request or row may cause. A request past one fails alone (HTTP 400, or an error row)
    with a message naming the limit; nothing it sends runs unbounded on the engine's stepping thread."""

    # A prompt (or the messages' text) longer than this in UTF-8 bytes is refused before it is tokenized. Default:
    # the context times the vocabulary's longest token in bytes, so no prompt that fits the context is refused.
    max_prompt_bytes: int | None = Field(None, ge=1)
    # A constraint's text (schema, regex, grammar, choices as JSON) longer than this is refused before compiling:
    # compiling 5,000 choices (164 KB) took 1.7 s and 26 MB for SmolLM2's vocabulary, and grows faster than its text.
    max_constraint_bytes: int = Field(128 << 10, ge=1)
    # Compiling one constraint against the vocabulary: longer than this fails its request.
    grammar_compile_timeout_s: float = Field(10.0, gt=0.0, le=3600.0)
    # A compiled grammar larger than this fails its request; the cache of compiled grammars holds at most
    # grammar_cache_bytes (least recently used first out).
    max_grammar_bytes: int = Field(64 << 20, ge=1)
    grammar_cache_bytes: int = Field(512 << 20, ge=0)
    # An engine step running longer than this inside one request's constraint work is stopped and that request
    # fails alone; elsewhere, a server reports unhealthy (/health 503) and Serve replaces it. A step prefills what
    # it admits: 64 rows of 2,048 tokens take about a minute of prefill on a 2-core CPU.
    step_timeout_s: float = Field(300.0, gt=0.0)


class Config(_Strict):
    model: str = "smollm2-135m-instruct"
    # vLLM's: the model's name in the HTTP API (/v1/models, the ``model`` field of requests); default: ``model``.
    served_model_name: ModelName | None = None
    # vLLM's --api-key: every HTTP route but /health, /ping and /metrics needs "Authorization: Bearer <key>" (else
    # SPECBATCH_API_KEY or VLLM_API_KEY). Never written out with the configuration.
    api_key: SecretStr | None = Field(None, exclude=True)
    # /metrics is open to any scraper, as vLLM's server leaves it; true: it needs the API key too (when one is set).
    metrics_require_api_key: bool = False
    # Serve's name: on SIGTERM/SIGINT the server finishes the requests it holds for up to this long.
    graceful_shutdown_timeout_s: float = Field(20.0, ge=0.0, le=3600.0)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    batch_size: int = Field(16, ge=1, le=1024, description="sequences decoded together inside one actor")
    max_num_seqs: int | None = Field(None, ge=1, le=1024, description="vLLM's name of batch_size")
    # The paged KV cache (vLLM's names): positions per block, and the pool's size, from an explicit block count, a
    # byte budget, or (on a GPU) the share of the device's memory the model and the pool may take. CPU default:
    # the pool holds batch_size rows of max_model_len positions, at most 4 GiB (pages are committed as they are
    # first written, so an idle pool costs address space only).
    block_size: Literal[16, 32, 64] = 16
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    max_model_len: int | None = Field(None, ge=16, description="context limit; default: the model's")
    # Most prompt tokens in one prefill forward (vLLM's per-step token budget); a longer prompt runs alone.
    # 2048: 64 XSum prompts' prefill took 17.8-19.0 s, 19.5 s at 4096, 20.7-24.0 s at 8192 (2-core CPU, float32).
    max_num_batched_tokens: int = Field(2048, ge=16)
    # vLLM's: full KV blocks of prompts are shared between rows by content, so a prefix many rows share (a system
    # prompt, a few-shot template, a document asked several questions) is prefilled once while it stays cached.
    enable_prefix_caching: bool = True
    concurrency: int | tuple[int, int] = Field(1, description="number of actors (int, or [min, max])")
    num_gpus: float = Field(0, ge=0)
    # Actors or replicas the cluster cannot hold (more CPUs or GPUs than its nodes have) fail the job or the
    # server at once; an autoscaling cluster's nodes may take a while to come: wait up to this long for them.
    resource_wait_s: float = Field(0.0, ge=0.0, le=86400.0)
    # CPU cores per actor / replica (and torch threads on CPU); None = the machine's cores split over actors.
    num_cpus: float | None = Field(None, gt=0)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # vLLM's quantization: "auto" (default) runs a GGUF model's quantized blocks as stored where dtype is auto on a
    # CPU (the default model ships as one: Q4_1 layers, a Q8_0 embedding and head); "gguf" asks for them (a CPU in
    # float32, or a GPU); null, or dtype float32, runs the float weights transformers dequantizes. An AWQ, GPTQ or
    # compressed-tensors checkpoint runs its packed integers whatever this says, unless it names another method.
    quantization: Quantization | None = "auto"
    # vLLM's --trust-remote-code: the model's and tokenizer's own Python code (a hub repository's modeling files)
    # may run when they load; off, such a model fails to load naming the option.
    trust_remote_code: bool = False
    # vLLM's --chat-template (a file or the template itself; default: the tokenizer's) and
    # --default-chat-template-kwargs (variables the template reads, e.g. enable_thinking); requests and rows may
    # override both.
    # A built-in template's name is taken too: ``hermes`` (ChatML with tools, decoding/chat_templates.py).
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # vLLM's --tool-call-parser: how generated text becomes tool calls with tool_choice auto (frontend/tool_calls.py);
    # None: tools may be shown (tool_choice none) or required, but auto is refused.
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic"] | None = None
    # vLLM's --trust-request-chat-template: a request's (or row's) own chat_template is Jinja code run in the
    # engine's process with no bound on its cost, so it is refused unless this is true.
    trust_request_chat_template: bool = False
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @field_validator("chat_template")
    @classmethod
    def _template_file(cls, value: str | None) -> str | None:
        from decoding.chat_templates import builtin_template

        if (builtin := builtin_template(value)) is not None:
            return builtin
        if value and "{" not in value and "\n" not in value and Path(value).is_file():
            return Path(value).read_text()
        return value

    @model_validator(mode="after")
    def _batch_size_alias(self) -> Config:
        if self.max_num_seqs is not None:
            if "batch_size" in self.model_fields_set and self.batch_size != self.max_num_seqs:
                raise ValueError(f"batch_size ({self.batch_size}) and max_num_seqs ({self.max_num_seqs}) differ: "
                                 "max_num_seqs is vLLM's name of batch_size, set one")
            object.__setattr__(self, "batch_size", self.max_num_seqs)
        return self

    @field_validator("num_gpus")
    @classmethod
    def _one_device_per_actor(cls, value: float) -> float:
        # The engine keeps its model, caches and step on one device; reserving more would leave them idle.
        if value > 1:
            whole = value == int(value)
            hint = f"num_gpus: 1 with concurrency: {value:g}" if whole else "num_gpus <= 1 with more actors"
            raise ValueError(
                f"num_gpus is {value:g}, but one actor runs its engine on one GPU (no model sharding): use {hint} "
                "to use more GPUs"
            )
        return value

    @field_validator("concurrency")
    @classmethod
    def _check_concurrency(cls, value: int | tuple[int, int]) -> int | tuple[int, int]:
        low, high = (value, value) if isinstance(value, int) else value
        if low < 1 or high < low:
            raise ValueError("concurrency must be a positive int or [min, max] with 1 <= min <= max")
        return value

    @property
    def concurrency_range(self) -> tuple[int, int]:
        """(min, max) actors or replicas; a fixed count is both."""
        return (self.concurrency, self.concurrency) if isinstance(self.concurrency, int) else self.concurrency


class ConfigError(ValueError):
    """A configuration that does not validate; the message names the bad field and value."""


# A config file is at most this many bytes, read no further, and no larger with its aliases expanded (each value
# counting its text and one byte): a 572-byte file of nine nested aliases holds 9**9 values once expanded, which
# validating the config, quoting a bad value or writing the config out would build.
MAX_CONFIG_BYTES = 1 << 20
# The deepest a config's values nest: a request's values (MAX_DEPTH, a JSON schema's included) under its sections.
CONFIG_DEPTH = 2 * MAX_DEPTH


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, each node measured as it is composed: its depth, and its size with aliases expanded (an
    alias is the node it names, measured once where it was composed). Composing recurses per level, so a document
    nested too deep is refused on the way down, before the recursion runs out of stack."""

    def __init__(self, text: str | bytes, source: str) -> None:
        super().__init__(text)
        self.source, self.level = source, 0
        self.measured: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded size, levels from it down)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self.level += 1
        if self.level > CONFIG_DEPTH:
            raise ConfigError(f"{self.source} nests deeper than {CONFIG_DEPTH} levels")
        node = super().compose_node(parent, index)
        self.level -= 1
        size, height = self.measured.get(id(node)) or self._measure(node)
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{self.source} expands past {MAX_CONFIG_BYTES} bytes with its aliases")
        if self.level + height > CONFIG_DEPTH:  # an alias of a deep node, placed deep
            raise ConfigError(f"{self.source} nests deeper than {CONFIG_DEPTH} levels")
        return node

    def _measure(self, node: yaml.Node) -> tuple[int, int]:
        if isinstance(node, yaml.ScalarNode):
            measured = (len(node.value) + 1, 1)
        else:  # every child (a mapping's keys and values) was composed, so measured, before its parent
            children = node.value if isinstance(node, yaml.SequenceNode) else [n for pair in node.value for n in pair]
            sizes = [self.measured[id(child)] for child in children]
            measured = (1 + sum(size for size, _ in sizes), 1 + max((height for _, height in sizes), default=0))
        self.measured[id(node)] = measured
        return measured


def load_yaml(text: str | bytes, source: str) -> Any:
    """YAML ``text`` as Python values (PyYAML's safe loader), refused with a ``ConfigError`` naming ``source`` and the
    bound when it is larger than ``MAX_CONFIG_BYTES``, expands past it with its aliases, or nests deeper than
    ``CONFIG_DEPTH``: nothing past those is expanded or recursed into. Config files and command-line overrides."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source} is larger than {MAX_CONFIG_BYTES} bytes")
    loader = _BoundedLoader(text, source)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot read {source}: {exc}") from None
    finally:
        loader.dispose()


def read_yaml_file(path: str | Path) -> Any:
    """The YAML document of the file at ``path`` (see ``load_yaml``), read no further than its bound."""
    try:
        with open(path, "rb") as file:
            text = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    return load_yaml(text, f"config file {path}")


def _parse_override_value(raw: str, dotted: str) -> Any:
    # YAML scalars: "3" -> 3, "true" -> True, "[1, 2]" -> [1, 2], "null" -> None, other text stays text.
    return load_yaml(raw, f"override --{dotted}") if raw != "" else ""


def apply_overrides(data: dict[str, Any], overrides: dict[str, str]) -> dict[str, Any]:
    """Set dotted keys (``speculative.num_candidates``) from raw command-line strings."""
    for dotted, raw in overrides.items():
        node = data
        *parents, leaf = dotted.replace("-", "_").split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"cannot set '{dotted}': '{key}' is not a section")
        node[leaf] = _parse_override_value(raw, dotted)
    return data


def load_config(path: str | Path | None = None, overrides: dict[str, str] | None = None) -> Config:
    """Build the config from an optional YAML file plus dotted overrides; errors name field and value."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = read_yaml_file(path)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping, not {type(loaded).__name__}")
        data = loaded or {}
    apply_overrides(data, overrides or {})
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from exc


# Longest part of a bad value an error message quotes: a 1 MB value must not come back as a 1 MB message.
QUOTE_CHARS = 80


# A value's repr a few levels and items deep: never the whole of a nested value (a list holding itself nine times
# over, nine levels deep, reprs to gigabytes).
_BRIEF = reprlib.Repr()
_BRIEF.maxlevel = 3
_BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxdict = _BRIEF.maxset = _BRIEF.maxfrozenset = _BRIEF.maxdeque = 16
_BRIEF.maxstring = _BRIEF.maxother = QUOTE_CHARS


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters with the full length said (``'xxx...' (1048576 chars)``); a
    nested value is shown three levels and 16 items deep at most before it is cut."""
    if isinstance(value, str | bytes) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} {'chars' if isinstance(value, str) else 'items'})"
    text = _BRIEF.repr(value)
    text = text if len(text) <= limit else f"{text[:limit]}..."
    return f"{text} ({len(value)} items)" if isinstance(value, list | tuple) and len(value) > limit else text


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """One line per error, each naming its field (under ``prefix``) and the value given."""
    lines = []
    for err in exc.errors():
        parts = [str(part) for part in (prefix, *err["loc"]) if part != ""]
        field = ".".join(parts) or "config"
        value = err.get("input")
        # A validator's own sentence reads without pydantic's "Value error, "; one that names a field inside its
        # own (a constraint's "invalid structured_outputs.regex: ...") names it under the same path.
        message = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
        if parts and message.startswith(f"invalid {parts[-1]}"):
            lines.append(f"invalid {'.'.join(parts[:-1] + [message.removeprefix('invalid ')])}")
            continue
        shown = "" if isinstance(value, dict) else f" (got {quote(value)})"
        lines.append(f"invalid {field}{shown}: {message}")
    return "; ".join(lines)
