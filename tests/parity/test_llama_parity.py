"""Logits and greedy continuations against llama.cpp on the same files and the same token ids.

The references (tests/reference/llama_cpp/*.npz) were recorded from llama.cpp by
scripts/make_llama_reference.py; see its docstring for what they hold. Models come from
tests/fixtures or mlxllama/data when copied into the repo, else from ../shared/fixtures/models.
"""

from functools import lru_cache

import mlx.core as mx
import numpy as np
import pytest

import mlxllama

from conftest import REFERENCE, find_fixture_model

REFERENCE_DIR = REFERENCE / "llama_cpp"
REFERENCES = sorted(p.stem for p in REFERENCE_DIR.glob("*.npz"))
PROMPTS = ("japan", "sum", "italy")
PROMPT_TEXT = {
    "japan": "<|user|>\nWhat is the capital of Japan?</s>\n<|assistant|>\n",
    "sum": "<|user|>\nWhat is 17 plus 25?</s>\n<|assistant|>\n",
    "italy": "The capital of Italy is",
}
# Mean KL(llama.cpp || ours) per position: the bar. Measured: 2e-7 on the F16 file,
# at most 1.6e-4 on the quantized ones.
MAX_MEAN_KL = 1e-3
# llama.cpp's CPU path rounds activations to 8 bits (Q8_0 / Q8_K blocks) before quantized dot
# products and keeps an F16 KV cache; we compute in float32. That moves logits by up to a few
# hundredths, so where llama.cpp's own top two are closer than this the argmax is a coin toss.
# (Emulating its 8-bit activation rounding removed every such flip on the Q8_0 and Q6_K files and
# cut their KL sevenfold; every flip seen had a margin below 0.04.) Native mode (quantized weights
# kept quantized, the default) flipped one at 0.057 on chat-tiny-Q2_K: llama.cpp's rounding lifts
# its third-ranked token there by 0.07 in both modes, and dense mode kept the order by 0.004.
NEAR_TIE = 0.08


@lru_cache(maxsize=2)
def model(name: str):
    return mlxllama.load(find_fixture_model(f"{name}.gguf"))


def reference(name: str) -> dict:
    with np.load(REFERENCE_DIR / f"{name}.npz") as data:
        return {key: data[key] for key in data.files}


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def kl_per_position(ref: dict, prompt: str, ours: np.ndarray) -> np.ndarray:
    """KL(llama.cpp || ours), the reference's tail beyond its stored top-K lumped into one bucket."""
    top_ids = ref[f"{prompt}/top_ids"]
    ref_logp = ref[f"{prompt}/top_logits"].astype(np.float64) - ref[f"{prompt}/logsumexp"][:, None]
    our_logp = np.take_along_axis(log_softmax(ours.astype(np.float64)), top_ids, axis=1)
    ref_p = np.exp(ref_logp)
    kl = (ref_p * (ref_logp - our_logp)).sum(axis=1)
    ref_tail = np.clip(1.0 - ref_p.sum(axis=1), 1e-300, None)
    our_tail = np.clip(1.0 - np.exp(our_logp).sum(axis=1), 1e-300, None)
    return kl + ref_tail * (np.log(ref_tail) - np.log(our_tail))


def assert_logits_match(m, ref: dict, prompt: str, label: str, min_decided: float = 0.75) -> None:
    """Mean KL under the bar, and llama.cpp's argmax wherever its top two are not a near-tie."""
    ids = ref[f"{prompt}/ids"].tolist()
    ours = m.logits(ids)
    assert ours.shape == (len(ids), m.config.vocab_size)
    top_logits = ref[f"{prompt}/top_logits"]
    decided = top_logits[:, 0] - top_logits[:, 1] >= NEAR_TIE
    assert decided.mean() > min_decided, f"{label}: too few positions with a clear winner to compare"
    np.testing.assert_array_equal(ours.argmax(axis=1)[decided], ref[f"{prompt}/top_ids"][decided, 0], err_msg=label)
    kl = kl_per_position(ref, prompt, ours)
    assert kl.mean() < MAX_MEAN_KL, f"{label}: mean KL {kl.mean():.2e}, max {kl.max():.2e}"


def assert_greedy_matches(m, ref: dict, prompt: str, label: str) -> list[int]:
    """The same greedy ids up to llama.cpp's first near-tie; returns the positions of its near-ties."""
    expected = ref[f"{prompt}/greedy"].tolist()
    near_ties = np.nonzero(ref[f"{prompt}/greedy_margin"] < NEAR_TIE)[0]
    compared = int(near_ties[0]) if near_ties.size else len(expected)
    result = m.generate(ref[f"{prompt}/ids"].tolist(), max_tokens=len(expected))
    assert result.token_ids[:compared] == expected[:compared], label
    return near_ties.tolist()


@pytest.mark.parametrize("name", REFERENCES)
def test_logits_match_llama_cpp(name):
    m, ref = model(name), reference(name)
    for prompt in PROMPTS:
        assert_logits_match(m, ref, prompt, f"{name} {prompt}")


@pytest.mark.parametrize("name", ["chat-tiny-Q4_K_M", "types-tiny-F16"])
def test_logits_match_llama_cpp_computed_in_float16(name):
    """A GPU's compute type, on the CPU: float16 products, norms that read the stream as the
    residual add cast it to float16, float16 norm weights. Measured: mean KL 1.4e-4 and 4.7e-5,
    against 1.4e-4 and 3.7e-5 when each norm read the float32 stream with a float32 weight."""
    m, ref = mlxllama.load(find_fixture_model(f"{name}.gguf"), dtype=mx.float16), reference(name)
    for prompt in PROMPTS:
        assert_logits_match(m, ref, prompt, f"{name} {prompt} float16")


@pytest.mark.parametrize("name", REFERENCES)
def test_tokenization_matches_llama_cpp(name):
    m, ref = model(name), reference(name)
    for prompt in PROMPTS:
        assert m.tokenize(PROMPT_TEXT[prompt], special=True) == ref[f"{prompt}/ids"].tolist()


@pytest.mark.parametrize("name", REFERENCES)
def test_greedy_continuation_matches_llama_cpp(name):
    m, ref = model(name), reference(name)
    for prompt in PROMPTS:
        near_ties = assert_greedy_matches(m, ref, prompt, f"{name} {prompt}")
        if prompt != "italy":
            assert not near_ties, f"{name} {prompt}: the reference chat answer has a near-tie"


@pytest.mark.parametrize("name", REFERENCES)
def test_italy_continues_with_rome(name):
    m = model(name)
    result = m.generate("The capital of Italy is", max_tokens=4)
    assert result.text.startswith(" Rome."), result.text
