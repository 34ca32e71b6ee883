"""Record llama.cpp's logits and greedy continuations for the test fixtures.

Run with a Python that has llama-cpp-python (and numpy, gguf) installed:

    python scripts/make_llama_reference.py ../shared/fixtures/models/*.gguf

For each model it writes tests/reference/llama_cpp/<model>.npz holding, per prompt, the token ids
llama.cpp tokenized (BOS added, special tokens parsed), the top-K logits at every position with
their token ids, the log-sum-exp over the whole vocabulary, and llama.cpp's greedy continuation
with the margin between its top two logits at each step.
Storing the top K (and the log-sum-exp) instead of every logit keeps the files small while still
giving the exact argmax and a KL divergence whose only approximation is to lump the tail of the
reference distribution (well under 1e-6 of the mass here) into one bucket.
"""

import sys
from pathlib import Path

import llama_cpp
import llama_cpp_cpu  # noqa: F401  (must come before any Llama is created)
import numpy as np

# Zephyr-style rendering (chat-tiny's and types-tiny's own template) of the fixtures README's questions.
PROMPTS = {
    "japan": "<|user|>\nWhat is the capital of Japan?</s>\n<|assistant|>\n",
    "sum": "<|user|>\nWhat is 17 plus 25?</s>\n<|assistant|>\n",
    "italy": "The capital of Italy is",
}
TOP_K = 512
GREEDY_TOKENS = 16
OUT = Path(__file__).resolve().parents[1] / "tests" / "reference" / "llama_cpp"


def reference(path: Path, prompts: dict[str, str] = PROMPTS, n_ctx: int = 512) -> dict:
    """The record for `prompts` from llama.cpp with a context of n_ctx tokens (0: the model's trained context)."""
    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, logits_all=True, n_threads=2, verbose=False, seed=0)
    eos = llm.token_eos()
    record = {}
    for name, text in prompts.items():
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(ids)
        logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
        top = np.argsort(-logits, axis=1, kind="stable")[:, :TOP_K]
        peak = logits.max(axis=1, keepdims=True)
        lse = (np.log(np.exp(logits - peak).sum(axis=1, keepdims=True)) + peak)[:, 0]
        greedy, margins = [], []
        step_logits = logits[-1]
        while len(greedy) < GREEDY_TOKENS:
            first, second = np.sort(step_logits)[-2:][::-1]
            greedy.append(int(np.argmax(step_logits)))
            margins.append(first - second)
            if greedy[-1] == eos:
                break
            llm.eval([greedy[-1]])
            step_logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        record[f"{name}/ids"] = np.array(ids, np.int32)
        record[f"{name}/top_ids"] = top.astype(np.int32)
        record[f"{name}/top_logits"] = np.take_along_axis(logits, top, axis=1)
        record[f"{name}/logsumexp"] = lse.astype(np.float32)
        record[f"{name}/greedy"] = np.array(greedy, np.int32)
        record[f"{name}/greedy_margin"] = np.array(margins, np.float32)
    return record


def keep_every(record: dict, prompt: str, stride: int, at_least: int) -> dict:
    """The record with `prompt`'s logits kept at every stride-th position and the last only (with
    `{prompt}/positions`): a long prompt's in full would weigh megabytes."""
    ids = record[f"{prompt}/ids"]
    if len(ids) < at_least:
        raise SystemExit(f"the {prompt!r} prompt is only {len(ids)} tokens, fewer than {at_least}")
    kept = np.unique(np.append(np.arange(0, len(ids), stride), len(ids) - 1))
    for key in ("top_ids", "top_logits", "logsumexp"):
        record[f"{prompt}/{key}"] = record[f"{prompt}/{key}"][kept]
    record[f"{prompt}/positions"] = kept.astype(np.int32)
    return record


def main(paths):
    OUT.mkdir(parents=True, exist_ok=True)
    for path in map(Path, paths):
        record = reference(path)
        np.savez_compressed(OUT / f"{path.stem}.npz", **record)
        print(path.stem, {k: record[k].tolist() for k in record if k.endswith("greedy")})


if __name__ == "__main__":
    main(sys.argv[1:])
