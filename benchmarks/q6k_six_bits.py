"""Q6_K's affine forms against llama.cpp: the two held at 8 bits, and 6 bits, measured and not taken.

Native mode holds Q6_K in MLX's affine form at 8.5 bits a weight, 1.3x the file's 6.56, where the
CPU's sub-block form does not take it: in groups of 32 with biases derived on each call
(quants._affine_q6_k, the CUDA kernels' layout), or in groups of 64 with biases stored
(quants._wide_affine_q6_k, what MLX's own products read: a launch less a projection). Each group's
largest sub-block sets the step, so its values stay exact; the others are rounded to a quarter of
that step. MLX 0.32 also has 6-bit groups of 32, which would hold Q6_K at 7 bits (a Q4_K_M file
whose token table is tied to the output, Qwen3-0.6B's, under 1.15x the file's bytes): this script
re-quantizes Q6_K to them too (the other sub-block rounded to the larger one's own step). It holds
each form to the parity tests' bars on the fixtures that have llama.cpp references: mean KL, and
llama.cpp's argmax wherever its top two logits differ by test_llama_parity's NEAR_TIE (0.08) or more.
Every form is loaded as MLX's products read it, on any device.

    python benchmarks/q6k_six_bits.py [MODEL ...]

MODEL: a fixture's GGUF path, or its name to look up in tests/fixtures, mlxllama/data and
../shared/fixtures/models (default: the chat-tiny mixes that hold Q6_K, and types-tiny-Q6_K); its
reference is tests/reference/llama_cpp/NAME.npz. One JSON line a model and form: its bits and group
size ("8/32" and "8/64" held, "6/32" as tried).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import mlxllama  # noqa: E402
import mlxllama.runtime  # noqa: E402
from mlxllama import quants  # noqa: E402
from mlxllama.quants import FORMATS, QT, BlockFormat  # noqa: E402
from mlxllama.weights import load_model  # noqa: E402

REFERENCES = ROOT / "tests" / "reference" / "llama_cpp"
MODEL_DIRS = (ROOT / "tests" / "fixtures", ROOT / "mlxllama" / "data", ROOT.parent / "shared" / "fixtures" / "models")
NEAR_TIE = 0.08  # tests/parity/test_llama_parity.py
DEFAULT = ["chat-tiny-Q3_K_M", "chat-tiny-Q4_K_M", "chat-tiny-Q5_K_M", "chat-tiny-Q6_K", "types-tiny-Q6_K"]


def six_bit_q6_k(f: quants.Fields):
    """The held form's pairing (quants._affine_q6_k) with a step of the larger sub-block's own."""
    v, step = quants._q6_k_on_shared_grids(f, 2, 1)
    return (mx.clip(v, -32, 31) + 32).astype(mx.uint8).reshape(f.n, 256), step, -32 * step


def kl_and_flips(runtime, ref) -> tuple[np.ndarray, int, int]:
    """KL(llama.cpp || ours) a position (the reference's tail past its top-K as one bucket), and the
    argmax flips where llama.cpp's top two are not a near-tie, of how many such positions."""
    kls, flips, decided_total = [], 0, 0
    prompts = sorted({key.split("/")[0] for key in ref.files})
    for prompt in prompts:
        ours = runtime.logits(ref[f"{prompt}/ids"].tolist()).astype(np.float64)
        top_ids, top = ref[f"{prompt}/top_ids"], ref[f"{prompt}/top_logits"].astype(np.float64)
        ref_logp = top - ref[f"{prompt}/logsumexp"][:, None]
        shifted = ours - ours.max(axis=1, keepdims=True)
        our_logp = np.take_along_axis(shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True)), top_ids, axis=1)
        ref_p = np.exp(ref_logp)
        ref_tail = np.clip(1 - ref_p.sum(axis=1), 1e-300, None)
        our_tail = np.clip(1 - np.exp(our_logp).sum(axis=1), 1e-300, None)
        kls.append((ref_p * (ref_logp - our_logp)).sum(axis=1) + ref_tail * (np.log(ref_tail) - np.log(our_tail)))
        decided = top[:, 0] - top[:, 1] >= NEAR_TIE
        flips += int((ours.argmax(axis=1)[decided] != top_ids[decided, 0]).sum())
        decided_total += int(decided.sum())
    return np.concatenate(kls), flips, decided_total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=DEFAULT)
    args = parser.parse_args()
    held = FORMATS[QT.Q6_K]
    mlxllama.runtime.load_model = lambda *a, **options: load_model(*a, **{**options, "sub_blocks": False, "wide": True})
    pairs = BlockFormat(held.layout, held.decode, 8, held.encode, requantized=True, symmetric=True)
    forms = {"8/32": pairs, "8/64": held, "6/32": BlockFormat(held.layout, held.decode, 6, six_bit_q6_k, requantized=True)}
    for model in args.models:
        name = Path(model).stem
        path = Path(model) if model.endswith(".gguf") else next(
            (d / f"{name}.gguf" for d in MODEL_DIRS if (d / f"{name}.gguf").exists()), None)
        if path is None or not path.exists():
            sys.exit(f"q6k_six_bits.py: {model}: no such model file")
        if not (REFERENCES / f"{name}.npz").exists():
            sys.exit(f"q6k_six_bits.py: {model}: no llama.cpp reference {REFERENCES / name}.npz")
        with np.load(REFERENCES / f"{name}.npz") as ref:
            for label, form in forms.items():
                FORMATS[QT.Q6_K] = form
                try:
                    kl, flips, decided = kl_and_flips(mlxllama.load(path), ref)
                finally:
                    FORMATS[QT.Q6_K] = held
                bits, group_size = (int(n) for n in label.split("/"))
                print(json.dumps({"model": name, "q6_k_bits": bits, "group_size": group_size, "mean_kl": float(kl.mean()),
                                  "max_kl": float(kl.max()),
                                  "argmax_flips": flips, "decided_positions": decided}), flush=True)


if __name__ == "__main__":
    main()
