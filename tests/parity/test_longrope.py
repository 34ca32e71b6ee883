"""Phi-3's LongRoPE: the short or the long RoPE factors, chosen by context size as llama.cpp chooses.

tests/fixtures/phi3-longrope-tiny-Q8_0.gguf (scripts/make_arch_fixtures.py) is trained for 4096
tokens with rope.scaling.original_context_length 256, and its long factors are unlike its short
ones. Besides test_arch_parity.py's prompts (recorded at n_ctx 512: long factors), its reference
holds llama.cpp's logits for one ~210-token passage at n_ctx 256 (short factors) and at n_ctx 0,
llama.cpp's default, the trained context (long factors).
"""

import math
from functools import lru_cache

import mlx.core as mx
import numpy as np
import pytest

import mlxllama
from conftest import find_fixture_model
from mlxllama.gguf_file import open_gguf
from mlxllama.models import read_config
from mlxllama.tensors import tensor_to_mlx
from test_arch_parity import MIN_DECIDED, reference
from test_llama_parity import assert_greedy_matches, assert_logits_match, log_softmax

NAME = "phi3-longrope-tiny-Q8_0"
# Our context_length (None: the trained context) -> llama.cpp's n_ctx for the same factors.
CONTEXTS = {256: 256, None: 0}


@lru_cache(maxsize=None)
def model(context_length: int | None):
    return mlxllama.load(find_fixture_model(f"{NAME}.gguf"), context_length=context_length)


@pytest.mark.parametrize("context_length", CONTEXTS)
def test_logits_match_llama_cpp_at_its_context(context_length):
    m, ref = model(context_length), reference(NAME)
    prompt = f"ctx{CONTEXTS[context_length]}/passage"
    assert m.config.context_length == (context_length or 4096)
    assert_logits_match(m, ref, prompt, prompt, MIN_DECIDED)
    assert_greedy_matches(m, ref, prompt, prompt)


def test_short_and_long_factors_give_different_logits():
    ref = reference(NAME)
    ids = ref["ctx256/passage/ids"].tolist()
    assert ids == ref["ctx0/passage/ids"].tolist() and len(ids) > 200
    short, long = (log_softmax(model(n).logits(ids).astype(np.float64)) for n in CONTEXTS)
    kl = (np.exp(short) * (short - long)).sum(axis=1)
    assert kl.mean() > 0.1, kl.mean()  # over 100x the parity bar
    # llama.cpp's own choice changes its answers as much: most argmaxes move.
    assert (ref["ctx256/passage/top_ids"][:, 0] != ref["ctx0/passage/top_ids"][:, 0]).mean() > 0.5


def test_factors_follow_llama_cpps_rule():
    gguf = open_gguf(find_fixture_model(f"{NAME}.gguf"))
    short, long = (tuple(np.array(tensor_to_mlx(gguf.path, gguf.tensors[f"rope_factors_{kind}.weight"], mx.float32),
                                  dtype=np.float64).tolist()) for kind in ("short", "long"))
    assert short != long
    for context_length, factors in [(1, short), (256, short), (257, long), (4096, long), (None, long)]:
        config = read_config(gguf, context_length)
        assert config.rope_freq_factors == factors, context_length
        # The attention factor applies with either set of factors: sqrt(1 + ln(4096 / 256) / ln(256)).
        assert config.rope_attn_factor == pytest.approx(math.sqrt(1.5))
    # llama.cpp compares its context rounded up to a multiple of 256, so with an original context of
    # 300 a context of 300 already takes the long factors (checked against llama-cpp-python 0.3.36).
    gguf.metadata["phi3.rope.scaling.original_context_length"] = 300
    assert [read_config(gguf, n).rope_freq_factors for n in (256, 257, 300)] == [short, long, long]


def test_context_length_limits_prompts_and_is_checked():
    m = model(256)
    with pytest.raises(mlxllama.MlxLlamaError, match="prompt is 300 tokens, more than the model's context of 256"):
        m.generate([1] * 300, max_tokens=1)
    path = find_fixture_model(f"{NAME}.gguf")
    for bad in (0, 4097):
        with pytest.raises(mlxllama.MlxLlamaError, match=f"context length {bad} is not between 1 and the model's"
                                                         " trained context of 4096"):
            mlxllama.load(path, context_length=bad)
