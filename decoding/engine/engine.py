"""The batched speculative decoding engine: step-wise API for continuous batching.

An engine is built once (``build.py``: models, the draft, the KV pool, measured costs, graphs) and then stepped: a
scheduler (``scheduler.py``: waiting sequences, admission while rows and KV blocks are free), the running batch
(``batch.py``: the one owner of what a row is) and the step (``step.py``: plan -> draft -> verify -> commit ->
observe). ``step()`` admits and prefills waiting sequences, runs one step over the running batch, and retires what
finished.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from decoding.config import Config, SamplingParams
from decoding.constraints.constrained import Constraints
from decoding.constraints.grammar import GrammarBudget
from decoding.drafting.length_policies import LengthPolicy, RowMemory
from decoding.engine.batch import Batch
from decoding.engine.build import build_parts
from decoding.engine.scheduler import Scheduler
from decoding.engine.sequence import (
    EngineError,
    GenerationResult,
    Prepared,
    Request,
    Sequence,
    StepOutput,
    encode_request,
    error_result,
    input_bytes,
    longest_token_bytes,
)
from decoding.engine.step import HostReads, Step
from decoding.model.lora import AdapterError
from decoding.model.padding import prefill_groups
from decoding.params import RequestError, bad_words_token_ids, check_bans, resolve_sampling
from decoding.stats import SpecDecodeStats
from decoding.verification.sampling import row_generator, run_seed

__all__ = ["Engine", "EngineError", "GenerationResult", "Prepared", "Request", "StepOutput", "encode_request",
           "prefill_groups"]


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
        self.parts = parts = build_parts(config, target=target, tokenizer=tokenizer, draft=draft, device=device)
        self.prefill_tokens = prefill_tokens or config.max_num_batched_tokens
        self.config, self.device, self.tokenizer = parts.config, parts.device, parts.tokenizer
        self.loaded_target, self.target, self.drafter = parts.loaded_target, parts.target, parts.drafter
        self.topology, self.sources, self.cache = parts.topology, parts.sources, parts.cache
        self.capacity, self.max_context, self.eos_ids = parts.capacity, parts.max_context, parts.eos_ids
        self.run_seed = run_seed(self.config.sampling.seed)
        self.batch = Batch(self.capacity, self.config.sampling, self.cache,
                           run_seeded=self.config.sampling.seed is not None, max_context=self.max_context)
        self.batch.listen(self.drafter)
        limits = self.config.limits
        self.constraints = Constraints(self.loaded_target.config.vocab_size, GrammarBudget(
            limits.max_constraint_bytes, limits.grammar_compile_timeout_s, limits.max_grammar_bytes,
            limits.grammar_cache_bytes))
        self.max_prompt_bytes = limits.max_prompt_bytes or self.max_context * longest_token_bytes(self.tokenizer)
        self.adapters = parts.adapters
        self.scheduler = Scheduler(self.batch, self._positions,
                                   [self.cache, *([self.drafter.own_cache] if self.drafter.own_cache else [])],
                                   self.adapters, self._failed_result)
        if self.adapters is not None:
            self.batch.listen(self.adapters)  # a leaving row's adapter slot is released
        self.reads = HostReads()
        self.stepper = Step(parts, self.batch, self.reads)

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
        return self.batch.seqs

    @property
    def policy(self) -> LengthPolicy:
        return self.stepper.policy

    @policy.setter
    def policy(self, policy: LengthPolicy) -> None:
        for seq in self.batch.seqs:  # a new policy learns the running rows afresh
            seq.policy_memory = RowMemory()
        self.stepper.policy = self.parts.policy = policy

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
            seq.bad_words = self._bad_words(params, tokenizer)
            seq.group = request.group or request.id
            seq.cache_salt = request.cache_salt or ""
            if request.lora is not None:
                seq.lora, seq.lora_key = request.lora, self._adapter_key(request.lora)
                seq.cache_salt = f"lora:{seq.lora_key}|{seq.cache_salt}"
            # Compiled here, off the step.
            seq.grammar = self.constraints.row_grammar(params, seq.stop_ids, tokenizer, request.id)
            need = self.cache.blocks_for(self._positions(seq))
            if need > self.cache.num_blocks:
                raise EngineError(
                    f"the request needs {self._positions(seq)} KV cache positions (prompt, max_tokens and a draft "
                    f"tree), the pool holds {self.cache.num_blocks * self.cache.block_size}: lower max_tokens or "
                    "raise kv_cache_memory_bytes / num_kv_blocks"
                )
        except EngineError as exc:
            prompt = request.prompt if isinstance(request.prompt, str) else ""
            result = self._error_result(request.id, prompt, str(exc), started)
            result.lora = request.lora if isinstance(request.lora, str) else None
            return result
        return seq

    def add_prepared(self, prepared: Prepared) -> None:
        """Queue what ``prepare`` made (cheap: for the stepping thread)."""
        if isinstance(prepared, GenerationResult):
            self.scheduler.rejected.append(prepared)
        else:
            self.scheduler.waiting.append(prepared)

    def _sampling_params(self, sampling: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """The request's parameters over the configured ones, validated once (``decoding.params``)."""
        try:
            return resolve_sampling(sampling, self.config.sampling, self.loaded_target.config.vocab_size,
                                    self.eos_ids)
        except RequestError as exc:
            raise EngineError(str(exc)) from exc

    def _bad_words(self, params: SamplingParams, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
        """The token sequences the request's bad words ban, tokenized once here (never in a step)."""
        if not params.bad_words:
            return []
        vocab = self.loaded_target.config.vocab_size
        try:
            words = bad_words_token_ids(params.bad_words, lambda text: tokenizer.encode(text, add_special_tokens=False),
                                        vocab)
            check_bans(params, vocab, self.eos_ids, words)
            return words
        except RequestError as exc:
            raise EngineError(str(exc)) from exc

    def _tokenize(self, request: Request, tokenizer: PreTrainedTokenizerBase) -> tuple[str, list[int]]:
        bound = "max_model_len" if self.config.max_model_len == self.max_context else "the model's context"
        size = input_bytes(request)
        if size > self.max_prompt_bytes:
            what = "prompt" if request.messages is None else "messages' text"
            raise EngineError(f"the {what} has {size} bytes, more than limits.max_prompt_bytes "
                              f"({self.max_prompt_bytes}): longer than {bound} of {self.max_context} tokens can hold")
        keep = request.truncate_prompt_tokens
        if keep is not None and (type(keep) is not int or keep == 0 or keep < -1):
            raise EngineError(f"truncate_prompt_tokens must be -1 (the context) or a number of tokens >= 1, "
                              f"got {keep!r}")
        if request.cache_salt is not None and (type(request.cache_salt) is not str or not request.cache_salt):
            raise EngineError("cache_salt must be a non-empty string")
        limit = None if keep is None else self.max_context if keep == -1 else keep  # the last tokens stay (vLLM's)
        given = request.prompt_token_ids
        if given is not None:
            if limit is not None and isinstance(given, list) and len(given) > limit:
                request = dataclasses.replace(request, prompt=None, prompt_token_ids=given[-limit:])
            self._check_prompt_ids(request.prompt_token_ids, bound)  # before they are decoded into the prompt's text
        prompt, ids = encode_request(tokenizer, request)
        if limit is not None and len(ids) > limit:
            ids = ids[-limit:]
            prompt = tokenizer.decode(ids)
        self._check_prompt_ids(ids, bound)
        return prompt, ids

    def _check_prompt_ids(self, ids: Any, bound: str) -> None:
        """A prompt's token ids: some, fewer than the context, each an integer in the vocabulary."""
        try:
            count = len(ids)
        except TypeError:
            raise EngineError(f"prompt token ids must be a list, got {type(ids).__name__}") from None
        if count == 0:
            raise EngineError("empty prompt")
        if count >= self.max_context:
            raise EngineError(f"prompt has {count} tokens; {bound} is {self.max_context} tokens, and the prompt "
                              "and its output must fit in it")
        vocab = self.loaded_target.config.vocab_size
        try:
            outside = any(not 0 <= int(t) < vocab for t in ids)
        except (TypeError, ValueError, OverflowError):
            raise EngineError("prompt token ids must be integers") from None
        if outside:
            raise EngineError(f"prompt token ids must lie in [0, {vocab})")

    def abort(self, request_id: str) -> bool:
        """Drop a request (e.g. its client went away) between steps; returns whether it was still pending."""
        if self.scheduler.drop_waiting(request_id):
            return True
        row = self.batch.row_of(request_id)
        if row is None:
            return False
        self.batch.remove(row)
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

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (vLLM's ``reset_prefix_cache``): later rows prefill in full."""
        for pool in self.scheduler.pools:
            pool.reset_prefix_cache()

    def kv_cache_usage(self) -> float:
        """Share of the KV pool's blocks in use (vLLM's ``kv_cache_usage_perc``)."""
        return self.cache.usage()

    # ------------------------------------------------------------------------------------------- stepping
    @torch.no_grad()
    def step(self) -> StepOutput:
        started = time.perf_counter()
        finished = self.scheduler.take_rejected()
        joining = self.scheduler.admit()
        queries, hits = self.cache.prefix_queries, self.cache.prefix_hits
        emitted = self._admit(joining)
        live = list(self.running)  # every sequence that may emit tokens this step
        finished += self._retire()  # sequences done at prefill (EOS, max_tokens 1) never speculate
        seqs = list(self.running)
        if seqs:
            step = self.stepper
            plan = step.plan(seqs)
            drafted = step.draft(seqs, plan)
            verdict = step.verify(seqs, plan, drafted)
            committed = step.commit(seqs, plan, drafted, verdict)
            step.observe(seqs, plan, drafted, verdict, committed)
            for seq, tokens in zip(seqs, committed.kept_tokens):
                emitted.setdefault(seq.request_id, []).extend(tokens)
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
                          new_logprobs=new_logprobs, prefix_cache_queries=self.cache.prefix_queries - queries,
                          prefix_cache_hits=self.cache.prefix_hits - hits,
                          scheduled={seq.request_id: seq.params.max_tokens for seq in joining}, started=started,
                          max_context=self.max_context, **self._adapters_in_use())

    def _admit(self, joining: list[Sequence]) -> dict[str, list[int]]:
        """Prefill the joining sequences into new rows: shortest uncached part first, in ragged forwards of bounded
        padded size; the tokens each emitted.

        Rows that would compute the same uncached block (a prompt prefix they share and nobody has cached) are
        prefilled in rounds: one of them first, the others after it, when they find the block cached."""
        emitted: dict[str, list[int]] = {}
        cache = self.cache
        while joining:
            now, later, computing, uncached, limits = [], [], set(), {}, {}
            for seq in joining:
                claim = cache.own_claim(seq.claims)
                held = cache.cached_blocks(claim)
                # The first block it could take from the cache but must compute: another row of this round may.
                key = claim.keys[held] if held < claim.cacheable else None
                if key is not None and key in computing:
                    later.append(seq)
                    continue
                computing.add(key)
                now.append(seq)
                uncached[seq.request_id] = len(seq.prompt_ids) - cache.block_size * held
                # Its blocks are promised up to the positions it may reach: no padding past them.
                limits[seq.request_id] = (cache.blocks_for(claim.positions) - held) * cache.block_size
            now.sort(key=lambda seq: uncached[seq.request_id])
            for group in prefill_groups([uncached[seq.request_id] for seq in now], self.prefill_tokens,
                                        limits=[limits[seq.request_id] for seq in now]):
                grouped = now[group]
                emitted.update(zip((seq.request_id for seq in grouped), self.stepper.prefill(grouped)))
            joining = later
        return emitted

    def _retire(self) -> list[GenerationResult]:
        results = []
        for row in self.batch.finished_rows():
            results.append(self.batch.remove(row).result(self.tokenizer, self.topology.max_depth))
        return results[::-1]

    def _error_result(self, request_id: str, prompt: str, message: str, started: float) -> GenerationResult:
        return error_result(request_id, prompt, message, started, self.topology.max_depth)

    def _adapters_in_use(self) -> dict[str, Any]:
        """``StepOutput``'s LoRA fields: the slots, and the adapters of the running and of the waiting rows."""
        if self.adapters is None:
            return {}
        return {"max_lora": self.config.lora.max_loras,
                "running_adapters": tuple(sorted({seq.lora for seq in self.running if seq.lora is not None})),
                "waiting_adapters": tuple(sorted({seq.lora for seq in self.waiting if seq.lora is not None}))}

    def _failed_result(self, seq: Sequence, message: str) -> GenerationResult:
        """The error result of a waiting sequence that cannot join (its adapter could not be loaded)."""
        result = self._error_result(seq.request_id, seq.prompt, message, seq.started)
        result.lora = seq.lora
        return result

    def _adapter_key(self, name: str) -> str:
        """The adapter's key, after reading it (on the preparing thread: a bad adapter fails its request)."""
        if self.adapters is None:
            raise EngineError(f"lora {name!r}: LoRA adapters are not enabled (set lora.enable: true)")
        try:
            key = self.adapters.resolve(name)
            self.adapters.read(key)
            return key
        except AdapterError as exc:
            raise EngineError(str(exc)) from exc

