"""The scheduler: waiting sequences and their admission while rows and KV blocks are free.

Admission is fair between requests: each free row goes to the waiting sequence of the group (a request, or the n
choices of one HTTP request) with the fewest sequences running, the earliest group on a tie, each group's
sequences in order. So a 4-token request waits for one free row, not for the 128 sequences of an n=128 request
that came before it. A sequence joins when the KV pool can promise
it the positions its prompt, its ``max_tokens`` and one draft tree need, less the cached blocks of its prompt's
prefix it takes (``PagedKVCache.claim``, in the target's pool and in a draft's own); otherwise it waits for a
finishing row to return its blocks. Joining sequences are prefilled shortest first, in groups whose padded size
stays within the per-forward token budget (``decoding.model.padding.prefill_groups``). A sequence with a LoRA adapter
also needs a device slot holding it (``decoding.model.lora.Adapters``): while every slot serves running rows of
other adapters it waits, and an adapter that cannot be loaded fails that sequence alone.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator

from decoding.engine.batch import Batch
from decoding.engine.sequence import GenerationResult, Sequence
from decoding.model.kv_cache import Claim, PagedKVCache
from decoding.model.lora import AdapterError, Adapters


def group_of(seq: Sequence) -> str:
    """A sequence's admission group: its request's group, else its own id (a sequence built outside ``prepare``)."""
    return seq.group or seq.request_id


class FairQueue:
    """Waiting sequences by admission group (``group_of``), groups in order of arrival."""

    def __init__(self) -> None:
        self._groups: OrderedDict[str, deque[Sequence]] = OrderedDict()
        self._size = 0

    def append(self, seq: Sequence) -> None:
        self._groups.setdefault(group_of(seq), deque()).append(seq)
        self._size += 1

    def extend(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self.append(seq)

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Sequence]:
        return (seq for group in self._groups.values() for seq in group)

    def next_for(self, active: Counter[str]) -> Sequence:
        """The head of the group with the fewest ``active`` (running) sequences, the earliest on a tie.

        The scan stops at the first group with none running: only groups with running sequences (at most one per
        row) come before it, so admitting from a queue of thousands of requests stays linear, not quadratic (3,000
        waiting requests: 4.5 million comparisons)."""
        for name in self._groups:
            if not active[name]:
                return self._groups[name][0]
        group = min(self._groups, key=lambda name: active[name])  # every group has some running; min keeps the first
        return self._groups[group][0]

    def pop(self, seq: Sequence) -> None:
        """Remove ``seq``, the head of its group (``next_for``'s answer)."""
        group = group_of(seq)
        self._groups[group].popleft()
        if not self._groups[group]:
            del self._groups[group]
        self._size -= 1

    def remove_request(self, request_id: str) -> bool:
        for name, group in self._groups.items():
            for seq in group:
                if seq.request_id == request_id:
                    group.remove(seq)
                    if not group:
                        del self._groups[name]
                    self._size -= 1
                    return True
        return False


class Scheduler:
    def __init__(self, batch: Batch, positions: Callable[[Sequence], int],
                 pools: list[PagedKVCache] | None = None, adapters: Adapters | None = None,
                 failed: Callable[[Sequence, str], GenerationResult] | None = None) -> None:
        """``positions``: the KV positions a sequence may reach (prompt, generation, one draft tree); ``pools``:
        the KV pools a joining row takes blocks in (default: the batch's); ``adapters``: the LoRA adapters' slots;
        ``failed``: the error result of a sequence whose adapter cannot be loaded."""
        self.batch = batch
        self.adapters, self.failed = adapters, failed
        self.cache = batch.cache
        self.pools = pools or [batch.cache]
        self.positions = positions
        self.waiting = FairQueue()
        self.rejected: list[GenerationResult] = []  # error results to hand out at the next step

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.batch.seqs or self.rejected)

    def take_rejected(self) -> list[GenerationResult]:
        rejected, self.rejected = self.rejected, []
        return rejected

    def admit(self) -> list[Sequence]:
        """The waiting sequences that join now, in fair order (see the module's doc), each with its claims."""
        joining: list[Sequence] = []
        active = Counter(group_of(seq) for seq in self.batch.seqs)
        while self.waiting and len(self.batch) + len(joining) < self.batch.capacity:
            seq = self.waiting.next_for(active)
            if seq.lora_key is not None:  # set only where the engine has adapters (``Engine.prepare``)
                try:
                    slot = self.adapters.acquire(seq.lora_key)
                except AdapterError as exc:  # read at prepare, but dropped from the host cache and gone since
                    self.waiting.pop(seq)
                    self.rejected.append(self.failed(seq, str(exc)))
                    continue
                if slot is None:  # every slot serves running rows of other adapters
                    break
                seq.lora_slot = slot
            claims = self._claims(seq)
            if claims is None:
                if seq.lora_key is not None:
                    self.adapters.release(seq.lora_key)
                break
            seq.claims = claims
            self.waiting.pop(seq)
            active[group_of(seq)] += 1
            joining.append(seq)
        return joining

    def _claims(self, seq: Sequence) -> list[Claim] | None:
        """A claim in every pool, or None (and nothing held) if one cannot promise the sequence its blocks."""
        claims: list[Claim] = []
        for pool in self.pools:
            # A row asking for prompt logprobs needs the logits at every prompt position: none from the cache.
            claim = pool.claim(seq.prompt_ids, self.positions(seq), read_cache=seq.params.prompt_logprobs is None,
                               salt=seq.cache_salt)
            if claim is None:
                for held in claims:
                    held.pool.release_claim(held)
                return None
            claims.append(claim)
        return claims

    def drop_waiting(self, request_id: str) -> bool:
        return self.waiting.remove_request(request_id)
