"""``decoding.params.resolve_sampling``, the one validation of a request's sampling parameters (the pipeline's rows,
the server's bodies, the engine's requests): every bound of docs/reference.md's table on both sides, the field named
in each refusal, the merge onto the configured values, and the checks against the model."""

from __future__ import annotations

import re

import pytest

from decoding.config import SamplingParams
from decoding.params import RequestError, resolve_sampling

VOCAB = 10
EOS = {0}
DEFAULTS = SamplingParams(max_tokens=2_000, seed=5)


def resolve(overrides: object, defaults: SamplingParams = DEFAULTS, **options: bool) -> SamplingParams:
    return resolve_sampling(overrides, defaults, VOCAB, EOS, **options)  # type: ignore[arg-type]


# (field, the extreme values accepted, values just past them); docs/reference.md lists the same bounds.
BOUNDS = [
    ("n", [1, 128], [0, 129, -1, 1.0, True]),
    ("temperature", [0.0, 2.0, 0, 2], [-1e-9, 2.0000001, float("inf"), float("nan"), "1"]),
    ("top_p", [5e-324, 1.0], [0.0, -0.5, 1.0000001, float("nan")]),
    ("top_k", [-1, 0, 1, 2**63 - 1], [-2, 2**63, 1.0]),
    ("max_tokens", [1, 1_000_000], [0, 1_000_001, True, 4.0, "4"]),
    ("min_tokens", [0, 2_000], [-1, 2_001, 1_000_001]),  # 2_000: the configured max_tokens
    ("seed", [0, 2**63 - 1, None], [-1, 2**63, 1.5]),
    ("presence_penalty", [-2.0, 2.0], [-2.0000001, 2.0000001, float("-inf")]),
    ("frequency_penalty", [-2.0, 2.0], [-2.0000001, 2.0000001, float("nan")]),
    ("repetition_penalty", [0.01, 100.0], [0.0099, 100.01, 0.0, 1e-300, -1.0]),
    ("logprobs", [0, VOCAB, None], [-1, VOCAB + 1, 21, True]),
    ("stop", [["x"] * 64, ["x" * 1024], "x", []], [["x"] * 65, ["x" * 1025], [""], "", ["ok", ""], [3], 3]),
    ("stop_token_ids", [[0], [VOCAB - 1], [1] * 1024], [[-1], [VOCAB], [2**31], [1] * 1025, ["1"]]),
    ("ignore_eos", [True, False], [1, "yes", None]),
    ("skip_special_tokens", [True, False], [0]),
    ("detokenize", [True, False], ["maybe", 0]),
    ("min_p", [0.0, 1.0, 0, 1], [-1e-9, 1.0000001, float("nan"), True, "0.1"]),
    ("logit_bias", [{0: -100.0}, {VOCAB - 1: 100.0}, {str(i): 1.0 for i in range(VOCAB)}, None, {}],
     [{"-1": 1.0}, {VOCAB: 1.0}, {"x": 1.0}, {"1.5": 1.0}, {"1": "2"}, {"1": float("inf")}, {"1": True}, [1], 3]),
    ("allowed_token_ids", [[0], [VOCAB - 1], list(range(VOCAB)), None], [[], [VOCAB], [-1], ["1"], [1.0], 1]),
    ("bad_words", [["x"], ["x" * 128] * 64, []], [[""], [" "], ["x" * 129], ["x"] * 65, "x", [3], None]),
    ("include_stop_str_in_output", [True, False], [1, "yes", None]),
    ("prompt_logprobs", [0, VOCAB, None], [-1, VOCAB + 1, 21, True, 1.0]),
]


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, good, _ in BOUNDS for v in good],
                         ids=[f"{f}={v!r:.20}" for f, good, _ in BOUNDS for v in good])
def test_a_value_within_the_bounds_is_taken(field, value) -> None:
    params = resolve({field: value}, fan_out=True)
    expected = [value] if field == "stop" and isinstance(value, str) else value
    if field == "logit_bias" and value:  # JSON's string keys are the token ids they spell
        expected = {int(token): bias for token, bias in value.items()}
    if field == "bad_words":  # each word once, as vLLM
        expected = list(dict.fromkeys(value))
    assert getattr(params, field) == expected or (field in ("top_k",) and value == -1 and params.top_k == 0)


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, _, bad in BOUNDS for v in bad],
                         ids=[f"{f}={v!r:.20}" for f, _, bad in BOUNDS for v in bad])
def test_a_value_past_the_bounds_is_refused_naming_the_field(field, value) -> None:
    with pytest.raises(RequestError) as error:
        resolve({field: value}, fan_out=True)
    assert error.value.param == field
    assert str(error.value).startswith("invalid sampling_params: ") and field in str(error.value)


def test_the_bounds_are_the_field_declarations_and_the_config_has_the_same() -> None:
    """The config's ``sampling`` validates with the same model, so a configured value past a bound is refused too."""
    from decoding.config import ConfigError, load_config

    for field, _, bad in BOUNDS:
        value = bad[0]
        if isinstance(value, float) and value != value:  # NaN does not survive YAML text as a float
            continue
        with pytest.raises(ConfigError, match=rf"sampling\.{field}"):
            load_config(overrides={f"sampling.{field}": repr(value) if not isinstance(value, str) else value})


@pytest.mark.parametrize("stop", ["", [""], ["ok", ""]])
def test_an_empty_stop_string_is_refused_in_words(stop) -> None:
    with pytest.raises(RequestError, match="stop strings must be non-empty"):
        resolve({"stop": stop})


def test_unknown_and_unsupported_fields_are_refused_by_name() -> None:
    for field in ("best_of", "spaces_between_special_tokens", "logprob_token_ids"):
        with pytest.raises(RequestError) as error:
            resolve({field: 1})
        assert error.value.param == field and field in str(error.value)


def test_a_request_overrides_the_configured_values_field_by_field_and_never_takes_the_run_seed() -> None:
    defaults = SamplingParams(temperature=0.5, top_k=3, max_tokens=7, seed=11, stop=["end"])
    params = resolve({"top_k": 4}, defaults)
    assert (params.temperature, params.top_k, params.max_tokens, params.stop) == (0.5, 4, 7, ["end"])
    assert params.seed is None  # the configured seed is the run's (decoding.verification.sampling)
    assert resolve({"seed": 3}, defaults).seed == 3
    assert resolve(None, defaults) == resolve({}, defaults) == defaults.model_copy(update={"seed": None})
    # vLLM's rules applied on the way: a tiny temperature is greedy, top_k -1 is 0, one stop string is a list.
    assert resolve({"temperature": 9e-6, "top_k": -1, "stop": "x"}, defaults).model_dump(
        include={"temperature", "top_k", "stop"}) == {"temperature": 0.0, "top_k": 0, "stop": ["x"]}


def test_a_check_across_fields_names_the_field_the_request_set() -> None:
    with pytest.raises(RequestError, match="min_tokens") as error:
        resolve({"min_tokens": 5}, SamplingParams(max_tokens=4))
    assert error.value.param == "min_tokens"
    with pytest.raises(RequestError) as error:
        resolve({"max_tokens": 2}, SamplingParams(min_tokens=3))
    assert error.value.param == "max_tokens"
    with pytest.raises(RequestError, match="detokenize") as error:
        resolve({"detokenize": False}, SamplingParams(stop=["x"]))
    assert error.value.param == "detokenize"


def test_the_older_name_of_structured_outputs_replaces_a_configured_constraint() -> None:
    configured = SamplingParams(structured_outputs={"regex": "a+"})
    assert resolve({"guided_decoding": {"choice": ["x", "y"]}}, configured).structured_outputs.choice == ["x", "y"]
    assert resolve({}, configured).structured_outputs.regex == "a+"
    with pytest.raises(RequestError, match="not both") as error:
        resolve({"guided_decoding": {"regex": "b"}, "structured_outputs": {"regex": "c"}})
    assert error.value.param == "structured_outputs"
    with pytest.raises(RequestError, match="structured_outputs.regex") as error:
        resolve({"guided_decoding": {"regex": "(a"}})
    assert error.value.param == "structured_outputs"


def test_checks_against_the_model() -> None:
    with pytest.raises(RequestError, match=rf"\[0, {VOCAB}\)") as error:
        resolve({"stop_token_ids": [VOCAB]})
    assert error.value.param == "stop_token_ids"
    with pytest.raises(RequestError, match=f"more than the {VOCAB} tokens") as error:
        resolve({"logprobs": VOCAB + 1})
    assert error.value.param == "logprobs"
    # min_tokens bans EOS and the stop ids: banning the whole vocabulary leaves nothing to sample.
    with pytest.raises(RequestError, match="ban every token") as error:
        resolve({"min_tokens": 2, "stop_token_ids": list(range(1, VOCAB))})
    assert error.value.param == "stop_token_ids"
    assert resolve({"min_tokens": 2, "stop_token_ids": list(range(1, VOCAB)), "ignore_eos": True}).min_tokens == 2
    # ... and every token of allowed_token_ids (EOS is 0 here).
    with pytest.raises(RequestError, match="min_tokens would ban every token of allowed_token_ids") as error:
        resolve({"min_tokens": 1, "allowed_token_ids": [0, 5], "stop_token_ids": [5]})
    assert error.value.param == "allowed_token_ids"
    assert resolve({"min_tokens": 1, "allowed_token_ids": [0, 5]}).allowed_token_ids == [0, 5]
    # An engine request decodes one sequence; the server makes n of them (fan_out).
    with pytest.raises(RequestError, match="n is 2") as error:
        resolve({"n": 2})
    assert error.value.param == "n"
    assert resolve({"n": 2}, fan_out=True).n == 2


def test_parameters_already_resolved_are_checked_against_the_model_only() -> None:
    made = resolve({"temperature": 1.0, "top_k": 4})
    assert resolve(made, SamplingParams(temperature=0.0)) is made  # not merged again onto other defaults
    with pytest.raises(RequestError) as error:
        resolve_sampling(SamplingParams(stop_token_ids=[50]), DEFAULTS, VOCAB, EOS)
    assert error.value.param == "stop_token_ids"
    with pytest.raises(RequestError) as error:
        resolve_sampling(SamplingParams(n=3), DEFAULTS, VOCAB, EOS)
    assert error.value.param == "n"


def test_overrides_that_are_not_an_object_are_refused() -> None:
    with pytest.raises(RequestError, match="expected an object, got list"):
        resolve([("temperature", 1.0)])


def test_the_frontends_error_is_this_error_and_the_servers_models_declare_no_bounds_of_their_own() -> None:
    from deploy import protocol
    from frontend.requests import RequestError as FrontendError

    assert FrontendError is RequestError
    sampling = {*protocol._SAMPLING_FIELDS, "max_tokens", "logprobs", "max_completion_tokens", "top_logprobs_"}
    for model in (protocol.CompletionRequest, protocol.ChatCompletionRequest):
        for name, field in model.model_fields.items():
            if name in sampling:
                assert field.metadata == [], f"{model.__name__}.{name} declares its own bounds: {field.metadata}"


def test_bad_words_are_tokenized_as_vllm_does() -> None:
    """vLLM's update_from_tokenizer: each word (leading spaces stripped) as it is, and with a leading space where
    that spells it with as many tokens starting differently; a word of no token or past the vocabulary refused."""
    from decoding.params import bad_words_token_ids

    pieces = {"new": [1], " new": [2], "york": [3], " york": [4], "zz": [5], " zz": [6, 5], "big": [VOCAB + 2],
              " big": [VOCAB + 3]}

    def encode(text: str) -> list[int]:  # a word-level tokenizer whose words carry their leading space
        return [token for piece in re.findall(r" ?[^ ]+", text) for token in pieces[piece]]

    assert bad_words_token_ids(["new york", "  zz", "york"], encode, VOCAB) == [[1, 4], [2, 4], [5], [3], [4]]
    with pytest.raises(RequestError, match="spells no token") as error:
        bad_words_token_ids(["\u200b"], lambda text: [], VOCAB)
    assert error.value.param == "bad_words"
    with pytest.raises(RequestError, match=rf"outside \[0, {VOCAB}\)") as error:
        bad_words_token_ids(["big"], encode, VOCAB)
    assert error.value.param == "bad_words"
