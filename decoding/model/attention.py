"""Attention over the paged KV cache: every query reads only its own row's blocks, without padding or copies.

A forward's queries are the nodes [start, end) of each row's tree (a decode step is a one-node tree, a prefill a
chain), laid out row by row. ``AttentionMetadata`` says, per query, which keys it sees: the row's first
``prefix_len`` positions, plus the tentative tree positions ``prefix_len + t`` for each bit t of ``tree_mask``
(its ancestors and itself; words of 64 bits). The same description serves a prefill (a chain: ``prefix_len``
grows by one per query, no tree bits), a verification (the committed tokens, then the tree) and a draft level
(the committed tokens, then the nodes earlier levels wrote).

Two implementations of the one operation ``paged_attention``:
- on a CPU, a C++ kernel (``csrc/paged_attention.cpp``) compiled once per machine with torch's extension builder
  and cached (a C++ compiler is needed; without one a warning says so and the reference runs). It writes the new
  keys and values into their slots, then reads each row's blocks in place. 64 rows of 300-1300 cached tokens:
  4.9 ms a layer against 6.9 ms for SDPA over the same rows padded to the longest (2-core CPU, AVX-512);
- elsewhere, and as the readable oracle the kernel is tested against, ``reference_attention``: the rows' blocks
  gathered into a padded batch and one SDPA call with the mask the metadata describes.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from decoding.paths import cache_dir

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_attention.cpp", "quantized_linear.cpp",
                                                                  "compiled_calls.cpp")]
_lock = threading.Lock()
_BUILD_WAIT_S = 900  # a build takes 15-30 s on 2 cores; a holder this long is stuck
_kernel_folder: dict[str, Path] = {}  # "folder": where the loaded kernel library lies
_kernel_state: dict[str, bool] = {}  # "loaded": the CPU kernel is registered as torch.ops.specbatch.paged_attention


@dataclass(frozen=True)
class AttentionMetadata:
    """Which slots a forward writes and which keys each query reads; tensors on the model's device.

    Queries are row-major: row r's queries are [row_starts[r], row_starts[r + 1]) (a tree forward gives every row
    as many; the kernel also takes ragged rows).
    """

    slots: torch.Tensor  # [N] long: the slot each query token's key and value are written to
    block_tables: torch.Tensor  # [R, max_blocks] int32: the physical blocks of each row of the forward
    row_starts: torch.Tensor  # [R + 1] int32
    prefix_len: torch.Tensor  # [N] int32: positions [0, prefix_len) of the row are visible
    tree_mask: torch.Tensor  # [N, words] int64: bit t (of word t // 64) makes position prefix_len + t visible
    max_keys: int  # at least the most positions any row's queries see (host fact: the reference's padding)


def _build_kernel() -> bool:
    """Compile and load the CPU kernel (once per machine and source; later processes load the library directly).

    Builders of one key take an OS file lock, which dies with its process; torch's own build lock (a plain file
    named ``lock``) outlives a killed build and makes every later build wait forever, so under our lock a leftover
    one is removed before building."""
    from filelock import FileLock, Timeout
    from torch.utils import cpp_extension


    capability = torch.backends.cpu.get_cpu_capability()  # DEFAULT, AVX2, AVX512: at::vec's instruction set
    flags = ["-O3", "-fopenmp"]
    if capability in ("AVX2", "AVX512"):
        flags += ["-march=native", f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    sources = b"".join(source.read_bytes() for source in _SOURCES)
    key = hashlib.sha256(sources + f"{torch.__version__}|{capability}".encode()).hexdigest()[:12]
    folder = cache_dir() / "kernels" / key
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / "specbatch_paged_attention.so"
    _kernel_folder["folder"] = folder
    try:
        with FileLock(str(folder.parent / f"{key}.lock"), timeout=_BUILD_WAIT_S):
            if library.exists():
                try:
                    torch.ops.load_library(str(library))
                    _export_symbols(library)
                    return True
                except OSError:  # a build killed while linking: build again
                    library.unlink()
            (folder / "lock").unlink(missing_ok=True)
            log.info("compiling the paged attention kernel for this machine (once; cached in %s)", folder)
            started = time.perf_counter()
            cpp_extension.load(
                name="specbatch_paged_attention", sources=[str(source) for source in _SOURCES], extra_cflags=flags,
                extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False, verbose=False,
            )
            log.info("compiled the paged attention kernel in %.1f s", time.perf_counter() - started)
            _export_symbols(library)
            return True
    except Timeout as exc:
        raise RuntimeError(f"another process held {folder} for {_BUILD_WAIT_S} s") from exc


def _export_symbols(library: Path) -> None:
    """The loaded library's symbols made global, so that a compiled package calling its C entry points
    (``csrc/compiled_calls.cpp``) finds them when loaded (torch loads libraries with their symbols local)."""
    import ctypes

    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)


def cpu_kernel() -> bool:
    """Whether the CPU kernel is available (built or loaded on first call; ``execution.py`` decides whether a
    forward uses it)."""
    with _lock:
        if "loaded" not in _kernel_state:
            try:
                _kernel_state["loaded"] = _build_kernel()
                torch.library.register_fake("specbatch::paged_attention")(_fake_paged_attention)
                torch.library.register_fake("specbatch::packed_linear")(_fake_packed_linear)
                torch.library.register_fake("specbatch::lora_delta")(_fake_lora_delta)
                torch.library.register_fake("specbatch::block_linear")(_fake_block_linear)
            except Exception as exc:  # no compiler, no headers: the reference computes the same
                log.warning("could not build the paged attention kernel (%s: %s); using the reference attention",
                            type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                _kernel_state["loaded"] = False
        return _kernel_state["loaded"]


def _fake_paged_attention(k_cache, v_cache, q, k, v, slots, block_tables, row_starts, prefix_len, tree_mask, scale):
    return torch.empty_like(q)


def _fake_packed_linear(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _fake_block_linear(x, q, d, m, bits):
    return x.new_empty((*x.shape[:-1], q.shape[0]))


def _fake_lora_delta(x, a, parts, index, rank):
    return x.new_empty((x.shape[0], sum(part.shape[1] for part in parts)))


def kernel_folder() -> Path:
    """The folder of the CPU kernels built for this machine and source (``cpu_kernel()`` first)."""
    return _kernel_folder["folder"]


def kernel_loaded() -> bool:
    """Whether the CPU kernels are registered (``cpu_kernel()`` loads them)."""
    return bool(_kernel_state.get("loaded"))


def pack_linear_weights(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Prepack float32 CPU weights for ``torch.ops.specbatch.packed_linear`` (which then finds them by their
    data pointer); returns the weights that were packed, to be forgotten with ``forget_linear_weights``."""
    if not (cpu_kernel() and torch.backends.mkldnn.is_available()):
        return []
    packed = []
    for weight in weights:
        if packs(weight):
            torch.ops.specbatch.remember_packed(weight, torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT))
            packed.append(weight)
    return packed


def packs(weight: torch.Tensor) -> bool:
    """Whether ``pack_linear_weights`` packs ``weight`` (a float32 CPU matrix of at least PACK_MIN_WEIGHTS)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.numel() >= PACK_MIN_WEIGHTS)


def forget_linear_weights(weights: list[torch.Tensor]) -> None:
    for weight in weights:
        torch.ops.specbatch.forget_packed(weight)


# Rows the packed layout is tuned for: a decode step or a verification of a few rows of a few tree nodes.
PACK_ROWS_HINT = 8
# Smaller weights stay dense: a packed call costs ~11 us whatever its size, a dense 192 x 64 one 2-5 us at 1-6 rows
# (at 576 x 576 and up, packed wins from 6 rows and at 64 rows by 2x; 2-core CPU).
PACK_MIN_WEIGHTS = 1 << 16


def pools_zero_filled(device: torch.device) -> bool:
    """Whether KV pools on ``device`` are zero-filled when allocated (``kv_cache.py``): then every slot holds a
    finite value. On a CPU they are not (pages are committed as blocks are first written)."""
    return device.type != "cpu"


def paged_attention(
    k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    meta: AttentionMetadata, scale: float, layout: DenseLayout | None = None, cpu: bool = False,
) -> torch.Tensor:
    """Write ``k``, ``v`` [N, kv_heads, D] into their slots, then attend ``q`` [N, heads, D] over each row's
    visible keys; returns [N, heads, D]. Caches: keys [blocks, kv_heads, D, block_size], values
    [blocks, kv_heads, block_size, D]. ``cpu``: the C++ kernel runs (``Execution.kernels``), else the reference;
    ``layout``: the reference's per-forward part, shared by the layers."""
    if cpu:
        return torch.ops.specbatch.paged_attention(
            k_cache, v_cache, q, k, v, meta.slots, meta.block_tables, meta.row_starts, meta.prefix_len,
            meta.tree_mask, scale,
        )
    return reference_attention(k_cache, v_cache, q, k, v, meta, scale, layout)


@dataclass(frozen=True)
class DenseLayout:
    """What every layer's reference attention shares within one forward, computed once from the metadata (per
    layer it was ~25 of a layer's ~75 kernel launches on a GPU)."""

    write_blocks: torch.Tensor  # [N] long: each new key's block
    write_offsets: torch.Tensor  # [N] long: its offset in the block
    blocks: torch.Tensor  # [R, ceil(keys / block_size)] long: the blocks gathered per row
    keys: int  # positions gathered per row (padded)
    allowed: torch.Tensor  # [R, 1, T, keys] bool: the SDPA mask
    seen: torch.Tensor | None  # [R, 1, keys, 1] bool: positions any query of the row sees; None: no zeroing needed


def dense_layout(meta: AttentionMetadata, block_size: int, zero_filled: bool) -> DenseLayout:
    """``meta`` as the reference reads it. ``zero_filled``: the pool was zero-filled when allocated, so every slot
    holds a finite value and unseen positions need no zeroing (a masked weight times a NaN is still NaN)."""
    rows = meta.block_tables.shape[0]
    keys = max(meta.max_keys, 1)
    needed = -(-keys // block_size)
    tables = meta.block_tables
    if tables.shape[1] < needed:  # keys past the table: the scratch block, masked by every caller
        tables = torch.nn.functional.pad(tables, (0, needed - tables.shape[1]))
    allowed = visibility(meta, keys).view(rows, 1, -1, keys)
    return DenseLayout(
        write_blocks=meta.slots // block_size, write_offsets=meta.slots % block_size,
        blocks=tables[:, :needed].long(), keys=keys, allowed=allowed,
        seen=None if zero_filled else allowed.any(2)[..., None],
    )


def write_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                blocks: torch.Tensor, offsets: torch.Tensor) -> None:
    """Keys and values [N, kv_heads, D] into their slots (``blocks`` and ``offsets`` [N])."""
    k_cache[blocks, :, :, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, :, offsets] = v.to(v_cache.dtype)


def gather_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, keys: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [0, keys) of each row (``blocks`` [R, nb]) as dense [R, kv_heads, keys, D] keys and values."""
    k = k_cache[blocks].permute(0, 2, 1, 4, 3).flatten(2, 3)  # [R, H, nb * bs, D]
    v = v_cache[blocks].transpose(1, 2).flatten(2, 3)
    # Contiguous: CUDA's memory-efficient SDPA refuses keys whose sequence stride is not aligned.
    return k[:, :, :keys].contiguous(), v[:, :, :keys].contiguous()


def visibility(meta: AttentionMetadata, keys: int) -> torch.Tensor:
    """[N, keys] bool: which of its row's first ``keys`` positions each query sees."""
    positions = torch.arange(keys, device=meta.prefix_len.device)[None]
    prefix = meta.prefix_len.long()[:, None]
    offset = positions - prefix
    words = meta.tree_mask.shape[1]
    in_tree = (offset >= 0) & (offset < 64 * words)
    word = meta.tree_mask.gather(1, (offset.clamp(0, 64 * words - 1) // 64).expand(len(prefix), -1))
    bits = (word >> (offset.clamp(min=0) % 64)) & 1
    return (positions < prefix) | (in_tree & (bits == 1))


def reference_attention(
    k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    meta: AttentionMetadata, scale: float, layout: DenseLayout | None = None,
) -> torch.Tensor:
    """``paged_attention`` with torch operations: the rows' blocks gathered, padded to ``max_keys``, one SDPA. Rows
    have equally many queries (as every tree forward lays them out); nothing is read back from the device, so a
    CUDA graph can capture it. ``layout``: ``dense_layout(meta, ...)`` when the caller shares it across layers."""
    if layout is None:
        layout = dense_layout(meta, k_cache.shape[-1], zero_filled=False)
    write_slots(k_cache, v_cache, k, v, layout.write_blocks, layout.write_offsets)
    rows = layout.blocks.shape[0]
    tokens, heads, dim = q.shape
    dense_k, dense_v = gather_rows(k_cache, v_cache, layout.blocks, layout.keys)  # [R, Hkv, L, D]
    if layout.seen is not None:  # positions no query of a row sees may never have been written
        dense_k, dense_v = torch.where(layout.seen, dense_k, 0), torch.where(layout.seen, dense_v, 0)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.view(rows, tokens // rows, heads, dim).transpose(1, 2), dense_k.to(q.dtype), dense_v.to(q.dtype),
        attn_mask=layout.allowed, scale=scale, enable_gqa=True,
    )
    return out.transpose(1, 2).reshape(tokens, heads, dim)
