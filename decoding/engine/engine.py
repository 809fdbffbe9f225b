"""The batched speculative decoding engine: step-wise API for continuous batching.

An engine is a scheduler (``scheduler.py``: waiting and running sequences, admission while rows and KV blocks are
free), the batch state (``batch_state.py``: row tensors; the paged KV cache ``kv_cache.py``: block tables) and the
step (``step.py``: plan -> draft -> verify -> commit -> observe). ``step()`` admits and prefills waiting
sequences, runs one step over the running batch, and retires what finished.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
from pydantic import ValidationError
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from decoding.config import Config, SamplingParams, format_validation_error
from decoding.constraints.constrained import Constraints
from decoding.drafting.costs import BatchCosts, calibrate_batch
from decoding.drafting.drafters import Drafter, DraftModelDrafter, NgramDrafter, model_view
from decoding.drafting.length_policies import LengthPolicy, Sources, make_policy
from decoding.engine.batch_state import BatchState
from decoding.engine.kv_cache import CacheShape, PagedKVCache
from decoding.engine.scheduler import Scheduler, prefill_groups
from decoding.engine.sequence import (
    EngineError,
    GenerationResult,
    Prepared,
    Request,
    Sequence,
    StepOutput,
    encode_request,
    eos_token_ids,
    error_result,
)
from decoding.engine.step import HostReads, Step
from decoding.model.cuda_graphs import build_shapes, captures_at_build, graph_memory_budget
from decoding.model.lean_forward import LeanCausalLM
from decoding.model.loading import (
    SELF_DRAFT,
    check_same_tokenizer,
    default_device,
    draft_vocab_subset,
    load_draft,
    load_model,
    load_tokenizer,
    resolve_draft,
    resolve_model_path,
)
from decoding.model.quantize import quantized
from decoding.stats import SpecDecodeStats
from decoding.verification.sampling import row_generator, run_seed
from decoding.verification.tree import TreeTopology

__all__ = ["Engine", "EngineError", "GenerationResult", "Prepared", "Request", "StepOutput", "encode_request",
           "prefill_groups"]

# The CPU pool's default ceiling (vLLM's CPU KV space default).
CPU_KV_BYTES = 4 << 30


class Engine:
    def __init__(
        self,
        config: Config,
        *,
        target: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        draft: torch.nn.Module | None = None,
        device: torch.device | None = None,
        prefill_tokens: int | None = None,
    ) -> None:
        """``prefill_tokens``: most padded tokens (rows x longest prompt) in one prefill forward (default: the
        config's ``max_num_batched_tokens``)."""
        self.prefill_tokens = prefill_tokens or config.max_num_batched_tokens
        spec = resolve_draft(config.speculative, config.model)
        self.config = config = config.model_copy(update={"speculative": spec})
        self.device = device or (target.device if target is not None else default_device())
        self.tokenizer = tokenizer or load_tokenizer(config.model)
        target_by_path = target is None  # its forward costs may be cached on disk under the path
        if target is None:
            target = load_model(config.model, config.dtype, self.device)
        self.loaded_target = target  # as loaded: a self-draft quantizes these weights, never the view below
        self.target = model_view(target)
        self.capacity = config.batch_size
        self.max_context = int(getattr(target.config, "max_position_embeddings", 1 << 30))
        depth = spec.num_speculative_tokens if spec.method != "none" else 0
        model_width = spec.num_candidates if depth else 1
        # n-gram siblings are extra candidates after the model's own in every level (one target forward for all).
        width = model_width + (spec.ngram_candidates if depth else 0)
        root_width = model_width if spec.candidate_init == "target" else 1
        self.topology = TreeTopology(width, depth, root_width)
        self.drafter = self._make_drafter(draft)
        if config.max_model_len:
            self.max_context = min(self.max_context, config.max_model_len)
        self.cache = self._make_cache()
        if isinstance(self.drafter, DraftModelDrafter):
            self.drafter.attach(self.cache)
        model_drafts = spec.method == "draft_model"
        self.sources = Sources(
            root_width, model_width if model_drafts else 0,
            (spec.ngram_candidates if model_drafts else model_width) if depth and spec.method != "none" else 0,
            prefix_tokens=0 if spec.model == SELF_DRAFT else 1,  # a self-draft never catches up
        )
        for model in (self.target, getattr(self.drafter, "model", None)):
            if isinstance(model, LeanCausalLM):
                model.compiled()  # compiled (or loaded) now, at build, never mid-run
        policy = make_policy(
            spec, self.sources, lambda: self._calibrate(target_by_path, draft is None), capacity=self.capacity,
        )
        self.drafter.uses_hidden_states = policy.needs_hidden_states
        policy.to(self.device)  # a trained stop head reads the draft's states where they are
        if self._captures_graphs():
            self._capture_graphs()
        self.eos_ids = eos_token_ids(self.tokenizer, target)
        self.run_seed = run_seed(config.sampling.seed)
        self.state = BatchState(self.capacity, config.sampling, self.device)
        self.constraints = Constraints(self.loaded_target.config.vocab_size)
        self.scheduler = Scheduler(self.capacity, self.cache, self._positions)
        self.reads = HostReads()
        self.stepper = Step(
            self.target, self.cache, self.drafter, policy, self.topology, self.sources, self.state, spec,
            self.tokenizer, self.max_context, config.sampling.seed is not None, self.reads,
            whole_trees=self._captures_graphs(),
        )

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
        elif draft.config.vocab_size != self.loaded_target.config.vocab_size:
            raise ValueError(
                f"draft vocab size {draft.config.vocab_size} differs from the target's "
                f"{self.loaded_target.config.vocab_size}: the draft must share the target's tokenizer"
            )
        self.max_context = min(self.max_context, int(getattr(draft.config, "max_position_embeddings", 1 << 30)))
        subset = draft_vocab_subset(spec.model) if spec.model and spec.model != SELF_DRAFT else None
        draft = draft.to(self.device).eval()
        if spec.quantization:
            draft = quantized(draft, spec.quantization)
        lookup = NgramDrafter(spec.prompt_lookup_max, spec.prompt_lookup_min) if spec.ngram_candidates else None
        return DraftModelDrafter(
            draft, self.capacity, self.device, subset, lookup, spec.ngram_candidates,
            shares_target_cache=spec.model == SELF_DRAFT,
        )

    def _make_cache(self) -> PagedKVCache:
        """The target's pool: ``num_kv_blocks``, or as many blocks as the memory budget holds (never more than
        ``batch_size`` rows of the whole context need)."""
        config = self.config
        shape = CacheShape.of(self.loaded_target.config)
        dtype = next(self.loaded_target.parameters()).dtype
        positions = self.max_context + self.topology.size(self.topology.max_depth) + 1
        bytes_per_block = shape.bytes_per_token * dtype.itemsize * config.block_size
        blocks_needed = self.capacity * -(-positions // config.block_size)
        blocks = config.num_kv_blocks
        if blocks is None:
            budget = config.kv_cache_memory_bytes
            if budget is None and self.device.type == "cuda":
                total = torch.cuda.get_device_properties(self.device).total_memory
                budget = int(total * config.gpu_memory_utilization) - torch.cuda.memory_allocated(self.device)
                if self._captures_graphs():  # captured after the pool is made: their memory is set aside first
                    budget -= graph_memory_budget()
            budget = budget if budget is not None else CPU_KV_BYTES
            blocks = max(1, min(blocks_needed, budget // bytes_per_block))
        cache = PagedKVCache(shape, blocks, self.capacity, positions, block_size=config.block_size, dtype=dtype,
                             device=self.device)
        return cache

    def _captures_graphs(self) -> bool:
        return captures_at_build() and self.device.type == "cuda" and isinstance(self.target, LeanCausalLM)

    def _capture_graphs(self) -> None:
        """The target's decode and verification forwards as CUDA graphs, for every row and key bucket, captured
        now within the graph memory budget (``cuda_graphs.py``)."""
        cache = self.cache
        positions = cache.max_blocks_per_row * cache.block_size
        topology = self.topology
        tokens = [1, *(topology.size(depth) for depth in range(topology.max_depth + 1))]
        captures = [(self.target, tokens, self.drafter.reads_target_states)]
        draft = getattr(self.drafter, "model", None)
        if self.drafter.graphs and isinstance(draft, LeanCausalLM):  # a self-draft's levels: its roots, then widths
            captures.append((draft, [topology.root_width, topology.num_candidates], self.drafter.uses_hidden_states))

        def memory() -> int:
            return torch.cuda.memory_reserved(self.device)

        started, budget = memory(), graph_memory_budget()
        for model, per_row, hidden in captures:  # one budget for both models
            shapes = build_shapes(cache.keys.data_ptr(), self.capacity, positions, per_row, hidden)
            model.graphed(positions).capture(shapes, cache.keys, cache.values, budget - (memory() - started), memory)

    def _calibrate(self, target_from_path: bool, draft_from_path: bool) -> tuple[BatchCosts, BatchCosts | None]:
        """Measured forward costs (cached on disk for models loaded by path) for the online policy."""
        spec = self.config.speculative
        verify = calibrate_batch(
            self.target, self.topology.size(self.topology.max_depth), self.capacity,
            resolve_model_path(self.config.model) if target_from_path else None, graphs=True,
        )
        if not isinstance(self.drafter, DraftModelDrafter):
            return verify, None  # n-gram lookup costs next to nothing beside a forward
        draft_key = None  # the quantization is part of what was timed
        if spec.model == SELF_DRAFT and target_from_path:
            draft_key = f"{resolve_model_path(self.config.model)}|self-draft|{spec.quantization}"
        elif draft_from_path and spec.model and spec.model != SELF_DRAFT:
            draft_key = f"{resolve_model_path(spec.model)}|{spec.quantization}"
        return verify, calibrate_batch(self.drafter.model, self.topology.root_width + 1, self.capacity, draft_key,
                                       graphs=self.drafter.graphs)

    def _positions(self, seq: Sequence) -> int:
        """KV positions a sequence may reach: its prompt, its generation, and one draft tree past it."""
        generation = min(seq.params.max_tokens, self.max_context - len(seq.prompt_ids))
        return len(seq.prompt_ids) + generation + self.topology.size(self.topology.max_depth) + 1

    # ------------------------------------------------------------------------------------------ requests
    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def policy(self) -> LengthPolicy:
        return self.stepper.policy

    @policy.setter
    def policy(self, policy: LengthPolicy) -> None:
        self.stepper.policy = policy

    @property
    def steps(self) -> int:
        """Verification steps run so far."""
        return self.stepper.steps

    @property
    def host_bytes(self) -> dict[str, int]:
        """Bytes read back from the device, by kind (see ``step.HostReads``)."""
        return self.reads.bytes

    def add_request(self, request: Request) -> None:
        """Queue a request; an invalid one finishes at the next step with an error result."""
        self.add_prepared(self.prepare(request))

    def prepare(self, request: Request, tokenizer: PreTrainedTokenizerBase | None = None) -> Prepared:
        """Validate and tokenize a request, touching no engine state: a runner calls this off the stepping thread
        (with a ``tokenizer`` of that thread's own), so a long prompt never stalls the batch. The result goes to
        ``add_prepared``; an invalid request becomes its error result."""
        started = time.perf_counter()
        tokenizer = tokenizer or self.tokenizer
        try:
            params = self._sampling_params(request.sampling)
            prompt, prompt_ids = self._tokenize(request, tokenizer)
            seq = Sequence(request.id, prompt, prompt_ids, params,
                           row_generator(params, self.run_seed, request.seed_key or request.id), started)
            seq.stop_ids = params.stop_ids(self.eos_ids)
            seq.grammar = self.constraints.row_grammar(params, seq.stop_ids, tokenizer)  # compiled here, off the step
            need = self.cache.blocks_for(self._positions(seq))
            if need > self.cache.num_blocks:
                raise EngineError(
                    f"the request needs {self._positions(seq)} KV cache positions (prompt, max_tokens and a draft "
                    f"tree), the pool holds {self.cache.num_blocks * self.cache.block_size}: lower max_tokens or "
                    "raise kv_cache_memory_bytes / num_kv_blocks"
                )
        except EngineError as exc:
            prompt = request.prompt if isinstance(request.prompt, str) else ""
            return self._error_result(request.id, prompt, str(exc), started)
        return seq

    def add_prepared(self, prepared: Prepared) -> None:
        """Queue what ``prepare`` made (cheap: for the stepping thread)."""
        if isinstance(prepared, GenerationResult):
            self.scheduler.rejected.append(prepared)
        else:
            self.scheduler.waiting.append(prepared)

    def _sampling_params(self, sampling: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        if not isinstance(sampling, SamplingParams):
            try:  # the config's seed is the run's, not a row's (see decoding.verification.sampling.row_generator)
                merged = {**self.config.sampling.model_dump(exclude={"seed"}), **(sampling or {})}
                sampling = SamplingParams.model_validate(merged)
            except (ValidationError, TypeError) as exc:
                detail = format_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
                raise EngineError(f"invalid sampling_params: {detail}") from exc
        vocab = self.loaded_target.config.vocab_size
        if any(t < 0 or t >= vocab for t in sampling.stop_token_ids):
            raise EngineError(f"invalid sampling_params: stop_token_ids must lie in [0, {vocab})")
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
        vocab = self.loaded_target.config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise EngineError(f"prompt token ids must lie in [0, {vocab})")
        return prompt, ids

    def abort(self, request_id: str) -> bool:
        """Drop a request (e.g. its client went away) between steps; returns whether it was still pending."""
        if self.scheduler.drop_waiting(request_id):
            return True
        row = self.scheduler.row_of(request_id)
        if row is None:
            return False
        self._remove_row(row)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

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

    def kv_cache_usage(self) -> float:
        """Share of the KV pool's blocks in use (vLLM's ``kv_cache_usage_perc``)."""
        return self.cache.usage()

    # ------------------------------------------------------------------------------------------- stepping
    @torch.no_grad()
    def step(self) -> StepOutput:
        emitted: dict[str, list[int]] = {}
        finished = self.scheduler.take_rejected()
        joining = self.scheduler.admit()
        self._admit(joining, emitted)
        live = list(self.running)  # every sequence that may emit tokens this step
        finished += self._retire()  # sequences done at prefill (EOS, max_tokens 1) never speculate
        seqs = list(self.running)
        if seqs:
            step = self.stepper
            plan = step.plan(seqs, self.eos_ids)
            drafted = step.draft(seqs, plan)
            verdict = step.verify(seqs, plan, drafted)
            committed = step.commit(seqs, plan, drafted, verdict, emitted)
            step.observe(seqs, plan, drafted, verdict, committed)
            finished += self._retire()
        spec = SpecDecodeStats.from_steps(
            [seq.per_step_drafted[-1] for seq in seqs], [seq.per_step_accepted[-1] for seq in seqs],
            sum(len(tokens) for tokens in emitted.values()), len(joining) + len(seqs), self.topology.max_depth,
        )
        new_logprobs = {
            seq.request_id: seq.logprobs[len(seq.generated) - len(emitted[seq.request_id]) : len(seq.generated)]
            for seq in live if seq.params.logprobs is not None and seq.request_id in emitted
        }
        return StepOutput(finished, emitted, spec, len(self.running), len(self.waiting), self.kv_cache_usage(),
                          new_logprobs)

    def _admit(self, joining: list[Sequence], emitted: dict[str, list[int]]) -> None:
        """Prefill the joining sequences into new rows: shortest first, in ragged forwards of bounded padded size."""
        joining = sorted(joining, key=lambda seq: len(seq.prompt_ids))
        for group in prefill_groups([len(seq.prompt_ids) for seq in joining], self.prefill_tokens):
            seqs = joining[group]
            self.stepper.prefill(seqs, [self._positions(seq) for seq in seqs], self.eos_ids, emitted)
            self.running.extend(seqs)

    def _retire(self) -> list[GenerationResult]:
        results = []
        for row in self.scheduler.finished_rows():
            results.append(self.running[row].result(self.tokenizer, self.topology.max_depth))
            self._remove_row(row)
        return results[::-1]

    def _remove_row(self, row: int) -> None:
        """Swap-remove: the last running sequence takes this row in the caches, the batch tensors and the drafter."""
        self.policy.forget(self.running[row].request_id)
        self.state.remove_row(row, len(self.running) - 1)
        self.cache.remove_row(row)
        self.drafter.remove_row(row)
        self.scheduler.remove_running(row)

    def _error_result(self, request_id: str, prompt: str, message: str, started: float) -> GenerationResult:
        return error_result(request_id, prompt, message, started, self.topology.max_depth)

