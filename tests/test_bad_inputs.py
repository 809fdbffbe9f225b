"""No row or file stops a job: each kind of bad input becomes error rows naming the row or file and the reason,
the job exits 0, and every good row beside it is generated.

One `specbatch generate` run over a directory holding one file (or a few) per case; each test checks its case:
rows in = rows out, the bad ones as error rows with the reason, the good ones generated."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from decoding.config import Config
from pipeline.io import read_json_records
from pipeline.schema import READ_ERROR
from pipeline.store import OutputStore

DEEP = 100_000  # far past Python's recursion limit


def deep_list(depth: int) -> str:
    return "[" * depth + "]" * depth


def jsonl(*records: dict | str) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def good(case: str, n: int = 2) -> list[dict]:
    return [{"id": f"{case}-ok-{i}", "prompt": f"the cat sat {i}"} for i in range(n)]


def nested(depth: int) -> object:
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


# file name -> (content, {id: expected error substring, or None for a row that must be generated})
CASES: dict[str, tuple[str | bytes, dict[str, str | None]]] = {}


def case(name: str, content: str | bytes, expected: dict[str, str | None]) -> None:
    CASES[name] = (content, expected)


case("deep_row.jsonl",
     jsonl(*good("deep-row"), f'{{"id": "deep-row-bad", "prompt": "the cat", "extra": {deep_list(DEEP)}}}',
           {"id": "deep-row-70", "prompt": "the cat", "extra": nested(70)}),
     {"deep-row-ok-0": None, "deep-row-ok-1": None,
      # a record too deep to read has no id of its own: it is named by file and record
      "deep_row.jsonl:2": "record 3: nested deeper than", "deep_row.jsonl:3": "record 4: nested deeper than"})
case("deep_sampling.jsonl",
     jsonl(*good("deep-sp"), {"id": "deep-sp-text", "prompt": "the cat", "sampling_params": deep_list(DEEP)},
           {"id": "deep-sp-stop", "prompt": "the cat", "sampling_params": json.dumps({"stop": nested(40)})}),
     {"deep-sp-ok-0": None, "deep-sp-ok-1": None,
      "deep-sp-text": "invalid sampling_params: nested deeper than 32",
      "deep-sp-stop": "invalid sampling_params: nested deeper than 32"})


def parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


_GOOD_PARQUET = parquet_bytes(pa.table({"id": [r["id"] for r in good("pq", 3)],
                                        "prompt": [r["prompt"] for r in good("pq", 3)]}))
case("corrupt/good.parquet", _GOOD_PARQUET, {r["id"]: None for r in good("pq", 3)})
case("corrupt/truncated.parquet", _GOOD_PARQUET[: len(_GOOD_PARQUET) // 2],
     {"corrupt/truncated.parquet": "unreadable input file corrupt/truncated.parquet"})
case("corrupt/garbage.parquet", b"PAR1 this is not parquet at all",
     {"corrupt/garbage.parquet": "unreadable input file corrupt/garbage.parquet"})

case("types/a.jsonl", jsonl(*[{**r, "extra": i} for i, r in enumerate(good("types-a"))]),
     {"types-a-ok-0": None, "types-a-ok-1": None})
case("types/b.jsonl", jsonl({"id": "types-b-0", "prompt": 7, "extra": "seven"},
                            {"id": "types-b-1", "prompt": 8, "extra": "eight"}),
     {"types-b-0": "prompt must be a string, got int", "types-b-1": "prompt must be a string, got int"})
case("types/c.csv", "id,prompt,extra\ntypes-c-0,the cat,x\n", {"types-c-0": None})

case("messages.jsonl", jsonl(
    {"id": "msg-ok", "messages": [{"role": "user", "content": "hello there"}]},
    {"id": "msg-parts", "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]},
    {"id": "msg-no-content", "messages": [{"role": "user"}]},
    {"id": "msg-role", "messages": [{"role": "wizard", "content": "hi"}]},
    {"id": "msg-int-content", "messages": [{"role": "user", "content": 5}]},
    {"id": "msg-bad-part", "messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]},
    {"id": "msg-empty", "messages": []},
    {"id": "msg-not-list", "messages": "hello"},
), {"msg-ok": None, "msg-parts": None,
    "msg-no-content": "messages.0.content", "msg-role": "messages.0.role", "msg-int-content": "messages.0.content",
    "msg-bad-part": "messages.0.content", "msg-empty": "messages must not be empty", "msg-not-list": "messages"})

case("stops.jsonl", jsonl(
    {"id": "stop-ok", "prompt": "the cat", "sampling_params": {"stop": ["zz"]}},
    {"id": "stop-empty-list", "prompt": "the cat", "sampling_params": {"stop": [""]}},
    {"id": "stop-empty-str", "prompt": "the cat", "sampling_params": {"stop": ""}},
    {"id": "stop-one-empty", "prompt": "the cat", "sampling_params": {"stop": ["ok", ""]}},
), {"stop-ok": None, "stop-empty-list": "stop strings must be non-empty",
    "stop-empty-str": "stop strings must be non-empty", "stop-one-empty": "stop strings must be non-empty"})


case("sampling.jsonl", jsonl(
    {"id": "sp-top-k", "prompt": "the cat", "sampling_params": {"top_k": 2**63, "temperature": 1}},
    {"id": "sp-max-bool", "prompt": "the cat", "sampling_params": {"max_tokens": True}},
    {"id": "sp-max-float", "prompt": "the cat", "sampling_params": json.dumps({"max_tokens": 4.0})},
    {"id": "sp-nan", "prompt": "the cat", "sampling_params": '{"temperature": NaN}'},
    {"id": "sp-stop-id", "prompt": "the cat", "sampling_params": {"stop_token_ids": [-1]}},
    {"id": "sp-stop-id-vocab", "prompt": "the cat", "sampling_params": {"stop_token_ids": [35]}},
    {"id": "sp-min-tokens", "prompt": "the cat", "sampling_params": {"min_tokens": 10**9}},
    {"id": "sp-tiny-temperature", "prompt": "the cat sat", "sampling_params": {"temperature": 1e-38, "top_k": 5}},
    {"id": "sp-tiny-top-p", "prompt": "the cat sat", "sampling_params": {"temperature": 1.0, "top_p": 1e-46}},
    {"id": "sp-greedy", "prompt": "the cat sat", "sampling_params": {"temperature": 0}},
), {"sp-top-k": "top_k", "sp-max-bool": "max_tokens", "sp-max-float": "max_tokens", "sp-nan": "temperature",
    "sp-stop-id": "stop_token_ids", "sp-stop-id-vocab": "stop_token_ids", "sp-min-tokens": "min_tokens",
    "sp-tiny-temperature": None, "sp-tiny-top-p": None, "sp-greedy": None})


# Text that is not valid UTF-8 is an error row by itself, in every format; the rest of the file runs.
case("text/surrogate.jsonl", jsonl(
    *good("sur"), '{"id": "sur-bad", "prompt": "x \\ud800"}', '{"prompt": "\\udfff alone", "extra": 1}',
    '{"id": "sur-pair", "prompt": "a pair \\ud83d\\ude00 is text"}'),
     {"sur-ok-0": None, "sur-ok-1": None, "sur-bad": "lone surrogate", "text/surrogate.jsonl:3": "lone surrogate",
      "sur-pair": None})
case("text/bad.csv", b"id,prompt,extra\ncsv-ok-0,the cat,1\ncsv-bad,bad \xff\xfe text,2\ncsv-ok-1,a dog,3\n"
     b"csv-ragged,x,4,5\n\ncsv-ok-2,\"quoted, with comma\",6\n",
     {"csv-ok-0": None, "csv-ok-1": None, "csv-ok-2": None, "csv-bad": "record 2: it is not valid UTF-8",
      "csv-ragged": "record 4: it has 4 fields, the header 3"})


def _invalid_utf8_parquet() -> bytes:
    """Parquet does not check UTF-8 on reading: a prompt, and a stop string nested in a struct, that are not text."""
    prompts = pa.array([b"the cat", b"bad \xff text", b"a dog", b"on a mat"]).view(pa.string())
    stops = pa.array([b"zz", b"zz", b"z\xffz"]).view(pa.string())
    stop_lists = pa.ListArray.from_arrays(pa.array([0, 0, 0, 2, 3], pa.int32()), stops)
    params = pa.StructArray.from_arrays([stop_lists], ["stop"])
    ids = ["pq8-ok-0", "pq8-bad", "pq8-ok-1", "pq8-bad-nested"]
    return parquet_bytes(pa.table({"id": ids, "prompt": prompts, "sampling_params": params}))


def _corrupt_row_group_parquet() -> bytes:
    table = pa.table({"id": [f"rg-{i}" for i in range(6)], "prompt": [f"the cat {i}" for i in range(6)]})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=2, compression="none")
    data = bytearray(sink.getvalue().to_pybytes())
    chunk = pq.ParquetFile(pa.BufferReader(bytes(data))).metadata.row_group(1).column(1)  # rows 2-3's prompts
    data[chunk.data_page_offset : chunk.data_page_offset + 8] = b"\xff" * 8  # an unreadable page header
    return bytes(data)


case("text/invalid_utf8.parquet", _invalid_utf8_parquet(),
     {"pq8-ok-0": None, "pq8-ok-1": None, "pq8-bad": "column 'prompt' is not valid UTF-8",
      "pq8-bad-nested": "column 'sampling_params' is not valid UTF-8"})
case("text/row_groups.parquet", _corrupt_row_group_parquet(),
     {"rg-0": None, "rg-1": None, "rg-2": "unreadable row group 1", "rg-3": "unreadable row group 1", "rg-4": None,
      "rg-5": None})

# Any column type in any file: ids of another type than text (binary, as some writers store strings) become text,
# prompts of another type are error rows; json.dumps(bytes) used to fail the whole job.
case("binary/ids.parquet", parquet_bytes(pa.table({
    "id": pa.array([b"bin-ok", b"\xff\xfe", None], pa.binary()), "prompt": ["the cat", "a dog", "on a mat"]})),
     {"bin-ok": None, "fffe": None, "binary/ids.parquet:2": None})
case("binary/prompts.parquet", parquet_bytes(pa.table({
    "id": ["bin-prompt-0", "bin-prompt-1"], "prompt": pa.array([b"the cat", b"\xff bad"], pa.binary())})),
     {"bin-prompt-0": "prompt must be a string, got binary", "bin-prompt-1": "prompt must be a string, got binary"})
case("binary/nested.parquet", parquet_bytes(pa.table({
    "id": pa.array([1, 2], pa.int64()), "prompt": pa.array([["the", "cat"], ["a"]])})),
     {"1": "prompt must be a string, got list", "2": "prompt must be a string, got list"})


@pytest.fixture(scope="module")
def bad_run(ray_cluster, tiny_dirs, tmp_path_factory) -> tuple[int, dict[str, dict]]:
    from jobs.generate import main

    root = tmp_path_factory.mktemp("bad_inputs")
    for name, (content, _) in CASES.items():
        path = root / "in" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    config = Config.model_validate({
        "model": tiny_dirs["target"],
        "speculative": {"method": "draft_model", "model": tiny_dirs["draft"], "num_speculative_tokens": 3,
                        "length_policy": "static"},
        "sampling": {"temperature": 0.0, "max_tokens": 8}, "batch_size": 4,
    })
    (root / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    code = main(["--config", str(root / "config.yaml"), "--input", str(root / "in"), "--output", str(root / "out")])
    rows = {row["id"]: row for row in OutputStore(str(root / "out")).read_outputs().to_pylist()}
    return code, rows


def check(bad_run: tuple[int, dict[str, dict]], *files: str) -> None:
    code, rows = bad_run
    assert code == 0
    for name in files:
        expected = CASES[name][1]
        for row_id, reason in expected.items():
            assert row_id in rows, f"{name}: no output row {row_id}"
            row = rows[row_id]
            if reason is None:
                assert row["finish_reason"] in ("stop", "length") and row["error"] is None, (row_id, row["error"])
            else:
                assert row["finish_reason"] == "error" and reason in row["error"], (row_id, row["error"])
    # rows in = rows out, over the whole input
    assert sorted(rows) == sorted(i for _, expected in CASES.values() for i in expected)


def test_deeply_nested_row(bad_run):
    check(bad_run, "deep_row.jsonl")


def test_deeply_nested_sampling_params_string(bad_run):
    check(bad_run, "deep_sampling.jsonl")


def test_corrupt_parquet_files_keep_good_files_rows(bad_run):
    check(bad_run, "corrupt/good.parquet", "corrupt/truncated.parquet", "corrupt/garbage.parquet")


def test_column_types_differing_between_files(bad_run):
    check(bad_run, "types/a.jsonl", "types/b.jsonl", "types/c.csv")
    _, rows = bad_run
    # each part keeps its file's type; read together, the clashing column is JSON text
    assert rows["types-a-ok-1"]["extra"] == "1" and rows["types-b-0"]["extra"] == "seven"
    assert rows["types-c-0"]["extra"] == "x"


def test_malformed_messages(bad_run):
    check(bad_run, "messages.jsonl")


def test_empty_stop_strings(bad_run):
    check(bad_run, "stops.jsonl")


def test_invalid_text_is_an_error_row_in_every_format(bad_run):
    """A lone surrogate in a JSON line, invalid UTF-8 or a ragged record in a CSV file, invalid UTF-8 in a Parquet
    string, an unreadable Parquet row group: those rows are errors (keeping their ids where they can), the others
    run; before, the file became one error row (or, for Parquet, failed the actor's whole batch)."""
    check(bad_run, "text/surrogate.jsonl", "text/bad.csv", "text/invalid_utf8.parquet", "text/row_groups.parquet")
    _, rows = bad_run
    assert rows["csv-ok-2"]["extra"] == "6" and rows["csv-ok-0"]["prompt"] == "the cat"


def test_any_column_type_in_any_file_is_rows_not_a_job_failure(bad_run):
    check(bad_run, "binary/ids.parquet", "binary/prompts.parquet", "binary/nested.parquet")


def test_an_output_directory_inside_the_input_is_never_read_as_input(ray_cluster, tiny_dirs, tmp_path):
    """Its parts, markers, runs and summary.json were read as input by the second run: 203 junk error rows."""
    from jobs.generate import main

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "prompts.jsonl").write_text(jsonl(*good("nested-out")))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model": tiny_dirs["target"], "speculative": {"method": "none"},
                                      "sampling": {"max_tokens": 4}, "batch_size": 2}))
    output = tmp_path / "in" / "out"
    for _ in range(2):  # the second run resumes: nothing left to do, nothing read from out/
        assert main(["--config", str(config), "--input", str(tmp_path / "in"), "--output", str(output)]) == 0
    rows = OutputStore(str(output)).read_outputs().to_pylist()
    assert sorted(row["id"] for row in rows) == ["nested-out-ok-0", "nested-out-ok-1"]
    assert all(row["error"] is None for row in rows)
    # The input inside the output: refused, naming both.
    with pytest.raises(SystemExit) as exited:
        main(["--config", str(config), "--input", str(output / "outputs"), "--output", str(output)])
    assert exited.value.code == 2


def test_a_value_python_cannot_hold_fails_its_row_alone():
    """The engine actor's rows (also build_processor's, from any dataset): a prompt that is not UTF-8 is an error row
    naming the column, the other rows are requests; a carried-through column is never made Python values (a
    timestamp past year 9999 failed the whole batch)."""
    from pipeline.actor import _rows
    from pipeline.schema import READ_ERROR

    batch = pa.table({"id": ["a", "b", "c"], "prompt": pa.array([b"the cat", b"bad \xff", b"a dog"]).view(pa.string()),
                      "when": pa.array([0, 10**14, 2], pa.timestamp("s"))})
    with pytest.raises(ValueError):
        batch.to_pylist()
    first, bad, last = _rows(batch)
    assert first == {"id": "a", "prompt": "the cat"} and last == {"id": "c", "prompt": "a dog"}
    assert list(bad) == [READ_ERROR] and "column 'prompt'" in bad[READ_ERROR]
    assert _rows(batch.drop_columns(["prompt"])) == [{"id": "a"}, {"id": "b"}, {"id": "c"}]


def test_progress_counts_every_file_corrupt_ones_included(tmp_path):
    """The progress display's row count (on a thread of its own) reads a corrupt Parquet file as the one error row
    the reader makes of it; it raised "Parquet magic bytes not found" there, and the run showed no total."""
    import pyarrow.fs as pafs

    from pipeline.io import parse_file
    from pipeline.progress import count_rows

    paths = []
    for name, (content, _) in CASES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        paths.append(str(path))
    assert count_rows(pafs.LocalFileSystem(), paths) == sum(len(expected) for _, expected in CASES.values())
    # records, not lines: a quoted CSV value with a line break, a JSON array on a few lines, a header alone
    (tmp_path / "multiline.csv").write_bytes(b'id,prompt\na,"line one\nline two"\nb,plain\n')
    (tmp_path / "array.json").write_bytes(b'[{"prompt": "a"}, {"prompt": "b"},\n {"prompt": "c"}]')
    (tmp_path / "header.csv").write_bytes(b"id,prompt\n")
    for name, rows in (("multiline.csv", 2), ("array.json", 3), ("header.csv", 0)):
        assert count_rows(pafs.LocalFileSystem(), [str(tmp_path / name)]) == rows, name
        assert parse_file(pa.py_buffer((tmp_path / name).read_bytes()), name.split(".")[1]).num_rows == rows, name


def test_sampling_params_are_bounded_and_strict_as_the_servers(bad_run):
    """Every field is bounded before the engine sees it (top_k 2**63 used to fail inside the engine step, which
    rebuilt the engine, and the error did not name top_k); ints are strict, as the server's."""
    check(bad_run, "sampling.jsonl")
    _, rows = bad_run
    greedy = rows["sp-greedy"]["generated_tokens"]
    assert greedy and rows["sp-tiny-temperature"]["generated_tokens"] == greedy
    assert rows["sp-tiny-top-p"]["generated_tokens"] == greedy


def test_the_server_refuses_what_the_pipeline_refuses():
    """One validation: the server's chat message model is the pipeline's."""
    from pydantic import ValidationError

    from deploy.protocol import ChatCompletionRequest
    from frontend.requests import ChatMessage, RequestError, parse_request

    assert ChatCompletionRequest.model_fields["messages"].annotation == list[ChatMessage]
    for messages in ([{"role": "user"}], [{"role": "wizard", "content": "hi"}], [{"role": "user", "content": 5}]):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({"messages": messages})
        with pytest.raises(RequestError):
            parse_request(messages=messages)
    with pytest.raises(RequestError, match="nested deeper"):
        parse_request(prompt="x", sampling_params=deep_list(DEEP))


def test_a_json_record_that_is_not_utf8_keeps_its_readable_id():
    """Its id was derived from the file's name and line (``nul.jsonl:1``): the line failed to decode as a whole."""
    rows = read_json_records(b'{"id": "kept", "prompt": "caf\xe9"}\n{"id": "ok", "prompt": "the cat"}\n'
                             b'{"id": "\xff", "prompt": "x"}\n\xef\xbb\xbf{"id": "bom", "prompt": "y"}\n').to_pylist()
    assert rows[0]["id"] == "kept" and rows[0].get("prompt") is None
    assert "record 1" in rows[0][READ_ERROR] and "utf-8" in rows[0][READ_ERROR]
    assert rows[1]["id"] == "ok" and rows[1]["prompt"] == "the cat" and rows[1][READ_ERROR] is None
    assert rows[2]["id"] is None and "record 3" in rows[2][READ_ERROR]  # an id that is not text: derived later
    assert rows[3]["id"] == "bom" and rows[3][READ_ERROR] is None
