"""Two builds of the plain step side by side in one process, and mlx-lm's model in the same loop.

    git archive REV mlxllama | tar x -C /tmp/before && mv /tmp/before/mlxllama /tmp/before/mlxllama_before
    MLXLLAMA_CUDA_KERNELS=0 python benchmarks/step_ab.py MODEL.gguf --before /tmp/before
        [-p 512] [--batches 1,8,16] [--depths 0,4096,8192] [-n 128] [--rounds 7] [--json OUT]

"after" is this tree's mlxllama, "before" the package `mlxllama_before` found in the --before folder
(another commit's mlxllama under that name: its imports are relative, so both load in one process).
With -p N, the three engines first prefill N random ids into an empty cache in turn, --rounds times
(bench.time_prompt, MlxLm.time_prompt: each build attends its prefill as its runtime does on this
backend). Then for each depth and batch, each engine's cache is filled with random keys and values
(versus_mlx_lm.py's --fill random), and the three engines decode -n tokens in bench.time_steps's
loop in turn, --rounds times, the order reversed every other round. It prints each engine's median
tokens/s (and for decoding host µs a step: building the graph + launching it), and after / before
and after / mlx-lm as ratios of the medians with their spreads (slowest over fastest, fastest over
slowest), and round by round (versus_mlx_lm.paired: the median of each round's own ratio, lowest
to highest).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from functools import partial

import mlx.core as mx

from mlxllama import bench, load
from mlxllama.errors import MlxLlamaError
from host_profile import decode, mlx_lm_engine, ours_engine
from versus_mlx_lm import MlxLm, host_us, interleaved_rounds, paired, spread


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("-p", "--n-prompt", type=int, default=0, help="also time a prefill of this many ids, first")
    parser.add_argument("--before", required=True, metavar="DIR", help="the folder holding another commit's mlxllama as mlxllama_before: git archive REV "
                             "mlxllama | tar x -C DIR && mv DIR/mlxllama DIR/mlxllama_before")
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--depths", default="0,4096,8192")
    parser.add_argument("-n", "--n-gen", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    sys.path.insert(0, args.before)
    try:
        before_package = importlib.import_module("mlxllama_before")
        before_bench = importlib.import_module("mlxllama_before.bench")
    except ImportError:
        sys.exit(f"step_ab.py: no mlxllama_before in {args.before}")
    batches, depths = [int(b) for b in args.batches.split(",")], [int(d) for d in args.depths.split(",")]
    try:
        after, before = load(args.model), before_package.load(args.model)
        bench.check_fits(after, args.n_prompt, args.n_gen, tuple(depths))
    except (MlxLlamaError, before_package.errors.MlxLlamaError) as e:
        print(f"step_ab.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    if after.model.decode_step.uses_kernels or before.model.decode_step.uses_kernels:
        sys.exit("step_ab.py: the plain step is measured: set MLXLLAMA_CUDA_KERNELS=0")
    theirs = MlxLm(after.config, after.model.compute_dtype)
    tests = [("pp", 1, 0)] if args.n_prompt else []
    tests += [("tg", b, d) for d in depths for b in batches]
    rows = []
    for kind, batch, depth in tests:
        host = {name: [] for name in ("after", "before", "mlx-lm")}
        if kind == "pp":
            n = args.n_prompt
            timers = {"after": lambda seed: n / bench.time_prompt(after, n, seed),
                      "before": lambda seed: n / before_bench.time_prompt(before, n, seed),
                      "mlx-lm": lambda seed: n / theirs.time_prompt(n, seed)}
        else:
            engines = {name: ours_engine(runtime, batch, depth, args.n_gen)
                       for name, runtime in (("after", after), ("before", before))}
            engines["mlx-lm"] = mlx_lm_engine(theirs, batch, depth, args.n_gen, after.model.compute_dtype)
            timers = {name: partial(decode, engine, batch, depth, args.n_gen, host=host[name])
                      for name, engine in engines.items()}
        tps = interleaved_rounds(timers, args.rounds, host, bench.warm_up_runs(after))
        row = {"test": f"pp{args.n_prompt}" if kind == "pp" else f"tg{args.n_gen}", "batch": batch, "depth": depth,
               "tps": tps}
        if kind == "tg":
            row["host_us"] = {n: host_us(h) for n, h in host.items()}
        for other in ("before", "mlx-lm"):
            row[f"after/{other}"] = statistics.median(tps["after"]) / statistics.median(tps[other])
            row[f"after/{other} spread"] = spread(tps["after"], tps[other])
            row[f"after/{other} paired"] = paired(tps["after"], tps[other])
        rows.append(row)
        print(f"{row['test']} b={batch} d={depth}: " + report(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": bench.device_name(), "mlx": mx.__version__, "model": args.model,
                           "n_prompt": args.n_prompt, "n_gen": args.n_gen, "rounds": args.rounds, "rows": rows},
                          f, indent=1)


def report(row: dict) -> str:
    """Each engine's median tokens/s and a decode's host µs (graph + launch), then the ratios with their spreads."""
    engines = []
    for name, tps in row["tps"].items():
        host = row.get("host_us", {}).get(name)
        engines.append(f"{name} {statistics.median(tps):.1f} t/s" + (f" ({host[0]:.0f} + {host[1]:.0f} µs)" if host else ""))
    ratios = []
    for other in ("before", "mlx-lm"):
        low, high = row[f"after/{other} spread"]
        median, lowest, highest = row[f"after/{other} paired"]
        ratios.append(f"after/{other} {row[f'after/{other}']:.2f}× ({low:.2f}–{high:.2f}), round by round"
                      f" {median:.2f}× ({lowest:.2f}–{highest:.2f})")
    return ", ".join(engines) + "; " + "; ".join(ratios)


if __name__ == "__main__":
    main()
