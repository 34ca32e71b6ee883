"""The `mlxllama batch` job runner: JSONL prompts in, JSONL results out, resumable.

Results are written in input order: a job that finishes before an earlier one waits in memory
until the earlier one is written. So a results file is always a prefix of the input's runnable
lines, and resuming (skip the ids already in the file, append the rest) ends with the same
file, in the same order, as one uninterrupted run. The price: results still waiting behind an
unfinished earlier job are lost if the run is killed, and recomputed when it is resumed.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, ContextManager, Iterable, Iterator, Sequence, TextIO

from .batching import Request, generate_batch
from .constraints import Constraint
from .distributed import gather, world
from .errors import MlxLlamaError, parse_json_object
from .files import open_for_append
from .generate import GenerationResult, check_fits
from .prompt import NO_TEMPLATE, Prompt, Template, build_prompt, choose_template, messages_for, with_system
from .prompt_files import SavedPrefix
from .sampling import SamplingParams
from .speculative import Drafting

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
    "json_schema": ((dict,), "a JSON Schema object"),
    "json_object": ((bool,), "true"),
    "regex": ((str,), "a string"),
    "grammar": ((str,), "a string (GBNF or Lark)"),
}
CONSTRAINT_FIELDS = ("json_schema", "json_object", "regex", "grammar")


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
    constraint: Constraint | None = None
    prompt_cache: SavedPrefix | None = None  # lines' prompts must start with it; only what follows is prefilled
    max_kv_size: int = 0  # with it, each row's cache keeps its first `keep` and last positions
    keep: int = 4
    drafting: Drafting | None = None  # speculative decoding of every line (a draft model, or prompt lookup)


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
    if entry.get("max_tokens", 0) < 0:
        raise MlxLlamaError("'max_tokens' must be a non-negative integer")
    if "template" in entry and entry.get("no_template"):
        raise MlxLlamaError("'template' and 'no_template' exclude each other")
    constraints = [key for key in CONSTRAINT_FIELDS if key in entry]
    if len(constraints) > 1:
        raise MlxLlamaError(f"{' and '.join(repr(k) for k in constraints)} exclude each other: give one constraint")
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
    constraint = next((Constraint.of(key, entry[key]) for key in CONSTRAINT_FIELDS if key in entry),
                      settings.constraint)
    if constraint is not None:
        constraint.check(runtime.tokenizer)
    request = Request((), entry.get("max_tokens", settings.max_tokens), settings.params.with_overrides(**overrides),
                      tuple([stop] if isinstance(stop, str) else stop), constraint=constraint,
                      drafting=settings.drafting)
    job = Job(job_id, [], [])
    for run_template in [template, NO_TEMPLATE] if settings.compare_template else [template]:
        prompt = build_prompt(runtime.tokenizer, run_template, messages, settings.template_kwargs)
        check_fits(len(prompt.ids), None if settings.max_kv_size else runtime.config.context_length)
        if settings.prompt_cache is not None:
            settings.prompt_cache.check_starts(prompt.ids)
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


# A results line holds one prompt's text and ids; a longer "line" means the file is something else.
MAX_RESULT_LINE = 64 << 20


@contextmanager
def results_output(out_path: str, input_path: str | None) -> Iterator[tuple[set[str], TextIO]]:
    """The ids already in the results file and the stream to append new results to, checked before
    any work is done: '-' is standard output; an existing regular file is resumed (read line by line,
    cut back to its last complete line); a device or pipe is written without resuming; the input
    file itself is refused. The file is closed on the way out, its last write checked.
    """
    if out_path == "-":
        yield set(), sys.stdout
        return
    if input_path is not None and os.path.exists(out_path) and os.path.exists(input_path) \
            and os.path.samefile(out_path, input_path):
        raise MlxLlamaError(f"--out {out_path} is the input file: its prompts would be read as finished results")
    done = read_done(out_path) if os.path.isfile(out_path) else set()
    out = open_for_append(out_path)
    try:
        yield done, out
    except BaseException:
        with suppress(OSError):  # what a full disk left buffered is lost anyway; the error is the first one
            out.stream.close()
        raise
    out.close()


def read_done(path: str) -> set[str]:
    """Ids already in a results file, cut back to its last complete line (a killed run, or a full
    disk, may leave half a line); memory is bounded by one line, not by the file."""
    done, offset = set(), 0
    try:
        with open(path, "rb") as f:
            for number, line in enumerate(iter(lambda: f.readline(MAX_RESULT_LINE + 1), b""), 1):
                if not line.endswith(b"\n"):
                    if len(line) > MAX_RESULT_LINE:
                        raise MlxLlamaError(f"{path}:{number}: a line of over {MAX_RESULT_LINE >> 20} MiB,"
                                            " so this is not a results file to resume")
                    break  # the cut-off last line
                try:
                    done.add(id_key(json.loads(line)["id"]))
                except (ValueError, KeyError, TypeError):
                    raise MlxLlamaError(f"{path}:{number}: not a result line, so this is not a results file"
                                        " to resume") from None
                offset += len(line)
        if offset < os.path.getsize(path):
            with open(path, "r+b") as f:
                f.truncate(offset)
    except OSError as e:
        raise MlxLlamaError(f"{path}: cannot read results ({e.strerror})") from None
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
    speculation = {"drafted": result.drafted, "accepted": result.accepted} if result.drafted else {}
    return {
        "template": prompt.template,
        "prompt": prompt.text,
        "prompt_tokens": len(prompt.ids),
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        **speculation,
        "timings": result.timings(),
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
    drafted_tokens: int = 0  # speculative decoding's drafts, and those the model kept
    accepted_tokens: int = 0
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


def run_jobs(runtime, jobs: list[Job], out: TextIO, batch_size: int, stats: BatchStats, progress: Progress,
             prompt_cache: SavedPrefix | None = None, max_kv_size: int = 0, keep: int = 0) -> None:
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
        store = prompt_cache.store() if prompt_cache is not None else None
        for finished in generate_batch(runtime.model, runtime.tokenizer, requests, batch_size, store, max_kv_size, keep):
            for index, result in finished:
                position, run = owners[index]
                results[position][run] = result
                stats.prompt_tokens += len(result.prompt_ids)
                stats.generated_tokens += len(result.token_ids)
                stats.drafted_tokens += result.drafted
                stats.accepted_tokens += result.accepted
                if all(r is not None for r in results[position]):
                    writer.put(position, job_record(jobs[position], results[position]))
                    written()
            stats.done, stats.seconds = writer.written, time.perf_counter() - start
            if interrupt.requested:
                stats.interrupted = True
                break


# Under --data-parallel, the batches each rank runs between two exchanges of results: more waits
# less on the slowest rank, fewer loses less to a kill (the round's results are recomputed).
ROUND_BATCHES = 4


def run_jobs_spread(runtime, jobs: list[Job], out: TextIO, batch_size: int, stats: BatchStats, progress: Progress,
                    prompt_cache: SavedPrefix | None = None, max_kv_size: int = 0, keep: int = 0) -> None:
    """--data-parallel under mlx.launch: every rank holds a whole model and runs every size-th job of
    each round; rank 0 writes the round's records in job order (the other ranks' `out` goes nowhere),
    so the file is the single process's, and resumes as it does."""
    w = world()
    per_round = w.size * batch_size * ROUND_BATCHES
    start = time.perf_counter()
    with progress(len(jobs)) as written:
        for first in range(0, len(jobs), per_round):
            round_jobs = jobs[first : first + per_round]
            mine, part = io.StringIO(), BatchStats()
            run_jobs(runtime, round_jobs[w.rank :: w.size], mine, batch_size, part, no_progress, prompt_cache,
                     max_kv_size, keep)
            parts = gather({"lines": mine.getvalue().splitlines(), "prompt_tokens": part.prompt_tokens,
                            "generated_tokens": part.generated_tokens})
            for position in range(len(round_jobs)):
                out.write(parts[position % w.size]["lines"][position // w.size] + "\n")
                written()
            out.flush()
            stats.prompt_tokens += sum(p["prompt_tokens"] for p in parts)
            stats.generated_tokens += sum(p["generated_tokens"] for p in parts)
            stats.done, stats.seconds = first + len(round_jobs), time.perf_counter() - start


@contextmanager
def no_progress(jobs: int) -> Iterator[Callable[[], None]]:
    yield lambda: None


def run_batch(runtime, lines: Iterable[str], source: str, out: TextIO, done: set[str], settings: BatchSettings,
              report: Callable[[str], None], progress: Progress, text_input: bool = False,
              batch_size: int = 8, data_parallel: bool = False) -> BatchStats:
    """Run the prompts of an input file and append their results to `out` (results_output's),
    skipping the ids in `done`; `data_parallel` spreads them over the ranks of mlx.launch
    (run_jobs_spread).

    A bad line is passed to `report` with its line number, and skipped; the others run. Ctrl-C
    stops the run after the current step (`interrupted` in the stats): the results written are
    kept, and running again with the same results file resumes.
    """
    try:
        jobs, errors, already_done = read_jobs(lines, source, runtime, settings, text_input, done, report)
    except UnicodeDecodeError as e:
        raise MlxLlamaError(f"{source}: not UTF-8 text (byte {e.start} of a line)")
    stats = BatchStats(prompts=len(jobs), already_done=already_done, errors=errors, batch_size=batch_size)
    run = run_jobs_spread if data_parallel else run_jobs
    run(runtime, jobs, out, batch_size, stats, progress, settings.prompt_cache, settings.max_kv_size, settings.keep)
    return stats
