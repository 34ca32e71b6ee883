"""Where one attention item's time goes inside a layer_kernel launch (CUDA only): cycle stamps in its runs.

    python benchmarks/attention_stamps.py MODEL.gguf [--positions 100,1024] [--kv-bits 8] [--twice | --l2-probe]
    python benchmarks/attention_stamps.py --header-only [--twice | --l2-probe] > stamped.cu   # to compile-check it

Builds the one-sequence kernel step from a copy of the kernels' source in which lane 0 of the warp that
takes head group 0's first run of slots, and of the warp that takes its last run (the one ending at
the step's new slot), writes clock64() at each phase of its item into an extra output; so does the
warp that stores a quantized cache's new slot (store_fresh). It decodes up to the last of
--positions and at each prints, as medians over the layers, each phase's end in cycles from the
item's start. A position whose group has one run shows it as the last run only; a phase the warp
did not reach is left out (a run that combines no head waits for none; a run on tensor cores,
tensor_attention_run's, has no new slot or finish phase, and its "chunk" is a step of 32 slots).

--twice: every run of slots, and every combining of a head's runs, done twice in a row, the stamps
marking the second (and the first combining's end): whether a phase is slow because its code runs
cold on its SM (it is not: docs/benchmarks.md, "Attention at depth").

--l2-probe: the stamped warps also time eight reads from L2 of one line of their group's partial
results, each read's address waiting on the value the one before returned: at the item's start,
and again once the combining warps have waited for the group's runs. It prints a read's round trip
at each (the eight reads' time over 8; in ptxas's build the last stamp follows the test of the
eighth read's value), to tell a slow memory system inside the kernel from slow code. Those reads
delay the probed warps' items, so the phases' times mean less in that mode.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxllama.cuda import kernels
from mlxllama.errors import MlxLlamaError

sys.path.insert(0, str(Path(__file__).parent))
from layer_timeline import arguments, instrumented_steps  # noqa: E402 - a sibling script

SLOTS = 80  # stamps a block: the first run's from 16, the last run's from 40, store_fresh's at 72 and 73
FIRST_RUN, LAST_RUN, STORE = 16, 40, 72
# --l2-probe's stamps of a run: around its reads at the item's start, and after the wait.
PROBES = [("at the item's start", 18), ("after the wait", 16)]
PROBE_READS = (
    "// Eight L2 reads of p, each one's address waiting on the value the last returned (v != v is\n"
    "// false for a finite value), between stamps k and k + 1; p is used after, so the reads stay.\n"
    "__device__ void l2_round_trips(const float* p, int base, int k) {\n"
    "  ASTAMP(base, k);\n"
    "  for (int i = 0; i < 8; ++i) {\n"
    "    const float v = __ldcg(p);\n"
    "    p += v != v;\n"
    "  }\n"
    "  ASTAMP(base, k + 1);\n"
    f"  if (g_att != nullptr && __ldcg(p) == 1.5e-38f) g_att[blockIdx.x * {SLOTS}] = 0;  // slot 0: unused\n"
    "}\n")
# Each phase's end as the stamp after the item's start (stamp 0) that marks it, in the order they come.
PHASES = [("queries staged", 1), ("run entered", 2), ("first chunk scored", 12),
          ("first chunk weighted", 13), ("first chunk done", 10), ("chunks done", 3), ("new slot done", 4),
          ("finish done", 5), ("run written", 6), ("arrived", 7), ("waited", 8),
          ("first combining done", 11), ("largest score", 14), ("runs summed", 15), ("combined", 9)]


def stamped_source(source: str, twice: bool = False, probe: bool = False) -> str:
    """The kernels' header (kernels.HEADER) with the stamps, and the layer kernel's extra output
    `att`, written in; with `twice`, each attention_run and combine_runs call made twice; with
    `probe`, the round trips to L2 timed (l2_round_trips) at an item's start and after the wait."""
    def put(anchor: str, text: str, before: bool = False, times: int = 1) -> None:
        nonlocal source
        if source.count(anchor) != times:
            raise SystemExit(f"attention_stamps.py: the kernels have changed: {anchor.strip()[:60]!r} not found "
                             f"{'once' if times == 1 else f'{times} times'}")
        source = source.replace(anchor, text + anchor if before else anchor + text)

    put("__device__ inline void grid_barrier(",
        "__device__ unsigned long long* g_att;\n"
        f"#define ASTAMP(base, k) do {{ if (g_att != nullptr && (base) >= 0 && threadIdx.x % 32 == 0) "
        f"g_att[blockIdx.x * {SLOTS} + (base) + (k)] = clock64(); }} while (0)\n" + (PROBE_READS if probe else ""),
        before=True)
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
    put("__device__ void combine_runs(const float* partials, int splits, float* out", ", int sb = -1")
    put("  float num[dims];\n", "  ASTAMP(sb, 14);\n", before=True)
    put("#pragma unroll\n  for (int j = 0; j < dims; ++j) {\n#pragma unroll\n    for (int offset = 16; offset >= 32 / sets;",
        "  ASTAMP(sb, 15);\n", before=True)
    put("  if constexpr (Slots::quantized) {\n    if (fresh_last) {", "  ASTAMP(sb, 3);\n", before=True)
    put("  slots.finish(acc);\n", "  ASTAMP(sb, 4);\n", before=True)
    put("  slots.finish(acc);\n", "  ASTAMP(sb, 5);\n")
    put("    const int head = group * QH, kv_head = head / (HEADS / KV_HEADS), seq_head = seq * HEADS + head;\n",
        f"    const int sb = seq == 0 && group == 0 ? (r == runs - 1 ? {LAST_RUN} : r == 0 ? {FIRST_RUN} : -1) : -1;\n"
        "    ASTAMP(sb, 0);\n")
    put("    const auto head_slots = cache.template slots<QH>(", "    ASTAMP(sb, 1);\n", before=True)
    put("attn + seq_head * HEAD_DIM, HEAD_DIM, true", ", sb", times=2)  # tensor_attention_run's call, attention_run's
    put("group_partials + r * (HEAD_DIM + 2), stride, false", ", sb", times=2)
    put("out, out_stride, false", ", sb")  # a quantized cache's runs on tensor cores
    put("    __threadfence();\n    __syncwarp();\n    unsigned int* done = runs_done", "    ASTAMP(sb, 6);\n", before=True)
    put("combiners = min(QH, runs);\n", "    ASTAMP(sb, 7);\n")
    put("    for (int h = rank; h < QH; h += combiners) {\n      combine_runs", "    ASTAMP(sb, 8);\n", before=True)
    put("      combine_runs<HEAD_DIM>(group_partials + h * stride, runs, attn + (seq_head + h) * HEAD_DIM);\n    }\n",
        "    ASTAMP(sb, 9);\n")
    if probe:
        put("    ASTAMP(sb, 0);\n", f"    if (sb >= 0) l2_round_trips(partials + static_cast<size_t>(seq_head) * stride + HEAD_DIM, "
            f"sb, {PROBES[0][1]});\n")
        put("    ASTAMP(sb, 8);\n", f"    if (sb >= 0) l2_round_trips(group_partials + HEAD_DIM, sb, {PROBES[1][1]});\n")
    put("  cache.store_fresh(seqs, positions);\n", f"  if (grid_warps() - 1 - grid_warp() == 0) ASTAMP({STORE}, 0);\n",
        before=True)
    put("  cache.store_fresh(seqs, positions);\n", f"  if (grid_warps() - 1 - grid_warp() == 0) ASTAMP({STORE}, 1);\n")
    put("const float* scratch, float* y", ", unsigned long long* att")
    if twice:
        tensor = "tensor_attention_run<HEAD_DIM, QH>(q_scaled, head_slots.tensor_keys(), head_slots.tensor_values(), "
        for call in (f"        {tensor}0, slots,", f"      {tensor}r * run, end,", f"        {tensor}r * run, end,",
                     "        attention_run<HEAD_DIM, QH>(q_scaled, q_sums, head_slots, 0, slots,",
                     "      attention_run<HEAD_DIM, QH>(q_scaled, q_sums, head_slots, r * run, end,"):
            start = source.index("\n" + call) + 1  # a whole line: one call's indent may begin another's
            first = source[start:source.index(";\n", start) + 2]
            put(first, first.replace(", sb);", ", -1);"), before=True)
        combine = "      combine_runs<HEAD_DIM>(group_partials + h * stride, runs, attn + (seq_head + h) * HEAD_DIM);\n"
        put(combine, combine + "      ASTAMP(sb, 11);\n", before=True)
    combining = "attn + (seq_head + h) * HEAD_DIM);\n"
    if combining not in source:
        raise SystemExit(f"attention_stamps.py: the kernels have changed: {combining.strip()!r} not found")
    source = source.replace(combining, combining.replace(");", ", sb);"))  # each call of combine_runs (two with --twice)
    put("  stage_input<true, HIDDEN, LAYER_THREADS>(x, attn_norm, eps[0], smem);\n  for (int pair = warp;",
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
    for name, k in PROBES:
        trips = [t[b, base + k + 1] - t[b, base + k] for t in layers for base in (FIRST_RUN, LAST_RUN)
                 for b in np.nonzero(t[:, base + k])[0][:1]]
        if trips:
            print(f"  an L2 read's round trip {name}: {int(np.median(trips)) // 8} cycles")
    stored = [t[b, STORE + 1] - t[b, STORE] for t in layers for b in np.nonzero(t[:, STORE])[0][:1]]
    if stored:
        print(f"  store_fresh (one warp): {int(np.median(stored))} cycles")


def main():
    args = arguments(__doc__, "100,1024", twice="each run and each combining done twice, stamps of the second",
                     l2_probe="time a read's round trip to L2 at an item's start and after the wait")
    if args.twice and args.l2_probe:
        raise SystemExit("attention_stamps.py: --twice and --l2-probe are measured apart: give one")
    rewrite = partial(stamped_source, twice=args.twice, probe=args.l2_probe)
    if args.header_only:
        print(rewrite(kernels.HEADER))
        return
    label = ((f"{args.kv_bits}-bit cache" if args.kv_bits else "unquantized cache") + (", twice" if args.twice else "")
             + (", L2 probed" if args.l2_probe else ""))
    for position, stamps, blocks in instrumented_steps("attention_stamps.py", args, rewrite, "att", SLOTS):
        report(position, label, stamps, blocks)


if __name__ == "__main__":
    try:
        main()
    except MlxLlamaError as error:
        raise SystemExit(f"attention_stamps.py: {error}")
