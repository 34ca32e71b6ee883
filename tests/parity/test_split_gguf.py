"""A model split over several files (NAME-00001-of-0000N.gguf, as llama.cpp's converter and gguf-split
write large published models), opened from its first part: the Qwen2 YaRN fixture converted to Q8_0
in three parts by llama.cpp's converter, against llama.cpp's reference on the same parts
(scripts/make_arch_fixtures.py split-convert, split-record)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from click.testing import CliRunner

import mlxllama
from mlxllama.cli import main
from mlxllama.errors import MlxLlamaError

from conftest import REFERENCE, REPO
from test_llama_parity import assert_greedy_matches, assert_logits_match

PARTS = [REPO / "tests" / "fixtures" / "split" / f"qwen2-split-tiny-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]


def test_the_split_model_matches_llama_cpp_opened_from_its_first_part():
    m = mlxllama.load(PARTS[0], context_length=512)
    with np.load(REFERENCE / "split" / "qwen2-split-tiny-Q8_0.npz") as data:
        ref = {key: data[key] for key in data.files}
    for prompt in ("chat", "plain"):
        assert m.tokenize(str(ref[f"{prompt}/text"]), special=True) == ref[f"{prompt}/ids"].tolist()
        assert_logits_match(m, ref, prompt, prompt, 0.5)
        assert_greedy_matches(m, ref, prompt, prompt)


def test_inspect_counts_every_part():
    result = CliRunner().invoke(main, ["inspect", str(PARTS[0])])
    assert result.exit_code == 0, result.output
    assert f"({sum(p.stat().st_size for p in PARTS):,} bytes in 3 files," in result.output


def copy_parts(folder, names: dict[int, int]):
    """Part i of the fixture copied into a new folder under the name of part names[i]; the first's path."""
    folder.mkdir()
    for i, as_number in names.items():
        shutil.copy(PARTS[i - 1], folder / f"m-0000{as_number}-of-00003.gguf")
    return folder / "m-00001-of-00003.gguf"


def test_a_later_part_a_missing_part_or_a_misnamed_one_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(main, ["inspect", str(PARTS[1])])
    assert result.exit_code == 2
    assert result.stderr == (f"mlxllama: error: {PARTS[1]}: part 2 of a model split in 3; open its first part,"
                             " NAME-00001-of-00003.gguf\n")
    with pytest.raises(MlxLlamaError, match=r"part 3 of 3 is missing \(.*m-00003-of-00003\.gguf\)$"):
        mlxllama.load(copy_parts(tmp_path / "missing", {1: 1, 2: 2}))
    with pytest.raises(MlxLlamaError, match=r"m-00002-of-00003\.gguf: not part 2 of 3"):
        mlxllama.load(copy_parts(tmp_path / "swapped", {1: 1, 3: 2, 2: 3}))
