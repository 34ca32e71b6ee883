"""The CUDA decode kernels (cuda_step.py) against the plain decode step, on every quantized fixture.

These run only where MLX runs on CUDA (the GPU scripts in benchmarks/ run them); elsewhere the
kernels are never used and the tests skip. The greedy and llama.cpp parity tests of
test_generation.py go through the kernels too when they run on CUDA.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxllama
from mlxllama.cache import make_cache

from conftest import find_fixture_model

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="the kernels run on MLX's CUDA backend only")

MODELS = ["chat-tiny-Q4_K_M.gguf", "chat-tiny-Q4_0.gguf", "chat-tiny-Q5_K_M.gguf", "chat-tiny-Q6_K.gguf",
          "chat-tiny-Q8_0.gguf", "chat-tiny-Q2_K.gguf", "chat-tiny-Q3_K_M.gguf", "mistral-tiny-Q4_K_M.gguf",
          "llama3-tiny-Q6_K.gguf", "qwen2-tiny-Q8_0.gguf", "phi3-tiny-Q5_K_M.gguf", "phi3-longrope-tiny-Q8_0.gguf"]
MODELS += [f"types-tiny-{t}.gguf" for t in
           ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]]
PROMPT = [1, 1724, 338, 278, 7483, 310, 5546, 29973]
STEPS = 12
# Mean KL divergence between the two steps' next-token distributions: both compute in float16,
# the kernels round less often (they keep normalized inputs and RoPE in float32).
MAX_KL = 1e-3


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max())
    return e / e.sum()


@pytest.mark.parametrize("name", MODELS)
def test_kernel_step_matches_the_plain_step(name):
    runtime = mlxllama.load(find_fixture_model(name))
    model = runtime.model
    kernel_step = model.kernel_step
    assert kernel_step is not None
    ids = [i % runtime.config.vocab_size for i in PROMPT]
    caches = make_cache(runtime.config.n_layers), make_cache(runtime.config.n_layers)
    for cache in caches:
        model(mx.array([ids]), cache)
    token = mx.array([[ids[-1]]])
    kls = []
    for step in range(STEPS):
        got = np.array(model.step(token, caches[0])[0])
        model.kernel_step = None
        want = np.array(model.step(token, caches[1])[0])
        model.kernel_step = kernel_step
        assert caches[0][0].offset == caches[1][0].offset == len(ids) + step + 1
        p, q = softmax(want.astype(np.float64)), softmax(got.astype(np.float64))
        kls.append(float(np.sum(p * (np.log(p + 1e-30) - np.log(q + 1e-30)))))
        assert np.argmax(got) == np.argmax(want) or np.max(want) - want[np.argmax(got)] < 0.05, step
        token = mx.array([[int(np.argmax(want))]])
    assert np.mean(kls) < MAX_KL, kls
    # The kernels wrote the same keys and values into the cache as the plain step.
    filled = len(ids) + STEPS
    for layer_a, layer_b in zip(*caches):
        for a, b in ((layer_a.keys, layer_b.keys), (layer_a.values, layer_b.values)):
            a, b = np.array(a[..., :filled, :], np.float32), np.array(b[..., :filled, :], np.float32)
            np.testing.assert_allclose(a, b, atol=0.02 * np.abs(b).max() + 1e-3)


def test_kernel_step_is_off_for_dequantized_models():
    runtime = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"), dequantize=True)
    assert runtime.model.kernel_step is None

