"""The server's host side alone under concurrent streaming clients: `mlxllama serve`'s app and
engine over a decoder that only stands in for the model, to tell what the HTTP side costs a burst
from what the model's steps cost it.

    python benchmarks/serve_stand_in.py [-m MODEL] [--clients 16] [--requests 4] [--max-tokens 128]
        [--step-ms 2.2] [--prefill-ms 1.5] [--joins together|one] [--held 0,0.3] [--rounds 3] [--json OUT]

The app (create_app), the Engine and uvicorn are the server's own, in this process, with clients
from serve_bench.py (each a process, one untimed request first). Only the decoder is replaced:
its rows are real (the model file's tokenizer turns their tokens into text; a reply is a sentence
repeated), but a prefill or a step makes no arrays. Each takes the time given: --step-ms for a step,
--prefill-ms for a call that prefills. With --joins together (the default) one such call joins every
request waiting, as the real engine's stepped rests join the prompts the prompt cache holds but for
their last tokens (serve_bench.py's repeated questions, after its untimed round); with --joins one,
one request a call, as a prompt the cache does not hold is prefilled on a GPU. A fraction of it (--held) the decoder spends in a Python loop,
holding the interpreter as the real engine's Python does (building a step, sampling, detokenizing);
the rest it waits with the interpreter released, as the real engine does while the device works
(MLX's eval, async_eval and tolist release it). Each --held value is one variant, run --rounds
times, the variants alternating. Reports each run's throughput and TTFT p50 and p95, and, per
variant, the p95 of all its requests pooled and of each client's first request (the burst on an
idle server).

The defaults are what the real engine measured on an H100 with 16 rows of the TinyLlama shape
(engine_turns.py: a step 2.2 ms, of which mx.async_eval 1.4 ms; a prefill 1.1-3.5 ms). MLX runs
on its CPU device here, for the tokenizer only: no kernel is ever compiled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from importlib.resources import files
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import serve_bench  # noqa: E402 - the clients, beside this script

import mlx.core as mx  # noqa: E402

import mlxllama  # noqa: E402
from mlxllama.batching import Row  # noqa: E402
from mlxllama.errors import MlxLlamaError  # noqa: E402
from mlxllama.prompt import choose_template  # noqa: E402
from mlxllama.sampling import SamplingParams  # noqa: E402
from mlxllama.server import engine as engine_module  # noqa: E402
from mlxllama.server.app import ServerSettings, create_app  # noqa: E402

REPLY = " The capital of Japan is Tokyo, and the capital of France is Paris."


def spend(seconds: float, held: float) -> None:
    """Take `seconds`: the fraction `held` in a Python loop (the interpreter held), the rest asleep."""
    end = time.perf_counter() + seconds * held
    while time.perf_counter() < end:
        pass
    time.sleep(seconds * (1 - held))


class StandInDecoder:
    """What Engine calls of a BatchDecoder, with real rows and no model: joiners are prefilled all in
    one call, or one a call (`together`), and each step gives every row its reply's next token."""

    prompt_cache = None
    max_kv_size = draft_room = 0

    def __init__(self, tokenizer, batch_size: int, context: int, step: float, prefill: float, held: float,
                 together: bool = True):
        self.tokenizer, self.batch_size, self.context, self.together = tokenizer, batch_size, context, together
        self.step_seconds, self.prefill_seconds, self.held = step, prefill, held
        self.reply = tokenizer.encode(REPLY, add_bos=False)
        self.joining: list[Row] = []
        self.rows: list[Row] = []

    @property
    def room(self) -> bool:
        return len(self.rows) + len(self.joining) < self.batch_size

    def admit(self, index, request) -> Row:
        row = Row(index, request, self.tokenizer, self.context)
        self.joining.append(row)
        return row

    def prefill_chunk(self) -> list[Row]:
        joined = self.joining if self.together else self.joining[:1]
        self.joining = [] if self.together else self.joining[1:]
        spend(self.prefill_seconds, self.held)
        return self._next(joined)

    def step(self) -> list[Row]:
        if not self.rows:
            return []
        spend(self.step_seconds, self.held)
        return self._next(list(self.rows))

    def drop(self, rows: list[Row]) -> None:
        self.rows = [row for row in self.rows if row not in rows]

    def _next(self, rows: list[Row]) -> list[Row]:
        finished = []
        for row in rows:
            if row.accept(self.reply[len(row.ids) % len(self.reply)]):
                finished.append(row)
            elif row not in self.rows:
                self.rows.append(row)
        self.drop(finished)
        return finished


def serve(runtime, args, held: float):
    """The app and an Engine over the stand-in decoder, served by uvicorn on a thread of this process."""
    def stand_in(runtime, max_batch, *_, **__):
        return StandInDecoder(runtime.tokenizer, max_batch, runtime.config.context_length,
                              args.step_ms / 1000, args.prefill_ms / 1000, held, args.joins == "together")

    real = engine_module.make_decoder
    engine_module.make_decoder = stand_in
    try:
        engine = engine_module.Engine(runtime, args.max_batch, kv_budget=1 << 40)
    finally:
        engine_module.make_decoder = real
    settings = ServerSettings(choose_template(runtime.chat_template), SamplingParams(), args.max_tokens)
    server, thread = serve_bench.serve_in_thread(create_app(runtime, engine, settings, webui=False))
    return server, thread, engine


def run_once(runtime, args, held: float) -> dict:
    server, thread, engine = serve(runtime, args, held)
    url = f"http://127.0.0.1:{server.config.port}"
    try:
        serve_bench.run(url, args.clients, 1, args.max_tokens)  # untimed: each client's first request
        result = serve_bench.run(url, args.clients, args.requests, args.max_tokens)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.stop()
    return result


def numbers(text: str) -> list[float]:
    return [float(v) for v in text.split(",")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default=str(files("mlxllama.data") / "chat-tiny-Q4_K_M.gguf"),
                        help="the GGUF file whose tokenizer and template the server uses (no weights are used)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--step-ms", type=float, default=2.2)
    parser.add_argument("--prefill-ms", type=float, default=1.5)
    parser.add_argument("--joins", choices=("together", "one"), default="together")
    parser.add_argument("--held", type=numbers, default=[0.0, 0.3],
                        help="fractions of each call the decoder holds the interpreter, one variant each")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    if any(not 0 <= held <= 1 for held in args.held):
        parser.error("--held: fractions from 0 to 1")
    mx.set_default_device(mx.cpu)
    try:
        runtime = mlxllama.load(args.model)
    except MlxLlamaError as e:
        print(f"serve_stand_in.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    runs: dict[float, list[dict]] = {held: [] for held in args.held}
    for round_ in range(args.rounds):
        for held in args.held if round_ % 2 == 0 else args.held[::-1]:
            result = run_once(runtime, args, held)
            runs[held].append(result)
            print(f"held {held:g}, round {round_ + 1}: {result['tokens_per_second']:.0f} t/s, TTFT p50"
                  f" {result['ttft_p50_ms']:.1f} / p95 {result['ttft_p95_ms']:.1f} ms", flush=True)
    for held, results in runs.items():
        pooled = sorted(t for r in results for t in r["ttft_ms"])
        first = sorted(requests[0][1] for r in results for requests in r["requests_by_client"])
        print(f"held {held:g}: TTFT p95 mean of rounds {statistics.fmean(r['ttft_p95_ms'] for r in results):.1f},"
              f" pooled {serve_bench.percentile(pooled, 95):.1f}; first requests p50"
              f" {serve_bench.percentile(first, 50):.1f} / p95 {serve_bench.percentile(first, 95):.1f} ms;"
              f" {statistics.fmean(r['tokens_per_second'] for r in results):.0f} t/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k != "json"},
                       "runs": {str(held): results for held, results in runs.items()}}, f)


if __name__ == "__main__":
    main()
