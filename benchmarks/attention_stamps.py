"""Where one attention item's time goes inside a layer_kernel launch (CUDA only): cycle stamps in its runs.

    python benchmarks/attention_stamps.py MODEL.gguf [--positions 100,1024] [--kv-bits 8]
    python benchmarks/attention_stamps.py --header-only > stamped.cu   # to compile-check it

Builds the one-sequence kernel step from a copy of the kernels' source in which lane 0 of the warp that
takes head group 0's first run of slots, and of the warp that takes its last run (the one ending at
the step's new slot), writes clock64() at each phase of its item into an extra output; so does the
warp that stores a quantized cache's new slot (store_fresh). It decodes up to the last of
--positions and at each prints, as medians over the layers, each phase's end in cycles from the
item's start. A position whose group has one run shows it as the last run only; "-1" marks a
phase the warp did not reach (a run that combines no head waits for none).
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxllama.cuda import kernels
from mlxllama.errors import MlxLlamaError

sys.path.insert(0, str(Path(__file__).parent))
from layer_timeline import arguments, instrumented_steps  # noqa: E402 - a sibling script

SLOTS = 64  # stamps a block: the first run's from 16, the last run's from 40, store_fresh's at 56 and 57
FIRST_RUN, LAST_RUN, STORE = 16, 40, 56
PHASES = ["queries staged", "run entered", "chunks done", "new slot done", "finish done", "run written",
          "arrived", "waited", "combined"]


def stamped_source(source: str) -> str:
    """The kernels' header (kernels.HEADER) with the stamps, and the layer kernel's extra output
    `att`, written in."""
    def put(anchor: str, text: str, before: bool = False) -> None:
        nonlocal source
        if source.count(anchor) != 1:
            raise SystemExit(f"attention_stamps.py: the kernels have changed: {anchor.strip()[:60]!r} not found once")
        source = source.replace(anchor, text + anchor if before else anchor + text)

    put("__device__ inline void grid_barrier(",
        "__device__ unsigned long long* g_att;\n"
        f"#define ASTAMP(base, k) do {{ if (g_att != nullptr && (base) >= 0 && threadIdx.x % 32 == 0) "
        f"g_att[blockIdx.x * {SLOTS} + (base) + (k)] = clock64(); }} while (0)\n", before=True)
    put("float* out, int out_stride, bool whole", ", int sb = -1")
    put("  constexpr int per_lane = HEAD_DIM / 32, at_once = Slots::at_once;\n", "  ASTAMP(sb, 2);\n")
    put("  if constexpr (Slots::quantized) {\n    if (fresh_last) {", "  ASTAMP(sb, 3);\n", before=True)
    put("  slots.finish(acc);\n", "  ASTAMP(sb, 4);\n", before=True)
    put("  slots.finish(acc);\n", "  ASTAMP(sb, 5);\n")
    put("    const int head = group * QH, kv_head = head / (HEADS / KV_HEADS), seq_head = seq * HEADS + head;\n",
        f"    const int sb = seq == 0 && group == 0 ? (r == runs - 1 ? {LAST_RUN} : r == 0 ? {FIRST_RUN} : -1) : -1;\n"
        "    ASTAMP(sb, 0);\n")
    put("    const auto head_slots = cache.template slots<QH>(", "    ASTAMP(sb, 1);\n", before=True)
    put("attn + seq_head * HEAD_DIM, HEAD_DIM, true", ", sb")
    put("group_partials + r * (HEAD_DIM + 2), stride, false", ", sb")
    put("    __threadfence();\n    __syncwarp();\n    unsigned int* done = runs_done", "    ASTAMP(sb, 6);\n", before=True)
    put("combiners = min(QH, runs);\n", "    ASTAMP(sb, 7);\n")
    put("    for (int h = rank; h < QH; h += combiners) {\n      combine_runs", "    ASTAMP(sb, 8);\n", before=True)
    put("      combine_runs<HEAD_DIM>(group_partials + h * stride, runs, attn + (seq_head + h) * HEAD_DIM);\n    }\n",
        "    ASTAMP(sb, 9);\n")
    put("  cache.store_fresh(seqs, positions);\n", f"  if (grid_warps() - 1 - grid_warp() == 0) ASTAMP({STORE}, 0);\n",
        before=True)
    put("  cache.store_fresh(seqs, positions);\n", f"  if (grid_warps() - 1 - grid_warp() == 0) ASTAMP({STORE}, 1);\n")
    put("const float* scratch, float* y", ", unsigned long long* att")
    put("  stage_input<true, HIDDEN, LAYER_THREADS>(x, attn_norm, eps[0], smem);\n  for (int pair = warp;",
        f"  g_att = att;\n  for (int i = threadIdx.x; i < {SLOTS}; i += blockDim.x) att[blockIdx.x * {SLOTS} + i] = 0;\n",
        before=True)
    return source


def report(position: int, label: str, stamps: list[mx.array], blocks: int) -> None:
    layers = [np.array(a).reshape(blocks, SLOTS).astype(np.int64) for a in stamps]
    print(f"position {position}, {label}: cycles from the item's start, median over layers")
    for base, name in ((FIRST_RUN, "first run"), (LAST_RUN, "last run (new slot)")):
        rows = [t[b, base:base + 10] - t[b, base] for t in layers for b in np.nonzero(t[:, base])[0][:1]]
        if not rows:
            continue
        phases = np.array(rows)[:, 1:]
        medians = [int(np.median(c[c >= 0])) if (c >= 0).any() else -1 for c in phases.T]
        print(f"  {name:20s} " + "  ".join(f"{n} {m}" for n, m in zip(PHASES, medians)))
    stored = [t[b, STORE + 1] - t[b, STORE] for t in layers for b in np.nonzero(t[:, STORE])[0][:1]]
    if stored:
        print(f"  store_fresh (one warp): {int(np.median(stored))} cycles")


def main():
    args = arguments(__doc__, "100,1024")
    if args.header_only:
        print(stamped_source(kernels.HEADER))
        return
    label = f"{args.kv_bits}-bit cache" if args.kv_bits else "unquantized cache"
    for position, stamps, blocks in instrumented_steps("attention_stamps.py", args, stamped_source, "att", SLOTS):
        report(position, label, stamps, blocks)


if __name__ == "__main__":
    try:
        main()
    except MlxLlamaError as error:
        raise SystemExit(f"attention_stamps.py: {error}")
