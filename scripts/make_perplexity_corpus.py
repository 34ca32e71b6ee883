"""Write tests/fixtures/perplexity-corpus.txt: plain text sampled from chat-tiny F16 itself.

    python scripts/make_perplexity_corpus.py ../shared/fixtures/models/chat-tiny-F16.gguf

Text the unquantized model produces is "like its corpus" in the one sense that makes perplexity
order the quantizations: on text drawn from a model P, every other model Q scores worse on
average (by KL(P || Q) per token), so F16 should come first and the roughest quantization last.
Hand-written sentences do not do that here: chat-tiny never saw a newline between sentences or
names outside its corpus, and those surprises swamp the differences between quantizations.

Each sample starts from BOS with pure sampling (temperature 1, no truncation) and a fixed seed,
and is cut at the first chat marker or newline, keeping the plain-sentence part of the corpus;
the samples are joined by spaces, as the corpus's sentences are.
"""

import sys
from pathlib import Path

import mlxllama

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "perplexity-corpus.txt"
TARGET_CHARS = 4000


def main(model_path: str) -> None:
    runtime = mlxllama.load(model_path)
    samples, size, seed = [], 0, 0
    while size < TARGET_CHARS:
        result = runtime.generate([runtime.tokenizer.bos_id], max_tokens=64, temperature=1.0, top_k=0, top_p=1.0,
                                  min_p=0.0, seed=seed, stop=["<|", "\n"])
        seed += 1
        text = result.text.strip()
        if text:
            samples.append(text)
            size += len(text) + 1
    OUT.write_text(" ".join(samples) + "\n", encoding="utf-8")
    print(f"{OUT}: {len(samples)} samples from seeds 0-{seed - 1}, {size} characters")


if __name__ == "__main__":
    main(sys.argv[1])
