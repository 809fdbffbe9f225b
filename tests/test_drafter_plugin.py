"""A drafter added from outside the engine: one class registered under its own ``speculative.method``, built from
the config by ``from_config``, runs through the unchanged engine greedy-identical to plain decoding and sampling
the target's law."""

from __future__ import annotations

import pytest
import torch
from engine_cases import LAW_SAMPLES, PROMPTS, assert_pairs_follow_target_law, law_requests, make_config, run

from decoding import Engine
from decoding.config import SpeculativeConfig
from decoding.drafting.drafters import DRAFTERS, Draft, DraftContext, Drafter, DraftInputs, DraftPlan, register_drafter


@register_drafter("previous_token")
class PreviousTokenDrafter(Drafter):
    """Proposes that each token repeats: every node below the roots takes its parent's token (a deterministic
    proposal, verified like a lookup)."""

    @classmethod
    def from_config(cls, context: DraftContext) -> DraftPlan:
        return DraftPlan.chains(context, cls(), model_drafts=False)

    def propose(self, inputs: DraftInputs) -> Draft:
        depth = inputs.max_depth
        draft = Draft.roots_only(inputs, depth)
        topology, depths = inputs.topology, inputs.depths.to(draft.tokens.device)
        parents = torch.tensor(topology.parents)
        for level in range(1, depth + 1):
            nodes = topology.level_slice(level)
            draft.tokens[:, nodes] = draft.tokens[:, parents[nodes]]
            draft.valid[:, nodes] = draft.valid[:, parents[nodes]] & (depths >= level)[:, None]
        return draft


def test_the_registry_names_every_drafter_and_the_config_accepts_a_registered_one() -> None:
    assert {"none", "ngram", "draft_model", "recycle", "previous_token"} <= set(DRAFTERS)
    assert SpeculativeConfig(method="previous_token").method == "previous_token"
    with pytest.raises(ValueError, match="unknown method 'next_token'"):
        SpeculativeConfig(method="next_token")
    with pytest.raises(ValueError, match="registered already"):
        register_drafter("ngram")(PreviousTokenDrafter)


@pytest.mark.parametrize(("width", "init"), [(1, "draft"), (2, "target")])
def test_a_registered_drafter_is_greedy_identical(width, init, tokenizer, target, reference) -> None:
    config = make_config(method="previous_token", num_candidates=width, candidate_init=init, length_policy="static",
                         num_speculative_tokens=3, batch_size=3)
    results = run(config, tokenizer, target, prompts=PROMPTS)
    assert [r.token_ids for r in results] == reference
    assert sum(sum(r.per_step_drafted) for r in results) > 0  # it drafted


def test_a_registered_drafter_samples_the_target_s_law(small_models, tokenizer) -> None:
    target, _ = small_models
    prompt = [3, 3, 3, 4, 4, 4, 3]  # runs of one token: repeats the target may keep
    samples = LAW_SAMPLES
    warp = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    config = make_config(method="previous_token", num_speculative_tokens=3, length_policy="static", batch_size=64,
                         sampling={"max_tokens": 4, **warp})
    engine = Engine(config, target=target, tokenizer=tokenizer)
    results = engine.generate(law_requests(engine, prompt, samples))
    drafted = sum(sum(r.per_step_drafted) for r in results)
    accepted = sum(sum(r.per_step_accepted) for r in results)
    assert drafted > samples and 0 < accepted < drafted  # speculation really happened, with rejections
    assert_pairs_follow_target_law(target, prompt, warp, results)
