"""LoRA adapters in PEFT's format: read with ``safetensors``, checked against the base model, held on the device
in stacked per-slot tensors, and applied to every token of a forward, whatever its adapter, by one batched matmul
pair per projection.

Slot 0 is the base (all zeros); slots 1..max_loras hold resident adapters, R = max_lora_rank rows each (an adapter
of lower rank is zero-padded), the scaling folded into B. A forward gathers the rows of the U adapters its tokens
use, once for every layer, and gives each token a one-hot mask over those U*R rows (all zero for a base token), so
each projection's delta is

    delta = ((x @ A.T) * mask) @ B

two dense matmuls with no loop over adapters (punica's shrink and expand, the selection done by the mask). Its cost
grows with the adapters present, not the slots: on SmolLM2-135M one rank-16 adapter on every projection adds ~5% of
a base token's multiply-adds. The projections the lean forward fuses (q|k|v, gate|up) share one shrink. Where the
CPU kernels run, the C++ ``lora_delta`` computes the same per token instead, each token against its own adapter's
rows only, base tokens not at all (``LoraBatch.delta``).
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION + MLP

# PEFT's key of a LoRA matrix in a Llama-style model: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")

# adapter_config.json fields that change what the adapter computes and that this module does not apply: refused
# when set (to anything but these inert values), naming the field.
_UNSUPPORTED = {
    "modules_to_save": (None, []),
    "use_dora": (False, None),
    "bias": ("none", None),
    "fan_in_fan_out": (False, None),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "target_parameters": (None, []),
    "trainable_token_indices": (None, {}),
    "layer_replication": (None, []),
    "use_qalora": (False, None),
}


class AdapterError(ValueError):
    """An adapter that cannot be applied; the message names the adapter and the field, file or tensor."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter read from its folder: per (layer, projection), A ``[r, in]`` and B ``[out, r]`` with the scaling
    (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``) folded into B."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of a Llama-style model config."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    intermediate = config.intermediate_size
    return {
        "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


def _targets(name: str, value) -> set[str]:
    if value == "all-linear":
        return set(PROJECTIONS)
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise AdapterError(f"adapter {name!r}: target_modules must be a list of projection names or 'all-linear', "
                           f"got {value!r}")
    # PEFT matches a name as a suffix of a module's path and saves "all-linear" as the full paths it matched.
    projections = {n: n.rsplit(".", 1)[-1] for n in names}
    unknown = sorted(n for n, projection in projections.items() if projection not in PROJECTIONS)
    if unknown:
        raise AdapterError(f"adapter {name!r}: target_modules {unknown} are not among the projections an adapter may "
                           f"target ({', '.join(PROJECTIONS)}); embedding and LM-head adapters are not supported")
    return set(projections.values())


def read_adapter(name: str, path: str | Path, model_config, max_rank: int) -> LoraAdapter:
    """Read and check the PEFT adapter folder ``path`` against the base model's config; raises ``AdapterError``
    naming what cannot be applied."""
    folder = Path(path)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"adapter {name!r}: {config_path} not found (a PEFT adapter folder holds {CONFIG_FILE} "
                           f"and {WEIGHTS_FILE})")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"adapter {name!r}: {config_path} is not readable JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {config_path} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {config['peft_type']!r} is not supported (only LORA)")
    for field, inert in _UNSUPPORTED.items():
        if field in config and config[field] not in inert:
            raise AdapterError(f"adapter {name!r}: {field} = {config[field]!r} is not supported")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r}: r = {rank} is above max_lora_rank = {max_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank
    targets = _targets(name, config.get("target_modules"))

    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        if (folder / PICKLED_WEIGHTS_FILE).is_file():
            raise AdapterError(f"adapter {name!r}: {PICKLED_WEIGHTS_FILE} (pickle) is not read; save the adapter "
                               f"with safetensors ({WEIGHTS_FILE})")
        raise AdapterError(f"adapter {name!r}: {weights_path} not found")
    shapes = projection_shapes(model_config)
    layers = model_config.num_hidden_layers
    matrices: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as tensors:
            for key in tensors.keys():  # noqa: SIM118 (safe_open has no __iter__)
                match = _KEY.match(key)
                if match is None:
                    raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA matrix of a supported "
                                       f"projection ({', '.join(PROJECTIONS)})")
                layer, projection, which = int(match[1]), match[2], match[3]
                if projection not in targets:
                    raise AdapterError(f"adapter {name!r}: tensor {key!r} targets {projection}, which target_modules "
                                       f"does not name")
                if layer >= layers:
                    raise AdapterError(f"adapter {name!r}: tensor {key!r} is for layer {layer}; the base model has "
                                       f"{layers} (base_model_name_or_path: {config.get('base_model_name_or_path')})")
                matrices.setdefault((layer, projection), {})[which] = tensors.get_tensor(key)
    except AdapterError:
        raise
    except Exception as exc:  # safetensors raises its own errors for a truncated or corrupt file
        raise AdapterError(f"adapter {name!r}: {weights_path} could not be read ({type(exc).__name__}: {exc})") from exc
    if not matrices:
        raise AdapterError(f"adapter {name!r}: {weights_path} holds no LoRA matrices")

    weights = {}
    for (layer, projection), pair in sorted(matrices.items()):
        if set(pair) != {"A", "B"}:
            missing = ({"A", "B"} - set(pair)).pop()
            raise AdapterError(f"adapter {name!r}: layer {layer} {projection} has no lora_{missing} matrix")
        a, b = pair["A"], pair["B"]
        features_in, features_out = shapes[projection]
        if tuple(a.shape) != (rank, features_in) or tuple(b.shape) != (features_out, rank):
            raise AdapterError(
                f"adapter {name!r}: layer {layer} {projection} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, the base model needs ({rank}, {features_in}) and ({features_out}, {rank}) "
                f"(base_model_name_or_path: {config.get('base_model_name_or_path')!r} has other shapes)")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterError(f"adapter {name!r}: layer {layer} {projection} matrices must be floating point")
        weights[layer, projection] = (a.float(), b.float() * scaling)
    return LoraAdapter(name=name, rank=rank, weights=weights)


# The lean forward's projections, each one GEMM: q|k|v and gate|up run fused (``lean_forward.Projection``), and so
# do their adapters' shrinks.
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}
GROUP_OF = {projection: group for group, parts in GROUPS.items() for projection in parts}
GATHERED_SETS = 4  # sets of present adapters whose gathered rows are kept (LoraSlots.batch)


class LoraSlots:
    """The resident adapters of one model on its device. Per projection group of the lean forward (q|k|v, o,
    gate|up, down), ``a[group] [layers, P*W, in]`` holds its P parts' A matrices side by side (W = S*R rows a part:
    S = max_loras + 1 slots of R = max_rank rows; slot 0, the base, stays zero), and per projection
    ``b[projection] [layers, W, out]`` its B matrices (transposed, the scaling folded in)."""

    def __init__(self, model_config, max_loras: int, max_rank: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.slots, self.rank = max_loras + 1, max_rank
        self.width = self.slots * max_rank
        layers = model_config.num_hidden_layers
        shapes = projection_shapes(model_config)
        self.a = {group: torch.zeros(layers, len(parts) * self.width, shapes[parts[0]][0], device=device, dtype=dtype)
                  for group, parts in GROUPS.items()}
        self.b = {projection: torch.zeros(layers, self.width, out, device=device, dtype=dtype)
                  for projection, (_, out) in shapes.items()}
        self.groups: list[set[str]] = [set() for _ in range(self.slots)]  # the groups each slot's adapter targets
        # The gathered rows of the last sets of adapters present (a step's draft and verification forwards, and
        # the steps until a row of another adapter joins, reuse them): a set of 16 rank-16 q/k/v/o adapters of
        # SmolLM2-135M is 118 MB to copy.
        self._gathered: OrderedDict[tuple[int, ...], tuple[dict, dict]] = OrderedDict()

    @property
    def dtype(self) -> torch.dtype:
        return self.a["o"].dtype

    @property
    def device(self) -> torch.device:
        return self.a["o"].device

    def _a_rows(self, projection: str, slot: int, rank: int) -> slice:
        first = GROUPS[GROUP_OF[projection]].index(projection) * self.width + slot * self.rank
        return slice(first, first + rank)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write ``adapter`` into ``slot`` (1..max_loras); its rank is at most max_rank (checked at read)."""
        if not 1 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not one of 1..{self.slots - 1}")
        self.clear(slot)
        self._gathered.clear()
        rows = slice(slot * self.rank, slot * self.rank + adapter.rank)
        for (layer, projection), (a, b) in adapter.weights.items():
            group = GROUP_OF[projection]
            self.a[group][layer, self._a_rows(projection, slot, adapter.rank)] = a.to(self.a[group])
            self.b[projection][layer, rows] = b.T.to(self.b[projection])
            self.groups[slot].add(group)

    def clear(self, slot: int) -> None:
        for projection in PROJECTIONS:
            self.a[GROUP_OF[projection]][:, self._a_rows(projection, slot, self.rank)] = 0
            self.b[projection][:, slot * self.rank : (slot + 1) * self.rank] = 0
        self.groups[slot] = set()
        self._gathered.clear()

    def batch(self, token_slots: torch.Tensor) -> LoraBatch | None:
        """One forward's adapters for tokens on ``token_slots`` ([N], on the host): the rows of the adapters
        present, gathered once for every layer (U adapters: U*R rows a part), and each token's one-hot mask over
        them (zero for base tokens). Groups no present adapter targets are left out. None: no token has one."""
        present = sorted(set(token_slots.unique().tolist()) - {0})
        if not present:
            return None
        rank, device = self.rank, self.device
        part_rows = torch.tensor([slot * rank + r for slot in present for r in range(rank)], device=device)
        position = torch.zeros(self.slots, dtype=torch.long)  # slot -> 1 + its index among the present
        position[present] = torch.arange(1, len(present) + 1)
        token_position = position[token_slots].to(device, non_blocking=True)
        columns = torch.arange(len(present) * rank, device=device) // rank + 1
        mask = (columns == token_position[:, None]).to(self.dtype)
        key = tuple(present)
        if key not in self._gathered:
            a, b = {}, {}
            for group in (group for group in GROUPS if any(group in self.groups[slot] for slot in present)):
                parts = GROUPS[group]
                rows = torch.cat([part_rows + index * self.width for index in range(len(parts))])
                a[group] = self.a[group].index_select(1, rows)
                b[group] = [self.b[projection].index_select(1, part_rows) for projection in parts]
            self._gathered[key] = (a, b)
            if len(self._gathered) > GATHERED_SETS:
                self._gathered.popitem(last=False)
        self._gathered.move_to_end(key)
        a, b = self._gathered[key]
        return LoraBatch(a, b, mask, token_position - 1, rank)

    def resident(self, token_slots: torch.Tensor) -> LoraBatch:
        """The adapters of tokens on ``token_slots`` ([N] on the device, padding and base tokens 0) over every slot
        as it lies, for a captured graph: shapes and addresses do not depend on which adapters are present (a slot
        loaded later is written in place), and nothing is read on the host. Every group runs; slot 0's rows are
        zeros, so base tokens get a zero delta."""
        columns = torch.arange(self.width, device=token_slots.device) // self.rank
        mask = (columns == token_slots[:, None]).to(self.dtype)
        b = {group: [self.b[projection] for projection in parts] for group, parts in GROUPS.items()}
        return LoraBatch(dict(self.a), b, mask, token_slots.masked_fill(token_slots == 0, -1), self.rank)


@dataclass(frozen=True)
class LoraBatch:
    """One forward's adapters (``LoraSlots.batch``): per targeted group, the present adapters' A rows
    ``[layers, P*U*R, in]`` and each part's B ``[layers, U*R, out]``; ``mask [N, U*R]`` (None where only the
    per-token kernel runs: a compiled stack's) and ``index [N]``, each token's adapter among the U present (-1: the
    base), of rank ``rank`` (R)."""

    a: dict[str, torch.Tensor]
    b: dict[str, list[torch.Tensor]]
    mask: torch.Tensor | None
    index: torch.Tensor
    rank: int

    def delta(self, group: str, layer: int, x: torch.Tensor, per_token: bool = False) -> torch.Tensor | None:
        """What each token's adapter adds to ``group``'s fused output at ``layer`` (``x [N, in]`` in any dtype; the
        delta in the adapters' dtype), or None where no present adapter targets the group. ``per_token``: by the
        C++ kernel, each token against its own adapter (x on the CPU, the kernel loaded); else one shrink for every
        part, the mask, one expand per part."""
        if group not in self.a:
            return None
        a = self.a[group][layer]
        parts = self.b[group]
        if per_token or self.mask is None:
            return torch.ops.specbatch.lora_delta(x.to(a.dtype), a, [part[layer] for part in parts], self.index,
                                                  self.rank)
        shrunk = x.to(a.dtype) @ a.T
        if len(parts) == 1:
            return (shrunk * self.mask) @ parts[0][layer]
        shrunk = shrunk.view(x.shape[0], len(parts), -1) * self.mask[:, None]
        return torch.cat([shrunk[:, index] @ part[layer] for index, part in enumerate(parts)], -1)

    def projection_delta(self, projection: str, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """The same for one projection of a group (transformers' forward runs them apart)."""
        group = GROUP_OF[projection]
        if group not in self.a:
            return None
        parts = GROUPS[group]
        index, rows = parts.index(projection), self.mask.shape[1]
        a = self.a[group][layer, index * rows : (index + 1) * rows]
        return ((x.to(a.dtype) @ a.T) * self.mask) @ self.b[group][index][layer]


@contextmanager
def adapted(model: torch.nn.Module, lora: LoraBatch | None) -> Iterator[None]:
    """Within it, transformers' forward of the Llama-style ``model`` adds each token's adapter delta to every
    projection's output (forward hooks; tokens in the forward's [B, T] order, as ``lora``'s masks; None: none)."""
    handles = []
    for layer, block in enumerate(model.model.layers if lora is not None else []):
        for projection in PROJECTIONS:
            module = getattr(block.self_attn if projection in ATTENTION else block.mlp, projection)

            def hook(_, inputs, output, layer=layer, projection=projection):
                delta = lora.projection_delta(projection, layer, inputs[0].reshape(-1, inputs[0].shape[-1]))
                return output if delta is None else output + delta.reshape(output.shape).to(output.dtype)

            handles.append(module.register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class SlotTable:
    """Which adapter holds which device slot. A slot in use by running rows is never taken; a free slot goes to
    the adapter asked for, else the least recently used unreferenced one is replaced; ``acquire`` returns None when
    every slot is in use (the row waits, never fails)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slots: OrderedDict[str, int] = OrderedDict()  # resident adapter -> slot, least recently used first
        self._users: dict[str, int] = {}

    def slot_of(self, name: str) -> int | None:
        return self._slots.get(name)

    def acquire(self, name: str) -> tuple[int, bool] | None:
        """(slot, whether the adapter must be written into it), or None when no slot can be had now."""
        if name in self._slots:
            self._slots.move_to_end(name)
            self._users[name] = self._users.get(name, 0) + 1
            return self._slots[name], False
        taken = set(self._slots.values())
        free = next((slot for slot in range(1, self.max_loras + 1) if slot not in taken), None)
        if free is None:
            idle = next((held for held in self._slots if not self._users.get(held)), None)
            if idle is None:
                return None
            free = self._slots.pop(idle)
            self._users.pop(idle, None)
        self._slots[name] = free
        self._users[name] = 1
        return free, True

    def release(self, name: str) -> None:
        self._users[name] -= 1

    def evict(self, name: str) -> None:
        """Forget ``name`` (unloaded), freeing its slot; refused while running rows use it."""
        if self._users.get(name):
            raise ValueError(f"adapter {name!r} is in use by {self._users[name]} running rows")
        self._slots.pop(name, None)
        self._users.pop(name, None)


class Adapters:
    """An engine's adapters: names resolved (``modules``, else ``dynamic_lora_loading_path/<name>``) to keys
    (``name@path``: re-adding a name with another path makes another adapter), read adapters kept on the host
    (``max_cpu_loras``, least recently used first out), device slots (``SlotTable``) written as rows that need them
    join. ``resolve``, ``read``, ``add`` and ``remove`` run on any thread (requests are prepared off the engine's);
    ``acquire`` and ``release`` on the engine's. ``localize``: a local folder for a path or URI."""

    def __init__(self, modules: dict[str, str], dynamic_path: str | None, max_cpu_loras: int, slots: LoraSlots,
                 model_config, localize=lambda path: path) -> None:
        self.modules, self.dynamic_path = dict(modules), dynamic_path
        self.max_cpu_loras, self.slots, self.model_config = max_cpu_loras, slots, model_config
        self.table = SlotTable(slots.slots - 1)
        self.localize = localize
        self._read: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._paths: dict[str, tuple[str, str]] = {}  # key -> (name, path)
        self._lock = threading.Lock()

    def resolve(self, name: str) -> str:
        """The key of adapter ``name``; raises ``AdapterError`` (unknown) where neither ``modules`` nor the dynamic
        path names it."""
        if not isinstance(name, str) or not name:
            raise AdapterError(f"an adapter's name must be a non-empty string, got {name!r}")
        path = self.modules.get(name)
        if path is None and self.dynamic_path is not None and "/" not in name and name not in (".", ".."):
            path = f"{self.dynamic_path.rstrip('/')}/{name}"
        if path is None:
            known = ", ".join(sorted(self.modules)) or "none"
            raise AdapterError(f"unknown adapter {name!r} (lora.modules names: {known}; no dynamic_lora_loading_path"
                               f"{' holds it' if self.dynamic_path else ''})")
        key = f"{name}@{path}"
        with self._lock:
            self._paths[key] = (name, path)
        return key

    def read(self, key: str) -> LoraAdapter:
        """The adapter of ``key`` (``resolve``'s), read on first use (and again once the host cache dropped it)."""
        with self._lock:
            if key in self._read:
                self._read.move_to_end(key)
                return self._read[key]
            name, path = self._paths[key]
        try:
            folder = self.localize(path)
        except Exception as exc:  # a URI that cannot be read
            raise AdapterError(f"adapter {name!r}: {path} could not be read ({type(exc).__name__}: {exc})") from exc
        adapter = read_adapter(name, folder, self.model_config, self.slots.rank)
        with self._lock:
            self._read[key] = adapter
            while len(self._read) > self.max_cpu_loras:
                self._read.popitem(last=False)
        return adapter

    def loaded(self) -> dict[str, str]:
        """Adapter name -> path of those configured or read (a dynamic one once a request used it)."""
        with self._lock:
            read = {self._paths[key][0]: self._paths[key][1] for key in self._read}
        return {**read, **self.modules}

    def add(self, name: str, path: str) -> None:
        """Register (and read, so a bad adapter is refused now) adapter ``name`` at ``path``."""
        if name in self.modules:
            raise AdapterError(f"adapter {name!r} is already loaded (from {self.modules[name]})")
        self.modules[name] = path
        try:
            self.read(self.resolve(name))
        except Exception:
            del self.modules[name]
            raise

    def remove(self, name: str) -> None:
        """Forget adapter ``name``: new requests may not name it; rows running under it finish."""
        if name not in self.loaded():
            raise AdapterError(f"unknown adapter {name!r}")
        self.modules.pop(name, None)
        with self._lock:
            for key in [key for key in self._read if self._paths[key][0] == name]:
                del self._read[key]

    def acquire(self, key: str) -> int | None:
        """A device slot holding ``key``'s adapter for one more row (written now if it was not resident), or None
        while every slot is used by running rows (the row waits)."""
        taken = self.table.acquire(key)
        if taken is None:
            return None
        slot, write = taken
        if write:
            try:
                self.slots.load(slot, self.read(key))
            except Exception:
                self.table.release(key)
                self.table.evict(key)
                raise
        return slot

    def release(self, key: str) -> None:
        self.table.release(key)

    # A ``decoding.engine.batch.RowState``: a row leaving releases its adapter's slot.
    def rows_joined(self, joined) -> None:
        del joined

    def row_removed(self, row: int, last: int, seq) -> None:
        del row, last
        if seq.lora_key is not None:
            self.release(seq.lora_key)
