"""A model split over the processes of `mlx.launch` against one process: greedy ids and logits.

    python benchmarks/split_parity.py MODEL --save ref.npz [-n 32]              # one process
    mlx.launch -n 2 --backend nccl -- python benchmarks/split_parity.py MODEL --against ref.npz [--pipeline] [--json F]

The reference run generates greedily from a fixed prompt and keeps its ids and the logits of one
forward pass over prompt + ids. The split run generates from the same prompt and computes the
logits of the same sequence (teacher-forced), so that the two are compared position by position:
the largest logit difference, the mean KL divergence, and where the greedy ids first part. A split
sums each projection's shares in another order (and in float16 on a GPU), so ids may part where
the reference's top two logits were closer than the split moves a logit: such a parting is a
near-tie, reported with its margin against the bound (twice the largest difference seen, since
both top logits can move). Rank 0 prints one line and, with --json, writes the comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlxllama  # noqa: E402
from mlxllama.distributed import world  # noqa: E402
from mlxllama.errors import MlxLlamaError  # noqa: E402

PROMPT = "The capital of France is"


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def top_two_margin(logits: np.ndarray) -> np.ndarray:
    top = np.sort(logits, axis=-1)[..., -2:]
    return top[..., 1] - top[..., 0]


def compare(ref: dict, greedy: list[int], logits: np.ndarray) -> dict:
    """The split run's ids and teacher-forced logits against the reference's."""
    ref_logits, ref_greedy, prompt_len = ref["logits"], [int(t) for t in ref["greedy"]], int(ref["prompt_len"])
    diff = float(np.abs(logits - ref_logits).max())
    p, q = log_softmax(ref_logits.astype(np.float64)), log_softmax(logits.astype(np.float64))
    kl = float((np.exp(p) * (p - q)).sum(-1).mean())
    # logits row prompt_len - 1 + k predicts generated token k
    margins = top_two_margin(ref_logits[prompt_len - 1:])
    parted = next((k for k, (a, b) in enumerate(zip(greedy, ref_greedy)) if a != b), None)
    bound = 2 * diff
    result = {"tokens": len(ref_greedy), "max_abs_logit_diff": diff,
              "max_abs_logit": float(np.abs(ref_logits).max()), "mean_kl": kl,
              "argmax_agree": float((logits.argmax(-1) == ref_logits.argmax(-1)).mean()),
              "greedy_equal": parted is None, "parted_at": parted, "near_tie_bound": bound,
              "smallest_margin": float(margins.min())}
    if parted is not None:
        result["margin_at_parting"] = float(margins[parted])
        result["near_tie"] = bool(margins[parted] < bound)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", metavar="NPZ", help="one process: write the reference here")
    mode.add_argument("--against", metavar="NPZ", help="compare with this reference")
    parser.add_argument("-n", type=int, default=32, help="greedy tokens (reference run)")
    parser.add_argument("--pipeline", action="store_true", help="split by layers instead of by tensor")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()

    if args.against and not Path(args.against).is_file():
        parser.exit(2, f"split_parity.py: error: no reference {args.against} (make it with --save)\n")
    w = world()
    try:
        runtime = mlxllama.load(args.model, parallel=("pipeline" if args.pipeline else "tensor") if w.size > 1 else None)
    except MlxLlamaError as e:
        parser.exit(2, f"split_parity.py: error: {e}\n")
    ids = runtime.tokenize(PROMPT)
    if args.save:
        greedy = runtime.generate(ids, max_tokens=args.n).token_ids
        logits = runtime.logits(ids + greedy)
        np.savez(args.save, logits=logits, greedy=np.array(greedy), prompt_len=len(ids))
        print(f"{Path(args.model).name}: {len(greedy)} greedy ids, smallest top-two margin "
              f"{top_two_margin(logits[len(ids) - 1:]).min():.4f}")
        return
    ref = dict(np.load(args.against))
    greedy = runtime.generate(ids, max_tokens=len(ref["greedy"])).token_ids
    logits = runtime.logits(ids + [int(t) for t in ref["greedy"]])
    if not w.is_root:
        return
    shard = runtime.model.shard
    result = {"model": Path(args.model).name, "split": f"{shard.mode} x{shard.size}" if shard else "none",
              **compare(ref, greedy, logits)}
    verdict = ("greedy ids equal" if result["greedy_equal"] else
               f"ids part at {result['parted_at']} ({'near-tie' if result['near_tie'] else 'NOT a near-tie'}: "
               f"margin {result['margin_at_parting']:.4f}, bound {result['near_tie_bound']:.4f})")
    print(f"{result['model']} {result['split']}: {verdict}; max |logit diff| {result['max_abs_logit_diff']:.3g} "
          f"of {result['max_abs_logit']:.2f}, mean KL {result['mean_kl']:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
