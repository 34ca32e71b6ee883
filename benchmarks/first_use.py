"""What a fresh process pays the first time it meets each kind of work, and a served request the first time it asks something new.

    python benchmarks/first_use.py [-m MODEL] [--json OUT]

Part 1, the model alone (loaded as `serve` loads it, MLX's CUDA graphs off as `serve` has them):
each kind of prefill and step timed three times, in the order a server meets them: a shape first
met, the same shape again, and a new shape of the same kind (another length, another row count).
A first call far slower than the repeat is a compile (or a graph, a plan, a heuristic) made on
first use; one where the new shape is also slow is made for every shape.

Part 2, the engine as `serve` runs it (prompt cache at serve's default, warmed as serve warms it):
one client's requests in turn, as serve_bench.py's one-client run asks them (its warm-up question,
then four), each request's time from submission to its first token on the host, and the prompt
tokens it fed through the model. Shows which of a lone client's requests is slow and why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from importlib.resources import files
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from serve_bench import QUESTIONS  # noqa: E402 - the questions the server benchmark asks

import mlx.core as mx  # noqa: E402

import mlxllama  # noqa: E402
from mlxllama.batching import BatchDecoder, Request  # noqa: E402
from mlxllama.errors import MlxLlamaError  # noqa: E402
from mlxllama.generate import prefill  # noqa: E402
from mlxllama.prompt import build_prompt, choose_template  # noqa: E402
from mlxllama.server import launch_without_cuda_graphs  # noqa: E402
from mlxllama.server.engine import Engine, Ticket  # noqa: E402

# serve's default --prompt-cache-mb
PROMPT_CACHE_BYTES = 512 << 20


def elapsed_ms(work) -> float:
    """Milliseconds for work() and its evaluation (the device waited for)."""
    start = time.perf_counter()
    mx.eval(work())
    return 1000 * (time.perf_counter() - start)


def model_firsts(runtime) -> list[dict]:
    """Each kind of work: first shape, the same again, a new shape; each case a function that
    prepares what it needs and returns the milliseconds of the part timed."""
    model, bos = runtime.model, runtime.tokenizer.bos_id or 1

    def ids(n: int, salt: int = 0) -> list[int]:
        return [bos] + [100 + (7 * i + salt) % 5000 for i in range(n - 1)]

    def fresh(n: int):
        return lambda: elapsed_ms(lambda: prefill(model, ids(n), model.make_cache()))

    def after_prefix(prefix: int, n: int):
        def case():
            cache = model.make_cache()
            mx.eval(prefill(model, ids(prefix), cache))
            return elapsed_ms(lambda: prefill(model, ids(n, salt=3), cache))  # the continuation alone
        return case

    def steps(rows: int):
        def case():
            decoder = BatchDecoder(model, runtime.tokenizer, 16)
            for row in range(rows):
                decoder.admit(row, Request(ids(2 + row), 8))
            while decoder.joining:
                decoder.prefill_chunk()
            decoder.step()
            decoder.step()  # the first step runs the joins' copies too
            return elapsed_ms(lambda: (decoder.step(), decoder.inputs)[1])
        return case

    kinds = [
        ("prefill of a fresh prompt", [("2 tokens", fresh(2)), ("25 tokens", fresh(25)), ("25 again", fresh(25)),
                                       ("31 tokens", fresh(31)), ("44 tokens", fresh(44))]),
        ("prefill after a cached prefix (the continuation alone)",
         [("7 after 25", after_prefix(25, 7)), ("7 after 25 again", after_prefix(25, 7)),
          ("9 after 31", after_prefix(31, 9)), ("30 after 60", after_prefix(60, 30))]),
        ("prefill of 128 tokens and more (dense products)",
         [("150 tokens", fresh(150)), ("150 again", fresh(150)), ("170 tokens", fresh(170)),
          ("600 tokens (two chunks)", fresh(600)), ("600 again", fresh(600))]),
        ("a decode step of a batch (its third step alone)",
         [("2 rows", steps(2)), ("2 rows again", steps(2)), ("3 rows", steps(3)), ("5 rows", steps(5)),
          ("5 rows again", steps(5)), ("13 rows", steps(13))]),
    ]
    out = []
    for kind, cases in kinds:
        print(kind)
        for label, case in cases:
            ms = case()
            print(f"  {label:28s} {ms:8.1f} ms")
            out.append({"kind": kind, "case": label, "ms": round(ms, 2)})
    return out


def served_firsts(runtime) -> list[dict]:
    """One client's requests through serve's engine: the warm-up question, then four in turn."""
    engine = Engine(runtime, prompt_cache_bytes=PROMPT_CACHE_BYTES)
    template = choose_template(runtime.chat_template, None)
    out = []
    print("one client through the engine (submitted -> first token on the host)")
    try:
        for turn, question in enumerate([QUESTIONS[0]] + [QUESTIONS[i % len(QUESTIONS)] for i in range(4)]):
            prompt = build_prompt(runtime.tokenizer, template, [{"role": "user", "content": question}])
            first, done = [], threading.Event()
            ticket = Ticket(Request(prompt.ids, 128), lambda text: first or first.append(time.perf_counter()),
                            lambda row: done.set(), lambda error: (print(error), done.set()))
            start = time.perf_counter()
            engine.submit(ticket)
            done.wait(60)
            ms = 1000 * (first[0] - start) if first else None
            label = "warm-up" if turn == 0 else f"request {turn}"
            print(f"  {label:10s} {len(prompt.ids):3d} prompt tokens, {ticket.row.cached_tokens:3d} cached:"
                  f" {'no first token' if ms is None else f'{ms:8.1f} ms'}")
            out.append({"case": label, "prompt_tokens": len(prompt.ids), "cached_tokens": ticket.row.cached_tokens,
                        "first_token_ms": round(ms, 2) if ms is not None else None})
    finally:
        engine.stop()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default=str(files("mlxllama") / "data" / "chat-tiny-Q4_K_M.gguf"))
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--served-only", action="store_true", help="part 2 alone, in a fresh process")
    args = parser.parse_args()
    launch_without_cuda_graphs()
    try:
        runtime = mlxllama.load(args.model)
    except MlxLlamaError as e:
        print(f"first_use.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{Path(args.model).name} on {mx.default_device()}")
    results = {"model": Path(args.model).name, "device": str(mx.default_device())}
    if not args.served_only:
        results["model_firsts"] = model_firsts(runtime)
    results["served_firsts"] = served_firsts(runtime)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
    # As `mlxllama serve` leaves: MLX (0.32) aborts in the interpreter's teardown when it frees
    # arrays made by the engine's thread, which is gone by then.
    sys.stdout.flush()
    os._exit(0)
