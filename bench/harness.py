"""Side-by-side throughput benchmark (``specbatch bench``): transformers against the engine's configurations.

Everything runs in one process, on the same prompts and the same loaded models. Contenders of one batch size take
turns, engine step by engine step (see ``_interleaved``), so the drift of a shared machine reaches all of them alike:
transformers ``generate`` (a batch-1 loop, and left-padded batches for larger batch sizes), transformers assisted
generation at batch 1 (``assistant_model`` for ``draft_model``, prompt lookup for ``ngram``), the engine with
method ``none`` at every batch size, and a grid of the engine's speculative configurations.

Profiling is measured from the outside: forward hooks time the target (and a transformers assistant), and the
engine's drafter methods are wrapped, so the engine itself is benchmarked unmodified.
"""

from __future__ import annotations

import itertools
import logging
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import transformers
from matplotlib.figure import Figure
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from decoding.config import Config, SamplingParams
from decoding.engine import Engine, GenerationResult, Request, encode_request, eos_token_ids
from decoding.models import SELF_DRAFT, load_draft, load_model, load_tokenizer
from decoding.stats import SpecDecodeStats

log = logging.getLogger(__name__)

LengthPolicyName = Literal["static", "heuristic", "online", "threshold", "decision"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DraftChoice(_Strict):
    """The draft of ``draft_model`` contenders: a model (``target``: the target drafts for itself), its
    weight-only quantization, and n-gram lookup siblings beside its candidates."""

    model: str | None = None  # None: the config's speculative.model
    quantization: Literal["int4", "int8"] | None = None
    ngram_candidates: int = 0


class Sweep(_Strict):
    """A cartesian product of engine configurations; a field left out keeps the config's value."""

    batch_sizes: list[int] | None = None
    methods: list[Literal["ngram", "draft_model"]] | None = None
    num_candidates: list[int] | None = None
    num_speculative_tokens: list[int] | None = None
    candidate_init: list[Literal["target", "draft"]] | None = None
    length_policy: list[LengthPolicyName] | None = None
    drafts: list[DraftChoice] | None = None  # for method draft_model


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
    turns: Literal["step", "chunk"] = Field(
        "step", description="how contenders of one batch size take turns on a chunk of prompts: one engine step "
        "each ('step'; their KV caches are in memory together) or the whole chunk each ('chunk'; one at a time)")

    def override(self, **fields: list[Any] | None) -> BenchGrid:
        """Set the given sweep fields (those not None) in every sweep."""
        changes = {k: v for k, v in fields.items() if v is not None}
        return self.model_copy(update={"sweeps": [s.model_copy(update=changes) for s in self.sweeps]})


@dataclass(frozen=True)
class Contender:
    kind: Literal["transformers", "assisted", "engine"]
    config: Config  # batch size, method and speculative settings of this contender

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    @property
    def method(self) -> str:
        return self.config.speculative.method

    @property
    def speculative(self) -> bool:
        return self.kind == "engine" and self.method != "none"

    @property
    def name(self) -> str:
        if self.kind == "transformers":
            return "transformers generate"
        if self.kind == "assisted":
            return "transformers assisted " + ("(prompt lookup)" if self.method == "ngram" else "(draft)")
        if not self.speculative:
            return "engine none"
        spec = self.config.speculative
        draft = ""
        if self.method == "draft_model":
            draft = "self" if spec.model == SELF_DRAFT else ""
            draft += f"-{spec.quantization}" if spec.quantization else ""
            draft += f"+lookup{spec.ngram_candidates}" if spec.ngram_candidates else ""
            draft = f" {draft.lstrip('-')}" if draft else ""
        return (f"engine {self.method}{draft} w{spec.num_candidates} d{spec.num_speculative_tokens} "
                f"init={spec.candidate_init} {spec.length_policy}")


def _variant(config: Config, batch_size: int, **speculative: Any) -> Config:
    data = config.model_dump()
    data["batch_size"] = batch_size
    data["speculative"].update(speculative)
    return Config.model_validate(data)


def contenders(config: Config, grid: BenchGrid) -> list[Contender]:
    """Every run of the benchmark, baselines first within each batch size; duplicates removed."""
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
        )
        for batch, method, width, depth, init, policy in axes:
            init = "draft" if width == 1 else init  # one candidate: both inits build the same chain
            drafts = (sweep.drafts or [None]) if method == "draft_model" else [None]
            for choice in drafts:
                draft = {} if choice is None else {
                    "model": choice.model or spec.model, "quantization": choice.quantization,
                    "ngram_candidates": choice.ngram_candidates,
                }
                key = (batch, method, width, depth, init, policy, tuple(draft.values()))
                engine.setdefault(key, _variant(
                    config, batch, method=method, num_candidates=width, num_speculative_tokens=depth,
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
            assistable = [m for m in methods if m == "ngram" or config.speculative.model != SELF_DRAFT]
            runs += [Contender("assisted", _variant(config, 1, method=m)) for m in assistable]
        runs.append(Contender("engine", _variant(config, batch, method="none")))
        runs += [Contender("engine", c) for key, c in engine.items() if key[0] == batch]
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


def _rows_of(args: tuple, kwargs: dict[str, Any]) -> int:
    tensor = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if tensor is None:
        tensor = args[0]
    return int(tensor.shape[0])


@contextmanager
def _timed_forwards(module: torch.nn.Module, on_done: Callable[[float, int], None]) -> Iterator[None]:
    starts: list[float] = []
    rows: list[int] = []
    # GPU kernels run asynchronously: without a sync the time would land in whatever waits next.
    sync = torch.cuda.synchronize if next(module.parameters()).is_cuda else (lambda: None)

    def before(_module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        rows.append(_rows_of(args, kwargs))
        sync()
        starts.append(time.perf_counter())

    def after(_module: torch.nn.Module, _args: tuple, _kwargs: dict[str, Any], _output: Any) -> None:
        sync()
        on_done(time.perf_counter() - starts.pop(), rows.pop())

    handles = [module.register_forward_pre_hook(before, with_kwargs=True),
               module.register_forward_hook(after, with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _time_methods(obj: Any, names: tuple[str, ...], profile: _Profile) -> None:
    """Wrap instance methods so their time counts as drafting (the engine is only used once per run)."""
    for name in names:
        method = getattr(obj, name)

        def timed(*args: Any, _method: Callable = method, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                profile.draft_s += time.perf_counter() - start

        setattr(obj, name, timed)


@dataclass
class _Measurement:
    """One contender on one prompt set, summed over the chunks of prompts it decoded."""

    outputs: dict[str, list[int]] = field(default_factory=dict)
    seconds: float = 0.0
    profile: _Profile = field(default_factory=_Profile)
    stats: SpecDecodeStats | None = None  # engine only (per-sequence target forwards; else counted by the hooks)


@dataclass
class Models:
    target: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    draft: torch.nn.Module | None = None  # as loaded: transformers assisted generation needs the full head
    draft_name: str | None = None
    eos_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.eos_ids = sorted(eos_token_ids(self.tokenizer, self.target))

    @classmethod
    def load(cls, config: Config, needs_draft: bool) -> Models:
        target = load_model(config.model, config.dtype)
        draft_name = config.speculative.model if needs_draft and config.speculative.model != SELF_DRAFT else None
        draft = load_draft(draft_name, config.dtype, target.device) if draft_name else None
        return cls(target, load_tokenizer(config.model), draft, draft_name)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]


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
    total = _Measurement()

    def on_target(seconds: float, rows: int) -> None:
        total.profile.target_s += seconds
        total.profile.target_rows += rows

    def on_draft(seconds: float, _rows: int) -> None:
        total.profile.draft_s += seconds

    def turns(prompts: dict[str, list[int]]) -> Iterator[bool]:  # transformers' generate is one turn
        ids = list(prompts)
        torch.manual_seed(params.seed if params.seed is not None else 0)  # transformers' global stream
        draft_hooks = _timed_forwards(models.draft, on_draft) if "assistant_model" in kwargs else nullcontext()
        with _timed_forwards(models.target, on_target), draft_hooks, torch.no_grad():
            start = time.perf_counter()
            for first in range(0, len(ids), contender.batch_size):
                chunk = ids[first : first + contender.batch_size]
                width = max(len(prompts[i]) for i in chunk)
                # Left padding, so that every row's next token follows its last prompt token.
                input_ids = torch.full((len(chunk), width), models.pad_id, dtype=torch.long)
                mask = torch.zeros(len(chunk), width, dtype=torch.long)
                for row, i in enumerate(chunk):
                    input_ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                    mask[row, width - len(prompts[i]) :] = 1
                out = models.target.generate(
                    input_ids=input_ids.to(device), attention_mask=mask.to(device), **kwargs
                )
                for row, i in enumerate(chunk):
                    total.outputs[i] = _until_eos(out[row, width:].tolist(), models.eos_ids)
            total.seconds += time.perf_counter() - start
        yield True

    return _Runner(total, turns)


def _engine_runner(models: Models, contender: Contender) -> _Runner:
    """One engine for all of the contender's chunks, so that what it learns (length policy) carries over."""
    draft = models.draft if contender.method == "draft_model" else None
    engine = Engine(contender.config, target=models.target, tokenizer=models.tokenizer, draft=draft)
    total = _Measurement(stats=SpecDecodeStats())
    _time_methods(engine.drafter, ("add_rows", "propose", "observe"), total.profile)

    def on_target(seconds: float, rows: int) -> None:
        total.profile.target_s += seconds
        total.profile.target_rows += rows

    def turns(prompts: dict[str, list[int]]) -> Iterator[bool]:  # one engine step a turn (``Engine.generate``)
        for i, p in prompts.items():
            engine.add_request(Request(i, prompt_token_ids=p))
        results: list[GenerationResult] = []
        while engine.has_unfinished():
            # Hooked per step: the engine's view of the target (for_inference) is shared by the engines built on
            # one model, and the others step between this engine's turns.
            with _timed_forwards(engine.target, on_target):
                start = time.perf_counter()
                results += engine.step().finished
                total.seconds += time.perf_counter() - start
            yield True
        errors = [r for r in results if r.finish_reason == "error"]
        if errors:
            raise RuntimeError(f"{contender.name}: prompt {errors[0].id} failed: {errors[0].error}")
        for result in results:
            total.outputs[result.id] = result.token_ids
            total.stats += result.stats

    return _Runner(total, turns)


@dataclass
class _Runner:
    total: _Measurement  # what the turns have measured so far
    # Decodes one chunk of prompts, adding to ``total``, in turns: the time between two yields is the runner's.
    turns: Callable[[dict[str, list[int]]], Iterator[bool]]

    def run(self, prompts: dict[str, list[int]]) -> None:
        """The chunk in one go."""
        for _ in self.turns(prompts):
            pass


def _runner(models: Models, contender: Contender) -> _Runner:
    return (_engine_runner if contender.kind == "engine" else _transformers_runner)(models, contender)


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _row(prompt_set: str, contender: Contender, m: _Measurement) -> BenchRow:
    tokens = sum(len(t) for t in m.outputs.values())
    spec = contender.config.speculative
    drafting = contender.kind != "transformers" and contender.method != "none"
    # Per-sequence target forwards: exact for the engine; for transformers, counted by the forward hooks.
    forwards = m.stats.num_target_forwards if m.stats is not None else m.profile.target_rows
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
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU: {cpu}",
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "dtype": str(models.target.dtype).removeprefix("torch."),
    }


def _warm_up(models: Models, runs: list[Contender], prompt: list[int]) -> None:
    """A short decode through each code path first, so one-time setup (kernels, allocator) is timed by nobody."""
    first: dict[tuple[str, str], Contender] = {}
    for contender in runs:
        first.setdefault((contender.kind, contender.method), contender)
    for contender in first.values():
        sampling = contender.config.sampling.model_copy(update={"max_tokens": 8})
        short = contender.config.model_copy(update={"batch_size": 1, "sampling": sampling})
        _runner(models, Contender(contender.kind, short)).run({"warm-up": prompt})


def _interleaved(
    models: Models, group: list[Contender], prompts: dict[str, list[int]], rounds: Callable[[int, int], None],
    turns: Literal["step", "chunk"] = "step",
) -> list[_Measurement]:
    """Contenders of one batch size, taking turns on each chunk (``batch_size`` prompts) before the next.

    A shared machine drifts by tens of percent over minutes; turns close together make every contender see the
    same drift, where one-after-the-other runs would hand it to whoever ran during a slow spell. With ``step``
    turns every engine runs one step in turn (a second apart at batch 64): whole-chunk turns left a batch-64 pair
    with two chunks running ABBA, and one engine's two turns, four minutes back to back, measured 0.88x of the
    other for the same target forwards (XSum, 2-core VM). The contender going first rotates by chunk, so none
    always follows a change of prompt.
    """
    runners = [_runner(models, contender) for contender in group]
    ids = list(prompts)
    size = group[0].batch_size
    chunks = [ids[first : first + size] for first in range(0, len(ids), size)]
    for turn, chunk in enumerate(chunks):
        order = [runners[(turn + k) % len(runners)] for k in range(len(runners))]
        if turns == "chunk":
            for runner in order:
                runner.run({i: prompts[i] for i in chunk})
        else:
            pending = [runner.turns({i: prompts[i] for i in chunk}) for runner in order]
            while pending:
                pending = [steps for steps in pending if next(steps, False)]  # False: chunk done
        rounds(turn + 1, len(chunks))
    return [runner.total for runner in runners]


def run_bench(
    config: Config,
    prompt_sets: dict[str, list[Request]],
    grid: BenchGrid | None = None,
    models: Models | None = None,
    progress: Callable[[BenchRow], None] | None = None,
) -> BenchResult:
    """Run every contender on every prompt set; ``progress`` sees each row as it is measured."""
    grid = grid or BenchGrid()
    runs = contenders(config, grid)
    models = models or Models.load(config, any(c.method == "draft_model" for c in runs))
    encoded = {
        name: {r.id: encode_request(models.tokenizer, r)[1] for r in requests} for name, requests in prompt_sets.items()
    }
    _warm_up(models, runs, next(iter(next(iter(encoded.values())).values())))
    rows: list[BenchRow] = []
    for name, prompts in encoded.items():
        if len(prompts) < max(c.batch_size for c in runs):
            log.warning("prompt set %s has %d prompts: larger batch sizes decode at most that many rows at once",
                        name, len(prompts))
        set_rows, set_outputs = [], []
        for batch in sorted({c.batch_size for c in runs}):
            group = [c for c in runs if c.batch_size == batch]

            def chunk_done(done: int, chunks: int, batch: int = batch, set_name: str = name) -> None:
                log.info("%s batch %d: %d/%d chunks of prompts decoded by every contender", set_name, batch, done,
                         chunks)

            measurements = _interleaved(models, group, prompts, chunk_done, grid.turns)
            for contender, measurement in zip(group, measurements, strict=True):
                set_rows.append(_row(name, contender, measurement))
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
_COLUMNS = [  # header, field, format
    ("prompt set", "prompt_set", "{}"), ("contender", "name", "{}"), ("batch", "batch_size", "{}"),
    ("tok/s", "tokens_per_s", "{:.1f}"), ("x transformers", "speedup_vs_transformers", "{:.2f}"),
    ("x engine none", "speedup_vs_none", "{:.2f}"), ("accept len", "mean_acceptance_length", "{:.2f}"),
    ("tok/fwd", "tokens_per_forward", "{:.2f}"),
    ("accept rate", "acceptance_rate", "{:.2f}"), ("fwd/token", "target_forwards_per_token", "{:.3f}"),
    ("identical", "identical", "{}"), ("draft/target/other s", None, ""),
]


def format_table(rows: list[BenchRow]) -> str:
    """The bench table as aligned text; '<< slower than engine none' flags a losing configuration."""
    lines = [[header for header, _, _ in _COLUMNS] + [""]]
    for row in rows:
        cells = [
            f"{row.draft_s:.1f}/{row.target_s:.1f}/{row.other_s:.1f}" if name is None
            else "-" if getattr(row, name) is None else fmt.format(getattr(row, name))
            for _, name, fmt in _COLUMNS
        ]
        lines.append([*cells, "<< slower than engine none" if row.slower_than_none else ""])
    widths = [max(len(cell) for cell in column) for column in zip(*lines, strict=True)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def plot(rows: list[BenchRow], path: str) -> None:
    """Bar chart of tokens/s, one panel per prompt set and batch size; the dashed line is engine none.

    Gray: transformers, blue: engine none, green: speculative configurations, red: those slower than engine none.
    """
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
