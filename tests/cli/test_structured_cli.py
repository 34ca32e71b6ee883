"""`generate` and `batch` with a constraint: --json-schema, --json-object, --regex, --grammar and
the same keys on batch lines."""

import json

import jsonschema
import pytest
from click.testing import CliRunner

from mlxllama.cli import main

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


def generate_json(*args) -> dict:
    result = run("generate", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_schema_from_a_file_and_inline(tmp_path):
    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(PERSON))
    from_file = generate_json("-p", "Describe a person.", "--json-schema", str(schema_file))
    inline = generate_json("-p", "Describe a person.", "--json-schema", json.dumps(PERSON))
    assert from_file == {**inline, "prompt_tokens_per_second": from_file["prompt_tokens_per_second"],
                         "generation_tokens_per_second": from_file["generation_tokens_per_second"]}
    assert from_file["finish_reason"] == "stop"
    jsonschema.validate(json.loads(from_file["text"]), PERSON)


def test_json_object_regex_and_grammar():
    assert isinstance(json.loads(generate_json("-p", "Anything", "--json-object")["text"]), dict)
    regex = generate_json("-p", "What is the capital of Japan?", "--regex", "(Tokyo|Osaka) is [a-z ]{1,12}\\.")
    assert regex["text"].startswith(("Tokyo is ", "Osaka is ")) and regex["text"].endswith(".")
    result = run("generate", "-p", "Is the sky green?", "--grammar", "-", input='root ::= "yes" | "no"\n')
    assert result.exit_code == 2 and "--grammar: cannot read -" in result.stderr


def test_grammar_from_a_file(tmp_path):
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text('root ::= answer "."\nanswer ::= "yes" | "no"\n')
    out = generate_json("-p", "Is the sky green?", "--grammar", str(grammar))
    assert out["text"] in ("yes.", "no.") and out["finish_reason"] == "stop"


@pytest.mark.parametrize("args, message", [
    (["--regex", "(ab"], "mlxllama: error: regex: "),
    (["--json-schema", '{"type": "array", "uniqueItems": true}'], "mlxllama: error: JSON schema: Unimplemented keys"),
    (["--json-schema", "{not json"], "mlxllama: error: JSON schema: not valid JSON"),
    (["--json-schema", "missing.json"], "mlxllama: error: --json-schema: cannot read missing.json: No such file"),
    (["--grammar", "missing.gbnf"], "mlxllama: error: --grammar: cannot read missing.gbnf: No such file"),
    (["--regex", "a", "--json-object"], "mlxllama: error: --json-object and --regex exclude each other: give one constraint"),
])
def test_a_bad_constraint_is_one_line_and_exit_2(args, message):
    result = run("generate", "-p", "x", *args)
    assert result.exit_code == 2
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
    assert result.stdout == ""


def test_batch_lines_carry_their_own_constraint_and_bad_ones_are_skipped():
    lines = [
        {"id": "person", "prompt": "Describe a person.", "json_schema": PERSON},
        {"id": "capital", "prompt": "What is the capital of Japan?", "regex": "The capital of [A-Z][a-z]+ is [A-Z][a-z]+\\."},
        {"id": "bad", "prompt": "x", "regex": "("},
        {"id": "two", "prompt": "x", "regex": "a", "grammar": 'root ::= "a"'},
        {"id": "yesno", "prompt": "Is the sky green?", "grammar": 'root ::= "yes" | "no"'},
        {"id": "free", "prompt": "What is 17 plus 25?"},
    ]
    result = run("batch", "-", "--json-object", "-n", "64", input="".join(json.dumps(line) + "\n" for line in lines))
    assert result.exit_code == 2
    records = {r["id"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert set(records) == {"person", "capital", "yesno", "free"}
    jsonschema.validate(json.loads(records["person"]["text"]), PERSON)
    assert records["capital"]["text"] == "The capital of Japan is Tokyo."
    assert records["yesno"]["text"] in ("yes", "no")
    # --json-object for lines without their own (this one runs on in a string until max_tokens)
    assert records["free"]["text"].startswith("{") and records["free"]["finish_reason"] == "length"
    assert "<stdin>:3: regex: " in result.stderr
    assert "<stdin>:4: 'regex' and 'grammar' exclude each other" in result.stderr
