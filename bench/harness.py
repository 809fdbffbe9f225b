"""Side-by-side throughput benchmark (``specbatch bench``): transformers against the engine's configurations.

Everything runs in one process, on the same prompts and the same loaded models. Contenders of one batch size take
turns, engine step by engine step (see ``_interleaved``), so the drift of a shared machine reaches all of them alike:
transformers ``generate`` (a batch-1 loop, and left-padded batches for larger batch sizes), transformers assisted
generation at batch 1 (``assistant_model`` for ``draft_model``, prompt lookup for ``ngram``), the engine with
method ``none`` at every batch size, a grid of the engine's speculative configurations, and, given another
checkout (``baseline.py``), that checkout's engine beside each of this one's.

Profiling is measured from the outside: forward hooks time the target (and a transformers assistant), and the
engine's drafter methods are wrapped, so the engine itself is benchmarked unmodified. Times are device time
(``measure.Clock``: CUDA events on a GPU, read once a turn); each row also gets its decode steps' mean time, the
bytes they move (weights and cached keys and values read) and the share of the device's memory bandwidth, and
each engine row the kernel launches of one decode step, counted apart from the timed runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
import logging
import platform
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

import torch
import transformers
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from bench.baseline import convert_model
from bench.measure import Bandwidth, Clock, ForwardBytes, bandwidth_fraction, count_launches, device_bandwidth
from decoding import stats as stats_module
from decoding.config import Config, SamplingParams
from decoding.drafting.feature_draft import load_draft
from decoding.engine import Request, encode_request, eos_token_ids
from decoding.engine import engine as engine_module
from decoding.model.loading import SELF_DRAFT, load_model, load_tokenizer, model_gguf, runs_gguf_blocks
from decoding.stats import SpecDecodeStats

log = logging.getLogger(__name__)

LengthPolicyName = Literal["static", "heuristic", "online", "threshold", "decision"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DraftChoice(_Strict):
    """The draft of ``draft_model`` contenders: a model (``target``: the target drafts for itself), its
    weight-only quantization, n-gram lookup siblings beside its candidates, and the layers a self-draft skips."""

    model: str | None = None  # None: the config's speculative.model
    quantization: Literal["int4", "int8"] | None = None
    ngram_candidates: int = 0
    layer_skip: Literal["auto"] | list[int] | None = None


class Sweep(_Strict):
    """A cartesian product of engine configurations; a field left out keeps the config's value."""

    batch_sizes: list[int] | None = None
    methods: list[Literal["ngram", "draft_model", "recycle"]] | None = None
    num_candidates: list[int] | None = None
    num_speculative_tokens: list[int] | None = None
    candidate_init: list[Literal["target", "draft"]] | None = None
    length_policy: list[LengthPolicyName] | None = None
    drafts: list[DraftChoice] | None = None  # for method draft_model
    tree_nodes: list[int | None] | None = None  # for method recycle: nodes of its static tree (null: sized by default)
    prefix_caching: list[bool] | None = None  # enable_prefix_caching (engine none runs each value too)
    quantization: list[Literal["auto", "gguf"] | None] | None = None  # Config.quantization, engine none too


def _default_sweeps() -> list[Sweep]:
    return [
        # Width x who starts each candidate x whether the depth adapts, one sequence at a time.
        Sweep(batch_sizes=[1], num_candidates=[1, 2, 4], candidate_init=["draft", "target"],
              length_policy=["static", "online"]),
        # Fixed draft depths at the configured width.
        Sweep(batch_sizes=[1], num_speculative_tokens=[2, 4, 8], length_policy=["static"]),
        # The configured batch size, where speculation competes with batching for the same compute.
        Sweep(num_candidates=[1, 2], length_policy=["static", "online"]),
    ]


class BenchGrid(_Strict):
    """What ``specbatch bench`` runs besides the engine-none baselines (YAML via ``--grid``)."""

    sweeps: list[Sweep] = Field(default_factory=_default_sweeps)
    transformers: bool = Field(True, description="transformers generate at every batch size")
    assisted: bool = Field(True, description="transformers assisted generation at batch 1, for each method")
    llama_cpp: bool = Field(True, description="llama.cpp (the llama-cpp-python package, where installed) decoding "
                            "the model's GGUF at batch 1, prefill included")
    turns: Literal["step", "chunk"] = Field(
        "step", description="how contenders of one batch size take turns on a chunk of prompts: one engine step "
        "each ('step'; their KV caches are in memory together) or the whole chunk each ('chunk'; one at a time)")

    def override(self, **fields: list[Any] | None) -> BenchGrid:
        """Set the given sweep fields (those not None) in every sweep."""
        changes = {k: v for k, v in fields.items() if v is not None}
        return self.model_copy(update={"sweeps": [s.model_copy(update=changes) for s in self.sweeps]})


@dataclass(frozen=True)
class Contender:
    # baseline: the other checkout's engine; llama_cpp: llama-cpp-python over the model's GGUF
    kind: Literal["transformers", "assisted", "engine", "baseline", "llama_cpp"]
    config: Config  # batch size, method and speculative settings of this contender

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    @property
    def method(self) -> str:
        return self.config.speculative.method

    @property
    def is_engine(self) -> bool:
        return self.kind in ("engine", "baseline")

    @property
    def speculative(self) -> bool:
        return self.is_engine and self.method != "none"

    @property
    def name(self) -> str:
        if self.kind == "transformers":
            return "transformers generate"
        if self.kind == "llama_cpp":
            return "llama.cpp generate"
        if self.kind == "assisted":
            return "transformers assisted " + ("(prompt lookup)" if self.method == "ngram" else "(draft)")
        if self.kind == "baseline":
            return "baseline " + Contender("engine", self.config).name
        if self.is_engine and self.config.quantization != "auto":
            return Contender(self.kind, self.config.model_copy(update={"quantization": "auto"})).name + \
                f" {self.config.quantization or 'dequantized'}"
        if self.is_engine and not self.config.enable_prefix_caching:
            return Contender(self.kind, self.config.model_copy(update={"enable_prefix_caching": True})).name + \
                " no-prefix-cache"
        if not self.speculative:
            return "engine none"
        spec = self.config.speculative
        draft = ""
        if self.method == "draft_model":
            draft = "self" if spec.model == SELF_DRAFT else ""
            draft += f"-{spec.quantization}" if spec.quantization else ""
            draft += f"+lookup{spec.ngram_candidates}" if spec.ngram_candidates else ""
            if spec.layer_skip is not None:
                draft += "-skip" + ("auto" if spec.layer_skip == "auto" else ",".join(map(str, spec.layer_skip)))
            draft = f" {draft.lstrip('-')}" if draft else ""
        if self.method == "recycle" and spec.tree_nodes:
            draft = f" tree{spec.tree_nodes}"
        return (f"engine {self.method}{draft} w{spec.num_candidates} d{spec.num_speculative_tokens} "
                f"init={spec.candidate_init} {spec.length_policy}")


def _variant(config: Config, batch_size: int, caching: bool | None = None, target_quantization: str | None = "",
             **speculative: Any) -> Config:
    """``config`` at ``batch_size`` with these speculative fields, ``enable_prefix_caching`` (None: kept) and
    the target's ``quantization`` (empty: kept)."""
    data = config.model_dump()
    data["batch_size"] = batch_size
    data["speculative"].update(speculative)
    if caching is not None:
        data["enable_prefix_caching"] = caching
    if target_quantization != "":
        data["quantization"] = target_quantization
    return Config.model_validate(data)


def contenders(config: Config, grid: BenchGrid, baseline: bool = False) -> list[Contender]:
    """Every run of the benchmark, baselines first within each batch size; duplicates removed. ``baseline``: each
    engine contender is followed by the same configuration of the baseline checkout's engine."""
    engine: dict[tuple, Config] = {}
    for sweep in grid.sweeps:
        spec = config.speculative
        methods = sweep.methods or ([spec.method] if spec.method != "none" else [])
        axes = itertools.product(
            sweep.batch_sizes or [config.batch_size],
            methods,
            sweep.num_candidates or [spec.num_candidates],
            sweep.num_speculative_tokens or [spec.num_speculative_tokens],
            sweep.candidate_init or [spec.candidate_init],
            sweep.length_policy or [spec.length_policy],
            sweep.prefix_caching or [config.enable_prefix_caching],
            sweep.quantization or [config.quantization],
        )
        for batch, method, width, depth, init, policy, caching, quantization in axes:
            init = "draft" if width == 1 else init  # one candidate: both inits build the same chain
            drafts = (sweep.drafts or [None]) if method == "draft_model" else [None]
            trees = (sweep.tree_nodes or [spec.tree_nodes]) if method == "recycle" else [None]
            for choice, nodes in itertools.product(drafts, trees):
                draft = {} if choice is None else {
                    "model": choice.model or spec.model, "quantization": choice.quantization,
                    "ngram_candidates": choice.ngram_candidates, "layer_skip": choice.layer_skip,
                }
                if nodes is not None:
                    draft["tree_nodes"] = nodes
                key = (batch, method, width, depth, init, policy, caching, quantization,
                       repr(tuple(draft.values())))
                engine.setdefault(key, _variant(
                    config, batch, caching, quantization, method=method, num_candidates=width,
                    num_speculative_tokens=depth,
                    candidate_init=init, length_policy=policy, **draft,
                ))
    batch_sizes = sorted({b for s in grid.sweeps for b in s.batch_sizes or [config.batch_size]} or {config.batch_size})
    methods = sorted({key[1] for key in engine})
    runs = []
    for batch in batch_sizes:
        if grid.transformers:
            runs.append(Contender("transformers", _variant(config, batch, method="none")))
        if grid.assisted and batch == 1:
            # transformers can assist with a loaded draft or with prompt lookup, not with a self-draft
            assistable = [m for m in methods if m == "ngram" or (m == "draft_model"
                                                                 and config.speculative.model != SELF_DRAFT)]
            runs += [Contender("assisted", _variant(config, 1, method=m)) for m in assistable]
        if grid.llama_cpp and batch == 1 and llama_cpp_runs(config.model):
            runs.append(Contender("llama_cpp", _variant(config, 1, method="none")))
        cachings = sorted({config.enable_prefix_caching} | {
            caching for sweep in grid.sweeps if batch in (sweep.batch_sizes or [config.batch_size])
            for caching in sweep.prefix_caching or []}, reverse=True)
        quantizations = sorted({config.quantization} | {
            quantization for sweep in grid.sweeps if batch in (sweep.batch_sizes or [config.batch_size])
            for quantization in sweep.quantization or []}, key=lambda quantization: quantization or "")
        engines = [_variant(config, batch, caching, quantization, method="none") for quantization in quantizations
                   for caching in cachings] + [c for key, c in engine.items() if key[0] == batch]
        for engine_config in engines:
            runs.append(Contender("engine", engine_config))
            if baseline:
                runs.append(Contender("baseline", engine_config))
    return runs


class BenchRow(BaseModel):
    prompt_set: str
    name: str
    batch_size: int
    method: str
    num_candidates: int | None
    num_speculative_tokens: int | None
    candidate_init: str | None
    length_policy: str | None
    prompts: int
    generated_tokens: int
    seconds: float
    tokens_per_s: float
    speedup_vs_transformers: float | None = None
    speedup_vs_none: float | None = None
    mean_acceptance_length: float | None  # vLLM's: 1 + accepted / spec steps (decoding.stats), engine only
    tokens_per_forward: float | None  # generated tokens / per-sequence target forwards (prefill included)
    acceptance_rate: float | None
    target_forwards_per_token: float
    identical: bool | None = None  # outputs equal transformers generate's, at temperature 0
    mismatches: int | None = None  # prompts whose outputs differ
    slower_than_none: bool = False  # a speculative engine configuration slower than engine none
    draft_s: float  # seconds in the drafter (engine) or the assistant model's forwards (transformers)
    target_s: float  # seconds in target model forwards (prefill, decode, verification)
    other_s: float  # the rest: sampling, acceptance, cache bookkeeping, Python
    # Decode steps: engine steps that admitted no prompt, transformers' generate iterations after the prefill.
    decode_steps: int = 0
    ms_per_step: float | None = None
    bytes_per_step: float | None = None  # weights and cached keys/values read by the step's forwards
    bandwidth_fraction: float | None = None  # bytes_per_step / ms_per_step over the device's memory bandwidth
    # Kernel launches of one decode step over batch_size rows (engine; counted after the timed runs): device kernels
    # on CUDA (the profiler), aten operations dispatched elsewhere; per layer: over the layer forwards of that step
    # (target layers x target forwards + draft layers x draft forwards), embedding, head and sampling included.
    launches_per_step: int | None = None
    launches_per_layer: float | None = None
    drafted_per_step: float | None = None  # draft tokens per decode step (engine)
    prefix_cache_hit_rate: float | None = None  # prompt tokens found in the prefix cache / prompt tokens (engine)


class BenchResult(BaseModel):
    environment: dict[str, Any]
    config: dict[str, Any]
    grid: dict[str, Any]
    prompt_sets: dict[str, int]
    rows: list[BenchRow]


# ------------------------------------------------------------------------------------------------ measuring
@dataclass
class _Profile:
    target_s: float = 0.0
    target_rows: int = 0  # sequences forwarded through the target, summed over its forward calls
    draft_s: float = 0.0

    def add(self, name: str, seconds: float) -> None:
        setattr(self, name, getattr(self, name) + seconds)


def _rows_of(args: tuple, kwargs: dict[str, Any]) -> int:
    tensor = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if tensor is None:
        tensor = args[0]
    return int(tensor.shape[0])


@contextmanager
def _timed_forwards(module: torch.nn.Module, clock: Clock, on_done: Callable[[float, int], None]) -> Iterator[None]:
    """Each forward of ``module`` as a clock span (device time: no waits on a GPU) with its row count."""
    starts: list[Any] = []
    rows: list[int] = []

    def before(_module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        rows.append(_rows_of(args, kwargs))
        starts.append(clock.mark())

    def after(_module: torch.nn.Module, _args: tuple, _kwargs: dict[str, Any], _output: Any) -> None:
        count = rows.pop()
        clock.add(starts.pop(), clock.mark(), lambda seconds: on_done(seconds, count))

    handles = [module.register_forward_pre_hook(before, with_kwargs=True),
               module.register_forward_hook(after, with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _on_forward(module: torch.nn.Module | None, call: Callable[[tuple, dict[str, Any]], None]) -> Iterator[None]:
    """``call(args, kwargs)`` before each forward of ``module`` (nothing when None)."""
    handle = module.register_forward_pre_hook(lambda _m, a, k: call(a, k), with_kwargs=True) if module else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def _time_methods(obj: Any, names: tuple[str, ...], clock: Clock, on_done: Callable[[float], None]) -> None:
    """Wrap instance methods so their time counts as drafting (the engine is only used once per run)."""
    for name in names:
        method = getattr(obj, name, None)
        if method is None:
            continue

        def timed(*args: Any, _method: Callable = method, **kwargs: Any) -> Any:
            with clock.span(on_done):
                return _method(*args, **kwargs)

        setattr(obj, name, timed)


@dataclass(frozen=True)
class Launches:
    per_step: int
    layer_forwards: int  # target layers x target forwards + draft layers x draft forwards, in that step

    @property
    def per_layer(self) -> float | None:
        return self.per_step / self.layer_forwards if self.layer_forwards else None


@dataclass
class _Measurement:
    """One contender on one prompt set, summed over the chunks of prompts it decoded."""

    outputs: dict[str, list[int]] = field(default_factory=dict)
    seconds: float = 0.0
    profile: _Profile = field(default_factory=_Profile)
    stats: SpecDecodeStats | None = None  # engine only (per-sequence target forwards; else counted by the hooks)
    decode_seconds: float = 0.0
    decode_steps: int = 0
    bytes_moved: float = 0.0  # by the decode steps
    drafted: int = 0  # draft tokens of the decode steps (engine)
    prompt_tokens: int = 0  # of the prompts decoded (engine)
    cached_tokens: int = 0  # of those, found in the prefix cache (engine)
    decode_tokens: int = 0  # tokens the decode steps emitted (engine)
    rounds: list[tuple[float, int]] = field(default_factory=list)  # (decode seconds, decode steps) per chunk
    launches: Launches | None = None  # of one decode step (engine), counted after the timed runs

    def add(self, name: str, value: float) -> None:
        setattr(self, name, getattr(self, name) + value)

    def close_round(self, seconds_before: float, steps_before: int) -> None:
        self.rounds.append((self.decode_seconds - seconds_before, self.decode_steps - steps_before))


@dataclass
class Models:
    target: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    draft: torch.nn.Module | None = None  # as loaded: transformers assisted generation needs the full head
    draft_name: str | None = None
    eos_ids: list[int] = field(default_factory=list)
    baseline: ModuleType | None = None  # another checkout's decoding package (bench.baseline.load_baseline)
    bandwidth_gbs: float | None = None  # the device's memory bandwidth, if known better than the default
    clock: Clock = field(init=False)
    config: Config | None = None  # where a quantized target is loaded from (``target_for``)
    quantized: dict[str, PreTrainedModel] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.eos_ids = sorted(eos_token_ids(self.tokenizer, self.target))
        self.clock = Clock(self.target.device)

    @classmethod
    def load(cls, config: Config, needs_draft: bool) -> Models:
        target = load_model(config.model, config.dtype)
        draft_name = config.speculative.model if needs_draft and config.speculative.model != SELF_DRAFT else None
        draft = load_draft(draft_name, config.dtype, target.device) if draft_name else None
        return cls(target, load_tokenizer(config.model), draft, draft_name, config=config)

    def target_for(self, quantization: str | None) -> PreTrainedModel:
        """The target an engine of ``quantization`` (``Config.quantization``) runs: the loaded one where that runs
        no GGUF blocks (a target given without its config runs as given), else the blocks one, loaded once."""
        if self.config is None and quantization in (None, "auto"):
            return self.target
        if self.config is None:
            raise ValueError(f"a {quantization} contender needs the config the models were loaded from")
        config = self.config
        if not runs_gguf_blocks(config.model, config.dtype, self.target.device, quantization):
            return self.target
        if "gguf" not in self.quantized:
            self.quantized["gguf"] = load_model(config.model, config.dtype, self.target.device, quantization="gguf")
        return self.quantized["gguf"]

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]

    def bandwidth(self) -> Bandwidth:
        if not hasattr(self, "_bandwidth"):
            self._bandwidth = device_bandwidth(self.target.device, self.bandwidth_gbs)
        return self._bandwidth


def _hf_kwargs(models: Models, params: SamplingParams) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "max_new_tokens": params.max_tokens, "eos_token_id": models.eos_ids, "pad_token_id": models.pad_id,
        "do_sample": not params.greedy,
    }
    if not params.greedy:
        kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None)
    if params.stop:
        kwargs.update(stop_strings=params.stop, tokenizer=models.tokenizer)
    return kwargs


def _until_eos(tokens: list[int], eos_ids: list[int]) -> list[int]:
    """Generated tokens up to and including the first EOS, as the engine reports them (padding dropped)."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


def _cached_positions(kwargs: dict[str, Any], rows: int) -> int:
    """Cached positions a transformers forward reads: rows x the cache's length (a padded batch reads its padding)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5.24's name, and the older one
    return rows * (cache.get_seq_length() if cache is not None else 0)


def _transformers_runner(models: Models, contender: Contender) -> _Runner:
    params = contender.config.sampling
    kwargs = _hf_kwargs(models, params)
    if contender.kind == "assisted":
        spec = contender.config.speculative
        if spec.method == "draft_model":
            if getattr(models.draft, "reads_features", False):
                raise ValueError(f"transformers assisted generation cannot run the feature draft {models.draft_name} "
                                 "(it reads the target's hidden states): bench it with --no-assisted")
            kwargs["assistant_model"] = models.draft
        else:
            kwargs.update(prompt_lookup_num_tokens=spec.num_speculative_tokens,
                          max_matching_ngram_size=spec.prompt_lookup_max)
    device = models.target.device
    clock = models.clock
    assistant = kwargs.get("assistant_model")
    target_bytes = ForwardBytes.of(models.target)
    draft_bytes = ForwardBytes.of(assistant) if assistant is not None else None

    def turns(prompts: dict[str, list[int]], into: _Measurement, max_tokens: int | None = None) -> Iterator[bool]:
        """transformers' generate is one turn."""
        ids = list(prompts)
        torch.manual_seed(params.seed if params.seed is not None else 0)  # transformers' global stream
        forwards: list[Any] = []  # each target forward's start mark: the first is the prefill
        moved = [0.0]

        def on_target(seconds: float, rows: int) -> None:
            into.profile.target_s += seconds
            into.profile.target_rows += rows

        def target_forward(args: tuple, hf_kwargs: dict[str, Any]) -> None:
            if forwards:  # a decode forward
                moved[0] += target_bytes(_cached_positions(hf_kwargs, _rows_of(args, hf_kwargs)))
            forwards.append(clock.mark() if len(forwards) == 1 else None)

        def draft_forward(args: tuple, hf_kwargs: dict[str, Any]) -> None:
            moved[0] += draft_bytes(_cached_positions(hf_kwargs, _rows_of(args, hf_kwargs)))

        with ExitStack() as hooks, torch.no_grad():
            hooks.enter_context(_timed_forwards(models.target, clock, on_target))
            if assistant is not None:
                hooks.enter_context(_timed_forwards(
                    assistant, clock, lambda seconds, _rows: into.profile.add("draft_s", seconds)))
                hooks.enter_context(_on_forward(assistant, draft_forward))
            hooks.enter_context(_on_forward(models.target, target_forward))
            generate_kwargs = {**kwargs, **({"max_new_tokens": max_tokens} if max_tokens else {})}
            start = clock.mark()
            for first in range(0, len(ids), contender.batch_size):
                chunk = ids[first : first + contender.batch_size]
                width = max(len(prompts[i]) for i in chunk)
                # Left padding, so that every row's next token follows its last prompt token.
                input_ids = torch.full((len(chunk), width), models.pad_id, dtype=torch.long)
                mask = torch.zeros(len(chunk), width, dtype=torch.long)
                for row, i in enumerate(chunk):
                    input_ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                    mask[row, width - len(prompts[i]) :] = 1
                forwards.clear()
                out = models.target.generate(
                    input_ids=input_ids.to(device), attention_mask=mask.to(device), **generate_kwargs
                )
                if len(forwards) > 1:
                    into.decode_steps += len(forwards) - 1
                    clock.add(forwards[1], clock.mark(), lambda seconds: into.add("decode_seconds", seconds))
                for row, i in enumerate(chunk):
                    into.outputs[i] = _until_eos(out[row, width:].tolist(), models.eos_ids)
            clock.add(start, clock.mark(), lambda seconds: into.add("seconds", seconds))
            into.bytes_moved += moved[0]
        yield True

    return _Runner(turns)


def result_stats(stats: ModuleType, result: Any) -> SpecDecodeStats:
    """A finished result's statistics, computed by the ``stats`` module of the engine that produced it, as this
    checkout's ``SpecDecodeStats`` (a field that engine does not count stays zero)."""
    theirs = stats.SpecDecodeStats.of(result)
    return SpecDecodeStats(**{f.name: getattr(theirs, f.name) for f in dataclasses.fields(SpecDecodeStats)
                              if hasattr(theirs, f.name)})


def _engine_runner(models: Models, contender: Contender) -> _Runner:
    """One engine for all of the contender's chunks, so that what it learns (length policy) carries over; the
    baseline checkout's engine for a ``baseline`` contender."""
    package, stats = engine_module, stats_module
    config: Any = contender.config
    if contender.kind == "baseline":
        if models.baseline is None:
            raise ValueError("a baseline contender needs the baseline checkout (Models.baseline)")
        package = models.baseline.engine
        stats = importlib.import_module(models.baseline.__name__ + ".stats")
        config = convert_model(config, models.baseline.config.Config)
    draft = models.draft if contender.method == "draft_model" else None
    target = models.target_for(contender.config.quantization)
    engine = package.Engine(config, target=target, tokenizer=models.tokenizer, draft=draft)
    clock = models.clock
    # The drafter's methods are wrapped once; their spans count for the measurement of the turn they ran in (spans
    # settle at the end of each turn).
    current = [_Measurement()]
    _time_methods(engine.drafter, ("rows_joined", "add_rows", "propose", "observe"), clock,
                  lambda seconds: current[0].profile.add("draft_s", seconds))
    target_bytes = ForwardBytes.of(target)
    draft_model = getattr(engine.drafter, "model", None)
    draft_bytes = ForwardBytes.of(draft_model) if draft_model is not None else None

    def turns(prompts: dict[str, list[int]], into: _Measurement, max_tokens: int | None = None) -> Iterator[bool]:
        """One engine step a turn (``Engine.generate``)."""
        current[0] = into
        if into.stats is None:
            into.stats = SpecDecodeStats()
        sampling = {"max_tokens": max_tokens} if max_tokens else None
        for i, p in prompts.items():
            engine.add_request(package.Request(i, prompt_token_ids=p, sampling=sampling))
        results: list[Any] = []

        def on_target(seconds: float, rows: int) -> None:
            into.profile.target_s += seconds
            into.profile.target_rows += rows

        draft_forwards = [0]

        def count_draft_forward(_args: tuple, _kwargs: dict[str, Any]) -> None:
            draft_forwards[0] += 1

        while engine.has_unfinished():
            current[0] = into
            decode = not engine.waiting  # no prompt joins this step
            positions = sum(len(s.prompt_ids) + len(s.generated) - 1 for s in engine.running)
            draft_forwards[0] = 0
            # Hooked per step: the engine's view of the target is shared by the engines built on one model, and
            # the others step between this engine's turns.
            with _timed_forwards(engine.target, clock, on_target), _on_forward(draft_model, count_draft_forward), \
                    clock.span(lambda seconds: into.add("seconds", seconds)):
                if decode:
                    with clock.span(lambda seconds: into.add("decode_seconds", seconds)):
                        out = engine.step()
                else:
                    out = engine.step()
            results += out.finished
            if decode and positions:
                into.decode_steps += 1
                into.drafted += out.spec_decode.num_draft_tokens
                into.decode_tokens += sum(len(tokens) for tokens in out.new_tokens.values())
                into.bytes_moved += target_bytes(positions) + (
                    draft_forwards[0] * draft_bytes(positions) if draft_bytes is not None else 0)
            yield True
        errors = [r for r in results if r.finish_reason == "error"]
        if errors:
            raise RuntimeError(f"{contender.name}: prompt {errors[0].id} failed: {errors[0].error}")
        for result in results:
            into.outputs[result.id] = result.token_ids
            into.stats += result_stats(stats, result)
            into.prompt_tokens += len(result.prompt_token_ids)
            into.cached_tokens += getattr(result, "num_cached_tokens", 0)
        if max_tokens and hasattr(engine, "reset_prefix_cache"):
            engine.reset_prefix_cache()  # a warm-up: what it cached must not speed up the timed prompts

    layers = _layers(target), _layers(draft_model)

    def launches(prompt: list[int]) -> Launches | None:
        """The launches of one decode step over ``batch_size`` rows of ``prompt``: untimed (the counter slows the
        step it counts), after the timed runs."""
        ids = [f"launches-{row}" for row in range(contender.batch_size)]
        for request_id in ids:  # long enough to be decoding after the step that admits them, whatever drafts
            engine.add_request(package.Request(request_id, prompt_token_ids=prompt,
                                               sampling={"max_tokens": 64, "ignore_eos": True}))
        forwards = [0, 0]  # target, draft

        def on_target(_args: tuple, _kwargs: dict[str, Any]) -> None:
            forwards[0] += 1

        def on_draft(_args: tuple, _kwargs: dict[str, Any]) -> None:
            forwards[1] += 1

        counted = None
        with _on_forward(engine.target, on_target), _on_forward(draft_model, on_draft):
            while engine.has_unfinished():
                if counted is None and not engine.waiting:  # a decode step: every row admitted before it
                    forwards[:] = [0, 0]
                    per_step = count_launches(engine.step, models.target.device)
                    counted = Launches(per_step, layers[0] * forwards[0] + layers[1] * forwards[1])
                    if hasattr(engine, "abort"):  # a baseline checkout's engine may not abort: it decodes on
                        for request_id in ids:
                            engine.abort(request_id)
                else:
                    engine.step()
        if hasattr(engine, "reset_prefix_cache"):
            engine.reset_prefix_cache()
        return counted

    return _Runner(turns, launches)


@dataclass
class _Runner:
    # Decodes one chunk of prompts, adding to the measurement it is given, in turns: the time between two yields is
    # the runner's. ``max_tokens`` shortens the decode (a warm-up).
    turns: Callable[..., Iterator[bool]]
    # One decode step's kernel launches over a prompt (engine runners), counted apart from the timed turns.
    launches: Callable[[list[int]], Launches | None] | None = None
    total: _Measurement = field(default_factory=_Measurement)  # what the timed turns have measured so far

    def run(self, prompts: dict[str, list[int]], clock: Clock | None = None) -> None:
        """The chunk in one go."""
        for _ in self.turns(prompts, self.total):
            if clock is not None:
                clock.settle()


def _layers(model: torch.nn.Module | None) -> int:
    return getattr(getattr(model, "config", None), "num_hidden_layers", 0) if model is not None else 0


def _runner(models: Models, contender: Contender) -> _Runner:
    if contender.kind == "llama_cpp":
        return _llama_cpp_runner(models, contender)
    return (_engine_runner if contender.is_engine else _transformers_runner)(models, contender)


def llama_cpp_runs(model: str) -> bool:
    """Whether llama.cpp can decode ``model`` here: llama-cpp-python installed and the model a GGUF."""
    return importlib.util.find_spec("llama_cpp") is not None and model_gguf(model) is not None


def _llama_cpp_runner(models: Models, contender: Contender) -> _Runner:
    """llama.cpp's own decoding of the model's GGUF, one prompt at a time (its batch 1), on as many threads as
    torch: the same prompt token ids, greedy or the config's sampling, prefill and decode timed as the engine's."""
    from llama_cpp import Llama

    params = contender.config.sampling
    llm = Llama(model_path=str(model_gguf(contender.config.model)), n_ctx=contender.config.max_model_len or 4096,
                n_threads=torch.get_num_threads(), n_threads_batch=torch.get_num_threads(), verbose=False,
                seed=params.seed if params.seed is not None else 0)
    sampling = {"temp": 0.0, "top_k": 1} if params.greedy else {
        "temp": params.temperature, "top_k": params.top_k or 0, "top_p": params.top_p, "min_p": 0.0}
    clock = models.clock

    def turns(prompts: dict[str, list[int]], into: _Measurement, max_tokens: int | None = None) -> Iterator[bool]:
        """One prompt after another is one turn."""
        limit = max_tokens or params.max_tokens
        start = clock.mark()
        for i, prompt in prompts.items():
            tokens: list[int] = []
            first = None
            for token in llm.generate(prompt, reset=True, repeat_penalty=1.0, **sampling):
                tokens.append(int(token))
                if first is None:
                    first = clock.mark()
                if token in models.eos_ids or len(tokens) >= limit:
                    break
            into.outputs[i] = tokens
            if len(tokens) > 1:
                into.decode_steps += len(tokens) - 1
                clock.add(first, clock.mark(), lambda seconds: into.add("decode_seconds", seconds))
        clock.add(start, clock.mark(), lambda seconds: into.add("seconds", seconds))
        yield True

    return _Runner(turns)


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _row(prompt_set: str, contender: Contender, m: _Measurement, bandwidth: Bandwidth) -> BenchRow:
    tokens = sum(len(t) for t in m.outputs.values())
    spec = contender.config.speculative
    drafting = contender.kind != "transformers" and contender.method != "none"
    # Per-sequence target forwards: exact for the engine; for transformers, counted by the forward hooks.
    forwards = m.stats.num_target_forwards if m.stats is not None else m.profile.target_rows
    ms_per_step = 1e3 * m.decode_seconds / m.decode_steps if m.decode_steps else None
    bytes_per_step = m.bytes_moved / m.decode_steps if m.decode_steps else None
    return BenchRow(
        prompt_set=prompt_set, name=contender.name, batch_size=contender.batch_size, method=contender.method,
        num_candidates=spec.num_candidates if contender.speculative else None,
        num_speculative_tokens=spec.num_speculative_tokens if drafting else None,
        candidate_init=spec.candidate_init if contender.speculative else None,
        length_policy=spec.length_policy if contender.speculative else None,
        prompts=len(m.outputs), generated_tokens=tokens, seconds=m.seconds, tokens_per_s=tokens / m.seconds,
        mean_acceptance_length=m.stats.mean_acceptance_length if m.stats is not None else None,
        tokens_per_forward=_ratio(tokens, forwards),
        acceptance_rate=m.stats.draft_acceptance_rate if m.stats is not None and m.stats.num_draft_tokens else None,
        target_forwards_per_token=m.profile.target_rows / tokens if tokens else 0.0,
        draft_s=m.profile.draft_s, target_s=m.profile.target_s,
        other_s=max(m.seconds - m.profile.draft_s - m.profile.target_s, 0.0),
        decode_steps=m.decode_steps, ms_per_step=ms_per_step, bytes_per_step=bytes_per_step,
        bandwidth_fraction=bandwidth_fraction(bytes_per_step, ms_per_step, bandwidth),
        launches_per_step=m.launches.per_step if m.launches is not None else None,
        launches_per_layer=m.launches.per_layer if m.launches is not None else None,
        drafted_per_step=m.drafted / m.decode_steps if contender.is_engine and m.decode_steps else None,
        prefix_cache_hit_rate=m.cached_tokens / m.prompt_tokens if contender.is_engine and m.prompt_tokens else None,
    )


def _compare(rows: list[BenchRow], outputs: list[dict[str, list[int]]], greedy: bool) -> None:
    """Speedups against the baselines at the same batch size, and outputs against the reference decode."""
    hf = {r.batch_size: r for r in rows if r.name == "transformers generate"}
    none = {r.batch_size: r for r in rows if r.name == "engine none"}
    # transformers generate at batch 1 is the reference; without it, engine none at the smallest batch size.
    reference_row = hf.get(1) or hf.get(min(hf, default=0)) or none[min(none)]
    reference = outputs[rows.index(reference_row)]
    for row, out in zip(rows, outputs, strict=True):
        if row.batch_size in hf:
            row.speedup_vs_transformers = row.tokens_per_s / hf[row.batch_size].tokens_per_s
        if row.batch_size in none:
            row.speedup_vs_none = row.tokens_per_s / none[row.batch_size].tokens_per_s
            row.slower_than_none = row.name.startswith("engine ") and row.name != "engine none" and (
                row.tokens_per_s < none[row.batch_size].tokens_per_s
            )
        if greedy:
            row.mismatches = sum(out[i] != reference[i] for i in reference)
            row.identical = row.mismatches == 0


def environment(models: Models) -> dict[str, Any]:
    """The machine and software a table was measured on (docs/performance.md records it with each table)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    device = models.target.device
    bandwidth = models.bandwidth()
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU: {cpu}",
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "dtype": str(models.target.dtype).removeprefix("torch."),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bandwidth_gbs": bandwidth.gbs,
        "bandwidth_source": bandwidth.source,
        "timer": "CUDA events" if models.clock.cuda else "perf_counter",
    }


WARM_UP_TOKENS = 4


def _warm_up(runners: list[_Runner], group: list[Contender], prompt: list[int], turn_done: Callable[[], None]
             ) -> None:
    """A short decode by every contender at its own batch size before anything is timed, so one-time setup of
    each shape (kernels, allocator, graphs) is timed by nobody; its measurement is dropped."""
    for runner, contender in zip(runners, group, strict=True):
        prompts = {f"warm-up-{row}": prompt for row in range(contender.batch_size)}
        for _ in runner.turns(prompts, _Measurement(), WARM_UP_TOKENS):
            turn_done()
        turn_done()


def _interleaved(
    models: Models, group: list[Contender], prompts: dict[str, list[int]], rounds: Callable[[int, int], None],
    turns: Literal["step", "chunk"] = "step", warm_up: list[int] | None = None,
) -> list[_Measurement]:
    """Contenders of one batch size, taking turns on each chunk (``batch_size`` prompts) before the next.

    A shared machine drifts by tens of percent over minutes; turns close together make every contender see the
    same drift, where one-after-the-other runs would hand it to whoever ran during a slow spell. With ``step``
    turns every engine runs one step in turn (a second apart at batch 64): whole-chunk turns left a batch-64 pair
    with two chunks running ABBA, and one engine's two turns, four minutes back to back, measured 0.88x of the
    other for the same target forwards (XSum, 2-core VM). The contender going first rotates by chunk, and with
    ``step`` turns by step as well (on a GPU, which of two contenders ran first changed their batch-8 figures), so
    none always follows a change of prompt or another contender. Each turn ends with the clock settled (one
    device synchronize), and ``warm_up`` (a prompt) runs every contender once at its batch size first.
    """
    runners = [_runner(models, contender) for contender in group]
    clock = models.clock if models is not None else None

    def turn_done() -> None:
        if clock is not None:
            clock.settle()

    if warm_up is not None:
        _warm_up(runners, group, warm_up, turn_done)

    ids = list(prompts)
    size = group[0].batch_size
    chunks = [ids[first : first + size] for first in range(0, len(ids), size)]
    for turn, chunk in enumerate(chunks):
        before = [(r.total.decode_seconds, r.total.decode_steps) for r in runners]
        order = [runners[(turn + k) % len(runners)] for k in range(len(runners))]
        if turns == "chunk":
            for runner in order:
                for _ in runner.turns({i: prompts[i] for i in chunk}, runner.total):
                    turn_done()
                turn_done()
        else:
            pending = [runner.turns({i: prompts[i] for i in chunk}, runner.total) for runner in order]
            step = 0
            while pending:
                first = step % len(pending)
                running = []
                for steps in pending[first:] + pending[:first]:
                    alive = next(steps, False)  # False: chunk done
                    turn_done()
                    if alive:
                        running.append(steps)
                pending = [steps for steps in pending if any(steps is s for s in running)]
                step += 1
        for runner, (seconds, steps) in zip(runners, before, strict=True):
            runner.total.close_round(seconds, steps)
        rounds(turn + 1, len(chunks))
    for runner in runners:
        if runner.launches is not None:
            runner.total.launches = runner.launches(prompts[ids[0]])
    return [runner.total for runner in runners]


def run_bench(
    config: Config,
    prompt_sets: dict[str, list[Request]],
    grid: BenchGrid | None = None,
    models: Models | None = None,
    progress: Callable[[BenchRow], None] | None = None,
    baseline: ModuleType | None = None,
    bandwidth_gbs: float | None = None,
) -> BenchResult:
    """Run every contender on every prompt set; ``progress`` sees each row as it is measured. ``baseline``
    (another checkout's ``decoding`` package, ``bench.baseline.load_baseline``) adds its engine beside each engine
    contender; ``bandwidth_gbs`` overrides the device's memory bandwidth."""
    grid = grid or BenchGrid()
    runs = contenders(config, grid, baseline is not None)
    models = models or Models.load(config, any(c.method == "draft_model" for c in runs))
    models.baseline = baseline or models.baseline
    models.bandwidth_gbs = bandwidth_gbs or models.bandwidth_gbs
    encoded = {
        name: {r.id: encode_request(models.tokenizer, r)[1] for r in requests} for name, requests in prompt_sets.items()
    }
    first_prompt = next(iter(next(iter(encoded.values())).values()))
    bandwidth = models.bandwidth()
    rows: list[BenchRow] = []
    for index, (name, prompts) in enumerate(encoded.items()):
        if len(prompts) < max(c.batch_size for c in runs):
            log.warning("prompt set %s has %d prompts: larger batch sizes decode at most that many rows at once",
                        name, len(prompts))
        set_rows, set_outputs = [], []
        for batch in sorted({c.batch_size for c in runs}):
            group = [c for c in runs if c.batch_size == batch]

            def chunk_done(done: int, chunks: int, batch: int = batch, set_name: str = name) -> None:
                log.info("%s batch %d: %d/%d chunks of prompts decoded by every contender", set_name, batch, done,
                         chunks)

            measurements = _interleaved(models, group, prompts, chunk_done, grid.turns,
                                        warm_up=first_prompt if index == 0 else None)
            for contender, measurement in zip(group, measurements, strict=True):
                set_rows.append(_row(name, contender, measurement, bandwidth))
                set_outputs.append(measurement.outputs)
                if progress:
                    progress(set_rows[-1])
        _compare(set_rows, set_outputs, config.sampling.greedy)
        rows += set_rows
    return BenchResult(
        environment=environment(models), config=config.model_dump(), grid=grid.model_dump(),
        prompt_sets={name: len(p) for name, p in encoded.items()}, rows=rows,
    )


# ---------------------------------------------------------------------------------------------- presenting
Format = str | Callable[[Any], str]  # a format string for the value, or a function of it


def megabytes(value: float) -> str:
    return f"{value / 1e6:.1f}"


def percent(value: float) -> str:
    return f"{100 * value:.1f}" if value >= 0.001 else f"{100 * value:.3f}"


_COLUMNS: list[tuple[str, str | None, Format]] = [  # header, field, format
    ("prompt set", "prompt_set", "{}"), ("contender", "name", "{}"), ("batch", "batch_size", "{}"),
    ("tok/s", "tokens_per_s", "{:.1f}"), ("x transformers", "speedup_vs_transformers", "{:.2f}"),
    ("x engine none", "speedup_vs_none", "{:.2f}"), ("accept len", "mean_acceptance_length", "{:.2f}"),
    ("tok/fwd", "tokens_per_forward", "{:.2f}"),
    ("accept rate", "acceptance_rate", "{:.2f}"), ("fwd/token", "target_forwards_per_token", "{:.3f}"),
    ("identical", "identical", "{}"), ("ms/step", "ms_per_step", "{:.2f}"), ("MB/step", "bytes_per_step", megabytes),
    ("bw %", "bandwidth_fraction", percent), ("launches/step", "launches_per_step", "{}"),
    ("launches/layer", "launches_per_layer", "{:.1f}"), ("prefix hit %", "prefix_cache_hit_rate", percent),
    ("draft/target/other s", None, ""),
]


def cell(value: Any, fmt: Format) -> str:
    if value is None:
        return "-"
    return fmt(value) if callable(fmt) else fmt.format(value)


def aligned(lines: list[list[str]]) -> str:
    """Rows of cells as left-aligned text columns (the first row is the header)."""
    widths = [max(len(c) for c in column) for column in zip(*lines, strict=True)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def format_table(rows: list[BenchRow]) -> str:
    """The bench table as aligned text; '<< slower than engine none' flags a losing configuration."""
    lines = [[header for header, _, _ in _COLUMNS] + [""]]
    for row in rows:
        cells = [
            f"{row.draft_s:.1f}/{row.target_s:.1f}/{row.other_s:.1f}" if name is None else cell(getattr(row, name), fmt)
            for _, name, fmt in _COLUMNS
        ]
        lines.append([*cells, "<< slower than engine none" if row.slower_than_none else ""])
    return aligned(lines)


def plot(rows: list[BenchRow], path: str) -> None:
    """Bar chart of tokens/s, one panel per prompt set and batch size; the dashed line is engine none.

    Gray: transformers, blue: engine none, green: speculative configurations, red: those slower than engine none.
    """
    from matplotlib.figure import Figure  # only where a chart is drawn

    groups: dict[tuple[str, int], list[BenchRow]] = {}
    for row in rows:
        groups.setdefault((row.prompt_set, row.batch_size), []).append(row)
    heights = [0.3 * len(g) + 1.0 for g in groups.values()]
    fig = Figure(figsize=(10, sum(heights)))
    axes = fig.subplots(len(groups), 1, height_ratios=heights, squeeze=False)[:, 0]
    for ax, ((prompt_set, batch), group) in zip(axes, groups.items(), strict=True):
        colors = ["tab:red" if r.slower_than_none else "tab:gray" if not r.name.startswith("engine")
                  else "tab:blue" if r.name == "engine none" else "tab:green" for r in group]
        bars = ax.barh(range(len(group)), [r.tokens_per_s for r in group], color=colors)
        labels = [f" {r.tokens_per_s:.1f}" + (f" ({r.speedup_vs_none:.2f}x)" if r.speedup_vs_none else "")
                  for r in group]
        ax.bar_label(bars, labels, fontsize=7)
        ax.set_yticks(range(len(group)), [r.name for r in group], fontsize=8)
        ax.invert_yaxis()
        ax.margins(x=0.15)
        for r in group:
            if r.name == "engine none":
                ax.axvline(r.tokens_per_s, color="tab:blue", linestyle="--", linewidth=1)
        ax.set_title(f"{prompt_set}, batch {batch}: tokens/s (x engine none)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
