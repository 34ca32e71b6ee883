"""Speculative decoding on the CPU, mlxllama beside llama.cpp, in one process: greedy decode
tokens/s with and without it on one raw prompt.

    python benchmarks/speculative_cpu.py MODEL.gguf --prompt-file copy.txt [-n 128] [-r 3]
        [--lookup 3 | --draft-model DRAFT.gguf] [--draft-tokens 5] [--threads 2]
        [--modes native:float32,dequantize:bfloat16] [--json OUT]

mlxllama: `Runtime.stream` without and with `draft=` (the n-gram length, or the loaded draft
model), in each of --modes (weights native or dequantized, and the compute dtype: on the CPU only
dequantized bfloat16 weights check k+1 positions for less than k+1 steps); llama.cpp:
llama-cpp-python's `create_completion` without and with its `draft_model=`:
its own `LlamaPromptLookupDecoding(max_ngram_size=LOOKUP, num_pred_tokens=K)`, or K greedy tokens
of a second llama.cpp model of the draft file (llama-cpp-python checks the drafts against llama.cpp's
model; llama.cpp's C++ speculation lives in llama-server, which this machine does not build). Each is timed from its first
streamed text to its last, so prefill is not in the rate; one untimed run first, then -r. The texts
are kept, so each row can be checked to give its plain row's text (and all rows, one text). Needs
llama-cpp-python (a test-time reference; extra buffer types are switched off, as
scripts/llama_cpp_cpu.py says why).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import llama_cpp  # noqa: E402
import llama_cpp_cpu  # noqa: E402,F401  (switches extra buffer types off before any Llama is created)
import numpy as np  # noqa: E402
from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding  # noqa: E402

import mlxllama  # noqa: E402


def timed(pieces) -> tuple[float, float, str, int]:
    """(time of the first piece, of the last, the text, how many pieces) of a stream of text pieces."""
    first = last = None
    text = []
    for piece in pieces:
        last = time.perf_counter()
        first = first or last
        text.append(piece)
    return first, last, "".join(text), len(text)


def mlxllama_runs(path: str, prompt: str, n: int, runs: int, drafter, k: int, mode: str) -> dict:
    """drafter: None, an n-gram length (prompt lookup) or a draft model's path; mode: "native:float32"..."""
    weights, dtype = mode.split(":")
    rt = mlxllama.load(path, dtype=dtype, dequantize=weights == "dequantize")
    draft = drafter
    if isinstance(drafter, str):
        draft = mlxllama.load(drafter, dtype=dtype, dequantize=weights == "dequantize")
    out = []
    for _ in range(runs + 1):
        stream = rt.stream(prompt, n, draft=draft, draft_tokens=k)
        first, last, text, _ = timed(stream)  # a piece may hold several tokens: count them from the result
        result = stream.result
        out.append({"decode_tokens_per_second": (len(result.token_ids) - 1) / (last - first), "text": text,
                    "tokens": len(result.token_ids), "drafted": result.drafted, "accepted": result.accepted})
    return summary(out[1:])


class LlamaModelDraft(LlamaDraftModel):
    """K greedy tokens of another llama.cpp model after the text so far (its own cache keeps what
    the text shares with the last call: Llama.generate reuses the longest common prefix)."""

    def __init__(self, path: str, k: int, threads: int):
        self.llm = llama_cpp.Llama(path, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
        self.k = k

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        drafts = []
        for token in self.llm.generate(input_ids.tolist(), temp=0.0):
            drafts.append(token)
            if len(drafts) == self.k:
                break
        return np.array(drafts, dtype=np.intc)


def llama_cpp_runs(path: str, prompt: str, n: int, runs: int, threads: int, drafter, k: int) -> dict:
    """drafter: None, an n-gram length (prompt lookup) or a draft model's path."""
    if isinstance(drafter, int):
        draft = LlamaPromptLookupDecoding(max_ngram_size=drafter, num_pred_tokens=k)
    else:
        draft = LlamaModelDraft(drafter, k, threads) if drafter else None
    llm = llama_cpp.Llama(path, n_ctx=1024, n_threads=threads, n_threads_batch=threads, draft_model=draft,
                          verbose=False)
    out = []
    for _ in range(runs + 1):
        llm.reset()  # no prefix reuse between runs: each prefills as mlxllama's does
        # llama-cpp-python streams a chunk a token, then an empty one with the finish reason
        pieces = (chunk["choices"][0]["text"] for chunk in
                  llm.create_completion(prompt, max_tokens=n, temperature=0.0, stream=True)
                  if chunk["choices"][0]["finish_reason"] is None)
        first, last, text, count = timed(pieces)
        out.append({"decode_tokens_per_second": (count - 1) / (last - first), "text": text, "tokens": count})
    return summary(out[1:])


def summary(runs: list[dict]) -> dict:
    rates = [r["decode_tokens_per_second"] for r in runs]
    return {"median_decode_tokens_per_second": statistics.median(rates), "min": min(rates), "max": max(rates),
            "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--prompt-file", required=True)
    parser.add_argument("-n", "--n-gen", type=int, default=128)
    parser.add_argument("-r", "--runs", type=int, default=3)
    parser.add_argument("--lookup", type=int, default=3)
    parser.add_argument("--draft-model", metavar="GGUF", help="a draft model instead of prompt lookup")
    parser.add_argument("--draft-tokens", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", default="native:float32,dequantize:bfloat16",
                        help="mlxllama's weights (native or dequantize) and dtype, comma-separated")
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()
    prompt = Path(args.prompt_file).read_text(encoding="utf-8")
    drafter, label = (args.draft_model, "draft model") if args.draft_model else (args.lookup, "lookup")
    k = args.draft_tokens
    rows = {}
    mlxllama_rows = [(f"mlxllama {mode}{with_drafter}", lambda mode=mode, d=d: mlxllama_runs(
                         args.model, prompt, args.n_gen, args.runs, d, k, mode))
                     for mode in args.modes.split(",") for with_drafter, d in [("", None), (f" {label}", drafter)]]
    for name, run in mlxllama_rows + [
        ("llama.cpp", lambda: llama_cpp_runs(args.model, prompt, args.n_gen, args.runs, args.threads, None, k)),
        (f"llama.cpp {label}", lambda: llama_cpp_runs(args.model, prompt, args.n_gen, args.runs, args.threads,
                                                      drafter, k)),
    ]:
        rows[name] = run()
        r = rows[name]
        print(f"{name}: {r['median_decode_tokens_per_second']:.2f} t/s (median of {args.runs};"
              f" {r['min']:.2f}-{r['max']:.2f})", flush=True)
    texts = {name: r["runs"][0]["text"] for name, r in rows.items()}
    as_plain = {name: text == texts[name.removesuffix(f" {label}")]
                for name, text in texts.items() if name.endswith(label)}
    print("same text:", len(set(texts.values())) == 1, "; each drafted row as its plain row:", as_plain)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "prompt": prompt, "n_gen": args.n_gen, "drafter": drafter,
                       "draft_tokens": args.draft_tokens, "threads": args.threads, "modes": args.modes,
                       "rows": rows,
                       "same_text": len(set(texts.values())) == 1, "drafted_as_plain": as_plain}, f, indent=1)


if __name__ == "__main__":
    main()
