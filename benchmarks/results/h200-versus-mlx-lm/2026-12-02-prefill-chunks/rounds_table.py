"""What prefill_chunks.py and prefill_sweep.py share: their arguments, and the table they print (each
engine's median tokens/s at each prompt length, with its ratio to one engine's, round by round:
versus_mlx_lm.paired)."""
import argparse
import statistics

import versus_mlx_lm


def arguments(lengths: str) -> argparse.Namespace:
    """MODEL [--lengths N,N,...] [--rounds R], `lengths` the default; args.lengths a list of ints."""
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--lengths", type=lambda text: [int(n) for n in text.split(",")], default=lengths)
    parser.add_argument("--rounds", type=int, default=7)
    return parser.parse_args()


def print_table(engines: dict, lengths: list[int], rounds: int, base: str, warm_ups: int = 1) -> None:
    """engines: name -> timer(n_prompt, seed) -> tokens/s, timed in interleaved rounds at each length."""
    print("| engine | " + " | ".join(f"pp{n}" for n in lengths) + " |")
    print("| --- |" + " ---: |" * len(lengths))
    rows = {name: [] for name in engines}
    for n in lengths:
        timers = {name: (lambda seed, timer=timer: timer(n, seed)) for name, timer in engines.items()}
        samples = versus_mlx_lm.interleaved_rounds(timers, rounds, {}, warm_ups)
        for name, tps in samples.items():
            middle, low, high = versus_mlx_lm.paired(tps, samples[base])
            rows[name].append(f"{statistics.median(tps):,.0f} ({middle:.2f}×, {low:.2f}–{high:.2f})")
    for name, cells in rows.items():
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
