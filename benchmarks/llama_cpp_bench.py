"""llama.cpp through llama-cpp-python, timed the way llama-bench times it, for machines without a llama-bench binary.

    python benchmarks/llama_cpp_bench.py MODEL.gguf -p 512 -n 128 -r 5 [--threads 2] [--json OUT]

pp<P> evaluates P random token ids in a fresh context; tg<N> evaluates one token, then N more one at a
time (random ids, no sampling, as llama-bench does). Each test runs once untimed, then -r times.
Extra buffer types are switched off: they crash llama.cpp on this project's CPU machines (AMX in a VM).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import llama_cpp  # noqa: E402
import llama_cpp_cpu  # noqa: E402,F401  (switches extra buffer types off before any Llama is created)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("-p", "--n-prompt", type=int, default=512)
    parser.add_argument("-n", "--n-gen", type=int, default=128)
    parser.add_argument("-r", "--repetitions", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    start = time.perf_counter()
    llm = llama_cpp.Llama(args.model, n_ctx=args.n_prompt + args.n_gen + 8, n_batch=512, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)
    load_seconds = time.perf_counter() - start
    vocab = llm.n_vocab()

    def prompt(seed: int) -> float:
        rng = random.Random(seed)
        ids = [rng.randrange(vocab) for _ in range(args.n_prompt)]
        llm.reset()
        begin = time.perf_counter()
        llm.eval(ids)
        return args.n_prompt / (time.perf_counter() - begin)

    def generation(seed: int) -> float:
        rng = random.Random(seed)
        llm.reset()
        llm.eval([rng.randrange(vocab)])
        begin = time.perf_counter()
        for _ in range(args.n_gen):
            llm.eval([rng.randrange(vocab)])
        return args.n_gen / (time.perf_counter() - begin)

    tests = []
    plan = ((f"pp{args.n_prompt}", args.n_prompt, prompt), (f"tg{args.n_gen}", args.n_gen, generation))
    for name, n, measure in plan:
        if not n:
            continue
        measure(args.repetitions)  # warm-up
        samples = [measure(seed) for seed in range(args.repetitions)]
        tests.append({"name": name, "samples": samples, "tokens_per_second": statistics.median(samples),
                      "stdev": statistics.stdev(samples) if len(samples) > 1 else 0.0})
        print(f"llama.cpp {name}: {tests[-1]['tokens_per_second']:.2f} ± {tests[-1]['stdev']:.2f} t/s", flush=True)
    report = {"model": args.model, "engine": f"llama-cpp-python {llama_cpp.__version__}", "threads": args.threads,
              "load_seconds": load_seconds, "tests": tests}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
