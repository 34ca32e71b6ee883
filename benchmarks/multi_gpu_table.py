"""The several-GPU tables of docs/benchmarks.md from the files `gpu.sh multi` brings back.

    python benchmarks/multi_gpu_table.py benchmarks/results/h100x4-multi-gpu

Reads bench-MODEL-N-SPLIT.json (`mlxllama bench --json`; N 1 with SPLIT kernels or plain),
llama-bench-MODEL-N-SM.json and llama-batched-MODEL-N-SM.md (llama.cpp with -sm none, layer or
row), allreduce-N.json (allreduce_cost.py) and parity-MODEL-N-SPLIT.json (split_parity.py), and
prints a markdown table of each; a run that left no file is a row saying so.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODELS = {"tiny": "TinyLlama-1.1B shape", "8b": "Llama-3-8B shape"}
OURS = [(1, "kernels", "mlxllama, one process (CUDA kernels)"), (1, "plain", "mlxllama, one process (plain step)"),
        (2, "tensor", "mlxllama, tensor"), (2, "pipeline", "mlxllama, pipeline"),
        (4, "tensor", "mlxllama, tensor"), (4, "pipeline", "mlxllama, pipeline")]
THEIRS = [(1, "none", "llama.cpp"), (2, "layer", "llama.cpp -sm layer"), (2, "row", "llama.cpp -sm row"),
          (4, "layer", "llama.cpp -sm layer"), (4, "row", "llama.cpp -sm row")]


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def ours_row(folder: Path, model: str, n: int, split: str) -> list[str] | None:
    report = read_json(folder / f"bench-{model}-{n}-{split}.json")
    if report is None:
        return None
    speed = {(t["name"], t["batch"]): t["tokens_per_second"] for t in report["tests"]}
    held = [r["weight_bytes"] for r in report["ranks"]] or [report["weight_bytes"]]
    return [f"{speed.get(('pp512', 1), 0):.0f}", f"{speed.get(('tg128', 1), 0):.1f}",
            f"{speed.get(('tg128', 16), 0):.0f}", f"{max(held) / 2**20:.0f}"]


def batched_tg16(path: Path) -> float | None:
    """S_TG t/s of llama-batched-bench's 16-sequence row."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= 8 and cells[2] == "16":
            return float(cells[7])
    return None


def theirs_row(folder: Path, model: str, n: int, sm: str) -> list[str] | None:
    runs = read_json(folder / f"llama-bench-{model}-{n}-{sm}.json")
    if not runs:
        return None
    speed = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in runs}
    tg16 = batched_tg16(folder / f"llama-batched-{model}-{n}-{sm}.md")
    return [f"{speed.get((512, 0), 0):.0f}", f"{speed.get((0, 128), 0):.1f}",
            f"{tg16:.0f}" if tg16 else "-", "-"]


def speed_table(folder: Path, model: str) -> list[str]:
    out = [f"{MODELS[model]} Q4_K_M", "",
           "| GPUs | runner, split | pp512 t/s | tg128 t/s | tg128 ×16 t/s | weights a rank (MiB) |",
           "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for n in (1, 2, 4):
        for what, rows in (("ours", OURS), ("theirs", THEIRS)):
            for count, split, name in rows:
                if count != n:
                    continue
                row = (ours_row if what == "ours" else theirs_row)(folder, model, n, split)
                cells = row or ["not run" if what == "ours" else "failed to load", "", "", ""]
                out.append(f"| {n} | {name} | " + " | ".join(cells) + " |")
    return out


def allreduce_table(folder: Path) -> list[str]:
    out = ["| GPUs | rows × hidden (float16) | one all-reduce in a step (µs) |", "| ---: | --- | ---: |"]
    for n in (2, 4):
        for r in read_json(folder / f"allreduce-{n}.json") or []:
            out.append(f"| {n} | {r['rows']} × {r['hidden']} | {r['per_all_reduce_us']:.1f} |")
    return out


def parity_table(folder: Path) -> list[str]:
    out = ["| model | split | greedy ids (32) | max abs logit diff | mean KL |", "| --- | --- | --- | ---: | ---: |"]
    for path in sorted(folder.glob("parity-*.json")):
        r = read_json(path)
        ids = ("equal" if r["greedy_equal"] else
               f"part at {r['parted_at']}: a near-tie (margin {r['margin_at_parting']:.4f} < {r['near_tie_bound']:.4f})"
               if r["near_tie"] else f"part at {r['parted_at']}, margin {r['margin_at_parting']:.4f}: NOT a near-tie")
        out.append(f"| {r['model']} | {r['split']} | {ids} | {r['max_abs_logit_diff']:.3g} | {r['mean_kl']:.2e} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    folder = parser.parse_args().folder
    if not folder.is_dir():
        raise SystemExit(f"multi_gpu_table.py: {folder} is not a folder")
    for model in MODELS:
        print("\n".join(speed_table(folder, model)) + "\n")
    print("\n".join(allreduce_table(folder)) + "\n")
    print("\n".join(parity_table(folder)))


if __name__ == "__main__":
    main()
