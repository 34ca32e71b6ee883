"""`mlxllama bench`: prompt and generation throughput in the style of llama-bench.

pp<P> feeds P random token ids into an empty cache (chunked prefill, as generation does) and
reports prompt tokens/s; tg<N> starts from one token and decodes N more with greedy sampling,
the host reading each token one step behind the device (as the generation loop does), and
reports generated tokens/s summed over the batch. With a depth D (llama-bench's -d), both start
from a cache already holding D random ids a sequence, filled untimed: "pp512 @ d8192". Each test
runs once untimed (the first use of a kernel compiles it; twice on CUDA, whose prefill plans
MLX's fused attention on a shape's second meeting), then `repetitions` times; the table gives the
median and the spread.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .cache import KVQuantization, kv_bytes_per_position, kv_label
from .constraints import Constraint, Guide
from .distributed import gather
from .errors import MlxLlamaError
from .generate import generate_tokens, prefill_chunk
from .gguf_file import open_gguf
from .models.transformer import EXPLICIT_FIRST
from .runtime import Runtime, load
from .sampling import SamplingParams, make_sampler
from .speculative import Speculation
from .step_cost import launches, weight_bytes_per_step


@dataclass
class TestResult:
    name: str  # pp512, tg128
    batch: int
    n_prompt: int
    n_gen: int
    samples: list[float]  # tokens/s of each repetition
    depth: int = 0  # positions a sequence's cache held before the timed part
    # tg: what one decode step costs (step_cost.py): the kernels it launches, by primitive, and the
    # host's microseconds a step to build it and hand it to the device, a figure a repetition
    launches: dict[str, int] = field(default_factory=dict)
    host_us: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def stdev(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0


@dataclass
class BenchReport:
    model: str
    mode: str  # native, native+kernels (decoding goes through mlxllama.cuda's kernels) or dequantize
    dtype: str  # what the model computes in: float32, float16 or bfloat16
    device: str
    file_bytes: int
    tensor_bytes: int
    params: int
    load_seconds: float
    weight_bytes: int  # MLX memory held once the model is loaded
    load_peak_bytes: int  # peak MLX memory while loading
    run_peak_bytes: int  # peak MLX memory over the tests (weights, cache, activations)
    kv_cache: str = "unquantized"  # or the --kv-* settings
    kv_bytes_per_position: int = 0  # a sequence's keys and values of every layer for one position
    step_weight_bytes: int = 0  # weight bytes a decode step reads, for all its rows (step_cost.py)
    tests: list[TestResult] = field(default_factory=list)
    speculation: list[dict] = field(default_factory=list)  # drafted and accepted, a speculative run each
    # Under mlx.launch: how the model is split ("tensor x2", "pipeline x2") and each rank's memory:
    # its weights (layer_bytes of the blocks, replicated_bytes of the rest) and its peak.
    parallel: str = ""
    ranks: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["weight_ratio"] = self.weight_bytes / self.tensor_bytes
        out["load_peak_ratio"] = self.load_peak_bytes / self.tensor_bytes
        out["tests"] = [
            {**asdict(t), "tokens_per_second": t.median, "stdev": t.stdev, "min": min(t.samples), "max": max(t.samples),
             **({"launches_per_step": sum(t.launches.values()), "host_us_per_step": statistics.median(t.host_us)}
                if t.launches else {})}
            for t in self.tests
        ]
        return out


def file_tensor_stats(path: str) -> tuple[int, int]:
    """(bytes of tensor data, number of weights) in a GGUF file."""
    gguf = open_gguf(path)
    tensors = gguf.tensors.values()
    return sum(int(t.n_bytes) for t in tensors), sum(int(t.n_elements) for t in tensors)


def random_ids(runtime: Runtime, batch: int, length: int, seed: int) -> list[list[int]]:
    # Like llama-bench: random ids, so no tokenizer work or prompt text is involved.
    rng = np.random.default_rng(seed)
    return rng.integers(0, runtime.config.vocab_size, size=(batch, length)).tolist()


def feed(runtime: Runtime, cache: list, ids: list[list[int]]) -> mx.array:
    """Feed rows of ids into the cache in chunks, as prefill does; the last position's logits [batch, vocab], evaluated."""
    chunk = prefill_chunk()
    for start in range(0, len(ids[0]), chunk):
        hidden = runtime.model.hidden_states(mx.array([row[start : start + chunk] for row in ids]), cache)
        mx.eval(hidden, [c.state for c in cache])
    logits = runtime.model.head(hidden[:, -1])
    mx.eval(logits)
    return logits


def time_prompt(runtime: Runtime, n_prompt: int, seed: int, depth: int = 0) -> float:
    """Seconds to prefill n_prompt ids into a cache holding `depth` others."""
    ids = random_ids(runtime, 1, depth + n_prompt, seed)[0]
    cache = runtime.new_cache()
    if depth:
        feed(runtime, cache, [ids[:depth]])
    start = time.perf_counter()
    feed(runtime, cache, [ids[depth:]])
    return time.perf_counter() - start


def warm_up_runs(runtime: Runtime) -> int:
    """Untimed runs of a test before its timed ones: one, where the first use of a kernel compiles
    it; two where the prefill is EXPLICIT_FIRST (CUDA's), which attends a shape by explicit products
    the first time it meets it and by the fused kernel, planning it, the second
    (Transformer.attend_prefill), so that no timed run pays a plan."""
    return 2 if runtime.model.prefill_attention == EXPLICIT_FIRST else 1


def check_fits(runtime: Runtime, n_prompt: int, n_gen: int, depths: tuple[int, ...]) -> None:
    """A one-line error unless pp<n_prompt> and tg<n_gen> at the deepest depth fit the model's context."""
    if min(n_prompt, n_gen, *depths) < 0:
        raise MlxLlamaError(f"prompt, generation and depth lengths must be 0 or more, not pp{n_prompt} / tg{n_gen}"
                            f" at depths {','.join(map(str, depths))}")
    context = runtime.config.context_length
    if max(depths) + max(n_prompt, n_gen + 1) > context:
        raise MlxLlamaError(f"pp{n_prompt} / tg{n_gen} at depth {max(depths)} do not fit the model's context of"
                            f" {context} tokens")


def first_token(runtime: Runtime, batch: int, depth: int, seed: int, cache: list | None) -> tuple[list, mx.array]:
    """A cache holding `depth` + 1 random ids of each of `batch` rows and the greedy token after them
    [batch, 1]; a `cache` given holds the `depth` positions already, and gets the last id."""
    if cache is None:
        cache, ids = runtime.model.make_cache(), random_ids(runtime, batch, depth + 1, seed)
    else:
        ids = random_ids(runtime, batch, 1, seed)
    return cache, mx.argmax(feed(runtime, cache, ids), axis=-1)[:, None]


def time_steps(step: Callable[[mx.array], mx.array], token: mx.array, n_gen: int,
               host: list[tuple[float, float]] | None = None) -> float:
    """Seconds for n_gen greedy decode steps from `token` [rows, 1], `step` giving the logits
    [rows, vocab] after its tokens. The host takes each token while the next step runs, as
    generate_tokens does; its seconds a step go to `host` as (building the step's graph, handing
    it to the device: on a GPU, launching its kernels)."""
    built = queued = 0.0
    start = time.perf_counter()
    for _ in range(n_gen):
        begin = time.perf_counter()
        next_token = mx.argmax(step(token), axis=-1)[:, None]
        graph = time.perf_counter()
        mx.async_eval(next_token)
        built, queued = built + graph - begin, queued + time.perf_counter() - graph
        token.tolist()
        token = next_token
    token.tolist()
    seconds = time.perf_counter() - start
    if host is not None:
        host.append((built / n_gen, queued / n_gen))
    return seconds


def cut_back(cache: list, depth: int) -> None:
    """Every layer of the cache back to its first `depth` positions."""
    for layer in cache:
        layer.trim(layer.offset - depth)


def time_generation(runtime: Runtime, batch: int, n_gen: int, seed: int, depth: int = 0,
                    host: list[tuple[float, float]] | None = None, cache: list | None = None) -> float:
    """Seconds for n_gen greedy decode steps of `batch` sequences after `depth` + 1 ids each, through
    the model's step (the CUDA kernels where they take the rows, as generate and batch decode), the
    host's time a step going to `host` (time_steps). A `cache` given already holds the `depth`
    positions (a benchmark that repeats a deep test fills it once), and is cut back to them afterwards."""
    cache, token = first_token(runtime, batch, depth, seed, cache)
    seconds = time_steps(lambda tokens: runtime.model.step(tokens, cache), token, n_gen, host)
    cut_back(cache, depth)
    return seconds


def step_launches(runtime: Runtime, batch: int, depth: int, cache: list | None = None) -> dict[str, int]:
    """The kernels one decode step of `batch` sequences launches after `depth` + 1 ids (step_cost.launches);
    a `cache` as time_generation takes it."""
    cache, token = first_token(runtime, batch, depth, 0, cache)
    outputs = [mx.argmax(runtime.model.step(token, cache), axis=-1)] + [a for layer in cache for a in layer.state]
    counted = launches(outputs)
    mx.eval(outputs)
    cut_back(cache, depth)
    return dict(counted.most_common())


def time_loop(runtime: Runtime, n_gen: int, seed: int, constraint: Constraint | None = None,
              speculation: Speculation | None = None, prompt: list[int] | None = None) -> tuple[float, int]:
    """(seconds, tokens) for up to n_gen greedy tokens of one sequence through the generation loop
    (generate_tokens, or speculative decoding's), under `constraint` or none, timed from the first
    token (after a one-token prompt, or `prompt`). Without a constraint stop tokens do not end it;
    with one, a stop token where the output is complete does (a schema of long outputs keeps that rare)."""
    guide = Guide(constraint, runtime.tokenizer) if constraint is not None else None
    stop_ids = runtime.tokenizer.stop_ids if guide else ()
    ids = prompt or random_ids(runtime, 1, 1, seed)[0]
    if speculation is not None:
        tokens = speculation(runtime.model, runtime.new_cache(), ids, n_gen + 1, stop_ids, ())
    else:
        sampler = make_sampler(SamplingParams(), runtime.model.sampling_group)
        tokens = generate_tokens(runtime.model, runtime.new_cache(), ids, sampler, n_gen + 1, stop_ids, guide=guide)
    next(tokens)
    start, count = time.perf_counter(), 0
    for _ in tokens:
        count += 1
    return time.perf_counter() - start, count


def run(path: str, n_prompt: int = 512, n_gen: int = 128, batches: tuple[int, ...] = (1,), repetitions: int = 5,
        dequantize: bool = False, dtype: mx.Dtype | str | None = None, context_length: int | None = None,
        constraint: Constraint | None = None, draft=None, draft_tokens: int = 4,
        draft_prompt: str | None = None, depths: tuple[int, ...] = (0,),
        kv_quantization: KVQuantization | None = None, parallel: str | None = None) -> BenchReport:
    """Load the model (its caches stored as `kv_quantization` says) and run pp<n_prompt> (one
    sequence) and tg<n_gen> at each batch size, at each depth; 0 skips a test.

    With a constraint, two more tests of one sequence through the generation loop, side by side:
    `tg<n_gen> loop` without it and `tg<n_gen> constrained` with it (the price of the masks). With
    a `draft` (a path to a draft model, or an n-gram length for prompt lookup), `tg<n_gen> loop`
    and `tg<n_gen> speculative` from `draft_prompt` (a copy task suits prompt lookup). Under
    mlx.launch, `parallel` splits the model as runtime.load does, and the report has every rank's memory."""
    tensor_bytes, params = file_tensor_stats(path)
    # Memory is counted from here, so arrays that the calling process already holds are left out.
    held_before = mx.get_active_memory()
    mx.reset_peak_memory()
    runtime = load(path, dtype=dtype, dequantize=dequantize, context_length=context_length,
                   kv_quantization=kv_quantization, parallel=parallel)
    report = BenchReport(
        model=os.path.basename(path), device=device_name(),
        mode="dequantize" if dequantize else ("native+kernels" if runtime.model.decode_step.uses_kernels else "native"),
        dtype=runtime.model.compute_dtype_name,
        file_bytes=os.path.getsize(path), tensor_bytes=tensor_bytes, params=params,
        load_seconds=runtime.load_seconds, weight_bytes=mx.get_active_memory() - held_before,
        load_peak_bytes=mx.get_peak_memory() - held_before, run_peak_bytes=0,
        kv_cache=kv_label(runtime.model.kv_quantization),
        kv_bytes_per_position=kv_bytes_per_position(runtime.config, runtime.model.compute_dtype,
                                                    runtime.model.kv_quantization),
        step_weight_bytes=weight_bytes_per_step(runtime.model),
    )
    mx.reset_peak_memory()
    if constraint is not None:
        constraint.check(runtime.tokenizer)
    check_fits(runtime, n_prompt, n_gen, depths)
    tests = []
    for d in depths:
        at = f" @ d{d}" if d else ""
        if n_prompt:
            tests.append((f"pp{n_prompt}{at}", 1, n_prompt, 0, d,
                          lambda seed, d=d: n_prompt / time_prompt(runtime, n_prompt, seed, d)))
        for b in batches if n_gen else ():
            tests.append((f"tg{n_gen}{at}", b, 0, n_gen, d,
                          lambda seed, b=b, d=d, host=None: b * n_gen / time_generation(runtime, b, n_gen, seed, d, host)))
    if n_gen and constraint is not None:
        for name, used in ((f"tg{n_gen} loop", None), (f"tg{n_gen} constrained", constraint)):
            tests.append((name, 1, 0, n_gen, 0, lambda seed, used=used: rate(time_loop(runtime, n_gen, seed, used))))
    if n_gen and draft is not None:
        drafter = draft if isinstance(draft, int) else load(draft, dtype=dtype, dequantize=dequantize,
                                                            context_length=context_length)
        prompt = runtime.tokenize(draft_prompt) if draft_prompt else None
        report.speculation = []

        def speculative(seed: int) -> float:
            speculation = runtime.speculation(drafter, SamplingParams(), draft_tokens)
            speed = rate(time_loop(runtime, n_gen, seed, speculation=speculation, prompt=prompt))
            report.speculation.append({"drafted": speculation.drafted, "accepted": speculation.accepted})
            return speed

        tests.append((f"tg{n_gen} loop", 1, 0, n_gen, 0,
                      lambda seed: rate(time_loop(runtime, n_gen, seed, prompt=prompt))))
        tests.append((f"tg{n_gen} speculative", 1, 0, n_gen, 0, speculative))
    warm_ups = warm_up_runs(runtime)
    for name, batch, pp, tg, depth, measure in tests:
        for _ in range(warm_ups):
            measure(repetitions)  # on ids no timed run uses
        result = TestResult(name, batch, pp, tg, [], depth)
        if name == f"tg{n_gen}" or name.startswith(f"tg{n_gen} @"):  # the decode steps bench times itself
            host = []
            result.samples = [measure(seed, host=host) for seed in range(repetitions)]
            result.host_us = [(built + queued) * 1e6 for built, queued in host]
            result.launches = step_launches(runtime, batch, depth)
        else:
            result.samples = [measure(seed) for seed in range(repetitions)]
        report.tests.append(result)
    report.run_peak_bytes = mx.get_peak_memory() - held_before
    shard = runtime.model.shard
    if shard is not None:
        report.parallel = f"{shard.mode} x{shard.size}"
        # This rank's cache: its heads of every layer, or every head of its layers.
        share = 1 / shard.size if shard.mode == "tensor" else len(shard.layers) / runtime.config.n_layers
        report.kv_bytes_per_position = round(report.kv_bytes_per_position * share)
        layer_bytes = sum(a.nbytes for _, a in tree_flatten(runtime.model.parameters()["blk"]))
        report.ranks = gather({"rank": shard.rank, "layers": [shard.layers.start, shard.layers.stop],
                               "weight_bytes": report.weight_bytes, "layer_bytes": layer_bytes,
                               "replicated_bytes": weight_param_bytes(runtime) - layer_bytes,
                               "run_peak_bytes": report.run_peak_bytes})
    return report


def weight_param_bytes(runtime: Runtime) -> int:
    return sum(a.nbytes for _, a in tree_flatten(runtime.model.parameters()))


def rate(timing: tuple[float, int]) -> float:
    seconds, tokens = timing
    return tokens / seconds if tokens else 0.0


def device_name() -> str:
    kind = "gpu" if mx.default_device() == mx.gpu else f"cpu ({os.cpu_count()} cores)"
    return f"{kind} {mx.device_info().get('device_name', '')}".strip()


def format_table(report: BenchReport) -> str:
    """A llama-bench-like markdown table, then load time and memory."""
    gib = report.tensor_bytes / 2**30
    size = f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.2f} MiB"
    rows = ["| model | size | params | mode | device | test | batch | t/s | launches/step | host µs/step |",
            "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for t in report.tests:
        cost = f"{sum(t.launches.values())} | {statistics.median(t.host_us):.0f}" if t.launches else " | "
        rows.append(
            f"| {report.model} | {size} | {report.params / 1e9:.2f} B | {report.mode}, {report.dtype} | {report.device} "
            f"| {t.name} "
            f"| {t.batch} | {t.median:.2f} ± {t.stdev:.2f} | {cost} |"
        )
    mib = 2**20
    rows += [
        "",
        f"load: {report.load_seconds:.2f} s; weights held: {report.weight_bytes / mib:.1f} MiB = "
        f"{report.weight_bytes / report.tensor_bytes:.3f} x the file's {report.tensor_bytes / mib:.1f} MiB of tensors "
        f"(peak while loading {report.load_peak_bytes / report.tensor_bytes:.3f} x); "
        f"peak during the tests: {report.run_peak_bytes / mib:.1f} MiB; KV cache ({report.kv_cache}): "
        f"{report.kv_bytes_per_position / 1024:.1f} KiB a position of a sequence" + (" on rank 0" if report.ranks else ""),
        f"a decode step reads {report.step_weight_bytes / mib:.1f} MiB of weights (for all its rows); launches/step:"
        f" the primitives of its graph on this device, views left out (docs/benchmarks.md)",
    ]
    if report.ranks:
        rows += ["", f"split: {report.parallel} (tokens/s above are the whole run's, as every rank takes part)",
                 "| rank | layers | weights held | of which layers | replicated | peak |",
                 "| ---: | --- | ---: | ---: | ---: | ---: |"]
        rows += [f"| {r['rank']} | {r['layers'][0]}-{r['layers'][1] - 1} | {r['weight_bytes'] / mib:.1f} MiB"
                 f" | {r['layer_bytes'] / mib:.1f} MiB | {r['replicated_bytes'] / mib:.1f} MiB"
                 f" | {r['run_peak_bytes'] / mib:.1f} MiB |" for r in report.ranks]
    return "\n".join(rows)
