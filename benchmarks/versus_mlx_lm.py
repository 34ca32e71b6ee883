"""The plain MLX decode step against mlx-lm's loop, side by side in one process: the path Apple
Silicon runs, on whatever device this runs on.

    pip install --no-deps mlx-lm==0.32.2
    MLXLLAMA_CUDA_KERNELS=0 python benchmarks/versus_mlx_lm.py MODEL.gguf [-n 128] [-p 512]
        [--batches 1,8,16] [--depths 0,4096,8192] [--rounds 5] [--fill random] [--ours-generate-step]
        [--ours-fused-prefill] [--json OUT]

Ours: `mlxllama bench`'s prefill and decode loops on the GGUF file as it loads (native mode). mlx-lm:
its `models.llama.Model` of the same shape, random weights in MLX's 4-bit format of group 64 (what
mlx-lm's converter writes by default) in our compute type (float16 on a GPU), one sequence through its `generate_step` (greedy, as it
decodes), several through the same pipelined loop around its model and cache; its prefill in chunks
of 2,048 ids, generate_step's default (ours in generate's: 2,048 on a GPU, 512 on the CPU). mlx-lm's model code is
imported without its Hugging Face parts: stand-ins take the place of `transformers` and
`huggingface_hub` where they are not installed, and nothing of them is called.

For each test, each engine's cache is filled to the depth once (and cut back to it after every run):
by prefilling random ids, or with `--fill random` by writing random keys and values straight into
it (a decode step's cost at a depth depends on how many positions it attends, not on their values;
on a 2-core CPU mlx-lm prefills 16 rows of 8,192 ids in hours; chat-tiny's layout written for a long
context, `synthetic.write(path, "chat-tiny", context=16384)`, is what the CPU's deep tests run on).
Then the engines run in turn, --rounds times, which goes first alternating. The table gives the
median of the rounds and the ratio of the medians (ours / mlx-lm) with its spread (slowest ours over
fastest mlx-lm, fastest over slowest), and round by round: the median of each round's own ratio,
with the lowest and highest (paired), which a shift of the whole process between rounds leaves
alone. It also gives what a Mac's speed follows: each step's launches (mlxllama.step_cost) and the
host's time to build and queue it, and the weights each engine holds.
Random weights make the speeds real and the text meaningless.

`--ours-generate-step` times our model's one sequence through mlx-lm's `generate_step` too, as a third
engine in the same rounds ("ours in generate_step"): the same step in the other loop, which tells the
loop's share of the one-sequence ratio from the step's.

`--ours-fused-prefill` times our prefill with MLX's fused attention always, as a third engine of the
pp test ("ours, fused prefill"), which is how every backend but CUDA, Apple Silicon's included,
prefills. On CUDA the runtime attends a prefill shape by explicit products the first time it meets
it, and by the fused kernel when it meets it again (`Transformer.attend_prefill`: MLX's
CUDA build plans the fused kernel anew for every shape of new and cached tokens, which one-off
prompts and a server's requests would pay nearly every time); there the warm-up meets each shape twice.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import types

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxllama import bench, load
from mlxllama.cache import whole_blocks
from mlxllama.errors import MlxLlamaError
from mlxllama.models.transformer import FUSED
from mlxllama.step_cost import launches

# Prompt ids mlx-lm's prefill feeds at once: generate_step's default prefill_step_size on every
# device (ours: generate.prefill_chunk()).
MLX_LM_PREFILL_STEP = 2048
# The third engine of --ours-generate-step: our model through mlx-lm's loop.
IN_GENERATE_STEP = "ours in generate_step"
# The third engine of --ours-fused-prefill: our prefill with MLX's fused attention.
FUSED_PREFILL = "ours, fused prefill"


def import_mlx_lm():
    """mlx_lm.generate.generate_step and mlx_lm.models.{llama, cache}, without running mlx_lm's
    __init__ (which loads its converter) and with stand-ins for Hugging Face's packages if absent."""

    class Anything(type):
        def __getattr__(cls, name):
            return lambda *args, **kwargs: None

    def stand_in(name: str) -> None:
        module = types.ModuleType(name)
        module.__path__ = []
        module.__getattr__ = lambda attr: Anything(attr, (), {})
        sys.modules[name] = module

    # find_spec refuses a module already imported without a spec (the stand-ins, from an earlier call).
    if "mlx_lm" not in sys.modules:
        spec = importlib.util.find_spec("mlx_lm")
        if spec is None:
            sys.exit("mlx-lm is not installed: pip install -e \".[bench]\" (or pip install --no-deps mlx-lm==0.32.2)")
        package = types.ModuleType("mlx_lm")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["mlx_lm"] = package
    for name in ("transformers", "huggingface_hub"):
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            stand_in(name)
            if name == "transformers":
                stand_in("transformers.tokenization_utils_base")
    from mlx_lm.generate import generate_step
    from mlx_lm.models import cache, llama
    return generate_step, llama, cache


class MlxLm:
    """mlx-lm's Llama of the GGUF file's shape, 4-bit group 64, random weights."""

    def __init__(self, config, dtype: mx.Dtype, seed: int = 0):
        self.generate_step, llama, cache = import_mlx_lm()
        self.make_cache = lambda: cache.make_prompt_cache(self.model)
        args = llama.ModelArgs(
            model_type="llama", hidden_size=config.hidden_size, num_hidden_layers=config.n_layers,
            intermediate_size=config.ffn_size, num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
            head_dim=config.head_dim, rms_norm_eps=config.rms_eps, vocab_size=config.vocab_size,
            rope_theta=config.rope_base, tie_word_embeddings=config.tied_output,
            max_position_embeddings=config.context_length)
        mx.random.seed(seed)
        self.model = llama.Model(args)  # MLX's layers start from random weights
        self.model.set_dtype(dtype)  # as mlx-lm loads a model: in its (half-precision) type
        nn.quantize(self.model, group_size=64, bits=4)
        mx.eval(self.model.parameters())
        self.weight_bytes = sum(a.nbytes for _, a in tree_flatten(self.model.parameters()))
        self.config = config

    def feed(self, cache, ids: mx.array) -> mx.array:
        for start in range(0, ids.shape[1], MLX_LM_PREFILL_STEP):
            logits = self.model(ids[:, start : start + MLX_LM_PREFILL_STEP], cache=cache)
            mx.eval(logits, [c.state for c in cache])
        return logits[:, -1]

    def time_prompt(self, n_prompt: int, seed: int) -> float:
        ids = random_ids(self.config.vocab_size, 1, n_prompt, seed)
        cache = self.make_cache()
        start = time.perf_counter()
        self.feed(cache, ids)
        return time.perf_counter() - start

    def prefilled(self, batch: int, depth: int, seed: int = 0) -> list:
        """A cache holding `depth` random ids of each of `batch` rows."""
        cache = self.make_cache()
        if depth:
            self.feed(cache, random_ids(self.config.vocab_size, batch, depth, seed))
        return cache

    def filled(self, batch: int, depth: int, n_gen: int, dtype: mx.Dtype) -> list:
        """A cache holding `depth` random keys and values in each of `batch` rows, in buffers as
        mlx-lm's KVCache grows them (steps of its `step`) with room for the run's n_gen + 1 positions,
        so that it does not grow (copy) them while timed."""
        cache = self.make_cache()
        slots = whole_blocks(depth + n_gen + 1, cache[0].step)
        for layer, (keys, values) in zip(cache, random_kv(self.config, batch, slots, dtype, len(cache))):
            layer.keys, layer.values, layer.offset = keys, values, depth
        return cache

    def time_generation(self, cache: list, batch: int, n_gen: int, seed: int, depth: int, host: list[tuple],
                        generate_step: bool = True) -> float:
        """As bench.time_generation, on a cache holding `depth` positions, cut back to them afterwards;
        one sequence through generate_step unless told otherwise."""
        ids = random_ids(self.config.vocab_size, batch, 1, seed)
        if batch == 1 and generate_step:
            seconds = through_generate_step(self.generate_step, self.model, ids[0], cache, n_gen)
            host.append((float("nan"), float("nan")))  # generate_step's host part is not separable from outside
        else:
            token = mx.argmax(self.feed(cache, ids), axis=-1)[:, None]
            seconds = bench.time_steps(lambda tokens: self.model(tokens, cache=cache)[:, -1], token, n_gen, host)
        bench.cut_back(cache, depth)
        return seconds

    def step_launches(self, cache: list, batch: int, depth: int) -> int:
        token = mx.argmax(self.feed(cache, random_ids(self.config.vocab_size, batch, 1, 0)), axis=-1)[:, None]
        buffers = [a for c in cache for a in c.state if isinstance(a, mx.array)]  # (keys, values, offset)
        outputs = [mx.argmax(self.model(token, cache=cache)[:, -1], axis=-1)] + buffers
        counted = sum(launches(outputs).values())
        mx.eval(outputs)
        bench.cut_back(cache, depth)
        return counted


def through_generate_step(generate_step, model, ids: mx.array, cache: list, n_gen: int) -> float:
    """Seconds for n_gen tokens of one sequence through mlx-lm's loop, `model` called as it calls
    its own (model(tokens, cache=cache)): it feeds `ids`, then decodes one token ahead of the host."""
    tokens = generate_step(ids, model, max_tokens=n_gen + 1, prompt_cache=cache)
    next(tokens)
    start = time.perf_counter()
    for _ in tokens:
        pass
    return time.perf_counter() - start


def time_fused_prefill(runtime, n_prompt: int, seed: int) -> float:
    """bench.time_prompt with MLX's fused attention, as every backend but CUDA prefills; the model's
    choice restored after."""
    with runtime.model.attending_prefill(FUSED):
        return bench.time_prompt(runtime, n_prompt, seed)


def ours_in_generate_step(runtime, generate_step, cache: list, n_gen: int, seed: int, depth: int) -> float:
    """As MlxLm.time_generation's one sequence (the same id for the same seed), with our model in mlx-lm's loop."""
    seconds = through_generate_step(generate_step, runtime.model, random_ids(runtime.config.vocab_size, 1, 1, seed)[0],
                                    cache, n_gen)
    bench.cut_back(cache, depth)
    return seconds


def random_kv(config, batch: int, slots: int, dtype: mx.Dtype, layers: int):
    """Each layer's random keys and values [batch, kv_heads, slots, head_dim]."""
    shape = (batch, config.n_kv_heads, slots, config.head_dim)
    for _ in range(layers):
        keys, values = mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype)
        mx.eval(keys, values)
        yield keys, values


def filled_ours(runtime, batch: int, depth: int, n_gen: int) -> list:
    """Our cache holding `depth` random keys and values in each of `batch` rows, as a prompt cache
    restores one, then grown as the cache grows itself (the runtime's own sizes, which decide
    MLX's attention kernel on CUDA) with room for the run's n_gen + 1 positions, so that it does not
    grow (copy) its buffers while timed."""
    cache = runtime.model.make_cache()
    for layer, (keys, values) in zip(cache, random_kv(runtime.config, batch, depth,
                                                      runtime.model.compute_dtype, len(cache))):
        layer.restore(keys, values, 0, depth)
        layer.make_room(n_gen + 1)
        mx.eval(layer.keys, layer.values)
    return cache


def random_ids(vocab: int, batch: int, length: int, seed: int) -> mx.array:
    return mx.random.randint(0, vocab, (batch, length), key=mx.random.key(seed))


def host_us(runs: list[tuple[float, float]]) -> list[float] | None:
    """The medians of the runs' host µs a step: (building the graph, launching it)."""
    measured = [run for run in runs if run[0] == run[0]]
    return [statistics.median(part) * 1e6 for part in zip(*measured)] if measured else None


def interleaved_rounds(timers: dict, rounds: int, host: dict, warm_ups: int = 1) -> dict[str, list[float]]:
    """Each timer's samples (timer(seed) -> tokens/s) over `rounds` rounds, every timer in each, the
    order reversed every other round. Each timer runs `warm_ups` times first, off the clock, so that
    each shape's kernels compile there (and on CUDA our prefill plans MLX's fused attention for a
    shape met again: bench.warm_up_runs); the host times those runs recorded in `host` are dropped."""
    for timer in timers.values():
        for seed in range(10_000, 10_000 + warm_ups):
            timer(seed)
    for times in host.values():
        times.clear()
    samples = {name: [] for name in timers}
    for round_ in range(rounds):
        for name in list(timers) if round_ % 2 == 0 else reversed(timers):
            samples[name].append(timers[name](round_))
    return samples


def spread(ours: list[float], theirs: list[float]) -> tuple[float, float]:
    return min(ours) / max(theirs), max(ours) / min(theirs)


def paired(ours: list[float], theirs: list[float]) -> tuple[float, float, float]:
    """The rounds' own ratios (each round's ours over the same round's theirs): median, lowest, highest.
    A GPU machine's one-sequence speed can shift by half for every engine at once between rounds of
    one process; a round's ratio cancels such a shift, where the ratio of the medians does not."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    return statistics.median(ratios), min(ratios), max(ratios)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("-p", "--n-prompt", type=int, default=512)
    parser.add_argument("-n", "--n-gen", type=int, default=128)
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--depths", default="0,4096,8192")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fill", choices=("prefill", "random"), default="prefill",
                        help="how the caches reach each depth: prefilled ids, or random keys and values")
    parser.add_argument("--no-generate-step", action="store_true",
                        help="mlx-lm's one sequence through the loop of its batches, not generate_step (whose host"
                             " time cannot be split from outside)")
    parser.add_argument("--ours-generate-step", action="store_true",
                        help="also time our one sequence through mlx-lm's generate_step, as a third engine")
    parser.add_argument("--ours-fused-prefill", action="store_true",
                        help="also time our prefill with MLX's fused attention (as a Mac prefills), as a third engine")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    depths = [int(d) for d in args.depths.split(",")]

    try:
        runtime = load(args.model)
        bench.check_fits(runtime, args.n_prompt, args.n_gen, tuple(depths))
    except MlxLlamaError as e:
        print(f"versus_mlx_lm.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    ours_bytes = sum(a.nbytes for _, a in tree_flatten(runtime.model.parameters()))
    theirs = MlxLm(runtime.config, runtime.model.compute_dtype)
    tests = [("pp", 1, 0)] if args.n_prompt else []
    tests += [("tg", b, d) for d in depths for b in batches]
    rows = []
    for kind, batch, depth in tests:
        host = {"ours": [], "mlx-lm": []}
        if kind == "pp":
            timers = {"ours": lambda seed: args.n_prompt / bench.time_prompt(runtime, args.n_prompt, seed),
                      "mlx-lm": lambda seed: args.n_prompt / theirs.time_prompt(args.n_prompt, seed)}
            if args.ours_fused_prefill:
                timers[FUSED_PREFILL] = lambda seed: args.n_prompt / time_fused_prefill(runtime, args.n_prompt, seed)
        else:  # each engine's cache is filled to the depth once, and cut back to it after every run
            if args.fill == "random":
                ours_cache = filled_ours(runtime, batch, depth, args.n_gen)
                theirs_cache = theirs.filled(batch, depth, args.n_gen, runtime.model.compute_dtype)
            else:
                ours_cache = runtime.model.make_cache()
                if depth:
                    bench.feed(runtime, ours_cache, bench.random_ids(runtime, batch, depth, 0))
                theirs_cache = theirs.prefilled(batch, depth)
            timers = {
                "ours": lambda seed: batch * args.n_gen / bench.time_generation(
                    runtime, batch, args.n_gen, seed, depth, host["ours"], ours_cache),
                "mlx-lm": lambda seed: batch * args.n_gen / theirs.time_generation(
                    theirs_cache, batch, args.n_gen, seed, depth, host["mlx-lm"], not args.no_generate_step)}
            if args.ours_generate_step and batch == 1:
                timers[IN_GENERATE_STEP] = lambda seed: args.n_gen / ours_in_generate_step(
                    runtime, theirs.generate_step, ours_cache, args.n_gen, seed, depth)
        samples = interleaved_rounds(timers, args.rounds, host, bench.warm_up_runs(runtime))
        ours, mlx_lm = samples["ours"], samples["mlx-lm"]
        row = {"test": f"pp{args.n_prompt}" if kind == "pp" else f"tg{args.n_gen}", "batch": batch, "depth": depth,
               "ours": ours, "mlx_lm": mlx_lm, "ratio": statistics.median(ours) / statistics.median(mlx_lm),
               "spread": spread(ours, mlx_lm), "paired": paired(ours, mlx_lm)}
        if kind == "tg":
            row["ours_launches"] = sum(bench.step_launches(runtime, batch, depth, ours_cache).values())
            row["mlx_lm_launches"] = theirs.step_launches(theirs_cache, batch, depth)
            row["ours_host_us"], row["mlx_lm_host_us"] = host_us(host["ours"]), host_us(host["mlx-lm"])
        in_loop = samples.get(IN_GENERATE_STEP)
        if in_loop:
            row["ours_generate_step"] = in_loop
            row["ours_generate_step_ratio"] = statistics.median(in_loop) / statistics.median(mlx_lm)
            row["ours_generate_step_spread"] = spread(in_loop, mlx_lm)
        fused = samples.get(FUSED_PREFILL)
        if fused:
            row["ours_fused_prefill"] = fused
            row["ours_fused_prefill_ratio"] = statistics.median(fused) / statistics.median(mlx_lm)
            row["ours_fused_prefill_paired"] = paired(fused, mlx_lm)
        rows.append(row)
        print(f"{row['test']} b={batch} d={depth}: {statistics.median(ours):.1f} against {statistics.median(mlx_lm):.1f}"
              " t/s" + (f"; ours in generate_step {statistics.median(in_loop):.1f}" if in_loop else "")
              + (f"; ours with a fused prefill {statistics.median(fused):.1f}" if fused else ""),
              file=sys.stderr, flush=True)
        if args.json:  # after every test, so that a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"device": bench.device_name(), "mlx": mx.__version__, "model": args.model,
                           "context": runtime.config.context_length, "fill": args.fill, "rounds": args.rounds, "ours_weight_bytes": ours_bytes,
                           "mlx_lm_weight_bytes": theirs.weight_bytes, "rows": rows}, f, indent=1)

    print(f"device: {bench.device_name()}, MLX {mx.__version__}, {args.rounds} rounds; weights held: ours "
          f"{ours_bytes / 2**20:.0f} MiB, mlx-lm {theirs.weight_bytes / 2**20:.0f} MiB")
    print("| test | batch | depth | mlxllama t/s | mlx-lm t/s | ratio (spread) | round by round (range)"
          " | launches/step mlxllama / mlx-lm | host µs/step, graph + launch: mlxllama / mlx-lm |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    split = lambda us: f"{us[0]:.0f} + {us[1]:.0f}" if us else "–"  # noqa: E731
    for r in rows:
        launched = f"{r['ours_launches']} / {r['mlx_lm_launches']}" if "ours_launches" in r else ""
        hosted = f"{split(r['ours_host_us'])} / {split(r['mlx_lm_host_us'])}" if "ours_host_us" in r else ""
        print(f"| {r['test']} | {r['batch']} | {r['depth']} | {statistics.median(r['ours']):.1f} "
              f"| {statistics.median(r['mlx_lm']):.1f} | {r['ratio']:.2f}× ({r['spread'][0]:.2f}–{r['spread'][1]:.2f})"
              f" | {r['paired'][0]:.2f}× ({r['paired'][1]:.2f}–{r['paired'][2]:.2f}) | {launched} | {hosted} |")
    in_loop = [r for r in rows if "ours_generate_step" in r]
    if in_loop:
        print("\n| test | depth | ours in generate_step t/s | mlx-lm t/s | ratio (spread) | ours in our loop, ratio |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for r in in_loop:
            low, high = r["ours_generate_step_spread"]
            print(f"| {r['test']} | {r['depth']} | {statistics.median(r['ours_generate_step']):.1f} "
                  f"| {statistics.median(r['mlx_lm']):.1f} "
                  f"| {r['ours_generate_step_ratio']:.2f}× ({low:.2f}–{high:.2f}) | {r['ratio']:.2f}× |")
    fused = [r for r in rows if "ours_fused_prefill" in r]
    if fused:
        print("\n| test | ours, fused prefill t/s | mlx-lm t/s | ratio | round by round (range) | ours as the runtime prefills, ratio |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for r in fused:
            middle, low, high = r["ours_fused_prefill_paired"]
            print(f"| {r['test']} | {statistics.median(r['ours_fused_prefill']):.1f} | {statistics.median(r['mlx_lm']):.1f} "
                  f"| {r['ours_fused_prefill_ratio']:.2f}× | {middle:.2f}× ({low:.2f}–{high:.2f}) | {r['ratio']:.2f}× |")


if __name__ == "__main__":
    main()
