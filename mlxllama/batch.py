"""Many prompts at once: batched decoding (`batch_generate`) and the `mlxllama batch` job runner.

Batched decoding. Each prompt is prefilled on its own, exactly as `Runtime.generate` prefills it
(prefill is already matrix-shaped work, and padding prompts to a common length would waste it),
and its cache then joins a BatchKVCache as a new row. Every decode step feeds one token per row in
a single forward pass: each row has its own RoPE position, its own cache length and a mask that
hides the slots past that length. A row keeps position p in slot p, as a lone sequence does, so
a row's logits are bit-identical to its one-at-a-time logits: on the CPU backend, matmuls and
attention give each row the same result whatever the batch around it, and masked slots add
exact zeros (tests/test_batch.py checks the logits bit for bit, and the greedy ids). On MLX's
CUDA backend the step goes through the batched kernel (cuda_step.py) instead, whose float16
tensor-core products round each row's inputs differently from one sequence's kernel: there a
row's logits match its one-at-a-time logits within tests/test_cuda_step.py's tolerance. A finished
row leaves the batch at once, and a waiting prompt takes its place. Each row has its own
sampler, seeded from its own settings, so a row's output with a seed does not depend on the
batch it runs in.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, ContextManager, Iterable, Iterator, Sequence, TextIO

import mlx.core as mx

from .cache import make_batch_cache, make_cache
from .errors import MlxLlamaError, parse_json_object
from .generate import GenerationResult, TextCollector, check_fits, prefill
from .model import Transformer
from .prompt import NO_TEMPLATE, Prompt, Template, build_prompt, choose_template, messages_for, with_system
from .sampling import SamplingParams, make_sampler
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Request:
    """One sequence to generate: its prompt ids and its own settings."""

    ids: Sequence[int]
    max_tokens: int = 256
    params: SamplingParams = SamplingParams()
    stop: Sequence[str] = ()


class _Row:
    """A sequence being generated: its sampler, ids so far, text and timings."""

    def __init__(self, index: int, request: Request, tokenizer: Tokenizer, context_length: int):
        self.index, self.request = index, request
        self.sampler = make_sampler(request.params)
        self.context = list(request.ids)  # what the repeat penalty looks back on
        self.ids: list[int] = []
        self.collector = TextCollector(tokenizer, request.stop)
        # Like generate_tokens: never run past the model's context.
        self.max_tokens = min(request.max_tokens, context_length - len(request.ids))
        self.start = time.perf_counter()
        self.first_token_time: float | None = None

    def accept(self, token_id: int) -> bool:
        """Record the next generated id; True once the row is finished."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.ids.append(token_id)
        self.context.append(token_id)
        self.collector.add(token_id)
        return self.collector.finish is not None or len(self.ids) >= self.max_tokens

    def result(self) -> GenerationResult:
        self.collector.close()
        end = time.perf_counter()
        first = self.first_token_time or end
        n = len(self.ids)
        return GenerationResult(
            text=self.collector.text,
            token_ids=self.ids,
            prompt_ids=list(self.request.ids),
            finish_reason=self.collector.finish or "length",
            prompt_tokens_per_second=len(self.request.ids) / max(first - self.start, 1e-9),
            generation_tokens_per_second=(n - 1) / (end - first) if n > 1 else 0.0,
            stop=self.collector.stop,
        )


def generate_batch(model: Transformer, tokenizer: Tokenizer, requests: Sequence[Request],
                   batch_size: int = 8) -> Iterator[list[tuple[int, GenerationResult]]]:
    """Generate every request, up to batch_size rows per decode step, admitting requests in order.

    After each step, yields the requests that finished in it as (index in requests, result),
    often none, so a caller can write results as they come and stop cleanly between steps.
    """
    if batch_size < 1:
        raise MlxLlamaError("the batch size must be at least 1")
    for request in requests:
        check_fits(len(request.ids), model.config.context_length)
    waiting = deque(enumerate(requests))
    cache = make_batch_cache(model.config.n_layers)
    rows: list[_Row] = []
    while rows or waiting:
        finished = []
        while waiting and len(rows) < batch_size:
            row = _Row(*waiting.popleft(), tokenizer, model.config.context_length)
            if row.max_tokens <= 0:
                finished.append(row)
                continue
            single = make_cache(model.config.n_layers)
            first = row.sampler(prefill(model, row.request.ids, single), row.context)
            if row.accept(first.item()):
                finished.append(row)
                continue
            for layer, row_layer in zip(cache, single):
                layer.add(row_layer)
            rows.append(row)
        if rows:
            logits = model.step(mx.array([[row.ids[-1]] for row in rows]), cache)
            tokens = mx.stack([row.sampler(logits[i], row.context) for i, row in enumerate(rows)]).tolist()
            done = [row.accept(token) for row, token in zip(rows, tokens)]
            if any(done):
                finished += [row for row, d in zip(rows, done) if d]
                keep = [i for i, d in enumerate(done) if not d]
                rows = [rows[i] for i in keep]
                for layer in cache:
                    layer.keep(keep)
        yield [(row.index, row.result()) for row in finished]


def batch_generate(runtime, prompts: Sequence[str | Sequence[int] | Request], max_tokens: int = 256,
                   temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                   repeat_penalty: float = 1.0, repeat_last_n: int = 64, seed: int | None = None,
                   stop: Sequence[str] = (), batch_size: int = 8, special: bool = False) -> list[GenerationResult]:
    """Generate for many prompts with batched decoding; the results come in prompt order.

    runtime is what `mlxllama.load` returns. A prompt is a string (tokenized with BOS and no
    template; `special` parses control tokens in it), a list of token ids, or a Request with
    settings of its own (the keyword settings apply to the others). With temperature 0 and no
    repeat penalty each result's ids equal `runtime.generate`'s for that prompt.
    """
    params = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed)

    def request(prompt) -> Request:
        if isinstance(prompt, Request):
            return prompt
        ids = runtime.tokenize(prompt, special=special) if isinstance(prompt, str) else list(prompt)
        return Request(ids, max_tokens, params, tuple(stop))

    results: list[GenerationResult | None] = [None] * len(prompts)
    for finished in generate_batch(runtime.model, runtime.tokenizer, [request(p) for p in prompts], batch_size):
        for index, result in finished:
            results[index] = result
    return results


# The `mlxllama batch` job runner.
#
# Results are written in input order: a job that finishes before an earlier one waits in memory
# until the earlier one is written. So a results file is always a prefix of the input's runnable
# lines, and resuming (skip the ids already in the file, append the rest) ends with the same
# file, in the same order, as one uninterrupted run. The price: results still waiting behind an
# unfinished earlier job are lost if the run is killed, and recomputed when it is resumed.

# Keys an input line may carry, the types each accepts, and how to say so; other keys are ignored,
# so a line can carry data of its own (an expected answer, say).
LINE_FIELDS = {
    "id": ((str, int), "a string or an integer"),
    "prompt": ((str,), "a string"),
    "messages": ((list,), "a list of messages"),
    "max_tokens": ((int,), "an integer"),
    "temperature": ((int, float), "a number"),
    "seed": ((int, type(None)), "an integer or null"),
    "system": ((str,), "a string"),
    "template": ((str,), "a built-in template name"),
    "no_template": ((bool,), "true or false"),
    "stop": ((str, list), "a string or a list of strings"),
}


@dataclass(frozen=True)
class BatchSettings:
    """The command line's settings; an input line may override most of them."""

    template: Template
    system: str | None = None
    template_kwargs: dict = field(default_factory=dict)
    params: SamplingParams = SamplingParams()
    max_tokens: int = 256
    stop: Sequence[str] = ()
    compare_template: bool = False


@dataclass
class Job:
    """One input line to run: one prompt, or two with --compare-template (with, then without template)."""

    id: Any
    prompts: list[Prompt]
    requests: list[Request]


def parse_entry(line: str) -> dict:
    entry = parse_json_object(line)
    for key, (types, description) in LINE_FIELDS.items():
        value = entry.get(key)
        if key in entry and (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
            raise MlxLlamaError(f"'{key}' must be {description}")
    if ("prompt" in entry) == ("messages" in entry):
        raise MlxLlamaError("needs either 'prompt' or 'messages'")
    messages = entry.get("messages")
    if messages is not None and not (messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise MlxLlamaError("'messages' must be a non-empty list of {\"role\": string, \"content\": string} objects")
    if isinstance(entry.get("stop"), list) and not all(isinstance(s, str) for s in entry["stop"]):
        raise MlxLlamaError(f"'stop' must be {LINE_FIELDS['stop'][1]}")
    if entry.get("max_tokens", 0) < 0 or not 0 <= entry.get("temperature", 0) < float("inf"):
        raise MlxLlamaError("'max_tokens' and 'temperature' must be non-negative numbers")
    if (entry.get("seed") or 0) < 0:
        raise MlxLlamaError("'seed' cannot be negative")
    if "template" in entry and entry.get("no_template"):
        raise MlxLlamaError("'template' and 'no_template' exclude each other")
    return entry


def build_job(entry: dict, job_id: Any, runtime, settings: BatchSettings) -> Job:
    """The prompts and requests of a checked input line, with the command line's settings as defaults."""
    if entry.get("no_template"):
        if settings.compare_template:
            raise MlxLlamaError("'no_template' cannot be combined with --compare-template")
        template = NO_TEMPLATE
    elif "template" in entry:
        template = choose_template(runtime.chat_template, entry["template"])
    else:
        template = settings.template
    messages = entry["messages"] if "messages" in entry else messages_for(entry["prompt"])
    messages = with_system(entry.get("system", settings.system), messages)
    stop = entry.get("stop", settings.stop)
    overrides = {key: entry[key] for key in ("temperature", "seed") if key in entry}
    request = Request((), entry.get("max_tokens", settings.max_tokens), replace(settings.params, **overrides),
                      tuple([stop] if isinstance(stop, str) else stop))
    job = Job(job_id, [], [])
    for run_template in [template, NO_TEMPLATE] if settings.compare_template else [template]:
        prompt = build_prompt(runtime.tokenizer, run_template, messages, settings.template_kwargs)
        check_fits(len(prompt.ids), runtime.config.context_length)
        job.prompts.append(prompt)
        job.requests.append(replace(request, ids=prompt.ids))
    return job


def read_jobs(lines: Iterable[str], source: str, runtime, settings: BatchSettings, text_input: bool,
              done: set[str], report: Callable[[str], None]) -> tuple[list[Job], int, int]:
    """The jobs still to run, in input order; also the number of bad lines (each reported) and of ids done before.

    A plain-text line is a prompt whose id is its line number; blank lines are skipped.
    """
    jobs: list[Job] = []
    first_seen: dict[str, int] = {}
    errors = already_done = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = {"prompt": line.rstrip("\r\n")} if text_input else parse_entry(line)
            job_id = entry.get("id", number)
            key = id_key(job_id)
            if key in first_seen:
                raise MlxLlamaError(f"duplicate id {key} (first on line {first_seen[key]})")
            first_seen[key] = number
            if key in done:
                already_done += 1
                continue
            jobs.append(build_job(entry, job_id, runtime, settings))
        except MlxLlamaError as e:
            report(f"{source}:{number}: {e}")
            errors += 1
    return jobs, errors, already_done


def id_key(job_id: Any) -> str:
    # 3 and "3" are different ids; their JSON spellings tell them apart.
    return json.dumps(job_id, ensure_ascii=False)


def read_done(path: str) -> set[str]:
    """Ids already in a results file, cut back to its last complete line (a killed run may leave half a line)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return set()
    except OSError as e:
        raise MlxLlamaError(f"{path}: cannot read results ({e.strerror})")
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) < len(data):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    done = set()
    for number, line in enumerate(complete.decode("utf-8", errors="replace").splitlines(), 1):
        try:
            done.add(id_key(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError):
            raise MlxLlamaError(f"{path}:{number}: not a result line, so this is not a results file to resume")
    return done


class OrderedWriter:
    """Writes records as JSON lines in job order, each flushed as soon as every earlier one is written."""

    def __init__(self, out: TextIO):
        self.out = out
        self.waiting: dict[int, dict] = {}
        self.written = 0

    def put(self, position: int, record: dict) -> None:
        self.waiting[position] = record
        while self.written in self.waiting:
            self.out.write(json.dumps(self.waiting.pop(self.written), ensure_ascii=False) + "\n")
            self.out.flush()
            self.written += 1


def run_record(prompt: Prompt, result: GenerationResult) -> dict:
    return {
        "template": prompt.template,
        "prompt": prompt.text,
        "prompt_tokens": len(prompt.ids),
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "timings": {
            "prompt_tokens_per_second": round(result.prompt_tokens_per_second, 2),
            "generation_tokens_per_second": round(result.generation_tokens_per_second, 2),
        },
    }


def job_record(job: Job, results: list[GenerationResult]) -> dict:
    runs = [run_record(prompt, result) for prompt, result in zip(job.prompts, results)]
    if len(runs) == 1:
        return {"id": job.id, **runs[0]}
    return {"id": job.id, "with_template": runs[0], "without_template": runs[1]}


class Interruptible:
    """Turns the first Ctrl-C into a request to stop between steps; a second one interrupts at once."""

    def __enter__(self):
        self.requested = False
        self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self.previous)

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self.previous)


@dataclass
class BatchStats:
    prompts: int = 0  # jobs to run this time
    done: int = 0  # jobs written this time
    already_done: int = 0  # jobs found in the results file and skipped
    errors: int = 0  # input lines reported and skipped
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    batch_size: int = 0
    interrupted: bool = False

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    def summary(self, style: str) -> str:
        fields = {**{k: v for k, v in asdict(self).items() if k != "interrupted"},
                  "seconds": round(self.seconds, 2), "tokens_per_second": round(self.tokens_per_second, 1)}
        if style == "json":
            return json.dumps(fields)
        if style == "csv":
            return ",".join(fields) + "\n" + ",".join(map(str, fields.values()))
        width = max(map(len, fields))
        return "\n".join(f"{key.replace('_', ' '):<{width}}  {value}" for key, value in fields.items())


# Given the number of jobs, a context entered while they run; what it yields is called as each
# job's record is written (the command line draws a progress bar with it).
Progress = Callable[[int], ContextManager[Callable[[], None]]]


def run_jobs(runtime, jobs: list[Job], out: TextIO, batch_size: int, stats: BatchStats, progress: Progress) -> None:
    """Run the jobs with batched decoding, writing each record in order; Ctrl-C stops after the current step."""
    requests, owners = [], []
    for position, job in enumerate(jobs):
        for run, request in enumerate(job.requests):
            requests.append(request)
            owners.append((position, run))
    results: list[list[GenerationResult | None]] = [[None] * len(job.requests) for job in jobs]
    writer = OrderedWriter(out)
    start = time.perf_counter()
    with progress(len(jobs)) as written, Interruptible() as interrupt:
        for finished in generate_batch(runtime.model, runtime.tokenizer, requests, batch_size):
            for index, result in finished:
                position, run = owners[index]
                results[position][run] = result
                stats.prompt_tokens += len(result.prompt_ids)
                stats.generated_tokens += len(result.token_ids)
                if all(r is not None for r in results[position]):
                    writer.put(position, job_record(jobs[position], results[position]))
                    written()
            stats.done, stats.seconds = writer.written, time.perf_counter() - start
            if interrupt.requested:
                stats.interrupted = True
                break


def run_batch(runtime, lines: Iterable[str], source: str, out_path: str, settings: BatchSettings,
              report: Callable[[str], None], progress: Progress, text_input: bool = False,
              batch_size: int = 8) -> BatchStats:
    """Run the prompts of an input file and append their results to out_path ('-': stdout).

    A bad line is passed to `report` with its line number, and skipped; the others run. Ctrl-C
    stops the run after the current step (`interrupted` in the stats): the results written are
    kept, and running again with the same out_path resumes.
    """
    done = set() if out_path == "-" else read_done(out_path)
    try:
        jobs, errors, already_done = read_jobs(lines, source, runtime, settings, text_input, done, report)
    except UnicodeDecodeError as e:
        raise MlxLlamaError(f"{source}: not UTF-8 text (byte {e.start} of a line)")
    stats = BatchStats(prompts=len(jobs), already_done=already_done, errors=errors, batch_size=batch_size)
    with nullcontext(sys.stdout) if out_path == "-" else open(out_path, "a", encoding="utf-8") as out:
        run_jobs(runtime, jobs, out, batch_size, stats, progress)
    return stats
