"""The CUDA decode kernels (mlxllama.cuda) against the plain decode step, on every quantized fixture.

These run only where MLX runs on CUDA (the GPU scripts in benchmarks/ run them); elsewhere the
kernels are never used and the tests skip. The greedy and llama.cpp parity tests of
tests/unit/test_generation.py go through the kernels too when they run on CUDA.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from unittest.mock import patch

import gguf
import mlx.core as mx
import numpy as np
import pytest

import mlxllama
from mlxllama import synthetic
from mlxllama.batching import Request, batch_generate
from mlxllama.cache import KVQuantization, kv_map
from mlxllama.cuda import KernelStep, kernels
from mlxllama.cuda.step import device_limits
from mlxllama.generate import prefill
from mlxllama.models.transformer import EXPLICIT
from mlxllama.prompt import Template, build_prompt, messages_for
from mlxllama.quantized_layers import NativeLinear
from mlxllama.quants import AffineWeight, to_affine

from conftest import assert_same_greedy, find_fixture_model, load_as_on_cuda

on_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the kernels run on MLX's CUDA backend only")

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


def kl_with_argmax_checked(want: np.ndarray, got: np.ndarray, where=None) -> float:
    """KL divergence of got's next-token distribution from want's (one row of logits each), once
    their argmax is checked to agree up to a near-tie (0.05 of a logit)."""
    top = np.argmax(got)
    assert top == np.argmax(want) or np.max(want) - want[top] < 0.05, where
    p, q = softmax(want.astype(np.float64)), softmax(got.astype(np.float64))
    return float(np.sum(p * (np.log(p + 1e-30) - np.log(q + 1e-30))))


def batch_caches(model, prompts: list[list[int]]) -> tuple[tuple[list, list], list[list[int]]]:
    """Two BatchKVCaches alike, a row for each prompt (prefilled alone, as batch decoding joins
    rows), and each prompt's greedy next token."""
    caches = model.make_batch_cache(), model.make_batch_cache()
    tokens = []
    for ids in prompts:
        single = model.make_cache()
        tokens.append([int(mx.argmax(prefill(model, ids, single)))])
        for a, b, row in zip(*caches, single):
            a.add(row)
            b.add(row)
    return caches, tokens


def assert_rows_cached_alike(caches: tuple[list, list], lengths: list[int], quantization: KVQuantization | None):
    """Each row's first lengths[row] slots alike in every layer of the two caches (assert_cached_alike)."""
    for layer_a, layer_b in zip(*caches):
        for row, length in enumerate(lengths):
            assert_cached_alike(*((kv_map(lambda x: x[row, :, :length], layer.keys),
                                   kv_map(lambda x: x[row, :, :length], layer.values)) for layer in (layer_a, layer_b)),
                                quantization)


@on_cuda
@pytest.mark.parametrize("name", MODELS)
def test_kernel_step_matches_the_plain_step(name):
    runtime = mlxllama.load(find_fixture_model(name))
    assert isinstance(runtime.model.decode_step, KernelStep)
    assert_steps_match(runtime.model, runtime.model.decode_step, [i % runtime.config.vocab_size for i in PROMPT])


@on_cuda
@pytest.mark.parametrize("blocks,length", [(None, 70), (None, 300), (3, 300), (1, 300)])
def test_kernel_step_over_many_runs_of_slots(blocks, length):
    """chat-tiny's 8 heads in 2 groups of 4 (kernels.query_heads), attended on tensor cores. 70
    cached slots: 3 runs of one chunk (32 slots) in one block (a team), which combines them; 300: 10
    runs; on 3 blocks, one team a group too; on 1 block, which takes the two groups' teams in turn."""
    runtime = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
    step = runtime.model.decode_step
    if blocks is not None:
        step = KernelStep(runtime.model, step.fallback, blocks, device_limits()[1])
    assert kernels.tensor_runs(runtime.config) and not step.staged_keys
    assert kernels.query_heads(runtime.config) == 4
    ids = np.random.default_rng(0).integers(3, runtime.config.vocab_size, length).tolist()
    assert_steps_match(runtime.model, step, ids)


@pytest.fixture(scope="module")
def tinyllama(tmp_path_factory):
    """A random-weight file of TinyLlama's layout (32 heads over 4 KV heads of 64 dims), loaded once."""
    path = tmp_path_factory.mktemp("tinyllama") / "tinyllama.gguf"
    synthetic.write(path, context=4096)
    return mlxllama.load(path)


@on_cuda
def test_kernel_step_with_two_head_groups_a_kv_head(tinyllama):
    """TinyLlama's layout (8 query heads a KV head, taken 4 at a time, so two warps read each KV
    head's slots of a run) at 2,000 cached slots, through the kernels and the plain step (random
    weights: a head group attending to another KV head's values would give other outputs): 63 runs
    of a chunk a group, in 4 teams whose partial results the last done combines."""
    assert kernels.query_heads(tinyllama.config) == 4
    ids = np.random.default_rng(1).integers(3, tinyllama.config.vocab_size, 2000).tolist()
    assert_steps_match(tinyllama.model, tinyllama.model.decode_step, ids)


@on_cuda
def test_kernel_step_with_runs_of_several_steps(tinyllama):
    """On one block, TinyLlama's 8 head groups at 2,000 cached slots are one team each, taken in
    turn: 16 runs of 4 chunks a group (the last of 3), each run's next rows loaded while it computes
    a step."""
    model = tinyllama.model
    step = KernelStep(model, model.decode_step.fallback, 1, device_limits()[1])
    ids = np.random.default_rng(5).integers(3, tinyllama.config.vocab_size, 2000).tolist()
    assert_steps_match(model, step, ids)


@on_cuda
@pytest.mark.parametrize("kv_bits", [None, 8])
def test_kernel_step_with_more_chunks_than_warps(tinyllama, kv_bits):
    """On one block a head group has one team of 16 warps (15 runs beside a quantized cache's new
    slot, a run of its own), as at depth 8,192 on a GPU of 132 SMs it has 16 teams: at 520 to 531
    cached slots, 17 chunks, more than its runs may be, so they are 9 runs of two chunks (the last
    of one)."""
    model = tinyllama.model
    model.store_kv_quantized(kv_bits and KVQuantization(kv_bits))
    try:
        step = KernelStep(model, model.decode_step.fallback, 1, device_limits()[1])
        ids = np.random.default_rng(6).integers(3, tinyllama.config.vocab_size, 520).tolist()
        assert_steps_match(model, step, ids)
    finally:
        model.store_kv_quantized(None)


@on_cuda
def test_kernel_step_with_gate_and_up_of_two_widths():
    """Gate at 4 bits and up at 8, as no llama.cpp mix among the fixtures has them (fusion.py then
    stacks neither): layer_kernel's items of gate rows and of up rows each read their own form."""
    model = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf")).model
    ffn = model.config.ffn_size
    for block in model.blk:
        fused = block["ffn_gate_up"]
        gate, up = ([fused[n][rows] for n in ("weight", "scales", "biases")]
                    for rows in (slice(0, ffn), slice(ffn, None)))
        dense_up = mx.dequantize(*up, group_size=fused.group_size, bits=fused.bits)
        del block["ffn_gate_up"]
        block["ffn_gate"] = NativeLinear(AffineWeight(*gate, fused.bits, fused.qtype, fused.group_size), False)
        block["ffn_up"] = NativeLinear(AffineWeight(*mx.quantize(dense_up, group_size=fused.group_size, bits=8), 8,
                                                    fused.qtype, fused.group_size), False)
    step = KernelStep(model, model.decode_step.fallback, *device_limits())
    assert {(layer["gate"].bits, layer["up"].bits) for layer in step.layers} == {(4, 8)}
    ids = np.random.default_rng(2).integers(3, model.config.vocab_size, 40).tolist()
    assert_steps_match(model, step, ids)


@on_cuda
@pytest.mark.parametrize("length", [1, 70, 300])
def test_kernel_step_over_a_quantized_cache(length):
    """chat-tiny with 8-bit keys and values (heads of 32: one group a head), on tensor cores: the new
    slot quantized by the kernel (fed to attention and stored as mx.quantize would) as a run of its
    own, beside runs over the cached slots from one slot of one (the first steps: the kernels take a
    quantized cache once it holds a slot) to many."""
    runtime = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"), kv_quantization=KVQuantization(8))
    assert kernels.tensor_runs(runtime.config, kv_group=32)
    ids = np.random.default_rng(2).integers(3, runtime.config.vocab_size, length).tolist()
    assert_steps_match(runtime.model, runtime.model.decode_step, ids)


@on_cuda
@pytest.mark.parametrize("bits,key_bits", [(8, None), (4, None), (4, 8)])
def test_kernel_step_over_a_quantized_cache_of_two_groups_a_head(tinyllama, bits, key_bits):
    """TinyLlama's layout at 2,000 slots with keys and values quantized in groups of 32 (two a
    head): 8-bit, 4-bit, and 8-bit keys with 4-bit values (--kv-key-bits), on tensor cores, 4 query
    heads a warp as over a plain cache."""
    assert kernels.tensor_runs(tinyllama.config, kv_group=32) and kernels.query_heads(tinyllama.config, 32) == 4
    model = tinyllama.model
    model.store_kv_quantized(KVQuantization(bits, key_bits=key_bits))
    try:
        assert model.kv_quantization.group_size == 32
        ids = np.random.default_rng(3).integers(3, tinyllama.config.vocab_size, 2000).tolist()
        assert_steps_match(model, model.decode_step, ids)
    finally:
        model.store_kv_quantized(None)


@on_cuda
@pytest.mark.parametrize("kv_bits", [None, 8])
def test_kernel_step_off_tensor_cores(monkeypatch, kv_bits):
    """attention_run's runs in layer_kernel (heads wider than TENSOR_RUNS_MAX_HEAD_DIM; here chat-tiny's
    heads of 32 with that bound made 0 in the source the kernels are built from): a plain cache's
    keys staged in shared memory, and an 8-bit cache's slots with the new one last in the last run,
    at 300 cached slots (10 runs of a chunk, combined by their block)."""
    monkeypatch.setattr(kernels, "HEADER", re.sub(r"TENSOR_RUNS_MAX_HEAD_DIM = \d+;", "TENSOR_RUNS_MAX_HEAD_DIM = 0;",
                                                  kernels.HEADER))
    monkeypatch.setattr(kernels, "TENSOR_RUNS_MAX_HEAD_DIM", 0)
    kernels.kernel.cache_clear()
    try:
        quantization = KVQuantization(kv_bits) if kv_bits else None
        runtime = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"), kv_quantization=quantization)
        step = runtime.model.decode_step
        assert not kernels.tensor_runs(runtime.config) and step.staged_keys  # a quantized cache stages none
        ids = np.random.default_rng(4).integers(3, runtime.config.vocab_size, 300).tolist()
        assert_steps_match(runtime.model, step, ids)
    finally:
        kernels.kernel.cache_clear()


@on_cuda
def test_kernel_step_past_the_quantized_start():
    """--quantized-kv-start: the kernels decode the plain cache, the plain step quantizes it at the
    step that passes the start, and the kernels decode the quantized cache after; the logits follow
    the plain step's throughout."""
    prompt = len(PROMPT)
    runtime = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"),
                            kv_quantization=KVQuantization(8, start=prompt + 3))
    model, kernel_step = runtime.model, runtime.model.decode_step
    fell_back = []
    reference = kernel_step.fallback

    def counted(tokens, cache):
        fell_back.append(cache[0].offset)
        return reference(tokens, cache)

    caches = model.make_cache(), model.make_cache()
    for cache in caches:
        model(mx.array([PROMPT]), cache)
    token = mx.array([[PROMPT[-1]]])
    kernel_step.fallback = counted
    try:
        for _ in range(8):
            got = np.array(kernel_step(token, caches[0])[0])
            want = np.array(reference(token, caches[1])[0])
            assert np.argmax(got) == np.argmax(want)
            np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max())
            token = mx.array([[int(np.argmax(want))]])
    finally:
        kernel_step.fallback = reference
    assert fell_back == [prompt + 3] and caches[0][0].quantized


def assert_steps_match(model, kernel_step, ids: list[int]):
    """STEPS greedy steps after `ids` through kernel_step (which must not fall back to the plain
    step) and through the plain step, side by side."""
    reference = kernel_step.fallback

    def fell_back(tokens, cache):
        raise AssertionError(f"the kernel step fell back to the plain step at offset {cache[0].offset}")

    caches = model.make_cache(), model.make_cache()
    # Both prefilled alike: under CUDA's EXPLICIT_FIRST the second prefill of a shape of 512 ids or
    # more attends by the fused kernel, whose keys and values differ from the first's by rounding.
    with model.attending_prefill(EXPLICIT):
        for cache in caches:
            model(mx.array([ids]), cache)
    token = mx.array([[ids[-1]]])
    kls = []
    for step in range(STEPS):
        kernel_step.fallback = fell_back
        try:
            got = np.array(kernel_step(token, caches[0])[0])
        finally:
            kernel_step.fallback = reference
        want = np.array(reference(token, caches[1])[0])
        assert caches[0][0].offset == caches[1][0].offset == len(ids) + step + 1
        kls.append(kl_with_argmax_checked(want, got, step))
        token = mx.array([[int(np.argmax(want))]])
    assert np.mean(kls) < MAX_KL, kls
    # The kernels wrote the same keys and values into the cache as the plain step.
    assert_rows_cached_alike(caches, [len(ids) + STEPS], model.kv_quantization)


def assert_cached_alike(got: tuple, want: tuple, quantization: KVQuantization | None):
    """Cached (keys, values) alike: within float16 rounding, or for a quantized cache within one
    code step (the kernels quantize values computed in float32, the plain step in float16)."""
    code_steps = (0.0, 0.0)
    if quantization is not None and isinstance(want[0], tuple):
        code_steps = tuple(float(mx.max(mx.abs(scales))) for _, scales, _ in want)  # the largest scale
        got, want = quantization.decode(*got), quantization.decode(*want)
    for a, b, code_step in zip(got, want, code_steps):
        a, b = np.array(a, np.float32), np.array(b, np.float32)
        np.testing.assert_allclose(a, b, atol=0.02 * np.abs(b).max() + 1e-3 + 1.01 * code_step)


# Models for the batched kernel: 4-bit with stored biases and Q6_K layers (8-bit, none stored),
# 5-bit (the generic unpacking), NeoX RoPE with Q/K/V biases and a tied head, head dims 32 and 64;
# row counts that fill one tile of 8 sequences, part of one, and part of two.
# With 8-bit keys and values: heads of 32 (one group a head) and 64 (qwen2-tiny, two groups).
BATCHED = [("chat-tiny-Q4_K_M.gguf", 3, None), ("chat-tiny-Q4_K_M.gguf", 16, None), ("phi3-tiny-Q5_K_M.gguf", 8, None),
           ("qwen2-tiny-Q8_0.gguf", 11, None), ("chat-tiny-Q4_K_M.gguf", 16, 8), ("qwen2-tiny-Q8_0.gguf", 5, 8)]


@on_cuda
@pytest.mark.parametrize("name,rows,kv_bits", BATCHED)
def test_batched_kernel_step_matches_the_plain_forward(name, rows, kv_bits):
    """Rows of different lengths (a BatchKVCache, as batch decoding has them, one row past 64
    slots) through the batched kernel and through the plain forward pass, side by side."""
    runtime = mlxllama.load(find_fixture_model(name), kv_quantization=kv_bits and KVQuantization(kv_bits))
    model, kernel_step = runtime.model, runtime.model.decode_step
    assert kernel_step.takes(rows)
    rng = np.random.default_rng(rows)
    prompts = [rng.integers(3, runtime.config.vocab_size, 3 + 5 * i + (70 if i == 1 else 0)).tolist()
               for i in range(rows)]
    caches, tokens = batch_caches(model, prompts)
    assert kernel_step.takes_storage(caches[0][0])
    kls = []
    for step in range(STEPS):
        got = np.array(kernel_step(mx.array(tokens), caches[0]))
        want = np.array(kernel_step.fallback(mx.array(tokens), caches[1]))
        assert caches[0][0].lengths == caches[1][0].lengths == [len(p) + step + 1 for p in prompts]
        kls += [kl_with_argmax_checked(want[row], got[row], (step, row)) for row in range(rows)]
        tokens = [[int(t)] for t in np.argmax(want, axis=-1)]
    assert np.mean(kls) < MAX_KL, kls
    assert_rows_cached_alike(caches, caches[0][0].lengths, model.kv_quantization)


# Speculation's checks: one row of 5 positions after 70 slots (3 runs of slots a head group), 16
# positions of one row (two tiles) of qwen2-tiny (NeoX RoPE, biases, heads of 64), 3 rows of 5 of a
# BatchKVCache of rows of different lengths, as the server checks them.
CHECKS = [("chat-tiny-Q4_K_M.gguf", 1, 5), ("qwen2-tiny-Q8_0.gguf", 1, 16), ("chat-tiny-Q4_K_M.gguf", 3, 5)]


@on_cuda
@pytest.mark.parametrize("name,rows,n", CHECKS)
def test_kernels_check_drafts_as_the_plain_forward_pass(name, rows, n):
    """check_drafts through the batch kernel, a row's n positions n sequences sharing its cache:
    each position's logits and the cached keys and values are the plain forward pass's, the
    kernels never fall back, and after a rejection (the cache cut back) the next check writes
    over the dropped slots as the plain pass does."""
    runtime = mlxllama.load(find_fixture_model(name))
    model, kernel_step = runtime.model, runtime.model.decode_step
    reference, vocab = kernel_step.fallback, runtime.config.vocab_size
    rng = np.random.default_rng(n)
    prompts = [rng.integers(3, vocab, 70 + 9 * i).tolist() for i in range(rows)]
    if rows == 1:
        caches = model.make_cache(), model.make_cache()
        for cache in caches:
            prefill(model, prompts[0], cache)
    else:
        caches, _ = batch_caches(model, prompts)

    class NoFallback:
        def check_drafts(self, tokens, cache):
            raise AssertionError(f"the kernels' check of {tokens.shape} fell back to the plain step")

    def lengths(cache):
        return list(cache[0].lengths) if rows > 1 else [cache[0].offset]

    kls = []
    for check in range(3):
        tokens = mx.array(rng.integers(3, vocab, (rows, n)))
        before = lengths(caches[0])
        kernel_step.fallback = NoFallback()
        try:
            got = np.array(kernel_step.check_drafts(tokens, caches[0]))
        finally:
            kernel_step.fallback = reference
        want = np.array(reference.check_drafts(tokens, caches[1]))
        assert got.shape == want.shape == (rows, n, vocab)
        assert lengths(caches[0]) == lengths(caches[1]) == [length + n for length in before]
        kls += [kl_with_argmax_checked(want[row, position], got[row, position], (check, row, position))
                for row in range(rows) for position in range(n)]
        for cache in caches:  # the last n - 2 positions of each row rejected
            for layer in cache:
                if rows > 1:
                    layer.cut_rows([length + 2 for length in before])
                else:
                    layer.trim(n - 2)
    assert np.mean(kls) < MAX_KL, kls
    assert_rows_cached_alike(caches, lengths(caches[0]), None)


@on_cuda
def test_prompt_lookup_checks_its_drafts_in_the_kernels():
    """Greedy generation with prompt lookup on CUDA: every check goes through the kernels (none to
    the plain step) and the ids are plain decoding's, up to a near-tie (a check's batch kernel
    rounds otherwise than the one-sequence kernel)."""
    runtime = mlxllama.load(find_fixture_model("qwen2-tiny-Q8_0.gguf"))
    plain_step = runtime.model.decode_step.fallback
    ids = runtime.tokenize("Once upon a time")
    plain = runtime.generate(ids, 120).token_ids
    fell_back = []
    plain_step.check_drafts = lambda tokens, cache: (fell_back.append(tokens.shape)
                                                     or type(plain_step).check_drafts(plain_step, tokens, cache))
    try:
        result = runtime.generate(ids, 120, draft=2, draft_tokens=6)
    finally:
        del plain_step.check_drafts
    assert fell_back == [] and result.accepted > 30
    assert_same_greedy(runtime, ids, result.token_ids, plain)


@on_cuda
def test_batch_of_equal_rows_through_the_kernels_and_alone():
    """A KVCache of 9 identical rows (as bench decodes them) gives each row the one-sequence kernel's logits."""
    runtime = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
    model = runtime.model
    batched, alone = model.make_cache(), model.make_cache()
    model(mx.array([PROMPT] * 9), batched)
    model(mx.array([PROMPT]), alone)
    token = PROMPT[-1]
    for step in range(STEPS):
        got = np.array(model.step(mx.array([[token]] * 9), batched))
        want = np.array(model.step(mx.array([[token]]), alone))[0]
        assert batched[0].offset == alone[0].offset == len(PROMPT) + step + 1
        np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), atol=0.05 * np.abs(want).max())
        token = int(np.argmax(want))


@on_cuda
def test_a_step_whose_logits_are_never_read_still_writes_the_cache():
    """The kernels write keys and values in place, which MLX's graph does not track: steps whose
    logits nobody evaluates (a prompt's rest fed a token a step) must still fill their slots, or
    later steps attend to zeros (a served repeated prompt's log-probability was 0.0 against -0.12)."""
    runtime = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
    model = runtime.model
    fed, read = model.make_cache(), model.make_cache()
    for cache in (fed, read):
        model(mx.array([PROMPT[:-3]]), cache)
    for token in PROMPT[-3:-1]:
        model.step(mx.array([[token]]), fed)
        mx.eval(model.step(mx.array([[token]]), read))
    got, want = (np.array(model.step(mx.array([[PROMPT[-1]]]), cache)) for cache in (fed, read))
    np.testing.assert_array_equal(got, want)


@on_cuda
def test_batch_generate_through_the_kernels_as_rows_finish():
    """batch_generate on CUDA: 10 rows (two tiles of 8 sequences), then fewer as rows finish, down
    to one (the one-sequence kernel on a BatchKVCache row); each row's greedy ids are those of the
    prompt decoded alone."""
    runtime = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
    # The file's template as is: the GPU scripts run the tests from a checkout, without the built-in templates' package.
    template = Template("gguf", runtime.chat_template)
    questions = ["What is the capital of Japan?", "What is 17 plus 25?", "What is the capital of France?",
                 "What color is the sky?", "Name a fruit.", "What is 3 times 4?"]
    prompts = [build_prompt(runtime.tokenizer, template, messages_for(q)).ids for q in questions]
    prompts += [runtime.tokenize(t) for t in ["The capital of Italy is", "Once upon a time", "1, 2, 3, 4,", "Hello"]]
    max_tokens = [16, 12, 3, 20, 9, 5, 7, 14, 2, 24]
    alone = [runtime.generate(ids, max_tokens=n).token_ids for ids, n in zip(prompts, max_tokens)]
    kernel_step, rows_seen = runtime.model.decode_step, set()

    class CountingStep:
        uses_kernels, takes = True, kernel_step.takes

        def __call__(self, tokens, cache):
            rows_seen.add(tokens.shape[0])
            return kernel_step(tokens, cache)

    runtime.model.decode_step = CountingStep()
    batched = batch_generate(runtime, [Request(ids, n) for ids, n in zip(prompts, max_tokens)], batch_size=10)
    assert [r.token_ids for r in batched] == alone
    assert batched[0].text == "The capital of Japan is Tokyo."
    assert {10, 1} <= rows_seen and any(1 < n < 9 for n in rows_seen)


@on_cuda
def test_kernel_step_is_off_for_dequantized_models():
    runtime = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"), dequantize=True)
    assert not runtime.model.decode_step.uses_kernels


def test_batched_kernel_takes_up_to_16_rows_where_their_inputs_fit_in_shared_memory():
    runtime = load_as_on_cuda(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
    plain = runtime.model.decode_step
    h100 = KernelStep(runtime.model, plain, blocks=132, shared_bytes=232448)
    assert h100.takes(1) and h100.takes(2) and h100.takes(16) and not h100.takes(17)
    small = KernelStep(runtime.model, plain, blocks=132, shared_bytes=48 * 1024)
    assert small.takes(1) and not small.takes(2)
    # 16 rows of TinyLlama-1.1B's shapes: the down projection's 5632 inputs each, in float16 (~220 KB in all).
    tinyllama = replace(runtime.config, hidden_size=2048, n_heads=32, n_kv_heads=4, head_dim=64, ffn_size=5632)
    assert 200_000 < 4 * kernels.batch_shared_floats(tinyllama, 2, staged_keys=True) <= 232448


def test_attention_stages_keys_only_where_shared_memory_has_room_for_them():
    runtime = load_as_on_cuda(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
    plain, c = runtime.model.decode_step, runtime.config
    with_keys = 4 * kernels.layer_shared_floats(c, staged_keys=True)
    without = 4 * kernels.layer_shared_floats(c, staged_keys=False)
    # 16 warps' rows of 32 keys: head_dim float16 values and 16 bytes of padding each.
    assert with_keys - without == 16 * 32 * (2 * c.head_dim + 16)
    # chat-tiny's heads of 32 are attended on tensor cores, which stage no keys.
    assert kernels.tensor_runs(c)
    assert not KernelStep(runtime.model, plain, blocks=132, shared_bytes=with_keys).staged_keys
    # As for heads that attention_run takes (wider than TENSOR_RUNS_MAX_HEAD_DIM):
    with patch.object(kernels, "TENSOR_RUNS_MAX_HEAD_DIM", c.head_dim // 2):
        roomy = KernelStep(runtime.model, plain, blocks=132, shared_bytes=with_keys)
        assert roomy.staged_keys and roomy.takes(1)
        tight = KernelStep(runtime.model, plain, blocks=132, shared_bytes=with_keys - 4)
        assert not tight.staged_keys and tight.takes(1)


@pytest.mark.parametrize("head_dim,takes", [(32, True), (64, True), (96, False), (128, False), (256, False)])
def test_one_sequence_attends_on_tensor_cores_over_heads_of_up_to_64(chat_tiny_config, head_dim, takes):
    """decode_step.cu's tensor_attention_run holds a lane's rows of 32 slots in registers: for heads
    of 128 they spilled, and attention_run takes those."""
    assert kernels.TENSOR_RUNS_MAX_HEAD_DIM == 64
    assert kernels.tensor_runs(replace(chat_tiny_config, head_dim=head_dim)) == takes


@pytest.fixture(scope="module")
def chat_tiny_config():
    """chat-tiny's config, loaded once for the tests that only vary its head counts."""
    return mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf")).config


@pytest.mark.parametrize("heads,kv_heads,expected,over_quantized", [
    (32, 4, 4, 2), (32, 8, 4, 2), (32, 16, 2, 2), (32, 32, 1, 1), (14, 2, 1, 1), (12, 2, 2, 2), (8, 2, 4, 2)])
def test_attention_warps_take_the_query_heads_of_one_kv_head(chat_tiny_config, heads, kv_heads, expected,
                                                             over_quantized):
    """As many as the largest power of two dividing the heads a KV head serves, up to MAX_QUERY_HEADS;
    up to MAX_QUERY_HEADS_QUANTIZED over a quantized cache that attention_run reads (heads wider than
    tensor runs take, or groups other than 32), as many as over a plain cache on tensor cores."""
    config = replace(chat_tiny_config, n_heads=heads, n_kv_heads=kv_heads)
    wide = replace(config, head_dim=128)
    assert (kernels.MAX_QUERY_HEADS, kernels.MAX_QUERY_HEADS_QUANTIZED) == (4, 2)
    assert kernels.query_heads(config) == kernels.query_heads(config, kv_group=32) == expected
    assert kernels.query_heads(wide, kv_group=32) == kernels.query_heads(config, kv_group=64) == over_quantized
    assert kernels.head_groups(wide, kv_group=32) == heads // over_quantized


@pytest.mark.parametrize("blocks", [3, 16, 132])
@pytest.mark.parametrize("seqs", [8, 16])
def test_every_attention_item_has_a_warp_of_its_own_where_runs_are_combined(chat_tiny_config, blocks, seqs):
    """batch_layer_kernel's combining warps wait for the group's other runs (attention_items): where
    a group's runs are more than one and so are its combining warps, every (sequence, group, run)
    item must have a warp of its own, or a warp could wait for an item it would take itself later.
    (One sequence's teams wait for no other block: decode_step.cu's team_attention.)"""
    for heads, kv_heads in [(8, 2), (32, 4), (32, 8), (32, 32), (64, 8)]:
        config = replace(chat_tiny_config, n_heads=heads, n_kv_heads=kv_heads)
        runs = kernels.max_runs(blocks, config, seqs)
        assert 1 <= runs <= kernels.RUNS_LIMIT
        if min(runs, kernels.query_heads(config)) > 1:
            assert seqs * kernels.head_groups(config) * runs <= blocks * kernels.LAYER_THREADS // 32


@pytest.mark.parametrize("blocks", [3, 16, 132])
def test_one_sequence_scratch_holds_a_quantized_cache_s_partials(chat_tiny_config, blocks):
    """layer_kernel's scratch holds partials for a plain cache's MAX_RUNS rows a head (step.py sizes it
    once); over a quantized cache the kernel's MAX_RUNS (max_runs with its group size: more, smaller
    head groups where attention_run reads it) is never more."""
    for heads, kv_heads in [(8, 2), (32, 4), (32, 8), (32, 32), (64, 8)]:
        config = replace(chat_tiny_config, n_heads=heads, n_kv_heads=kv_heads)
        for kv_group in (32, 64):
            assert kernels.max_runs(blocks, config, 1, kv_group) <= kernels.max_runs(blocks, config)


@pytest.mark.parametrize("head_dim,bits,takes", [(32, 8, True), (32, 4, False), (64, 4, True), (64, 8, True),
                                                 (128, 4, True)])
def test_kernels_read_caches_quantized_in_whole_bytes_a_lane(chat_tiny_config, head_dim, bits, takes):
    """A lane reads the values of HEAD_DIM / 32 dims at once: 4-bit values of heads of 32 would be half a byte."""
    config = replace(chat_tiny_config, head_dim=head_dim)
    assert kernels.takes_quantized_cache(config, KVQuantization(bits).for_heads(head_dim)) == takes


def test_kernel_step_takes_a_quantized_cache_except_where_it_starts_quantizing():
    """Before --quantized-kv-start the cache is plain and the kernels take it; the step that passes
    the start goes to the plain step, which quantizes what the cache held; after, the kernels read
    it quantized. 4-bit values of chat-tiny's heads of 32 go the plain way throughout."""
    runtime = load_as_on_cuda(find_fixture_model("chat-tiny-Q4_K_M.gguf"), kv_quantization=KVQuantization(8, start=5))
    step = KernelStep(runtime.model, runtime.model.decode_step, blocks=132)
    cache = runtime.model.make_cache()
    runtime.model(mx.array([PROMPT[:4]]), cache)
    assert not cache[0].quantized and step.takes_storage(cache[0])
    runtime.model(mx.array([PROMPT[4:5]]), cache)
    assert not cache[0].quantized and not step.takes_storage(cache[0])
    runtime.model(mx.array([PROMPT[5:6]]), cache)
    assert cache[0].quantized and step.takes_storage(cache[0])
    runtime.model.store_kv_quantized(KVQuantization(4))
    cache = runtime.model.make_cache()
    runtime.model(mx.array([PROMPT]), cache)
    assert cache[0].quantized and not step.takes_storage(cache[0])


def test_the_header_reaches_mlx_as_one_include_of_a_file_named_by_its_text(tmp_path, monkeypatch):
    """MLX hashes a kernel's whole source at every launch, so the header goes to it as an #include
    of a file in the user's cache named by a hash of its text; where no file can be written, the
    text itself."""
    def included_file(line: str) -> Path:
        return Path(re.fullmatch(r'#include "(.*)"\n', line).group(1))

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    line = kernels.included(kernels.HEADER)
    path = included_file(line)
    assert path.parent == tmp_path / "mlxllama" / "cuda" and path.read_text() == kernels.HEADER
    assert kernels.included(kernels.HEADER) == line
    batch = included_file(kernels.included(kernels.BATCH_HEADER))
    assert batch != path and batch.read_text() == kernels.BATCH_HEADER
    path.write_text("changed behind the cache's back")
    assert kernels.included(kernels.HEADER) == line and path.read_text() == kernels.HEADER
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # a file where the directory should be
    assert kernels.included(kernels.HEADER) == kernels.HEADER


def test_kernel_step_is_off_without_cuda():
    runtime = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
    assert runtime.model.decode_step.uses_kernels == (mx.cuda.is_available() and mx.default_device() == mx.gpu)


def test_projections_of_fused_layers_are_the_files_tensors():
    """The kernels read Q, K, V (and gate, up) as row ranges of the fused layers: each range must be
    exactly the file's tensor, so the kernels are built here (no kernel runs) and compared."""
    path = find_fixture_model("chat-tiny-Q4_K_M.gguf")
    runtime = load_as_on_cuda(path)
    step = KernelStep(runtime.model, runtime.model.decode_step, blocks=132)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    fused_blocks = [i for i, block in enumerate(runtime.model.blk) if "attn_qkv" in block]
    assert fused_blocks and "ffn_gate_up" in runtime.model.blk[0]
    for i in fused_blocks[:2]:
        for part, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("gate", "ffn_gate"), ("up", "ffn_up")):
            tensor = tensors[f"blk.{i}.{name}.weight"]
            want = to_affine(tensor.data, tensor.tensor_type, tuple(int(n) for n in reversed(tensor.shape)))
            got = step.layers[i][part]
            assert got.bits == want.bits and got.stored_biases == (want.biases is not None)
            assert got.cols == int(tensor.shape[0]) and got.rows == int(tensor.shape[1])
            for a, b in ((got.weight, want.weight), (got.scales, want.scales)):
                np.testing.assert_array_equal(np.array(a), np.array(b), err_msg=f"blk.{i}.{name}")


def test_rope_inverse_frequencies_match_mlx_rope():
    """inv_freq[i] * position is the angle MLX's RoPE (the plain step's path) turns pair i by."""
    runtime = mlxllama.load(find_fixture_model("phi3-longrope-tiny-Q8_0.gguf"), context_length=256)
    c = runtime.config
    step = KernelStep(runtime.model, runtime.model.decode_step, blocks=132)
    position, half = 37, c.rope_dim // 2
    # Row i is 1 at dim i: NeoX pair (i, i + rope_dim / 2) turns it to (cos, sin) of pair i's angle.
    x = mx.eye(c.rope_dim)[:half].reshape(1, half, 1, c.rope_dim)
    freqs = runtime.model.blk[0]._rope_freqs
    rotated = np.array(mx.fast.rope(x, c.rope_dim, traditional=False, base=None if freqs is not None else c.rope_base,
                                    scale=c.rope_scale, offset=position, freqs=freqs))[0, :, 0]
    angles = np.arctan2(rotated[np.arange(half), np.arange(half) + half], rotated[np.arange(half), np.arange(half)])
    want = np.angle(np.exp(1j * position * np.array(step.inv_freq, np.float64)))
    assert c.rope_freq_factors is not None and len(set(c.rope_freq_factors)) > 1
    np.testing.assert_allclose(angles, want, atol=1e-4)
