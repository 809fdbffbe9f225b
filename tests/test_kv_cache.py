"""The paged KV cache: blocks by use, admission by free blocks, the accepted path's commit, and the attention
metadata a tree forward is described by."""

from __future__ import annotations

import torch
from tiny import tiny_model, tiny_tokenizer

from decoding import Config, Engine, Request
from decoding.model.attention import visibility
from decoding.model.kv_cache import CacheShape, PagedKVCache
from decoding.verification.tree import TreeTopology, chain_ancestors, with_prefix_chain

SHAPE = CacheShape(num_layers=2, kv_heads=1, head_dim=16)


def test_blocks_are_handed_out_as_rows_grow_and_return_when_they_leave() -> None:
    cache = PagedKVCache(SHAPE, num_blocks=10, max_rows=3, max_positions=64, block_size=16)
    assert cache.can_admit(64) and not cache.can_admit(161)
    rows = cache.add_rows([40, 30])  # promised 3 + 2 blocks, none handed out yet
    assert cache.blocks_in_use == 0 and cache.blocks_promised == 5
    assert cache.can_admit(80) and not cache.can_admit(81)  # 5 blocks left to promise
    cache.ensure(rows, [17, 1])
    assert cache.blocks_in_use == 3 and cache.blocks_promised == 5
    assert cache.row_blocks[0] == [1, 2] and cache.row_blocks[1] == [3]  # lowest first; block 0 is scratch
    cache.remove_row(0)  # row 1 moves into row 0: its table, not its entries
    assert cache.active == 1 and cache.row_blocks[0] == [3] and cache.tables[0, 0] == 3
    assert cache.blocks_in_use == 1 and cache.blocks_promised == 2
    cache.remove_row(0)
    assert cache.blocks_in_use == 0 and cache.blocks_promised == 0 and cache.peak_blocks == 3


def test_commit_moves_accepted_entries_and_leaves_an_in_place_path_alone() -> None:
    """A row keeps the tentative entries at its accepted nodes right after its committed ones; a path already in
    that order (a chain's accepted prefix) moves nothing."""
    cache = PagedKVCache(CacheShape(1, 1, 16), num_blocks=4, max_rows=2, max_positions=32, block_size=16)
    rows = cache.add_rows([16, 16])
    cache.ensure(rows, [16, 16])
    cache.keys.zero_(), cache.values.zero_()  # the pools are allocated uninitialized: NaNs would fail torch.equal
    for row, offset in ((0, 0.0), (1, 100.0)):
        block = cache.row_blocks[row][0]
        cache.keys[0, block, 0, :, :] = (torch.arange(16.0) + offset)[None]
        cache.values[0, block, 0, :, :] = (torch.arange(16.0) + offset)[:, None]
    before, version = cache.keys.clone(), cache.keys._version
    cache.commit(rows, torch.tensor([[0, 1, 2], [0, 1, 0]]), [3, 2])  # in place: nothing moves
    assert torch.equal(cache.keys, before) and cache.keys._version == version and cache.host_lengths[:2] == [3, 2]
    cache.commit(rows, torch.tensor([[0, 2], [1, 0]]), [2, 1])  # row 0 keeps nodes 0, 2 (positions 3, 5)
    row0, row1 = cache.row_blocks[0][0], cache.row_blocks[1][0]
    assert cache.keys[0, row0, 0, 0, :5].tolist() == [0, 1, 2, 3, 5]
    assert cache.keys[0, row1, 0, 0, :3].tolist() == [100, 101, 103]
    assert cache.values[0, row0, 0, :5, 0].tolist() == [0, 1, 2, 3, 5] and cache.host_lengths[:2] == [5, 3]


def _expected_visibility(ancestors, valid, lengths, start, end, keys) -> torch.Tensor:
    """Query (b, n) of nodes [start, end) sees its row's committed positions and its valid ancestors' positions;
    a padding query sees the row's first position only."""
    rows = []
    for b, length in enumerate(lengths):
        for n in range(start, end):
            seen = torch.zeros(keys, dtype=torch.bool)
            if valid[b, n]:
                seen[:length] = True
                for m in range(end):
                    if ancestors[n, m] and valid[b, m]:
                        seen[length + m] = True
            else:
                seen[0] = True
            rows.append(seen)
    return torch.stack(rows)


def test_tree_metadata_describes_each_query_s_keys_and_slots() -> None:
    topology = TreeTopology(num_candidates=3, max_depth=3, root_width=1)
    cases = [  # (ancestors, start, end)
        (chain_ancestors(9), 0, 9),  # a prefill
        (chain_ancestors(1), 0, 1),  # a decode step
        (topology.sliced_ancestors(3), 0, topology.size(3)),  # a verification
        (topology.sliced_ancestors(3), topology.size(1), topology.size(2)),  # a draft level
        (with_prefix_chain(topology.sliced_ancestors(2), 2), 2, 2 + topology.size(2)),  # after catch-up tokens
        (TreeTopology(16, 5, 1).ancestors, 0, 81),  # more than 64 tree nodes: several mask words
        # A row with fewer catch-up tokens than the prefix holds before a chain: its first prefix nodes are
        # padding, so its real queries miss ancestors the tree gives them and see the rest as tree bits.
        (with_prefix_chain(TreeTopology(1, 3, 1).sliced_ancestors(3), 3), 3, 7),
    ]
    generator = torch.Generator().manual_seed(0)
    for case, (ancestors, start, end) in enumerate(cases):
        cache = PagedKVCache(SHAPE, num_blocks=64, max_rows=3, max_positions=160, block_size=16)
        rows = cache.add_rows([150, 150, 150])
        cache.advance(rows, [0, 17, 33])
        valid = torch.rand(3, end, generator=generator) < 0.8
        valid[:, 0] = True
        valid &= (ancestors[:end, :end] <= valid[:, None, :end]).all(-1)  # a node's ancestors are valid
        if case == len(cases) - 1:
            valid[1, :2] = False
        meta, positions = cache.tree_metadata(rows, ancestors, valid, start, end)
        keys = meta.max_keys
        assert keys == 33 + end
        expected = _expected_visibility(ancestors, valid, [0, 17, 33], start, end, keys)
        assert torch.equal(visibility(meta, keys), expected)
        for b, length in enumerate([0, 17, 33]):
            for index, n in enumerate(range(start, end)):
                slot = meta.slots[b * (end - start) + index].item()
                assert slot == cache.slot_of(b, length + n)
                if valid[b, n]:
                    assert positions[b, index] == length + int((ancestors[n, :end] & valid[b, :end]).sum()) - 1


def test_rows_are_admitted_by_free_blocks_and_give_them_back_on_finish_abort_and_error() -> None:
    """A pool of 12 blocks of 16 (positions for about two requests at once) runs five: the third waits for a row's
    blocks; a finished, an aborted and a refused request all leave the pool as it was."""
    tokenizer, target = tiny_tokenizer(), tiny_model()
    config = Config.model_validate({"model": "in-memory", "batch_size": 4, "num_kv_blocks": 12,
                                    "speculative": {"method": "ngram", "num_speculative_tokens": 3},
                                    "sampling": {"max_tokens": 60, "ignore_eos": True}})
    engine = Engine(config, target=target, tokenizer=tokenizer)
    need = engine.cache.blocks_for(engine._positions(engine.prepare(Request(id="probe", prompt="abc abc"))))
    assert 2 * need <= 12 < 3 * need
    for i in range(5):
        engine.add_request(Request(id=str(i), prompt="abc abc"))
    engine.add_request(Request(id="bad", prompt="x" * 300))  # longer than the model's context: an error result
    output = engine.step()
    assert [r.id for r in output.finished] == ["bad"] and output.finished[0].finish_reason == "error"
    assert len(engine.running) == 2 and len(engine.waiting) == 3  # rows are free, blocks are not
    assert engine.cache.blocks_promised <= 12
    assert engine.abort("1") and len(engine.running) == 1
    engine.step()
    assert len(engine.running) == 2  # the aborted row's blocks admitted the next request
    done = []
    while engine.has_unfinished():
        done += engine.step().finished
        assert engine.cache.blocks_promised <= 12
    assert sorted(r.id for r in done) == ["0", "2", "3", "4"]
    assert engine.cache.blocks_in_use == 0 and engine.cache.blocks_promised == 0 and engine.kv_cache_usage() == 0


def test_a_request_larger_than_the_pool_is_an_error_result() -> None:
    tokenizer, target = tiny_tokenizer(), tiny_model()
    config = Config.model_validate({"model": "in-memory", "num_kv_blocks": 2, "speculative": {"method": "none"},
                                    "sampling": {"max_tokens": 100}})
    result = Engine(config, target=target, tokenizer=tokenizer).generate([Request(id="x", prompt="abc")])[0]
    assert result.finish_reason == "error" and "KV cache positions" in result.error


def test_commit_moves_every_layer_s_entries_across_blocks() -> None:
    """Accepted nodes that sit in the row's next block move back into the block before it, in every layer, keys and
    values alike; a row whose path is its chain moves nothing."""
    cache = PagedKVCache(CacheShape(2, 1, 4), num_blocks=6, max_rows=2, max_positions=32, block_size=16)
    rows = cache.add_rows([32, 32])
    cache.ensure(rows, [32, 32])

    def locate(row: int, position: int) -> tuple[int, int]:
        return divmod(cache.slot_of(row, position), cache.block_size)

    for row in range(2):
        for position in range(32):
            block, offset = locate(row, position)
            for layer in range(2):
                cache.keys[layer, block, 0, :, offset] = 1000 * layer + 100 * row + position
                cache.values[layer, block, 0, offset, :] = 1000 * layer + 100 * row + position
    cache.advance(rows, [14, 3])
    # Row 0 keeps nodes 0, 3, 5 (positions 14, 17, 19) as positions 14, 15, 16; row 1 keeps its root alone.
    cache.commit(rows, torch.tensor([[0, 3, 5], [0, 0, 0]]), [3, 1])
    assert cache.host_lengths[:2] == [17, 4]

    def read(row: int, layer: int, positions: range) -> list[tuple[int, int]]:
        return [(int(cache.keys[layer, block, 0, 0, offset]), int(cache.values[layer, block, 0, offset, 0]))
                for block, offset in (locate(row, position) for position in positions)]

    for layer in range(2):
        expected = [1000 * layer + position for position in [*range(15), 17, 19]]
        assert read(0, layer, range(17)) == list(zip(expected, expected))
        expected = [1000 * layer + 100 + position for position in range(4)]
        assert read(1, layer, range(4)) == list(zip(expected, expected))
