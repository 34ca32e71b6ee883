"""Llama 3, Qwen2 (also with YaRN), Qwen3, Phi-3, Mistral, Gemma 3, Qwen3-MoE and Mixtral against llama.cpp: tokenization, logits (KL),
argmax and greedy ids, on short prompts and at every 64th position of a prompt of over 4,096 tokens.

The fixtures (tests/fixtures/{llama3,qwen2,qwen3,phi3,mistral,gemma3,qwen3moe,mixtral}-tiny-*.gguf) are random-weight transformers models
with real, cut-down tokenizers, converted and quantized by llama.cpp's own tools; the references
(tests/reference/arch/*.npz) hold llama.cpp's ids and logits for their prompts. Both were made by
scripts/make_arch_fixtures.py. The same bars as test_llama_parity.py apply. test_longrope.py checks
phi3-longrope-tiny's references at other context sizes.

Qwen3's, Gemma 3's and the mixtures' references are llama.cpp on a float32 copy of the fixture's dequantized
weights (the exact answer for those weights; llama.cpp's quantized path rounds activations to 8
bits, which with their peaked attention moves its logits by a KL of 1e-3 or more), so their bar is
tighter: the largest KL as well as the mean, under 1e-3 with --dequantize. Natively a K-quant's
scales are kept as float16 (quants.AFFINE_SCALE_DTYPE), which at depth moves the largest KL of the
Q4_K_M fixture to about 1.2e-3: there the largest may reach NATIVE_MAX_KL.
"""


from functools import lru_cache

import mlx.core as mx
import numpy as np
import pytest

import mlxllama

from conftest import REFERENCE, find_fixture_model
from test_llama_parity import MAX_MEAN_KL, assert_greedy_matches, assert_logits_match, kl_per_position

REFERENCE_DIR = REFERENCE / "arch"
REFERENCES = sorted(p.stem for p in REFERENCE_DIR.glob("*.npz"))
PROMPTS = ("chat", "plain")
# Random weights give flatter distributions than a trained model's, so fewer positions clear
# NEAR_TIE than test_llama_parity.py asks of its fixtures; the KL bar still covers every position.
MIN_DECIDED = 0.5
# llama.cpp's n_ctx when the references were recorded: it picks Phi-3's LongRoPE factors, so the
# models are loaded for the same context.
REFERENCE_CONTEXT = 512
# The long prompt's references were recorded at this n_ctx (scripts/make_arch_fixtures.py).
LONG_CONTEXT = 8192
LONG_REFERENCES = [n for n in REFERENCES if not n.startswith("phi3-longrope")]  # trained for 4,096 only
EXACT = ("qwen3", "gemma3", "mixtral")  # references from llama.cpp on the dequantized weights (qwen3moe too)
NATIVE_MAX_KL = 5e-3


@lru_cache(maxsize=1)
def model(name: str):
    return mlxllama.load(find_fixture_model(f"{name}.gguf"), context_length=REFERENCE_CONTEXT)


def reference(name: str) -> dict:
    with np.load(REFERENCE_DIR / f"{name}.npz") as data:
        return {key: data[key] for key in data.files}


def test_every_architecture_has_a_reference():
    assert {name.split("-")[0] for name in REFERENCES} == {"llama3", "qwen2", "qwen3", "phi3", "mistral", "gemma3",
                                                           "qwen3moe", "mixtral"}


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


@pytest.mark.parametrize("name", [n for n in REFERENCES if n.startswith(EXACT)])
@pytest.mark.parametrize("dequantize", [False, True], ids=["native", "dequantize"])
def test_the_exact_references_hold_at_every_position(name, dequantize):
    m = mlxllama.load(find_fixture_model(f"{name}.gguf"), context_length=REFERENCE_CONTEXT, dequantize=dequantize)
    ref = reference(name)
    for prompt in PROMPTS:
        kl = kl_per_position(ref, prompt, m.logits(ref[f"{prompt}/ids"].tolist()))
        largest = MAX_MEAN_KL if dequantize else NATIVE_MAX_KL
        assert kl.mean() < MAX_MEAN_KL and kl.max() < largest, f"{name} {prompt}: KL {kl.mean():.2e}, {kl.max():.2e}"


@lru_cache(maxsize=None)
def long_logits(name: str, window: int | None = None, local_base: float | None = None,
                tokens: int | None = None) -> tuple:
    """Our logits at the long reference's positions (those among its first `tokens`, if given);
    `window`/`local_base` replace the sliding layers' window or RoPE base, to show that the test
    catches a wrong one."""
    m = mlxllama.load(find_fixture_model(f"{name}.gguf"), context_length=LONG_CONTEXT)
    for block in m.model.blk:
        if block.window and window is not None:
            block._window = window
        if block.window and local_base is not None:
            block._rope_base = local_base
    ref = reference(name)
    ids = ref["long/ids"].tolist()[:tokens]
    return m, prefill_logits(m.model, ids, [p for p in ref["long/positions"] if p < len(ids)])


def prefill_logits(model, ids: list[int], positions) -> np.ndarray:
    """Logits at `positions`, the prompt fed in chunks of 512 through the model's own cache, as
    generate feeds it: a sliding layer's cache keeps only its window, and attention costs the
    window, not the prompt."""
    cache, hidden = model.make_cache(), []
    for start in range(0, len(ids), 512):
        h = model.hidden_states(mx.array([ids[start : start + 512]]), cache)[0]
        wanted = [int(p) - start for p in positions if start <= p < start + 512]
        hidden.append(h[mx.array(wanted)] if wanted else h[:0])
        mx.eval(hidden[-1], [layer.state for layer in cache])
    assert all(layer.offset == len(ids) for layer in cache)
    return np.array(model.head(mx.concatenate(hidden)))


# Native mode only: what a long prompt tests (the cache's growth, sliding windows, positions past
# 4,096) is the same code in both modes, and the short prompts test --dequantize against the exact
# references.
@pytest.mark.parametrize("name", LONG_REFERENCES)
def test_logits_match_llama_cpp_past_4096_tokens(name):
    m, ours = long_logits(name)
    ref = reference(name)
    assert len(ref["long/ids"]) >= 4096 and m.tokenize(str(ref["long/text"])) == ref["long/ids"].tolist()
    kl = kl_per_position(ref, "long", ours)
    assert kl.mean() < MAX_MEAN_KL, f"{name}: mean KL {kl.mean():.2e}, largest {kl.max():.2e}"
    if name.startswith(EXACT):
        assert kl.max() < NATIVE_MAX_KL, f"{name}: largest KL {kl.max():.2e} at {ref['long/positions'][kl.argmax()]}"
    top = ref["long/top_logits"]
    decided = top[:, 0] - top[:, 1] >= 0.1
    assert decided.mean() > MIN_DECIDED
    np.testing.assert_array_equal(ours.argmax(axis=1)[decided], ref["long/top_ids"][decided, 0], err_msg=name)


@pytest.mark.parametrize("change", [dict(window=64), dict(window=0), dict(local_base=1e6)], ids=str)
def test_a_wrong_window_or_local_rope_base_fails_the_long_test(change):
    """The Gemma 3 fixture's attention is peaked enough that its window and local RoPE base matter."""
    name, tokens = next(n for n in REFERENCES if n.startswith("gemma3")), 1024  # 32 windows are enough
    _, ours = long_logits(name, **change, tokens=tokens)
    ref = reference(name)
    kept = ref["long/positions"] < tokens
    ref = {f"long/{k}": ref[f"long/{k}"][kept] for k in ("top_ids", "top_logits", "logsumexp")}
    assert kl_per_position(ref, "long", ours).mean() > 10 * MAX_MEAN_KL


@pytest.mark.parametrize("name", REFERENCES)
def test_greedy_continuation_matches_llama_cpp(name):
    m, ref = model(name), reference(name)
    for prompt in PROMPTS:
        assert_greedy_matches(m, ref, prompt, f"{name} {prompt}")


def test_each_fixture_exercises_its_architecture():
    llama3, qwen2, phi3, mistral, qwen3, gemma3 = (model(next(n for n in REFERENCES if n.startswith(a))).config
                                                   for a in ("llama3", "qwen2", "phi3", "mistral", "qwen3", "gemma3"))
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
    # Qwen3: Q/K norms, a head size other than hidden / heads, NeoX RoPE with theta 1e6, tied output
    assert (qwen3.architecture, qwen3.qk_norm, qwen3.head_dim, qwen3.hidden_size // qwen3.n_heads) == (
        "qwen3", True, 128, 64)
    assert (qwen3.rope_traditional, qwen3.rope_base, qwen3.tied_output, qwen3.attn_bias) == (False, 1e6, True, False)
    # Gemma 3: five sliding layers (window 32, base 10,000) and a global one (1e6), GeGLU, post norms,
    # embeddings scaled by sqrt(256), 1 KV head
    assert (gemma3.architecture, gemma3.sliding_window, gemma3.sliding_layers) == (
        "gemma3", 32, (True, True, True, True, True, False))
    assert (gemma3.rope_base, gemma3.rope_base_local, gemma3.ffn_activation, gemma3.embedding_scale) == (
        1e6, 10000.0, "gelu", 16.0)
    assert gemma3.qk_norm and gemma3.post_norms and gemma3.n_kv_heads == 1 and gemma3.attention_scale == 64**-0.5
    # Qwen2 with YaRN (factor 4 over 4,096): per-pair divisors between 1 and 4, cos/sin scaled by 1 + 0.1 ln 4
    yarn = model(next(n for n in REFERENCES if n.startswith("qwen2-yarn"))).config
    assert yarn.rope_scale == 1.0 and abs(yarn.rope_attn_factor - (1 + 0.1 * np.log(4))) < 1e-6
    assert yarn.rope_freq_factors[0] == 1.0 and yarn.rope_freq_factors[-1] == 4.0
    # Mixtures of experts: Qwen3-MoE (Qwen3's attention) and Mixtral (`llama`), four experts, two used
    qwen3moe, mixtral = (model(next(n for n in REFERENCES if n.startswith(a))).config for a in ("qwen3moe", "mixtral"))
    assert (qwen3moe.architecture, qwen3moe.qk_norm, qwen3moe.head_dim, qwen3moe.n_experts, qwen3moe.n_experts_used,
            qwen3moe.expert_ffn_size) == ("qwen3moe", True, 128, 4, 2, 256)
    assert (mixtral.architecture, mixtral.rope_traditional, mixtral.n_experts, mixtral.n_experts_used,
            mixtral.expert_ffn_size) == ("llama", True, 4, 2, 512)


@pytest.mark.parametrize("wrong", ["no YaRN", "interpolation only", "no scale"])
def test_a_wrong_yarn_fails_the_parity_bar(wrong, monkeypatch):
    """Without YaRN, with every pair interpolated, or without its cos/sin scale, the Qwen2 YaRN
    fixture's logits leave llama.cpp's by more than three times the bar."""
    import mlxllama.models.config as config

    real = config.yarn_factors

    def changed(factor, rope_dim, base, original, log_multiplier=0.0):
        divisors, scale = real(factor, rope_dim, base, original, log_multiplier)
        return {"no YaRN": ((1.0,) * len(divisors), 1.0), "interpolation only": ((factor,) * len(divisors), scale),
                "no scale": (divisors, 1.0)}[wrong]

    monkeypatch.setattr(config, "yarn_factors", changed)
    name = next(n for n in REFERENCES if n.startswith("qwen2-yarn"))
    m, ref = mlxllama.load(find_fixture_model(f"{name}.gguf"), context_length=REFERENCE_CONTEXT), reference(name)
    assert kl_per_position(ref, "plain", m.logits(ref["plain/ids"].tolist())).mean() > 3 * MAX_MEAN_KL


@pytest.mark.parametrize("name", ["qwen3moe", "mixtral"])
@pytest.mark.parametrize("wrong", ["not renormalized", "one expert", "every expert"])
def test_a_wrong_router_fails_the_parity_bar(name, wrong, monkeypatch):
    """Expert weights left as the softmax gave them, or one expert, or all of them, a token: the
    mixture fixtures' logits leave llama.cpp's by twice the bar, and by 20 times what the right
    router's do. (Mixtral's tiny router leaves little unrenormalized: its mean KL is 3.1 times the
    bar in float32 and 2.3 times in float16, against the right router's 0.007 and 0.04 times.)"""
    from mlxllama.models.transformer import Block

    real = Block.mixture

    def changed(block, x):
        c = block.config
        if wrong == "not renormalized":
            probs = mx.softmax(block.ffn_gate_inp(x).astype(mx.float32), axis=-1)
            chosen = mx.argpartition(-probs, kth=c.n_experts_used - 1, axis=-1)[..., : c.n_experts_used]
            weights = mx.take_along_axis(probs, chosen, axis=-1)
            h = x[..., None, None, :]
            h = block._gated(block.ffn_gate_exps(h, chosen), block.ffn_up_exps(h, chosen))
            return (block.ffn_down_exps(h, chosen)[..., 0, :] * weights[..., None]).sum(axis=-2)
        used = 1 if wrong == "one expert" else c.n_experts
        object.__setattr__(c, "n_experts_used", used)
        try:
            return real(block, x)
        finally:
            object.__setattr__(c, "n_experts_used", 2)

    monkeypatch.setattr(Block, "mixture", changed)
    fixture = next(n for n in REFERENCES if n.startswith(name))
    m, ref = mlxllama.load(find_fixture_model(f"{fixture}.gguf"), context_length=REFERENCE_CONTEXT), reference(fixture)
    ids = ref["plain/ids"].tolist()
    wrong = kl_per_position(ref, "plain", m.logits(ids)).mean()
    monkeypatch.undo()
    right = kl_per_position(ref, "plain", m.logits(ids)).mean()
    assert wrong > 2 * MAX_MEAN_KL and wrong > 20 * right


def sorted_gather_mm_is_right() -> bool:
    """Whether MLX's gathered product over rows sorted by expert (what the dequantized mixture runs
    when it sorts) gives the unsorted product's values, on this device: 128 rows over 8 experts of
    256 x 512, a shape where MLX 0.32.4's CUDA build is wrong by more than the values themselves
    (smaller ones came out right there)."""
    w, x = mx.random.normal((8, 256, 512), key=mx.random.key(0)), mx.random.normal((128, 1, 256), key=mx.random.key(1))
    experts = mx.sort(mx.random.randint(0, 8, (128,), key=mx.random.key(2)))
    sorted_product = mx.gather_mm(x, w, rhs_indices=experts, sorted_indices=True)
    return mx.allclose(sorted_product, mx.gather_mm(x, w, rhs_indices=experts), rtol=1e-2, atol=0.1).item()


@pytest.mark.parametrize("name", ["qwen3moe", "mixtral"])
@pytest.mark.parametrize("dequantize", [False, True], ids=["native", "dequantize"])
def test_experts_run_in_expert_order_give_the_same_logits(name, dequantize, monkeypatch):
    """The sorted path Metal takes for long inputs (transformer.expert_outputs), forced: the same
    products in another order, so the logits of the unsorted path within 1e-5 in float32 (on a GPU,
    whose float16 products the other order rounds apart, within the parity bar only) and
    llama.cpp's within the bar."""
    from mlxllama.models import transformer

    if dequantize and not sorted_gather_mm_is_right():
        pytest.skip("this MLX's gather_mm(sorted_indices=True) gives other products than unsorted on this "
                    "device (MLX 0.32.4's CUDA build, an H100); expert_outputs sorts on Metal only")
    fixture = next(n for n in REFERENCES if n.startswith(name))
    m, ref = mlxllama.load(find_fixture_model(f"{fixture}.gguf"), context_length=REFERENCE_CONTEXT,
                           dequantize=dequantize), reference(fixture)
    ids = ref["plain/ids"].tolist()
    assert len(ids) * m.config.n_experts_used >= transformer.SORT_EXPERTS_MIN_PAIRS
    plain = m.logits(ids)
    calls = []
    real = transformer.expert_outputs
    monkeypatch.setattr(transformer, "expert_outputs",
                        lambda *args: calls.append(1) or real(*args, sort=True))
    ordered = m.logits(ids)
    assert len(calls) == m.config.n_layers
    if m.model.compute_dtype == mx.float32:
        np.testing.assert_allclose(ordered, plain, rtol=0, atol=1e-5)
    assert kl_per_position(ref, "plain", ordered).mean() < MAX_MEAN_KL
