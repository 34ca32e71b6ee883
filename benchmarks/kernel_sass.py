"""The layer kernels as ptxas compiles them for an H100, on a machine without a GPU: registers, spills, SASS.

    python benchmarks/kernel_sass.py [--cache plain 8 4] [--batch] [--source decode_step.cu] [--sass DIR]
    python benchmarks/kernel_sass.py --q6-k [--sass DIR]

Wraps decode_step.cu's layer_kernel (--batch: decode_batch.cu's batch_layer_kernel, two tiles) in a
__global__ function instantiated as step.py instantiates it for the TinyLlama-shape Q4_K_M file
(`bench --synthetic`) on one of its layers whose V and down projections are Q6_K: the template
arguments in TINYLLAMA below, the arrays' types as MLX's generated source declares them, over a
float16 cache or, for `--cache 8` and `4`, keys and values of that many bits in --kv-group-size's
default groups for heads of 64 (KVQuantization.for_heads: 32) with float16 scales. MAX_RUNS is what kernels.max_runs
gives on an H100's 132 SMs (one sequence, or the batch kernel's 16). Each build is `nvcc -std=c++17
-O3 -arch=sm_90 -cubin`, and ptxas's register and spill counts are printed; with --sass, cuobjdump's
SASS of each build is written to DIR, to see where loads wait (docs/benchmarks.md, "Attention at
depth"), and its spill instructions are counted step by step. --source compiles another copy of
decode_step.cu (a variant under study) instead.
--q6-k builds q6_k.cu's kernels instead, for TinyLlama's Q6_K output layer (2,048 columns): the
product of 1 and of 16 float16 inputs (as blocks.py launches them), and the kernel step's head.

Needs nvcc for CUDA 12.8 or later. cuobjdump and the nvdisasm it runs come with a full CUDA, or
from PyPI's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels (docs/maintaining.md, "The
GPU"). MLX compiles the kernels with NVRTC for sm_90 with no other options, whose code generation
is ptxas's too; MLX's own generated source for the file (combine-loads/mlx-generated-source.txt in
benchmarks/results), built here, loads the combined runs as these builds do.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from mlxllama.cache import KVQuantization
from mlxllama.cuda import kernels

TINYLLAMA = dict(Q_BITS=4, Q_BIASES="true", K_BITS=4, K_BIASES="true", V_BITS=8, V_BIASES="false", BIAS="false",
                 HEADS=32, KV_HEADS=4, HEAD_DIM=64, ROPE_DIM=64, TRADITIONAL="true", HIDDEN=2048, O_BITS=4,
                 O_BIASES="true", GATE_BITS=4, GATE_BIASES="true", UP_BITS=4, UP_BIASES="true", DOWN_BITS=8,
                 DOWN_BIASES="false", FFN=5632)
H100_SMS = 132  # layer_kernel's grid: one block an SM
CACHES = {"plain": None, "8": KVQuantization(8), "4": KVQuantization(4)}  # as --kv-bits makes them
SOURCE = Path(kernels.__file__).parent


def wrapper(function: str, header: str, cache: KVQuantization | None, batch: bool) -> str:
    """`header` and a __global__ function that calls `function` with the template arguments above,
    over a plain cache (None) or one quantized as `cache` says."""
    cache = cache.for_heads(TINYLLAMA["HEAD_DIM"]) if cache else None
    key_bits, value_bits, group = (cache.bits_of_keys, cache.bits, cache.group_size) if cache else (0, 0, 0)
    found = re.search(rf"__device__ void {function}\((.*?)\)\s*{{", header, re.S)
    if found is None:
        sys.exit(f"kernel_sass.py: the source has no {function}")
    signature = found.group(1)
    # As MLX declares the arrays for that file (its generated source): float16 norms and scales,
    # float32 biases, and a plain cache's unused scale arrays float32.
    types = dict(N="__half", S="__half", B="float", C="uint32_t" if key_bits else "__half",
                 KS="__half" if key_bits else "float")
    parameters = []
    for declaration in signature.split(","):
        kind, name = declaration.strip().rsplit(" ", 1)
        for letter, concrete in types.items():
            kind = re.sub(rf"\b{letter}\b", concrete, kind)
        parameters.append((kind, name.lstrip("*")))
    values = dict(TINYLLAMA, KEY_BITS=key_bits, VALUE_BITS=value_bits, KV_GROUP=group)
    arguments = [str(values[name]) for name in kernels.LAYER_TEMPLATE]
    shape = SimpleNamespace(n_heads=TINYLLAMA["HEADS"], n_kv_heads=TINYLLAMA["KV_HEADS"],
                            head_dim=TINYLLAMA["HEAD_DIM"])
    # Keys staged in shared memory, as step.py does for TinyLlama's shapes on an H100.
    staged = "true"
    if batch:  # two tiles of sequences, as step.py's _batch_layer takes 16
        runs = kernels.max_runs(H100_SMS, shape, 2 * kernels.SEQ_TILE)
        arguments = ["2"] + arguments + [str(runs), staged]
    else:
        runs = kernels.max_runs(H100_SMS, shape, kv_group=group)
        arguments = arguments + [str(kernels.FFN_ROWS), str(runs), staged]
    call = f"{function}<{', '.join(arguments + list(types.values()))}>({', '.join(n for _, n in parameters)});"
    declared = ", ".join(f"{kind} {name}" for kind, name in parameters)
    return (f"#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cstdint>\n{header}\n"
            f"__global__ void instantiated({declared}) {{ {call} }}\n")


# q6_k.cu's kernels as blocks.py instantiates them for TinyLlama's output layer: name, template arguments, parameters.
Q6_K_BUILDS = [
    ("q6_k_product_kernel, 1 input", "2048, 1, 1", "const __half* x, const uint8_t* w, int rows, __half* y"),
    ("q6_k_product_kernel, 16 inputs", "2048, 16, 2", "const __half* x, const uint8_t* w, int rows, __half* y"),
    ("q6_k_head_kernel", "2048",
     "const float* x, const __half* norm_w, const float* eps, const uint8_t* w, int rows, float* y"),
]


def q6_k_wrapper(header: str, function: str, arguments: str, declared: str) -> str:
    names = ", ".join(d.rsplit(" ", 1)[1].lstrip("*") for d in declared.split(","))
    return (f"#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cstdint>\n{header}\n"
            f"__global__ void instantiated({declared}) {{ {function}<{arguments}>({names}); }}\n")


def build(unit_text: str, name: str, label: str, work: str, sass: Path | None) -> None:
    """Compile one wrapper with nvcc, print ptxas's counts under `label`; with `sass`, write its SASS as NAME.sass."""
    unit, cubin = Path(work) / f"{name}.cu", Path(work) / f"{name}.cubin"
    unit.write_text(unit_text)
    built = subprocess.run(["nvcc", "-std=c++17", "-O3", "-arch=sm_90", "-cubin", "-Xptxas", "-v",
                            "-o", str(cubin), str(unit)], capture_output=True, text=True)
    if built.returncode:
        sys.exit(f"kernel_sass.py: nvcc failed for {label}:\n{built.stderr}")
    counts = re.findall(r"(\d+ bytes spill stores, \d+ bytes spill loads|Used \d+ registers)", built.stderr)
    print(f"{label}: {'; '.join(counts)}")
    if sass:
        listing = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True, check=True)
        (sass / f"{name}.sass").write_text(listing.stdout)
        print(f"  {spills_by_step(listing.stdout)}")


def spills_by_step(listing: str) -> str:
    """The local-memory stores and loads (STL, LDL: ptxas's spills) of a layer kernel's SASS in each of
    its steps, cut at the grid barriers (each barrier's arrival is the launch's one 64-bit atomic
    add): ptxas allocates registers for the whole kernel, and a change to one step can make another
    spill (docs/benchmarks.md, "The FFN's products in units"). Another kernel's in all."""
    lines = listing.splitlines()
    arrivals = [i for i, line in enumerate(lines) if "ATOMG.E.ADD.64" in line]
    edges = [0, *arrivals, len(lines)]

    def count(a: int, b: int) -> str:
        ops = [found[1] for line in lines[a:b] if (found := re.search(r"\b(STL|LDL)\b", line))]
        return f"{ops.count('STL')}/{ops.count('LDL')}"

    if len(arrivals) != 4:
        return f"spill instructions (stores/loads): {count(0, len(lines))}"
    return "spill instructions (stores/loads) by step: " + ", ".join(
        f"{step} {count(a, b)}" for step, (a, b) in enumerate(zip(edges, edges[1:]), start=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="example: python benchmarks/kernel_sass.py --cache plain 8 --sass /tmp/sass")
    parser.add_argument("--cache", nargs="+", choices=list(CACHES), default=list(CACHES),
                        help="the caches to build for: plain (float16), or --kv-bits 8 or 4 (default: all three)")
    parser.add_argument("--batch", action="store_true", help="batch_layer_kernel instead of layer_kernel")
    parser.add_argument("--source", type=Path, default=SOURCE / "decode_step.cu",
                        help="a copy of decode_step.cu to build instead (a variant under study)")
    parser.add_argument("--sass", type=Path, metavar="DIR",
                        help="write each build's SASS here and count its spill instructions by step (needs cuobjdump "
                             "and nvdisasm)")
    parser.add_argument("--q6-k", action="store_true", help="q6_k.cu's kernels instead of the layer kernels")
    args = parser.parse_args()
    if args.q6_k and args.batch:
        sys.exit("kernel_sass.py: --q6-k and --batch build different kernels: give one")
    for tool in ["nvcc"] + (["cuobjdump", "nvdisasm"] if args.sass else []):
        if shutil.which(tool) is None:
            sys.exit(f"kernel_sass.py: {tool} not found on PATH")
    if not args.source.is_file():
        sys.exit(f"kernel_sass.py: {args.source}: no such file")
    if args.sass:
        try:
            args.sass.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            sys.exit(f"kernel_sass.py: --sass {args.sass}: {e.strerror}")
    header = kernels._stripped(args.source.read_text())
    with tempfile.TemporaryDirectory() as work:
        if args.q6_k:
            header += kernels._stripped((SOURCE / "q6_k.cu").read_text())
            for i, (label, arguments, declared) in enumerate(Q6_K_BUILDS):
                function = label.split(",")[0]
                build(q6_k_wrapper(header, function, arguments, declared), f"{function}-{i}", label, work, args.sass)
            return
        if args.batch:
            header += kernels._stripped((SOURCE / "decode_batch.cu").read_text())
        function = "batch_layer_kernel" if args.batch else "layer_kernel"
        for cache in args.cache:
            build(wrapper(function, header, CACHES[cache], args.batch), f"{function}-{cache}",
                  f"{function}, {cache} cache", work, args.sass)


if __name__ == "__main__":
    main()
