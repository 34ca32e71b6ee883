"""The measurement scripts in benchmarks/ that the documented GPU results came from, kept in step
with the code they instrument (their GPU runs cannot happen in CI)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import mlxllama
from mlxllama import cuda_step

from conftest import find_fixture_model

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import host_time  # noqa: E402
import layer_timeline  # noqa: E402


def test_layer_timeline_stamps_the_start_each_barrier_and_the_end_of_the_layer_kernel():
    timed = layer_timeline.timed_header(cuda_step._HEADER)
    body = timed.split("unsigned long long* times) {")[1]
    assert [int(i) for i in re.findall(r"stamp\(times, (\d+)\)", body)] == list(range(layer_timeline.STAMPS))
    assert body.count("grid_barrier(arrivals);") == 4


def test_host_time_splits_each_step_into_host_and_wait():
    runtime = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
    speed, host, wait = host_time.run(runtime, 5, 4)
    assert speed > 0 and host > 0 and wait >= 0
