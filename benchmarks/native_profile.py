"""Where a decode step's host time goes inside MLX: py-spy's native stacks, as shares of the loop's samples.

    pip install py-spy
    MLXLLAMA_CUDA_KERNELS=0 python benchmarks/native_profile.py MODEL.gguf [--batch 1] [--depth 4096]
        [-n 128] [--seconds 10] [--rate 100] [--mlx-lm] [--raw OUT.txt] [--json OUT]
    python benchmarks/native_profile.py --summarize RAW.txt

Python's profiler (host_profile.py) sees MLX's calls only from outside; this sees into them. The
script runs itself under `py-spy record --native`: after a warm-up, the child decodes -n steps at a
time (host_profile.py's loop, the cache filled to --depth with random keys and values and cut back
after each run) for --seconds, and prints its tokens/s. Then, of the samples taken inside that timed
loop, the share that falls in each of a fixed list of frames (FRAMES): the step built in Python,
MLX's evaluation, attention and the CUDA graph work under it, quantized products, compiled kernels,
allocation. A frame counts a sample when it is anywhere on the sample's stack. py-spy samples on a
fixed clock, so a share is a share of the host's time in the loop, whatever the device does.
--summarize reads a raw file that py-spy wrote (this script's --raw, or another loop's with
--loop-frame) again.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

TIMED = "timed_decode"

# (label, a substring of the frame's name). MLX's CUDA backend names its work as below; a frame that
# no sample holds (on a Mac: the cuDNN and CUDA graph ones) shows 0%.
FRAMES = [
    ("the step built in Python (ours)", "Transformer.step"),
    ("the step built in Python (mlx-lm)", "Model.__call__"),
    ("MLX's evaluation, all of it", "mlx::core::async_eval"),
    ("  attention (ScaledDotProductAttention::eval_gpu)", "ScaledDotProductAttention::eval_gpu"),
    ("    through cuDNN (sdpa_cudnn)", "mlx::core::sdpa_cudnn"),
    ("      cuDNN's CUDA graph updated (DnnGraph::encode_graph)", "DnnGraph::encode_graph"),
    ("    MLX's vector kernel (sdpa_vector)", "mlx::core::sdpa_vector"),
    ("  the CUDA graph launched (CommandEncoder::commit)", "CommandEncoder::commit"),
    ("  kernel nodes added (add_kernel_node)", "add_kernel_node"),
    ("  quantized products (QuantizedMatmul::eval_gpu)", "QuantizedMatmul::eval_gpu"),
    ("  compiled kernels (Compiled::eval_gpu)", "Compiled::eval_gpu"),
    ("  device memory (CudaAllocator::malloc_async)", "CudaAllocator::malloc_async"),
    ("waiting on another thread (pthread_cond_wait: on a CPU, for the stream's)", "pthread_cond_wait"),
]


def summarize(raw_lines, loop: str = TIMED, leave_out: tuple[str, ...] = ()) -> dict:
    """The samples inside the function `loop`, and each FRAMES label's share of them in %; samples
    with a frame named in `leave_out` on their stack are not counted."""
    held = collections.Counter()
    samples = 0
    for number, line in enumerate(raw_lines, 1):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        if not count.isdigit():
            raise ValueError(f"line {number}: no sample count")
        names = [frame.split(" (")[0] for frame in stack.split(";")]
        if loop not in names or any(part in name for part in leave_out for name in names):
            continue
        samples += int(count)
        for label, part in FRAMES:
            if any(part in name for name in names):
                held[label] += int(count)
    return {"samples": samples,
            "shares": {label: round(100 * held[label] / samples, 1) if samples else 0.0 for label, _ in FRAMES}}


def report(summary: dict) -> None:
    print(f"{summary['samples']} samples in the timed loop; share of them on the stack:")
    for label, share in summary["shares"].items():
        print(f"  {share:5.1f}%  {label}")


# MLX, the package and the model are imported by the child only: --summarize runs on any machine.
def timed_decode(engine: dict, batch: int, depth: int, n_gen: int, seconds: float) -> float:
    from host_profile import decode

    tokens, start, seed = 0, time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        decode(engine, batch, depth, n_gen, seed, None)
        tokens, seed = tokens + batch * n_gen, seed + 1
    return tokens / (time.perf_counter() - start)


def loop(args) -> None:
    """The child under py-spy: decode for --seconds and print tokens/s."""
    from host_profile import decode, mlx_lm_engine, ours_engine
    from versus_mlx_lm import MlxLm

    from mlxllama import load

    runtime = load(args.model)
    if args.mlx_lm:
        theirs = MlxLm(runtime.config, runtime.model.compute_dtype)
        engine = mlx_lm_engine(theirs, args.batch, args.depth, args.n_gen, runtime.model.compute_dtype)
    else:
        engine = ours_engine(runtime, args.batch, args.depth, args.n_gen)
    decode(engine, args.batch, args.depth, args.n_gen, 10_000, None)  # each kernel compiles off the clock
    print(f"{timed_decode(engine, args.batch, args.depth, args.n_gen, args.seconds):.1f} tokens/s", flush=True)


def fail(message: str):
    print(f"native_profile.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--depth", type=int, default=4096)
    parser.add_argument("-n", "--n-gen", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=int, default=100, help="py-spy's samples a second")
    parser.add_argument("--mlx-lm", action="store_true", help="mlx-lm's model (versus_mlx_lm.MlxLm) in place of ours")
    parser.add_argument("--raw", metavar="OUT", help="keep py-spy's raw stacks here")
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--summarize", metavar="RAW", help="only summarize a raw file py-spy wrote (.gz: gzipped)")
    parser.add_argument("--loop-frame", default=TIMED, help="with --summarize: the function whose samples count")
    parser.add_argument("--leave-out", action="append", default=[], metavar="FRAME",
                        help="with --summarize: leave out samples with this frame on their stack (a one-off"
                             " compile inside a loop that warmed up in it); repeatable")
    parser.add_argument("--loop", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loop:
        return loop(args)
    if args.summarize:
        try:
            with (gzip.open if args.summarize.endswith(".gz") else open)(args.summarize, "rt") as f:
                summary = summarize(f, args.loop_frame, tuple(args.leave_out))
        except OSError as e:
            fail(f"{args.summarize}: {e.strerror or e}")
        except (UnicodeDecodeError, EOFError, ValueError) as e:
            fail(f"{args.summarize}: not a raw py-spy file ({e})")
        if not summary["samples"]:
            fail(f"{args.summarize}: no samples inside {args.loop_frame}()")
        return report(summary)
    if not args.model:
        parser.error("the model is needed (or --summarize RAW)")
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if spy is None:
        fail("py-spy is not installed (pip install py-spy)")
    from host_profile import load_checked

    runtime = load_checked(args.model, "native_profile.py", args.n_gen, (args.depth,))
    if runtime.model.decode_step.uses_kernels and not args.mlx_lm:
        fail("the plain step is measured: set MLXLLAMA_CUDA_KERNELS=0")
    del runtime
    with tempfile.TemporaryDirectory() as tmp:
        raw = args.raw or os.path.join(tmp, "raw.txt")
        child = [sys.executable, os.path.abspath(__file__), "--loop", args.model, "--batch", str(args.batch),
                 "--depth", str(args.depth), "-n", str(args.n_gen), "--seconds", str(args.seconds)]
        if args.mlx_lm:
            child.append("--mlx-lm")
        run = subprocess.run([spy, "record", "--native", "-r", str(args.rate), "-f", "raw",
                              "-o", raw, "--", *child], capture_output=True, text=True)
        speed = [line for line in run.stdout.splitlines() if line.endswith("tokens/s")]
        if run.returncode != 0 or not speed:
            fail(f"py-spy or the decode loop failed: {(run.stderr.strip().splitlines() or ['no output'])[-1]}")
        with open(raw) as f:
            summary = summarize(f)
        if not summary["samples"]:
            fail(f"py-spy took no samples inside {TIMED}()")
    print(f"{'mlx-lm' if args.mlx_lm else 'ours'}, batch {args.batch}, depth {args.depth}: {speed[-1]}")
    report(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "engine": "mlx-lm" if args.mlx_lm else "ours", "batch": args.batch,
                       "depth": args.depth, "n_gen": args.n_gen, "seconds": args.seconds, "rate": args.rate,
                       "tokens_per_s": float(speed[-1].split()[0]), **summary}, f, indent=1)


if __name__ == "__main__":
    main()
