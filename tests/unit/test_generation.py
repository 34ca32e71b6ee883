"""The model, cache and generation loop on the bundled chat-tiny Q4_K_M."""

import gc
import tracemalloc
import weakref
from functools import lru_cache

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mlxllama
from mlxllama.cache import KVCache, grown_size
from mlxllama.generate import TextCollector, generate_tokens, prefill
from mlxllama.sampling import SamplingParams, apply_repeat_penalty, filter_logits, make_sampler
from conftest import find_fixture_model

JAPAN_IDS = [1, 529, 29989, 1792, 29989, 29958, 13, 5618, 338, 278, 7483, 310, 5546, 29973, 2, 29871, 13, 29966,
             29989, 465, 22137, 29989, 29958, 13]
TOKYO_ANSWER_IDS = [1576, 7483, 310, 5546, 338, 20377, 29889, 2]  # "The capital of Japan is Tokyo." EOS


def logit_tolerance() -> float:
    """Between two evaluation orders of the same logits: float32 on the CPU agrees to 2e-3; float16
    on a GPU differed by up to 0.04 over 260 random tokens (an H100), while a wrong position or
    mask moves logits by whole units."""
    return 2e-3 if chat_tiny().model.compute_dtype == mx.float32 else 8e-2


@lru_cache(maxsize=1)
def chat_tiny():
    return mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"))


def test_position_and_cache_advance_by_exactly_the_tokens_fed():
    m = chat_tiny()
    cache = m.new_cache()
    mx.eval(prefill(m.model, JAPAN_IDS[:10], cache))
    assert [c.offset for c in cache] == [10] * m.config.n_layers
    mx.eval(prefill(m.model, JAPAN_IDS[10:], cache))
    assert [c.offset for c in cache] == [24] * m.config.n_layers
    greedy = make_sampler(SamplingParams())
    cache = m.new_cache()
    generated = list(generate_tokens(m.model, cache, JAPAN_IDS, greedy, max_tokens=5))
    assert generated == TOKYO_ANSWER_IDS[:5]
    # Every yielded token has been fed, so the cache holds the prompt plus all of them.
    assert [c.offset for c in cache] == [24 + 5] * m.config.n_layers


def test_prefill_feeds_chunks_of_2048_ids_on_a_gpu_and_512_on_the_cpu(monkeypatch):
    from mlxllama import generate

    m = chat_tiny()
    fed = []
    hidden_states = m.model.hidden_states
    monkeypatch.setattr(m.model, "hidden_states", lambda ids, cache: (fed.append(ids.shape[1]), hidden_states(ids, cache))[1])
    ids = [JAPAN_IDS[i % len(JAPAN_IDS)] for i in range(2100)]
    for device, chunks in ((mx.cpu, [512] * 4 + [52]), (mx.gpu, [2048, 52])):
        fed.clear()
        monkeypatch.setattr(generate.mx, "default_device", lambda: device)  # where the model runs is not changed
        mx.eval(prefill(m.model, ids, m.new_cache()))
        assert fed == chunks


def test_incremental_decoding_matches_one_full_forward_pass():
    """Chunked prefill then single steps must see the same positions as one pass over everything."""
    m = chat_tiny()
    ids = JAPAN_IDS + TOKYO_ANSWER_IDS[:4]
    full = m.logits(ids)
    cache = m.new_cache()
    steps = [m.model(mx.array([ids[:9]]), cache)[0], m.model(mx.array([ids[9:24]]), cache)[0]]
    steps += [m.model(mx.array([[token]]), cache)[0] for token in ids[24:]]
    incremental = np.concatenate([np.array(s) for s in steps])
    np.testing.assert_allclose(incremental, full, atol=logit_tolerance(), rtol=0)

def test_the_decode_step_matches_the_full_pass_across_buffer_growth_and_trim():
    """Transformer.step must attend over exactly the cached positions: when the cache's buffers
    grow (position 289: a one-sequence buffer holds 256 + 32 slots), and after a trim leaves stale
    slots past the offset."""
    m = chat_tiny()
    rng = np.random.default_rng(0)
    ids = [1] + rng.integers(3, m.config.vocab_size, size=289).tolist()
    full = m.logits(ids)
    cache = m.new_cache()
    mx.eval(prefill(m.model, ids[:254], cache))
    assert cache[0].keys.shape[2] == 288
    steps = [np.array(m.model.step(mx.array([[token]]), cache)[0]) for token in ids[254:]]
    assert [c.offset for c in cache] == [290] * m.config.n_layers
    assert cache[0].keys.shape[2] == 544
    np.testing.assert_allclose(np.stack(steps), full[254:], atol=logit_tolerance(), rtol=0)
    for layer in cache:
        layer.trim(3)
    other = [5, 6, 7]
    stepped = [np.array(m.model.step(mx.array([[token]]), cache)[0]) for token in other]
    np.testing.assert_allclose(np.stack(stepped), m.logits(ids[:287] + other)[287:], atol=logit_tolerance(), rtol=0)



@pytest.mark.parametrize("rows, final_size", [(2, 512), (1, 544)])
def test_the_cache_writes_in_place_while_it_has_room_and_grows_by_whole_steps(rows, final_size):
    """KVCache's step without copies (a buffer with room, written in place) and its growth (a copy
    into a buffer of whole GROWTH_STEPs, one channel block more for one row, off the 256 grid that
    sends MLX's CUDA attention to cuDNN) hold the same keys and values: every one appended, in order."""
    rng = np.random.default_rng(0)
    appended = [mx.array(rng.standard_normal((rows, 3, n, 4)).astype(np.float16)) for n in [5] + [1] * 300 + [7]]
    cache = KVCache()
    for i, new in enumerate(appended):
        before = cache.keys
        keys, values = cache.update_and_fetch(new, -new)
        grew = before is None or cache.offset > before.shape[2]
        assert (cache.keys is not before) == grew
        assert cache.keys.shape[2] == (grown_size(cache.offset, rows) if grew else before.shape[2])
        assert keys.shape == values.shape == (rows, 3, cache.offset, 4)
    assert cache.offset == 312 and cache.keys.shape[2] == final_size
    expected = np.concatenate([np.array(a) for a in appended], axis=2)
    np.testing.assert_array_equal(np.array(keys), expected)
    np.testing.assert_array_equal(np.array(values), -expected)


def test_greedy_chat_answer_stops_at_eos():
    result = chat_tiny().generate(JAPAN_IDS, max_tokens=20)
    assert result.token_ids == TOKYO_ANSWER_IDS
    assert result.text == "The capital of Japan is Tokyo."
    assert result.finish_reason == "stop"


def test_max_tokens_ends_with_length():
    result = chat_tiny().generate("The capital of Italy is", max_tokens=3)
    assert len(result.token_ids) == 3 and result.finish_reason == "length"
    # The third token is BOS (the corpus runs on into a new chat), which renders as nothing.
    assert result.token_ids == [9184, 29889, 1] and result.text == " Rome."


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    m = chat_tiny()
    runs = [m.generate("The capital of Italy is", max_tokens=20, temperature=0.9, seed=seed) for seed in (3, 3, 4)]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].token_ids != runs[2].token_ids


def test_top_k_one_is_greedy_at_any_temperature():
    m = chat_tiny()
    greedy = m.generate("The capital of Italy is", max_tokens=12)
    sampled = m.generate("The capital of Italy is", max_tokens=12, temperature=1.5, top_k=1, seed=0)
    assert sampled.token_ids == greedy.token_ids


def test_stop_string_across_token_boundary_is_not_emitted():
    m = chat_tiny()
    stream = m.stream(JAPAN_IDS, max_tokens=20, stop=["of Ja"])
    pieces = list(stream)
    assert stream.result.text == "The capital "
    assert "".join(pieces) == "The capital "
    assert stream.result.finish_reason == "stop" and stream.result.stop == "of Ja"


class PieceTokenizer:
    """Token i decodes to pieces[i], so a test puts the token boundaries where it wants them."""

    stop_ids = frozenset()
    bos_id = None
    add_space_prefix = False

    def __init__(self, pieces: list[str]):
        self.pieces = [p.encode() for p in pieces]

    def token_bytes(self, id: int) -> bytes:
        return self.pieces[id]


@pytest.mark.parametrize("pieces, stop, text, matched", [
    # One character a token: the stop string starts as far back as a match can.
    (["x", "a", "b", "c", "d", "y"], ["abcd"], "x", "abcd"),
    (["ab", "cS", "T", "O", "Pxyz"], ["STOP"], "abc", "STOP"),
    (["foo", "barSTOPbaz"], ["STOP"], "foobar", "STOP"),
    # Both complete in the last token; the longer one, begun two tokens earlier, starts first.
    (["say hello", " wo", "rld!"], ["wor", "hello world"], "say ", "hello world"),
    # A held-back prefix that does not become the stop string is released.
    (["ST", "OW", " STO", "P"], ["STOP"], "STOW ", "STOP"),
    (["no", " stop", " here"], ["STOP"], "no stop here", None),
])
def test_stop_strings_spanning_token_boundaries(pieces, stop, text, matched):
    collector = TextCollector(PieceTokenizer(pieces), stop)
    streamed = ""
    for token_id in range(len(pieces)):
        streamed += collector.add(token_id)
        if collector.finish:
            break
    streamed += collector.close()
    assert (streamed, collector.text, collector.stop) == (text, text, matched)


def test_text_collector_does_not_copy_the_reply_per_token():
    """A token costs work in proportion to its piece: adding one to a long reply allocates no copy of it."""
    long_reply = "x" * 4_000_000
    collector = TextCollector(PieceTokenizer([long_reply, "y", "S"]), ["STOP"])
    assert collector.add(0) == long_reply
    tracemalloc.start()
    try:
        pieces = [collector.add(1) for _ in range(10)] + [collector.add(2)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100_000, peak  # `text += piece` would allocate a 4 MB string each token
    assert pieces == ["y"] * 10 + [""]  # "S" may begin "STOP": held back
    assert collector.text == long_reply + "y" * 10 + "S" and collector.text == collector.text
    assert collector.close() == "S" and collector.text == long_reply + "y" * 10 + "S"


def _held_back(text: str, stops: list[str]) -> int:
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("abS", max_size=4), max_size=12), st.lists(st.text("abS", min_size=1, max_size=4), max_size=3))
def test_text_collector_matches_its_specification(pieces, stop):
    """After each token: the text so far cut at the first stop string that has appeared, less the longest
    tail that could still begin one, has been returned; `text` is everything so far without the stop string."""
    collector = TextCollector(PieceTokenizer(pieces), stop)
    text, streamed, matched = "", "", None
    for token_id, piece in enumerate(pieces):
        text += piece
        streamed += collector.add(token_id)
        hits = sorted((text.find(s), s) for s in stop if s in text)
        if hits:
            (_, matched), text = hits[0], text[: hits[0][0]]
            assert (collector.finish, collector.stop, collector.text) == ("stop", matched, text)
            break
        assert streamed == text[: len(text) - _held_back(text, stop)] and collector.text == text
    streamed += collector.close()
    assert (streamed, collector.text, collector.stop) == (text, text, matched)


def test_streamed_text_equals_detokenized_ids():
    m = chat_tiny()
    stream = m.stream("The capital of Italy is", max_tokens=24)
    assert "".join(stream) == m.detokenize(stream.result.token_ids)


def test_prompt_longer_than_context_is_a_clear_error():
    m = chat_tiny()
    with pytest.raises(mlxllama.MlxLlamaError, match="prompt is 600 tokens, more than the model's context of 512"):
        m.generate([1] + [450] * 599, max_tokens=1)


def test_generation_stops_at_the_context_length():
    m = chat_tiny()
    result = m.generate([1] + [450] * 508, max_tokens=50)
    assert len(result.token_ids) == 3 and result.finish_reason == "length"


def test_filter_logits_top_k_top_p_min_p():
    logits = mx.log(mx.array([0.5, 0.25, 0.15, 0.1]))
    kept = lambda out: np.isfinite(np.array(out)).tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2, top_p=1.0, min_p=0.0)) == [True, True, False, False]
    # The nucleus keeps tokens until the mass before them reaches top_p.
    assert kept(filter_logits(logits, top_k=0, top_p=0.7, min_p=0.0)) == [True, True, False, False]
    assert kept(filter_logits(logits, top_k=0, top_p=0.76, min_p=0.0)) == [True, True, True, False]
    assert kept(filter_logits(logits, top_k=0, top_p=1.0, min_p=0.35)) == [True, True, False, False]


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    logits = mx.array([2.0, -2.0, 1.0, 3.0])
    out = apply_repeat_penalty(logits, [0, 1, 3, 0], penalty=2.0, last_n=2)
    np.testing.assert_allclose(np.array(out), [1.0, -2.0, 1.0, 1.5])
    out = apply_repeat_penalty(mx.array([2.0, -2.0, 1.0, 3.0]), [0, 1], penalty=2.0, last_n=-1)
    np.testing.assert_allclose(np.array(out), [1.0, -4.0, 1.0, 3.0])


def test_repeat_penalty_window_includes_the_pending_token():
    logits = mx.array([2.0, -2.0, 1.0, 3.0])
    out = apply_repeat_penalty(logits, [0, 1, 3], penalty=2.0, last_n=2, pending=mx.array(2))
    np.testing.assert_allclose(np.array(out), [2.0, -2.0, 0.5, 1.5])


def test_repeat_penalty_sees_every_generated_token():
    """The decode loop queues a step before reading the last token; the penalty must still count it."""
    m = chat_tiny()
    params = dict(max_tokens=16, repeat_penalty=1.3, repeat_last_n=8)
    streamed = m.generate("The capital of Italy is", **params)
    # Reference: one token at a time, the penalty applied to every id generated so far.
    ids = m.tokenize("The capital of Italy is")
    expected = []
    for _ in range(16):
        logits = mx.array(m.logits(ids + expected)[-1])
        window = (ids + expected)[-8:]
        penalized = np.array(apply_repeat_penalty(logits, window, 1.3, 8))
        expected.append(int(penalized.argmax()))
        streamed_id = streamed.token_ids[len(expected) - 1]
        if streamed_id != expected[-1]:
            # Only a near-tie may go either way between the two evaluation orders (float16 on a GPU).
            assert penalized[expected[-1]] - penalized[streamed_id] <= logit_tolerance()
            return
    assert streamed.token_ids == expected



def test_empty_prompt_is_a_clear_error():
    with pytest.raises(mlxllama.MlxLlamaError, match="the prompt is empty"):
        chat_tiny().generate([], max_tokens=1)


def test_a_model_that_has_generated_is_freed_when_dropped():
    """Without waiting for Python's cycle collector: the decode step must not keep its model
    (and so the weights) alive, or the next load's memory figures and peak include the old one."""
    gc.disable()
    try:
        runtime = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
        runtime.generate(JAPAN_IDS, max_tokens=3)
        model = weakref.ref(runtime.model)
        del runtime
        assert model() is None
    finally:
        gc.enable()
