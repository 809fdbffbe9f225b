"""The running batch: the one owner of what a row is.

Row r is the r-th running sequence, row r of the KV cache, of the drafter's state and of the row tensors below. Rows
join here (``admit``, then ``joined`` once the prefill has computed what a drafter reads) and leave here (``remove``:
swap-remove, the last row takes the leaving one's place), and the batch tells every part that keeps per-row state
(the KV cache, the drafter, the length policy: ``RowState``); no other code adds or removes a row.

Per step, ``metadata()`` derives what every phase reads about the rows (greedy, seeded, penalized, constrained, the
room each has left), once (vLLM's ``SamplingMetadata``). The row tensors keep the sampling parameters twice: on the
device (the draft and the verification warp there) and on the host (which rows draw random numbers; what warping
branches on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from decoding.config import SamplingParams
from decoding.engine.sequence import Sequence
from decoding.model.kv_cache import PagedKVCache, joining_entries
from decoding.model.rows import move_last_row
from decoding.verification.sampling import WarpParams

# The per-row tensors of WarpParams kept as batch state; penalties are built per step, from each row's history.
ROW_FIELDS = ("temperature", "top_k", "top_p", "min_p")


@dataclass(frozen=True)
class JoinedRows:
    """Sequences that joined at ``rows`` after their prefill."""

    rows: slice
    seqs: list[Sequence]
    positions: list[int] | None  # the cache positions each may reach; None: as each one's claims say
    target_states: torch.Tensor | None  # [B, T, H] the target's last hidden states at the prompts, where read


class RowState(Protocol):
    """A part of the engine that keeps state per row; the batch tells it when rows join and leave."""

    def rows_joined(self, joined: JoinedRows) -> None: ...

    def row_removed(self, row: int, last: int, seq: Sequence) -> None:
        """``seq`` left ``row``; row ``last`` takes its place (swap-remove)."""


@dataclass(frozen=True)
class BatchMetadata:
    """What the phases of one step read about its rows, derived once per step (host facts and device tensors)."""

    rows: slice
    greedy: torch.Tensor  # [B] bool, host
    sampled: list[int]  # rows that draw random numbers (not greedy)
    reproducible: list[bool]  # sampled rows that must reproduce (their own seed, or the run's)
    penalized: bool  # some row has a penalty, a logit bias or a token ban
    constrained: bool  # some row has a grammar
    room: torch.Tensor  # [B] long, host: tokens a row may still draft this step (max_tokens, the context)
    row_warp: WarpParams  # on the device: temperature, top-k, top-p, min-p

    @property
    def all_greedy(self) -> bool:
        return not self.sampled


class Batch:
    def __init__(self, capacity: int, sampling: SamplingParams, cache: PagedKVCache, run_seeded: bool,
                 max_context: int) -> None:
        self.capacity = capacity
        self.cache = cache
        self.device = cache.device
        self.run_seeded = run_seeded
        self.max_context = max_context
        self.seqs: list[Sequence] = []
        self.listeners: list[RowState] = []
        self.warp_host = WarpParams.from_params([sampling] * capacity)
        self.warp_device = self.warp_host.to(self.device)
        self.max_tokens = torch.zeros(capacity, dtype=torch.long)
        # [capacity, V] on the device: the law each row's pending token was drawn from (greedy rows: the logits);
        # allocated at the first prefill, when the logits' width is known.
        self.root_scores: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    def listen(self, part: RowState) -> None:
        self.listeners.append(part)

    # ---------------------------------------------------------------------------------------- joining
    def admit(self, seqs: list[Sequence], positions: list[int] | None = None) -> slice:
        """Rows for ``seqs`` after the running ones: cache rows with what admission claimed for them (or promised
        ``positions``), their row tensors."""
        rows = self.cache.add_rows(joining_entries(self.cache, [seq.claims for seq in seqs], positions))
        self.cache.row_adapters[rows] = torch.tensor([seq.lora_slot for seq in seqs], dtype=torch.long)
        params = [seq.params for seq in seqs]
        new = WarpParams.from_params(params)
        for name in ROW_FIELDS:
            getattr(self.warp_host, name)[rows] = getattr(new, name)
            getattr(self.warp_device, name)[rows] = getattr(new, name).to(self.device, non_blocking=True)
        self.max_tokens[rows] = torch.tensor([p.max_tokens for p in params])
        self.seqs.extend(seqs)
        return rows

    def joined(self, joined: JoinedRows) -> None:
        """The prefill of ``joined`` ran: the parts that keep per-row state take the new rows."""
        for part in self.listeners:
            part.rows_joined(joined)

    def set_root_scores(self, rows: slice, scores: torch.Tensor) -> None:
        if self.root_scores is None:
            self.root_scores = scores.new_zeros(self.capacity, scores.shape[-1])
        self.root_scores[rows] = scores

    # ---------------------------------------------------------------------------------------- leaving
    def remove(self, row: int) -> Sequence:
        """Swap-remove ``row``: the last running sequence takes its place everywhere."""
        seq, last = self.seqs[row], len(self.seqs) - 1
        move_last_row(row, last, *(getattr(w, name) for w in (self.warp_host, self.warp_device) for name in ROW_FIELDS),
                      self.max_tokens, self.root_scores)
        self.cache.remove_row(row)
        for part in self.listeners:
            part.row_removed(row, last, seq)
        move_last_row(row, last, self.seqs)
        self.seqs.pop()
        return seq

    def finished_rows(self) -> list[int]:
        """Rows whose sequence has finished, last first (so swap-removing them in turn keeps the others' rows)."""
        return sorted((row for row, seq in enumerate(self.seqs) if seq.finish_reason), reverse=True)

    def row_of(self, request_id: str) -> int | None:
        return next((row for row, seq in enumerate(self.seqs) if seq.request_id == request_id), None)

    # --------------------------------------------------------------------------------------- per step
    def row_warp(self, rows: slice) -> WarpParams:
        """The device's sampling parameters of ``rows``, with what warping branches on read from their host copy."""
        host = WarpParams(**{name: getattr(self.warp_host, name)[rows] for name in ROW_FIELDS})  # its facts computed
        return WarpParams(**{name: getattr(self.warp_device, name)[rows] for name in ROW_FIELDS},
                          max_top_k=host.max_top_k, nucleus_rows=host.nucleus_rows, min_p_rows=host.min_p_rows)

    def metadata(self, seqs: list[Sequence] | None = None) -> BatchMetadata:
        """The step's facts about ``seqs`` (default: every running row; a prefill passes its joining rows, which
        sit at the end of the batch)."""
        seqs = self.seqs if seqs is None else seqs
        end = len(self.seqs)
        rows = slice(end - len(seqs), end) if seqs is not self.seqs else slice(0, end)
        greedy = [seq.params.greedy for seq in seqs]
        contexts = self.cache.host_lengths[rows]
        generated = torch.tensor([len(seq.generated) for seq in seqs], dtype=torch.long)
        room = torch.minimum(
            self.max_tokens[rows] - generated - 1,  # a step emits accepted + 1 tokens
            self.max_context - 1 - torch.tensor(contexts, dtype=torch.long),
        )
        finished = torch.tensor([seq.finish_reason is not None for seq in seqs])
        return BatchMetadata(
            rows=rows,
            greedy=torch.tensor(greedy, dtype=torch.bool),
            sampled=[row for row, is_greedy in enumerate(greedy) if not is_greedy],
            reproducible=[not is_greedy and (seq.params.seed is not None or self.run_seeded)
                          for seq, is_greedy in zip(seqs, greedy)],
            penalized=any(seq.params.penalized for seq in seqs),
            constrained=any(seq.grammar is not None for seq in seqs),
            room=torch.where(finished, 0, room.clamp(min=0)),
            row_warp=self.row_warp(rows),
        )
