"""The server's engine: requests join a running batch a prefill chunk at a time, between decode steps."""

from __future__ import annotations

import threading

import mlxllama
from mlxllama.batching import BatchDecoder, Request
from mlxllama.server.engine import Engine, Ticket, warm_up

from conftest import PACKAGE_DATA


def test_a_joining_prompt_never_holds_a_running_stream_up_for_more_than_one_chunk():
    runtime = mlxllama.load(PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf")
    engine = Engine(runtime, max_batch=4, prefill_chunk=16)
    work: list[str] = []
    decoder = engine.decoder
    prefill_chunk, step = decoder.prefill_chunk, decoder.step
    decoder.prefill_chunk = lambda: (work.append("chunk"), prefill_chunk())[1]
    decoder.step = lambda: (work.append(f"step {len(decoder.rows)}") if decoder.rows else None, step())[1]

    results, texts, started = {}, {}, threading.Event()

    def submit(name: str, ids: list[int], max_tokens: int) -> threading.Event:
        done = threading.Event()

        def on_text(update):
            texts[name] = texts.get(name, "") + update[0]
            started.set()

        def on_done(row):
            results[name] = row.result()
            done.set()

        engine.submit(Ticket(Request(ids, max_tokens), on_text, on_done, lambda e: done.set()))
        return done

    running_ids = runtime.tokenize("Once upon a time")
    joining_ids = runtime.tokenize("The capital of Italy is Rome. " * 20)  # 141 tokens: 9 chunks of 16
    first = submit("running", running_ids, 60)
    assert started.wait(60)
    second = submit("joining", joining_ids, 4)
    assert first.wait(120) and second.wait(120)
    engine.stop()

    assert work.count("chunk") == -(-len(joining_ids) // 16) + 1  # the running prompt's one chunk, then the newcomer's
    newcomer = work[work.index("chunk", 1):]
    # Every chunk of the newcomer is followed by a step of the running row before the next chunk.
    assert all(newcomer[i + 1].startswith("step") for i, w in enumerate(newcomer[:-1]) if w == "chunk")
    # Neither request's text depends on the other being there.
    assert results["running"].token_ids == runtime.generate(running_ids, 60).token_ids
    assert results["joining"].token_ids == runtime.generate(joining_ids, 4).token_ids
    assert texts["running"] == results["running"].text


def test_warm_up_runs_every_batch_size_class_and_leaves_nothing_behind():
    """What a GPU server runs before serving (engine.warm_up): a step at 1, 2, 4 ... and the most
    rows, so that each size class of the CUDA kernels compiles before any request waits for it."""
    runtime = mlxllama.load(PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf")
    decoder = BatchDecoder(runtime.model, runtime.tokenizer, 6)
    sizes = []
    step = decoder.step
    decoder.step = lambda: (sizes.append(len(decoder.rows)), step())[1]
    warm_up(decoder)
    # Two tokens a request, the first sampled at prefill: a step samples the second, and (steps being
    # pipelined) the next reads it.
    assert sizes == [1, 1, 2, 2, 4, 4, 6, 6]
    assert not decoder.rows and not decoder.joining and decoder.prompt_cache is None
