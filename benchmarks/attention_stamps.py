"""Where one attention item's time goes inside a layer_kernel launch (CUDA only): cycle stamps in its runs.

    python benchmarks/attention_stamps.py MODEL.gguf [--positions 100,1024] [--kv-bits 8] [--source VARIANT.cu]
    python benchmarks/attention_stamps.py --header-only > stamped.cu   # to compile-check it

Builds the one-sequence kernel step from a copy of the kernels' source in which lane 0 of the warp that
takes head group 0's first run of slots, and of the warp that takes its last run (the one ending at
the step's new slot), writes clock64() at each phase of its team's item (team_attention) into an extra
output; so does the warp that stores a quantized cache's new slot (store_fresh). It decodes up to the
last of --positions and at each prints, as medians over the layers, each phase's end in cycles from
the item's start. A position whose group has one run shows it as the last run only; a phase the warp
did not reach is left out (a group of one team has no arrival nor cross-team combining, and only the
last team done combines; a run on tensor cores, tensor_attention_run's, has no new slot or finish
phase, and its "chunk" is a step of 32 slots). --source stamps another copy of decode_step.cu, as
layer_timeline.py's does.
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

SLOTS = 80  # stamps a block: the first run's from 16, the last run's from 40, store_fresh's at 72 and 73
FIRST_RUN, LAST_RUN, STORE = 16, 40, 72
# Each phase's end as the stamp after the item's start (stamp 0) that marks it, in the order they come.
PHASES = [("queries staged", 1), ("run entered", 2), ("first chunk scored", 12),
          ("first chunk weighted", 13), ("first chunk done", 10), ("chunks done", 3), ("new slot done", 4),
          ("finish done", 5), ("run written", 6), ("team combined", 7), ("arrived", 8), ("teams combined", 9)]


def stamped_source(source: str) -> str:
    """The kernels' header (kernels.HEADER) with the stamps, and the layer kernel's extra output
    `att`, written in."""
    def swap(anchor: str, text: str) -> None:
        nonlocal source
        if source.count(anchor) != 1:
            raise SystemExit(f"attention_stamps.py: the kernels have changed: {anchor.strip()[:60]!r} not found once")
        source = source.replace(anchor, text)

    def put(anchor: str, text: str, before: bool = False) -> None:
        swap(anchor, text + anchor if before else anchor + text)

    put("__device__ inline void grid_barrier(",
        "__device__ unsigned long long* g_att;\n"
        f"#define ASTAMP(base, k) do {{ if (g_att != nullptr && (base) >= 0 && threadIdx.x % 32 == 0) "
        f"g_att[blockIdx.x * {SLOTS} + (base) + (k)] = clock64(); }} while (0)\n", before=True)
    put("bool fresh_last,\n                              float* out, int out_stride, bool whole", ", int sb = -1")
    put("  constexpr int per_lane = HEAD_DIM / 32, at_once = Slots::at_once;\n", "  ASTAMP(sb, 2);\n")
    # The same phases of a run on tensor cores (tensor_attention_run; no new slot or finish there).
    put("int end,\n                                     float* out, int out_stride, bool whole", ", int sb = -1")
    put("  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;\n", "  ASTAMP(sb, 2);\n")
    put("    if (next < end) {\n      step_rows(keys, next, end, key);", "    if (first == begin) ASTAMP(sb, 12);\n",
        before=True)
    put("#pragma unroll\n    for (int e = 0; e < PARTS; ++e) {\n#pragma unroll\n      for (int m = 0; m < 4; ++m) {\n"
        "        acc[e][m][0] *= correction;", "    if (first == begin) ASTAMP(sb, 13);\n", before=True)
    put("    if (next < end) {\n      step_rows(values, next, end, value);", "    if (first == begin) ASTAMP(sb, 10);\n",
        before=True)
    put("  sum_exp += __shfl_xor_sync(0xffffffff, sum_exp, 1);\n", "  ASTAMP(sb, 3);\n", before=True)
    put("      slots.score(slot, q, q_sums, score);\n    }\n", "    if (chunk == begin) ASTAMP(sb, 12);\n")
    put("    if (slot < cached_end) {\n      slots.add_value_biases(slot, p);", "    if (chunk == begin) ASTAMP(sb, 13);\n",
        before=True)
    put("      slots.add_values(acc, p, t, dims[t]);\n    }\n", "    if (chunk == begin) ASTAMP(sb, 10);\n")
    put("  if constexpr (Slots::quantized) {\n    if (fresh_last) {", "  ASTAMP(sb, 3);\n", before=True)
    put("  slots.finish(acc);\n", "  ASTAMP(sb, 4);\n", before=True)
    put("  slots.finish(acc);\n", "  ASTAMP(sb, 5);\n")
    # team_attention: the item's start, its queries, its run's calls, then the block's and the teams' combining.
    put("    __syncthreads();  // the block's previous item has read its queries and results\n",
        "    const int sb_run = item / GROUPS * LAYER_WARPS + warp;\n"
        f"    const int sb = item % GROUPS == 0 ? (sb_run == runs - 1 ? {LAST_RUN} : sb_run == 0 ? {FIRST_RUN} : -1) : -1;\n"
        "    ASTAMP(sb, 0);\n", before=True)
    put("    const int r = team * LAYER_WARPS + warp, begin = r * run", "    ASTAMP(sb, 1);\n", before=True)
    for call in ("                                           out, out_stride, whole);\n",  # tensor_attention_run's
                 "                                    out_stride, whole);\n"):  # attention_run's
        swap(call, call.replace("whole);", "whole, sb);"))
    put("    if (runs == 1) {\n      continue;\n    }\n    __syncthreads();", "    ASTAMP(sb, 6);\n", before=True)
    put("    if (last) {\n      continue;\n    }\n    __threadfence();", "    ASTAMP(sb, 7);\n", before=True)
    put("    if (arrived < static_cast<unsigned int>(teams)) {", "    ASTAMP(sb, 8);\n", before=True)
    put("      attn[(head + h) * HEAD_DIM + d] = num / den;\n    }\n", "    ASTAMP(sb, 9);\n")
    put("  cache.store_fresh(1, position);\n", f"  if (grid_warps() - 1 - grid_warp() == 0) ASTAMP({STORE}, 0);\n",
        before=True)
    put("  cache.store_fresh(1, position);\n", f"  if (grid_warps() - 1 - grid_warp() == 0) ASTAMP({STORE}, 1);\n")
    put("const float* scratch, float* y", ", unsigned long long* att")
    put("  cache.prefetch(0, position[0]);\n  stage_input<true, HIDDEN, LAYER_THREADS>(x, attn_norm, eps[0], smem);\n",
        f"  g_att = att;\n  for (int i = threadIdx.x; i < {SLOTS}; i += blockDim.x) att[blockIdx.x * {SLOTS} + i] = 0;\n",
        before=True)
    return source


def report(position: int, label: str, stamps: list[mx.array], blocks: int) -> None:
    layers = [np.array(a).reshape(blocks, SLOTS).astype(np.int64) for a in stamps]
    print(f"position {position}, {label}: cycles from the item's start, median over layers")
    for base, name in ((FIRST_RUN, "first run"), (LAST_RUN, "last run (new slot)")):
        rows = [t[b, base + np.array([k for _, k in PHASES])] - t[b, base]
                for t in layers for b in np.nonzero(t[:, base])[0][:1]]
        if not rows:
            continue
        medians = [int(np.median(c[c >= 0])) if (c >= 0).any() else -1 for c in np.array(rows).T]
        print(f"  {name:20s} " + "  ".join(f"{n} {m}" for (n, _), m in zip(PHASES, medians) if m >= 0))
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
