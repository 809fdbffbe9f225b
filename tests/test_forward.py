"""The forwards a step runs: the paged attention kernel against its reference, the lean forward against
transformers' for every family it serves (and a quantized twin), transformers' own forward for any other
architecture, the compiled layer stack against the eager one, and the prepacked inference view and all three
forwards agreeing on trees."""

from __future__ import annotations

import dataclasses
import functools
import weakref
import zipfile

import pytest
import torch
from engine_cases import PROMPTS
from tiny import gguf_pair, tiny_model, tiny_tokenizer
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from decoding import Config, Engine, Request
from decoding.config import ExecutionConfig
from decoding.drafting.costs import BatchCosts, CostTable
from decoding.engine import build
from decoding.model import attention
from decoding.model import loading as models
from decoding.model.attention import AttentionMetadata, cpu_kernel, packs, reference_attention
from decoding.model.execution import Execution
from decoding.model.forward import forward_tree
from decoding.model.kv_cache import CacheShape, PagedKVCache
from decoding.model.lean_forward import LeanCausalLM, lean_view, supports_lean_forward
from decoding.model.loading import for_inference
from decoding.model.quantize import quantized
from decoding.paths import cache_dir
from decoding.verification.tree import TreeTopology, chain_ancestors

COMMON = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, bos_token_id=1, pad_token_id=0)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # q, k, v with biases
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),  # RMSNorm over each head's query and key
}


def family_model(name: str) -> torch.nn.Module:
    config_class, model_class, extra = FAMILIES[name]
    torch.manual_seed(0)
    model = model_class(config_class(**COMMON, **extra, initializer_range=0.3)).eval()
    if name == "qwen2":  # random biases: a zero bias would hide a bias left out
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.3)
    return model


def _tree_forwards(model: torch.nn.Module, config, execution: Execution | None = None
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, last hidden) of a ragged prefill and then a width-2 tree (a shallower row included), for all three
    rows and for rows 0 and 2 alone (a host index of rows); run as ``execution`` says (default: the default's)."""
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, config.vocab_size, (3, 7), generator=generator)
    prompt_valid = torch.arange(7)[None] < torch.tensor([[7], [4], [6]])
    topology = TreeTopology(num_candidates=2, max_depth=2, root_width=1)
    nodes = torch.randint(3, config.vocab_size, (3, topology.size(2)), generator=generator)
    valid = torch.ones(3, topology.size(2), dtype=torch.bool)
    valid[1, -2:] = False
    cache = PagedKVCache(CacheShape.of(config), 8, 3, 64, dtype=next(model.parameters()).dtype, execution=execution)
    rows = cache.add_rows([32, 32, 32])
    prefill = forward_tree(model, cache, rows, prompts, chain_ancestors(7), prompt_valid, want_hidden=True)
    cache.advance(rows, prompt_valid.sum(1).tolist())
    outputs = [(prefill[0][prompt_valid], prefill[1][prompt_valid])]
    for some in (rows, torch.tensor([0, 2])):
        picked = slice(None) if isinstance(some, slice) else some
        logits, hidden = forward_tree(model, cache, some, nodes[picked], topology.ancestors, valid[picked],
                                      want_hidden=True)
        outputs.append((logits[valid[picked]], hidden[valid[picked]]))
    return outputs


def _rows_agree(outputs) -> None:
    """Rows 0 and 2 forwarded alone compute what they compute beside row 1."""
    (_, _), (all_logits, _), (some_logits, _) = outputs
    per_row = all_logits.split([5, 3, 5])
    torch.testing.assert_close(some_logits, torch.cat([per_row[0], per_row[2]]))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_lean_forward_computes_what_transformers_computes(family) -> None:
    model = family_model(family)
    assert supports_lean_forward(model)
    lean = lean_view(model)
    assert isinstance(lean, LeanCausalLM) and lean_view(model) is lean
    reference, ours = _tree_forwards(model, model.config), _tree_forwards(lean, model.config)
    for (logits, hidden), (lean_logits, lean_hidden) in zip(reference, ours):
        torch.testing.assert_close(lean_logits, logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lean_hidden, hidden, atol=1e-5, rtol=1e-5)
    _rows_agree(ours)


def test_the_lean_forward_runs_a_quantized_twin_through_its_fused_kernels() -> None:
    twin = quantized(tiny_model(), "int4", head=None)  # a float head: the layers' rounding alone is compared
    lean = lean_view(twin)
    assert all(spec.qkv.kind == "int4" and spec.kernel_dtype == torch.bfloat16 for spec in lean.stack.specs)
    for (logits, hidden), (lean_logits, lean_hidden) in zip(_tree_forwards(twin, twin.config),
                                                            _tree_forwards(lean, twin.config)):
        # bf16 activations into the int4 kernels on both sides; the fused call rounds like the separate ones.
        torch.testing.assert_close(lean_logits, logits, atol=0.05, rtol=0.01)
        torch.testing.assert_close(lean_hidden, hidden, atol=0.05, rtol=0.01)


def test_the_lean_forward_reads_a_quantized_twins_own_head() -> None:
    """A twin's LM head is its int4 kernel with the top logits recomputed in float, a third of a float head's cost
    at SmolLM2's size: the lean forward computes its logits through it, not through the float weight it shares."""
    twin = quantized(tiny_model(), "int4")
    lean = lean_view(twin)
    for logits, hidden in _tree_forwards(lean, twin.config):
        torch.testing.assert_close(logits, twin.lm_head(hidden), atol=0, rtol=0)
        assert not torch.allclose(logits, hidden @ twin.lm_head.weight.T, atol=1e-3)


def test_another_architecture_runs_transformers_forward_with_the_same_semantics() -> None:
    """Gemma's decoder is not the Llama family's: the engine runs transformers' own forward over the paged cache,
    and greedy outputs are transformers' generate, plain and speculative."""
    torch.manual_seed(0)
    config = GemmaConfig(**{**COMMON, "head_dim": 16}, initializer_range=0.3)
    target = GemmaForCausalLM(config).eval()
    tokenizer = tiny_tokenizer()
    target.resize_token_embeddings(len(tokenizer))
    assert not supports_lean_forward(target)
    prompts = ["abc abc abc", "the cat sat on the mat", "a"]
    reference = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
        reference.append(out[0, ids.shape[1]:].tolist())
    for speculative in ({"method": "none"}, {"method": "ngram", "num_candidates": 2, "length_policy": "static"}):
        engine_config = Config.model_validate({"model": "in-memory", "batch_size": 2, "speculative": speculative,
                                               "sampling": {"max_tokens": 12}})
        engine = Engine(engine_config, target=target, tokenizer=tokenizer)
        assert not isinstance(engine.target, LeanCausalLM)
        results = engine.generate([Request(id=str(i), prompt=p) for i, p in enumerate(prompts)])
        assert [r.token_ids for r in results] == reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_computes_what_the_reference_computes(dtype) -> None:
    """Random rows of random trees (padding queries, chains, several mask words, grouped-query heads) over a
    shuffled pool, prefills (a causal triangle of tree bits over three words): the kernel's outputs and the entries
    it writes equal the reference's."""
    if not cpu_kernel():
        pytest.skip("no C++ compiler: the reference runs instead of the kernel")
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block = 6, 2, 32, 16
    for tokens_per_row, words in ((1, 1), (6, 1), (70, 2), (20, 1), (150, 3)):
        rows = 5
        lengths = torch.randint(0, 90, (rows,), generator=generator)
        blocks = -(-(lengths + tokens_per_row) // block)
        pool = int(blocks.sum()) + 3
        order = torch.randperm(pool, generator=generator)
        tables = torch.zeros(rows, int(blocks.max()), dtype=torch.int32)
        at = 0
        for r in range(rows):
            tables[r, : blocks[r]] = order[at : at + blocks[r]].int()
            at += int(blocks[r])
        n = rows * tokens_per_row
        position = lengths.repeat_interleave(tokens_per_row) + torch.arange(tokens_per_row).repeat(rows)
        row_of = torch.arange(rows).repeat_interleave(tokens_per_row)
        slots = tables[row_of, position // block].long() * block + position % block
        prefix = lengths.repeat_interleave(tokens_per_row).int()
        # Tree bits: a random subset of the row's tentative positions, always the query's own.
        bits = (torch.rand(n, tokens_per_row, generator=generator) < 0.5) | (
            torch.arange(tokens_per_row)[None] == torch.arange(tokens_per_row).repeat(rows)[:, None])
        if tokens_per_row == 150:  # a prefill: each query sees the cached prefix and the tree keys up to its own
            bits = torch.arange(tokens_per_row)[None] <= torch.arange(tokens_per_row).repeat(rows)[:, None]
        mask = torch.zeros(n, words, dtype=torch.int64)
        for word in range(words):
            chunk = bits[:, 64 * word : 64 * (word + 1)].long()
            mask[:, word] = (chunk << torch.arange(chunk.shape[1])).sum(1)
        if tokens_per_row == 20:  # chains: each query sees what comes before it, no tree bits
            prefix, mask = (position + 1).int(), torch.zeros(n, words, dtype=torch.int64)
        meta = AttentionMetadata(slots, tables, torch.arange(0, n + 1, tokens_per_row, dtype=torch.int32), prefix,
                                 mask, max_keys=int(lengths.max()) + tokens_per_row)
        q = torch.randn(n, heads, dim, generator=generator).to(dtype)
        k, v = (torch.randn(n, kv_heads, dim, generator=generator).to(dtype) for _ in range(2))
        keys = torch.randn(pool, kv_heads, dim, block, generator=generator).to(dtype)
        values = torch.randn(pool, kv_heads, block, dim, generator=generator).to(dtype)
        ref_keys, ref_values = keys.clone(), values.clone()
        reference = reference_attention(ref_keys, ref_values, q, k, v, meta, dim**-0.5)
        ours = torch.ops.specbatch.paged_attention(keys, values, q, k, v, meta.slots, meta.block_tables,
                                                   meta.row_starts, meta.prefix_len, meta.tree_mask, dim**-0.5)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(ours, reference, atol=tolerance, rtol=tolerance)
        assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)


def test_the_compiled_stack_computes_what_the_eager_stack_computes(monkeypatch, tmp_path, caplog) -> None:
    """The layer stack compiled ahead of time (a float model, an int4 twin and a twin multiplying GGUF blocks, each
    calling the C++ kernels through their C entry points), for several batch shapes from one package, loaded without
    leaving its extracted files behind; a stack that cannot compile runs eagerly, with a warning."""
    if not cpu_kernel():
        pytest.skip("no C++ compiler")
    from decoding.model import compiled_forward

    # The product's cache, as the product uses it: compiled once per machine and code version, then loaded.
    monkeypatch.delenv("SPECBATCH_COMPILE")  # the tests' eager default: each execution says here
    monkeypatch.setattr(compiled_forward, "_loaded", {})  # each package loaded here, from the cache or compiled
    temp = tmp_path / "tmp"  # where torch would extract each loaded package, and leave it
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    cpu = torch.device("cpu")
    eager_mode = Execution.resolve(ExecutionConfig(compile="off"), cpu)
    compiled_mode = Execution.resolve(ExecutionConfig(), cpu)
    assert compiled_mode.compile and not eager_mode.compile
    target = tiny_model()
    int4 = quantized(target, "int4", head=None)  # the eager head: compared without its rounding
    for model in (target, int4, gguf_pair(target, tmp_path / "tiny.gguf")[1]):
        eager, compiled = LeanCausalLM(model), LeanCausalLM(model)
        eager.prepare(eager_mode)
        compiled.prepare(compiled_mode)
        assert compiled.compiled() is not None
        tolerance = 0.05 if model is int4 else 1e-5
        for (logits, hidden), (c_logits, c_hidden) in zip(_tree_forwards(eager, model.config, eager_mode),
                                                          _tree_forwards(compiled, model.config, compiled_mode)):
            torch.testing.assert_close(c_logits, logits, atol=tolerance, rtol=tolerance)
            torch.testing.assert_close(c_hidden, hidden, atol=tolerance, rtol=tolerance)
    assert len(compiled_forward._loaded) == 3 and not list(temp.glob("aotinductor*"))
    for key in compiled_forward._loaded:  # every kernel call through its C entry point, none boxed
        with zipfile.ZipFile(cache_dir() / "compiled" / key / "stack.pt2") as package:
            wrapper = b"".join(package.read(name) for name in package.namelist() if name.endswith("wrapper.cpp"))
        assert wrapper.count(b"aoti_torch_cpu_paged_attention(") > 1  # declared, and called
        assert b"proxy_executor_call_function(" not in wrapper

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(compiled_forward, "_loaded", {})
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiler)
    fallback = LeanCausalLM(target)
    with caplog.at_level("WARNING"):
        assert fallback.compiled() is None
    assert "no C++ compiler found" in caplog.text
    logits, _ = _tree_forwards(fallback, target.config, compiled_mode)[1]
    assert torch.isfinite(logits).all()


def _prefilled(blocks: int, positions: int) -> tuple[LeanCausalLM, PagedKVCache, slice, torch.Tensor]:
    """A tiny model's lean forward and a cache of 64 positions a row holding three rows of a 6-token prompt each
    (``positions`` reserved per row)."""
    lean = lean_view(tiny_model())
    cache = PagedKVCache(CacheShape.of(lean.config), blocks, 3, 64)
    rows = cache.add_rows([positions] * 3)
    prompts = torch.randint(3, 30, (3, 6), generator=torch.Generator().manual_seed(0))
    forward_tree(lean, cache, rows, prompts, chain_ancestors(6), torch.ones(3, 6, dtype=torch.bool))
    cache.advance(rows, [6, 6, 6])
    return lean, cache, rows, prompts


def test_rows_padded_for_a_cuda_graph_compute_what_the_real_rows_compute() -> None:
    """A CUDA graph runs a bucket of rows: the padding rows write the scratch block and see one position, and
    the real rows' logits and hidden states are those of the unpadded forward (checked on the eager forward, on
    whatever device this machine has)."""
    from decoding.model.attention import dense_layout
    from decoding.model.cuda_graphs import key_bucket, pad_rows_to, row_bucket

    assert [row_bucket(n) for n in (1, 2, 3, 5, 9, 64, 65)] == [1, 2, 4, 8, 16, 64, 128]
    assert key_bucket(10, 4096) == 256 and key_bucket(300, 4096) == 512 and key_bucket(300, 400) == 400
    lean, cache, rows, _ = _prefilled(16, 40)
    topology = TreeTopology(num_candidates=2, max_depth=2)
    tokens = torch.randint(3, 30, (3, topology.size(2)), generator=torch.Generator().manual_seed(1))
    valid = torch.ones_like(tokens, dtype=torch.bool)
    meta, positions = cache.tree_metadata(rows, topology.ancestors, valid, 0, topology.size(2))
    nodes = torch.arange(topology.size(2))
    cache.keys[:, 0] = 7.0  # a padding row's token (id 0, the padding embedding) may write zeros: not what is there
    scratch = cache.keys[:, 0].clone()
    expected = lean(tokens, positions, meta, cache.keys, cache.values, nodes, nodes, execution=cache.execution)
    keys = key_bucket(meta.max_keys, 64)  # past the rows' tables: the graph's tables are padded with scratch
    padded = pad_rows_to(4, tokens, positions, meta, nodes, nodes, table_blocks=keys // cache.block_size)
    assert padded.block_tables.shape == (4, keys // cache.block_size) > meta.block_tables.shape
    logits, hidden = lean.flat_forward(
        padded.input_ids, padded.positions,
        AttentionMetadata(padded.slots, padded.block_tables, padded.row_starts, padded.prefix_len, padded.tree_mask,
                          keys), cache.keys, cache.values, padded.logits_at, padded.hidden_at,
        execution=cache.execution)
    real = 3 * topology.size(2)
    torch.testing.assert_close(logits[:real], expected[0])
    torch.testing.assert_close(hidden[:real], expected[1])
    assert torch.isfinite(logits).all()
    assert not torch.equal(cache.keys[:, 0], scratch)  # the padding row wrote the scratch block, nothing else
    # The reference attention gathers keys past a row's table from the scratch block (masked), not a shorter batch.
    narrow = AttentionMetadata(meta.slots, meta.block_tables[:, :1], meta.row_starts, meta.prefix_len, meta.tree_mask,
                               keys)
    layout = dense_layout(narrow, cache.block_size, zero_filled=False)
    assert layout.blocks.shape[1] * cache.block_size >= keys and layout.allowed.shape[-1] == keys


def _graph_case(cache: PagedKVCache, rows, depth: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A verification forward's inputs over ``rows`` of ``cache``: a width-2 tree of ``depth``."""
    topology = TreeTopology(num_candidates=2, max_depth=depth)
    count = len(range(rows.start, rows.stop))
    tokens = torch.randint(3, 30, (count, topology.size(depth)), generator=torch.Generator().manual_seed(seed))
    meta, positions = cache.tree_metadata(rows, topology.ancestors, torch.ones_like(tokens, dtype=torch.bool), 0,
                                          topology.size(depth))
    return tokens, positions, meta, torch.arange(topology.size(depth))


def _second_pool(lean, prompts: torch.Tensor, seed: int) -> tuple[PagedKVCache, tuple[torch.Tensor, ...]]:
    """Another pool (as a cost calibration's scratch pool is) with one row of 6 prefilled tokens, and a
    verification's inputs over it (``_graph_case``, depth 1)."""
    pool = PagedKVCache(CacheShape.of(lean.config), 8, 1, 64)
    rows = pool.add_rows([20])
    forward_tree(lean, pool, rows, prompts[:1], chain_ancestors(6), torch.ones(1, 6, dtype=torch.bool))
    pool.advance(rows, [6])
    return pool, _graph_case(pool, rows, 1, seed=seed)


def test_graphed_forward_replays_what_the_eager_forward_computes_with_fresh_inputs_each_call() -> None:
    """The graph machinery (persistent buffers, padded rows, one graph per shape) with the eager stand-in
    recorder: every replay computes the eager forward of its own inputs, a shape met again reuses its graph."""
    from decoding.model.cuda_graphs import GraphedForward, record_eagerly

    lean, cache, rows, prompts = _prefilled(24, 60)
    graphed = GraphedForward(functools.partial(lean.flat_forward, execution=cache.execution), 64, record=record_eagerly)
    for call, (batch, depth) in enumerate([(3, 2), (3, 2), (2, 1), (3, 2), (1, 2)]):
        tokens, positions, meta, nodes = _graph_case(cache, slice(0, batch), depth, seed=call)
        expected = lean(tokens, positions, meta, cache.keys, cache.values, nodes, nodes, execution=cache.execution)
        logits, hidden = graphed(tokens, positions, meta, cache.keys, cache.values, nodes, nodes)
        torch.testing.assert_close(logits, expected[0])
        torch.testing.assert_close(hidden, expected[1])
    # (3 rows -> bucket 4, depth 2), (2 rows, depth 1), (1 row, depth 2): three shapes for five calls.
    assert sorted((shape.rows, shape.per_row) for shape in graphed.graphs) == [(1, 5), (2, 3), (4, 5)]


def test_a_graph_replays_the_largest_tree_the_engine_builds_on_cuda() -> None:
    """Batch 1's recycling tree on CUDA (256 nodes under the pending token, a lookup sibling at every level: 262
    nodes, five mask words), through the graph machinery with the eager stand-in recorder, as the eager forward."""
    from decoding.drafting.recycle import recycling_tree, recycling_tree_nodes
    from decoding.model.cuda_graphs import GraphedForward, record_eagerly

    depth = 5
    tree, order = recycling_tree(8, depth, recycling_tree_nodes(torch.device("cuda"), 1, depth))
    topology = TreeTopology(1, depth, 1, tree, order)
    nodes = topology.size(depth)
    lean = lean_view(tiny_model())
    positions = 6 + nodes
    cache = PagedKVCache(CacheShape.of(lean.config), -(-positions // 16) + 1, 1, positions)
    rows = cache.add_rows([positions])
    prompt = torch.randint(3, 30, (1, 6), generator=torch.Generator().manual_seed(0))
    forward_tree(lean, cache, rows, prompt, chain_ancestors(6), torch.ones(1, 6, dtype=torch.bool))
    cache.advance(rows, [6])
    tokens = torch.randint(3, 30, (1, nodes), generator=torch.Generator().manual_seed(1))
    meta, at = cache.tree_metadata(rows, topology.ancestors, torch.ones_like(tokens, dtype=torch.bool), 0, nodes)
    assert meta.tree_mask.shape[1] == -(-nodes // 64) == 5
    every = torch.arange(nodes)
    expected = lean(tokens, at, meta, cache.keys, cache.values, every, every, execution=cache.execution)
    graphed = GraphedForward(functools.partial(lean.flat_forward, execution=cache.execution), positions,
                             record=record_eagerly)
    logits, hidden = graphed(tokens, at, meta, cache.keys, cache.values, every, every)
    torch.testing.assert_close(logits, expected[0])
    torch.testing.assert_close(hidden, expected[1])
    assert [(shape.rows, shape.per_row) for shape in graphed.graphs] == [(1, nodes)]


def test_graphs_captured_at_build_follow_the_plan_and_budget_then_uncaptured_shapes_run_eagerly(caplog) -> None:
    from decoding.model.cuda_graphs import (
        GraphedForward,
        build_shapes,
        key_buckets,
        pool_key,
        record_eagerly,
        row_bucket,
        tree_words,
    )

    assert key_buckets(64) == [64] and key_buckets(1000) == [256, 512, 1000]
    assert key_buckets(8224) == [256, 512, 1024, 2048, 4096, 8192, 8224]
    assert tree_words(1) == tree_words(65) == 1 and tree_words(66) == 2
    plan = build_shapes(7, 5, 1000, [3, 1, 3], hidden=False)
    assert len(plan) == 3 * 2 * 4  # key buckets x tokens per row x row buckets 1, 2, 4, 8
    assert [(s.keys, s.per_row, s.rows) for s in plan[:5]] == [(256, 1, 1), (256, 1, 2), (256, 1, 4), (256, 1, 8),
                                                               (256, 3, 1)]
    assert {(s.cache, s.words, s.logits_per_row == s.per_row, s.hidden_per_row) for s in plan} == {(7, 1, True, 0)}
    assert {s.hidden_per_row for s in build_shapes(7, 1, 64, [1, 3], hidden=True)} == {1, 3}

    lean, cache, rows, prompts = _prefilled(24, 60)
    sizes = [1, TreeTopology(2, 1).size(1), TreeTopology(2, 2).size(2)]
    shapes = build_shapes(pool_key(cache.keys), 3, 64, sizes, hidden=True)
    assert len(shapes) == 3 * 3  # one key bucket (64 positions a row), rows 1, 2, 4
    graphed = GraphedForward(functools.partial(lean.flat_forward, execution=cache.execution), 64, record=record_eagerly)
    # A stand-in for the device's memory: 100 MiB each.
    with caplog.at_level("INFO", logger="decoding.model.cuda_graphs"):
        captured = graphed.capture(shapes, cache.keys, cache.values, budget=500 << 20,
                                   memory=lambda: len(graphed.graphs) * (100 << 20))
    assert captured == 5 and list(graphed.graphs) == shapes[:5]  # the budget stops it after the fifth
    assert "captured 5/9 CUDA graphs" in caplog.text and "budget (500 MiB) reached after 5 of 9" in caplog.text
    # Captured shapes replay what the eager forward computes; the rest of the plan runs eagerly (None).
    for batch, depth, replayed in [(3, 0, True), (1, 1, True), (2, 1, True), (3, 1, False), (1, 2, False)]:
        if depth:
            tokens, positions, meta, nodes = _graph_case(cache, slice(0, batch), depth, seed=batch)
        else:
            tokens = torch.randint(3, 30, (batch, 1), generator=torch.Generator().manual_seed(5))
            meta, positions = cache.tree_metadata(slice(0, batch), chain_ancestors(1),
                                                  torch.ones(batch, 1, dtype=torch.bool), 0, 1)
            nodes = torch.arange(1)
        assert (row_bucket(batch), tokens.shape[1]) in {(s.rows, s.per_row) for s in shapes}
        out = graphed(tokens, positions, meta, cache.keys, cache.values, nodes, nodes)
        assert (out is not None) == replayed
        if replayed:
            expected = lean(tokens, positions, meta, cache.keys, cache.values, nodes, nodes, execution=cache.execution)
            torch.testing.assert_close(out[0], expected[0])
            torch.testing.assert_close(out[1], expected[1])
    assert len(graphed.graphs) == 5  # nothing captured mid-run over the frozen pool
    # Another pool (a cost calibration's) is still captured when first met.
    other, (tokens, positions, meta, nodes) = _second_pool(lean, prompts, seed=9)
    assert graphed(tokens, positions, meta, other.keys, other.values, nodes, nodes) is not None
    assert len(graphed.graphs) == 6


def _capturing(builder: build._Builder, target: torch.nn.Module) -> Execution:
    """The execution of an engine that captures graphs at build (a CUDA engine's), for this CPU's forwards."""
    return dataclasses.replace(Execution.resolve(builder.config.execution, builder.device), graphs=True)


def _capture_at_build(monkeypatch) -> None:
    """Engines built from here on capture graphs at build as a CUDA engine does, with the eager stand-in recorder
    and no device memory to count."""
    from decoding.model import cuda_graphs
    from decoding.model.cuda_graphs import record_eagerly

    defaults = cuda_graphs.GraphedForward.__init__.__defaults__  # (record, key_buckets, adapters)
    monkeypatch.setattr(cuda_graphs.GraphedForward.__init__, "__defaults__", (record_eagerly, *defaults[1:]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(build._Builder, "execution", _capturing)


def _record_calibrations(monkeypatch) -> list[tuple[torch.nn.Module, bool]]:
    """The (model, captured) of every cost calibration engines built from here on ask for, each answered at once."""
    calibrated: list[tuple[torch.nn.Module, bool]] = []
    costs = BatchCosts(one_row=CostTable([(1, 0.01), (8, 0.012)]), full=CostTable([(1, 0.02), (8, 0.03)]),
                       full_rows=2)
    monkeypatch.setattr(build, "calibrate_batch", lambda model, *args, captured=False, **kwargs: (
        calibrated.append((model, captured)) or costs))
    return calibrated


def test_an_engine_capturing_at_build_plans_its_shapes_and_verifies_whole_trees(tokenizer, target, monkeypatch
                                                                                 ) -> None:
    """With graphs captured at build (mode ``all``): the engine plans the target's decode and whole-tree
    verification shapes for its rows and cache and captures them (the eager stand-in recorder here), and
    verifications carry whole trees, a host draft's dead nodes as padding queries rather than pruned (only whole
    trees are captured), emitting the tokens the pruned forwards emit."""
    from decoding.model.cuda_graphs import key_buckets, pool_key
    from decoding.model.model_runner import ModelRunner

    config = Config.model_validate({
        "model": "in-memory", "batch_size": 3, "sampling": {"max_tokens": 16},
        "speculative": {"method": "ngram", "num_candidates": 2, "num_speculative_tokens": 3,
                        "length_policy": "static"}})
    requests = [Request(id=str(i), prompt_token_ids=p) for i, p in enumerate(
        [[3, 4, 5, 3, 4, 5, 3], [5, 4, 3, 5, 1, 4, 3], [7, 8, 9, 10, 7, 8]])]
    widths: list[int] = []
    forward = ModelRunner.verify

    def recording(runner, rows, input_ids, *args, **kwargs):  # the target's verifications (an n-gram draft has none)
        widths.append(input_ids.shape[1])
        return forward(runner, rows, input_ids, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "verify", recording)
    expected = [r.token_ids for r in Engine(config, target=target, tokenizer=tokenizer).generate(requests)]
    assert set(widths) - {1, 3, 5, 7}, widths  # pruned: dead nodes left out of some forwards

    _capture_at_build(monkeypatch)  # a CUDA engine's choice, on this CPU
    engine = Engine(config, target=target, tokenizer=tokenizer)
    positions = engine.cache.max_positions_per_row
    sizes = [1, *(engine.topology.size(depth) for depth in range(1, 4))]  # size(0) is 1: one root
    graphs = engine.stepper.runner.graphs
    assert sorted((s.keys, s.per_row, s.rows) for s in graphs.graphs) == sorted(
        (keys, per_row, rows) for keys in key_buckets(positions) for per_row in sizes for rows in (1, 2, 4))
    assert graphs.frozen == {pool_key(engine.cache.keys)}
    assert engine.stepper.runner.replays  # the engine's choice where it captures at build
    widths.clear()
    assert [r.token_ids for r in engine.generate(requests)] == expected
    assert set(widths) <= set(sizes) and max(widths) == sizes[-1]


def test_a_self_draft_captures_its_levels_at_build_beside_the_target(tokenizer, target, monkeypatch) -> None:
    """Mode ``all``: the self-draft's levels (one token per row in the default chain) are captured at build for
    every row and key bucket beside the target's shapes, over the same pool, and its cost calibration times them as
    they will run; other drafters and modes leave draft levels eager."""
    from decoding.model.cuda_graphs import key_buckets, pool_key

    config = Config.model_validate({"model": "in-memory", "batch_size": 2, "sampling": {"max_tokens": 8}})
    assert not Engine(config, target=target, tokenizer=tokenizer).drafter.runner.replays  # no graphs: eager levels
    lean = lean_view(target)
    _capture_at_build(monkeypatch)
    calibrated = _record_calibrations(monkeypatch)
    engine = Engine(config, target=target, tokenizer=tokenizer)
    draft = engine.drafter.model
    assert engine.drafter.runner.replays and isinstance(draft, LeanCausalLM) and draft is not lean
    assert calibrated == [(lean, True), (draft, True)]
    positions = engine.cache.max_positions_per_row
    pool = pool_key(engine.cache.keys)
    draft_graphs, target_graphs = engine.drafter.runner.graphs, engine.stepper.runner.graphs
    assert sorted((s.keys, s.per_row, s.rows, s.cache) for s in draft_graphs.graphs) == sorted(
        (keys, 1, rows, pool) for keys in key_buckets(positions) for rows in (1, 2))
    assert draft_graphs.frozen == target_graphs.frozen == {pool}
    assert {s.per_row for s in target_graphs.graphs} == {1, *(engine.topology.size(d) for d in range(1, 6))}
    results = engine.generate([Request(id="0", prompt_token_ids=[3, 4, 5, 3, 4, 5, 3])])
    assert results[0].error is None and results[0].token_ids


def test_every_layer_set_of_auto_captures_its_levels_at_build(tokenizer, monkeypatch) -> None:
    """Mode ``all`` with ``layer_skip: auto``: each candidate layer set's levels are captured at build over the
    target's pool and calibrated as they will run, and the engine, switching sets, decodes what plain decoding
    does."""
    from decoding.drafting import layer_skip
    from decoding.model.cuda_graphs import pool_key

    deep = tiny_model(seed=11, layers=6)
    requests = [Request(id=str(i), prompt=p) for i, p in enumerate(PROMPTS)]
    plain = Config.model_validate({"model": "in-memory", "batch_size": 2, "sampling": {"max_tokens": 24},
                                   "speculative": {"method": "none"}})
    expected = [r.token_ids for r in Engine(plain, target=deep, tokenizer=tokenizer).generate(requests)]
    monkeypatch.setattr(layer_skip, "TRIAL_STEPS", 2)
    _capture_at_build(monkeypatch)
    calibrated = _record_calibrations(monkeypatch)
    config = Config.model_validate({"model": "in-memory", "batch_size": 2, "sampling": {"max_tokens": 24},
                                    "speculative": {"layer_skip": "auto", "length_policy": "static",
                                                    "num_speculative_tokens": 3}})
    engine = Engine(config, target=deep, tokenizer=tokenizer)
    views = engine.drafter.search.views
    assert len(views) == 3 and all((view, True) in calibrated for view in views)
    pool = pool_key(engine.cache.keys)
    assert len(engine.drafter.runners) == 3
    for runner in engine.drafter.runners:  # the whole int4 draft and two sets skipping layers, each its own graphs
        assert {s.cache for s in runner.graphs.graphs} == {pool}
        assert {s.rows for s in runner.graphs.graphs} == {1, 2}
    assert [r.token_ids for r in engine.generate(requests)] == expected
    assert engine.drafter.search.candidates[1].steps > 0  # a set skipping layers drafted


def test_prepacked_inference_model_matches_and_leaves_the_original(target, monkeypatch) -> None:
    assert packs(torch.zeros(576, 576)) and not packs(torch.zeros(192, 64))  # a small weight's GEMM stays dense
    monkeypatch.setattr(attention, "PACK_MIN_WEIGHTS", 0)  # the tiny model's weights are all small
    monkeypatch.setattr(models, "_inference_views", weakref.WeakKeyDictionary())
    fast = for_inference(target)
    ids = torch.randint(3, target.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, target(ids).logits, rtol=1e-5, atol=1e-5)

    def prepacked(model: torch.nn.Module) -> list[bool]:
        return ["forward" in vars(m) for m in model.modules() if isinstance(m, torch.nn.Linear)]

    assert prepacked(fast) and all(prepacked(fast))
    assert not any(prepacked(target))  # the caller's modules run as before
    assert all(a is b for a, b in zip(fast.parameters(), target.parameters()))  # weights shared, not copied


@pytest.mark.parametrize("rows_count", [2, 1])  # one row of up to 8 queries: SDPA's own grouped-query path
def test_every_forward_computes_the_same_on_trees(target, rows_count) -> None:
    """transformers' forward through the cache adapter, the prepacked grouped-query inference view, and the lean
    forward over the paged cache agree on a ragged prefill and a verification tree (a shallower row included)."""
    fast = for_inference(target)
    assert target.config.num_attention_heads > target.config.num_key_value_heads  # the tiny model uses GQA
    assert fast.config._attn_implementation != target.config._attn_implementation == "sdpa"
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, target.config.vocab_size, (2, 9), generator=generator)
    prompt_valid = torch.arange(9)[None] < torch.tensor([[9], [6]])  # ragged rows
    topology = TreeTopology(num_candidates=2, max_depth=3, root_width=2)
    tree = torch.randint(3, target.config.vocab_size, (2, topology.size(3)), generator=generator)
    tree_valid = torch.ones_like(tree, dtype=torch.bool)
    tree_valid[1, -2:] = False  # a row with a shallower tree
    prompts, prompt_valid, tree, tree_valid = (t[:rows_count] for t in (prompts, prompt_valid, tree, tree_valid))
    assert tree.shape[1] == 8
    logits = []
    for model in (target, fast, lean_view(target)):
        cache = PagedKVCache(CacheShape.of(target.config), 8, 2, 64, block_size=16)
        rows = cache.add_rows([32] * rows_count)
        prefill, _ = forward_tree(model, cache, rows, prompts, chain_ancestors(9), prompt_valid)
        cache.advance(rows, prompt_valid.sum(1).tolist())
        verify, _ = forward_tree(model, cache, rows, tree, topology.sliced_ancestors(3), tree_valid)
        logits.append((prefill[prompt_valid], verify[tree_valid]))
    for reference, other in zip(logits[0], logits[1]):
        torch.testing.assert_close(other, reference, rtol=1e-5, atol=1e-5)
    for reference, other in zip(logits[0], logits[2]):
        torch.testing.assert_close(other, reference, rtol=1e-5, atol=1e-5)


def test_reference_attention_zeroes_unwritten_positions_unless_the_pool_is_zero_filled() -> None:
    """A pool off the CPU is zero-filled when allocated, and the reference attention then skips zeroing the
    positions no query of a row sees; in a pool that is not (torch.empty), such a position may hold a NaN, which a
    masked weight would still spread: the zeroing is what keeps the output finite there."""
    from decoding.model.attention import dense_layout

    generator = torch.Generator().manual_seed(0)
    block, kv_heads, heads, dim = 16, 2, 4, 8
    lengths = [5, 40]
    tables = torch.tensor([[1, 0, 0], [2, 3, 4]], dtype=torch.int32)  # row 0's later columns: the scratch block
    slots = torch.tensor([1 * block + 5, 4 * block + 8])  # each row's next position
    meta = AttentionMetadata(slots, tables, torch.tensor([0, 1, 2], dtype=torch.int32),
                             torch.tensor(lengths, dtype=torch.int32), torch.ones(2, 1, dtype=torch.int64), 41)
    pools = {name: (torch.full((5, kv_heads, dim, block), fill), torch.full((5, kv_heads, block, dim), fill))
             for name, fill in (("empty", float("nan")), ("zeros", 0.0))}
    for row, length in enumerate(lengths):  # the written positions: the same values in both pools
        for position in range(length):
            physical, offset = int(tables[row, position // block]), position % block
            key, value = (torch.randn(kv_heads, dim, generator=generator) for _ in range(2))
            for keys, values in pools.values():
                keys[physical, :, :, offset], values[physical, :, offset] = key, value
    q = torch.randn(2, heads, dim, generator=generator)
    k, v = torch.randn(2, kv_heads, dim, generator=generator), torch.randn(2, kv_heads, dim, generator=generator)

    def attend(pool: str, zero_filled: bool) -> torch.Tensor:
        keys, values = (t.clone() for t in pools[pool])
        return reference_attention(keys, values, q, k, v, meta, dim**-0.5, dense_layout(meta, block, zero_filled))

    zeroed, zero_filled = attend("empty", False), attend("zeros", True)
    torch.testing.assert_close(zeroed, zero_filled)
    assert torch.isfinite(zeroed).all()
    assert not torch.isfinite(attend("empty", True)).all()  # an unfilled pool does need the zeroing


def test_graphs_over_a_freed_pool_go_at_the_next_call_never_in_its_finalizer() -> None:
    """A graph is keyed by its pool object (never only its address) and dropped when the pool is freed: at the
    next capture or replay, not in the pool's finalizer, which a collection can run in the middle of a capture."""
    import gc

    from decoding.model.cuda_graphs import GraphedForward, pool_key

    def record_once(run, pool):  # holds no reference to the pool, as a CUDA graph holds none (replays: no-ops)
        return run(), lambda: None

    lean, cache, rows, prompts = _prefilled(24, 60)
    graphed = GraphedForward(functools.partial(lean.flat_forward, execution=cache.execution), 64, record=record_once)
    scratch, (tokens, positions, meta, nodes) = _second_pool(lean, prompts, seed=3)
    assert graphed(tokens, positions, meta, scratch.keys, scratch.values, nodes, nodes) is not None
    scratch_key = pool_key(scratch.keys)
    assert {shape.cache for shape in graphed.graphs} == {scratch_key}
    del scratch, tokens, positions, meta
    gc.collect()
    assert {shape.cache for shape in graphed.graphs} == {scratch_key}  # the finalizer only noted it
    tokens, positions, meta, nodes = _graph_case(cache, rows, 1, seed=4)
    assert graphed(tokens, positions, meta, cache.keys, cache.values, nodes, nodes) is not None
    assert {shape.cache for shape in graphed.graphs} == {pool_key(cache.keys)} != {scratch_key}


def test_a_cpu_engine_keeps_freed_heap_memory_where_the_c_library_is_glibc() -> None:
    """Freed temporaries stay in the heap for the next forward (``execution.keep_freed_heap_memory``)."""
    import platform

    from decoding.model.execution import keep_freed_heap_memory

    Execution.resolve(ExecutionConfig(), torch.device("cpu"), quiet=True)
    assert keep_freed_heap_memory() == (platform.libc_ver()[0] == "glibc")
