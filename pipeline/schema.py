"""The explicit Arrow schemas of an output directory (docs/reference.md) and the tables built on them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from frontend.logprobs import vllm_logprobs

if TYPE_CHECKING:
    from decoding.engine import GenerationResult

SPEC_DECODE = pa.struct([
    pa.field("num_spec_steps", pa.int32()),
    pa.field("num_draft_tokens", pa.int32()),
    pa.field("num_accepted_draft_tokens", pa.int32()),
    pa.field("mean_acceptance_length", pa.float64()),
    pa.field("tokens_per_forward", pa.float64()),
    pa.field("draft_acceptance_rate", pa.float64()),
    pa.field("acceptance_histogram", pa.list_(pa.int32())),
    pa.field("num_grammar_forced_tokens", pa.int32()),
])

# vLLM's Logprob: a token's log-probability, its 1-based rank in the model's law, and its text.
LOGPROB = pa.struct([pa.field("logprob", pa.float32()), pa.field("rank", pa.int32()),
                     pa.field("decoded_token", pa.string())])
# vLLM's logprobs of one position: token id -> Logprob, the chosen token first, then the top alternatives.
POSITION_LOGPROBS = pa.map_(pa.int32(), LOGPROB)

# One call in OpenAI's terms: its id, the function's name, its arguments as a JSON object's text.
TOOL_CALL = pa.struct([pa.field("id", pa.string()), pa.field("name", pa.string()), pa.field("arguments", pa.string())])

OUTPUT_SCHEMA = pa.schema([
    pa.field("id", pa.string()),
    pa.field("prompt", pa.string()),
    pa.field("prompt_token_ids", pa.list_(pa.int32())),
    pa.field("generated_text", pa.string()),
    pa.field("generated_tokens", pa.list_(pa.int32())),
    pa.field("num_input_tokens", pa.int32()),
    pa.field("num_generated_tokens", pa.int32()),
    # Prompt tokens taken from the prefix cache instead of prefilled (vLLM's num_cached_tokens).
    pa.field("num_cached_tokens", pa.int32()),
    pa.field("finish_reason", pa.string()),
    pa.field("error", pa.string()),
    pa.field("time_taken_llm", pa.float64()),
    pa.field("token_accepted", pa.list_(pa.bool_())),
    pa.field("per_step_drafted", pa.list_(pa.int32())),
    pa.field("per_step_accepted", pa.list_(pa.int32())),
    pa.field("spec_decode", SPEC_DECODE),
    pa.field("target_model", pa.string()),
    pa.field("draft_model", pa.string()),
    # The LoRA adapter that produced the row (null: the base model).
    pa.field("lora", pa.string()),
    # sampling_params.logprobs (vLLM's RequestOutput): per generated token, the target's log-probabilities of the
    # token and of its top alternatives; null for rows that did not ask.
    pa.field("logprobs", pa.list_(POSITION_LOGPROBS)),
    # sampling_params.prompt_logprobs: the same per prompt token, the first null (nothing precedes it).
    pa.field("prompt_logprobs", pa.list_(POSITION_LOGPROBS)),
    # The calls generated_text holds, read by the row's tools (frontend/tool_calls.py); null where none.
    pa.field("tool_calls", pa.list_(TOOL_CALL)),
])
# The columns a processor hands on as Ray Data LLM's rows hold them: Python dicts keyed by token id.
PYTHON_OBJECT_COLUMNS = ("logprobs", "prompt_logprobs")

# One row per drafted candidate token; field order matches GenerationResult.token_stats tuples after `id`.
TOKEN_STATS_SCHEMA = pa.schema([
    pa.field("id", pa.string()),
    pa.field("step", pa.int32()),
    pa.field("depth", pa.int32()),
    pa.field("candidate", pa.int32()),
    pa.field("token_id", pa.int32()),
    pa.field("draft_prob", pa.float32()),
    pa.field("target_prob", pa.float32()),
    pa.field("accepted", pa.bool_()),
])
TOKEN_STAT = pa.struct(list(TOKEN_STATS_SCHEMA)[1:])

# Columns private to the pipeline, never written: a reader's per-row decode error, and the token statistics
# (opt-in for build_processor) that travel nested in the actor's output block until the writer splits them off.
READ_ERROR = "__read_error"
TOKEN_STATS = "token_stats"
_PRIVATE = (READ_ERROR, TOKEN_STATS)
# Schema metadata keys of an actor's output block: the Ray node it was generated on, and when (wall clock) the
# actor's engine was built.
PRODUCER_NODE = "specbatch.node"
ENGINE_READY = "specbatch.engine_ready"


def python_objects(values: list[Any]) -> pa.Array:
    """``values`` as one Arrow column of Python objects (Ray Data's pickled-object extension type): how Ray Data
    holds a column of dicts keyed by ints, such as Ray Data LLM's ``logprobs``."""
    from ray.data._internal.object_extensions.arrow import ArrowPythonObjectArray

    return ArrowPythonObjectArray.from_objects(values)


def _output_row(result: GenerationResult, decode: Callable[[list[int]], list[str]] | None) -> dict[str, Any]:
    if result.finish_reason == "error":  # no partial outputs: every list of an error row is empty
        spec_decode = {**result.spec_decode, "acceptance_histogram": []}
    else:
        spec_decode = result.spec_decode
    return {
        "prompt": result.prompt,
        "prompt_token_ids": result.prompt_token_ids,
        "generated_text": result.text,
        "generated_tokens": result.token_ids,
        "num_input_tokens": len(result.prompt_token_ids),
        "num_generated_tokens": len(result.token_ids),
        "num_cached_tokens": result.num_cached_tokens,
        "finish_reason": result.finish_reason,
        "error": result.error,
        "time_taken_llm": result.time_taken,
        "token_accepted": result.token_accepted,
        "per_step_drafted": result.per_step_drafted,
        "per_step_accepted": result.per_step_accepted,
        "spec_decode": spec_decode,
        "lora": result.lora,
        "logprobs": vllm_logprobs(result.logprobs, decode),
        "prompt_logprobs": vllm_logprobs(getattr(result, "prompt_logprobs", None), decode),
    }


def output_block(
    inputs: pa.Table, results: list[GenerationResult], provenance: dict[str, str | None], token_stats: bool = True,
    *, decode: Callable[[list[int]], list[str]] | None = None, python_logprobs: bool = False,
    tool_calls: list[list[dict[str, str]] | None] | None = None,
) -> pa.Table:
    """The output columns for ``results`` (one per input row, same order), carried-through input
    columns after them, and with ``token_stats`` the nested token statistics. ``id`` only where the input has
    one (build_processor needs none), first and of the input's type (the job's reader makes it a string).
    ``decode``: token ids to their texts, for the logprobs' ``decoded_token``. ``python_logprobs``: the logprob
    columns as Python objects, as Ray Data LLM's rows hold them (else Arrow maps, which Parquet stores).
    ``tool_calls``: each row's calls (``TOOL_CALL`` dicts), or None."""
    calls = tool_calls or [None] * len(results)
    rows = [{**_output_row(result, decode), **provenance, "tool_calls": row_calls}
            for result, row_calls in zip(results, calls, strict=True)]
    table = pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA.remove(0))
    if python_logprobs:
        for name in PYTHON_OBJECT_COLUMNS:
            index = table.column_names.index(name)
            table = table.set_column(index, name, python_objects([row[name] for row in rows]))
    if "id" in inputs.column_names:
        table = table.add_column(0, inputs.schema.field("id"), inputs["id"])
    for field in inputs.schema:
        if field.name not in OUTPUT_SCHEMA.names and field.name not in _PRIVATE:
            table = table.append_column(field, inputs[field.name])
    if not token_stats:
        return table
    stats = pa.array([[dict(zip(TOKEN_STAT.names, stat, strict=True)) for stat in r.token_stats] for r in results],
                     type=pa.list_(TOKEN_STAT))
    return table.append_column(TOKEN_STATS, stats)


def split_block(block: pa.Table) -> tuple[pa.Table, pa.Table]:
    """An actor's output block -> (outputs table, token_stats table with one row per drafted token)."""
    nested = block[TOKEN_STATS]
    flat = pc.list_flatten(nested)
    ids = pc.take(block["id"], pc.list_parent_indices(nested))
    stats = pa.Table.from_arrays([ids, *(pc.struct_field(flat, name) for name in TOKEN_STAT.names)],
                                 schema=TOKEN_STATS_SCHEMA)
    return block.drop_columns([TOKEN_STATS]), stats


# Ray Data LLM's error column (``should_continue_on_error``): the reason on error rows, empty on the others.
INFERENCE_ERROR = "__inference_error__"


@dataclass(frozen=True)
class RowOptions:
    """What rows mean to the actor. ``continue_on_error``: a row that cannot be generated becomes an error row
    (false: it fails the batch, so the dataset). ``detokenize``: ``generated_text`` decoded from the tokens for rows
    whose sampling asked for none. ``apply_chat_template``: false refuses ``messages``. ``continue_assistant``:
    messages ending with the assistant's are continued (Ray Data LLM's rule). ``metrics``: vLLM's metrics export.
    ``error_column``: rows get ``INFERENCE_ERROR``. ``max_pending``: rows the actor keeps in its engine at once
    (None: every row of the batches it works on). ``ray_data_llm_rows``: rows as Ray Data LLM's engine stage makes
    them: ``n`` above 1 gives the first completion only, and the logprob columns hold Python dicts."""

    continue_on_error: bool = True
    error_column: bool = False
    detokenize: bool = False
    apply_chat_template: bool = True
    continue_assistant: bool = False
    metrics: bool = True
    max_pending: int | None = None
    ray_data_llm_rows: bool = False
