"""The batched speculative decoding engine: step-wise API for continuous batching.

One step, for every running sequence at once (gpt-fast style, see ``_speculate``):
plan depths -> draft a candidate tree -> ONE target forward over all trees -> verify each row ->
keep the accepted paths in both caches -> emit tokens -> learn (drafter, length policy).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import ValidationError
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from decoding.acceptance import Verdict, verify_greedy, verify_sampled
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
from decoding.quantize import quantized
from decoding.sampling import WarpParams, draw, row_generator, run_seed, token_logprobs, warp_probs
from decoding.stats import SpecDecodeStats, acceptance_histogram
from decoding.tree import TreeTopology, chain_ancestors


@dataclass
class Request:
    id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams | dict[str, Any] | None = None
    seed_key: str | None = None  # what the row's random stream derives from with the run seed; default: id


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


@dataclass
class _Sequence:
    request_id: str
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    started: float
    root_scores: torch.Tensor | None = None  # law the pending token came from (logits when greedy)
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

    @property
    def context(self) -> list[int]:
        """Committed tokens whose KV is cached: everything but the pending (last) token."""
        return self.prompt_ids + self.generated[:-1]


class EngineError(ValueError):
    """A request the engine cannot run; it becomes that sequence's error result."""


def encode_request(tokenizer: PreTrainedTokenizerBase, request: Request) -> tuple[str, list[int]]:
    """Prompt text and token ids (SPEC "Input"): ``prompt`` exactly as ``tokenizer(prompt)`` does, ``messages``
    through the chat template with the generation prompt, or ``prompt_token_ids`` as given."""
    if request.prompt_token_ids is not None:
        ids = [int(t) for t in request.prompt_token_ids]
        return (request.prompt if isinstance(request.prompt, str) else tokenizer.decode(ids)), ids
    if request.messages is not None:
        try:
            prompt = tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
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


def prefill_groups(lengths: list[int], max_tokens: int) -> list[slice]:
    """Consecutive groups of prompts whose padded size (rows x longest prompt) stays within ``max_tokens``.

    Prefilling 64 long prompts in one forward padded them all to the longest and built attention inputs of
    rows x length^2: 64 XSum documents ran a 24 GB machine out of memory. A prompt longer than the budget gets a
    forward of its own.
    """
    groups, start, longest = [], 0, 0
    for end, length in enumerate(lengths):
        longest = max(longest, length)
        if end > start and (end - start + 1) * longest > max_tokens:
            groups.append(slice(start, end))
            start, longest = end, length
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
        )
        self.policy = make_policy(
            spec, self.sources, lambda: self._calibrate(target_by_path, draft is None), capacity=self.capacity,
        )
        self.drafter.uses_hidden_states = self.policy.needs_hidden_states
        self.eos_ids = eos_token_ids(self.tokenizer, self.target)
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self.rejected: list[GenerationResult] = []
        self.steps = 0
        self.run_seed = run_seed(config.sampling.seed)

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
        return DraftModelDrafter(draft, self.capacity, self.device, subset, lookup, spec.ngram_candidates)

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
        started = time.perf_counter()
        try:
            params = self._sampling_params(request.sampling)
            prompt, prompt_ids = self._tokenize(request)
        except EngineError as exc:
            prompt = request.prompt if isinstance(request.prompt, str) else ""
            self.rejected.append(self._error_result(request.id, prompt, str(exc), started))
            return
        generator = row_generator(params, self.run_seed, request.seed_key or request.id)
        seq = _Sequence(request.id, prompt, prompt_ids, params, generator, started)
        seq.stop_ids = params.stop_ids(self.eos_ids)
        self.waiting.append(seq)

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
        if sampling.n != 1:
            raise EngineError(
                f"invalid sampling_params: n is {sampling.n}; one request decodes one sequence (the server returns "
                "n choices; a batch job writes one row per input row, so repeat the row for more samples)"
            )
        return sampling

    def _tokenize(self, request: Request) -> tuple[str, list[int]]:
        prompt, ids = encode_request(self.tokenizer, request)
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
        self._admit(emitted)
        finished += self._retire()  # sequences done at prefill (EOS, max_tokens 1) never speculate
        if self.running:
            self._speculate(emitted)
            finished += self._retire()
        return StepOutput(finished, emitted)

    def _admit(self, emitted: dict[str, list[int]]) -> None:
        """Prefill waiting sequences into free rows: shortest first, in ragged forwards of bounded padded size."""
        joining = [self.waiting.popleft() for _ in range(min(self.capacity - len(self.running), len(self.waiting)))]
        joining.sort(key=lambda seq: len(seq.prompt_ids))
        for group in prefill_groups([len(seq.prompt_ids) for seq in joining], self.prefill_tokens):
            self._prefill(joining[group], emitted)

    @torch.no_grad()
    def _prefill(self, joining: list[_Sequence], emitted: dict[str, list[int]]) -> None:
        rows = self.cache.add_rows(len(joining))
        lengths = torch.tensor([len(s.prompt_ids) for s in joining])
        width = int(lengths.max())
        ids = torch.zeros(len(joining), width, dtype=torch.long)
        for i, seq in enumerate(joining):
            ids[i, : len(seq.prompt_ids)] = torch.tensor(seq.prompt_ids)
        valid = torch.arange(width)[None] < lengths[:, None]
        last_positions = sorted(set((lengths - 1).tolist()))
        reads_states = self.drafter.reads_target_states
        logits, states = forward_tree(
            self.target, self.cache, rows, ids.to(self.device), chain_ancestors(width), valid.to(self.device),
            logits_at=torch.tensor(last_positions), want_hidden=reads_states,
            hidden_at=torch.arange(width) if reads_states else None,
        )
        keep = torch.arange(width)[None].expand(len(joining), -1)
        self.cache.commit(rows, keep.to(self.device), lengths.to(self.device))
        logits = logits.float().cpu()
        last = logits[torch.arange(len(joining)), [last_positions.index(n - 1) for n in lengths.tolist()]]
        warp = self._warp(joining, prefill=True)
        scores = warp.penalize(last)
        probs = warp_probs(scores, warp)
        for i, seq in enumerate(joining):
            seq.forwards = 1
            if seq.params.greedy:
                seq.root_scores, token = scores[i], int(scores[i].argmax())
            else:
                seq.root_scores = probs[i]
                token = int(torch.multinomial(probs[i], 1, generator=seq.generator))
            if seq.params.logprobs is not None:
                seq.logprobs += token_logprobs(last[i : i + 1], [token], seq.params.logprobs)
            self._emit(seq, [token], [False], emitted)
        self.running.extend(joining)
        self.drafter.add_rows(rows, [s.prompt_ids for s in joining], states)

    def _reproducible(self, params: SamplingParams) -> bool:
        """A sampled row that must reproduce (a run seed, or its own): the policy's choices for it may then depend
        only on its seed and its past acceptance, never on timings or other rows (SPEC "Decoding semantics")."""
        return not params.greedy and (params.seed is not None or self.config.sampling.seed is not None)

    def _plan(self, seqs: list[_Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(model depths, lookup depths or None) per row, within each row's room."""
        contexts = [len(s.prompt_ids) + len(s.generated) - 1 for s in seqs]  # cached tokens, known on the host
        depths, lookup_depths = self.policy.plan_rows(
            [s.request_id for s in seqs], contexts, [self._reproducible(s.params) for s in seqs]
        )
        room = torch.tensor([
            0 if seq.finish_reason else max(0, min(
                seq.params.max_tokens - len(seq.generated) - 1,  # a step emits accepted + 1 tokens
                self.max_context - 1 - context,
            )) for seq, context in zip(seqs, contexts)
        ], dtype=torch.long)
        return depths.minimum(room), lookup_depths.minimum(room) if lookup_depths is not None else None

    def _roots(self, seqs: list[_Sequence], depths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Root-level tokens: the pending token, plus target-initialized siblings where a row drafts."""
        width = self.topology.root_width
        roots = torch.zeros(len(seqs), width, dtype=torch.long)
        valid = torch.zeros(len(seqs), width, dtype=torch.bool)
        for row, seq in enumerate(seqs):
            roots[row, 0] = seq.generated[-1]
            valid[row, 0] = True
            if width == 1 or depths[row] == 0:
                continue
            pending = seq.generated[-1]
            if seq.params.greedy:
                ranked = [t for t in seq.root_scores.topk(width).indices.tolist() if t != pending]
                siblings = torch.tensor(ranked[: width - 1])
            elif self.config.speculative.replacement:
                siblings = draw(seq.root_scores, width - 1, True, seq.generator)
            else:
                rest = seq.root_scores.clone()
                rest[pending] = 0
                if rest.sum() <= 0:
                    continue
                siblings = draw(rest / rest.sum(), width - 1, False, seq.generator)
            roots[row, 1 : 1 + len(siblings)] = siblings
            valid[row, 1 : 1 + len(siblings)] = True
        return roots, valid

    @torch.no_grad()
    def _speculate(self, emitted: dict[str, list[int]]) -> None:
        seqs = self.running
        rows = slice(0, len(seqs))
        warp = self._warp(seqs)
        depths, lookup_depths = self._plan(seqs)
        roots, root_valid = self._roots(seqs, depths)
        started = time.perf_counter()
        draft = self.drafter.propose(
            DraftInputs(
                contexts=[s.context for s in seqs], roots=roots, root_valid=root_valid, depths=depths,
                topology=self.topology, warp=warp, generators=[s.generator for s in seqs],
                replacement=self.config.speculative.replacement, keep=self.policy.keep, lookup_depths=lookup_depths,
            )
        )
        drafted = time.perf_counter()
        raw, states, slot_of = self._verify_forward(rows, draft)
        raw = raw.float().cpu()
        context = sum(len(s.prompt_ids) + len(s.generated) - 1 for s in seqs) / len(seqs)
        timing = StepTiming(
            (len(seqs), int(draft.valid.any(0).sum()), context), time.perf_counter() - drafted,
            [(len(seqs), tokens, context) for tokens in self.drafter.forward_tokens], drafted - started,
        )
        # Each node with its own history, as the draft did.
        logits = warp.penalize(raw, draft.tokens, self.topology.sliced_ancestors(draft.depth))
        verdicts, target_token_probs = self._verify(seqs, draft, logits, warp)
        paths = [v.path for v in verdicts]
        keep = torch.zeros(len(seqs), max(len(p) for p in paths), dtype=torch.long)
        for row, path in enumerate(paths):
            keep[row, : len(path)] = slot_of[path]
        self.cache.commit(rows, keep.to(self.device), torch.tensor([len(p) for p in paths]).to(self.device))
        self.drafter.observe(paths, draft, states)

        self.steps += 1
        depth_of = self.topology.depths
        drafted_nodes = draft.valid & (depth_of[: draft.tokens.shape[1]] > 0)[None]
        emitted_by_row = []
        for row, (seq, verdict) in enumerate(zip(seqs, verdicts)):
            accepted_nodes = [n for n in verdict.path if depth_of[n] > 0]
            seq.forwards += 1
            # A copy: a view would keep this step's whole [B, N, V] logits alive for as long as the sequence runs.
            law = verdict.next_probs if verdict.next_probs is not None else logits[row, verdict.path[-1]]
            seq.root_scores = law.clone()
            new_tokens = [int(draft.tokens[row, n]) for n in accepted_nodes] + [verdict.next_token]
            emitted_by_row.append(new_tokens)
            if seq.params.logprobs is not None:
                seq.logprobs += token_logprobs(raw[row, verdict.path], new_tokens, seq.params.logprobs)
            kept = self._emit(seq, new_tokens, [True] * len(accepted_nodes) + [False], emitted)
            kept_nodes = set(accepted_nodes[:kept])  # a stop inside the accepted run drops the rest
            seq.per_step_drafted.append(int(drafted_nodes[row].sum()))
            seq.per_step_accepted.append(len(kept_nodes))
            for node in drafted_nodes[row].nonzero().flatten().tolist():
                seq.token_stats.append((
                    self.steps, int(depth_of[node]), int(self.topology.candidate_index[node]),
                    int(draft.tokens[row, node]), float(draft.token_probs[row, node]),
                    float(target_token_probs[row, node]), node in kept_nodes,
                ))
        matched = self._matched_by_source(draft, emitted_by_row)
        self.policy.observe(StepRecord(
            ids=[s.request_id for s in seqs],
            planned_depth=depths.tolist(),
            drafted_depth=(drafted_nodes * depth_of[: draft.tokens.shape[1]]).amax(1).tolist(),
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

    def _verify_forward(self, rows: slice, draft: Draft) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The target forward over the tree's live nodes; (logits [B, N, V], states, cache slot of each node).

        A node no row has (a candidate that stopped, an n-gram sibling without a match) is left out of the forward
        rather than padded: on a CPU each extra token of a small verify costs ~5% of a plain step. A node's
        ancestors are live wherever it is, so the live nodes form a tree of their own.
        """
        size = draft.tokens.shape[1]
        nodes = draft.valid.any(0).nonzero().flatten()
        ancestors = self.topology.sliced_ancestors(draft.depth)[nodes][:, nodes]
        logits, states = forward_tree(
            self.target, self.cache, rows, draft.tokens[:, nodes].to(self.device), ancestors,
            draft.valid[:, nodes].to(self.device), want_hidden=self.drafter.reads_target_states,
        )
        slot_of = torch.zeros(size, dtype=torch.long)
        slot_of[nodes] = torch.arange(len(nodes))
        if len(nodes) < size:  # back to tree positions; dead nodes' rows are never read
            logits = logits[:, slot_of]
            states = states[:, slot_of.to(states.device)] if states is not None else None
        return logits, states, slot_of

    def _warp(self, seqs: list[_Sequence], prefill: bool = False) -> WarpParams:
        """Sampling parameters of ``seqs`` as tensors, with the committed histories their penalties need."""
        params = [s.params for s in seqs]
        if not any(p.penalized for p in params):
            return WarpParams.from_params(params)
        return WarpParams.from_params(
            params, [s.prompt_ids for s in seqs], [[] if prefill else s.generated[:-1] for s in seqs],
            self.eos_ids, self.target.config.vocab_size,
        )

    def _verify(
        self, seqs: list[_Sequence], draft: Draft, logits: torch.Tensor, warp: WarpParams
    ) -> tuple[list[Verdict], torch.Tensor]:
        """Apply the acceptance rule to each row; also the target probability of every node's token."""
        size = draft.tokens.shape[1]
        parents = self.topology.parents[:size]
        parent_index = torch.tensor([max(p, 0) for p in parents])
        greedy = warp.temperature == 0
        sampled_rows = (~greedy).nonzero().flatten()
        target_probs = warp_probs(logits[sampled_rows], warp[sampled_rows]) if len(sampled_rows) else None
        # Target probability of each node's token at its parent (temperature 1 for greedy rows), for statistics;
        # indexed rather than gathered from a copy of the parents' logits, which would cost a pass over [B, N, V].
        rows = torch.arange(len(seqs))[:, None]
        token_logits = logits[rows, parent_index[None], draft.tokens]
        token_probs = (token_logits - logits.logsumexp(-1)[:, parent_index]).exp()
        argmax = logits.argmax(-1).tolist()
        verdicts = []
        for row, seq in enumerate(seqs):
            tokens, valid = draft.tokens[row].tolist(), draft.valid[row].tolist()
            if greedy[row]:
                verdicts.append(verify_greedy(tokens, parents, valid, argmax[row], tokens[0]))
                continue
            probs = target_probs[(sampled_rows == row).nonzero().item()]
            token_probs[row] = probs[parent_index].gather(-1, draft.tokens[row][:, None]).squeeze(-1)
            verdicts.append(verify_sampled(
                tokens, parents, valid, probs, seq.root_scores,
                draft.draft_probs[row] if draft.draft_probs is not None else None,
                self.config.speculative.replacement, seq.generator,
                draft.point_mass[row].tolist() if draft.point_mass is not None else None,
            ))
        return verdicts, token_probs

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
        decode = self.tokenizer.decode
        if not any(stop in decode(seq.generated, skip_special_tokens=True) for stop in seq.params.stop):
            return
        for end in range(before + 1, len(seq.generated) + 1):
            text = decode(seq.generated[:end], skip_special_tokens=True)
            hits = [text.find(stop) for stop in seq.params.stop if stop in text]
            if hits:
                del seq.generated[end:], seq.accepted[end:]
                seq.stop_text = text[: min(hits)]
                seq.finish_reason = "stop"
                return

    def _retire(self) -> list[GenerationResult]:
        results = []
        for row in sorted((r for r, s in enumerate(self.running) if s.finish_reason), reverse=True):
            results.append(self._result(self.running[row]))
            self._remove_row(row)
        return results[::-1]

    def _remove_row(self, row: int) -> None:
        """Swap-remove: the last running sequence takes this row in the caches and the drafter too."""
        self.policy.forget(self.running[row].request_id)
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
