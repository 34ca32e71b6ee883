"""The `mlxllama` command line: its commands (their shared options are in cli_options.py)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict
from typing import Callable, Iterator

import click

from .cli_options import (check_no_template, constraint_options, context_option, context_requested, default_model_path,
                          dequantize_requested, dtype_requested, kv_cache_options, kv_quantization_requested,
                          kv_size_options, load_draft, load_model, load_prompt_cache, model_option, parallel_options,
                          parallel_requested, parse_template_kwargs, precision_options, prompt_cache_option,
                          refuse_stdin, refuse_under_launch, remember, requested_constraint, sampling_options,
                          sampling_params, speculation_options, template_options)
from .distributed import barrier, launched, lost_peer, share, world
from .errors import MlxLlamaError, count
from .files import STDOUT, CheckedStream, WriteError, check_output_dir


class Main(click.Group):
    """Turns user-fixable problems into one line on stderr and exit code 2, Ctrl-C into exit code 130.

    Usage errors (a missing or malformed option, an unknown command) are one line naming the
    option too, not click's usage block; standard output goes through a CheckedStream, so a full
    disk or a closed terminal there is the same one-line error as for any file.
    """

    def main(self, args=None, prog_name=None, **extra):
        try:
            return super().main(args, "mlxllama", standalone_mode=False, **extra)
        except click.UsageError as e:
            command = e.ctx.command_path if e.ctx else "mlxllama"
            fail(f"{' '.join(e.format_message().split())} (see '{command} --help')")
        except click.ClickException as e:
            fail(" ".join(e.format_message().split()), e.exit_code)
        except click.Abort:
            click.echo("\nmlxllama: interrupted", err=True)
            sys.exit(130)

    def invoke(self, ctx):
        if launched():
            prepare_launched_rank()
        stdout = sys.stdout
        sys.stdout = CheckedStream(stdout, STDOUT)
        try:
            try:
                launch_check(ctx._protected_args[0] if ctx._protected_args else None)  # the command to run
                result = super().invoke(ctx)
                barrier()  # no rank leaves while another still exchanges with it
                return result
            finally:
                sys.stdout.flush()  # here, so that a full disk is reported, not met again at exit
        except MlxLlamaError as e:
            if isinstance(e, WriteError) and e.path == STDOUT:
                silence_stdout()
            fail(str(e)) if world().is_root else follower_fails(str(e))
        except RuntimeError as e:
            lost = lost_peer(e)
            if lost is None:
                raise
            fail(str(lost))
        except KeyboardInterrupt:
            click.echo("\nmlxllama: interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:
            # The reader went away (e.g. `| head`); stop quietly rather than raise again at exit.
            silence_stdout()
            sys.exit(0)
        finally:
            if isinstance(sys.stdout, CheckedStream):
                sys.stdout = stdout


def fail(message: str | None, code: int = 2) -> None:
    if message is not None:
        # A follower rank's stderr goes nowhere (Main.invoke), but its own fatal error is worth a line.
        click.echo(f"mlxllama: error: {message}", file=sys.stderr if world().is_root else sys.__stderr__)
    sys.exit(code)


# The commands that run under mlx.launch; the others read or write per-process state (a saved
# prompt cache, a trace's dumps) that a split model does not have yet.
LAUNCHED_COMMANDS = ("generate", "chat", "batch", "serve", "bench", "perplexity")


def launch_check(command: str | None) -> None:
    if launched() and command not in (None, *LAUNCHED_COMMANDS):
        raise MlxLlamaError(f"mlxllama {command} does not run under mlx.launch (these do: {', '.join(LAUNCHED_COMMANDS)})")


# How long a rank other than 0 holds back a user's error: every rank usually meets the same one,
# and rank 0 says it; the others say theirs only if mlx.launch has not stopped them by then.
FOLLOWER_ERROR_GRACE_SECONDS = 2.0


def prepare_launched_rank() -> None:
    """Under mlx.launch: rank 0 alone writes, and mlx.launch's SIGTERM (it stops the other ranks
    when one fails) ends a rank with one line, not a traceback."""
    signal.signal(signal.SIGTERM, lambda *_: fail(f"rank {world().rank}: stopped by SIGTERM"
                                                  " (under mlx.launch: another rank ended)", 143))
    if not world().is_root:
        silence_stdout()
        sys.stderr = open(os.devnull, "w")


def follower_fails(message: str) -> None:
    """A user's error on a rank other than 0: said after a grace period, unless rank 0 failed too
    (then mlx.launch stops this rank quietly first), so that the line comes once, from rank 0."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(2))
    time.sleep(FOLLOWER_ERROR_GRACE_SECONDS)
    fail(f"rank {world().rank}: {message}")


def silence_stdout() -> None:
    """Point standard output at /dev/null, so that what is still buffered for it is dropped at exit
    instead of failing again there."""
    sys.stdout = open(os.devnull, "w")
    try:
        os.dup2(sys.stdout.fileno(), sys.__stdout__.fileno())
    except (AttributeError, OSError, ValueError):  # no real file descriptor (a test's captured output)
        pass


@click.group(cls=Main)
@click.version_option(package_name="mlxllama")
def main():
    """Run GGUF language models on MLX, with chat templates applied explicitly."""


def fit_prompt(runtime, ids: list[int], max_tokens: int, truncate: bool) -> list[int]:
    """The prompt ids to feed: unchanged, cut by --truncate's policy, or an error when too long for the context."""
    from .generate import check_fits, truncate_prompt

    context = runtime.config.context_length
    if not truncate:
        check_fits(len(ids), context, "; shorten it or pass --truncate to drop its start")
        return ids
    kept = truncate_prompt(ids, context, max_tokens, runtime.tokenizer.bos_id)
    if len(kept) < len(ids):
        click.echo(f"[prompt truncated: dropped {len(ids) - len(kept)} of its {count(len(ids), 'token')} from the start,"
                   f" kept {len(kept)} of the context's {context}]", err=True)
    return kept


def print_prompt(prompt) -> None:
    click.echo(f"--- prompt (template: {prompt.template}) ---", err=True)
    click.echo(prompt.text, err=True)
    click.echo(f"--- {len(prompt.ids)} token ids ---", err=True)
    click.echo(" ".join(map(str, prompt.ids)), err=True)


@main.command()
@model_option
@precision_options
@context_option
@kv_cache_options
@click.option("--prompt", "-p", "prompt_text", required=True, help="The prompt ('-' reads it from stdin).")
@template_options
@click.option("--compare-template", is_flag=True, help="Run with and without the template, same settings and seed.")
@click.option("--truncate", is_flag=True,
              help="Cut a prompt too long for the context: keep BOS and its last tokens, leaving room to reply.")
@sampling_options
@constraint_options
@prompt_cache_option
@kv_size_options
@speculation_options
@parallel_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def generate(model_path, prompt_text, no_template, template_name, template_file, template_kwargs, system,
             show_prompt, compare_template, truncate, prompt_cache_file, max_kv_size, keep, draft_model, lookup,
             draft_tokens, as_json, **sampling):
    """Generate a continuation of a prompt (with the model's chat template unless --no-template).

    \b
    mlxllama generate -p "What is the capital of Japan?"
    mlxllama generate -p "The capital of Italy is" --no-template -n 8
    mlxllama generate -p "What is 17 plus 25?" --compare-template --json
    mlxllama generate -p "Name a city." --json-schema '{"type": "object", "properties": {"city": {"type": "string"}}}'
    """
    from .prompt import NO_TEMPLATE, build_prompt, choose_template, messages_for

    refuse_under_launch(prompt_cache=prompt_cache_file, draft_model=draft_model, lookup=lookup)
    if prompt_text == "-":
        refuse_stdin()
        prompt_text = sys.stdin.read()
    check_no_template(no_template, system, compare_template, template_name, template_file)
    if compare_template and prompt_cache_file:
        raise MlxLlamaError("--compare-template and --prompt-cache exclude each other: a cached prefix holds one template")
    if max_kv_size and (prompt_cache_file or truncate):
        raise MlxLlamaError("--max-kv-size excludes --prompt-cache and --truncate")
    kwargs = parse_template_kwargs(template_kwargs)
    params = sampling_params(sampling)
    constraint = requested_constraint()
    runtime = load_model(model_path)
    if constraint is not None:
        constraint.check(runtime.tokenizer)
    draft = load_draft(draft_model, lookup)
    messages = messages_for(prompt_text, system)
    template = choose_template(runtime.chat_template, template_name, template_file, no_template)
    saved = load_prompt_cache(prompt_cache_file, runtime, template)
    runs = [template, NO_TEMPLATE] if compare_template else [template]
    results = []
    for run_template in runs:
        prompt = build_prompt(runtime.tokenizer, run_template, messages, kwargs)
        if show_prompt:
            print_prompt(prompt)
        ids = prompt.ids if max_kv_size else fit_prompt(runtime, prompt.ids, sampling["max_tokens"], truncate)
        if saved is not None:
            saved.check_starts(ids)
        stream = runtime.stream(ids, sampling["max_tokens"], params, sampling["stop"], constraint=constraint,
                                prompt_cache=saved.store() if saved is not None else None, max_kv_size=max_kv_size,
                                keep=keep, draft=draft, draft_tokens=draft_tokens)
        if saved is not None:
            click.echo(f"[prompt cache: {stream.cached_tokens} of the prompt's {count(len(ids), 'token')} from"
                       f" {prompt_cache_file}]", err=True)
        if not as_json:
            if compare_template:
                click.echo(f"=== {'template: ' + prompt.template if run_template.text else 'no template'} ===")
            for piece in stream:
                click.echo(piece, nl=False)
                sys.stdout.flush()
            click.echo()
            if not stream.result.text:
                why = "its first token ended the reply" if stream.result.finish_reason == "stop" else "no room to reply"
                click.echo(f"[no text: {why}]", err=True)
            if stream.result.drafted:
                from .speculative import acceptance_note

                click.echo(acceptance_note(stream.result.drafted, stream.result.accepted), err=True)
        else:
            stream.run()
        results.append({"model": runtime.path, "template": prompt.template, "prompt": prompt.text,
                        **stream.result.to_dict(), "cached_tokens": stream.cached_tokens})
    if as_json:
        payload = results[0] if not compare_template else {"with_template": results[0], "without_template": results[1]}
        click.echo(json.dumps(payload, ensure_ascii=False))


@main.command("cache-prompt")
@model_option
@precision_options
@context_option
@kv_cache_options
@click.option("--prompt", "-p", "prompt_text", help="The text to cache: the start of later prompts ('-' reads stdin).")
@click.option("--file", "-f", "prompt_file", type=click.Path(dir_okay=False), help="Read the text to cache from a file.")
@click.option("--no-template", is_flag=True, help="Cache the raw text, with BOS if the file asks for one.")
@click.option("--template", "template_name", metavar="NAME", help="Use a built-in chat template.")
@click.option("--template-file", type=click.Path(dir_okay=False), help="Use the chat template in this file.")
@click.option("--template-kwargs", metavar="JSON", help="Extra template variables, as a JSON object.")
@click.option("--system", metavar="TEXT", help="System message; alone, it is what is cached (for chat).")
@click.option("--out", "-o", "out_path", required=True, metavar="FILE", help="Where to save it (safetensors).")
def cache_prompt(model_path, prompt_text, prompt_file, no_template, template_name, template_file, template_kwargs,
                 system, out_path):
    """Save the keys and values of a prompt's start, for --prompt-cache on generate, chat and batch.

    With a template, what is cached is the rendered prompt up to the end of the text (the first
    user message), so prompts that start with the text reuse it; with --system alone, the rendered
    system prompt, for chat.

    
    mlxllama cache-prompt -m model.gguf --file report.txt -o report.safetensors
    mlxllama generate -m model.gguf -p "$(cat report.txt) Summarize it." --prompt-cache report.safetensors
    mlxllama cache-prompt --system "$(cat manual.txt)" -o manual.safetensors
    mlxllama chat --system "$(cat manual.txt)" --prompt-cache manual.safetensors
    """
    from .prompt import choose_template, messages_for
    from .prompt_files import prefix_ids, save

    given = [text for text in (prompt_text, prompt_file) if text is not None]
    if len(given) > 1 or not given and not system:
        raise MlxLlamaError("give the text to cache: -p TEXT or --file FILE (or --system alone)")
    check_no_template(no_template, system, False, template_name, template_file)
    kwargs = parse_template_kwargs(template_kwargs)
    if prompt_text == "-":
        prompt_text = sys.stdin.read()
    elif prompt_file is not None:
        from .cli_options import read_text

        prompt_text = read_text(prompt_file, "--file")
    if os.path.isdir(out_path):
        raise MlxLlamaError(f"--out {out_path} is a directory")
    check_output_dir(os.path.dirname(os.path.abspath(out_path)))
    runtime = load_model(model_path)
    template = choose_template(runtime.chat_template, template_name, template_file, no_template)
    if prompt_text is None:  # the system prompt alone; a user message follows it in every conversation
        messages, anchor = messages_for("", system), system
    else:
        messages, anchor = messages_for(prompt_text, system), prompt_text
    ids = prefix_ids(runtime.tokenizer, template, messages, kwargs, anchor)
    size = save(out_path, runtime, template, ids, anchor)
    click.echo(f"cached {count(len(ids), 'token')} (template: {template.label}) in {out_path}, {size / 2**20:.1f} MiB",
               err=True)


@main.command("inspect")
@click.argument("model_path", metavar="MODEL", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect_command(model_path, as_json):
    """Describe a GGUF file without loading its weights: architecture, parameters, context length,
    tokenizer and special tokens, chat template, tensor types and sizes.

    \b
    mlxllama inspect model.gguf
    mlxllama inspect model.gguf --json
    """
    from .model_info import describe, format_text

    info = describe(model_path)
    click.echo(json.dumps(info, ensure_ascii=False) if as_json else format_text(info))


@main.command()
@model_option
@precision_options
@context_option
@kv_cache_options
@click.option("--template", "template_name", metavar="NAME", help="Use a built-in chat template.")
@click.option("--template-file", type=click.Path(dir_okay=False), help="Use the chat template in this file.")
@click.option("--template-kwargs", metavar="JSON", help="Extra template variables, as a JSON object.")
@click.option("--system", metavar="TEXT", help="System message.")
@sampling_options
@prompt_cache_option
@kv_size_options
@speculation_options
@parallel_options
def chat(model_path, template_name, template_file, template_kwargs, system, prompt_cache_file, max_kv_size, keep,
         draft_model, lookup, draft_tokens, **sampling):
    """Chat with a model; the conversation stays in the KV cache between turns.

    Reads one message per line from a pipe too:

    \b
    mlxllama chat
    printf 'What is the capital of Japan?\\nWhat is 17 plus 25?\\n' | mlxllama chat
    """
    from .chat import ChatSession
    from .chat_repl import run_chat
    from .prompt import choose_template

    refuse_under_launch(prompt_cache=prompt_cache_file, draft_model=draft_model, lookup=lookup)
    check_no_template(False, system, False, template_name, template_file)
    kwargs = parse_template_kwargs(template_kwargs)
    runtime = load_model(model_path)
    template = choose_template(runtime.chat_template, template_name, template_file)
    if max_kv_size and prompt_cache_file:
        raise MlxLlamaError("--max-kv-size excludes --prompt-cache")
    params = sampling_params(sampling)
    session = ChatSession(runtime, template, system, params, sampling["max_tokens"],
                          sampling["stop"], kwargs, notify=lambda message: click.echo(f"[{message}]", err=True),
                          max_kv_size=max_kv_size, keep=keep,
                          speculation=runtime.speculation(load_draft(draft_model, lookup), params, draft_tokens,
                                                          max_kv_size, keep))
    saved = load_prompt_cache(prompt_cache_file, runtime, template)
    if saved is not None:
        # The conversation starts with its system prompt: the cached prefix must be that.
        from .prompt import build_prompt, messages_for

        saved.check_starts(build_prompt(runtime.tokenizer, template, messages_for("", system), kwargs).ids)
        saved.store(into=session.prompt_cache)
    sys.exit(run_chat(session, sys.stdin))


@contextmanager
def batch_progress(jobs: int) -> Iterator[Callable[[], None]]:
    """run_batch's progress: a bar on stderr, when it is a terminal, advanced as each job is written."""
    if not sys.stderr.isatty():
        yield lambda: None
        return
    with click.progressbar(length=jobs, label="batch", file=sys.stderr) as bar:
        yield lambda: bar.update(1)


@main.command()
@model_option
@precision_options
@context_option
@kv_cache_options
# Lazy: under mlx.launch only rank 0 opens it (the other machines need not have it).
@click.argument("prompts_file", metavar="PROMPTS", type=click.File("r", encoding="utf-8", lazy=True))
@click.option("--out", "-o", "out_path", default="-", show_default=True, metavar="FILE",
              help="Results, a JSON line per prompt ('-': stdout). An existing file is resumed: its ids are skipped.")
@click.option("--text", "text_input", is_flag=True, help="PROMPTS is plain text, one prompt per line.")
@click.option("--batch-size", "-b", default=8, show_default=True, type=click.IntRange(1), help="Sequences decoded together.")
@click.option("--no-template", is_flag=True, help="Feed raw prompts, with BOS if the file asks for one (a line may override).")
@click.option("--template", "template_name", metavar="NAME", help="Use a built-in chat template (lines may override).")
@click.option("--template-file", type=click.Path(dir_okay=False), help="Use the chat template in this file.")
@click.option("--template-kwargs", metavar="JSON", help="Extra template variables, as a JSON object.")
@click.option("--system", metavar="TEXT", help="System message for lines without one.")
@click.option("--compare-template", is_flag=True, help="Run each prompt with and without its template.")
@sampling_options
@constraint_options
@prompt_cache_option
@kv_size_options
@speculation_options
@parallel_options
@click.option("--data-parallel", is_flag=True, callback=remember,
              help="Under mlx.launch: every process holds the whole model and runs a share of the lines (instead of"
                   " splitting the model).")
@click.option("--summary", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True,
              help="Format of the summary printed to stderr at the end.")
def batch(model_path, prompts_file, out_path, text_input, batch_size, no_template, template_name, template_file,
          template_kwargs, system, compare_template, prompt_cache_file, max_kv_size, keep, draft_model, lookup,
          draft_tokens, data_parallel, summary, **sampling):
    """Run every prompt of a JSONL file (or '-' for stdin) with batched decoding; write results in input order.

    Each line is a JSON object: "prompt" or "messages", and optionally "id" (default: the line
    number), "max_tokens", "temperature", "seed", "system", "template", "no_template", "stop",
    and one constraint ("json_schema": a schema, "json_object": true, "regex", "grammar"),
    which override the options. Bad lines are reported with their line number and skipped.
    Exit code: 0, or 2 if any line was bad, or 130 after Ctrl-C; run again to resume.

    \b
    mlxllama batch prompts.jsonl --out results.jsonl
    printf 'What is 17 plus 25?\\nMy name is Zoe.\\n' | mlxllama batch --text - -n 32
    """
    from .batch_jobs import BatchSettings, results_output, run_batch
    from .cache import check_kv_size
    from .prompt import choose_template

    refuse_under_launch(prompt_cache=prompt_cache_file, draft_model=draft_model, lookup=lookup)
    if data_parallel and not launched():
        raise MlxLlamaError("--data-parallel spreads the lines over the processes of mlx.launch:"
                            " run `mlx.launch -n 2 -- mlxllama batch --data-parallel ...`")
    check_no_template(no_template, system, compare_template, template_name, template_file)
    check_kv_size(max_kv_size, keep, kv_quantization_requested())
    if max_kv_size and prompt_cache_file:
        raise MlxLlamaError("--max-kv-size excludes --prompt-cache")
    kwargs = parse_template_kwargs(template_kwargs)
    params = sampling_params(sampling)
    constraint = requested_constraint()
    source = "<stdin>" if prompts_file.name == "-" else prompts_file.name
    if source == "<stdin>":
        refuse_stdin()
    output = results_output(out_path, None if source == "<stdin>" else source) if world().is_root else discard()
    with output as (done, out):
        if launched():  # rank 0 read them; the others run the same jobs, or their share of them
            done, prompts_file = set(share(sorted(done))), share(list(prompts_file) if world().is_root else None)
        runtime = load_model(model_path)
        if constraint is not None:
            constraint.check(runtime.tokenizer)
        template = choose_template(runtime.chat_template, template_name, template_file, no_template)
        if compare_template and prompt_cache_file:
            raise MlxLlamaError("--compare-template and --prompt-cache exclude each other: a cached prefix holds one"
                                " template")
        saved = load_prompt_cache(prompt_cache_file, runtime, template)
        draft = load_draft(draft_model, lookup)
        settings = BatchSettings(template, system, kwargs, params, sampling["max_tokens"], sampling["stop"],
                                 compare_template, constraint, saved, max_kv_size, keep,
                                 runtime.drafting(draft, draft_tokens) if draft is not None else None)
        stats = run_batch(runtime, prompts_file, source, out, done, settings,
                          lambda message: click.echo(message, err=True), batch_progress, text_input, batch_size,
                          data_parallel)
    click.echo(stats.summary(summary), err=True)
    if stats.interrupted:
        where = "written to stdout" if out_path == "-" else f"in {out_path}; run the same command again to resume"
        click.echo(f"mlxllama: interrupted: {stats.done} of {stats.prompts} prompts done, {where}", err=True)
        sys.exit(130)
    sys.exit(2 if stats.errors else 0)


@contextmanager
def discard() -> Iterator[tuple[set[str], object]]:
    """A follower rank's stand-in for results_output: rank 0 alone writes the results file."""
    with open(os.devnull, "w") as out:
        yield set(), out


@main.command("serve")
@model_option
@precision_options
@context_option
@kv_cache_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; one reachable from other machines needs --api-key.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--api-key", metavar="KEY", envvar="MLXLLAMA_API_KEY",
              help="Require 'Authorization: Bearer KEY' on every request (or $MLXLLAMA_API_KEY).")
@click.option("--max-batch", default=16, show_default=True, type=click.IntRange(1),
              help="Most requests decoded together; more wait for a free row.")
@click.option("--kv-budget-mb", type=click.IntRange(1), default=None, metavar="MB",
              help="KV cache memory the running requests may hold; more wait (default: half the GPU's memory,"
                   " or a quarter of the machine's).")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(0),
              help="Requests that may wait for room; past that, HTTP 503 with Retry-After.")
@click.option("--prompt-cache-mb", default=512, show_default=True, type=click.IntRange(0),
              help="Keys and values of past prompts and replies kept for requests that start the same way"
                   " (least recently used out; 0: none).")
@click.option("--prefill-chunk", default=512, show_default=True, type=click.IntRange(1),
              help="Prompt tokens a newcomer's prefill feeds between two decode steps of the running requests.")
@click.option("--template", "template_name", metavar="NAME", help="Use a built-in chat template for chat requests.")
@click.option("--template-file", type=click.Path(dir_okay=False), help="Use the chat template in this file.")
@click.option("--no-webui", is_flag=True, help="Serve the API only, not the chat page at /.")
@click.option("--engine", "engine_kind", type=click.Choice(["process", "thread"]), default=None,
              help="Run the model in a process of its own, so that the HTTP side and the engine never wait for"
                   " each other's interpreter (the default on a GPU), or in a thread of the server's process (the"
                   " default on the CPU and under mlx.launch; docs/server.md).")
@kv_size_options
@speculation_options
@sampling_options
@parallel_options
def serve_command(model_path, host, port, api_key, max_batch, kv_budget_mb, max_queue, prompt_cache_mb, prefill_chunk,
                  template_name, template_file, no_webui, engine_kind, max_kv_size, keep, draft_model, lookup,
                  draft_tokens, **sampling):
    """Serve the model over HTTP with an OpenAI-compatible API (docs/server.md).

    Chat requests get the chat template explicitly (a request may pick another with "chat_template",
    or "none"); /v1/completions feeds the raw prompt. The sampling options are the defaults a
    request's own fields override. On CUDA it turns MLX's CUDA graphs off (MLX_USE_CUDA_GRAPHS=0)
    unless the environment sets that variable: bursts of requests get their first tokens sooner.

    \b
    mlxllama serve -m model.gguf --port 8080
    curl http://127.0.0.1:8080/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'
    """
    from .cache import check_kv_size
    from .prompt import choose_template
    from .server import DRAFT_ROOM, check_listen, default_engine, launch_without_cuda_graphs, serve

    try:
        from .server.app import ServerSettings
    except ImportError as e:
        raise MlxLlamaError(f"mlxllama serve needs {e.name}: pip install \"mlxllama[serve]\"") from None

    check_no_template(False, None, False, template_name, template_file)
    check_kv_size(max_kv_size, keep, kv_quantization_requested())
    refuse_under_launch(draft_model=draft_model, lookup=lookup)
    if engine_kind == "process" and launched():
        raise MlxLlamaError("--engine process is not supported under mlx.launch: a split model's engine runs in"
                            " rank 0's thread")
    engine_kind = engine_kind or default_engine()
    params = sampling_params(sampling)
    if world().is_root:
        check_listen(host, port, api_key)
    launch_without_cuda_graphs()
    engine_options = dict(max_batch=max_batch, prefill_chunk=prefill_chunk,
                          kv_budget=kv_budget_mb << 20 if kv_budget_mb else None,
                          prompt_cache_bytes=prompt_cache_mb << 20, max_kv_size=max_kv_size, keep=keep,
                          draft_room=max(draft_tokens, DRAFT_ROOM))
    if engine_kind == "process":
        from .server.engine_process import EngineProcess

        model, spec, drafting = engine_process_spec(model_path, draft_model, lookup, draft_tokens, engine_options)
        template = choose_template(model.chat_template, template_name, template_file)  # its errors first
        engine = EngineProcess(spec, max_queue)
    else:
        model = load_model(model_path)
        draft = load_draft(draft_model, lookup)
        if not world().is_root:  # rank 0 serves; this rank runs its part of the model as rank 0's engine says
            from .server.engine import make_decoder
            from .server.replicas import follow

            follow(make_decoder(model, max_batch, prefill_chunk, prompt_cache_mb << 20, max_kv_size, keep))
            sys.exit(0)  # rank 0 has gone (serve ends its process at once): no barrier to meet
        if prompt_cache_mb and model.model.shard and model.model.shard.mode == "pipeline":
            click.echo("[prompt cache off: a pipeline's ranks hold caches of different sizes]", err=True)
        from .server.engine import Engine

        template = choose_template(model.chat_template, template_name, template_file)
        engine = Engine(model, max_queue=max_queue, **engine_options)
        drafting = model.drafting(draft, draft_tokens) if draft is not None else None
    settings = ServerSettings(template, params, sampling["max_tokens"], api_key or None, drafting)
    serve(model, engine, settings, host, port,
          on_ready=lambda url: click.echo(f"mlxllama serve: {os.path.basename(model.path)} on {url}"
                                          f" (template {settings.template.label}){'' if no_webui else ', chat page at /'};"
                                          " Ctrl-C stops", err=True),
          webui=not no_webui)


def engine_process_spec(model_path, draft_model, lookup, draft_tokens, engine_options):
    """serve --engine process: the file read here without its weights, what the engine's process is
    to load and run, and how requests are drafted for (a draft model's vocabulary checked here)."""
    from .runtime import load_tokenizer, read_model_file
    from .server.engine_process import ENGINE_DRAFT_MODEL, EngineSpec
    from .speculative import Drafting, check_same_vocabulary

    parallel_requested()  # its one-line error for --pipeline and the like outside mlx.launch
    drafting = None
    if draft_model or lookup is not None:  # Drafting checks the options as load_draft and Runtime.drafting do
        drafting = Drafting(draft_tokens, lookup=lookup, model=ENGINE_DRAFT_MODEL if draft_model else None)
    context_length = context_requested()
    model = read_model_file(model_path or default_model_path(), context_length)
    if draft_model:
        check_same_vocabulary(load_tokenizer(draft_model), model.tokenizer, draft_model)
    spec = EngineSpec(model.path, dequantize_requested(), dtype_requested(), context_length,
                      kv_quantization_requested(), draft_model, draft_tokens, engine_options)
    return model, spec, drafting


@main.command("bench")
@model_option
@click.option("--synthetic", metavar="NAME",
              help="Benchmark a generated file with a model's exact layout (tinyllama-1.1b, qwen3-0.6b, llama-3-8b, chat-tiny), written to"
                   " --model if given (an existing file there is reused), else to a temporary file; written for a"
                   " longer context than the model's where --depth needs one.")
@click.option("--quant", default="Q4_K_M", show_default=True, help="Quantization mix of --synthetic.")
@click.option("--n-prompt", "-p", default=512, show_default=True, help="Prompt tokens for pp (0 skips it).")
@click.option("--n-gen", "-n", default=128, show_default=True, help="Generated tokens for tg (0 skips it).")
@click.option("--batch", "-b", "batches", default="1", show_default=True, metavar="LIST",
              help="Comma-separated numbers of sequences decoded together in tg.")
@click.option("--repetitions", "-r", default=5, show_default=True, help="Timed runs of each test, after a warm-up.")
@click.option("--depth", "-d", "depths", default="0", show_default=True, metavar="LIST",
              help="Comma-separated numbers of positions each sequence's cache holds before pp and tg (llama-bench's -d).")
@precision_options
@context_option
@kv_cache_options
@constraint_options
@speculation_options
@click.option("--draft-prompt", metavar="TEXT", help="With --lookup or --draft-model: the raw prompt the tg tests start"
              " from (a copy task for lookup).")
@parallel_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def bench_command(model_path, synthetic, quant, n_prompt, n_gen, batches, repetitions, depths, draft_model, lookup,
                  draft_tokens, draft_prompt, as_json):
    """Prompt (pp) and generation (tg) tokens/s, load time and memory, in the style of llama-bench.

    \b
    mlxllama bench -m model.gguf -p 512 -n 128 -b 1,8,16
    mlxllama bench --synthetic tinyllama-1.1b --quant Q4_K_M --json
    mlxllama bench -p 0 -n 128 --json-schema benchmarks/long-array.schema.json
    mlxllama bench --synthetic tinyllama-1.1b -d 0,8192 --kv-bits 8
    mlxllama bench --synthetic qwen3-0.6b -p 512 -n 128
    """
    import tempfile

    from . import bench, synthetic as synthetic_models

    batch_sizes, depth_list = integer_list(batches, "--batch"), integer_list(depths, "--depth")
    if min(batch_sizes) < 1 or repetitions < 1 or n_prompt < 0 or n_gen < 0 or min(depth_list) < 0:
        raise MlxLlamaError("--batch and --repetitions must be at least 1, -p, -n and --depth at least 0")
    with tempfile.TemporaryDirectory() as scratch:
        if synthetic:
            in_scratch = model_path is None
            model_path = model_path or os.path.join(scratch, f"{synthetic}-{quant}.gguf")
            # Under mlx.launch each rank writes its own scratch copy; a file named by -m, rank 0
            # alone while the others wait.
            if not os.path.exists(model_path) and (in_scratch or world().is_root):
                # Written for the deepest test where the model's own context is too short for it
                # (random weights do not mind).
                positions = max(depth_list) + max(n_prompt, n_gen + 1)
                synthetic_models.write(model_path, synthetic, quant,
                                       context=synthetic_models.context_for(synthetic, positions))
            if not in_scratch:
                barrier()
        report = bench.run(model_path or default_model_path(), n_prompt, n_gen, batch_sizes, repetitions,
                           dequantize=dequantize_requested(), dtype=dtype_requested(),
                           context_length=context_requested(), constraint=requested_constraint(),
                           draft=draft_model or lookup, draft_tokens=draft_tokens,
                           draft_prompt=draft_prompt, depths=depth_list, kv_quantization=kv_quantization_requested(),
                           parallel=parallel_requested())
    click.echo(json.dumps(report.to_dict()) if as_json else bench.format_table(report))


def integer_list(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise MlxLlamaError(f"{option}: expected comma-separated integers, got {text!r}") from None


@main.command("trace")
@model_option
@precision_options
@context_option
@click.option("--prompt", "-p", "prompt_text", help="The prompt ('-' reads it from stdin).")
@template_options
@click.option("--steps", default=1, show_default=True,
              help="Forward passes: the prompt, then each greedy token fed back (each predicts one token).")
@click.option("--top-k", "top_k", default=5, show_default=True, help="Likeliest next tokens shown after each pass.")
@click.option("--plot", "plot_path", metavar="FILE", help="With --compare: every layer's error at every position,"
              " as a heatmap; with --attention: a head's weights (--plot-head). .png, .svg or .html; needs"
              ' matplotlib (pip install "mlxllama[plot]").')
@click.option("--plot-head", default="0.0", show_default=True, metavar="LAYER.HEAD",
              help="With --attention --plot: the head whose prompt weights are drawn (with --compare, from the"
                   " dumps that hold them: trace --attention --dump).")
@click.option("--attention", is_flag=True,
              help="Attend through an explicit softmax and report each head's: entropy, largest weight and its"
                   " position, weight on BOS and on the last 16 positions; collapsed heads; positions a layer cannot see.")
@click.option("--dump", "dump_dir", metavar="DIR", type=click.Path(file_okay=False),
              help="Write every layer's hidden states to DIR as .npy files (format: see above).")
@click.option("--compare", nargs=2, metavar="DIR_A DIR_B", type=click.Path(file_okay=False, exists=True),
              help="Compare two dumps instead of running a model; exit code 1 if they diverge.")
@click.option("--tolerance", default=0.1, show_default=True,
              help="--compare: the largest relative error ||a - b|| / ||b|| of one position's hidden state.")
@click.option("--requantized", is_flag=True,
              help="Run Q2_K and Q6_K matrices re-quantized to 8 bits, as generate does; by default trace holds"
                   " them at the file's values (expanded), so a comparison with an exact reference shows only real"
                   " divergence.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the text report.")
def trace_command(model_path, prompt_text, no_template, template_name, template_file, template_kwargs, system,
                  show_prompt, steps, top_k, plot_path, plot_head, attention, dump_dir, compare, tolerance,
                  requantized, as_json):
    """Show what each layer computes: RMS, min, max and mean of its attention output, MLP output and
    residual stream, then the position, cache length and top-k next tokens of each pass.

    \b
    mlxllama trace -p "The capital of Italy is" --no-template --steps 3
    mlxllama trace -p "What is 17 plus 25?" --dump ours/
    mlxllama trace --compare ours/ theirs/ --tolerance 0.01

    A dump is DIR/meta.json ({"token_ids": [...], ...}) and one float32 .npy of shape
    [positions, hidden] per tensor: embd.npy, then layer_000_attn.npy, layer_000_mlp.npy,
    layer_000_resid.npy, ... (module mlxllama.trace documents it). --compare checks A against B
    position by position, in the order the model computes, and reports the first layer and
    position whose error is over the tolerance. Exit code: 0 same, 1 diverging, 2 error.
    """
    from . import trace
    from .prompt import build_prompt, choose_template, messages_for

    if compare:
        if prompt_text is not None or dump_dir:
            raise MlxLlamaError("--compare takes two dump directories, not --prompt or --dump")
        comparison = trace.compare_dumps(compare[0], compare[1], tolerance)
        if plot_path:
            from .trace_plot import plot_comparison

            plot_comparison(comparison, *compare, plot_path, parse_head(plot_head) if attention else None)
        click.echo(json.dumps(asdict(comparison)) if as_json else trace.format_comparison(comparison, *compare))
        sys.exit(1 if comparison.diverged else 0)
    if prompt_text is None:
        raise MlxLlamaError("trace needs --prompt (or --compare DIR_A DIR_B)")
    if steps < 1 or top_k < 1:
        raise MlxLlamaError("--steps and --top-k must be at least 1")
    if plot_path and not attention:
        raise MlxLlamaError("--plot draws a comparison (with --compare) or attention weights (with --attention)")
    if plot_path:
        from .trace_plot import check_plot_path, pyplot

        check_plot_path(plot_path)
        pyplot()  # the missing extra is said before the model loads
    if prompt_text == "-":
        prompt_text = sys.stdin.read()
    check_no_template(no_template, system, False, template_name, template_file)
    if dump_dir:
        check_output_dir(dump_dir)
    kwargs = parse_template_kwargs(template_kwargs)
    runtime = load_model(model_path, requantize=requantized)
    template = choose_template(runtime.chat_template, template_name, template_file, no_template)
    prompt = build_prompt(runtime.tokenizer, template, messages_for(prompt_text, system), kwargs)
    if show_prompt:
        print_prompt(prompt)
    result = trace.trace(runtime.model, runtime.tokenizer, prompt.ids, runtime.new_cache(), steps, top_k,
                         keep_hidden=bool(dump_dir), attention=attention)
    if dump_dir:
        trace.write_dump(dump_dir, result, len(prompt.ids), runtime.path, runtime.model)
    if plot_path:
        from .trace_plot import plot_attention

        layer, head = parse_head(plot_head, [w.shape[0] for w in result.prompt_weights])
        plot_attention(result.prompt_weights[layer][head], layer, head, plot_path)
    if as_json:
        click.echo(json.dumps({"model": runtime.path, "template": prompt.template, "prompt_ids": prompt.ids,
                               "passes": [asdict(p) for p in result.passes]}, ensure_ascii=False))
        return
    click.echo(f"model {runtime.path}, template {prompt.template}, prompt of {count(len(prompt.ids), 'token')}")
    for number, one_pass in enumerate(result.passes, 1):
        click.echo(trace.format_pass(number, one_pass, runtime.tokenizer))
    if dump_dir:
        click.echo(f"dump: {dump_dir} ({len(result.token_ids)} positions)")


def parse_head(text: str, heads: list[int] | None = None) -> tuple[int, int]:
    """--plot-head LAYER.HEAD, checked against the model's layers and their heads where known."""
    try:
        layer, head = (int(part) for part in text.split("."))
    except ValueError:
        raise MlxLlamaError(f"--plot-head: expected LAYER.HEAD (e.g. 3.5), got {text!r}") from None
    if heads is not None and (not 0 <= layer < len(heads) or not 0 <= head < heads[layer]):
        raise MlxLlamaError(f"--plot-head {text}: the model has {len(heads)} layers of {heads[0]} heads")
    return layer, head


@main.command("perplexity")
@model_option
@precision_options
@kv_cache_options
@click.argument("text_path", metavar="FILE", type=click.Path(dir_okay=False))
@click.option("--ctx", "-c", "n_ctx", default=512, show_default=True,
              help="Chunk length in tokens, and the context the model is loaded for (llama.cpp's -c).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of llama.cpp's lines.")
def perplexity_command(model_path, text_path, n_ctx, as_json):
    """Perplexity on a text file, computed as llama.cpp's llama-perplexity computes it.

    The text is cut into chunks of --ctx tokens (BOS first in each); only the second half of each
    chunk is scored. Prints the running estimate per chunk to stderr, as llama.cpp does, then
    "Final estimate: PPL = x +/- y" (one standard error).

    \b
    mlxllama perplexity -m model.gguf wiki.test.raw
    mlxllama perplexity -m model.gguf notes.txt --ctx 128 --json
    """
    from .perplexity import perplexity, read_text

    text = share(read_text(text_path) if world().is_root else None)  # under mlx.launch rank 0 reads it
    # llama-perplexity's context is one chunk, which also picks Phi-3's LongRoPE factors.
    runtime = load_model(model_path, n_ctx)
    tokens = runtime.tokenize(text, add_bos=True)
    bos_id = runtime.tokenizer.bos_id if runtime.tokenizer.add_bos else None

    def progress(index, running):
        click.echo(f"[{index}]{running:.4f},", err=True, nl=False)

    result = perplexity(runtime.model, tokens, n_ctx, bos_id, None if as_json else progress)
    if as_json:
        click.echo(json.dumps({"model": runtime.path, "text": text_path, **result.to_dict()}))
        return
    click.echo("", err=True)
    click.echo(f"Final estimate: PPL = {result.ppl:.4f} +/- {result.uncertainty:.5f}  "
               f"({result.n_chunks} chunks of {n_ctx}, {result.n_scored} tokens scored)")
