"""The batched speculative decoding engine: step-wise API for continuous batching.

One step, for every running sequence at once (gpt-fast style, see ``_speculate``):
plan depths -> draft a candidate tree -> ONE target forward over all trees -> verify all rows ->
keep the accepted paths in both caches -> emit tokens -> learn (drafter, length policy).

Verification, sampling and the per-token statistics run on the target's device (``verify_batched.py``); what
the host reads back per step is the accepted paths and next tokens, and the statistics' O(B x N) floats, all
through ``_to_host``. The batch's sampling parameters and the laws the pending tokens came from live in row-indexed
tensors that follow the caches' swap-remove.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import ValidationError
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from decoding.config import Config, SamplingParams, format_validation_error
from decoding.costs import BatchCosts, calibrate_batch
from decoding.drafters import Draft, Drafter, DraftInputs, DraftModelDrafter, NgramDrafter
from decoding.kv_cache import SlotKVCache, forward_tree
from decoding.length_policies import Sources, StepRecord, StepTiming, make_policy
from decoding.models import (
    SELF_DRAFT,
    check_same_tokenizer,
    default_device,
    draft_vocab_subset,
    for_inference,
    load_draft,
    load_model,
    load_tokenizer,
    resolve_draft,
    resolve_model_path,
)
from decoding.padding import pad_rows
from decoding.quantize import quantized
from decoding.sampling import WarpParams, row_generator, row_uniforms, run_seed, token_logprobs, warp_probs
from decoding.stats import SpecDecodeStats, acceptance_histogram
from decoding.text import IncrementalDecoder
from decoding.tree import TreeTopology, chain_ancestors
from decoding.verify_batched import sample_from, sample_siblings, verify_batch


@dataclass
class Request:
    id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams | dict[str, Any] | None = None
    seed_key: str | None = None  # what the row's random stream derives from with the run seed; default: id
    # How ``messages`` render (vLLM's chat request fields): a template instead of the tokenizer's, extra variables
    # for the template (e.g. ``enable_thinking``), and whether to open the assistant's turn or continue the last one.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


@dataclass
class GenerationResult:
    id: str
    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # stop | length | error
    error: str | None
    time_taken: float
    token_accepted: list[bool]
    per_step_drafted: list[int]
    per_step_accepted: list[int]
    num_target_forwards: int
    acceptance_histogram: list[int]
    # One tuple per drafted candidate token: (step, depth, candidate, token_id, draft_prob, target_prob, accepted)
    token_stats: list[tuple[int, int, int, int, float, float, bool]] = field(default_factory=list)
    # With sampling_params.logprobs: per generated token, the target's log-probability and top alternatives.
    logprobs: list[dict[str, Any]] | None = None

    @property
    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats.of(self)

    @property
    def spec_decode(self) -> dict[str, Any]:
        return self.stats.struct()


@dataclass
class StepOutput:
    finished: list[GenerationResult]
    new_tokens: dict[str, list[int]]  # tokens each running sequence emitted this step (for streaming)
    # For per-step metrics: this step's speculation over its rows (each row that drafted is one spec step; tokens
    # and target forwards count prefills too), and the batch after the step.
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # Engine.kv_cache_usage
    # With sampling_params.logprobs: the entries of ``new_tokens`` (for streaming them).
    new_logprobs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


@dataclass
class _Sequence:
    request_id: str
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    started: float
    generated: list[int] = field(default_factory=list)
    accepted: list[bool] = field(default_factory=list)
    per_step_drafted: list[int] = field(default_factory=list)
    per_step_accepted: list[int] = field(default_factory=list)
    token_stats: list[tuple] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    forwards: int = 0
    finish_reason: str | None = None
    stop_text: str | None = None
    stop_ids: set[int] = field(default_factory=set)  # EOS unless ignore_eos, and stop_token_ids
    text: IncrementalDecoder | None = None  # the generation's text so far, kept only to match stop strings

    @property
    def context(self) -> list[int]:
        """Committed tokens whose KV is cached: everything but the pending (last) token."""
        return self.prompt_ids + self.generated[:-1]


# A request ready to join the batch, or the error result it already is.
Prepared = _Sequence | GenerationResult


class _Contexts(Sequence[list[int]]):
    """Each row's committed tokens, built only for a drafter that reads them (n-gram lookup)."""

    def __init__(self, seqs: list[_Sequence]) -> None:
        self._seqs = seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def __getitem__(self, row):  # type: ignore[override]
        if isinstance(row, slice):
            return [seq.context for seq in self._seqs[row]]
        return self._seqs[row].context


# The per-row tensors of WarpParams kept as batch state; penalties are built per step, from each row's history.
ROW_FIELDS = ("temperature", "top_k", "top_p")


class EngineError(ValueError):
    """A request the engine cannot run; it becomes that sequence's error result."""


def encode_request(tokenizer: PreTrainedTokenizerBase, request: Request) -> tuple[str, list[int]]:
    """Prompt text and token ids (SPEC "Input"): ``prompt`` exactly as ``tokenizer(prompt)`` does, ``messages``
    through the chat template (the request's or the tokenizer's) with the generation prompt unless the request
    continues its final message, or ``prompt_token_ids`` as given."""
    if request.prompt_token_ids is not None:
        ids = [int(t) for t in request.prompt_token_ids]
        return (request.prompt if isinstance(request.prompt, str) else tokenizer.decode(ids)), ids
    if request.messages is not None:
        if request.add_generation_prompt and request.continue_final_message:
            raise EngineError("add_generation_prompt and continue_final_message cannot both be true")
        options = {"chat_template": request.chat_template, "add_generation_prompt": request.add_generation_prompt,
                   "continue_final_message": request.continue_final_message}
        try:
            prompt = tokenizer.apply_chat_template(
                request.messages, **{**(request.chat_template_kwargs or {}), **options, "tokenize": False}
            )
        except Exception as exc:  # templates raise many types on malformed messages
            raise EngineError(f"cannot render messages with the chat template: {exc}") from exc
        return prompt, tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if isinstance(request.prompt, str):
        return request.prompt, tokenizer(request.prompt)["input_ids"]
    raise EngineError(f"prompt must be a string, got {type(request.prompt).__name__}")


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> set[int]:
    """Tokens that end a sequence: the tokenizer's EOS and the model's generation config's."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return {i for i in ids if i is not None}


def prefill_groups(
    lengths: list[int], max_tokens: int, padding_slack: float = 0.1, padding_floor: int = 256
) -> list[slice]:
    """Consecutive groups of prompts whose padded size (rows x longest prompt) stays within ``max_tokens`` and
    within ``padding_slack`` of their real tokens (or ``padding_floor`` tokens, for short prompts).

    Prefilling 64 long prompts in one forward padded them all to the longest and built attention inputs of
    rows x length^2: 64 XSum documents ran a 24 GB machine out of memory. A prompt longer than the budget gets a
    forward of its own. Padding is paid in full: a prefill costs the same per token for one row of 700 tokens
    as for eight (1.9 vs 1.8 ms on 2 CPU cores, SmolLM2-135M), so eight XSum prompts of 300 to 1,300 tokens
    padded together cost up to twice their tokens, while one forward per prompt costs nothing more.
    """
    groups, start, longest, real = [], 0, 0, 0
    for end, length in enumerate(lengths):
        padded = (end - start + 1) * max(longest, length)
        allowed = min(max_tokens, max(real + length + padding_floor, (1 + padding_slack) * (real + length)))
        if end > start and padded > allowed:
            groups.append(slice(start, end))
            start, longest, real = end, 0, 0
        longest, real = max(longest, length), real + length
    if lengths:
        groups.append(slice(start, len(lengths)))
    return groups


class Engine:
    def __init__(
        self,
        config: Config,
        *,
        target: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        draft: torch.nn.Module | None = None,
        device: torch.device | None = None,
        prefill_tokens: int = 8192,
    ) -> None:
        """``prefill_tokens``: most padded tokens (rows x longest prompt) in one prefill forward."""
        self.prefill_tokens = prefill_tokens
        spec = resolve_draft(config.speculative, config.model)
        self.config = config = config.model_copy(update={"speculative": spec})
        self.device = device or (target.device if target is not None else default_device())
        self.tokenizer = tokenizer or load_tokenizer(config.model)
        target_by_path = target is None  # its forward costs may be cached on disk under the path
        if target is None:
            target = load_model(config.model, config.dtype, self.device)
        self.loaded_target = target  # as loaded: a self-draft quantizes these weights, never the view below
        self.target = for_inference(target)
        self.capacity = config.batch_size
        self.cache = SlotKVCache(self.target.config.num_hidden_layers, self.capacity, device=self.device)
        self.max_context = int(getattr(self.target.config, "max_position_embeddings", 1 << 30))
        depth = spec.num_speculative_tokens if spec.method != "none" else 0
        model_width = spec.num_candidates if depth else 1
        # n-gram siblings are extra candidates after the model's own in every level (one target forward for all).
        width = model_width + (spec.ngram_candidates if depth else 0)
        root_width = model_width if spec.candidate_init == "target" else 1
        self.topology = TreeTopology(width, depth, root_width)
        self.drafter = self._make_drafter(draft)
        model_drafts = spec.method == "draft_model"
        self.sources = Sources(
            root_width, model_width if model_drafts else 0,
            (spec.ngram_candidates if model_drafts else model_width) if depth and spec.method != "none" else 0,
            prefix_tokens=0 if self.drafter.target_cache is not None else 1,  # a self-draft never catches up
        )
        self.policy = make_policy(
            spec, self.sources, lambda: self._calibrate(target_by_path, draft is None), capacity=self.capacity,
        )
        self.drafter.uses_hidden_states = self.policy.needs_hidden_states
        self.policy.to(self.device)  # a trained stop head reads the draft's states where they are
        self.eos_ids = eos_token_ids(self.tokenizer, self.target)
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self.rejected: list[GenerationResult] = []
        self.steps = 0
        self.run_seed = run_seed(config.sampling.seed)
        # Row-indexed batch state, filled at admission and moved with swap-remove: sampling parameters on the
        # device (drafter and verification warp there) and on the host (which rows draw random numbers),
        # max_tokens, and the law each pending token came from (allocated at the first prefill, when the logits'
        # width is known). Their own max_top_k / nucleus_rows go stale as rows change: ``_row_warp`` reads them anew.
        self._warp_host = WarpParams.from_params([config.sampling] * self.capacity)
        self._warp_device = self._warp_host.to(self.device)
        self._max_tokens = torch.zeros(self.capacity, dtype=torch.long)
        self._root_scores: torch.Tensor | None = None
        self.host_bytes = {"state": 0, "stats": 0}  # bytes read back from the device (see _to_host)

    # ----------------------------------------------------------------------------------------------- setup
    def _make_drafter(self, draft: torch.nn.Module | None) -> Drafter:
        spec = self.config.speculative
        if spec.method == "none":
            return Drafter()
        if spec.method == "ngram":
            return NgramDrafter(spec.prompt_lookup_max, spec.prompt_lookup_min)
        if spec.model == SELF_DRAFT:
            draft = self.loaded_target
        elif draft is None:
            check_same_tokenizer(self.tokenizer, load_tokenizer(spec.model), spec.model)
            draft = load_draft(spec.model, self.config.dtype, self.device)
        elif draft.config.vocab_size != self.target.config.vocab_size:
            raise ValueError(
                f"draft vocab size {draft.config.vocab_size} differs from the target's "
                f"{self.target.config.vocab_size}: the draft must share the target's tokenizer"
            )
        self.max_context = min(self.max_context, int(getattr(draft.config, "max_position_embeddings", 1 << 30)))
        subset = draft_vocab_subset(spec.model) if spec.model and spec.model != SELF_DRAFT else None
        draft = draft.to(self.device).eval()
        if spec.quantization:
            draft = quantized(draft, spec.quantization)
        lookup = NgramDrafter(spec.prompt_lookup_max, spec.prompt_lookup_min) if spec.ngram_candidates else None
        return DraftModelDrafter(
            draft, self.capacity, self.device, subset, lookup, spec.ngram_candidates,
            target_cache=self.cache if spec.model == SELF_DRAFT else None,
        )

    def _calibrate(self, target_from_path: bool, draft_from_path: bool) -> tuple[BatchCosts, BatchCosts | None]:
        """Measured forward costs (cached on disk for models loaded by path) for the online policy."""
        spec = self.config.speculative
        verify = calibrate_batch(
            self.target, self.topology.size(self.topology.max_depth), self.capacity,
            resolve_model_path(self.config.model) if target_from_path else None,
        )
        if not isinstance(self.drafter, DraftModelDrafter):
            return verify, None  # n-gram lookup costs next to nothing beside a forward
        draft_key = None  # the quantization is part of what was timed
        if spec.model == SELF_DRAFT and target_from_path:
            draft_key = f"{resolve_model_path(self.config.model)}|self-draft|{spec.quantization}"
        elif draft_from_path and spec.model and spec.model != SELF_DRAFT:
            draft_key = f"{resolve_model_path(spec.model)}|{spec.quantization}"
        return verify, calibrate_batch(self.drafter.model, self.topology.root_width + 1, self.capacity, draft_key)

    # ------------------------------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a request; an invalid one finishes at the next step with an error result."""
        self.add_prepared(self.prepare(request))

    def prepare(self, request: Request, tokenizer: PreTrainedTokenizerBase | None = None) -> Prepared:
        """Validate and tokenize a request, touching no engine state: a runner calls this off the stepping thread
        (with a ``tokenizer`` of that thread's own), so a long prompt never stalls the batch. The result goes to
        ``add_prepared``; an invalid request becomes its error result."""
        started = time.perf_counter()
        try:
            params = self._sampling_params(request.sampling)
            prompt, prompt_ids = self._tokenize(request, tokenizer or self.tokenizer)
        except EngineError as exc:
            prompt = request.prompt if isinstance(request.prompt, str) else ""
            return self._error_result(request.id, prompt, str(exc), started)
        generator = row_generator(params, self.run_seed, request.seed_key or request.id)
        seq = _Sequence(request.id, prompt, prompt_ids, params, generator, started)
        seq.stop_ids = params.stop_ids(self.eos_ids)
        return seq

    def add_prepared(self, prepared: Prepared) -> None:
        """Queue what ``prepare`` made (cheap: for the stepping thread)."""
        if isinstance(prepared, GenerationResult):
            self.rejected.append(prepared)
        else:
            self.waiting.append(prepared)

    def _sampling_params(self, sampling: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        if not isinstance(sampling, SamplingParams):
            try:  # the config's seed is the run's, not a row's (see decoding.sampling.row_generator)
                merged = {**self.config.sampling.model_dump(exclude={"seed"}), **(sampling or {})}
                sampling = SamplingParams.model_validate(merged)
            except (ValidationError, TypeError) as exc:
                detail = format_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
                raise EngineError(f"invalid sampling_params: {detail}") from exc
        vocab = self.target.config.vocab_size
        if any(t < 0 or t >= vocab for t in sampling.stop_token_ids):
            raise EngineError(f"invalid sampling_params: stop_token_ids must lie in [0, {vocab})")
        if sampling.structured_outputs is not None:  # validated above; the step does not apply masks
            raise EngineError(
                "invalid sampling_params: structured_outputs (guided_decoding) is not applied by this engine's step, "
                "so it is refused rather than ignored"
            )
        if sampling.n != 1:
            raise EngineError(
                f"invalid sampling_params: n is {sampling.n}; one request decodes one sequence (the server returns "
                "n choices; a batch job writes one row per input row, so repeat the row for more samples)"
            )
        return sampling

    def _tokenize(self, request: Request, tokenizer: PreTrainedTokenizerBase) -> tuple[str, list[int]]:
        prompt, ids = encode_request(tokenizer, request)
        if not ids:
            raise EngineError("empty prompt")
        if len(ids) >= self.max_context:
            raise EngineError(f"prompt has {len(ids)} tokens; the model's context is {self.max_context} tokens")
        vocab = self.target.config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise EngineError(f"prompt token ids must lie in [0, {vocab})")
        return prompt, ids

    def abort(self, request_id: str) -> bool:
        """Drop a request (e.g. its client went away) between steps; returns whether it was still pending."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return True
        for row, seq in enumerate(self.running):
            if seq.request_id == request_id:
                self._remove_row(row)
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.rejected)

    def generate(self, requests: Iterable[Request]) -> list[GenerationResult]:
        """Run requests to completion, keeping the batch full; results in request order."""
        order = []
        for request in requests:
            order.append(request.id)
            self.add_request(request)
        done: dict[str, GenerationResult] = {}
        while self.has_unfinished():
            for result in self.step().finished:
                done[result.id] = result
        return [done[i] for i in order]

    # ------------------------------------------------------------------------------------------- stepping
    def step(self) -> StepOutput:
        emitted: dict[str, list[int]] = {}
        finished, self.rejected = self.rejected, []
        prefilled = len(self.waiting)
        self._admit(emitted)
        prefilled -= len(self.waiting)
        live = list(self.running)  # every sequence that may emit tokens this step
        finished += self._retire()  # sequences done at prefill (EOS, max_tokens 1) never speculate
        verified = list(self.running)
        if verified:
            self._speculate(emitted)
            finished += self._retire()
        spec = SpecDecodeStats.from_steps(
            [seq.per_step_drafted[-1] for seq in verified], [seq.per_step_accepted[-1] for seq in verified],
            sum(len(tokens) for tokens in emitted.values()), prefilled + len(verified), self.topology.max_depth,
        )
        new_logprobs = {
            seq.request_id: seq.logprobs[len(seq.generated) - len(emitted[seq.request_id]) : len(seq.generated)]
            for seq in live if seq.params.logprobs is not None and seq.request_id in emitted
        }
        return StepOutput(finished, emitted, spec, len(self.running), len(self.waiting), self.kv_cache_usage(),
                          new_logprobs)

    def kv_cache_usage(self) -> float:
        """Share of the KV cache's allocated entries that hold committed tokens (vLLM's ``kv_cache_usage_perc``)."""
        cache = self.cache
        return sum(cache.host_lengths[: cache.active]) / (cache.capacity * cache.max_slots)

    def _admit(self, emitted: dict[str, list[int]]) -> None:
        """Prefill waiting sequences into free rows: shortest first, in ragged forwards of bounded padded size."""
        joining = [self.waiting.popleft() for _ in range(min(self.capacity - len(self.running), len(self.waiting)))]
        joining.sort(key=lambda seq: len(seq.prompt_ids))
        if joining:
            longest = len(joining[-1].prompt_ids)
            tree = self.topology.size(self.topology.max_depth) + 1
            # Room for the prompts and up to as many new tokens in one allocation (a longer run grows as it goes).
            self.cache.reserve(longest + min(max(s.params.max_tokens for s in joining), longest) + tree)
        for group in prefill_groups([len(seq.prompt_ids) for seq in joining], self.prefill_tokens):
            self._prefill(joining[group], emitted)

    def _to_host(self, tensor: torch.Tensor, *, stats: bool = False) -> torch.Tensor:
        """Every device -> host copy of a step goes through here: a test bounds the bytes, and on a GPU each call
        is a wait for the device, so the step makes few of them (admission, root siblings, verification)."""
        self.host_bytes["stats" if stats else "state"] += tensor.numel() * tensor.element_size()
        return tensor.to("cpu")

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Host -> device without waiting: a blocking copy would also wait for the device's queue to drain."""
        return tensor.to(self.device, non_blocking=True)

    def _uniforms(self, seqs: list[_Sequence], count: int) -> torch.Tensor | None:
        """[B, count] uniforms on the device, each sampled row's from its own generator (greedy rows: 0); None
        when every row is greedy. A row draws the same count every step, whatever the others do."""
        sampled = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
        if not sampled:
            return None
        return self._to_device(row_uniforms([s.generator for s in seqs], sampled, count))

    def _set_rows(self, rows: slice, joining: list[_Sequence]) -> None:
        """Admission: the joining sequences' sampling parameters become rows of the batch tensors."""
        new = WarpParams.from_params([s.params for s in joining])
        for name in ROW_FIELDS:
            getattr(self._warp_host, name)[rows] = getattr(new, name)
            getattr(self._warp_device, name)[rows] = self._to_device(getattr(new, name))
        self._max_tokens[rows] = torch.tensor([s.params.max_tokens for s in joining])

    @torch.no_grad()
    def _prefill(self, joining: list[_Sequence], emitted: dict[str, list[int]]) -> None:
        rows = self.cache.add_rows(len(joining))
        ids, lengths = pad_rows([s.prompt_ids for s in joining])
        width = ids.shape[1]
        valid = torch.arange(width)[None] < lengths[:, None]
        last_positions = sorted(set((lengths - 1).tolist()))
        reads_states = self.drafter.reads_target_states
        logits, states = forward_tree(
            self.target, self.cache, rows, self._to_device(ids), chain_ancestors(width), self._to_device(valid),
            logits_at=torch.tensor(last_positions), want_hidden=reads_states,
            hidden_at=torch.arange(width) if reads_states else None,
        )
        keep = torch.arange(width)[None].expand(len(joining), -1)
        self.cache.commit(rows, keep, lengths)  # on the host: commit moves it where needed
        self._set_rows(rows, joining)
        at = self._to_device(torch.tensor([last_positions.index(n - 1) for n in lengths.tolist()]))
        raw = logits[torch.arange(len(joining), device=self.device), at].float()  # [B, V]
        last = raw
        if any(s.params.penalized for s in joining):
            last = self._warp(joining, prefill=True).to(self.device).penalize(raw)
        if self._root_scores is None:
            self._root_scores = last.new_zeros(self.capacity, last.shape[-1])
        tokens, scores = last.argmax(-1), last
        uniforms = self._uniforms(joining, 1)
        if uniforms is not None:
            warp = self._row_warp(rows)
            probs = warp_probs(last, warp)
            greedy = warp.temperature == 0
            tokens = torch.where(greedy, tokens, sample_from(probs, uniforms[:, 0]))
            scores = torch.where(greedy[:, None], last, probs)
        self._root_scores[rows] = scores
        for i, (seq, token) in enumerate(zip(joining, self._to_host(tokens).tolist())):
            seq.forwards = 1
            if seq.params.logprobs is not None:
                seq.logprobs += token_logprobs(self._to_host(raw[i : i + 1], stats=True), [token], seq.params.logprobs)
            self._emit(seq, [token], [False], emitted)
        self.running.extend(joining)
        self.drafter.add_rows(rows, [s.prompt_ids for s in joining], states)

    def _reproducible(self, params: SamplingParams) -> bool:
        """A sampled row that must reproduce (a run seed, or its own): the policy's choices for it may then depend
        only on its seed and its past acceptance, never on timings or other rows (SPEC "Decoding semantics")."""
        return not params.greedy and (params.seed is not None or self.config.sampling.seed is not None)

    def _plan(self, seqs: list[_Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(model depths, lookup depths or None) per row, within each row's room."""
        batch = len(seqs)
        contexts = self.cache.host_lengths[:batch]  # cached tokens, known on the host
        depths, lookup_depths = self.policy.plan_rows(
            [s.request_id for s in seqs], contexts, [self._reproducible(s.params) for s in seqs]
        )
        generated = torch.tensor([len(s.generated) for s in seqs])
        room = torch.minimum(
            self._max_tokens[:batch] - generated - 1,  # a step emits accepted + 1 tokens
            self.max_context - 1 - torch.tensor(contexts),
        )
        finished = torch.tensor([s.finish_reason is not None for s in seqs])
        room = torch.where(finished, 0, room.clamp(min=0))
        return depths.minimum(room), lookup_depths.minimum(room) if lookup_depths is not None else None

    def _roots(self, seqs: list[_Sequence], depths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Root-level tokens: the pending token, plus target-initialized siblings where a row drafts."""
        width = self.topology.root_width
        pending = torch.tensor([s.generated[-1] for s in seqs])
        roots = torch.zeros(len(seqs), width, dtype=torch.long)
        valid = torch.zeros(len(seqs), width, dtype=torch.bool)
        roots[:, 0], valid[:, 0] = pending, True
        if width == 1:
            return roots, valid
        batch = len(seqs)
        uniforms = self._uniforms(seqs, width - 1)
        siblings = self._to_host(sample_siblings(
            self._root_scores[:batch], self._to_device(pending), self._warp_device.temperature[:batch] == 0,
            width - 1, self.config.speculative.replacement,
            uniforms if uniforms is not None else torch.zeros(batch, width - 1, device=self.device),
        ))
        drafts = (siblings >= 0) & (depths > 0)[:, None]
        roots[:, 1:] = torch.where(drafts, siblings, 0)
        valid[:, 1:] = drafts
        return roots, valid

    @torch.no_grad()
    def _speculate(self, emitted: dict[str, list[int]]) -> None:
        seqs = self.running
        batch = len(seqs)
        rows = slice(0, batch)
        depths, lookup_depths = self._plan(seqs)
        # Penalties need each row's history: then the drafter warps with it (the target's logits get the same below).
        penalized = any(s.params.penalized for s in seqs)
        row_warp = self._row_warp(rows)
        warp = self._warp(seqs).to(self.device) if penalized else row_warp
        roots, root_valid = self._roots(seqs, depths)
        started = time.perf_counter()
        draft = self.drafter.propose(
            DraftInputs(
                contexts=_Contexts(seqs), roots=roots, root_valid=root_valid, depths=depths,  # type: ignore[arg-type]
                topology=self.topology, warp=warp, greedy=self._warp_host.temperature[rows] == 0,
                generators=[s.generator for s in seqs], replacement=self.config.speculative.replacement,
                keep=self.policy.keep, lookup_depths=lookup_depths, to_host=self._to_host,
            )
        )
        drafted = time.perf_counter()
        size = draft.tokens.shape[1]
        ancestors = self.topology.sliced_ancestors(draft.depth)
        tokens, valid = self._to_device(draft.tokens), self._to_device(draft.valid)
        raw, states, slot_of = self._verify_forward(rows, draft, tokens, valid, ancestors)
        logits = raw
        if penalized:  # each node with its own history, as the draft did
            logits = warp.penalize(raw, tokens, self._to_device(ancestors))
        uniforms = self._uniforms(seqs, self.topology.size(self.topology.max_depth) + 1)
        verdict = verify_batch(
            logits, tokens, valid, self.topology, row_warp, self._root_scores[rows],
            self._to_device(draft.draft_probs) if draft.draft_probs is not None else None,
            self.config.speculative.replacement,
            uniforms[:, [*range(size), -1]] if uniforms is not None else None,
            self._to_device(draft.point_mass) if draft.point_mass is not None else None,
        )
        self._root_scores[rows] = verdict.next_law
        host = self._to_host(torch.cat([verdict.path, verdict.next_token[:, None]], 1))
        lengths = (host[:, :-1] >= 0).sum(1)
        paths = [path[:n] for path, n in zip(host[:, :-1].tolist(), lengths.tolist())]
        next_tokens = host[:, -1].tolist()
        context = sum(self.cache.host_lengths[:batch]) / batch
        timing = StepTiming(  # the host copy above waited for the verify forward: its time is all in
            (batch, int(draft.valid.any(0).sum()), context), time.perf_counter() - drafted,
            [(count, width, context) for count, width in self.drafter.forward_shapes], drafted - started,
        )
        self.cache.commit(rows, slot_of[host[:, :-1].clamp(min=0)], lengths)  # on the host: see commit
        target_token_probs = self._to_host(verdict.token_probs, stats=True).tolist()
        draft_token_probs = self._to_host(draft.token_probs, stats=True).tolist()
        self.drafter.observe(paths, draft, states)

        self.steps += 1
        depth_of = self.topology.depths
        drafted_nodes = draft.valid & (depth_of[:size] > 0)[None]
        node_depths, node_candidates = depth_of.tolist(), self.topology.candidate_index.tolist()
        draft_tokens = draft.tokens.tolist()
        emitted_by_row = []
        for row, (seq, path) in enumerate(zip(seqs, paths)):
            accepted_nodes = [n for n in path if node_depths[n] > 0]
            seq.forwards += 1
            new_tokens = [draft_tokens[row][n] for n in accepted_nodes] + [next_tokens[row]]
            emitted_by_row.append(new_tokens)
            if seq.params.logprobs is not None:  # opt-in: the target's log-probabilities at the path's nodes
                at_path = self._to_host(raw[row, path], stats=True)
                seq.logprobs += token_logprobs(at_path, new_tokens, seq.params.logprobs)
            kept = self._emit(seq, new_tokens, [True] * len(accepted_nodes) + [False], emitted)
            kept_nodes = set(accepted_nodes[:kept])  # a stop inside the accepted run drops the rest
            drafted = drafted_nodes[row].nonzero().flatten().tolist()
            seq.per_step_drafted.append(len(drafted))
            seq.per_step_accepted.append(len(kept_nodes))
            for node in drafted:
                seq.token_stats.append((
                    self.steps, node_depths[node], node_candidates[node], draft_tokens[row][node],
                    draft_token_probs[row][node], target_token_probs[row][node], node in kept_nodes,
                ))
        matched = self._matched_by_source(draft, emitted_by_row)
        self.policy.observe(StepRecord(
            ids=[s.request_id for s in seqs],
            planned_depth=depths.tolist(),
            drafted_depth=(drafted_nodes * depth_of[:size]).amax(1).tolist(),
            accepted=[s.per_step_accepted[-1] for s in seqs],
            lookup_planned=(lookup_depths if lookup_depths is not None else depths).tolist(),
            model_matched=matched[0], lookup_matched=matched[1], timing=timing,
        ))

    def _matched_by_source(
        self, draft: Draft, emitted: list[list[int]]
    ) -> tuple[list[int] | None, list[int] | None]:
        """How far the best chain of the model's candidates, and of the lookup siblings, agrees with the tokens
        each row emitted: what each drafter alone would have had accepted, so the policy learns both from every
        step whichever won. None where the tree has one drafter (its accepted run says it)."""
        sources = self.sources
        if not (sources.model_width and sources.lookup_width) or draft.depth == 0:
            return None, None
        topology, depth = self.topology, draft.depth
        levels = torch.tensor([topology.level_slice(level).start for level in range(1, depth + 1)])
        nodes = levels[None, :] + torch.arange(topology.num_candidates)[:, None]  # [C, D]
        chains = draft.tokens[:, nodes]  # [B, C, D]
        target = torch.full((len(emitted), depth), -1, dtype=torch.long)
        for row, tokens in enumerate(emitted):
            target[row, : min(len(tokens), depth)] = torch.tensor(tokens[:depth])
        parents = torch.tensor(topology.parents)[nodes[:, 0]]
        under_pending = (parents == 0)[None, :, None]  # target-initialized siblings' chains never count
        agree = (chains == target[:, None, :]) & draft.valid[:, nodes] & under_pending
        matched = agree.long().cumprod(-1).sum(-1)  # [B, C]
        width = sources.model_width
        return matched[:, :width].amax(1).tolist(), matched[:, width:].amax(1).tolist()

    def _verify_forward(
        self, rows: slice, draft: Draft, tokens: torch.Tensor, valid: torch.Tensor, ancestors: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The target forward over the tree's live nodes; (logits [B, N, V], states) on the device and the cache
        slot of each node on the host. ``tokens``/``valid`` are the draft's on the device; the live nodes come from
        its host copy.

        A node no row has (a candidate that stopped, an n-gram sibling without a match) is left out of the forward
        rather than padded: on a CPU each extra token of a small verify costs ~5% of a plain step. A node's
        ancestors are live wherever it is, so the live nodes form a tree of their own.
        """
        size = draft.tokens.shape[1]
        nodes = draft.valid.any(0).nonzero().flatten()
        slot_of = torch.zeros(size, dtype=torch.long)
        slot_of[nodes] = torch.arange(len(nodes))
        if len(nodes) == size:
            logits, states = forward_tree(self.target, self.cache, rows, tokens, ancestors, valid,
                                          want_hidden=self.drafter.reads_target_states)
            return logits, states, slot_of
        live = self._to_device(nodes)
        logits, states = forward_tree(
            self.target, self.cache, rows, tokens[:, live], ancestors[nodes][:, nodes], valid[:, live],
            want_hidden=self.drafter.reads_target_states,
        )
        # Back to tree positions; dead nodes' rows are never read.
        on_device = self._to_device(slot_of)
        return logits[:, on_device], states[:, on_device] if states is not None else None, slot_of

    def _row_warp(self, rows: slice) -> WarpParams:
        """The device's sampling parameters of ``rows``, with what warping branches on read from their host copy."""
        host = WarpParams(*(getattr(self._warp_host, name)[rows] for name in ROW_FIELDS))  # its facts computed
        return WarpParams(*(getattr(self._warp_device, name)[rows] for name in ROW_FIELDS),
                          max_top_k=host.max_top_k, nucleus_rows=host.nucleus_rows)

    def _warp(self, seqs: list[_Sequence], prefill: bool = False) -> WarpParams:
        """Sampling parameters of ``seqs`` as tensors, with the committed histories their penalties need."""
        params = [s.params for s in seqs]
        if not any(p.penalized for p in params):
            return WarpParams.from_params(params)
        return WarpParams.from_params(
            params, [s.prompt_ids for s in seqs], [[] if prefill else s.generated[:-1] for s in seqs],
            self.eos_ids, self.target.config.vocab_size,
        )

    # ------------------------------------------------------------------------------------------- results
    def _emit(self, seq: _Sequence, tokens: list[int], accepted: list[bool], emitted: dict[str, list[int]]) -> int:
        """Append tokens up to a stop condition; returns how many were kept."""
        before = len(seq.generated)
        for token, flag in zip(tokens, accepted):
            seq.generated.append(token)
            seq.accepted.append(flag)
            if token in seq.stop_ids:
                seq.finish_reason = "stop"
                break
            if len(seq.generated) >= seq.params.max_tokens or (
                len(seq.prompt_ids) + len(seq.generated) >= self.max_context
            ):
                seq.finish_reason = "length"
                break
        if seq.params.stop:
            self._apply_stop_strings(seq, before)
        if len(seq.generated) < before:
            raise AssertionError("stop handling removed committed tokens")
        emitted.setdefault(seq.request_id, []).extend(seq.generated[before:])
        return len(seq.generated) - before

    def _apply_stop_strings(self, seq: _Sequence, before: int) -> None:
        """Cut after the first token whose text completes a stop string; the text ends before the stop string.

        Incremental: each token is decoded once, and only text that the new token could complete is searched (a
        stop string found now must end in the token's text, else an earlier token would have ended the sequence).
        """
        if seq.text is None:
            seq.text = IncrementalDecoder(self.tokenizer)
        stops = seq.params.stop
        longest = max(len(stop) for stop in stops)
        for end in range(before, len(seq.generated)):
            start = max(0, len(seq.text.text) - longest + 1)
            seq.text.push([seq.generated[end]])
            hits = [at for stop in stops if (at := seq.text.text.find(stop, start)) >= 0]
            if hits:
                del seq.generated[end + 1 :], seq.accepted[end + 1 :]
                seq.stop_text = seq.text.text[: min(hits)]
                seq.finish_reason = "stop"
                return

    def _retire(self) -> list[GenerationResult]:
        results = []
        for row in sorted((r for r, s in enumerate(self.running) if s.finish_reason), reverse=True):
            results.append(self._result(self.running[row]))
            self._remove_row(row)
        return results[::-1]

    def _remove_row(self, row: int) -> None:
        """Swap-remove: the last running sequence takes this row in the caches, the batch tensors and the drafter."""
        self.policy.forget(self.running[row].request_id)
        last = len(self.running) - 1
        for state in (*(getattr(w, name) for w in (self._warp_host, self._warp_device) for name in ROW_FIELDS),
                      self._max_tokens, self._root_scores):
            state[row] = state[last]
        self.cache.remove_row(row)
        self.drafter.remove_row(row)
        self.running[row] = self.running[-1]
        self.running.pop()

    def _histogram(self, per_step_drafted: list[int], per_step_accepted: list[int]) -> list[int]:
        return acceptance_histogram(per_step_drafted, per_step_accepted, self.topology.max_depth)

    def _result(self, seq: _Sequence) -> GenerationResult:
        text = seq.stop_text
        if not seq.params.detokenize:
            text = ""
        elif text is None:
            text = self.tokenizer.decode(seq.generated, skip_special_tokens=seq.params.skip_special_tokens)
        return GenerationResult(
            id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_ids, token_ids=seq.generated,
            text=text, finish_reason=seq.finish_reason or "length", error=None,
            time_taken=time.perf_counter() - seq.started, token_accepted=seq.accepted,
            per_step_drafted=seq.per_step_drafted, per_step_accepted=seq.per_step_accepted,
            num_target_forwards=seq.forwards,
            acceptance_histogram=self._histogram(seq.per_step_drafted, seq.per_step_accepted),
            token_stats=seq.token_stats,
            logprobs=seq.logprobs[: len(seq.generated)] if seq.params.logprobs is not None else None,
        )

    def _error_result(self, request_id: str, prompt: str, message: str, started: float) -> GenerationResult:
        return GenerationResult(
            id=request_id, prompt=prompt, prompt_token_ids=[], token_ids=[], text="", finish_reason="error",
            error=message, time_taken=time.perf_counter() - started, token_accepted=[], per_step_drafted=[],
            per_step_accepted=[], num_target_forwards=0, acceptance_histogram=self._histogram([], []),
        )
