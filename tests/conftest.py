"""Shared pytest helpers: where fixtures live, and a summary of what was skipped for want of them.

Tests are grouped: unit/ (one module or behaviour at a time), parity/ (against llama.cpp and
transformers references), cli/ (commands as a user runs them, and the benchmark scripts), cuda/
(the CUDA kernels; they skip where MLX does not run on CUDA), distributed/ (models split over two
processes of mlx.launch on 127.0.0.1).
"""

from __future__ import annotations

import os

# float32 products in full float32 on every device: MLX runs them at TF32 precision on CUDA (and on
# Apple's M5 accelerators) unless told not to, which moved float32 logits by up to 0.02 on an H100
# and failed bars that compare two float32 computations. Set before anything imports MLX; the
# commands the tests start inherit it. (MLX's own test harness sets the same.)
os.environ["MLX_ENABLE_TF32"] = "0"

import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest

TESTS = Path(__file__).parent
REPO = TESTS.parent
REPO_FIXTURES = TESTS / "fixtures"
REFERENCE = TESTS / "reference"
PACKAGE_DATA = REPO / "mlxllama" / "data"
# The extended fixtures (larger models, every vocabulary, 70 templates) live beside the checkout,
# as the workplace and CI have them, and may be absent elsewhere.
SHARED = REPO.parent / "shared" / "fixtures"
SHARED_MODELS = SHARED / "models"
MISSING = "missing extended fixture"


def skip_missing(what: str | Path) -> None:
    """Skip a test whose fixture is absent; the session's summary counts these skips."""
    pytest.skip(f"{MISSING}: {what}")


def find_fixture_model(name: str) -> Path:
    """Path of a fixture model: the repo copy if present, else the shared one, else skip the test."""
    for directory in (REPO_FIXTURES, PACKAGE_DATA, SHARED_MODELS):
        path = directory / name
        if path.is_file():
            return path
    skip_missing(SHARED_MODELS / name)


def load_as_on_cuda(path, block_products=None, wide=False, **options):
    """mlxllama.load with the weights in MLX's affine form, as on CUDA (the CPU holds the K-types in
    its sub-block form instead): in groups of 32, as the CUDA kernels read them, or with `wide` Q6_K's
    wide form, as MLX's own products read it there; and with a backend's `block_products` where
    given: for the tests that build CUDA's pieces, or stand in for them, on any device. `options`
    go to mlxllama.load."""
    from unittest.mock import patch

    import mlxllama.runtime
    from mlxllama.weights import load_model

    forms = {"sub_blocks": False, "wide": wide,
             **({"block_products": block_products} if block_products is not None else {})}
    with patch.object(mlxllama.runtime, "load_model", lambda *args, **kw: load_model(*args, **{**kw, **forms})):
        return mlxllama.load(path, **options)


@pytest.fixture
def fixture_model() -> Callable[[str], Path]:
    """Use as `fixture_model("types-tiny-Q4_0.gguf")`; skips the test when the file is missing."""
    return find_fixture_model


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say how many cases skipped for want of the extended fixtures, and for what else, so that
    a clone without ../shared cannot pass for a full run."""
    reasons = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reasons["extended fixtures" if MISSING in reason else reason.removeprefix("Skipped: ")] += 1
    if not reasons:
        return
    terminalreporter.section("skipped cases")
    for reason, count in reasons.most_common():
        if reason == "extended fixtures":
            terminalreporter.write_line(f"{count} skipped: extended fixtures not found in {SHARED}"
                                        " (the parity models, vocabularies and templates beside the checkout)")
        else:
            terminalreporter.write_line(f"{count} skipped: {reason}")


def free_port(count: int = 1) -> int:
    """A loopback port nothing uses now, and the `count` - 1 after it (mlx.launch's ring listens on
    the starting port and the next, one a rank)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for following in range(port, port + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", following))
            return port
        except OSError:
            continue


def assert_same_greedy(rt, prompt: list[int], got: list[int], want: list[int]) -> None:
    """Equal ids, or ids that part at a near-tie of the model's logits after their common prefix:
    on the CPU they are equal; float16 on a GPU rounds a (k+1)-row check and single steps
    differently (the parity tests' 0.08 is the bar)."""
    import mlx.core as mx  # here, as only the tests of models need it

    part = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if part is None:
        assert len(got) == len(want) or rt.model.compute_dtype != mx.float32
        return
    assert rt.model.compute_dtype != mx.float32, f"they part at token {part} on the CPU"
    row = rt.logits(list(prompt) + want[:part])[-1]
    assert abs(row[got[part]] - row[want[part]]) < 0.08, part


def wait_until_serving(url: str, process: subprocess.Popen, seconds: float = 60) -> None:
    """Return once `url`/health answers 200; fail with the server's stderr if its process ends first."""
    import httpx  # here, as only the server's tests need it

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
        if process.poll() is not None:
            raise AssertionError(process.stderr.read())
    raise AssertionError("the server did not start")


class Server:
    """`mlxllama serve ARGS` on a free loopback port, started and waited for; `url` reaches it."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([sys.executable, "-m", "mlxllama", "serve", "--port", str(self.port), *args],
                                        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until_serving(self.url, self.process)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
