"""Throughput and latency of an OpenAI-compatible server under concurrent streaming clients.

    python benchmarks/serve_bench.py --url http://127.0.0.1:8080 [--clients 1,8,32] [--requests 4]
        [--max-tokens 64] [--warmup] [--prime] [--json OUT] [--label NAME]
    python benchmarks/serve_bench.py --compare OUT.json ...

Each of C clients sends --requests streamed chat completions one after another (greedy, the same
few questions in turn, `stream_options.include_usage`); C = each of --clients in turn. Each client
is a process of its own (spawned), started before the clock, so that the clients' own parsing
(Python, one core each) does not cap what a fast server can deliver. Reports, per C: aggregate
generated tokens/s (all completion tokens over the wall time), time to first token and inter-token latency
(the gaps between streamed chunks), p50 and p95, and the inter-token p95 without each request's
first gap. It speaks only the OpenAI API, so it measures `mlxllama serve` and llama.cpp's
`llama-server` alike.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import socket
import statistics
import threading
import time
from typing import Iterator

import httpx

QUESTIONS = ["What is the capital of Japan?", "What is 17 plus 25?", "My name is Zoe.", "What is the capital of France?",
             "Tell me about the capital of Italy.", "What is the opposite of hot?", "What is 9 plus 33?", "Hello!"]


def streamed_chunks(client: httpx.Client, url: str, path: str, body: dict) -> Iterator[dict]:
    """The JSON chunks of a streamed OpenAI-style request: its `data:` events, up to `[DONE]`."""
    with client.stream("POST", f"{url}{path}", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def one_request(client: httpx.Client, url: str, question: str, max_tokens: int, user: str = "") -> dict:
    # `user` (which OpenAI's API takes and servers may ignore) names the client and turn, so that a
    # server-side trace can match its requests to the client's (engine_turns.py)
    body = {"model": "any", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "user": user}
    start = time.perf_counter()
    arrivals, tokens = [], 0
    for chunk in streamed_chunks(client, url, "/v1/chat/completions", body):
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if any(choice.get("delta", {}).get("content") for choice in chunk.get("choices", [])):
            arrivals.append(time.perf_counter())
    return {"sent": start, "ttft": arrivals[0] - start if arrivals else None,
            "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])], "tokens": tokens or len(arrivals)}


def one_client(url: str, number: int, requests: int, max_tokens: int, ready,
               prime: bool = False) -> tuple[float, float, list[dict]]:
    # One httpx client a process, as an app keeps its SDK's: httpx.stream() makes a client for each
    # request, and its TLS context alone (17 ms of CPU, though the URL is http) was inside every TTFT,
    # 16 processes' worth at once in a burst, beside the server on the same cores. A connection a
    # request still, as before: llama-server closes a kept-alive one after a stream, unannounced.
    with httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        if prime:  # the process's own first-request setup (connection pool, parsers) done before the clock
            client.get(f"{url}/health")
        ready.wait()  # every client's process is up before any of them starts
        start = time.perf_counter()
        results = [one_request(client, url, QUESTIONS[(number + i) % len(QUESTIONS)], max_tokens, f"{number}.{i}")
                   for i in range(requests)]
    return start, time.perf_counter(), results


def serve_in_thread(app, *beside):
    """`app` (an ASGI app) served by uvicorn on a free loopback port, on a thread of this process,
    with the coroutine functions `beside` run on its event loop too, for the scripts that time a
    server from inside it (engine_turns.py, serve_stand_in.py): the server, once it listens, and
    its thread."""
    import uvicorn  # the server's stack: only these scripts need it, not the clients

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))

    async def serve() -> None:
        tasks = [asyncio.create_task(task()) for task in beside]
        await server.serve()
        for task in tasks:
            task.cancel()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread


def run(url: str, clients: int, requests: int, max_tokens: int, prime: bool = False) -> dict:
    # Spawned, not forked: a server in the same process (engine_turns.py) would otherwise stop for
    # each fork, its event loop's lag then 24 ms a client. Each child imports the calling script, so
    # a script that calls this keeps its work under `if __name__ == "__main__"`.
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, concurrent.futures.ProcessPoolExecutor(clients, mp_context=context) as pool:
        ready = manager.Barrier(clients)
        futures = [pool.submit(one_client, url, n, requests, max_tokens, ready, prime) for n in range(clients)]
        done = [f.result() for f in futures]
    # perf_counter is the system's monotonic clock on Linux: comparable across the clients' processes.
    first = min(start for start, _, _ in done)
    wall = max(end for _, end, _ in done) - first
    results = [r for _, _, rs in done for r in rs]
    ttft = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    gaps = sorted(g for r in results for g in r["gaps"])
    # Without each request's first gap: how long running streams wait, apart from when the first
    # token was sent relative to the second.
    later = sorted(g for r in results for g in r["gaps"][1:])
    return {"clients": clients, "requests": len(results), "seconds": wall, "clock_start": first,
            "tokens_per_second": sum(r["tokens"] for r in results) / wall,
            "ttft_p50_ms": 1000 * percentile(ttft, 50), "ttft_p95_ms": 1000 * percentile(ttft, 95),
            "itl_p50_ms": 1000 * percentile(gaps, 50), "itl_p95_ms": 1000 * percentile(gaps, 95),
            "itl_after_second_p95_ms": 1000 * percentile(later, 95),
            # every request's TTFT, so that rounds can be pooled: a p95 of one run's 64 requests is its
            # fourth-slowest, and moves by tens of ms from run to run
            "ttft_ms": [round(1000 * t, 2) for t in ttft],
            # and each client's requests in the order it sent them, as [sent, TTFT] in ms from the
            # first client's start: which of a burst's requests were the slow ones
            "requests_by_client": [[[round(1000 * (r["sent"] - first), 2),
                                     round(1000 * r["ttft"], 2) if r["ttft"] is not None else None] for r in rs]
                                   for _, _, rs in done]}


# What --compare reads of each run, besides the optional ttft_ms and requests_by_client.
NUMBERS = ("clients", "ttft_p95_ms", "tokens_per_second")


def compare(paths: list[str]):
    """Per server and concurrency, over the runs of files written with --json (or lists of them, as
    gpu.sh serve writes, bare or as the "runs" of a results file with a "note"): TTFT p95 as the
    mean and median of the runs' and of all their requests pooled, and tokens/s; then, where the
    runs kept each client's requests, the TTFT of each client's first, second ... request pooled
    (the first of every client arrive together, on an idle server). A server is a label up to its
    last "-": gpu.sh labels rounds "NAME-ROUND"."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for path in paths:
        try:
            with open(path) as f:
                loaded = json.load(f)
            if isinstance(loaded, dict) and "label" not in loaded:
                loaded = loaded["runs"]
            for output in loaded if isinstance(loaded, list) else [loaded]:
                label = output["label"]
                server = label.rsplit("-", 1)[0] if label[-1:].isdigit() else label
                for row in output["runs"]:
                    if not all(isinstance(row[k], (int, float)) for k in NUMBERS):
                        raise TypeError(f"a run's {', '.join(NUMBERS)} must be numbers")
                    groups.setdefault((server, row["clients"]), []).append(row)
        except (OSError, ValueError) as e:
            raise SystemExit(f"serve_bench.py: {path}: {e}") from None
        except (KeyError, TypeError, AttributeError) as e:
            raise SystemExit(f"serve_bench.py: {path}: not serve_bench.py --json output"
                             f" ({type(e).__name__}: {e})") from None
    ordered = sorted(groups.items(), key=lambda item: (item[0][1], item[0][0]))  # by concurrency, then server
    print("server           clients  runs  TTFT p95 ms: mean  median  pooled  range        TTFT p50 pooled  tokens/s mean")
    for (server, clients), rows in ordered:
        p95s = [row["ttft_p95_ms"] for row in rows]
        pooled = sorted(t for row in rows for t in row.get("ttft_ms", []))
        print(f"{server:16s} {clients:7d}  {len(rows):4d}  {statistics.mean(p95s):17.1f}  {statistics.median(p95s):6.1f}"
              f"  {percentile(pooled, 95):6.1f}  {min(p95s):5.1f}-{max(p95s):<5.1f}  {percentile(pooled, 50):15.1f}"
              f"  {statistics.mean(row['tokens_per_second'] for row in rows):13.1f}")
    for (server, clients), rows in ordered:
        by_turn: dict[int, list[float]] = {}
        for row in rows:
            for requests in row.get("requests_by_client", []):
                for turn, (_, ttft) in enumerate(requests):
                    if ttft is not None:
                        by_turn.setdefault(turn, []).append(ttft)
        if by_turn:
            by_turn = {turn: sorted(ttfts) for turn, ttfts in sorted(by_turn.items())}
            turns = ", ".join(f"{turn + 1}: {percentile(t, 50):.0f} / {percentile(t, 90):.0f} / {t[-1]:.0f}"
                              for turn, t in by_turn.items())
            print(f"{server} at {clients} clients, TTFT p50 / p90 / max ms of each client's request {turns}")


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1] if len(values) > 1 else values[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--warmup", action="store_true",
                        help="one untimed request per client first (a GPU compiles kernels on first use)")
    parser.add_argument("--prime", action="store_true",
                        help="each client process makes one untimed GET /health before the clock starts")
    parser.add_argument("--label", default="", help="a name for the server in the output (--json)")
    parser.add_argument("--compare", nargs="+", metavar="JSON",
                        help="measure nothing: summarize the runs in these --json outputs, rounds pooled")
    args = parser.parse_args()
    if args.compare:
        return compare(args.compare)
    rows = []
    print("clients  requests  tokens/s  TTFT p50/p95 ms  ITL p50/p95 ms  ITL p95 past the 2nd token")
    for clients in (int(c) for c in args.clients.split(",")):
        if args.warmup:
            run(args.url, clients, 1, args.max_tokens)
        row = run(args.url, clients, args.requests, args.max_tokens, args.prime)
        rows.append(row)
        print(f"{clients:7d}  {row['requests']:8d}  {row['tokens_per_second']:8.1f}  "
              f"{row['ttft_p50_ms']:7.1f} / {row['ttft_p95_ms']:<7.1f} {row['itl_p50_ms']:6.1f} / {row['itl_p95_ms']:<6.1f}"
              f" {row['itl_after_second_p95_ms']:6.1f}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"url": args.url, "label": args.label, "max_tokens": args.max_tokens, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    try:
        main()
    except httpx.HTTPError as error:
        raise SystemExit(f"serve_bench.py: {error}")
