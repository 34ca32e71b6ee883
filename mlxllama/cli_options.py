"""The options the `mlxllama` commands share, and what they become: the model to load, the
sampling settings, the template choice."""

from __future__ import annotations

import os
from importlib.resources import files

import click

from .errors import MlxLlamaError, parse_json_object


MODEL_ENV = "MLXLLAMA_MODEL"


def default_model_path() -> str:
    """$MLXLLAMA_MODEL, else the small demo model shipped inside the package."""
    return os.environ.get(MODEL_ENV) or str(files("mlxllama.data") / "chat-tiny-Q4_K_M.gguf")


def model_option(f):
    return click.option(
        "--model", "-m", "model_path", default=None, metavar="GGUF",
        help=f"GGUF model file (default: ${MODEL_ENV}, else the bundled demo model chat-tiny Q4_K_M).",
    )(f)


def sampling_options(f):
    options = [
        click.option("--max-tokens", "-n", default=256, show_default=True, type=click.IntRange(0),
                     help="Most tokens to generate."),
        click.option("--temperature", "--temp", "-t", default=0.0, show_default=True,
                     type=click.FloatRange(0, float("inf"), max_open=True), help="0 is greedy."),
        click.option("--top-k", default=40, show_default=True, help="Keep the k likeliest tokens (0: all)."),
        click.option("--top-p", default=0.95, show_default=True, help="Nucleus: keep the smallest set with this mass."),
        click.option("--min-p", default=0.05, show_default=True, help="Drop tokens below min-p x the top probability."),
        click.option("--repeat-penalty", default=1.0, show_default=True, help="Penalty for recent tokens (1: off)."),
        click.option("--repeat-last-n", default=64, show_default=True, help="Window of the repeat penalty (-1: all)."),
        click.option("--presence-penalty", default=0.0, show_default=True,
                     help="Subtracted once from a generated token's logit (OpenAI's; -2 to 2)."),
        click.option("--frequency-penalty", default=0.0, show_default=True,
                     help="Subtracted from a token's logit for each time it was generated (OpenAI's; -2 to 2)."),
        click.option("--logit-bias", multiple=True, metavar="ID=BIAS", callback=parse_logit_bias,
                     help="Add BIAS (-100 to 100) to token ID's logit (repeatable)."),
        click.option("--seed", type=click.IntRange(0), default=None, help="Random seed for sampling (reproducible runs)."),
        click.option("--stop", multiple=True, help="Stop at this string (repeatable); it is not printed."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def parse_logit_bias(ctx, param, values) -> tuple[tuple[int, float], ...]:
    pairs = []
    for value in values:
        token, _, bias = value.partition("=")
        try:
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise click.BadParameter(f"{value!r} is not ID=BIAS (e.g. 29889=-100)") from None
    return tuple(pairs)


def sampling_params(options: dict):
    """The sampling options as SamplingParams, which checks them (a NaN passes click's range check)."""
    from .sampling import InvalidSampling, SamplingParams

    try:
        return SamplingParams(**{name: options[name] for name in SamplingParams.names()})
    except InvalidSampling as e:
        raise MlxLlamaError(f"--{e.name.replace('_', '-')} must be {e.must}, got {e.value}") from None


def template_options(f):
    options = [
        click.option("--no-template", is_flag=True, help="Feed the raw prompt, with BOS if the file asks for one (as llama.cpp)."),
        click.option("--template", "template_name", metavar="NAME", help="Use a built-in chat template."),
        click.option("--template-file", type=click.Path(dir_okay=False), help="Use the chat template in this file."),
        click.option("--template-kwargs", metavar="JSON", help="Extra template variables, as a JSON object."),
        click.option("--system", metavar="TEXT", help="System message (with a template)."),
        click.option("--show-prompt", is_flag=True, help="Print the rendered prompt and its token ids to stderr."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def check_no_template(no_template: bool, system: str | None, compare_template: bool, template_name: str | None,
                      template_file: str | None) -> None:
    """The template options that exclude each other, named in one line."""
    if no_template and (system or compare_template):
        raise MlxLlamaError("--no-template cannot be combined with --system or --compare-template")
    given = [name for name, value in (("--no-template", no_template), ("--template", template_name),
                                      ("--template-file", template_file)) if value]
    if len(given) > 1:
        raise MlxLlamaError(f"{' and '.join(given)} exclude each other: give one template source")


def parse_template_kwargs(raw: str | None) -> dict:
    return parse_json_object(raw, "--template-kwargs") if raw else {}


DTYPES = ("float32", "float16", "bfloat16")


def precision_options(f):
    # Not passed to the command: load_model reads them, so commands need no extra parameter.
    f = click.option(
        "--dtype", type=click.Choice(DTYPES), default=None, expose_value=False, callback=remember,
        help="What the model computes in, and what --dequantize expands weights to (default: float16 on a GPU,"
             " float32 on the CPU). On the CPU, --dequantize --dtype bfloat16 is what makes --lookup and"
             " --draft-model pay: MLX's CPU bfloat16 product checks 6 positions in about 3 steps' time, its"
             " float32 and quantized ones in 6. Without --dequantize, bfloat16 is slower there than float32.",
    )(f)
    return click.option(
        "--dequantize", is_flag=True, expose_value=False, callback=remember,
        help="Expand quantized weights to float (float16 on a GPU) instead of running them quantized.",
    )(f)


def dequantize_requested() -> bool:
    return bool(click.get_current_context().meta.get("mlxllama.dequantize"))


def dtype_requested() -> str | None:
    """--dtype's name ("bfloat16"...), or None for runtime.load's default; a name, not an mx.Dtype
    (which does not pickle), so that it also travels to serve's engine process."""
    import mlx.core as mx

    name = click.get_current_context().meta.get("mlxllama.dtype")
    if name == "float16" and mx.default_device() == mx.cpu:
        raise MlxLlamaError("--dtype float16 on the CPU: MLX's CPU norms overflow in float16 (Gemma 3 gives NaN)"
                            " and its float16 products are its slowest; use float32 or bfloat16")
    return name


def context_option(f):
    # Not passed to the command: load_model reads it, as it reads --dequantize. A plain int, so that
    # a bad value is the one-line error of the loader rather than click's usage message.
    return click.option(
        "--ctx", "-c", type=int, default=None, metavar="N", expose_value=False,
        callback=lambda ctx, _param, value: ctx.meta.__setitem__("mlxllama.context_length", value),
        help="Context length in tokens, at most the model's trained context (the default); as llama.cpp's -c,"
             " it also picks Phi-3's short or long LongRoPE factors.",
    )(f)


def context_requested() -> int | None:
    return click.get_current_context().meta.get("mlxllama.context_length")


def remember(ctx, param, value):
    """An option's callback that also leaves its value where load_model looks (ctx.meta)."""
    ctx.meta[f"mlxllama.{param.name}"] = value
    return value


def kv_cache_options(f):
    # Not passed to the command: load_model reads them, as it reads --dequantize.
    options = [
        click.option("--kv-bits", type=int, default=None, metavar="4|8", expose_value=False, callback=remember,
                     help="Store the KV cache quantized to this many bits a value (MLX's affine quantization):"
                          " about 1/2 (8) or 1/4 (4) of its memory at float16."),
        click.option("--kv-key-bits", type=int, default=None, metavar="4|8", expose_value=False, callback=remember,
                     help="With --kv-bits: store the keys at this many bits instead (llama.cpp's -ctk beside -ctv):"
                          " --kv-bits 4 --kv-key-bits 8 holds about 0.41 of the float16 cache and loses far"
                          " less than 4-bit keys."),
        click.option("--kv-keys-by-channel", is_flag=True, expose_value=False, callback=remember,
                     help="With --kv-bits: quantize each channel of the keys over blocks of 32 positions (KIVI)"
                          " instead of along the head; 4-bit keys then lose little (docs/benchmarks.md). One"
                          " sequence at a time, on the plain step: not in batch or serve; with --max-kv-size,"
                          " --keep must be a multiple of 32."),
        click.option("--kv-group-size", type=int, default=None, metavar="N", expose_value=False, callback=remember,
                     help="With --kv-bits: values sharing one scale and bias (default 64, or 32 for heads of 64 or fewer)."),
        click.option("--quantized-kv-start", type=int, default=0, show_default=True, metavar="N", expose_value=False,
                     callback=remember, help="With --kv-bits: hold the first N positions at full precision, and"
                                             " quantize the cache once it holds more."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def kv_quantization_requested():
    """The KVQuantization the --kv-* options ask for, or None."""
    from .cache import KVQuantization

    meta = click.get_current_context().meta
    bits = meta.get("mlxllama.kv_bits")
    if bits is None:
        defaults = (("kv-key-bits", None), ("kv-keys-by-channel", False), ("kv-group-size", None),
                    ("quantized-kv-start", 0))
        given = [f"--{name}" for name, default in defaults
                 if meta.get(f"mlxllama.{name.replace('-', '_')}", default) != default]
        if given:
            raise MlxLlamaError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --kv-bits")
        return None
    return KVQuantization(bits, meta["mlxllama.kv_group_size"], meta["mlxllama.quantized_kv_start"],
                          meta["mlxllama.kv_key_bits"], meta["mlxllama.kv_keys_by_channel"])


def parallel_options(f):
    # Not passed to the command: load_model reads it, as it reads --dequantize.
    return click.option(
        "--pipeline", is_flag=True, expose_value=False, callback=remember,
        help="Under mlx.launch: split the model by layers, a range a process, instead of splitting every"
             " layer's tensors (the default; a pipeline too where the heads do not divide).",
    )(f)


def parallel_requested() -> str | None:
    """How the model is split over the processes of mlx.launch: "tensor", "pipeline", or None when
    not launched (or when each process holds a whole model: batch --data-parallel)."""
    from .distributed import launched

    meta = click.get_current_context().meta
    if not launched():
        if meta.get("mlxllama.pipeline"):
            raise MlxLlamaError("--pipeline splits a model over the processes of mlx.launch:"
                                " run `mlx.launch -n 2 -- mlxllama ...`")
        return None
    if meta.get("mlxllama.data_parallel"):
        if meta.get("mlxllama.pipeline"):
            raise MlxLlamaError("--pipeline and --data-parallel exclude each other: split the model, or the lines")
        return None
    return "pipeline" if meta.get("mlxllama.pipeline") else "tensor"


def load_model(model_path: str | None, context_length: int | None = None, requantize: bool = True):
    """The model, loaded for `context_length` tokens, else for --ctx, else for its trained context,
    its caches stored as the --kv-* options say; under mlx.launch, this process's part of it.
    `requantize`: runtime.load's."""
    from .distributed import world
    from .runtime import load

    if context_length is None:
        context_length = context_requested()
    runtime = load(model_path or default_model_path(), dtype=dtype_requested(), dequantize=dequantize_requested(),
                   context_length=context_length, kv_quantization=kv_quantization_requested(),
                   parallel=parallel_requested(), requantize=requantize)
    shard = runtime.model.shard
    if shard is not None and world().is_root:
        if shard.mode == "tensor":
            how = f"layers split by tensor over {shard.size} processes"
        else:
            why = f" (not split by tensor: {shard.reason})" if shard.reason else ""
            how = f"a pipeline of {shard.size} processes, {len(shard.layers)} layers on rank 0{why}"
        click.echo(f"[mlx.launch: {how}]", err=True)
    return runtime


def refuse_stdin() -> None:
    """Standard input as a command's text: not under mlx.launch, which never passes its end on."""
    from .distributed import launched

    if launched():
        raise MlxLlamaError("under mlx.launch, standard input never ends (mlx.launch does not pass its end on):"
                            " give the text as an argument or a file")


def refuse_under_launch(**options) -> None:
    """A one-line error for the first given option that a run under mlx.launch does not take yet."""
    from .distributed import launched

    if not launched():
        return
    for option, value in options.items():
        if value:
            raise MlxLlamaError(f"--{option.replace('_', '-')} is not supported under mlx.launch yet")


CONSTRAINT_OPTIONS = {"json_schema": "--json-schema", "json_object": "--json-object", "regex": "--regex",
                      "grammar": "--grammar"}  # in the order errors name them


def constraint_options(f):
    # Not passed to the command: requested_constraint() reads them, as load_model reads --dequantize.
    def remember(ctx, param, value):
        if value:
            ctx.meta.setdefault("mlxllama.constraint", {})[param.name] = value

    options = [
        click.option("--json-schema", metavar="FILE_OR_JSON", expose_value=False, callback=remember,
                     help="Output JSON that validates against this JSON Schema (a file, or the schema itself)."),
        click.option("--json-object", is_flag=True, expose_value=False, callback=remember,
                     help="Output one JSON object (any)."),
        click.option("--regex", metavar="PATTERN", expose_value=False, callback=remember,
                     help="Output text that matches this regular expression (the whole of it)."),
        click.option("--grammar", metavar="FILE", expose_value=False, callback=remember,
                     help="Output text in the language of this grammar (GBNF, as llama.cpp's, or llguidance's Lark)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def requested_constraint():
    """The Constraint the options ask for, or None; more than one is an error, as is an unreadable file."""
    from .constraints import Constraint

    given = click.get_current_context().meta.get("mlxllama.constraint", {})
    if len(given) > 1:
        named = [option for key, option in CONSTRAINT_OPTIONS.items() if key in given]
        raise MlxLlamaError(f"{' and '.join(named)} exclude each other: give one constraint")
    if not given:
        return None
    (kind, value), = given.items()
    if kind == "json_schema" and not value.lstrip().startswith(("{", "true", "false")):
        value = read_text(value, "--json-schema")
    elif kind == "grammar":
        value = read_text(value, "--grammar")
    return Constraint.of(kind, value)


def read_text(path: str, option: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise MlxLlamaError(f"{option}: cannot read {path}: {reason}") from None


def prompt_cache_option(f):
    return click.option(
        "--prompt-cache", "prompt_cache_file", metavar="FILE", type=click.Path(dir_okay=False),
        help="Start from a prefix saved by `mlxllama cache-prompt`: only what follows it is prefilled.",
    )(f)


def load_prompt_cache(path: str | None, runtime, template):
    """The saved prefix at `path` for this run (None without one), checked to belong to it."""
    if path is None:
        return None
    from .prompt_files import load

    return load(path, runtime, template)


def kv_size_options(f):
    options = [
        click.option("--max-kv-size", type=int, default=0, metavar="N",
                     help="Bound the KV cache to N positions: the first --keep and the last ones; the chat or"
                          " generation may then run past the context (0: off)."),
        click.option("--keep", type=int, default=4, show_default=True, metavar="N",
                     help="With --max-kv-size: the first positions always kept (BOS, the start of a system prompt)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def speculation_options(f):
    options = [
        click.option("--draft-model", metavar="GGUF", type=click.Path(dir_okay=False),
                     help="Speculative decoding: a smaller model of the same vocabulary drafts, the model checks."),
        click.option("--lookup", type=int, default=None, metavar="N",
                     help="Speculative decoding by prompt lookup: draft what followed the last N-gram before."),
        click.option("--draft-tokens", type=int, default=4, show_default=True, metavar="K",
                     help="Tokens drafted and checked at a time."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def load_draft(draft_model: str | None, lookup: int | None):
    """What drafts for Runtime.stream: a loaded model, an n-gram length, or None."""
    if draft_model and lookup is not None:
        raise MlxLlamaError("--draft-model and --lookup exclude each other: give one drafter")
    if draft_model:
        from .runtime import load

        return load(draft_model, dtype=dtype_requested(), dequantize=dequantize_requested(),
                    context_length=context_requested())
    return lookup
