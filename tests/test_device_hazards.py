"""GPU hazards a CPU can catch: in a decode step and a speculative step of every drafter, policy and width, no
operation on a tensor computed from the model (its weights, its cache, a drafter's tables) has a data-dependent
shape or reads the device from the host, outside the step's one counted read point (``HostReads``). On a GPU each
such operation waits for the device, and none can be captured in a CUDA graph."""

from __future__ import annotations

import itertools
import os
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_cases import PROMPTS, make_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from decoding import Engine, Request
from decoding.drafting.recycle import RecycleDrafter
from decoding.model import execution

aten = torch.ops.aten
# Host reads (the value crosses to Python) and results whose size depends on the data.
READS_OR_DATA_SHAPED = {aten._local_scalar_dense.default, aten.item.default, aten.nonzero.default,
                        aten.masked_select.default, aten.unique_consecutive.default, aten._unique2.default}
BOOLEAN_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _engine_frame() -> str:
    """The innermost line of the product's code on the stack: where a hazard is written."""
    for frame in reversed(traceback.extract_stack()):
        if f"{os.sep}decoding{os.sep}" in frame.filename:
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.line}"
    return "?"


class DeviceHazards(TorchDispatchMode):
    """Records hazardous aten ops on *device-derived* tensors: the model's parameters and buffers, and whatever is
    computed from them (tracked through every op, in-place writes included). Tensors a step builds from host data
    are not device-derived; what ``HostReads`` returns is a host copy."""

    def __init__(self, *modules: torch.nn.Module) -> None:
        super().__init__()
        self._derived: dict[int, weakref.ref[torch.Tensor]] = {}
        self.found: list[str] = []
        self.reading = False
        for module in modules:
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                self._mark(tensor)

    def _mark(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        self._derived[key] = weakref.ref(tensor, lambda _, key=key: self._derived.pop(key, None))

    def derived(self, tensor: Any) -> bool:
        ref = self._derived.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        return ref is not None and ref() is tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs, _ = tree_flatten((args, kwargs))
        hot = not self.reading and any(self.derived(t) for t in inputs)
        if hot and (func in READS_OR_DATA_SHAPED or func in BOOLEAN_INDEXED and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_flatten(args[1])[0])):
            shapes = [tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor)]
            self.found.append(f"{func} on {shapes} at {_engine_frame()}")
        out = func(*args, **kwargs)
        if hot:
            outputs, _ = tree_flatten(out)
            mutated = [args[i] for i, arg in enumerate(func._schema.arguments[:len(args)]) if arg.is_write]
            for tensor in [*outputs, *mutated]:
                if isinstance(tensor, torch.Tensor):
                    self._mark(tensor)
        return out

    @contextmanager
    def counted_read(self) -> Iterator[None]:
        self.reading = True
        try:
            yield
        finally:
            self.reading = False


def watched_generation(engine: Engine, modules: list[torch.nn.Module], requests: list[Request]
                       ) -> tuple[list[str], int, int]:
    """Runs ``requests`` to the end under ``DeviceHazards``: (hazards found, steps, tokens drafted)."""
    hazards = DeviceHazards(*modules)
    to_host = engine.stepper.to_host

    def counted(tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        with hazards.counted_read():
            return to_host(tensor, **kwargs).clone()  # on a CPU the "copy" is the tensor itself

    engine.stepper.to_host = counted
    steps = drafted = 0
    with hazards:
        for request in requests:
            engine.add_request(request)
        while engine.has_unfinished():
            output = engine.step()
            steps += 1
            drafted += sum(sum(result.per_step_drafted) for result in output.finished)
    return hazards.found, steps, drafted


DRAFTERS = {
    "plain": {"method": "none"},
    "lookup": {"method": "ngram"},
    "recycle": {"method": "recycle", "ngram_candidates": 1},
    "draft-model": {"method": "draft_model"},
    "self-draft-int4-lookup": {"method": "draft_model", "model": "target", "quantization": "int4",
                               "ngram_candidates": 1},
    "layer-skip": {"method": "draft_model", "model": "target", "layer_skip": [1]},
    "feature-draft": {"method": "draft_model", "model": "feature"},
}
POLICIES = ["static", "heuristic", "online", "threshold", "decision"]
TRAINED_POLICIES = {"threshold", "decision"}  # a draft model's signal head: only where a model drafts
GRID = [("plain", "static", 1)] + [
    (drafter, policy, width) for drafter in list(DRAFTERS)[1:] for policy in POLICIES for width in (1, 3)
    if policy not in TRAINED_POLICIES or DRAFTERS[drafter]["method"] == "draft_model"
]


@pytest.mark.parametrize(("drafter", "policy", "width"), GRID)
def test_a_step_has_no_device_sync_or_data_dependent_shape(drafter, policy, width, tokenizer, target, draft,
                                                           feature_draft, heads, monkeypatch) -> None:
    monkeypatch.setattr(execution, "CPU_READS_FREE", False)  # the accelerator's paths, on this CPU
    speculative = dict(DRAFTERS[drafter])
    models = [target]
    own_draft = None
    if speculative.get("model") == "feature":
        own_draft = feature_draft
        speculative["model"] = "in-memory"
    elif speculative["method"] == "draft_model" and "model" not in speculative:
        own_draft = draft
    if own_draft is not None:
        models.append(own_draft)
    extra = {key: heads[key] for key in heads if policy in ("threshold", "decision")}
    config = make_config(**speculative, num_candidates=width, length_policy=policy, num_speculative_tokens=4,
                         batch_size=4, sampling={"max_tokens": 8}, **extra)
    engine = Engine(config, target=target, tokenizer=tokenizer, draft=own_draft)
    # Greedy and sampled rows side by side: both acceptance paths run in the same steps.
    requests = [Request(id=str(i), prompt=prompt, sampling={"temperature": 1.0 if i % 2 else 0.0, "seed": i})
                for i, prompt in enumerate(PROMPTS[:4])]
    found, steps, drafted = watched_generation(engine, models, requests)
    assert not found, sorted(set(found))
    assert steps
    if drafter != "plain" and policy == "static":
        assert drafted, "no step drafted"


def test_the_hazard_check_catches_a_boolean_mask_write(tokenizer, target, monkeypatch) -> None:
    """The recycling table written through a boolean mask (a device sync each step on a GPU) is caught."""
    monkeypatch.setattr(execution, "CPU_READS_FREE", False)

    def masked_observe(self, rows, paths, path_tokens, draft, topology, target_states=None, target_topk=None) -> None:
        if target_topk is not None:
            valid = draft.valid.to(self.table.device)
            self.table[draft.tokens.to(self.table.device)[valid]] = target_topk[valid]

    monkeypatch.setattr(RecycleDrafter, "observe", masked_observe)
    config = make_config(method="recycle", num_candidates=2, length_policy="static", num_speculative_tokens=4,
                         batch_size=4, sampling={"max_tokens": 12})
    engine = Engine(config, target=target, tokenizer=tokenizer)
    found, _, drafted = watched_generation(engine, [target], [Request(id=str(i), prompt=p)
                                                              for i, p in enumerate(PROMPTS[:4])])
    assert drafted
    assert any("index" in hazard for hazard in found), found
