"""Q6_K's two affine forms side by side in one process: groups of 32 with biases derived on each call
(the CUDA kernels' layout) against the wide form, groups of 64 with biases stored (what MLX's own
products now read), on the plain MLX step.

    MLXLLAMA_CUDA_KERNELS=0 python benchmarks/q6k_groups_ab.py MODEL.gguf [-n 128] [--batches 1,8,16]
        [--depths 0] [--rounds 7] [--dtype float16] [--json OUT]

Both forms hold 8.5 bits a weight; the wide one saves a launch (the bias multiply) for every Q6_K
projection a step in float16 (a float32 input has MLX cast the stored scales and biases instead).
The file is loaded once in each form, in MLX's affine form on any device (the CPU would otherwise
take its sub-block form) and the compute type `--dtype` (default: the device's); each test times them in turn, --rounds
times, which goes first alternating, and gives the medians, their ratio (wide / pairs) with its
spread (slowest wide over fastest pairs, fastest over slowest), each form's launches a step
(mlxllama.step_cost) and the host's time to build and queue a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from unittest.mock import patch

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mlxllama.runtime  # noqa: E402
from mlxllama import bench  # noqa: E402
from mlxllama.weights import load_model  # noqa: E402


def load(path: str, wide: bool, dtype: str | None):
    forms = {"wide": wide, "sub_blocks": False}
    with patch.object(mlxllama.runtime, "load_model", lambda *a, **kw: load_model(*a, **{**kw, **forms})):
        return mlxllama.runtime.load(path, dtype=dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("-n", "--n-gen", type=int, default=128)
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--depths", default="0")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype")
    parser.add_argument("--json")
    args = parser.parse_args()
    forms = {"pairs": load(args.model, False, args.dtype), "wide": load(args.model, True, args.dtype)}
    for name, runtime in forms.items():
        if runtime.model.decode_step.uses_kernels:
            sys.exit("q6k_groups_ab.py: the CUDA kernels took the step: run with MLXLLAMA_CUDA_KERNELS=0")
        print(name, runtime.weight_form, bench.weight_param_bytes(runtime), "bytes of weights", flush=True)
    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            launches = {name: sum(bench.step_launches(rt, batch, depth).values()) for name, rt in forms.items()}
            rates = {name: [] for name in forms}
            host = {name: [] for name in forms}
            for name, runtime in forms.items():  # warm-up: every kernel compiled before timing
                bench.time_generation(runtime, batch, 8, 0, depth)
            for r in range(args.rounds):
                for name in (forms if r % 2 == 0 else reversed(list(forms))):
                    seconds = bench.time_generation(forms[name], batch, args.n_gen, r, depth, host[name])
                    rates[name].append(batch * args.n_gen / seconds)
            wide, pairs = statistics.median(rates["wide"]), statistics.median(rates["pairs"])
            row = {"batch": batch, "depth": depth, "pairs": rates["pairs"], "wide": rates["wide"],
                   "ratio": wide / pairs,
                   "spread": [min(rates["wide"]) / max(rates["pairs"]), max(rates["wide"]) / min(rates["pairs"])],
                   "launches": launches,
                   "host_us": {n: [round(1e6 * statistics.median(h[i] for h in host[n]), 1) for i in (0, 1)]
                               for n in forms}}
            rows.append(row)
            print(f"tg{args.n_gen} b={batch} d={depth}: wide {wide:.1f} pairs {pairs:.1f} t/s, {row['ratio']:.3f}x "
                  f"({row['spread'][0]:.2f}-{row['spread'][1]:.2f}), launches {launches}, host {row['host_us']}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": bench.device_name(), "mlx": mx.__version__,
                                               "model": args.model, "rounds": args.rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
