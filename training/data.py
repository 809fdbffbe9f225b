"""Training prompts: rows of JSONL / JSON / Parquet / CSV files, turned into token ids exactly as the engine does."""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedTokenizerBase


class PromptSource(BaseModel):
    """One prompt file. Rows carry ``prompt`` (raw text) or ``messages`` (chat), as in the job's input;
    ``template`` instead formats any row fields (``"Summarize ...: {document}"``) into a prompt."""

    model_config = ConfigDict(extra="forbid")

    path: str
    template: str | None = None
    chat: bool = Field(False, description="render the templated text as a user message with the chat template")
    limit: int | None = Field(None, ge=1, description="use only the first rows (keep the rest held out)")


def read_rows(path: str) -> list[dict[str, Any]]:
    files = sorted(glob.glob(path)) if any(c in path for c in "*?[") else [path]
    if len(files) == 1 and Path(files[0]).is_dir():
        files = sorted(str(p) for p in Path(files[0]).iterdir() if p.suffix in (".jsonl", ".json", ".parquet", ".csv"))
    if not files:
        raise FileNotFoundError(f"no prompt files match {path}")
    rows: list[dict[str, Any]] = []
    for file in files:
        suffix = Path(file).suffix
        if suffix == ".jsonl":
            rows += [json.loads(line) for line in Path(file).read_text().splitlines() if line.strip()]
        elif suffix == ".json":
            rows += json.loads(Path(file).read_text())
        elif suffix in (".parquet", ".csv"):
            import pyarrow.csv
            import pyarrow.parquet

            table = pyarrow.parquet.read_table(file) if suffix == ".parquet" else pyarrow.csv.read_csv(file)
            rows += table.to_pylist()
        else:
            raise ValueError(f"unsupported prompt file {file} (use .jsonl, .json, .parquet or .csv)")
    return rows


def row_prompt_ids(row: dict[str, Any], source: PromptSource, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    messages = row.get("messages")
    if source.template is not None:
        text = source.template.format(**row)
        messages = [{"role": "user", "content": text}] if source.chat else None
        if messages is None:
            return tokenizer(text)["input_ids"]
    if messages is not None:
        if isinstance(messages, str):
            messages = json.loads(messages)
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    if not isinstance(row.get("prompt"), str):
        raise ValueError(f"row without a 'prompt' string or 'messages' in {source.path}: set a template")
    return tokenizer(row["prompt"])["input_ids"]


def load_prompts(sources: list[PromptSource], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Token ids of every usable prompt, in file order; empty prompts are skipped."""
    prompts = []
    for source in sources:
        rows = read_rows(source.path)[: source.limit]
        prompts += [ids for ids in (row_prompt_ids(row, source, tokenizer) for row in rows) if ids]
    if not prompts:
        raise ValueError("no training prompts found in " + ", ".join(s.path for s in sources))
    return prompts
