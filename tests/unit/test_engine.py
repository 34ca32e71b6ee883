"""The server's engine: requests join a running batch a prefill chunk at a time, between decode steps."""

from __future__ import annotations

import threading

import mlxllama
from mlxllama.batching import BatchDecoder, Request
from mlxllama.server.engine import Engine, Ticket, warm_up

from conftest import PACKAGE_DATA


class Recorded:
    """An engine whose decoder's prefill chunks and steps, and its requests' texts, go to `work` in
    the order they happen."""

    def __init__(self, runtime, **engine_options):
        self.engine = Engine(runtime, **engine_options)
        self.work: list[str] = []
        self.results, self.texts, self.started = {}, {}, threading.Event()
        decoder = self.engine.decoder
        prefill_chunk, step = decoder.prefill_chunk, decoder.step
        decoder.prefill_chunk = lambda: (self.work.append("chunk"), prefill_chunk())[1]
        decoder.step = lambda: (self.work.append(f"step {len(decoder.rows)}") if decoder.rows else None, step())[1]

    def submit(self, name: str, ids: list[int], max_tokens: int) -> threading.Event:
        done = threading.Event()

        def on_text(update):
            self.work.append(f"text {name}")
            self.texts[name] = self.texts.get(name, "") + update[0]
            self.started.set()

        def on_done(finished):
            self.results[name] = finished.result
            done.set()

        self.engine.submit(Ticket(Request(ids, max_tokens), on_text, on_done, lambda e: done.set()))
        return done


def test_a_joining_prompt_never_holds_a_running_stream_up_for_more_than_one_chunk():
    runtime = mlxllama.load(PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf")
    recorded = Recorded(runtime, max_batch=4, prefill_chunk=16)
    running_ids = runtime.tokenize("Once upon a time")
    joining_ids = runtime.tokenize("The capital of Italy is Rome. " * 20)  # 141 tokens: 9 chunks of 16
    first = recorded.submit("running", running_ids, 60)
    assert recorded.started.wait(60)
    second = recorded.submit("joining", joining_ids, 4)
    assert first.wait(120) and second.wait(120)
    recorded.engine.stop()

    work = [w for w in recorded.work if not w.startswith("text")]
    assert work.count("chunk") == -(-len(joining_ids) // 16) + 1  # the running prompt's one chunk, then the newcomer's
    newcomer = work[work.index("chunk", 1):]
    # Every chunk of the newcomer is followed by a step of the running row before the next chunk.
    assert all(newcomer[i + 1].startswith("step") for i, w in enumerate(newcomer[:-1]) if w == "chunk")
    # Neither request's text depends on the other being there.
    assert recorded.results["running"].token_ids == runtime.generate(running_ids, 60).token_ids
    assert recorded.results["joining"].token_ids == runtime.generate(joining_ids, 4).token_ids
    assert recorded.texts["running"] == recorded.results["running"].text


def test_a_newcomer_first_token_goes_out_before_the_running_rows_next_step():
    """The first token is sampled when the last chunk of a prompt is in: the client has it then, not
    a decode step of the running rows later (at 16 clients on the CPU: TTFT p50 0.62x, p95 0.75x)."""
    runtime = mlxllama.load(PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf")
    recorded = Recorded(runtime, max_batch=4, prefill_chunk=16)
    first = recorded.submit("running", runtime.tokenize("Once upon a time"), 40)
    assert recorded.started.wait(60)
    second = recorded.submit("joining", runtime.tokenize("The capital of Italy is Rome. " * 4), 4)
    assert first.wait(120) and second.wait(120)
    recorded.engine.stop()

    work = recorded.work
    last_chunk = max(i for i, w in enumerate(work) if w == "chunk")
    assert work.index("text joining") == last_chunk + 1
    assert work[last_chunk + 2] == "step 2"  # the newcomer's second token comes from the step with both rows


def test_warm_up_runs_every_batch_size_class_and_prefill_class_and_leaves_nothing_behind():
    """What a GPU server runs before serving (engine.warm_up): a step at 1, 2, 4 ... and the most
    rows, so that each size class of the CUDA kernels compiles before any request waits for it;
    then a prefill in every power-of-two class of rows up to a chunk and past it, for the classes
    of MLX's own kernels."""
    runtime = mlxllama.load(PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf")
    decoder = BatchDecoder(runtime.model, runtime.tokenizer, 6, chunk=16)
    sizes, admitted, fed = [], [], []
    step, admit, hidden_states = decoder.step, decoder.admit, runtime.model.hidden_states
    decoder.step = lambda: (sizes.append(len(decoder.rows)), step())[1]
    decoder.admit = lambda index, request: (admitted.append((len(request.ids), request.max_tokens)),
                                            admit(index, request))[1]
    runtime.model.hidden_states = lambda tokens, cache=None: (fed.append(tokens.shape[1]), hidden_states(tokens, cache))[1]
    warm_up(decoder)
    # Two tokens a request, the first sampled at prefill: a step samples the second, and (steps being
    # pipelined) the next reads it.
    assert sizes == [1, 1, 2, 2, 4, 4, 6, 6]
    # The ladder's prompts end with their first token and never step; 17 tokens take two chunks.
    assert [n for n, max_tokens in admitted if max_tokens == 1] == [2, 3, 5, 9, 17]
    assert fed[-6:] == [2, 3, 5, 9, 16, 1]
    assert not decoder.rows and not decoder.joining and decoder.prompt_cache is None


def test_an_error_crosses_from_the_engine_process_as_itself_or_as_its_type_and_text():
    from mlxllama.server.engine_process import sendable

    class Unpicklable(Exception):  # a local class: pickle cannot name it
        pass

    error = ValueError("bad token")
    assert sendable(error) is error
    stand_in = sendable(Unpicklable("lost in the pipe"))
    assert type(stand_in) is RuntimeError and str(stand_in) == "Unpicklable: lost in the pipe"
