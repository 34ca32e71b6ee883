"""What a served request's first token waits for: every call the engine makes under a burst of streaming clients, timed.

    python benchmarks/engine_turns.py [-m MODEL] [--clients 16] [--requests 4] [--max-tokens 128]
        [--max-batch 16] [--slow-ms 20] [--eval-joins] [--split-step] [--json OUT]

Runs `mlxllama serve`'s app and engine in this process (uvicorn on a free loopback port, the
prompt cache at serve's default, MLX's CUDA graphs off as serve has them unless the environment
sets MLX_USE_CUDA_GRAPHS), times each call the engine makes to its decoder (admit, prefill_chunk,
step, drop) and when each request was submitted, and drives it with serve_bench.py's clients (one
untimed round first, as serve_bench's --warmup). Reports:
- the clients' TTFT; for each request how long it waited to be admitted, and from admission to its
  first token on the host;
- how late the server's event loop ran a callback asked for every millisecond;
- what the app did with each request on its event loop: when it arrived, was handed to the engine,
  and had its first text chunk out (the rest of a client's TTFT is the client, the connection and
  uvicorn's HTTP);
- the garbage collector's pauses, which stop every thread;
- how long a thread of its own waits for the interpreter after each 0.5 ms sleep (the GIL probe),
  and, for the waits over 1 ms, where the engine's thread and the event loop's were when it got it:
  what held the interpreter while requests waited;
- the decoder calls slower than --slow-ms, with the engine thread's CPU time in each and the rows
  and joiners around it: what the slow first tokens waited for.
With --eval-joins, each prefill_chunk is followed by a call of its own (eval_joins) that computes
the batch cache and waits for the device, so the joins' copies are timed apart from the step after
them (which otherwise computes them). With --split-step, each step's time is split into what MLX's
compile traced (the kernels' step meeting a new shape), what mx.async_eval and mx.eval took on the
host (encoding the graph: the joins' lazy copies with it, and the prompt cache's stores), and the
wait for the sampled tokens (tolist); the rest is Python building the step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import gc
import json
import os
import statistics
import sys
import threading
import time
from importlib.resources import files
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import serve_bench  # noqa: E402 - the clients, beside this script

import mlx.core as mx  # noqa: E402

import mlxllama  # noqa: E402
from mlxllama.cache import kv_arrays  # noqa: E402
from mlxllama.errors import MlxLlamaError  # noqa: E402
from mlxllama.prompt import choose_template  # noqa: E402
from mlxllama.sampling import SamplingParams  # noqa: E402
from mlxllama.server import launch_without_cuda_graphs  # noqa: E402
from mlxllama.server.app import Api, Completion, OpenAICompletion, ServerSettings, create_app  # noqa: E402
from mlxllama.server.engine import Engine  # noqa: E402

DECODER_CALLS = ("admit", "prefill_chunk", "step", "drop")
# With --eval-joins: the batch cache evaluated, and the device waited for, after each prefill_chunk.
JOINS = "eval_joins"
# With --split-step: the parts of a step timed apart (StepParts).
PARTS = ("trace", "async_eval", "eval", "wait")


class Timeline:
    """The decoder's calls, each (name, start, seconds, rows before, joiners before, the first
    joiner's prompt tokens not yet fed and those already in its cache, and the CPU seconds the
    engine's thread spent in it: a call much longer than its CPU time waited, for the device or for
    the GIL; and with split_step, a step's parts in ms, None for other calls), and each submitted
    ticket with its submission time; perf_counter's clock, as the rows' own times."""

    def __init__(self, engine: Engine, eval_joins: bool = False, split_step: bool = False):
        self.calls: list[tuple[str, float, float, int, int, int, int, float, dict[str, float] | None]] = []
        self.submitted: list[tuple[float, object]] = []
        decoder = engine.decoder
        self.split = StepParts(decoder) if split_step else None
        for name in DECODER_CALLS:
            setattr(decoder, name, self._timed(name, getattr(decoder, name), decoder))
        if eval_joins:
            prefill_chunk, evaluated = decoder.prefill_chunk, self._timed(JOINS, lambda: evaluate(decoder.cache), decoder)
            decoder.prefill_chunk = lambda: (prefill_chunk(), evaluated())[0]
        submit = engine.submit
        engine.submit = lambda ticket: (self.submitted.append((time.perf_counter(), ticket)), submit(ticket))[1]

    def _timed(self, name, call, decoder):
        def timed(*args, **kwargs):
            first = decoder.joining[0] if decoder.joining else None
            rest, fed = (len(first.row.request.ids) - first.fed, first.fed) if first else (0, 0)
            rows, joining = len(decoder.rows), len(decoder.joining)
            split = self.split if name == "step" else None
            start, cpu = time.perf_counter(), time.thread_time()
            if split is not None:
                split.begin()
            try:
                return call(*args, **kwargs)
            finally:
                self.calls.append((name, start, time.perf_counter() - start, rows, joining, rest, fed,
                                   time.thread_time() - cpu, split.end() if split is not None else None))
        return timed

    def clear(self) -> None:
        self.calls.clear()
        self.submitted.clear()

    def requests(self) -> list[dict]:
        """Each ticket's wait in the queue (submitted to admitted) and from admission to its first
        token on the host, in ms."""
        out = []
        for submitted, ticket in self.submitted:
            row = ticket.row
            if row is None or row.first_token_time is None:
                continue
            out.append({"queued_ms": 1000 * (row.start - submitted),
                        "first_token_ms": 1000 * (row.first_token_time - row.start),
                        "cached_tokens": row.cached_tokens, "prefilled_tokens": row.prefilled_tokens})
        return out


class StepParts:
    """The seconds a decode step spends in each of PARTS, on the thread that runs it: the kernels'
    compiled step traced (mx.compile calls the traced method only for a new shape), mx.async_eval
    and mx.eval (on MLX's CUDA backend, encoding every pending operation of the graph: the step's,
    and the joins' copies that it computes first), and the sampled tokens read (_take: the wait for
    the device)."""

    def __init__(self, decoder):
        self.thread: int | None = None
        self.seconds: dict[str, float] = {}
        step = getattr(decoder.model, "decode_step", None)
        if getattr(step, "uses_kernels", False):
            for method in ("_forward", "_batch_forward"):
                setattr(step, method, self._timed("trace", getattr(step, method)))
        mx.async_eval, mx.eval = self._timed("async_eval", mx.async_eval), self._timed("eval", mx.eval)
        decoder._take = self._timed("wait", decoder._take)

    def _timed(self, part: str, call):
        def timed(*args, **kwargs):
            if self.thread != threading.get_ident():
                return call(*args, **kwargs)
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - start
        return timed

    def begin(self) -> None:
        self.thread, self.seconds = threading.get_ident(), {}

    def end(self) -> dict[str, float]:
        self.thread = None
        return {part: 1000 * self.seconds.get(part, 0.0) for part in PARTS}


def evaluate(cache) -> None:
    """The batch cache's buffers computed, and the device idle: the joins' copies done."""
    mx.eval([a for layer in cache if layer.keys is not None for b in (layer.keys, layer.values) for a in kv_arrays(b)])
    mx.synchronize()


class LoopLag:
    """How late the server's event loop runs a callback asked for every millisecond: while it is
    busy (the streams' chunks, the requests' templates, the GIL held by the engine's thread), a new
    request's handling and every first token it sends out wait as long."""

    def __init__(self):
        self.lags: list[float] = []
        self.measuring = False
        self.thread_id: int | None = None  # the event loop's thread, once the probe runs

    async def probe(self) -> None:
        self.thread_id = threading.get_ident()
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(0.001)
            if self.measuring:
                self.lags.append(1000 * (time.perf_counter() - asked - 0.001))


class AppTimes:
    """For each chat request, on the app's event loop: when its handler started, when it was handed
    to the engine, and when its first text chunk was yielded to the response (perf_counter's clock)."""

    def __init__(self):
        self.requests: list[list[float | None]] = []
        # by each request's `user` field (serve_bench's "client.turn"): its times and its engine ticket
        self.by_user: dict[str, tuple[list[float | None], object]] = {}
        arrived = contextvars.ContextVar("arrived", default=None)
        user = contextvars.ContextVar("user", default="")
        handler, submit, stream_text = Api.chat_completions, Completion.submit, OpenAICompletion.stream_text

        async def chat_completions(api, request):
            arrived.set(time.perf_counter())
            user.set(json.loads(await request.body()).get("user", ""))  # Starlette keeps the body for the handler
            return await handler(api, request)

        def timed_submit(completion, request):
            completion.times = [arrived.get(), time.perf_counter(), None]
            self.requests.append(completion.times)
            events = submit(completion, request)
            self.by_user[user.get()] = (completion.times, completion.ticket)
            return events

        def timed_text(completion, *args):
            event = stream_text(completion, *args)
            if event and completion.times[2] is None:
                completion.times[2] = time.perf_counter()
            return event

        Api.chat_completions, Completion.submit, OpenAICompletion.stream_text = chat_completions, timed_submit, timed_text

    def clear(self) -> None:
        self.requests.clear()
        self.by_user.clear()

    def spans(self) -> tuple[list[float], list[float]]:
        """In ms: arrival to submission, and arrival to the first chunk out, of each request."""
        done = [t for t in self.requests if None not in t]
        return [1000 * (s - a) for a, s, _ in done], [1000 * (f - a) for a, _, f in done]


class GilProbe:
    """A thread that sleeps 0.5 ms at a time and times how long it then waits for the interpreter
    (time.sleep releases it; taking it back waits for whichever thread holds it, up to the switch
    interval). For each wait over LONG_MS it notes where the engine's thread and the event loop's
    thread stood as it got the interpreter back. Only one of them can have held it: that one has
    just let go, at a call that releases the GIL or at the switch interval's check; an engine
    waiting for work had not held it, so the loop had. The other's frame is only where it was."""

    SLEEP, LONG_MS = 0.0005, 1.0

    def __init__(self, engine_thread: threading.Thread, lag: LoopLag):
        self.waits: list[float] = []
        self.holders: dict[str, int] = {}
        self.measuring = False
        self.engine_id = engine_thread.ident
        self.lag = lag  # its probe names the event loop's thread
        threading.Thread(target=self._run, name="gil-probe", daemon=True).start()

    def _run(self) -> None:
        while True:
            asked = time.perf_counter()
            time.sleep(self.SLEEP)
            waited = 1000 * (time.perf_counter() - asked - self.SLEEP)
            if not self.measuring:
                continue
            self.waits.append(waited)
            if waited > self.LONG_MS:
                frames = sys._current_frames()
                for label, ident in (("engine", self.engine_id), ("loop", self.lag.thread_id)):
                    frame = frames.get(ident)
                    if frame is not None:
                        where = f"{label}: {Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"
                        self.holders[where] = self.holders.get(where, 0) + 1

    def report(self) -> list[str]:
        long = [w for w in self.waits if w > self.LONG_MS]
        seconds = len(self.waits) * self.SLEEP + sum(self.waits) / 1000
        lines = [f"GIL probe, ms waited after each sleep: {summary(self.waits)}; over {self.LONG_MS:g} ms: {len(long)},"
                 f" {sum(long):.0f} ms in all, {100 * sum(self.waits) / 1000 / seconds if seconds else 0:.0f}% of the"
                 f" probe's time"]
        lines += [f"  {count:5d}  {where}" for where, count in sorted(self.holders.items(), key=lambda i: -i[1])[:12]]
        return lines


class GcPauses:
    """The cyclic garbage collector's pauses, by generation, in ms."""

    def __init__(self):
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self.measuring = False
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.measuring:
            self.pauses[info["generation"]].append(1000 * (time.perf_counter() - self._start))


def first_burst(clients: dict, app_times: AppTimes) -> list[dict]:
    """Each client's first request (they arrive at once on an idle server), in ms from the first
    client's start: sent, its handler started, handed to the engine, admitted, first token on the
    host, first chunk out, and received by the client; the clock is the machine's (perf_counter)."""
    start = clients["clock_start"]

    def ms(t):
        return None if t is None else round(1000 * (t - start), 1)

    out = []
    for number, requests in enumerate(clients["requests_by_client"]):
        sent, ttft = requests[0]
        (arrived, handed, first_out), ticket = app_times.by_user.get(f"{number}.0", ((None, None, None), None))
        row = ticket.row if ticket is not None else None
        out.append({"client": number, "sent": sent, "arrived": ms(arrived), "handed": ms(handed),
                    "admitted": ms(row.start) if row else None, "first_token": ms(row.first_token_time) if row else None,
                    "first_out": ms(first_out), "received": None if ttft is None else round(sent + ttft, 1)})
    return sorted(out, key=lambda r: r["received"] or 0.0)


def summary(values: list[float]) -> str:
    if not values:
        return "-"
    values = sorted(values)
    return (f"p50 {serve_bench.percentile(values, 50):.1f}, p95 {serve_bench.percentile(values, 95):.1f}, "
            f"max {values[-1]:.1f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default=str(files("mlxllama.data") / "chat-tiny-Q4_K_M.gguf"))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--slow-ms", type=float, default=20.0, help="list the decoder calls slower than this")
    parser.add_argument("--eval-joins", action="store_true",
                        help="evaluate the batch cache after each prefill_chunk, timed apart (eval_joins): what the"
                             " joins cost the device, apart from the step after them")
    parser.add_argument("--split-step", action="store_true",
                        help="time each step's parts apart: compile traces, mx.async_eval/mx.eval, the wait for its tokens")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()

    launch_without_cuda_graphs()  # as serve does (MLX_USE_CUDA_GRAPHS=1 in the environment keeps them)
    try:
        runtime = mlxllama.load(args.model)
    except MlxLlamaError as e:
        print(f"engine_turns.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    engine = Engine(runtime, args.max_batch, prompt_cache_bytes=512 << 20)
    timeline = Timeline(engine, args.eval_joins, args.split_step)
    lag, app_times, gc_pauses = LoopLag(), AppTimes(), GcPauses()
    app = create_app(runtime, engine, ServerSettings(choose_template(runtime.chat_template), SamplingParams(), 256),
                     webui=False)
    server, thread = serve_bench.serve_in_thread(app, lag.probe)
    gil = GilProbe(engine.thread, lag)
    url = f"http://127.0.0.1:{server.config.port}"
    try:
        serve_bench.run(url, args.clients, 1, args.max_tokens)  # untimed: compiles, and fills the prompt cache
        timeline.clear()
        app_times.clear()
        lag.measuring = gc_pauses.measuring = gil.measuring = True
        clients = serve_bench.run(url, args.clients, args.requests, args.max_tokens)
        gil.measuring = False
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.stop()
    requests = timeline.requests()
    by_call = {name: [1000 * c[2] for c in timeline.calls if c[0] == name]
               for name in DECODER_CALLS + ((JOINS,) if args.eval_joins else ())}
    slow = [c for c in timeline.calls if 1000 * c[2] > args.slow_ms]
    start = min((c[1] for c in timeline.calls), default=0.0)
    print(f"{args.clients} clients x {args.requests} requests, {args.max_tokens} tokens each: "
          f"{clients['tokens_per_second']:.1f} t/s, "
          f"TTFT p50 {clients['ttft_p50_ms']:.1f} / p95 {clients['ttft_p95_ms']:.1f} ms")
    print(f"queued (submitted -> admitted), ms: {summary([r['queued_ms'] for r in requests])}")
    print(f"admitted -> first token on the host, ms: {summary([r['first_token_ms'] for r in requests])}")
    print(f"submitted -> first token on the host, ms: "
          f"{summary([r['queued_ms'] + r['first_token_ms'] for r in requests])}")
    print(f"event loop lag (a 1 ms sleep's lateness), ms: {summary(lag.lags)}")
    handed, first_out = app_times.spans()
    print(f"app: arrival -> engine, ms: {summary(handed)}; arrival -> first chunk out, ms: {summary(first_out)}")
    print("\n".join(gil.report()))
    print("gc pauses, ms: " + "; ".join(f"generation {g} x{len(p)}: {summary(p)}" for g, p in gc_pauses.pauses.items()))
    for name, ms in by_call.items():
        print(f"{name:13s} {len(ms):6d} calls, ms: {summary(ms)}, total {sum(ms):.0f}")
    print(f"calls over {args.slow_ms:g} ms: {len(slow)}")
    if args.split_step:
        steps = [c[8] for c in timeline.calls if c[8] is not None]
        print("step parts, ms: " + "; ".join(f"{part} {summary([p[part] for p in steps])}" for part in PARTS))
    burst = first_burst(clients, app_times)
    print("the first burst, each client's first request, ms from the first client's start:"
          " sent / handler / to engine / admitted / first token on the host / first chunk out / received")
    for r in burst:
        print("  " + " / ".join("-" if r[k] is None else f"{r[k]:.1f}" for k in
                                ("sent", "arrived", "handed", "admitted", "first_token", "first_out", "received")))
    burst_end = max((r["received"] or 0.0) for r in burst) if burst else 0.0
    first_calls = [c for c in timeline.calls if 1000 * (c[1] - clients["clock_start"]) <= burst_end]
    print("the engine's calls until then: " + ", ".join(
        f"{c[0]} {1000 * (c[1] - clients['clock_start']):.1f}+{1000 * c[2]:.1f}" for c in first_calls))
    for name, at, seconds, rows, joining, rest, fed, cpu, split in slow[:40]:
        print(f"  {1000 * (at - start):9.1f} ms  {name:13s} {1000 * seconds:7.1f} ms (CPU {1000 * cpu:5.1f})"
              f"  rows {rows:2d}  joining {joining:2d}  first joiner: {rest} to feed after {fed}"
              + ("" if split is None else "  " + " ".join(f"{part} {split[part]:.1f}" for part in PARTS)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "clients": clients, "requests": requests, "first_burst": burst,
                       "loop_lag_ms": lag.lags, "gil_waits_ms": gil.waits, "gil_holders": gil.holders,
                       "app_ms": {"to_engine": handed, "first_chunk_out": first_out},
                       "gc_pauses_ms": {str(g): p for g, p in gc_pauses.pauses.items()},
                       "calls": [{"name": n, "at_ms": 1000 * (at - start), "ms": 1000 * s, "rows": r, "joining": j,
                                  "rest": rest, "fed": fed, "cpu_ms": 1000 * cpu, **({"parts_ms": p} if p else {})}
                                 for n, at, s, r, j, rest, fed, cpu, p in timeline.calls],
                       "mean_step_ms": statistics.fmean(by_call["step"]) if by_call["step"] else None}, f, indent=1)


if __name__ == "__main__":
    main()
    # As `mlxllama serve` leaves: MLX (0.32) aborts in the interpreter's teardown when it frees
    # arrays made by the engine's thread, which is gone by then.
    sys.stdout.flush()
    os._exit(0)
