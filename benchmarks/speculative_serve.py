"""One streamed greedy completion at a time from an OpenAI-compatible server, with and without
speculative decoding: decode tokens/s (first streamed token to last), and what was drafted.

    python benchmarks/speculative_serve.py --url http://127.0.0.1:8080 --prompt-file copy.txt
        [-n 128] [-r 5] [--extra JSON] [--label NAME] [--json OUT]

Sends the raw prompt to /v1/completions (`temperature` 0, `max_tokens` n, `stream_options.include_usage`)
once to warm up, then r times. `--extra` adds fields to the body (mlxllama's `{"lookup": 3,
"draft_tokens": 5}`); a server started with speculation (llama-server's `--spec-type`) needs none.
Decode rate: completion tokens after the first over the time from the first streamed text to the
last, so prefill is not in it, alike for every server. Drafts: mlxllama's
`usage.completion_tokens_details` (accepted and rejected prediction tokens), llama-server's
`timings` (`draft_n`, `draft_n_accepted`) where the last chunk has them. The text of every run is
kept, so the rows can be checked to be the same text.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx
from serve_bench import streamed_chunks  # benchmarks/ is the script's own folder


def one_run(client: httpx.Client, url: str, prompt: str, max_tokens: int, extra: dict) -> dict:
    body = {"model": "any", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    first = last = None
    tokens, text, drafts = 0, [], {}
    for chunk in streamed_chunks(client, url, "/v1/completions", body):
        piece = "".join(choice.get("text") or "" for choice in chunk.get("choices", []))
        if piece:
            last = time.perf_counter()
            first = first or last
            text.append(piece)
        usage = chunk.get("usage") or {}
        tokens = usage.get("completion_tokens", tokens)
        details = usage.get("completion_tokens_details") or {}
        if "accepted_prediction_tokens" in details:
            drafts = {"accepted": details["accepted_prediction_tokens"],
                      "drafted": details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]}
        timings = chunk.get("timings") or {}
        if timings.get("draft_n"):
            drafts = {"accepted": timings["draft_n_accepted"], "drafted": timings["draft_n"]}
    rate = (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0
    return {"tokens": tokens, "decode_tokens_per_second": rate, "text": "".join(text), **drafts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--prompt-file", required=True)
    parser.add_argument("-n", "--max-tokens", type=int, default=128)
    parser.add_argument("-r", "--runs", type=int, default=5)
    parser.add_argument("--extra", default="{}", help="JSON object of fields added to each request's body")
    parser.add_argument("--label", default="")
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()
    prompt = open(args.prompt_file, encoding="utf-8").read()
    extra = json.loads(args.extra)
    with httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        one_run(client, args.url, prompt, args.max_tokens, extra)
        runs = [one_run(client, args.url, prompt, args.max_tokens, extra) for _ in range(args.runs)]
    rates = [r["decode_tokens_per_second"] for r in runs]
    summary = {"label": args.label, "url": args.url, "extra": extra, "max_tokens": args.max_tokens,
               "median_decode_tokens_per_second": statistics.median(rates), "runs": runs}
    print(f"{args.label}: {statistics.median(rates):.1f} t/s (median of {len(rates)}; {min(rates):.1f}-{max(rates):.1f}),"
          f" {runs[0]['tokens']} tokens, drafts {({k: runs[0][k] for k in ('accepted', 'drafted') if k in runs[0]})}")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
