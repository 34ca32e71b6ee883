"""Shared pytest helpers."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

REPO_FIXTURES = Path(__file__).parent / "fixtures"
PACKAGE_DATA = Path(__file__).parents[1] / "mlxllama" / "data"
# Large models live outside the repo, next to the checkout, and may be absent.
SHARED_FIXTURES = Path(__file__).parents[2] / "shared" / "fixtures" / "models"


def find_fixture_model(name: str) -> Path:
    """Path of a fixture model: the repo copy if present, else the shared one, else skip the test."""
    for directory in (REPO_FIXTURES, PACKAGE_DATA, SHARED_FIXTURES):
        path = directory / name
        if path.is_file():
            return path
    pytest.skip(f"fixture model {name} not found in {REPO_FIXTURES}, {PACKAGE_DATA} or {SHARED_FIXTURES}")


@pytest.fixture
def fixture_model() -> Callable[[str], Path]:
    """Use as `fixture_model("types-tiny-Q4_0.gguf")`; skips the test when the file is missing."""
    return find_fixture_model
