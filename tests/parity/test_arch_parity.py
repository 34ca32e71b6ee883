"""Llama 3, Qwen2, Phi-3 and Mistral against llama.cpp: tokenization, logits (KL), argmax and greedy ids.

The fixtures (tests/fixtures/{llama3,qwen2,phi3,mistral}-tiny-*.gguf) are random-weight transformers models
with real, cut-down tokenizers, converted and quantized by llama.cpp's own tools; the references
(tests/reference/arch/*.npz) hold llama.cpp's ids and logits for their prompts. Both were made by
scripts/make_arch_fixtures.py. The same bars as test_llama_parity.py apply. test_longrope.py checks
phi3-longrope-tiny's references at other context sizes.
"""

from functools import lru_cache

import numpy as np
import pytest

import mlxllama

from conftest import REFERENCE, find_fixture_model
from test_llama_parity import assert_greedy_matches, assert_logits_match

REFERENCE_DIR = REFERENCE / "arch"
REFERENCES = sorted(p.stem for p in REFERENCE_DIR.glob("*.npz"))
PROMPTS = ("chat", "plain")
# Random weights give flatter distributions than a trained model's, so fewer positions clear
# NEAR_TIE than test_llama_parity.py asks of its fixtures; the KL bar still covers every position.
MIN_DECIDED = 0.5
# llama.cpp's n_ctx when the references were recorded: it picks Phi-3's LongRoPE factors, so the
# models are loaded for the same context.
REFERENCE_CONTEXT = 512


@lru_cache(maxsize=1)
def model(name: str):
    return mlxllama.load(find_fixture_model(f"{name}.gguf"), context_length=REFERENCE_CONTEXT)


def reference(name: str) -> dict:
    with np.load(REFERENCE_DIR / f"{name}.npz") as data:
        return {key: data[key] for key in data.files}


def test_every_architecture_has_a_reference():
    assert {name.split("-")[0] for name in REFERENCES} == {"llama3", "qwen2", "phi3", "mistral"}


@pytest.mark.parametrize("name", REFERENCES)
def test_tokenization_matches_llama_cpp(name):
    m, ref = model(name), reference(name)
    for prompt in PROMPTS:
        assert m.tokenize(str(ref[f"{prompt}/text"]), special=True) == ref[f"{prompt}/ids"].tolist(), prompt


@pytest.mark.parametrize("name", REFERENCES)
def test_logits_match_llama_cpp(name):
    m, ref = model(name), reference(name)
    for prompt in PROMPTS:
        assert_logits_match(m, ref, prompt, f"{name} {prompt}", MIN_DECIDED)


@pytest.mark.parametrize("name", REFERENCES)
def test_greedy_continuation_matches_llama_cpp(name):
    m, ref = model(name), reference(name)
    for prompt in PROMPTS:
        assert_greedy_matches(m, ref, prompt, f"{name} {prompt}")


def test_each_fixture_exercises_its_architecture():
    llama3, qwen2, phi3, mistral = (model(next(n for n in REFERENCES if n.startswith(a))).config
                                    for a in ("llama3", "qwen2", "phi3", "mistral"))
    # Llama 3: rope_freqs from the llama3 RoPE scaling, adjacent-pair RoPE, tied output
    assert (llama3.architecture, llama3.rope_traditional, llama3.tied_output) == ("llama", True, True)
    assert llama3.rope_freq_factors[0] == 1.0 and llama3.rope_freq_factors[-1] == 32.0
    # Qwen2: Q/K/V biases, NeoX RoPE
    assert (qwen2.architecture, qwen2.attn_bias, qwen2.rope_traditional) == ("qwen2", True, False)
    # Phi-3: fused QKV and gate/up, LongRoPE factors and attention factor, untied output
    assert (phi3.architecture, phi3.fused_qkv, phi3.fused_gate_up, phi3.tied_output) == ("phi3", True, True, False)
    assert phi3.rope_freq_factors is not None and phi3.rope_attn_factor > 1.0
    # Mistral: converted to `llama`, so adjacent-pair RoPE, with v0.2's theta 1e6, GQA, untied output
    assert (mistral.architecture, mistral.rope_traditional, mistral.rope_base) == ("llama", True, 1e6)
    assert mistral.n_kv_heads < mistral.n_heads and not mistral.tied_output and mistral.rope_freq_factors is None
