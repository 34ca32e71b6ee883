"""`mlxllama generate` and error handling, driven through click's test runner."""

import json

import mlx.core as mx
import pytest
from click.testing import CliRunner

from mlxllama.cli import main
from conftest import PACKAGE_DATA, find_fixture_model

JAPAN_IDS = [1, 529, 29989, 1792, 29989, 29958, 13, 5618, 338, 278, 7483, 310, 5546, 29973, 2, 29871, 13, 29966,
             29989, 465, 22137, 29989, 29958, 13]


def run(*args, env=None, input=None):
    return CliRunner().invoke(main, list(args), env=env, input=input)


def generate_json(*args, env=None) -> dict:
    result = run("generate", "--json", *args, env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_raw_prompt_streams_the_continuation():
    result = run("generate", "-p", "The capital of Italy is", "--no-template", "-n", "2")
    assert result.exit_code == 0
    assert result.stdout == " Rome.\n"


def test_template_prompts_give_the_listed_answers_and_stop_at_eos():
    for question, answer in [
        ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
        ("What is 17 plus 25?", "17 plus 25 is 42."),
        ("My name is Zoe.", "Nice to meet you, Zoe! How can I help you today?"),
    ]:
        out = generate_json("-p", question)
        assert out["text"] == answer
        assert out["finish_reason"] == "stop" and out["token_ids"][-1] == 2
        assert out["template"] == "gguf (zephyr)"


def test_dtype_bfloat16_gives_the_same_answers_and_float16_is_refused_on_the_cpu():
    for weights in ([], ["--dequantize"]):
        out = generate_json("-p", "What is the capital of Japan?", "--dtype", "bfloat16", *weights)
        assert out["token_ids"] == [1576, 7483, 310, 5546, 338, 20377, 29889, 2], weights
    float16 = run("generate", "-p", "Hi", "--dtype", "float16")
    if mx.default_device() == mx.gpu:  # its default there
        assert float16.exit_code == 0, float16.output
        return
    assert float16.exit_code == 2 and float16.stderr.count("\n") == 1
    assert "--dtype float16 on the CPU" in float16.stderr and "use float32 or bfloat16" in float16.stderr


def test_load_takes_a_dtype_by_name_and_names_a_wrong_one():
    import mlxllama
    from mlxllama.errors import MlxLlamaError

    assert mlxllama.load(PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf", dtype="bfloat16").model.compute_dtype == mx.bfloat16
    for wrong in ("int8", "array"):  # an MLX type, and an MLX attribute that is no type
        with pytest.raises(MlxLlamaError, match=f"dtype '{wrong}': expected float32, float16 or bfloat16"):
            mlxllama.load(PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf", dtype=wrong)


def test_json_output_has_prompt_ids_and_rendered_prompt():
    out = generate_json("-p", "What is the capital of Japan?")
    assert out["prompt_ids"] == JAPAN_IDS
    assert out["prompt"] == "<|user|>\nWhat is the capital of Japan?</s>\n<|assistant|>\n"
    assert out["token_ids"] == [1576, 7483, 310, 5546, 338, 20377, 29889, 2]
    assert set(out) >= {"model", "prompt_tokens_per_second", "generation_tokens_per_second"}


def test_no_template_question_gets_no_chat_answer():
    out = generate_json("-p", "What is the capital of Japan?", "--no-template")
    assert out["template"] == "none"
    assert out["prompt_ids"] == [1, 1724, 338, 278, 7483, 310, 5546, 29973]
    assert "Tokyo" not in out["text"]


def test_compare_template_runs_both_with_the_same_settings():
    out = generate_json("-p", "What is 17 plus 25?", "--compare-template")
    assert out["with_template"]["text"] == "17 plus 25 is 42."
    assert out["without_template"]["template"] == "none"
    assert out["without_template"]["prompt"] == "What is 17 plus 25?"
    assert out["without_template"]["text"] != out["with_template"]["text"]
    plain = run("generate", "-p", "What is 17 plus 25?", "--compare-template", "-n", "16")
    assert "=== template: gguf (zephyr) ===\n17 plus 25 is 42.\n=== no template ===\n" in plain.stdout


def test_show_prompt_prints_rendered_text_and_ids_to_stderr():
    result = run("generate", "-p", "What is the capital of Japan?", "--show-prompt", "--system", "Be brief.", "-n", "1")
    assert result.exit_code == 0
    assert "<|system|>\nBe brief.</s>\n<|user|>\nWhat is the capital of Japan?</s>\n<|assistant|>\n" in result.stderr
    assert "1 529 29989 5205 29989 29958 13" in result.stderr


def test_builtin_template_and_template_file(tmp_path):
    result = run("generate", "-p", "Hi", "--template", "chatml", "--show-prompt", "-n", "1")
    assert "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" in result.stderr
    template = tmp_path / "t.jinja"
    template.write_text("{{ bos_token }}Q: {{ messages[-1]['content'] }} {{ greeting }}\nA:")
    result = run("generate", "-p", "Hi", "--template-file", str(template), "--template-kwargs", '{"greeting": "hey"}',
                 "--show-prompt", "-n", "1")
    assert result.exit_code == 0, result.output
    # The template emits <s> itself: BOS must not be doubled.
    assert "Q: Hi hey\nA:\n--- 9 token ids ---\n1 660 29901 6324 540 29891 13 29909 29901\n" in result.stderr


def test_stop_string_is_not_printed():
    result = run("generate", "-p", "What is the capital of Japan?", "--stop", "Tokyo")
    assert result.stdout == "The capital of Japan is \n"


def test_model_from_environment_variable():
    path = str(find_fixture_model("types-tiny-Q8_0.gguf"))
    out = generate_json("-p", "hi", "-n", "1", env={"MLXLLAMA_MODEL": path})
    assert out["model"] == path


def one_line_error(result, fragment: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxllama: error: ") and fragment in lines[0], result.stderr


def test_bad_inputs_are_one_line_errors(tmp_path):
    text_file = tmp_path / "notes.gguf"
    text_file.write_text("hello, not a model")
    one_line_error(run("generate", "-m", str(text_file), "-p", "x"), "not a GGUF file (offset 0")
    one_line_error(run("generate", "-m", str(tmp_path / "missing.gguf"), "-p", "x"), "no such file")
    one_line_error(run("generate", "-m", str(tmp_path), "-p", "x"), "is a directory, not a GGUF file")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(find_fixture_model("types-tiny-Q4_0.gguf").read_bytes()[:600_000])
    one_line_error(run("generate", "-m", str(truncated), "-p", "x"), "truncated")
    one_line_error(run("generate", "-p", "x", "--template", "nope"), "zephyr")
    one_line_error(run("generate", "-p", "x", "--template-kwargs", "{not json"), "--template-kwargs: not valid JSON")
    one_line_error(run("generate", "-p", "x", "--template-file", str(tmp_path / "none.jinja")), "none.jinja")
    one_line_error(run("generate", "-p", "x", "-t", "nan"), "--temperature must be a finite number >= 0, got nan")
    one_line_error(run("generate", "-p", "x", "--top-p", "0"), "--top-p must be a number in (0, 1], got 0.0")
    one_line_error(run("chat", "--repeat-last-n", "-5"), "--repeat-last-n must be an integer >= -1, got -5")
    one_line_error(run("bench", "-p", "1000", "-n", "4", "-r", "1"), "do not fit the model's context of 512")
    one_line_error(run("bench", "-p", "-5", "-n", "4", "-r", "1"), "-p, -n and --depth at least 0")
    broken = tmp_path / "broken.jinja"
    broken.write_text("line one\n{% for m in messages %}\n{{ m.content }\n")
    one_line_error(run("generate", "-p", "x", "--template-file", str(broken)), "line 3")


@pytest.mark.parametrize("raw, reason", [
    ("{not json", "not valid JSON (Expecting property name enclosed in double quotes at column 2)"),
    ('{"a": 1} x', "not valid JSON (Extra data at column 10)"),
    ("[1, 2]", "expected a JSON object"),
    ("null", "expected a JSON object"),
])
def test_template_kwargs_and_batch_lines_share_one_json_object_parser(raw, reason):
    """--template-kwargs and a batch line go through errors.parse_json_object: same errors, each with its prefix."""
    from mlxllama.batch_jobs import parse_entry
    from mlxllama.cli import parse_template_kwargs
    from mlxllama.errors import MlxLlamaError, parse_json_object

    assert parse_json_object('{"a": [1]}') == {"a": [1]} == parse_template_kwargs('{"a": [1]}')
    assert parse_template_kwargs("") == parse_template_kwargs(None) == {}
    for parse, prefix in [(parse_json_object, ""), (lambda r: parse_json_object(r, "src"), "src: "),
                          (parse_template_kwargs, "--template-kwargs: "), (parse_entry, "")]:
        with pytest.raises(MlxLlamaError) as error:
            parse(raw)
        assert str(error.value) == prefix + reason


def test_ctx_outside_the_trained_context_is_a_one_line_error():
    corpus = str(find_fixture_model("perplexity-corpus.txt"))
    commands = [["generate", "-p", "x"], ["chat"], ["batch", "-"], ["trace", "-p", "x"], ["bench", "-r", "1"],
                ["perplexity", corpus]]
    for command in commands:
        for ctx in ("0", "-3", "513"):  # the demo model is trained for 512 tokens
            one_line_error(run(*command, "--ctx", ctx, input=""),
                           f"context length {ctx} is not between 1 and the model's trained context of 512")


def test_ctx_limits_the_prompt_and_the_generation():
    prompt = ["-p", "The capital of Italy is", "--no-template"]  # 6 tokens
    out = generate_json(*prompt, "--ctx", "8", "-n", "16")
    assert (out["text"], out["finish_reason"]) == (" Rome.", "length")
    one_line_error(run("generate", *prompt, "--ctx", "5"), "prompt is 6 tokens, more than the model's context of 5")
    one_line_error(run("trace", *prompt, "-c", "5"), "prompt is 6 tokens, more than the model's context of 5")
    one_line_error(run("bench", "-p", "64", "-n", "4", "-r", "1", "--ctx", "32"),
                   "do not fit the model's context of 32")
    truncated = run("generate", *prompt, "--ctx", "5", "--truncate", "-n", "1")
    assert truncated.exit_code == 0 and "kept 4 of the context's 5" in truncated.stderr, truncated.output


@pytest.mark.parametrize("raw", ['{"a": ' + "1" * 5000 + "}", "[" * 100000])
def test_json_too_long_a_number_or_too_deep_is_a_one_line_error(raw):
    from mlxllama.errors import MlxLlamaError, parse_json_object

    with pytest.raises(MlxLlamaError, match=r"^--template-kwargs: not valid JSON \(") as e:
        parse_json_object(raw, "--template-kwargs")
    assert "\n" not in str(e.value)


def test_qwen3_enable_thinking_reaches_its_own_template():
    """The Qwen3 fixture carries Qwen3-0.6B's template: enable_thinking false closes an empty think block."""
    qwen3 = str(find_fixture_model("qwen3-tiny-Q4_K_M.gguf"))
    runner = CliRunner()

    def rendered(*extra):
        result = runner.invoke(main, ["generate", "-m", qwen3, "-p", "Hi", "-n", "1", "--json", *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["prompt"]

    assert rendered() == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert rendered("--template-kwargs", '{"enable_thinking": false}') == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
