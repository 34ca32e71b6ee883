"""SamplingParams: the one definition of the sampling settings, which checks its own fields."""

from __future__ import annotations

import math

import pytest

import mlxllama
from mlxllama.errors import MlxLlamaError
from mlxllama.sampling import SamplingParams

from conftest import PACKAGE_DATA


@pytest.mark.parametrize("field,value,must", [
    ("temperature", math.nan, "a finite number >= 0"),
    ("temperature", -0.5, "a finite number >= 0"),
    ("temperature", math.inf, "a finite number >= 0"),
    ("top_k", -1, "an integer >= 0"),
    ("top_k", 2.5, "an integer >= 0"),
    ("top_p", 0.0, "a number in (0, 1]"),
    ("top_p", 1.5, "a number in (0, 1]"),
    ("min_p", math.nan, "a number in [0, 1]"),
    ("repeat_penalty", 0.0, "a finite number > 0"),
    ("repeat_last_n", -2, "an integer >= -1"),
    ("seed", -1, "null or an integer >= 0"),
    ("seed", True, "null or an integer >= 0"),
])
def test_invalid_values_raise_an_error_naming_the_field(field, value, must):
    with pytest.raises(MlxLlamaError) as info:
        SamplingParams(**{field: value})
    assert str(info.value) == f"sampling setting '{field}' must be {must}, got {value!r}"


def test_the_python_api_checks_sampling_keywords_before_generating():
    runtime = mlxllama.load(PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf")
    with pytest.raises(MlxLlamaError, match="'temperature' must be a finite number >= 0, got nan"):
        runtime.generate("The capital of Italy is", 4, temperature=math.nan)
    with pytest.raises(MlxLlamaError, match="'top_p' must be"):
        mlxllama.batch_generate(runtime, ["a", "b"], 2, top_p=0)
    with pytest.raises(TypeError, match="unknown sampling setting"):
        runtime.generate("x", 2, temprature=0.5)
    params = SamplingParams(temperature=0.7, seed=3)
    assert params.with_overrides(seed=4) == SamplingParams(temperature=0.7, seed=4)
    # Keywords and a SamplingParams give the same seeded result.
    assert (runtime.generate("The capital of Italy is", 6, params).token_ids
            == runtime.generate("The capital of Italy is", 6, temperature=0.7, seed=3).token_ids)


def test_presence_and_frequency_penalties_follow_openais_rule():
    """logit - frequency x count - presence x (count > 0), counted over the tokens this sampler picked."""
    import mlx.core as mx

    from mlxllama.sampling import make_sampler

    logits = mx.array([1.0, 0.9, 0.75, 0.0])
    picks = []
    sample = make_sampler(SamplingParams(frequency_penalty=0.2))
    for _ in range(4):
        picks.append(int(sample(logits, [])))
    # 1.0 -> 0.8 after one pick (0.9 wins), 0.9 -> 0.7 (0.8 wins), 0.8 -> 0.6 (0.75 wins), 0.7 wins.
    assert picks == [0, 1, 0, 2]
    sample = make_sampler(SamplingParams(presence_penalty=0.3))
    assert [int(sample(logits, [])) for _ in range(3)] == [0, 1, 2]


def test_logit_bias_moves_the_named_tokens():
    import mlx.core as mx

    from mlxllama.sampling import make_sampler

    logits = mx.array([1.0, 0.9, 0.0])
    assert int(make_sampler(SamplingParams(logit_bias=((0, -100.0),)))(logits, [])) == 1
    assert int(make_sampler(SamplingParams(logit_bias=((2, 5.0),)))(logits, [])) == 2
    with pytest.raises(MlxLlamaError, match="logit bias: token id 7 is not in the vocabulary of 3"):
        make_sampler(SamplingParams(logit_bias=((7, 1.0),)))(logits, [])
    with pytest.raises(MlxLlamaError, match="'logit_bias' must be"):
        SamplingParams(logit_bias=((0, 500.0),))
