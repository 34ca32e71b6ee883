"""Where a decode step's host time goes, our plain step against mlx-lm's model in the same loop.

    pip install --no-deps mlx-lm==0.32.2
    MLXLLAMA_CUDA_KERNELS=0 python benchmarks/host_profile.py MODEL.gguf [--batches 1,8] [--depths 0,4096]
        [-n 128] [--rounds 3] [--top 25] [--json OUT]

For each batch and depth both engines' caches are filled with random keys and values
(versus_mlx_lm.py's --fill random), and each engine decodes -n tokens in bench.time_steps's loop,
mlx-lm's model (versus_mlx_lm.MlxLm) as our step. In interleaved rounds, each engine runs with
Python's garbage collector on and off: tokens/s and the host's µs a step, building the graph and
launching it. Then one run each under Python's profiler (cProfile): the functions with the most
time of their own a step, MLX's calls among them, so that a difference in the host's time between
the engines, or between depths, can be put on the calls that make it. The profiler slows Python
code more than MLX's calls, so its figures are for comparing the engines, not for speeds.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import sys

import mlx.core as mx

from mlxllama import bench, load
from mlxllama.errors import MlxLlamaError
from versus_mlx_lm import MlxLm, filled_ours, host_us, random_ids


def load_checked(model: str, script: str, n_gen: int, depths: tuple[int, ...]):
    """The model loaded, or the script's one-line error and exit 2 when it cannot be, or when tg<n_gen> at
    the deepest depth does not fit its context."""
    try:
        runtime = load(model)
        bench.check_fits(runtime, 0, n_gen, depths)
    except MlxLlamaError as e:
        print(f"{script}: error: {e}", file=sys.stderr)
        sys.exit(2)
    return runtime


def make_engine(step, cache: list, vocab: int) -> dict:
    """What decode times: `step(tokens, cache)` giving the logits [rows, vocab] after the tokens, over `cache`."""
    return {"step": lambda tokens: step(tokens, cache), "cache": cache, "vocab": vocab}


def ours_engine(runtime, batch: int, depth: int, n_gen: int) -> dict:
    """The runtime's plain step over a cache holding `depth` random positions in each of `batch` rows."""
    return make_engine(runtime.model.step, filled_ours(runtime, batch, depth, n_gen), runtime.config.vocab_size)


def mlx_lm_engine(theirs: MlxLm, batch: int, depth: int, n_gen: int, dtype) -> dict:
    """mlx-lm's model as ours_engine gives our step: its logits after the tokens, over a filled cache."""
    return make_engine(lambda tokens, cache: theirs.model(tokens, cache=cache)[:, -1],
                       theirs.filled(batch, depth, n_gen, dtype), theirs.config.vocab_size)


def decode(engine: dict, batch: int, depth: int, n_gen: int, seed: int, host: list | None) -> float:
    """Tokens/s of n_gen steps from the engine's cache at `depth`, cut back to it afterwards."""
    token = random_ids(engine["vocab"], batch, 1, seed)
    seconds = bench.time_steps(engine["step"], token, n_gen, host)
    bench.cut_back(engine["cache"], depth)
    return batch * n_gen / seconds


def decode_without_gc(engine: dict, batch: int, depth: int, n_gen: int, seed: int, host: list) -> float:
    gc.disable()
    try:
        return decode(engine, batch, depth, n_gen, seed, host)
    finally:
        gc.enable()


def profiled(engine: dict, batch: int, depth: int, n_gen: int, top: int) -> list[dict]:
    """The `top` functions by time of their own in one run of n_gen steps, in µs and calls a step."""
    profiler = cProfile.Profile()
    profiler.enable()
    decode(engine, batch, depth, n_gen, 0, None)
    profiler.disable()
    return top_functions(profiler, n_gen, top)


def top_functions(profiler: cProfile.Profile, repetitions: int, top: int) -> list[dict]:
    """The `top` functions by time of their own under `profiler`, in µs and calls a repetition."""
    rows = [{"function": label(key), "own_us": own / repetitions * 1e6, "total_us": total / repetitions * 1e6,
             "calls": calls / repetitions} for key, (_, calls, own, total, _) in pstats.Stats(profiler).stats.items()]
    return sorted(rows, key=lambda r: -r["own_us"])[:top]


def label(key: tuple) -> str:
    path, line, name = key
    return name if path == "~" else f"{os.path.basename(path)}:{line}({name})"


def profile_lines(rows: list[dict]) -> list[str]:
    """top_functions' rows as printed: µs of their own and with callees, calls, the function."""
    return [f"  {r['own_us']:8.1f} {r['total_us']:8.1f} {r['calls']:6.1f}  {r['function']}" for r in rows]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("-n", "--n-gen", type=int, default=128)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--depths", default="0,4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    runtime = load_checked(args.model, "host_profile.py", args.n_gen, tuple(int(d) for d in args.depths.split(",")))
    if runtime.model.decode_step.uses_kernels:
        sys.exit("host_profile.py: the plain step is measured: set MLXLLAMA_CUDA_KERNELS=0")
    theirs = MlxLm(runtime.config, runtime.model.compute_dtype)
    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            engines = {"ours": ours_engine(runtime, batch, depth, args.n_gen),
                       "mlx-lm": mlx_lm_engine(theirs, batch, depth, args.n_gen, runtime.model.compute_dtype)}
            runs = {(name, mode): {"tps": [], "host": []} for name in engines for mode in ("gc", "no gc")}
            for timed in engines.values():  # warm-up: each shape's kernels compile off the clock
                decode(timed, batch, depth, args.n_gen, 10_000, None)
            for round_ in range(args.rounds):
                order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
                for name, mode in order:
                    timer = decode if mode == "gc" else decode_without_gc
                    run = runs[(name, mode)]
                    run["tps"].append(timer(engines[name], batch, depth, args.n_gen, round_, run["host"]))
            row = {"batch": batch, "depth": depth, "runs": [
                {"engine": name, "gc": mode == "gc", "tps": run["tps"], "host_us": host_us(run["host"])}
                for (name, mode), run in runs.items()]}
            row["profiles"] = {name: profiled(timed, batch, depth, args.n_gen, args.top)
                               for name, timed in engines.items()}
            rows.append(row)
            report(row)
            if args.json:  # after every test, so that a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"device": bench.device_name(), "mlx": mx.__version__, "model": args.model,
                               "n_gen": args.n_gen, "rounds": args.rounds, "rows": rows}, f, indent=1)


def report(row: dict) -> None:
    print(f"\nbatch {row['batch']}, depth {row['depth']}")
    print("| engine | gc | t/s (median) | host µs a step, graph + launch |")
    print("| --- | --- | ---: | ---: |")
    for run in row["runs"]:
        graph, launch = run["host_us"]
        print(f"| {run['engine']} | {'on' if run['gc'] else 'off'} | {statistics.median(run['tps']):.1f}"
              f" | {graph:.0f} + {launch:.0f} |")
    for name, top in row["profiles"].items():
        print(f"\n{name}, under cProfile, µs a step (own / with callees), calls a step:")
        print("\n".join(profile_lines(top)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
