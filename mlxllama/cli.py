"""The `mlxllama` command line."""

from __future__ import annotations

import json
import os
import sys
from importlib.resources import files

import click

from .errors import MlxLlamaError

MODEL_ENV = "MLXLLAMA_MODEL"


def default_model_path() -> str:
    """$MLXLLAMA_MODEL, else the small demo model shipped inside the package."""
    return os.environ.get(MODEL_ENV) or str(files("mlxllama.data") / "chat-tiny-Q4_K_M.gguf")


class Main(click.Group):
    """Turns user-fixable problems into one line on stderr and exit code 2, Ctrl-C into exit code 130."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MlxLlamaError as e:
            click.echo(f"mlxllama: error: {e}", err=True)
            ctx.exit(2)
        except KeyboardInterrupt:
            click.echo("\nmlxllama: interrupted", err=True)
            ctx.exit(130)
        except BrokenPipeError:
            # The reader went away (e.g. `| head`); stop quietly rather than raise again at exit.
            sys.stdout = open(os.devnull, "w")
            ctx.exit(0)


@click.group(cls=Main)
@click.version_option(package_name="mlxllama")
def main():
    """Run GGUF language models on MLX, with chat templates applied explicitly."""


def model_option(f):
    return click.option(
        "--model", "-m", "model_path", default=None, metavar="GGUF",
        help=f"GGUF model file (default: ${MODEL_ENV}, else the bundled demo model chat-tiny Q4_K_M).",
    )(f)


def sampling_options(f):
    options = [
        click.option("--max-tokens", "-n", default=256, show_default=True, help="Most tokens to generate."),
        click.option("--temperature", "--temp", "-t", default=0.0, show_default=True, help="0 is greedy."),
        click.option("--top-k", default=40, show_default=True, help="Keep the k likeliest tokens (0: all)."),
        click.option("--top-p", default=0.95, show_default=True, help="Nucleus: keep the smallest set with this mass."),
        click.option("--min-p", default=0.05, show_default=True, help="Drop tokens below min-p x the top probability."),
        click.option("--repeat-penalty", default=1.0, show_default=True, help="Penalty for recent tokens (1: off)."),
        click.option("--repeat-last-n", default=64, show_default=True, help="Window of the repeat penalty (-1: all)."),
        click.option("--seed", type=int, default=None, help="Random seed for sampling (reproducible runs)."),
        click.option("--stop", multiple=True, help="Stop at this string (repeatable); it is not printed."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def sampling_params(kwargs: dict):
    from .sampling import SamplingParams

    return SamplingParams(
        temperature=kwargs["temperature"], top_k=kwargs["top_k"], top_p=kwargs["top_p"], min_p=kwargs["min_p"],
        repeat_penalty=kwargs["repeat_penalty"], repeat_last_n=kwargs["repeat_last_n"], seed=kwargs["seed"],
    )


def template_options(f):
    options = [
        click.option("--no-template", is_flag=True, help="Feed the raw prompt with BOS only."),
        click.option("--template", "template_name", metavar="NAME", help="Use a built-in chat template."),
        click.option("--template-file", type=click.Path(dir_okay=False), help="Use the chat template in this file."),
        click.option("--template-kwargs", metavar="JSON", help="Extra template variables, as a JSON object."),
        click.option("--system", metavar="TEXT", help="System message (with a template)."),
        click.option("--show-prompt", is_flag=True, help="Print the rendered prompt and its token ids to stderr."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def parse_template_kwargs(raw: str | None) -> dict:
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise MlxLlamaError(f"--template-kwargs: not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(value, dict):
        raise MlxLlamaError("--template-kwargs: expected a JSON object")
    return value


def load_model(model_path: str | None):
    from .runtime import load

    return load(model_path or default_model_path())


def print_prompt(prompt) -> None:
    click.echo(f"--- prompt (template: {prompt.template}) ---", err=True)
    click.echo(prompt.text, err=True)
    click.echo(f"--- {len(prompt.ids)} token ids ---", err=True)
    click.echo(" ".join(map(str, prompt.ids)), err=True)


@main.command()
@model_option
@click.option("--prompt", "-p", "prompt_text", required=True, help="The prompt ('-' reads it from stdin).")
@template_options
@click.option("--compare-template", is_flag=True, help="Run with and without the template, same settings and seed.")
@sampling_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def generate(model_path, prompt_text, no_template, template_name, template_file, template_kwargs, system,
             show_prompt, compare_template, as_json, **sampling):
    """Generate a continuation of a prompt (with the model's chat template unless --no-template).

    \b
    mlxllama generate -p "What is the capital of Japan?"
    mlxllama generate -p "The capital of Italy is" --no-template -n 8
    mlxllama generate -p "What is 17 plus 25?" --compare-template --json
    """
    from .prompt import NO_TEMPLATE, build_prompt, choose_template, messages_for

    if prompt_text == "-":
        prompt_text = sys.stdin.read()
    if no_template and (system or compare_template):
        raise MlxLlamaError("--no-template cannot be combined with --system or --compare-template")
    kwargs = parse_template_kwargs(template_kwargs)
    runtime = load_model(model_path)
    params = sampling_params(sampling)
    messages = messages_for(prompt_text, system)
    template = choose_template(runtime.chat_template, template_name, template_file, no_template)
    runs = [template, NO_TEMPLATE] if compare_template else [template]
    results = []
    for run_template in runs:
        prompt = build_prompt(runtime.tokenizer, run_template, messages, kwargs)
        if show_prompt:
            print_prompt(prompt)
        stream = runtime.stream(prompt.ids, sampling["max_tokens"], params, sampling["stop"])
        if not as_json:
            if compare_template:
                click.echo(f"=== {'template: ' + prompt.template if run_template.text else 'no template'} ===")
            for piece in stream:
                click.echo(piece, nl=False)
                sys.stdout.flush()
            click.echo()
        else:
            stream.run()
        results.append({"model": runtime.path, "template": prompt.template, "prompt": prompt.text,
                        **stream.result.to_dict()})
    if as_json:
        payload = results[0] if not compare_template else {"with_template": results[0], "without_template": results[1]}
        click.echo(json.dumps(payload, ensure_ascii=False))


CHAT_HELP = """commands: /reset (forget the conversation), /system TEXT (set the system message; empty clears it),
/history (show the conversation), /save FILE (write a JSON transcript), /quit (or Ctrl-D).
Ctrl-C stops the current reply."""


@main.command()
@model_option
@click.option("--template", "template_name", metavar="NAME", help="Use a built-in chat template.")
@click.option("--template-file", type=click.Path(dir_okay=False), help="Use the chat template in this file.")
@click.option("--template-kwargs", metavar="JSON", help="Extra template variables, as a JSON object.")
@click.option("--system", metavar="TEXT", help="System message.")
@sampling_options
def chat(model_path, template_name, template_file, template_kwargs, system, **sampling):
    """Chat with a model; the conversation stays in the KV cache between turns.

    Reads one message per line from a pipe too:

    \b
    mlxllama chat
    printf 'What is the capital of Japan?\\nWhat is 17 plus 25?\\n' | mlxllama chat
    """
    from .chat import ChatSession
    from .prompt import choose_template

    kwargs = parse_template_kwargs(template_kwargs)
    runtime = load_model(model_path)
    template = choose_template(runtime.chat_template, template_name, template_file)
    session = ChatSession(runtime, template, system, sampling_params(sampling), sampling["max_tokens"],
                          sampling["stop"], kwargs, notify=lambda message: click.echo(f"[{message}]", err=True))
    interactive = sys.stdin.isatty()
    failed = False
    if interactive:
        click.echo(f"mlxllama chat: {os.path.basename(runtime.path)}, template {template.label}. {CHAT_HELP}", err=True)
    while True:
        try:
            line = input(">>> ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        except KeyboardInterrupt:
            click.echo("", err=True)
            continue
        if not interactive and not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        try:
            if line.startswith("/"):
                if run_chat_command(session, line):
                    break
                continue
            for piece in session.send(line):
                click.echo(piece, nl=False)
                sys.stdout.flush()
            click.echo()
        except KeyboardInterrupt:
            click.echo("\n[reply stopped]", err=True)
        except MlxLlamaError as e:
            # One bad line or command should not end the conversation, but a script should learn of it.
            click.echo(f"mlxllama: error: {e}", err=True)
            failed = True
    if failed and not interactive:
        sys.exit(2)


def run_chat_command(session, line: str) -> bool:
    """Carry out a /command; True means quit."""
    command, _, argument = line.partition(" ")
    argument = argument.strip()
    if command in ("/quit", "/exit"):
        return True
    if command == "/reset":
        session.reset()
        click.echo("[conversation reset]", err=True)
    elif command == "/system":
        session.set_system(argument)
        click.echo(f"[system message {'set' if argument else 'cleared'}]", err=True)
    elif command == "/history":
        for message in session.conversation():
            click.echo(f"{message['role']}: {message['content']}")
    elif command == "/save":
        if not argument:
            raise MlxLlamaError("/save needs a file name")
        session.save(argument)
        click.echo(f"[saved {argument}]", err=True)
    else:
        click.echo(f"[unknown command {command}; {CHAT_HELP}]", err=True)
    return False
