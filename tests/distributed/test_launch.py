"""Models split over two processes of `mlx.launch --backend ring` on 127.0.0.1, as a user runs them:
the single process's answer from either split, rank 0 alone writing, a batch spread over ranks
written as one process writes it, and a killed rank ending the run without losing results.

MLXLLAMA_LAUNCH_BACKEND=nccl runs the same tests over NCCL, one GPU a rank, on a machine of
several GPUs (`benchmarks/gpu.sh multi` does)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import PACKAGE_DATA, REPO_FIXTURES, free_port, wait_until_serving

import mlxllama

BIN = Path(sys.executable).parent
BACKEND = os.environ.get("MLXLLAMA_LAUNCH_BACKEND", "ring")
CHAT_TINY = PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf"
HERE = Path(__file__).parent
# Mean KL divergence of a split model's next-token distributions from one process's: the split
# sums each projection's halves in another order, which moves float32 logits by about 1e-5.
MAX_KL = 1e-4


def installed(name: str) -> str:
    """A console script of this interpreter's environment, else the one on PATH (the GPU machine's
    wrappers, where the packages are unpacked rather than installed)."""
    return str(BIN / name) if (BIN / name).exists() else shutil.which(name) or name


def launch_command(*command: str, n: int = 2, port: int | None = None) -> list[str]:
    """`mlx.launch -n N -- COMMAND` over BACKEND from `port`: the ring's ranks listen on it and the
    N - 1 after it, NCCL's rank 0 on it alone."""
    port = port or free_port(n)
    ports = ["--starting-port", str(port)] if BACKEND == "ring" else ["--nccl-port", str(port)]
    return [installed("mlx.launch"), "-n", str(n), "--backend", BACKEND, *ports, "--", *command]


def launch(*command: str, n: int = 2, timeout: float = 240, stdin: str | None = None, **kwargs):
    """Run `launch_command` (mlx.launch exits 0 whatever its ranks do, so callers check the output)."""
    return subprocess.run(launch_command(*command, n=n), input=stdin, capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def mlxllama_cli(*args: str) -> list[str]:
    return [installed("mlxllama"), *args]


SPLITS = [(CHAT_TINY, "tensor", "tensor"), (CHAT_TINY, "pipeline", "pipeline"), (CHAT_TINY, "pipeline-sum", "pipeline"),
          # GQA with Q/K norms and heads of 128; fused Q/K/V and gate/up; two mixtures of experts
          (REPO_FIXTURES / "qwen3-tiny-Q4_K_M.gguf", "tensor", "tensor"),
          (REPO_FIXTURES / "phi3-tiny-Q5_K_M.gguf", "tensor", "tensor"),
          (REPO_FIXTURES / "mixtral-tiny-Q4_K_M.gguf", "tensor", "tensor"),
          (REPO_FIXTURES / "qwen3moe-tiny-Q8_0.gguf", "tensor", "tensor"),
          # one KV head: tensor parallelism cannot split it, so a pipeline runs
          (REPO_FIXTURES / "gemma3-tiny-Q8_0.gguf", "tensor", "pipeline")]


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_split_models_give_the_single_process_logits_and_ids(tmp_path):
    result = launch(sys.executable, str(HERE / "split_run.py"), str(tmp_path),
                    *[f"{path}:{mode}" for path, mode, _ in SPLITS])
    assert result.returncode == 0 and not result.stderr.count("Traceback"), result.stderr
    for n, (path, asked, mode) in enumerate(SPLITS):
        runtime = mlxllama.load(path, dtype=mx.float32)  # as split_run.py, on a GPU too
        ids = runtime.tokenize("The capital of France is")
        logits = runtime.logits(ids)
        ranks = [np.load(tmp_path / f"{rank}-{n}.npz") for rank in range(2)]
        assert str(ranks[0]["mode"]) == mode, path.name
        if mode == "pipeline":
            assert [list(r["layers"]) for r in ranks] == [[0, 1, 2], [3, 4, 5]]
            assert asked != "pipeline-sum" or str(ranks[0]["hand_over"]) == "sum"
        p, q = softmax(logits), softmax(ranks[0]["logits"])
        kl = float((p * (np.log(p) - np.log(q))).sum(-1).mean())
        assert kl < MAX_KL, (path.name, kl)
        np.testing.assert_allclose(ranks[0]["logits"], logits, atol=1e-3, err_msg=path.name)
        assert list(ranks[0]["greedy"]) == runtime.generate(ids, max_tokens=12).token_ids, path.name
        assert list(ranks[0]["sampled"]) == runtime.generate(ids, max_tokens=12, temperature=1.0, seed=7).token_ids
        for key in ("greedy", "sampled", "unseeded"):  # every rank fed rank 0's choices
            assert list(ranks[1][key]) == list(ranks[0][key]), (path.name, key)


def single(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(mlxllama_cli(*args), capture_output=True, text=True, timeout=120, **kwargs)


@pytest.mark.parametrize("split", [[], ["--pipeline"]])
def test_generate_and_chat_under_launch_answer_as_one_process(split):
    args = ["generate", "-p", "What is 17 plus 25?", "--json"]
    launched = launch(*mlxllama_cli(*args, *split))
    assert launched.stdout.count("\n") == 1, launched.stdout + launched.stderr  # rank 0 alone writes
    expected = json.loads(single(*args).stdout)
    got = json.loads(launched.stdout)
    assert (got["token_ids"], got["text"]) == (expected["token_ids"], expected["text"]) == (
        expected["token_ids"], "17 plus 25 is 42.")
    how = "a pipeline of 2 processes" if split else "layers split by tensor over 2 processes"
    assert f"[mlx.launch: {how}" in launched.stderr
    # mlx.launch never passes on the end of its input: a piped chat ends with /quit.
    messages = "What is the capital of Japan?\nWhat is 17 plus 25?\n"
    chatted = launch(*mlxllama_cli("chat", *split), stdin=messages + "/quit\n")
    assert chatted.stdout == single("chat", input=messages).stdout == \
        "The capital of Japan is Tokyo.\n17 plus 25 is 42.\n"


def prompts_file(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": i, "prompt": f"What is {i} plus {i}?"}) + "\n" for i in range(n)))
    return path


def records(path: Path) -> list[tuple]:
    return [(r["id"], r["token_ids"], r["text"]) for r in map(json.loads, path.read_text().splitlines())]


def test_batch_split_or_spread_writes_the_single_process_file(tmp_path):
    prompts = prompts_file(tmp_path / "in.jsonl", 11)
    expected = tmp_path / "single.jsonl"
    single("batch", str(prompts), "-o", str(expected), "-n", "12")
    for name, extra in (("tensor", []), ("spread", ["--data-parallel", "-b", "2"])):
        out = tmp_path / f"{name}.jsonl"
        result = launch(*mlxllama_cli("batch", str(prompts), "-o", str(out), "-n", "12", *extra))
        assert "prompts" in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert records(out) == records(expected), name


def rank_pid(rank: int, tag: str) -> int | None:
    """The pid of rank `rank` of the run whose environment carries MLXLLAMA_TEST_RUN=tag."""
    wanted = {f"MLX_RANK={rank}".encode(), f"MLXLLAMA_TEST_RUN={tag}".encode()}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and wanted <= set((entry / "environ").read_bytes().split(b"\0")):
                return int(entry.name)
        except OSError:
            continue
    return None


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the rank to kill through /proc")
def test_a_killed_rank_ends_the_run_and_a_rerun_loses_nothing(tmp_path):
    prompts = prompts_file(tmp_path / "in.jsonl", 40)
    out = tmp_path / "out.jsonl"
    command = launch_command(*mlxllama_cli("batch", str(prompts), "-o", str(out), "-n", "16", "-b", "2", "--data-parallel"))
    tag = str(time.time_ns())
    env = {**os.environ, "MLXLLAMA_TEST_RUN": tag}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as run:
        deadline = time.monotonic() + 120
        while (not out.exists() or not out.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        victim = rank_pid(1, tag)
        assert victim is not None and out.read_text(), "no rank 1 found, or no result written in time"
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = run.communicate(timeout=60)
    assert time.monotonic() - killed < 20
    written = records(out)
    assert 0 < len(written) < 40
    assert "mlxllama: error: rank 0:" in stderr and "Traceback" not in stderr, stderr
    launch(*mlxllama_cli("batch", str(prompts), "-o", str(out), "-n", "16", "-b", "2", "--data-parallel"))
    expected = tmp_path / "single.jsonl"
    single("batch", str(prompts), "-o", str(expected), "-n", "16")
    assert records(out) == records(expected)  # every id once, in input order


def test_launch_errors_are_one_line(tmp_path):
    for args, message in ((["generate", "--pipeline", "-p", "hi"], "--pipeline splits a model over the processes"),
                          (["batch", "--data-parallel", str(prompts_file(tmp_path / "in.jsonl", 1))],
                           "--data-parallel spreads the lines")):
        result = single(*args)
        assert result.returncode == 2 and result.stderr.startswith(f"mlxllama: error: {message}"), result.stderr
    result = launch(*mlxllama_cli("inspect"))
    assert "mlxllama: error: mlxllama inspect does not run under mlx.launch" in result.stderr
    assert result.stderr.count("mlxllama: error") == 1  # rank 0 says it for both
    result = launch(*mlxllama_cli("generate", "-p", "-"), stdin="hi\n")
    assert "standard input never ends" in result.stderr
    result = launch(*mlxllama_cli("serve", "--engine", "process"))
    assert "mlxllama: error: --engine process is not supported under mlx.launch" in result.stderr


def test_each_rank_holds_its_share_of_the_layers_and_the_replicated_rest(tmp_path):
    # On chat-tiny the embedding and head are 78% of the weights; in a TinyLlama-shape file the
    # layers dominate, so halving them shows.
    model = tmp_path / "tinyllama.gguf"
    args = ["bench", "--synthetic", "tinyllama-1.1b", "-m", str(model), "-p", "0", "-n", "0", "--json"]
    whole = json.loads(single(*args).stdout)["weight_bytes"]
    for split, layers in (([], [[0, 22], [0, 22]]), (["--pipeline"], [[0, 11], [11, 22]])):
        report = json.loads(launch(*mlxllama_cli(*args, *split)).stdout)
        assert [r["layers"] for r in report["ranks"]] == layers
        layer_bytes = [r["layer_bytes"] for r in report["ranks"]]
        replicated = report["ranks"][0]["replicated_bytes"]
        # the layers' halves make up the whole model's layers; embedding, norms and head are on each rank
        assert sum(layer_bytes) + replicated == pytest.approx(whole, rel=0.01)
        for rank in report["ranks"]:
            assert rank["layer_bytes"] == pytest.approx(sum(layer_bytes) / 2, rel=0.01)
            assert rank["weight_bytes"] == pytest.approx(rank["layer_bytes"] + rank["replicated_bytes"], rel=0.01)
            assert rank["weight_bytes"] < 0.6 * whole


# Split by tensor: each decoder call travels to the other rank (server/replicas.py) whatever the
# split, and the pipeline's forward pass is tested through generate, chat and batch above.
@pytest.mark.parametrize("split", [[]])
def test_serve_under_launch_answers_concurrent_clients_as_one_process(split):
    openai = pytest.importorskip("openai")  # a test extra; the GPU machine has it only where carried

    ranks = free_port(2)
    port = next(p for p in iter(free_port, None) if p not in (ranks, ranks + 1))
    command = launch_command(*mlxllama_cli("serve", "--port", str(port), *split), port=ranks)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as server:
        try:
            wait_until_serving(f"http://127.0.0.1:{port}", server, seconds=120)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
            # chat-tiny's greedy answers in one process (tests/cli/test_cli.py holds them to that)
            questions = {"What is the capital of Japan?": "The capital of Japan is Tokyo.",
                         "What is 17 plus 25?": "17 plus 25 is 42."}

            def ask(question: str) -> str:
                reply = client.chat.completions.create(model="m", max_tokens=24,
                                                       messages=[{"role": "user", "content": question}])
                return reply.choices[0].message.content

            # Rows joining and leaving one batch of the split model, as the engine decides on rank 0.
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(ask, list(questions) * 2))
            assert replies == list(questions.values()) * 2
            stream = client.chat.completions.create(model="m", max_tokens=24, stream=True,
                                                    messages=[{"role": "user", "content": "What is 17 plus 25?"}])
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "17 plus 25 is 42."
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            _, stderr = server.communicate(timeout=30)
    assert "Traceback" not in stderr, stderr


def test_split_parity_and_allreduce_cost_measure_a_launched_split(tmp_path):
    """The scripts behind docs/benchmarks.md's several-GPU run, on the ring: a split against one
    process (float32 here, so equal ids and logits within the split's reordering) and what an
    all-reduce adds to a step."""
    ref, report, cost = tmp_path / "ref.npz", tmp_path / "parity.json", tmp_path / "allreduce.json"
    script = str(HERE.parent.parent / "benchmarks" / "split_parity.py")
    subprocess.run([sys.executable, script, str(CHAT_TINY), "--save", str(ref), "-n", "12"], check=True,
                   capture_output=True, timeout=120)
    result = launch(sys.executable, script, str(CHAT_TINY), "--against", str(ref), "--pipeline", "--json", str(report))
    assert "chat-tiny-Q4_K_M.gguf pipeline x2: greedy ids equal" in result.stdout, result.stdout + result.stderr
    parity = json.loads(report.read_text())
    assert parity["tokens"] == 12 and parity["greedy_equal"] and parity["max_abs_logit_diff"] < 1e-3
    launch(sys.executable, str(HERE.parent.parent / "benchmarks" / "allreduce_cost.py"), "--hidden", "64",
           "--rows", "1,4", "--repeats", "2", "--count", "4", "--json", str(cost))
    rows = json.loads(cost.read_text())
    assert [(r["ranks"], r["rows"], r["hidden"]) for r in rows] == [(2, 1, 64), (2, 4, 64)]
    assert all(r["chain_ms"] > 0 for r in rows)
