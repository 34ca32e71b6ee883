"""Record how Hugging Face transformers renders chat templates, as the reference for mlxllama's renderer.

Renders every template in the shared fixtures (`../shared/fixtures/templates/*.jinja`, next to the
checkout) and every built-in template (`templates/*.jinja`) with transformers' own renderer, for a
few fixed conversations (one of them offering a tool), with and without the generation prompt, and writes
`tests/reference/template_renderings.json`, which `tests/parity/test_chat_template.py` replays.

It needs transformers, which mlxllama does not depend on; it does not need torch:

    python3 -m venv /tmp/tfvenv
    /tmp/tfvenv/bin/pip install transformers jinja2
    /tmp/tfvenv/bin/python scripts/make_template_expectations.py [--fixtures DIR] [--out FILE]

`strftime_now` is pinned to FIXED_NOW so that templates printing today's date render the same
every time; the test pins mlxllama's renderer to the same moment.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from datetime import datetime
from pathlib import Path

import jinja2
import transformers
from transformers.utils import chat_template_utils

REPO = Path(__file__).resolve().parents[1]
DEFAULT_FIXTURES = REPO.parent / "shared" / "fixtures" / "templates"
DEFAULT_OUT = REPO / "tests" / "reference" / "template_renderings.json"

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
FIXED_NOW = datetime(2025, 3, 5, 9, 7, 3)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo actuelle d'une ville — «current weather»",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "Nom de la ville, e.g. Zürich"}},
            "required": ["city"],
        },
    },
}

# Each case: the messages, and the tools offered (None: the template sees `tools` as None).
CONVERSATIONS = {
    "user": {
        "messages": [
            {"role": "user", "content": "What is the capital of Japan?"},
        ],
        "tools": None,
    },
    "system_turns": {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello!"},
            # Surrounding spaces, because several templates trim content and others keep it.
            {"role": "assistant", "content": "  Hi there. How can I help?  "},
            {"role": "user", "content": "What is 17 plus 25?"},
        ],
        "tools": None,
    },
    "non_ascii": {
        "messages": [
            {"role": "user", "content": "Ça va? 日本の首都は? 🙂"},
            {"role": "assistant", "content": "Très bien. 東京です。"},
            {"role": "user", "content": "Merci! «Straße» — 👍"},
        ],
        "tools": None,
    },
    # Tool schemas reach the prompt through `tojson`, whose options and non-ASCII handling differ from Jinja's.
    "tools": {
        "messages": [
            {"role": "user", "content": "Quel temps fait-il à Zürich?"},
        ],
        "tools": [WEATHER_TOOL],
    },
}


class _FixedDatetime(datetime):
    @classmethod
    def now(cls, tz=None):
        return FIXED_NOW


def render(source: str, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> dict:
    """{"text": ...}, {"error": raise_exception's message}, or {"exception": any other failure}."""
    try:
        rendered, _ = chat_template_utils.render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=source,
            add_generation_prompt=add_generation_prompt,
            bos_token=BOS_TOKEN,
            eos_token=EOS_TOKEN,
        )
    # transformers' raise_exception raises exactly jinja2's base TemplateError; everything Jinja itself
    # raises (undefined names, syntax, sandbox) is a subclass of it.
    except jinja2.TemplateError as e:
        if type(e) is jinja2.TemplateError:
            return {"error": str(e)}
        return {"exception": f"{type(e).__name__}: {e}"}
    except Exception as e:
        return {"exception": f"{type(e).__name__}: {e}"}
    return {"text": rendered[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES, help="directory of *.jinja templates")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    sources = {f"fixture:{p.stem}": p for p in sorted(args.fixtures.glob("*.jinja"))}
    if not sources:
        print(f"no templates in {args.fixtures}", file=sys.stderr)
        return 1
    sources.update({f"builtin:{p.stem}": p for p in sorted((REPO / "templates").glob("*.jinja"))})

    # transformers' strftime_now reads the module's `datetime` when called.
    chat_template_utils.datetime = _FixedDatetime

    templates = {}
    renderings = []
    for key, path in sources.items():
        source = path.read_text(encoding="utf-8")
        templates[key] = hashlib.sha256(source.encode("utf-8")).hexdigest()
        for conversation, case in CONVERSATIONS.items():
            for add_generation_prompt in (True, False):
                renderings.append({
                    "template": key,
                    "conversation": conversation,
                    "add_generation_prompt": add_generation_prompt,
                    **render(source, case["messages"], case["tools"], add_generation_prompt),
                })

    reference = {
        "generator": "scripts/make_template_expectations.py",
        "transformers": transformers.__version__,
        "jinja2": jinja2.__version__,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "now": FIXED_NOW.isoformat(),
        "conversations": CONVERSATIONS,
        "template_sha256": templates,
        "renderings": renderings,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(reference, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    counts = {kind: sum(kind in r for r in renderings) for kind in ("text", "error", "exception")}
    print(f"{len(templates)} templates, {len(renderings)} renderings {counts} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
