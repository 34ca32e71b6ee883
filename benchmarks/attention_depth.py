"""The CUDA kernels' decode speed at depth under other attention settings (CUDA only), side by side in one process.

    python benchmarks/attention_depth.py MODEL.gguf [--depths 0,4096,8192] [--batches 1,16]
        [--query-heads 8,4] [--runs-limits 64,128] [--staged-keys 1,0] [--sources shipped,VARIANT.cu]
        [--kv-bits 0,8,4] [--rounds 1] [-n 128] [-r 2] [--json OUT.jsonl]

Each variant is one setting of what shapes attention (mlxllama/cuda; team_attention for one sequence,
attention_items for several): the query heads a warp takes at once (decode_step.cu's MAX_QUERY_HEADS,
patched into the kernels' source), the runs a head group's slots may be cut into (kernels.RUNS_LIMIT;
for one sequence, the most teams a group takes, which a block a group bounds first), whether a plain cache's keys are staged
in shared memory (KernelStep.stage_keys) and the decode_step.cu the kernels are built from
("shipped", or a variant's file under study, e.g. the shipped file with a patch applied: `patch -o
VARIANT.cu mlxllama/cuda/decode_step.cu < P.patch`); every combination of the values given, the
shipped setting first, and with `--rounds` all of them again in turn. For each, `mlxllama bench`'s tg (bench.run: -p 0, its -n, -r, -b and -d) with the kernels,
over each cache of --kv-bits (0: unquantized; else `--kv-bits N`'s): one line a variant, cache and
test, and the rows as JSON lines with --json.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import mlx.core as mx

from mlxllama import bench
from mlxllama.cache import KVQuantization
from mlxllama.cuda import kernels
from mlxllama.cuda.step import KernelStep
from mlxllama.errors import MlxLlamaError

SHIPPED = {"query_heads": kernels.MAX_QUERY_HEADS, "runs_limit": kernels.RUNS_LIMIT,
           "staged_keys": int(KernelStep.stage_keys), "source": "shipped"}
SHIPPED_HEADER, BATCH_PART = kernels.HEADER, kernels.BATCH_HEADER[len(kernels.HEADER):]


def use(query_heads: int, runs_limit: int, staged_keys: int, source: str) -> None:
    """The kernels built from now on take `query_heads`, `runs_limit` and `staged_keys`, from `source`."""
    header = SHIPPED_HEADER if source == "shipped" else kernels._stripped(Path(source).read_text())
    header = re.sub(r"constexpr int MAX_QUERY_HEADS = \d+;", f"constexpr int MAX_QUERY_HEADS = {query_heads};",
                    header)
    kernels.HEADER, kernels.BATCH_HEADER = header, header + BATCH_PART
    # A source from before one sequence's tensor-core runs stages keys for every head size.
    tensor = re.search(r"constexpr int TENSOR_RUNS_MAX_HEAD_DIM = (\d+);", header)
    kernels.TENSOR_RUNS_MAX_HEAD_DIM = int(tensor.group(1)) if tensor else 0
    kernels.MAX_QUERY_HEADS, kernels.RUNS_LIMIT = query_heads, runs_limit
    KernelStep.stage_keys = bool(staged_keys)
    kernels.kernel.cache_clear()


def variants(query_heads: list[int], runs_limits: list[int], staged_keys: list[int],
             sources: list[str]) -> list[dict[str, object]]:
    settings = [dict(query_heads=q, runs_limit=r, staged_keys=k, source=f) for q in query_heads for r in runs_limits
                for k in staged_keys for f in sources]
    return [SHIPPED] + [setting for setting in settings if setting != SHIPPED]


def numbers(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--depths", type=numbers, default=[0, 4096, 8192])
    parser.add_argument("--batches", type=numbers, default=[1, 16])
    parser.add_argument("--query-heads", type=numbers, default=[8, 4])
    parser.add_argument("--runs-limits", type=numbers, default=[64, 128])
    parser.add_argument("--staged-keys", type=numbers, default=[1])
    parser.add_argument("--sources", type=lambda text: text.split(","), default=["shipped"])
    parser.add_argument("--kv-bits", type=numbers, default=[0], help="caches to decode over: 0 unquantized, 8 or 4")
    parser.add_argument("--rounds", type=int, default=1, help="times every variant is run, in turn")
    parser.add_argument("-n", "--n-gen", type=int, default=128)
    parser.add_argument("-r", "--repetitions", type=int, default=2)
    parser.add_argument("--json", help="write each variant's tests as JSON lines here")
    args = parser.parse_args()
    if not mx.cuda.is_available():
        raise SystemExit("attention_depth.py: needs MLX's CUDA backend")
    for source in args.sources:
        if source != "shipped" and not Path(source).is_file():
            raise SystemExit(f"attention_depth.py: no such file: {source}")
    if any(bits not in (0, 4, 8) for bits in args.kv_bits):
        raise SystemExit("attention_depth.py: --kv-bits takes 0, 4 and 8")
    rows = []
    for round_, variant, kv_bits in ((r, v, b) for r in range(args.rounds)
                                     for v in variants(args.query_heads, args.runs_limits, args.staged_keys, args.sources)
                                     for b in args.kv_bits):
        use(**variant)
        try:
            report = bench.run(args.model, n_prompt=0, n_gen=args.n_gen, batches=tuple(args.batches),
                               repetitions=args.repetitions, depths=tuple(args.depths),
                               kv_quantization=KVQuantization(kv_bits) if kv_bits else None)
        except MlxLlamaError as e:
            raise SystemExit(f"attention_depth.py: {e}")
        if report.mode != "native+kernels":
            raise SystemExit(f"attention_depth.py: {args.model} does not decode through the CUDA kernels")
        for test in report.tests:
            row = dict(variant, kv_bits=kv_bits, round=round_, batch=test.batch, depth=test.depth,
                       tokens_per_second=round(test.median, 1), stdev=round(test.stdev, 1))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
