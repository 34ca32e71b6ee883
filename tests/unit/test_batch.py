"""Batched decoding and `mlxllama batch`, on the bundled chat-tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from importlib.resources import files

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

import mlxllama
from mlxllama.batch_jobs import BatchSettings, results_output, run_batch
from mlxllama.batching import BatchDecoder, Request, batch_generate
from mlxllama.cache import KVQuantization, kv_arrays, make_batch_cache, make_cache
from mlxllama.cli import main
from mlxllama.generate import prefill
from mlxllama.prompt_cache import PromptCache
from mlxllama.step_cost import launches
from mlxllama.prompt import NO_TEMPLATE, build_prompt, choose_template, messages_for
from mlxllama.sampling import SamplingParams

MODEL = str(files("mlxllama.data") / "chat-tiny-Q4_K_M.gguf")
RAW = ["The capital of Italy is", "Once upon a time", "1, 2, 3, 4,", "The quick brown fox jumps over the lazy dog"]
QUESTIONS = ["What is the capital of Japan?", "What is 17 plus 25?"]
# Differing prompt lengths, and max_tokens that make rows finish (and be replaced) at different steps;
# the templated questions end early on EOS.
MAX_TOKENS = [12, 3, 9, 5, 16, 14]


def logprob_rounding(runtime, kv: KVQuantization | None = None) -> float:
    """How far one token's log-probability may round apart when the same prompt goes through the
    model in other shapes (a padded group, a stepped rest, a row of a batch): 1e-4 computed in
    float32 (the CPU); in float16 (a GPU) up to 0.0033 was measured on an H100. With a quantized
    cache a key that rounds apart may be stored a level apart: on an H200, 0.0068 at 8 bits and
    0.018 at 4 (keys by channel)."""
    if runtime.model.compute_dtype == mx.float32:
        return 1e-4
    return 5e-3 if kv is None else 0.02 if kv.bits == 8 else 0.05


def key_rounding(runtime) -> float:
    """How far a cached key may round apart between those shapes: 1e-4 in float32; in float16 one
    unit in the last place of a value below 2 (0.00098 measured on an H100, at 0.5 to 1)."""
    return 1e-4 if runtime.model.compute_dtype == mx.float32 else 2e-3


@pytest.fixture(scope="module")
def runtime():
    return mlxllama.load(MODEL)


@pytest.fixture(scope="module")
def prompts(runtime):
    template = choose_template(runtime.chat_template)
    chat = [build_prompt(runtime.tokenizer, template, messages_for(q)).ids for q in QUESTIONS]
    return [runtime.tokenize(text) for text in RAW] + chat


@pytest.fixture(scope="module")
def sequential(runtime, prompts):
    return [runtime.generate(ids, max_tokens=n) for ids, n in zip(prompts, MAX_TOKENS)]


@pytest.fixture
def cli(runtime, monkeypatch):
    """Runs `mlxllama ...` in-process with the already loaded model."""
    monkeypatch.setattr("mlxllama.cli.load_model", lambda path: runtime)

    def run(*args, input=None):
        return CliRunner().invoke(main, list(args), input=input)

    return run


def test_batched_step_logits_are_bit_identical(runtime, prompts):
    model = runtime.model
    singles, tokens = [], []
    batch = model.make_batch_cache()
    for ids in prompts[:3]:
        single = model.make_cache()
        tokens.append(int(mx.argmax(prefill(model, ids, single))))
        for layer, row in zip(batch, single):
            layer.add(row)
        singles.append(single)
    for _ in range(3):
        batched = model(mx.array([[t] for t in tokens]), batch)[:, -1]
        alone = [model(mx.array([[t]]), single)[0, -1] for t, single in zip(tokens, singles)]
        for row, logits in enumerate(alone):
            assert np.array_equal(np.array(batched[row]), np.array(logits))
        tokens = [int(mx.argmax(logits)) for logits in alone]


def test_decode_step_on_rows_of_different_lengths(runtime, prompts):
    """model.step on a BatchKVCache (as batch decoding calls it) gives the forward pass's logits and
    moves every row on by exactly one position. In float32 (the CPU) the logits are the same bits;
    in float16 (a GPU, where the step is the CUDA kernels') the forward pass's next token is the
    step's too, unless its top two logits are within 0.1, and its log-probability within
    logprob_rounding."""
    model = runtime.model
    stepped, forward = model.make_batch_cache(), model.make_batch_cache()
    tokens = []
    for ids in prompts[:3]:
        single = model.make_cache()
        tokens.append([int(mx.argmax(prefill(model, ids, single)))])
        for a, b, row in zip(stepped, forward, single):
            a.add(row)
            b.add(row)
    lengths = list(stepped[0].lengths)
    for step in range(1, 3):
        got = model.step(mx.array(tokens), stepped)
        want = model(mx.array(tokens), forward)[:, -1]
        if model.compute_dtype == mx.float32:
            assert np.array_equal(np.array(got), np.array(want))
        else:
            assert_same_next_token(got.astype(mx.float32), want.astype(mx.float32), logprob_rounding(runtime))
        assert all(layer.lengths == [n + step for n in lengths] for layer in stepped)
        tokens = [[int(t)] for t in mx.argmax(want, axis=-1).tolist()]


def assert_same_next_token(got: mx.array, want: mx.array, bound: float) -> None:
    """Each row's greedy token by `want`'s logits [rows, vocab] is `got`'s (unless want's top two
    are within 0.1), with the same log-probability within `bound`."""
    got_logprobs = np.array(got - mx.logsumexp(got, axis=-1, keepdims=True))
    want_logprobs = np.array(want - mx.logsumexp(want, axis=-1, keepdims=True))
    want = np.array(want)
    top = want.argmax(axis=-1)
    rows = np.arange(len(want))
    clear = want[rows, top] - np.sort(want, axis=-1)[:, -2] > 0.1
    assert (np.array(got).argmax(axis=-1) == top)[clear].all()
    np.testing.assert_allclose(got_logprobs[rows, top], want_logprobs[rows, top], atol=bound)


def test_rows_of_one_length_attend_with_a_single_sequence_mask(runtime, prompts):
    """A lone row (a server with one client), or rows all of one length, take a single sequence's
    mask: None for one token, "causal" for several, which MLX's fused attention takes as they are
    (an array mask makes its CUDA build run the products apart), and write their keys and values as
    one slice: a lone row's step launches what a single sequence's does and gives its logits to the
    last bit. Rows of different lengths keep the array mask."""
    model = runtime.model
    caches = [model.make_cache() for _ in range(3)]
    token = [int(mx.argmax(prefill(model, prompts[5], caches[0])))]
    for ids, cache in zip(prompts[:2], caches[1:]):
        prefill(model, ids, cache)
    lone, twins, uneven = (model.make_batch_cache() for _ in range(3))
    for i in range(len(lone)):
        lone[i].add(caches[0][i])
        twins[i].add(caches[0][i])
        twins[i].add(caches[0][i])
        uneven[i].add(caches[1][i])
        uneven[i].add(caches[2][i])
    assert (lone[0].mask(1), lone[0].mask(4), twins[0].mask(4)) == (None, "causal", "causal")
    mx.eval([kv_arrays(b) for layer in lone for b in (layer.keys, layer.values)])
    stepped = [(model.step(mx.array([token]), cache), cache) for cache in (lone, caches[0])]
    counts = [launches([logits] + [a for layer in cache for b in (layer.keys, layer.values) for a in kv_arrays(b)])
              for logits, cache in stepped]
    assert counts[0] == counts[1]
    assert np.array_equal(np.array(stepped[0][0]), np.array(stepped[1][0]))
    assert uneven[0].lengths[0] != uneven[0].lengths[1]
    assert uneven[0].mask(1).shape == (2, 1, 1, max(uneven[0].lengths) + 1)
    # Their slots come from the host: beyond the step's one mask, no arithmetic on positions a layer.
    mx.eval([kv_arrays(b) for layer in uneven for b in (layer.keys, layer.values)])
    logits = model.step(mx.array([token, token]), uneven)
    count = launches([logits] + [a for layer in uneven for b in (layer.keys, layer.values) for a in kv_arrays(b)])
    assert count["Arange"] + count["Add"] <= counts[0]["Arange"] + counts[0]["Add"] + 3


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_batched_greedy_ids_equal_one_at_a_time(runtime, prompts, sequential, batch_size):
    requests = [Request(ids, n) for ids, n in zip(prompts, MAX_TOKENS)]
    results = batch_generate(runtime, requests, batch_size=batch_size)
    assert [r.token_ids for r in results] == [r.token_ids for r in sequential]
    assert [(r.text, r.finish_reason) for r in results] == [(r.text, r.finish_reason) for r in sequential]
    assert results[4].text == "The capital of Japan is Tokyo." and results[4].finish_reason == "stop"


@pytest.mark.parametrize("kv", [None, KVQuantization(8), KVQuantization(4, keys_by_channel=True)], ids=["none", "8", "4c"])
def test_joining_prompts_fed_together_continue_as_if_fed_alone(runtime, prompts, kv, monkeypatch):
    """A burst of joiners, one continuing a prompt cache's prefix, prefilled in one padded pass
    (BatchDecoder's group): the ids and log-probabilities of each prompt fed alone (within 1e-4:
    float32 rounding of other shapes) and the same keys in the batch (keys by channel: the padding
    left out of each row's last block)."""
    runtime.model.store_kv_quantized(kv)
    try:
        (fed_alone, keys_alone, alone), (fed_together, keys_together, together) = (
            feed_burst(runtime, prompts, group, monkeypatch) for group in (False, True))
    finally:
        runtime.model.store_kv_quantized(None)
    assert len(fed_alone) == 6 and fed_together == [(6, 15)]  # six rows, each padded to the longest rest
    assert [r.ids for r in together] == [r.ids for r in alone]
    for a, b in zip(alone, together):
        assert (b.cached_tokens, b.prefilled_tokens) == (a.cached_tokens, a.prefilled_tokens)
        np.testing.assert_allclose([t.logprob for t in b.logprobs], [t.logprob for t in a.logprobs],
                                   atol=logprob_rounding(runtime, kv))
    for (a, level), (b, _), row in zip(keys_alone, keys_together, alone):
        n = len(row.request.ids)
        # Stored at 8 bits, a key that rounds apart in float16 may land one level over (on an H100).
        bar = key_rounding(runtime) + (level if runtime.model.compute_dtype != mx.float32 else 0.0)
        np.testing.assert_allclose(b[..., :n, :], a[..., :n, :], atol=bar)


@pytest.mark.parametrize("kv", [KVQuantization(8), KVQuantization(4, keys_by_channel=True)], ids=["8", "4c"])
def test_fresh_prompts_fed_together_into_a_quantized_cache(runtime, prompts, kv):
    """A burst of prompts none of which the prompt cache holds, with keys and values stored at 8
    bits from the first position, prefilled in one pass (a CPU server's group): it used to fail,
    quantizing the group's buffers before any row had laid them out; now the ids each gets alone."""
    def run(group: bool):
        decoder = BatchDecoder(runtime.model, runtime.tokenizer, 8, group=group)
        rows = [decoder.admit(i, Request(ids, n)) for i, (ids, n) in enumerate(zip(prompts, MAX_TOKENS))]
        while decoder.joining:
            decoder.prefill_chunk()
        while decoder.rows:
            decoder.step()
        return [row.ids for row in rows]

    runtime.model.store_kv_quantized(kv)
    try:
        assert run(True) == run(False)
    finally:
        runtime.model.store_kv_quantized(None)


def test_a_short_rest_after_a_cached_prefix_goes_through_the_decode_step(runtime, prompts, monkeypatch):
    """stepped_rests (the server's, on a GPU): a prompt the prompt cache holds but for its last 3
    tokens feeds two of them as decode steps of its own and the last in the batch's next step, no
    prefill pass; the same ids and log-probabilities (within 1e-4: a step and a pass round apart)
    as the prefill pass gives."""
    model = runtime.model
    rows, passes = {}, {}
    for stepped in (False, True):
        decoder = BatchDecoder(model, runtime.tokenizer, 4, prompt_cache=PromptCache(1 << 24), stepped_rests=stepped)
        decoder.admit(-1, Request(prompts[5][:-3], 1))
        decoder.prefill_chunk()
        row = decoder.admit(0, Request(prompts[5], 6, logprobs=0))
        fed = []
        real_pass, real_step = model.hidden_states, model.step

        def step(tokens, cache):  # what a step does inside (the plain step may run a pass) is not a prefill pass
            fed.append("step")
            monkeypatch.setattr(model, "hidden_states", real_pass)
            logits = real_step(tokens, cache)
            monkeypatch.setattr(model, "hidden_states", prefill_pass)
            return logits

        def prefill_pass(tokens, cache=None):
            fed.append("pass")
            return real_pass(tokens, cache)

        monkeypatch.setattr(model, "hidden_states", prefill_pass)
        monkeypatch.setattr(model, "step", step)
        decoder.prefill_chunk()
        assert not decoder.joining and (row.ids == []) == stepped
        while not row.ids:
            decoder.step()
        monkeypatch.undo()
        while decoder.rows:
            decoder.step()
        rows[stepped], passes[stepped] = row, fed
    assert passes == {False: ["pass"], True: ["step"] * 3}
    assert rows[True].ids == rows[False].ids and rows[True].prefilled_tokens == rows[False].prefilled_tokens == 3
    np.testing.assert_allclose([t.logprob for t in rows[True].logprobs], [t.logprob for t in rows[False].logprobs],
                               atol=logprob_rounding(runtime))


@pytest.mark.parametrize("logprobs", [None, 0], ids=["pipelined", "read-each-step"])
def test_repeated_prompts_join_together_in_one_step(runtime, prompts, logprobs, monkeypatch):
    """A burst of prompts the prompt cache holds but for their last token (a server's clients asking
    again) joins in one prefill_chunk() with stepped rests, beside a running row, and takes its
    first tokens from one batch step: the ids each gets alone with a prefill pass."""
    def run(stepped):
        store = PromptCache(1 << 26)
        seeder = BatchDecoder(runtime.model, runtime.tokenizer, 8, prompt_cache=store)
        for i, ids in enumerate(prompts):  # each prompt stored, but for its last token
            seeder.admit(-1 - i, Request(ids[:-1], 1))
            seeder.prefill_chunk()
        decoder = BatchDecoder(runtime.model, runtime.tokenizer, 8, prompt_cache=store, stepped_rests=stepped)
        running = decoder.admit(99, Request(prompts[0][:2], 30, logprobs=logprobs))
        decoder.prefill_chunk()
        decoder.step()
        rows = [decoder.admit(i, Request(ids, n, logprobs=logprobs))
                for i, (ids, n) in enumerate(zip(prompts, MAX_TOKENS))]
        assert all(row.cached_tokens == len(ids) - 1 for row, ids in zip(rows, prompts))
        chunks = 0
        extended = []
        for layer in decoder.cache:
            monkeypatch.setattr(layer, "extend", lambda caches, real=layer.extend: extended.append(len(caches))
                                or real(caches))
        while decoder.joining:
            decoder.prefill_chunk()
            chunks += 1
        monkeypatch.undo()
        if stepped:
            # One copy of the batch's cache a layer for the whole burst, not one a joiner.
            assert extended == [len(prompts)] * len(decoder.cache)
            assert chunks == 1 and len(decoder.rows) == 1 + len(prompts) and not any(row.ids for row in rows)
            decoder.step()
            if logprobs is None:  # pipelined: a token is read one step after it is sampled
                decoder.step()
            assert all(len(row.ids) == 1 for row in rows)
        while decoder.rows:
            decoder.step()
        return [row.ids for row in rows + [running]], [[t.logprob for t in row.logprobs] for row in rows]

    (ids, logprobs_passed), (stepped_ids, logprobs_stepped) = run(False), run(True)
    assert stepped_ids == ids
    for a, b in zip(logprobs_stepped, logprobs_passed):
        np.testing.assert_allclose(a, b, atol=logprob_rounding(runtime))


def first_layer_keys(decoder: BatchDecoder, row: int) -> tuple[np.ndarray, float]:
    """Row `row`'s keys in the first layer, dequantized where the cache stores them quantized, and
    the largest step between two levels of that quantization (0 unquantized)."""
    keys, values = decoder.cache[0].row(row)
    if not isinstance(keys, tuple):
        return np.array(keys), 0.0
    return np.array(decoder.cache[0].quantization.decode(keys, values)[0]), float(keys[1].max())


def feed_burst(runtime, prompts, group: bool, monkeypatch):
    """Every prompt admitted at once, the last continuing a stored prefix of itself, then prefilled
    and decoded to its end: the shapes fed, each row's first-layer keys as stored, and the rows."""
    model = runtime.model
    decoder = BatchDecoder(model, runtime.tokenizer, batch_size=8, prompt_cache=PromptCache(1 << 24), group=group)
    decoder.admit(-1, Request(prompts[5][:-3], 1))
    assert len(decoder.prefill_chunk()) == 1  # finished at its first token, its prompt stored
    rows = [decoder.admit(i, Request(ids, n, logprobs=0)) for i, (ids, n) in enumerate(zip(prompts, MAX_TOKENS))]
    assert rows[5].cached_tokens == len(prompts[5]) - 3
    fed = []
    real = model.hidden_states
    monkeypatch.setattr(model, "hidden_states", lambda tokens, cache=None: fed.append(tokens.shape) or real(tokens, cache))
    while decoder.joining:
        assert decoder.prefill_chunk() == []
    monkeypatch.undo()
    keys = [first_layer_keys(decoder, i) for i in range(6)]
    while decoder.rows:
        decoder.step()
    return fed, keys, rows


def test_seeded_sampling_does_not_depend_on_the_batch(runtime, prompts):
    settings = dict(max_tokens=6, temperature=0.9, top_k=40, seed=11)
    alone = runtime.generate(prompts[1], **settings)
    params = SamplingParams(temperature=0.9, top_k=40, seed=11)
    batched = batch_generate(runtime, [prompts[0], Request(prompts[1], 6, params), prompts[2]], max_tokens=4)
    assert batched[1].token_ids == alone.token_ids


def test_stop_strings_and_max_tokens_per_prompt(runtime):
    results = batch_generate(runtime, [Request(runtime.tokenize(RAW[0]), 8, stop=(".",)), RAW[0]], max_tokens=2)
    assert (results[0].text, results[0].finish_reason, results[0].stop) == (" Rome", "stop", ".")
    assert len(results[1].token_ids) == 2 and results[1].finish_reason == "length"


@pytest.mark.parametrize("start", [None, 0, 6], ids=["full", "quantized", "quantized-from-6"])
def test_rows_added_together_equal_rows_added_in_turn(start):
    """A burst of joiners goes into the batch cache in one copy of its rows (extend): the buffers
    and lengths that adding them one at a time leaves, whatever they hold: nothing, fewer slots
    than the rows, more (the buffers grow), quantized beside full-precision rows. The slots past a
    row's length, which its mask hides, may differ: a quantized zero there is stored either way."""
    quantization = None if start is None else KVQuantization(8, 32, start)

    def single(length: int, seed: int):
        cache = make_cache([0], quantization=quantization)[0]
        if length:
            values = [mx.random.normal((1, 2, length, 32), key=mx.random.key(seed + i)) for i in range(2)]
            cache.update_and_fetch(*values)
        return cache

    def batch(together: bool):
        layer = make_batch_cache([0], quantization)[0]
        layer.add(single(0, 0))
        layer.update_and_fetch(mx.ones((1, 2, 3, 32)), mx.ones((1, 2, 3, 32)))
        joiners = [single(n, 10 * n) for n in (0, 2, 300, 5)]
        if together:
            layer.extend(joiners)
        else:
            for joiner in joiners:
                layer.add(joiner)
        return layer

    alone, together = batch(False), batch(True)
    assert together.lengths == alone.lengths == [3, 0, 2, 300, 5]
    for got, want in zip(kv_arrays(together.keys) + kv_arrays(together.values),
                         kv_arrays(alone.keys) + kv_arrays(alone.values)):
        assert got.shape == want.shape
        for row, length in enumerate(alone.lengths):
            assert np.array_equal(np.array(got[row, :, :length]), np.array(want[row, :, :length]))
    assert together.quantized == (start is not None)


@pytest.mark.parametrize("joiners", [1, 4, 12])
def test_a_burst_of_joiners_costs_one_copy_a_joiner(joiners):
    """Each buffer of a burst's join is one zeroed array, the rows before copied in once and each
    joiner once: 2 + k launches a buffer. MLX's CUDA backend builds a CUDA graph anew for every new
    sequence of launches, so a burst's cost on the host goes with this count (padding each joiner
    and concatenating took 3k + 1: a served burst's first step was 2-3 times as long)."""
    layer = make_batch_cache([0])[0]
    for length in (3, 7):
        running = make_cache([0])[0]
        running.update_and_fetch(mx.ones((1, 2, length, 32)), mx.ones((1, 2, length, 32)))
        layer.add(running)
    mx.eval(layer.keys, layer.values)
    caches = []
    for n in range(joiners):
        cache = make_cache([0])[0]
        cache.update_and_fetch(mx.ones((1, 2, 5 + n, 32)), mx.ones((1, 2, 5 + n, 32)))
        mx.eval(cache.keys, cache.values)
        caches.append(cache)
    layer.extend(caches)
    assert launches([layer.keys, layer.values]) == {"Full": 2, "SliceUpdate": 2 * (1 + joiners)}


def test_batch_cache_builds_its_offset_once_per_change():
    """RoPE, the mask and the update of a step all read one offset array; it follows every change of lengths."""
    layer = make_batch_cache([0])[0]
    for length in (3, 5):
        single = make_cache([0])[0]
        single.update_and_fetch(mx.zeros((1, 2, length, 4)), mx.zeros((1, 2, length, 4)))
        layer.add(single)
    offset = layer.offset
    layer.mask(1)
    assert layer.offset is offset and offset.tolist() == [3, 5]
    layer.update_and_fetch(mx.ones((2, 2, 1, 4)), mx.ones((2, 2, 1, 4)))
    assert layer.offset.tolist() == [4, 6]
    layer.keep_rows([1])
    assert layer.offset.tolist() == [6]


def test_job_runner_reports_through_its_callers_callbacks(runtime, tmp_path, capfd):
    """The runner prints nothing and needs no click: bad lines and progress go to the callbacks the CLI passes."""
    lines = ['{"id": "a", "prompt": "Hi", "max_tokens": 2}\n', "not json\n", '{"id": "b", "prompt": "Yo", "max_tokens": 2}\n']
    reported, progress = [], []

    @contextmanager
    def track(jobs):
        progress.append(jobs)
        yield lambda: progress.append("written")

    out = tmp_path / "out.jsonl"
    with results_output(str(out), None) as (done, stream):
        stats = run_batch(runtime, lines, "in.jsonl", stream, done, BatchSettings(NO_TEMPLATE), reported.append, track)
    assert capfd.readouterr() == ("", "")
    assert reported == ["in.jsonl:2: not valid JSON (Expecting value at column 1)"]
    assert progress == [2, "written", "written"]
    assert (stats.prompts, stats.done, stats.errors, stats.interrupted) == (2, 2, 1, False)
    assert [r["id"] for r in read_results(out)] == ["a", "b"]
    imported = subprocess.run([sys.executable, "-c", "import sys, mlxllama.batching, mlxllama.batch_jobs; print(sorted(sys.modules))"],
                              capture_output=True, text=True, check=True).stdout
    assert "'mlxllama.batch_jobs'" in imported and "'click'" not in imported


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))


def read_results(path):
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_per_line_options(cli, tmp_path):
    write_lines(tmp_path / "in.jsonl", [
        json.dumps({"id": "japan", "prompt": "What is the capital of Japan?"}),
        json.dumps({"prompt": "What is 17 plus 25?", "max_tokens": 3}),
        json.dumps({"id": "italy", "prompt": "The capital of Italy is", "no_template": True, "stop": ["."]}),
        json.dumps({"id": "zoe", "messages": [{"role": "user", "content": "My name is Zoe."}], "template": "zephyr",
                    "temperature": 0.8, "seed": 5, "max_tokens": 4}),
    ])
    result = cli("batch", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out.jsonl"), "-n", "10", "-b", "3")
    assert result.exit_code == 0, result.output
    japan, sum_, italy, zoe = read_results(tmp_path / "out.jsonl")
    assert [r["id"] for r in (japan, sum_, italy, zoe)] == ["japan", 2, "italy", "zoe"]
    assert japan["text"] == "The capital of Japan is Tokyo." and japan["finish_reason"] == "stop"
    assert japan["template"] == "gguf (zephyr)" and japan["prompt"].startswith("<|user|>\nWhat is the capital")
    assert japan["prompt_tokens"] == 24 and japan["token_ids"][-1] == 2 and "timings" in japan
    assert len(sum_["token_ids"]) == 3 and sum_["finish_reason"] == "length"
    assert (italy["template"], italy["prompt"], italy["text"], italy["finish_reason"]) == (
        "none", "The capital of Italy is", " Rome", "stop")
    assert zoe["template"] == "zephyr" and len(zoe["token_ids"]) == 4
    again = cli("batch", "-", "-n", "10", input=json.dumps(
        {"id": "zoe", "prompt": "My name is Zoe.", "template": "zephyr", "temperature": 0.8, "seed": 5,
         "max_tokens": 4}) + "\n")
    assert json.loads(again.stdout)["token_ids"] == zoe["token_ids"]
    assert "tokens per second" in result.stderr


def test_compare_template_lines(cli, tmp_path):
    write_lines(tmp_path / "in.jsonl", [json.dumps({"prompt": "What is 17 plus 25?"})])
    result = cli("batch", str(tmp_path / "in.jsonl"), "--compare-template", "-n", "12", "--seed", "1")
    assert result.exit_code == 0, result.output
    line = json.loads(result.stdout)
    assert line["id"] == 1 and line["with_template"]["text"] == "17 plus 25 is 42."
    without = line["without_template"]
    assert without["template"] == "none" and without["prompt"] == "What is 17 plus 25?"


def test_malformed_lines_are_reported_and_skipped(cli, tmp_path):
    write_lines(tmp_path / "in.jsonl", [
        json.dumps({"prompt": "The capital of Italy is", "no_template": True}),
        "{not json",
        json.dumps(["a list"]),
        json.dumps({"id": 1, "prompt": "duplicate of line 1's id"}),
        "",
        json.dumps({"prompt": "x", "max_tokens": "many"}),
        json.dumps({"prompt": "x", "template": "no-such-template"}),
        json.dumps({"system": "no prompt"}),
        json.dumps({"prompt": "x", "seed": -1}),
        '{"prompt": "x", "temperature": NaN}',
        json.dumps({"id": "last", "prompt": "Once upon a time", "no_template": True}),
    ])
    result = cli("batch", str(tmp_path / "in.jsonl"), "-n", "2", "--summary", "json")
    assert result.exit_code == 2
    assert [json.loads(line)["id"] for line in result.stdout.splitlines()] == [1, "last"]
    name = str(tmp_path / "in.jsonl")
    for number, reason in [(2, "not valid JSON"), (3, "expected a JSON object"), (4, "duplicate id 1"),
                           (6, "'max_tokens' must be an integer"), (7, "unknown chat template"),
                           (8, "needs either 'prompt' or 'messages'"),
                           (9, "sampling setting 'seed' must be null or an integer >= 0, got -1"),
                           (10, "sampling setting 'temperature' must be a finite number >= 0, got nan")]:
        assert f"{name}:{number}: {reason}" in result.stderr
    summary = json.loads(result.stderr.strip().splitlines()[-1])
    assert (summary["prompts"], summary["done"], summary["errors"]) == (2, 2, 8)


def test_unreadable_input_or_output_is_a_one_line_error(cli, tmp_path):
    write_lines(tmp_path / "in.jsonl", [json.dumps({"prompt": "x"})])
    result = cli("batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path))
    assert (result.exit_code, result.stderr) == (2, f"mlxllama: error: cannot write {tmp_path}: is a directory\n")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00a\n")
    result = cli("batch", "--text", str(tmp_path / "bin.txt"), "-o", str(tmp_path / "out.jsonl"))
    assert result.exit_code == 2 and "bin.txt: not UTF-8 text" in result.stderr


def test_text_input_from_stdin_to_stdout(cli):
    result = cli("batch", "--text", "-", "--no-template", "-n", "2", "-o", "-",
                 input="The capital of Italy is\n\nOnce upon a time\n")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["id"], r["prompt"], r["template"]) for r in lines] == [
        (1, "The capital of Italy is", "none"), (3, "Once upon a time", "none")]
    assert lines[0]["text"] == " Rome."


def test_resume_skips_done_ids_and_drops_a_cut_off_line(cli, tmp_path):
    write_lines(tmp_path / "in.txt", RAW)
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": 1, "text": "done before"}) + "\n" + '{"id": 2, "te')
    result = cli("batch", "--text", str(tmp_path / "in.txt"), "--no-template", "-n", "2", "-o", str(out),
                 "--summary", "json")
    assert result.exit_code == 0, result.output
    results = read_results(out)
    assert [r["id"] for r in results] == [1, 2, 3, 4] and results[0]["text"] == "done before"
    assert json.loads(result.stderr.splitlines()[-1])["already_done"] == 1


def start_batch(tmp_path, count):
    """A `mlxllama batch` subprocess over `count` raw prompts, two at a time."""
    write_lines(tmp_path / "in.txt", [RAW[i % len(RAW)] for i in range(count)])
    command = [sys.executable, "-c", "from mlxllama.cli import main; main()", "batch", "--model", MODEL, "--text",
               str(tmp_path / "in.txt"), "--no-template", "-n", "12", "-b", "2", "-o", str(tmp_path / "out.jsonl"),
               "--summary", "json"]
    return command, subprocess.Popen(command, stderr=subprocess.PIPE, text=True)


def wait_for_lines(path, process, count=1, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if path.exists() and path.read_text().count("\n") >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"no {count} results before the run ended: {process.stderr.read()}")


def test_killed_run_resumes_with_every_id_exactly_once(tmp_path):
    command, process = start_batch(tmp_path, 10)
    wait_for_lines(tmp_path / "out.jsonl", process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    # A line cut short by the kill would not count: the rerun drops it.
    done_before = (tmp_path / "out.jsonl").read_text().count("\n")
    assert 1 <= done_before < 10
    rerun = subprocess.run(command, stderr=subprocess.PIPE, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert [r["id"] for r in read_results(tmp_path / "out.jsonl")] == list(range(1, 11))
    assert json.loads(rerun.stderr.splitlines()[-1])["already_done"] == done_before


def test_ctrl_c_stops_with_whole_lines_and_a_count(tmp_path):
    _, process = start_batch(tmp_path, 10)
    wait_for_lines(tmp_path / "out.jsonl", process)
    os.kill(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130
    results = read_results(tmp_path / "out.jsonl")
    assert [r["id"] for r in results] == list(range(1, len(results) + 1)) and len(results) < 10
    assert f"interrupted: {len(results)} of 10 prompts done" in stderr
