"""Drafters (decoding/drafting/: lookup.py, recycle.py, draft_model.py): n-gram lookup on literal token arrays, and
what the model drafters promise: a stop ends drafting without a wasted forward, a self-draft drafts in the target's
cache and leaves the target as loaded, a draft over a vocabulary subset stays lossless, lookup siblings join a
model's tree only."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from engine_cases import PROMPTS, make_config, run

from decoding import Config, Engine, Request
from decoding.drafting.draft_model import SOME_ROWS_MAX_SHARE
from decoding.drafting.drafters import DraftInputs, RowDraftState
from decoding.drafting.lookup import NgramDrafter, TokenHistory, lookup_continuations
from decoding.drafting.recycle import RecycleDrafter, recycling_tree_nodes
from decoding.drafting.signal_head import DraftSignalMLP
from decoding.engine.batch import JoinedRows
from decoding.engine.sequence import Contexts, Sequence
from decoding.verification.tree import TreeTopology


# -------------------------------------------------------------------------------------------------------- n-gram lookup
def test_the_longest_matching_suffix_is_continued_first() -> None:
    """The 3-gram [4, 2, 3] continues with 5 before the more recent 2-gram [2, 3] continues with 6; a shorter
    suffix whose continuation starts like an earlier candidate's adds nothing."""
    context = [4, 2, 3, 5, 1, 2, 3, 6, 0, 4, 2, 3]
    assert NgramDrafter(max_ngram=3).continuations(context, depth=2, width=2) == [[5, 1], [6, 0]]
    assert NgramDrafter(max_ngram=3).continuations(context, depth=2, width=1) == [[5, 1]]
    # Up to 2-grams only: the most recent occurrence of [2, 3] first.
    assert NgramDrafter(max_ngram=2).continuations(context, depth=2, width=2) == [[6, 0], [5, 1]]


def test_the_most_recent_occurrence_is_continued_first() -> None:
    context = [1, 5, 1, 6, 1, 7, 1]
    assert NgramDrafter().continuations(context, depth=1, width=3) == [[7], [6], [5]]
    assert NgramDrafter().continuations(context, depth=1, width=2) == [[7], [6]]


def test_candidates_start_with_distinct_tokens() -> None:
    """The oldest [1] continues with 2 as a more recent one does: no second candidate, so fewer than ``width``."""
    context = [1, 2, 1, 2, 1, 3, 1]
    assert NgramDrafter().continuations(context, depth=3, width=3) == [[3, 1], [2, 1, 3]]


def test_continuations_stop_at_the_depth_and_at_the_context_s_end() -> None:
    context = [1, 2, 3, 1, 2]  # [1, 2] occurred at the start: 3, 1, 2 follow it, and then the context ends
    assert NgramDrafter().continuations(context, depth=2, width=1) == [[3, 1]]
    assert NgramDrafter().continuations(context, depth=5, width=1) == [[3, 1, 2]]


def test_suffixes_shorter_than_min_ngram_or_unseen_propose_nothing() -> None:
    assert NgramDrafter(min_ngram=1).continuations([1, 2, 3, 1], depth=3, width=2) == [[2, 3, 1]]
    assert NgramDrafter(min_ngram=2).continuations([1, 2, 3, 1], depth=3, width=2) == []
    assert NgramDrafter().continuations([1, 2, 3, 4], depth=3, width=2) == []
    assert NgramDrafter().continuations([5], depth=3, width=2) == []
    assert NgramDrafter().continuations([], depth=3, width=2) == []


def _ngram_inputs(topology: TreeTopology, contexts: list[list[int]], roots: list[list[int]],
                  root_valid: list[list[bool]], depths: list[int]) -> DraftInputs:
    """Draft inputs as the engine hands them to a host drafter; n-gram lookup reads no warp, randomness or stop."""
    roots_tensor = torch.tensor(roots)
    return DraftInputs(
        contexts=contexts, roots=roots_tensor, root_valid=torch.tensor(root_valid), pending=roots_tensor[:, 0],
        depths=torch.tensor(depths), topology=topology, warp=None, greedy=torch.ones(len(roots), dtype=torch.bool),
        generators=[], replacement=False, stop=None, rows=[RowDraftState() for _ in roots],
    )


def test_lookup_places_candidate_k_of_level_l_at_its_tree_node() -> None:
    """Each row continues context + pending token; candidate k's l-th token sits at ``level_slice(l).start + k``,
    and the tree is cut to the deepest level any row filled."""
    topology = TreeTopology(num_candidates=2, max_depth=3, root_width=1)
    inputs = _ngram_inputs(topology, [[4, 2, 3, 5, 1, 2], [7, 7, 7], [9, 8]], [[3], [7], [8]], [[True]] * 3,
                           [2, 1, 0])
    draft = NgramDrafter().propose(inputs)
    assert draft.depth == 2 and draft.draft_probs is None  # deterministic proposals
    assert draft.tokens.tolist() == [[3, 5, 0, 1, 0], [7, 7, 0, 0, 0], [8, 0, 0, 0, 0]]
    assert draft.valid.int().tolist() == [[1, 1, 0, 1, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]


def test_lookup_continues_each_target_initialized_root_alone() -> None:
    topology = TreeTopology(num_candidates=2, max_depth=2, root_width=2)
    inputs = _ngram_inputs(topology, [[3, 9, 6, 8, 1]] * 2, [[3, 6], [3, 6]], [[True, True], [True, False]], [2, 2])
    draft = NgramDrafter().propose(inputs)
    assert draft.depth == 2
    assert draft.tokens.tolist() == [[3, 6, 9, 8, 6, 1], [3, 6, 9, 0, 6, 0]]
    assert draft.valid.int().tolist() == [[1, 1, 1, 1, 1, 1], [1, 0, 1, 0, 1, 0]]


def test_a_recycling_tree_proposes_each_parent_tokens_successor_of_its_rank() -> None:
    """The static tree (a, b under the pending token; c, d under a; e under b) over a hand-filled table: node of rank
    r proposes table[parent's token, r]; a token without successors ends its branch; a row drafts to its depth."""
    topology = TreeTopology(num_candidates=0, max_depth=2, root_width=1, tree=(-1, -1, 0, 0, 1))
    drafter = RecycleDrafter(vocab_size=10, width=2, device=torch.device("cpu"))
    drafter.table[3] = torch.tensor([4, 5])
    drafter.table[4] = torch.tensor([6, 7])
    drafter.table[5] = torch.tensor([8, -1])
    drafter.table[8] = torch.tensor([-1, -1])
    inputs = _ngram_inputs(topology, [[1], [1], [1]], [[3], [4], [3]], [[True]] * 3, [2, 2, 1])
    draft = drafter.propose(inputs)
    assert draft.depth == 2 and draft.draft_probs is None  # deterministic proposals
    #                                pending a  b  c  d  e
    assert draft.tokens.tolist() == [[3, 4, 5, 6, 7, 8],
                                     [4, 6, 7, 0, 0, 0],  # 6 and 7 have no successors yet
                                     [3, 4, 5, 0, 0, 0]]  # a row drafting one level
    assert draft.valid.int().tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0]]


def test_a_recycling_tree_is_sized_by_the_device_and_the_batch() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert recycling_tree_nodes(cuda, 1, 5) > recycling_tree_nodes(cuda, 8, 5) > recycling_tree_nodes(cuda, 64, 5)
    assert recycling_tree_nodes(cuda, 64, 5) == 5  # at least a chain as deep as the policy may draft
    assert recycling_tree_nodes(cpu, 1, 5) < recycling_tree_nodes(cuda, 1, 5)  # a CPU pays for every node
    assert make_config(method="recycle", tree_nodes=12).speculative.tree_nodes == 12
    assert make_config(method="draft_model", tree_nodes=12).speculative.tree_nodes is None  # a recycling option
    with pytest.raises(ValueError, match="tree_nodes"):
        make_config(method="recycle", tree_nodes=0)


@pytest.mark.parametrize(("max_ngram", "min_ngram", "depth", "count"), [(4, 1, 3, 2), (3, 2, 5, 4), (1, 1, 1, 1)])
def test_the_device_lookup_finds_what_the_reference_finds(max_ngram, min_ngram, depth, count) -> None:
    """Rows of random tokens from a small vocabulary (many repeats), of different lengths, with stale tokens past
    each row's end: the same continuations, in the same order, as the host reference for every row."""
    generator = torch.Generator().manual_seed(max_ngram * 100 + depth * 10 + count)
    reference = NgramDrafter(max_ngram, min_ngram)
    for _ in range(20):
        batch, width = 6, 40
        history = torch.randint(0, 5, (batch, width), generator=generator)
        lengths = torch.randint(0, width + 1, (batch,), generator=generator)
        tokens, valid = lookup_continuations(history, lengths, depth, count, max_ngram, min_ngram)
        for row in range(batch):
            expected = reference.continuations(history[row, : lengths[row]].tolist(), depth, count)
            got = [tokens[row, c][valid[row, c]].tolist() for c in range(count) if valid[row, c].any()]
            assert got == expected, (row, history[row, : lengths[row]].tolist())
            assert not valid[row, len(expected):].any()
            for c, chain in enumerate(expected):  # a continuation's flags are a prefix of its levels
                assert valid[row, c].tolist() == [True] * len(chain) + [False] * (depth - len(chain))


def _joined(states: list[RowDraftState]) -> JoinedRows:
    """Rows joining with these drafter states (a drafter reads only their sequences' ``draft_state``)."""
    seqs = [SimpleNamespace(draft_state=state) for state in states]
    return JoinedRows(slice(0, len(states)), seqs, None, None)  # type: ignore[arg-type]


def test_the_token_history_appends_what_rows_gained_and_follows_swap_removal() -> None:
    history = TokenHistory(torch.device("cpu"))
    states = [RowDraftState() for _ in range(3)]
    history.rows_joined(_joined(states))
    tokens, lengths = history.sync([[1, 2], [3], [4, 5, 6]], torch.tensor([9, 8, 7]), states)
    assert lengths.tolist() == [3, 2, 4] and [state.history_length for state in states] == [3, 2, 4]
    assert [tokens[r, :n].tolist() for r, n in enumerate(lengths.tolist())] == [[1, 2, 9], [3, 8], [4, 5, 6, 7]]
    history.row_removed(0, 2)  # the last row takes row 0's place, its state with it
    states = [states[2], states[1]]
    tokens, lengths = history.sync([[4, 5, 6, 7, 1] + list(range(100)), [3, 8, 2]], torch.tensor([5, 5]), states)
    assert lengths.tolist() == [106, 4] and tokens.shape[1] == 106  # grown past its first width
    assert tokens[0, :8].tolist() == [4, 5, 6, 7, 1, 0, 1, 2] and tokens[1, :4].tolist() == [3, 8, 2, 5]
    tokens, lengths = history.sync([[1], [3, 8, 2, 5]], torch.tensor([2, 6]), states)  # not row 0's history: anew
    assert [tokens[r, :n].tolist() for r, n in enumerate(lengths.tolist())] == [[1, 2], [3, 8, 2, 5, 6]]


def test_the_token_history_grows_in_rows_without_shrinking_its_width() -> None:
    """More rows than ever, all short, after a long row widened the history (as a long-lived engine's batch fills
    after one long row): the rows grow and the width stays, the rows it held kept."""
    history = TokenHistory(torch.device("cpu"))
    states = [RowDraftState()]
    history.rows_joined(_joined(states))
    history.sync([list(range(200))], torch.tensor([7]), states)
    wide = history.tokens.shape[1]
    assert wide >= 201
    history.row_removed(0, 0)
    states = [RowDraftState() for _ in range(4)]
    history.rows_joined(_joined(states))
    tokens, lengths = history.sync([[1, 2], [3], [4, 5, 6], [7]], torch.tensor([9, 8, 7, 6]), states)
    assert history.tokens.shape == (4, wide) and lengths.tolist() == [3, 2, 4, 2]
    assert [tokens[r, :n].tolist() for r, n in enumerate(lengths.tolist())] == [[1, 2, 9], [3, 8], [4, 5, 6, 7],
                                                                                 [7, 6]]


def test_a_row_that_joined_after_the_last_lookup_takes_a_leaving_row_s_place_with_nothing_on_the_device() -> None:
    """Row 2 joins after a sync and takes row 0's place before it is ever looked up: row 0 then holds nothing, and
    the next sync copies its whole context (its stale length once made it append only a tail after row 0's
    tokens)."""
    history = TokenHistory(torch.device("cpu"))
    states = [RowDraftState() for _ in range(2)]
    history.rows_joined(_joined(states))
    history.sync([[1, 2, 3], [4]], torch.tensor([9, 8]), states)
    joining = RowDraftState(history_length=3)  # a state that held tokens before: joining resets it
    history.rows_joined(_joined([joining]))
    history.row_removed(0, 2)
    states = [joining, states[1]]
    tokens, lengths = history.sync([[5, 6, 7, 8, 9, 10], [4, 8]], torch.tensor([11, 12]), states)
    assert [tokens[r, :n].tolist() for r, n in enumerate(lengths.tolist())] == [[5, 6, 7, 8, 9, 10, 11],
                                                                                 [4, 8, 12]]


def test_lookup_on_the_device_drafts_the_host_lookups_tree() -> None:
    """The same tree from a drafter that looks up on the device and one on the host, a constrained row's grammar
    draft first in both (that row continued on the host), rows at different depths."""
    topology = TreeTopology(num_candidates=2, max_depth=3, root_width=1)
    contexts = [[4, 2, 3, 5, 1, 2, 3, 6, 2], [7, 7, 7], [9, 8], [1, 2, 1, 2, 1]]
    inputs = _ngram_inputs(topology, contexts, [[3], [7], [8], [2]], [[True]] * 4, [3, 1, 0, 2])
    inputs = dataclasses.replace(inputs, grammar_drafts=[[], [], [], [5, 5]])
    host = NgramDrafter().propose(inputs)
    device = NgramDrafter(device=torch.device("cpu")).propose(inputs)
    size = host.tokens.shape[1]
    assert host.depth == 3 and device.depth == 3
    assert torch.equal(device.valid[:, :size], host.valid) and not device.valid[:, size:].any()
    assert torch.equal(torch.where(host.valid, device.tokens[:, :size], 0), torch.where(host.valid, host.tokens, 0))
    assert host.tokens[3, topology.chain_node(1, 0)] == 5  # the grammar draft's candidate


# --------------------------------------------------------------------------------------------------------- model drafts


@pytest.mark.parametrize("policy", ["threshold", "decision"])
def test_a_stop_ends_drafting_after_the_token_without_a_wasted_forward(
    policy, tmp_path, tokenizer, target, draft, reference
) -> None:
    """A head that always says "stop" drafts exactly what static depth 1 drafts, with one draft forward per step:
    the stop comes after the token it judged, so no forward is run for a token that is then thrown away."""
    head = DraftSignalMLP(target.config.hidden_size)
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.fill_(-20.0)  # P(accepted) ~ 0
    head.save(tmp_path)
    field = "acceptance_head" if policy == "threshold" else "decision_model"
    config = make_config(method="draft_model", num_candidates=1, length_policy=policy, num_speculative_tokens=4,
                         batch_size=3, **{field: str(tmp_path)})
    engine = Engine(config, target=target, tokenizer=tokenizer, draft=draft)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(Request(id=str(i), prompt=prompt))
    results, levels = {}, []
    propose = engine.drafter.propose
    engine.drafter.propose = lambda inputs: (draft := propose(inputs), levels.append(draft.forwarded_levels))[0]
    while engine.has_unfinished():
        results.update((r.id, r) for r in engine.step().finished)
    assert max(levels) == 1
    assert [results[str(i)].token_ids for i in range(len(PROMPTS))] == reference
    static = run(make_config(method="draft_model", num_candidates=1, length_policy="static",
                             num_speculative_tokens=1, batch_size=3), tokenizer, target, draft)
    assert [results[str(i)].per_step_drafted for i in range(len(PROMPTS))] == [r.per_step_drafted for r in static]


def test_vocabulary_subset_draft_is_lossless_and_leaves_the_model_whole(
    tmp_path, tokenizer, target, draft, reference
) -> None:
    import json

    from decoding.model.loading import DRAFT_METADATA

    draft.save_pretrained(tmp_path)
    (tmp_path / DRAFT_METADATA).write_text(json.dumps({"vocab_subset": list(range(3, 20))}))
    config = make_config(method="draft_model", model=str(tmp_path), num_candidates=2)
    engine = Engine(config, target=target, tokenizer=tokenizer, draft=draft)
    assert engine.drafter.model.get_output_embeddings().out_features == 17
    assert draft.get_output_embeddings().out_features == target.config.vocab_size
    results = engine.generate([Request(id=str(i), prompt=p) for i, p in enumerate(PROMPTS)])
    assert [r.token_ids for r in results] == reference
    # Tokens outside the subset are never proposed.
    assert all(3 <= stat[3] < 20 for r in results for stat in r.token_stats)
    # A second engine on the same draft reuses the cut view (and so its prepacked weights and measured costs).
    assert Engine(config, target=target, tokenizer=tokenizer, draft=draft).drafter.model is engine.drafter.model


def test_quantized_self_draft_leaves_the_target_as_loaded(tokenizer, target) -> None:
    before = {name: p.detach().clone() for name, p in target.named_parameters()}
    config = make_config(method="draft_model", model="target", quantization="int4", num_speculative_tokens=3)
    engine = Engine(config, target=target, tokenizer=tokenizer)
    twin = engine.drafter.model  # the lean forward over the quantized twin (decoding.model.lean_forward)
    assert twin is not target and twin is not engine.target and twin.inner is not target
    assert twin.compiled is not None  # its layers compiled (decoding.compiled_layers): what the engine tests run
    quantized_layers = [m for m in twin.modules() if isinstance(m, torch.nn.Linear) and "forward" in vars(m)]
    assert len(quantized_layers) == sum(isinstance(m, torch.nn.Linear) for m in target.modules())
    assert not any("forward" in vars(m) for m in target.modules() if isinstance(m, torch.nn.Linear))
    assert all(torch.equal(p, before[name]) for name, p in target.named_parameters())
    ids = torch.tensor([tokenizer("abc abc abc").input_ids])
    with torch.no_grad():  # a close twin (0.64 here, on random weights; chance is 1/31), not another model
        agree = (twin.inner(ids).logits.argmax(-1) == target(ids).logits.argmax(-1)).float().mean()
    assert agree >= 0.5


def test_a_self_draft_drafts_in_the_target_cache(tokenizer, target) -> None:
    """The self-draft reads and writes the target's cache: no prefill through the quantized twin, no catch-up
    forward of tokens committed while it did not draft, and rows join and leave once."""
    config = make_config(method="draft_model", model="target", quantization="int4", num_speculative_tokens=3,
                         batch_size=3, length_policy="static", sampling={"max_tokens": 20, "ignore_eos": True})
    engine = Engine(config, target=target, tokenizer=tokenizer)
    assert engine.drafter.cache is engine.cache
    draft_tokens, draft_rows = [], []

    def record(module, args, kwargs, out) -> None:  # the lean forward's args: ids [B, T], positions, metadata
        draft_rows.append(args[0].shape[0])
        draft_tokens.append(args[0].shape[1])

    engine.drafter.model.register_forward_hook(record, with_kwargs=True)

    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(Request(id=str(i), prompt=prompt))
    engine._admit(engine.scheduler.admit())
    assert not draft_tokens  # no prefill forward through the quantized twin
    assert engine.cache.active == 3
    finished = {}

    def step() -> None:
        finished.update({r.id: r for r in engine.step().finished})

    engine.policy.plan = lambda rows: torch.zeros(len(rows), dtype=torch.long)  # plain steps: nothing drafted
    step(), step()
    assert not draft_tokens
    # Most rows, not all, drafting: the draft runs over the whole batch (a slice read in place, nothing gathered).
    engine.policy.plan = lambda rows: torch.tensor([3, 1, 0])
    assert SOME_ROWS_MAX_SHARE * 3 < 2  # two of three rows draft: more than the share
    step()
    assert draft_rows[0] == 3
    assert engine.cache.active == 3
    engine.policy.plan = lambda rows: torch.full((len(rows),), 3)
    draft_tokens.clear(), draft_rows.clear()
    step()
    assert draft_tokens == [1, 1, 1]  # the root alone, then one token per level: no backlog fed again
    assert draft_rows == [3, 3, 3]
    # Few rows drafting are forwarded alone: the draft runs over the middle row's entries only.
    engine.policy.plan = lambda rows: torch.tensor([0, 2, 0][: len(rows)])
    draft_rows.clear()
    step()
    assert draft_rows == [1, 1]
    while engine.has_unfinished():
        step()
    assert engine.cache.active == 0
    plain = Engine(make_config(sampling={"max_tokens": 20, "ignore_eos": True}), target=target, tokenizer=tokenizer)
    expected = plain.generate([Request(id=str(i), prompt=p) for i, p in enumerate(PROMPTS[:3])])
    assert all(finished[r.id].token_ids == r.token_ids for r in expected)


def test_lookup_siblings_belong_to_a_model_tree() -> None:
    assert make_config(method="ngram", ngram_candidates=1).speculative.ngram_candidates == 0
    assert make_config(method="none", ngram_candidates=2).speculative.ngram_candidates == 0
    assert make_config(method="draft_model", ngram_candidates=2).speculative.ngram_candidates == 2
    default = Config().speculative  # the zero-training default: the target drafting for itself in int4
    assert (default.model, default.quantization, default.method) == ("target", "int4", "draft_model")
    assert make_config(method="draft_model", model="some/draft").speculative.quantization is None


def test_a_rows_context_tail_is_read_without_building_the_context() -> None:
    """``Contexts.tail``, what the token history reads each step, equals slicing the whole context at every start,
    across the prompt's end; and a history synced through it equals one synced through the whole contexts."""
    seqs = [Sequence(request_id=str(i), prompt="", prompt_ids=prompt, params=None, generator=torch.Generator(),
                     started=0.0, generated=generated)  # type: ignore[arg-type]
            for i, (prompt, generated) in enumerate([([1, 2, 3], [4, 5, 6, 7]), ([8], [9]), ([10, 11], [12])])]
    contexts = Contexts(seqs)
    for row, seq in enumerate(seqs):
        for start in range(len(seq.context) + 2):
            assert contexts.tail(row, start) == (len(seq.context), seq.context[start:])
    by_tail, by_lists = TokenHistory(torch.device("cpu")), TokenHistory(torch.device("cpu"))
    tail_states, list_states = [RowDraftState() for _ in seqs], [RowDraftState() for _ in seqs]
    for step in range(3):
        pending = torch.tensor([seq.generated[-1] for seq in seqs])
        got = by_tail.sync(contexts, pending, tail_states)
        expected = by_lists.sync([seq.context for seq in seqs], pending, list_states)
        assert got[1].tolist() == expected[1].tolist() and torch.equal(got[0], expected[0])
        for seq in seqs:
            seq.generated.extend([20 + step] * (1 + step))
