"""The measurement scripts in benchmarks/ that the documented GPU results came from, run as a
maintainer runs them and kept in step with the code they instrument (their GPU runs cannot happen in CI)."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import types

import gguf
import pytest

from conftest import REPO, find_fixture_model


def run_script(*args: str) -> str:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def test_layer_timeline_stamps_the_start_each_barrier_and_the_end_of_the_layer_kernel():
    timed = run_script("benchmarks/layer_timeline.py", "--header-only")
    body = timed.split("unsigned long long* times) {")[1]
    # Stamp 0 at the start, 2i+1 and 2i+2 around barrier i, 9 at the end: the order report() reads them in.
    assert [int(i) for i in re.findall(r"stamp\(times, (\d+)\)", body)] == list(range(10))
    assert body.count("grid_barrier(arrivals);") == 4


def test_layer_timeline_times_another_source_given(tmp_path):
    variant = tmp_path / "variant.cu"
    variant.write_text((REPO / "mlxllama/cuda/decode_step.cu").read_text().replace(
        "constexpr int LAYER_THREADS", "constexpr int A_VARIANT = 1;\nconstexpr int LAYER_THREADS", 1))
    assert "A_VARIANT" not in run_script("benchmarks/layer_timeline.py", "--header-only")
    timed = run_script("benchmarks/layer_timeline.py", "--header-only", "--source", str(variant))
    assert "constexpr int A_VARIANT = 1;" in timed and timed.count("grid_barrier(arrivals);") == 4
    missing = subprocess.run([sys.executable, "benchmarks/layer_timeline.py", "--header-only", "--source",
                              str(tmp_path / "none.cu")], cwd=REPO, capture_output=True, text=True)
    assert missing.returncode == 2 and "no such file" in missing.stderr.splitlines()[-1]


def test_attention_stamps_mark_each_phase_of_a_team_item_in_order():
    stamped = run_script("benchmarks/attention_stamps.py", "--header-only")
    team = stamped.split("__device__ void team_attention(")[1].split("__device__ void reset_runs_done(")[0]
    # The item's start (0), its queries staged (1), the run written (6), the team's results combined
    # (7), its arrival (8) and the teams' results combined (9), around the run's own: report()'s order.
    assert [int(i) for i in re.findall(r"ASTAMP\(sb, (\d+)\)", team)] == [0, 1, 6, 7, 8, 9]
    run = stamped.split("__device__ void attention_run(")[1].split("__device__")[0]
    # Inside the loop over its chunks, for the first: scored (12), weighted (13) and done (10).
    assert [int(i) for i in re.findall(r"ASTAMP\(sb, (\d+)\)", run)] == [2, 12, 13, 10, 3, 4, 5]
    # The same phases of a run on tensor cores, which has no new slot to take nor a finish.
    tensor_run = stamped.split("__device__ void tensor_attention_run(")[1].split("__device__")[0]
    assert [int(i) for i in re.findall(r"ASTAMP\(sb, (\d+)\)", tensor_run)] == [2, 12, 13, 10, 3]
    assert "bool whole, int sb = -1) {" in tensor_run
    # Both runs' calls in team_attention pass the item's stamps on; the batch kernel's are unstamped.
    assert team.count("whole, sb);") == 2
    items = stamped.split("__device__ void attention_items(")[1].split("__device__ void team_attention(")[0]
    assert "ASTAMP" not in items and ", sb)" not in items
    assert "unsigned long long* att) {" in stamped


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_kernel_sass_compiles_the_one_sequence_kernel_spilling_no_more_than_measured():
    # ptxas's counts for the plain cache's one-sequence kernel in a 512-thread block's 128 registers
    # a thread: its attention on tensor cores holds the next step's rows ahead, for which it spills
    # some 70-120 bytes (stores; 68 since teams), and that build measured faster than one that
    # spilled nothing (docs/benchmarks.md, "One sequence's attention on tensor cores"). A change that
    # spills much more (heads of 128 would: 1.9 KB) shows here.
    out = run_script("benchmarks/kernel_sass.py", "--cache", "plain")
    counts = re.fullmatch(r"layer_kernel, plain cache: (\d+) bytes spill stores, (\d+) bytes spill loads; "
                          r"Used (\d+) registers\n", out)
    assert counts, out
    stores, loads, registers = map(int, counts.groups())
    assert stores <= 160 and loads <= 400 and registers <= 128, out


def test_kernel_sass_counts_a_layer_kernel_s_spill_instructions_step_by_step(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import kernel_sass

    def barrier(i):
        return f"        /*0{i}0*/  @P1 ATOMG.E.ADD.64.STRONG.GPU PT, R2, desc[UR4][R4.64], R6 ;"

    step = ["        /*0100*/  STL [R1+0x4], R12 ;", "        /*0110*/  LDL.64 R8, [R1+0x8] ;",
            "        /*0120*/  LDG.E.STRONG.GPU R3, desc[UR4][R6.64] ;", "        /*0130*/  LDL R9, [R1] ;"]
    listing = step + [barrier(1)] + step[2:] + [barrier(2)] + step + step + [barrier(3), barrier(4)] + step[:1]
    assert kernel_sass.spills_by_step("\n".join(listing)) == \
        "spill instructions (stores/loads) by step: 1 1/2, 2 0/1, 3 2/4, 4 0/0, 5 1/0"
    # A kernel without the layer kernels' four barriers (q6_k.cu's): counted in all.
    assert kernel_sass.spills_by_step("\n".join(step + [barrier(1)] + step)) == "spill instructions (stores/loads): 2/4"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_kernel_sass_compiles_the_q6_k_kernels_without_spilling():
    out = run_script("benchmarks/kernel_sass.py", "--q6-k")
    labels = ["q6_k_product_kernel, 1 input", "q6_k_product_kernel, 16 inputs", "q6_k_head_kernel"]
    assert re.fullmatch("".join(rf"{label}: 0 bytes spill stores, 0 bytes spill loads; Used \d+ registers\n"
                                for label in labels), out), out


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("program", ["combine_runs_bench.cu", "ffn_products_bench.cu"])
def test_cuda_programs_build_against_the_kernels_as_they_are(program, tmp_path):
    # Each includes decode_step.cu and calls its helpers: a change there that they no longer build
    # with shows here.
    built = subprocess.run(["nvcc", "-std=c++17", "-O3", "-arch=sm_90", "-Xptxas", "-v", "-o", str(tmp_path / "bench"),
                            f"benchmarks/{program}"], cwd=REPO, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    if program == "ffn_products_bench.cu":
        # Its variants are compared as the products would run in the layer kernel, which spills
        # nothing in them: none of its kernels may spill either.
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", built.stderr)
        assert len(spills) > 20 and all(stores == loads == "0" for stores, loads in spills), built.stderr


def test_host_time_splits_each_step_into_host_and_wait(tmp_path):
    out = tmp_path / "host_time.json"
    run_script("benchmarks/host_time.py", str(find_fixture_model("chat-tiny-Q4_K_M.gguf")), "--reps", "3",
               "--tokens", "6", "--json", str(out))
    report = json.loads(out.read_text())
    assert report["tokens"] == 6 and len(report["reps"]) == 3
    for rep in report["reps"]:
        # The host's part and the wait are two disjoint parts of a step: together no longer than the step.
        step_us = 1e6 / rep["tokens_per_second"]
        assert 0 < rep["host_us_per_step"] and 0 <= rep["wait_us_per_step"]
        assert rep["host_us_per_step"] + rep["wait_us_per_step"] <= step_us


class StandInProfile:
    """torch.profiler.profile with two kernels and one launch a traced call (CUPTI runs only on a GPU)."""

    def __init__(self, activities):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def export_chrome_trace(self, path: str) -> None:
        events = [{"cat": "kernel", "name": "gemm", "ts": 0, "dur": 30}, {"cat": "kernel", "name": "softmax", "ts": 40, "dur": 10},
                  {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 4}]
        with open(path, "w") as f:
            json.dump({"traceEvents": events}, f)


@pytest.mark.parametrize("how, attended", [((), "explicit"), (("--fused-prefill",), "fused"), (("--mlx-lm",), None)])
def test_kernel_trace_traces_prefills_attended_explicitly_fused_or_by_mlx_lm(monkeypatch, tmp_path, how, attended):
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(synchronize=lambda: None)
    profiler = types.ModuleType("torch.profiler")
    profiler.ProfilerActivity, profiler.profile = types.SimpleNamespace(CUDA="cuda"), StandInProfile
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    with monkeypatch.context() as only_for_the_import:  # mlx-lm's imports must not find the stand-in
        only_for_the_import.setitem(sys.modules, "torch", torch)
        only_for_the_import.setitem(sys.modules, "torch.profiler", profiler)
        only_for_the_import.delitem(sys.modules, "kernel_trace", raising=False)
        import kernel_trace

    import mlxllama

    load = mlxllama.load

    def load_as_on_cuda(path):  # where the runtime attends a prefill shape explicitly when it first meets it
        runtime = load(path)
        runtime.model.attend_prefill("explicit-first")
        return runtime

    fed = []
    monkeypatch.setattr(kernel_trace.mlxllama, "load", load_as_on_cuda)
    monkeypatch.setattr(kernel_trace.bench, "feed", lambda runtime, cache, ids: fed.append(
        (runtime.model.prefill_attention, cache[0].offset, [len(row) for row in ids])))
    monkeypatch.setattr(kernel_trace.MlxLm, "feed", lambda self, cache, ids: fed.append((None, cache[0].offset, [ids.shape[1]])))
    out = tmp_path / "trace.json"
    monkeypatch.setattr(sys, "argv", ["kernel_trace.py", str(find_fixture_model("chat-tiny-Q4_K_M.gguf")), "--prefill", "24",
                                      "--steps", "2", *how, "--json", str(out)])
    kernel_trace.main()
    # A warm-up and the traced prefills, each of 24 ids into an empty cache, attended as asked.
    assert fed == [(attended, 0, [24])] * 4
    report = json.loads(out.read_text())
    assert report["step"] == "prefill 24: " + {(): "explicit", ("--fused-prefill",): "fused", ("--mlx-lm",): "mlx-lm"}[how]
    assert (report["kernels_per_step"], report["busy_us_per_step"], report["span_us_per_step"]) == (1.0, 20.0, 25.0)
    assert report["top"][0] == ["gemm", 15.0, 0.5] and report["api"] == [["cudaLaunchKernel", 2.0, 0.5]]


def test_kernel_trace_names_a_bad_model_or_a_missing_torch_in_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(10))
    stand_in = tmp_path / "stand_in"
    (stand_in / "torch").mkdir(parents=True)
    (stand_in / "torch" / "__init__.py").write_text("cuda = None\n")
    (stand_in / "torch" / "profiler.py").write_text("ProfilerActivity = profile = None\n")
    missing = tmp_path / "missing"
    (missing / "torch").mkdir(parents=True)
    (missing / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    for path, message in [(stand_in, "kernel_trace.py: error: "), (missing, "kernel_trace.py: needs PyTorch")]:
        run = subprocess.run([sys.executable, "benchmarks/kernel_trace.py", str(bad), "--prefill", "8"], cwd=REPO,
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(path)})
        assert run.returncode == 2 and run.stdout == ""
        assert run.stderr.startswith(message) and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_moe_prefill_times_both_orders_of_the_same_products(tmp_path):
    out = tmp_path / "moe.json"
    table = run_script("benchmarks/moe_prefill.py", "--experts", "8", "--used", "2", "--hidden", "64", "--width", "32",
                       "--tokens", "3,40", "--repetitions", "1", "--json", str(out))
    report = json.loads(out.read_text())
    assert [(r["tokens"], r["pairs"]) for r in report["rows"]] == [(3, 6), (40, 80)]
    # The same products in another order: equal up to float32 rounding (both run on the CPU here).
    assert all(r["largest_difference"] < 1e-5 and r["token_order_s"] > 0 < r["expert_order_s"] for r in report["rows"])
    assert "| 40 | 80 |" in table


def test_versus_mlx_lm_times_both_engines_on_every_test_and_counts_their_launches(tmp_path):
    out = tmp_path / "versus.json"
    table = run_script("benchmarks/versus_mlx_lm.py", str(find_fixture_model("chat-tiny-Q4_K_M.gguf")), "-p", "16",
                       "-n", "4", "--batches", "1,2", "--depths", "0,8", "--rounds", "2", "--ours-generate-step",
                       "--ours-fused-prefill", "--json", str(out))
    report = json.loads(out.read_text())
    rows = [(r["test"], r["batch"], r["depth"]) for r in report["rows"]]
    assert rows == [("pp16", 1, 0)] + [("tg4", b, d) for d in (0, 8) for b in (1, 2)]
    for r in report["rows"]:
        assert len(r["ours"]) == len(r["mlx_lm"]) == 2
        assert r["ratio"] == pytest.approx(statistics.median(r["ours"]) / statistics.median(r["mlx_lm"]))
        assert r["spread"][0] <= r["ratio"] <= r["spread"][1]
        # Round by round: each round's ours over the same round's mlx-lm, never outside the spread.
        assert r["paired"] == pytest.approx(versus_paired(r["ours"], r["mlx_lm"]))
        assert r["spread"][0] <= r["paired"][1] <= r["paired"][0] <= r["paired"][2] <= r["spread"][1]
        if r["test"] == "tg4":
            # mlx-lm's Llama launches a product per projection (7 a layer) and the head's.
            assert r["mlx_lm_launches"] > 7 * 6 and r["ours_launches"] > 0
            assert all(us > 0 for us in r["ours_host_us"])
            # One sequence goes through mlx-lm's generate_step, whose host time is not visible from outside.
            assert r["mlx_lm_host_us"] is None if r["batch"] == 1 else all(us > 0 for us in r["mlx_lm_host_us"])
        # --ours-generate-step: our one sequence in mlx-lm's loop too, a third engine of the same rounds.
        if r["test"] == "tg4" and r["batch"] == 1:
            assert len(r["ours_generate_step"]) == 2 and all(speed > 0 for speed in r["ours_generate_step"])
            assert r["ours_generate_step_ratio"] == pytest.approx(
                statistics.median(r["ours_generate_step"]) / statistics.median(r["mlx_lm"]))
        else:
            assert "ours_generate_step" not in r
        # --ours-fused-prefill: our prefill with MLX's fused attention, a third engine of the pp test.
        if r["test"] == "pp16":
            fused = r["ours_fused_prefill"]
            assert len(fused) == 2 and r["ours_fused_prefill_ratio"] == pytest.approx(
                statistics.median(fused) / statistics.median(r["mlx_lm"]))
            assert r["ours_fused_prefill_paired"] == pytest.approx(versus_paired(fused, r["mlx_lm"]))
        else:
            assert "ours_fused_prefill" not in r
    # Our file holds Q4_K at 5 bits and Q6_K at 8.5, mlx-lm's random weights 4 bits and a half.
    assert report["ours_weight_bytes"] > report["mlx_lm_weight_bytes"] > 0
    assert "| tg4 | 2 | 8 |" in table
    assert "| test | depth | ours in generate_step t/s |" in table and "\n| tg4 | 8 | " in table
    assert "| test | ours, fused prefill t/s |" in table


def versus_paired(ours: list[float], theirs: list[float]) -> list[float]:
    """The median of each round's own ratio, the lowest and the highest."""
    rounds = [a / b for a, b in zip(ours, theirs)]
    return [statistics.median(rounds), min(rounds), max(rounds)]


def test_the_rounds_warm_up_twice_where_a_prefill_shape_is_planned_when_met_again(monkeypatch):
    # bench.warm_up_runs: CUDA's EXPLICIT_FIRST prefill plans the fused kernel on a shape's second
    # meeting, which neither bench's nor the scripts' timed runs may pay.
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import versus_mlx_lm

    import mlxllama
    from mlxllama import bench

    runtime = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
    assert bench.warm_up_runs(runtime) == 1
    runtime.model.attend_prefill("explicit-first")
    assert bench.warm_up_runs(runtime) == 2
    seeds, host = [], {"a": [(1.0, 2.0)]}
    samples = versus_mlx_lm.interleaved_rounds({"a": lambda seed: seeds.append(seed) or 1.0}, 2, host, warm_ups=2)
    assert seeds == [10_000, 10_001, 0, 1] and samples == {"a": [1.0, 1.0]} and host == {"a": []}


def test_versus_mlx_lm_times_a_fused_prefill_and_gives_the_model_its_choice_back(monkeypatch):
    # On CUDA the runtime attends a prefill shape explicitly when it first meets it; the fused engine
    # attends every shape fused for its own runs only.
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import versus_mlx_lm

    import mlxllama

    runtime = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
    runtime.model.attend_prefill("explicit-first")
    seen = []
    monkeypatch.setattr(versus_mlx_lm.bench, "time_prompt",
                        lambda rt, n_prompt, seed: seen.append((rt.model.prefill_attention, n_prompt)) or 0.25)
    assert versus_mlx_lm.time_fused_prefill(runtime, 16, 0) == 0.25
    assert seen == [("fused", 16)] and runtime.model.prefill_attention == "explicit-first"


@pytest.mark.parametrize("rows, our_slots", [(2, 512), (1, 544)])
def test_versus_mlx_lm_fills_both_caches_to_the_depth_with_room_for_the_run(monkeypatch, rows, our_slots):
    # --fill random: every layer of both engines' caches at the depth, in buffers each engine's own
    # cache would grow to (ours one channel block past the 256 grid for one row, mlx-lm's on it),
    # and a timed run neither grows a buffer (a copy of the cache, off the step's true cost) nor
    # leaves the depth behind.
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import versus_mlx_lm

    import mlxllama
    from mlxllama import bench

    runtime = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
    theirs = versus_mlx_lm.MlxLm(runtime.config, runtime.model.compute_dtype)
    ours_cache = versus_mlx_lm.filled_ours(runtime, rows, 300, 8)
    theirs_cache = theirs.filled(rows, 300, 8, runtime.model.compute_dtype)
    for cache, slots in ((ours_cache, our_slots), (theirs_cache, 512)):
        assert len(cache) == 6 and {(layer.offset, layer.keys.shape) for layer in cache} == {(300, (rows, 2, slots, 32))}
    buffers = [(layer.keys, layer.values) for layer in ours_cache + theirs_cache]
    bench.time_generation(runtime, rows, 8, 0, 300, [], ours_cache)
    theirs.time_generation(theirs_cache, rows, 8, 0, 300, [])
    for layer, (keys, values) in zip(ours_cache + theirs_cache, buffers):
        assert layer.offset == 300 and layer.keys is keys and layer.values is values


def test_versus_mlx_lm_refuses_depths_past_the_context_in_one_line(tmp_path):
    # chat-tiny's context is 512: the default depths (to 8,192) do not fit it, nor does a truncated file load.
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(find_fixture_model("chat-tiny-Q4_K_M.gguf").read_bytes()[:300])
    chat_tiny = str(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
    for args, message in (([chat_tiny], "at depth 8192 do not fit the model's context of 512"),
                          ([chat_tiny, "-p", "-3", "--depths", "0"], "must be 0 or more, not pp-3 / tg128 at depths 0"),
                          ([str(truncated)], "truncated or corrupt")):
        result = subprocess.run([sys.executable, "benchmarks/versus_mlx_lm.py", *args], cwd=REPO,
                                capture_output=True, text=True)
        assert result.returncode == 2 and result.stdout == ""
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and message in errors[0]


def test_host_profile_times_both_engines_with_and_without_the_collector_and_profiles_each(tmp_path):
    out = tmp_path / "host_profile.json"
    table = run_script("benchmarks/host_profile.py", str(find_fixture_model("chat-tiny-Q4_K_M.gguf")), "-n", "4",
                       "--batches", "1,2", "--depths", "0,8", "--rounds", "2", "--top", "60", "--json", str(out))
    report = json.loads(out.read_text())
    assert [(r["batch"], r["depth"]) for r in report["rows"]] == [(1, 0), (2, 0), (1, 8), (2, 8)]
    for row in report["rows"]:
        runs = {(run["engine"], run["gc"]): run for run in row["runs"]}
        assert set(runs) == {(engine, gc) for engine in ("ours", "mlx-lm") for gc in (True, False)}
        assert all(len(run["tps"]) == 2 and len(run["host_us"]) == 2 and min(run["host_us"]) > 0 for run in runs.values())
        # Each engine's own code under the profiler, a call a layer a step: chat-tiny has 6 layers.
        ours = {p["function"]: p for p in row["profiles"]["ours"]}
        theirs = {p["function"]: p for p in row["profiles"]["mlx-lm"]}
        attention = next(p for name, p in ours.items() if name.startswith("transformer.py:") and "(attention)" in name)
        assert attention["calls"] == 6 and attention["total_us"] >= attention["own_us"] > 0
        assert any(name.startswith("llama.py:") and p["calls"] == 6 for name, p in theirs.items())
    assert "| mlx-lm | off |" in table and "ours, under cProfile" in table


def test_graph_build_times_both_engines_building_a_step_on_the_cpu():
    # 20 builds a profile: over 3, one build slowed by a busy CI machine could push every layer
    # function out of the top 5 (it did, once, beside another test worker on 2 cores).
    built = run_script("benchmarks/graph_build.py", str(find_fixture_model("chat-tiny-Q4_K_M.gguf")), "--reps", "20",
                       "--rounds", "2", "--batch", "2", "--profile", "5")
    for engine in ("ours", "mlx-lm"):
        medians = re.search(rf"^{engine}: µs a build, median of each round: (\d+), (\d+) \(fastest (\d+)\)$", built, re.M)
        assert medians and int(medians[3]) == min(int(medians[1]), int(medians[2])) > 0
    # The profiles name each engine's layer code, a call a layer (6) a build.
    ours = built.split("ours, under cProfile")[1].split("mlx-lm, under cProfile")[0]
    assert re.search(r" 6\.0  transformer\.py:\d+\(", ours)
    assert re.search(r" 6\.0  llama\.py:\d+\(", built.split("mlx-lm, under cProfile")[1])


def test_op_cost_splits_each_operation_into_build_and_hand_over_and_names_a_bad_model(tmp_path):
    out = tmp_path / "ops.json"
    printed = run_script("benchmarks/op_cost.py", "--model", str(find_fixture_model("chat-tiny-Q4_K_M.gguf")),
                         "--chain", "3", "--rounds", "1", "--json", str(out))
    result = json.loads(out.read_text())
    assert (result["chain"], result["rounds"]) == (3, 1)
    ops = result["us_per_op"]
    assert {"residual add, compiled, two outputs (residual_add)", "token embedding lookup (the file's; lookups apart, not chained)",
            "one layer of the plain step, 16 cached positions"} <= set(ops)
    for name, us in ops.items():
        # The host's two parts happen inside the wall time, which also waits for the result.
        assert 0 < us["build"] and 0 < us["hand-over"] and us["build"] + us["hand-over"] <= us["wall"], name
        assert f"| {name} | {us['wall']} | {us['build']} | {us['hand-over']} |" in printed
    bad = subprocess.run([sys.executable, "benchmarks/op_cost.py", "--model", str(tmp_path / "missing.gguf")],
                         cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "missing.gguf" in bad.stderr


def test_step_ab_times_two_builds_of_the_package_and_mlx_lm_in_one_process(tmp_path):
    shutil.copytree(REPO / "mlxllama", tmp_path / "mlxllama_before", ignore=shutil.ignore_patterns("*.gguf", "templates"))
    out = tmp_path / "ab.json"
    printed = run_script("benchmarks/step_ab.py", str(find_fixture_model("chat-tiny-Q4_K_M.gguf")), "--before",
                         str(tmp_path), "-p", "6", "-n", "4", "--batches", "1,2", "--depths", "0,8", "--rounds", "2",
                         "--json", str(out))
    report = json.loads(out.read_text())
    assert [(r["test"], r["batch"], r["depth"]) for r in report["rows"]] == [
        ("pp6", 1, 0), ("tg4", 1, 0), ("tg4", 2, 0), ("tg4", 1, 8), ("tg4", 2, 8)]
    for r in report["rows"]:
        assert {name: len(tps) for name, tps in r["tps"].items()} == {"after": 2, "before": 2, "mlx-lm": 2}
        for other in ("before", "mlx-lm"):
            ratio = statistics.median(r["tps"]["after"]) / statistics.median(r["tps"][other])
            assert r[f"after/{other}"] == pytest.approx(ratio)
            assert r[f"after/{other} spread"][0] <= ratio <= r[f"after/{other} spread"][1]
            assert r[f"after/{other} paired"] == pytest.approx(versus_paired(r["tps"]["after"], r["tps"][other]))
        assert r["test"] == "pp6" or all(min(us) > 0 for us in r["host_us"].values())
    assert printed.count("after/before") == 5 and printed.startswith("pp6 b=1 d=0: after ")
    missing = subprocess.run([sys.executable, "benchmarks/step_ab.py", str(find_fixture_model("chat-tiny-Q4_K_M.gguf")),
                              "--before", str(tmp_path / "nowhere")], cwd=REPO, capture_output=True, text=True)
    assert missing.returncode == 1 and missing.stderr.strip().endswith("step_ab.py: no mlxllama_before in "
                                                                       + str(tmp_path / "nowhere"))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(find_fixture_model("chat-tiny-Q4_K_M.gguf").read_bytes()[:300])
    refused = subprocess.run([sys.executable, "benchmarks/step_ab.py", str(truncated), "--before", str(tmp_path)],
                             cwd=REPO, capture_output=True, text=True)
    errors = [line for line in refused.stderr.splitlines() if "error" in line]
    assert refused.returncode == 2 and len(errors) == 1 and "truncated or corrupt" in errors[0]
    too_long = subprocess.run([sys.executable, "benchmarks/step_ab.py", str(find_fixture_model("chat-tiny-Q4_K_M.gguf")),
                               "--before", str(tmp_path), "-p", "600", "--depths", "0"], cwd=REPO, capture_output=True, text=True)
    errors = [line for line in too_long.stderr.splitlines() if "error" in line]
    assert too_long.returncode == 2 and errors == ["step_ab.py: error: pp600 / tg128 at depth 0 do not fit the model's"
                                                   " context of 512 tokens"]


def test_native_profile_counts_a_frame_anywhere_on_a_stack_and_only_samples_of_the_timed_loop(tmp_path):
    raw = tmp_path / "raw.txt"
    # py-spy's raw format: a stack's frames, outermost first, joined by ';', then the samples that saw it.
    raw.write_text(
        "<module> (x.py:1);load (mlxllama/weights.py:71);mlx::core::eval (libmlx.so) 50\n"
        "<module> (x.py:1);timed_decode (native_profile.py:81);Transformer.step (mlxllama/models/transformer.py:414) 3\n"
        "<module> (x.py:1);timed_decode (native_profile.py:81);mlx::core::async_eval (libmlx.so);"
        "mlx::core::fast::ScaledDotProductAttention::eval_gpu (libmlx.so);mlx::core::sdpa_cudnn (libmlx.so);"
        "mlx::core::DnnGraph::encode_graph (libmlx.so) 4\n"
        "<module> (x.py:1);timed_decode (native_profile.py:81);mlx::core::async_eval (libmlx.so);"
        "mlx::core::cu::CommandEncoder::commit (libmlx.so) 1\n")
    printed = run_script("benchmarks/native_profile.py", "--summarize", str(raw))
    assert printed.startswith("8 samples in the timed loop")
    shares = re.findall(r"^ +([\d.]+)%  +(.+)$", printed, re.M)
    assert {label: float(share) for share, label in shares if float(share)} == {
        "the step built in Python (ours)": 37.5, "MLX's evaluation, all of it": 62.5,
        "attention (ScaledDotProductAttention::eval_gpu)": 50.0, "through cuDNN (sdpa_cudnn)": 50.0,
        "cuDNN's CUDA graph updated (DnnGraph::encode_graph)": 50.0,
        "the CUDA graph launched (CommandEncoder::commit)": 12.5}
    # Gzipped, and with the samples under cuDNN's graph left out: 3 of Python's and 1 of the commit's remain.
    zipped = tmp_path / "raw.txt.gz"
    zipped.write_bytes(gzip.compress(raw.read_bytes()))
    printed = run_script("benchmarks/native_profile.py", "--summarize", str(zipped), "--leave-out", "DnnGraph::encode_graph")
    assert printed.startswith("4 samples in the timed loop") and "   75.0%  the step built in Python (ours)" in printed
    # Another loop's samples, counted by naming its function: the 50 of the load, none of them in a step.
    printed = run_script("benchmarks/native_profile.py", "--summarize", str(raw), "--loop-frame", "load")
    assert printed.startswith("50 samples in the timed loop") and "    0.0%  the step built in Python (ours)" in printed
    (tmp_path / "uncounted.txt").write_text("<module> (x.py:1);timed_decode (native_profile.py:81) x\n")
    for args, message in ((["--summarize", str(tmp_path / "none.txt")], "none.txt: No such file"),
                          (["--summarize", str(tmp_path / "uncounted.txt")], "not a raw py-spy file (line 1: no sample count)"),
                          (["--summarize", str(raw), "--loop-frame", "run"], "raw.txt: no samples inside run()")):
        refused = subprocess.run([sys.executable, "benchmarks/native_profile.py", *args], cwd=REPO,
                                 capture_output=True, text=True)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and message in refused.stderr


def test_native_profile_samples_either_engine_decoding_under_py_spy(tmp_path):
    model = str(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
    for engine in ("ours", "mlx-lm"):
        out, raw = tmp_path / f"{engine}.json", tmp_path / f"{engine}.txt"
        printed = run_script("benchmarks/native_profile.py", model, "--depth", "64", "-n", "8", "--seconds", "3", "--rate", "200",
                             "--raw", str(raw), "--json", str(out), *(["--mlx-lm"] if engine == "mlx-lm" else []))
        report = json.loads(out.read_text())
        assert printed.startswith(f"{engine}, batch 1, depth 64: ") and report["tokens_per_s"] > 0
        assert report["samples"] > 10 and "timed_decode (native_profile.py:" in raw.read_text()
        shares = report["shares"]
        # Each engine's Python builds its step, and MLX evaluates it: the other engine's frames are never sampled.
        assert shares[f"the step built in Python ({engine})"] > 0 and shares["MLX's evaluation, all of it"] > 0
        assert shares[f"the step built in Python ({'ours' if engine == 'mlx-lm' else 'mlx-lm'})"] == 0
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(find_fixture_model("chat-tiny-Q4_K_M.gguf").read_bytes()[:300])
    refused = subprocess.run([sys.executable, "benchmarks/native_profile.py", str(truncated)], cwd=REPO,
                             capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "truncated or corrupt" in refused.stderr


def test_kv_key_grouping_measures_what_the_quantized_cache_does(tmp_path):
    """Its 'head' way is --kv-bits 4 as the product stores it: chat-tiny's heads are one group, so
    the product's perplexity is matched to the last digit, and the unquantized one likewise."""
    import mlxllama
    from mlxllama.cache import KVQuantization
    from mlxllama.perplexity import perplexity, read_text

    model, corpus = find_fixture_model("chat-tiny-Q4_K_M.gguf"), REPO / "tests" / "fixtures" / "perplexity-corpus.txt"
    lines = [json.loads(line) for line in run_script("benchmarks/kv_key_grouping.py", str(model), str(corpus),
                                                     "--keys", "head,centered,nvfp4").splitlines()]
    assert [line["keys"] for line in lines] == ["unquantized", "head", "centered", "nvfp4"]
    # the same 4 bits along the head, of keys less their channels' means: chat-tiny's +3.4%
    assert 0 < lines[2]["rise"] < lines[1]["rise"] - 0.02
    # 4-bit floats in groups of 16 along the head: chat-tiny's -2.3%, against +8.2% for affine 4 bits
    assert lines[3]["rise"] < lines[1]["rise"] - 0.05
    lines = lines[:2]
    text = read_text(str(corpus))
    for line, quantization in zip(lines, (None, KVQuantization(bits=4))):
        runtime = mlxllama.load(model, context_length=512, kv_quantization=quantization)
        ppl = perplexity(runtime.model, runtime.tokenize(text, add_bos=True), 512, runtime.tokenizer.bos_id).ppl
        assert line["ppl"] == round(ppl, 4)
    assert lines[1]["rise"] > 0.05  # 4 bits along the head: chat-tiny's +7.9%


def test_kv_key_grouping_names_an_unknown_way_in_one_line():
    result = subprocess.run([sys.executable, "benchmarks/kv_key_grouping.py", "m.gguf", "t.txt", "--keys", "rows"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr == (
        "kv_key_grouping.py: error: --keys: no way named 'rows' (one of head, full, 8, tokens, scaled, centered, nvfp4, mxfp4)\n")


def test_channel_keys_decode_times_two_decodings_of_the_same_keys():
    """The script checks that the fused decoding gives the shipped one's keys to the bit before it
    times them; patched in, perplexity with keys by channel is the shipped figure to the last digit."""
    lines = run_script("benchmarks/channel_keys_decode.py", "--depth", "100", "--runs", "2").splitlines()
    assert [line.split(":")[0] for line in lines] == ["shipped", "fused"]
    assert all(" us a layer's keys at depth 100 on Device(" in line for line in lines)
    model, corpus = find_fixture_model("chat-tiny-Q4_K_M.gguf"), REPO / "tests" / "fixtures" / "perplexity-corpus.txt"
    patched = run_script("benchmarks/channel_keys_decode.py", "--patch", "perplexity", "-m", str(model), str(corpus),
                         "--ctx", "512", "--kv-bits", "4", "--kv-keys-by-channel", "--json")
    assert round(json.loads(patched)["ppl"], 4) == 12.9591  # tests/cli/test_kv_cache_cli.py's


def test_kv_round_trip_rounding_finds_the_cpu_cache_equal_to_its_round_trip():
    """The figures behind assert_close's GPU bound: on the CPU each quantized cache equals its
    round trip to the bit, and quantizing moves the output (the unquantized lines by nothing)."""
    lines = [json.loads(line) for line in run_script("benchmarks/kv_round_trip_rounding.py", "--only", "qwen3").splitlines()]
    assert [line["case"].split()[0] for line in lines] == ["chunked"] * 4 + ["by_channel", "unquantized", "unquantized",
                                                                             "keys8"]
    assert all(line["diff_max"] == 0 for line in lines)
    assert all((line["quant_mean"] > 0.01) == (line["case"].split()[0] != "unquantized") for line in lines)


def test_q6k_six_bits_finds_the_argmax_flip_that_keeps_q6_k_at_8_bits():
    """The measurement behind holding Q6_K at 8 bits, in groups of 32 or 64: on chat-tiny's Q6_K file
    the 6-bit form moves the mean KL to llama.cpp up and flips an argmax the parity tests hold, where
    groups of 64 flip none and stay within 1.5x the mean KL of groups of 32 (docs/benchmarks.md)."""
    model = find_fixture_model("chat-tiny-Q6_K.gguf")
    pairs, wide, six = (json.loads(line) for line in run_script("benchmarks/q6k_six_bits.py", str(model)).splitlines())
    assert [(f["q6_k_bits"], f["group_size"]) for f in (pairs, wide, six)] == [(8, 32), (8, 64), (6, 32)]
    assert pairs["argmax_flips"] == wide["argmax_flips"] == 0 and six["argmax_flips"] >= 1
    assert wide["mean_kl"] < 1.5 * pairs["mean_kl"] and six["mean_kl"] > 1.5 * wide["mean_kl"]
    assert pairs["mean_kl"] != wide["mean_kl"]  # two forms, not one measured twice


def test_q6k_groups_ab_times_both_forms_and_finds_a_launch_less_a_q6_k_matrix(tmp_path):
    """The A/B behind Q6_K's wide form, on chat-tiny in float16: the same bytes, and one launch fewer a
    step for each Q6_K matrix whose biases the pairs' form derives (its output layer and the layers
    whose attn_v or ffn_down llama.cpp's Q4_K_M mix makes Q6_K)."""
    path = find_fixture_model("chat-tiny-Q4_K_M.gguf")
    out = tmp_path / "ab.json"
    printed = run_script("benchmarks/q6k_groups_ab.py", str(path), "-n", "4", "--batches", "1", "--rounds", "2",
                         "--dtype", "float16", "--json", str(out))
    assert "pairs native " in printed and "wide native, wide Q6_K " in printed
    held = {line.split()[0]: int(line.split()[-4]) for line in printed.splitlines() if "bytes of weights" in line}
    assert held["pairs"] == held["wide"]
    (row,) = json.loads(out.read_text())["rows"]
    q6_k = sum(1 for t in gguf.GGUFReader(path).tensors if t.tensor_type == gguf.GGMLQuantizationType.Q6_K
               and t.name != "token_embd.weight")
    assert q6_k > 1 and row["launches"]["pairs"] - row["launches"]["wide"] == q6_k
    assert len(row["pairs"]) == len(row["wide"]) == 2 and row["ratio"] > 0


def test_sub_block_products_times_both_forms_and_finds_only_the_sub_blocks_exact(tmp_path):
    """The measurement behind the CPU's sub-block form (docs/benchmarks.md), on a small shape."""
    out = tmp_path / "products.json"
    printed = run_script("benchmarks/sub_block_products.py", "--shapes", "64x512", "--rows", "1,3", "--json", str(out))
    rows = json.loads(out.read_text())["results"]
    assert [(r["type"], r["rows"]) for r in rows] == [(t, n) for t in ("Q6_K", "Q4_K", "Q3_K", "Q2_K") for n in (1, 3)]
    bits = {r["type"]: (r["affine_bits"], r["sub_blocks_bits"]) for r in rows}
    assert bits == {"Q6_K": (8.5, 6.5625), "Q4_K": (5.0, 4.625), "Q3_K": (8.5, 4.5625), "Q2_K": (9.0, 3.125)}
    assert all(r["sub_blocks_error"] < 1e-5 and r["affine_ms"] > 0 and r["sub_blocks_ms"] > 0 for r in rows)
    assert all(r["affine_error"] > 1e-3 for r in rows if r["type"] in ("Q6_K", "Q2_K"))  # re-quantized
    assert printed.count("sub-blocks") == len(rows)


def test_engine_turns_times_every_call_and_every_request_of_a_burst(tmp_path):
    """Two clients, two requests each, on chat-tiny: every timed request was admitted and got a first
    token, repeated questions came from the prompt cache, and the calls account for the steps run."""
    out = tmp_path / "turns.json"
    printed = run_script("benchmarks/engine_turns.py", "--clients", "2", "--requests", "2", "--max-tokens", "4",
                         "--json", str(out))
    report = json.loads(out.read_text())
    assert report["clients"]["requests"] == 4 and len(report["requests"]) == 4
    assert all(r["queued_ms"] >= 0 and r["first_token_ms"] > 0 for r in report["requests"])
    assert any(r["cached_tokens"] > 0 for r in report["requests"])  # the untimed round stored them
    names = [c["name"] for c in report["calls"]]
    assert names.count("admit") == 4 and names.count("step") >= 3 and "eval_joins" not in names
    assert all(0 <= c["cpu_ms"] for c in report["calls"]) and report["loop_lag_ms"]
    assert "admitted -> first token on the host" in printed and "event loop lag" in printed
    # The GIL probe waited after each of its sleeps, and named a thread's place for each long wait.
    assert report["gil_waits_ms"] and all(w > -1 for w in report["gil_waits_ms"]) and "GIL probe" in printed
    long_waits = sum(w > 1.0 for w in report["gil_waits_ms"])
    assert all(where.startswith(("engine: ", "loop: ")) for where in report["gil_holders"])
    assert sum(report["gil_holders"].values()) <= 2 * long_waits
    # Each client's first request traced through the server, its moments in the order they happen
    # (one clock: the clients' and the server's perf_counter are the machine's).
    moments = ("sent", "arrived", "handed", "admitted", "first_token", "first_out", "received")
    assert sorted(r["client"] for r in report["first_burst"]) == [0, 1]
    assert all([r[k] for k in moments] == sorted(r[k] for k in moments) for r in report["first_burst"])
    assert "the first burst" in printed


def test_serve_stand_in_serves_every_request_through_the_app_for_each_variant(tmp_path):
    """Two clients, two requests each, through the real app and Engine over the stand-in decoder,
    for each fraction held: every request answered with all its tokens, the variants alternating."""
    out = tmp_path / "stand-in.json"
    printed = run_script("benchmarks/serve_stand_in.py", "-m", str(find_fixture_model("chat-tiny-Q4_K_M.gguf")),
                         "--clients", "2", "--requests", "2", "--max-tokens", "4", "--step-ms", "1",
                         "--prefill-ms", "1", "--held", "0,0.5", "--rounds", "2", "--json", str(out))
    report = json.loads(out.read_text())
    assert sorted(report["runs"]) == ["0.0", "0.5"]
    for runs in report["runs"].values():
        assert len(runs) == 2
        for run in runs:
            assert run["requests"] == 4 and len(run["ttft_ms"]) == 4
            assert round(run["tokens_per_second"] * run["seconds"]) == 4 * 4
    rounds = re.findall(r"held (\S+), round (\d)", printed)
    assert rounds == [("0", "1"), ("0.5", "1"), ("0.5", "2"), ("0", "2")]
    assert "held 0.5: TTFT p95 mean of rounds" in printed


def test_engine_turns_times_the_joins_apart_when_asked(tmp_path):
    """--eval-joins: every prefill_chunk is followed by the joins' evaluation, timed as a call of its own."""
    out = tmp_path / "turns.json"
    printed = run_script("benchmarks/engine_turns.py", "--clients", "2", "--requests", "1", "--max-tokens", "2",
                         "--eval-joins", "--json", str(out))
    names = [c["name"] for c in json.loads(out.read_text())["calls"]]
    chunks = [i for i, name in enumerate(names) if name == "prefill_chunk"]
    assert chunks and all(names[i + 1] == "eval_joins" for i in chunks)
    assert names.count("eval_joins") == len(chunks) and "eval_joins" in printed


def test_engine_turns_splits_each_step_and_times_the_app(tmp_path):
    """--split-step: each step's parts (compile traces, MLX's evaluations on the host, the wait for
    its tokens) fit in the step; each chat request's arrival, hand-off and first chunk out, in order."""
    out = tmp_path / "turns.json"
    printed = run_script("benchmarks/engine_turns.py", "--clients", "2", "--requests", "2", "--max-tokens", "4",
                         "--split-step", "--json", str(out))
    report = json.loads(out.read_text())
    steps = [c for c in report["calls"] if c["name"] == "step"]
    assert steps and all(set(c["parts_ms"]) == {"trace", "async_eval", "eval", "wait"} for c in steps)
    assert all(0 <= sum(c["parts_ms"].values()) <= c["ms"] for c in steps)
    assert sum(c["parts_ms"]["async_eval"] for c in steps) > 0
    assert not any("parts_ms" in c for c in report["calls"] if c["name"] != "step")
    app = report["app_ms"]
    assert len(app["to_engine"]) == len(app["first_chunk_out"]) == 4
    assert all(0 <= a <= b for a, b in zip(app["to_engine"], app["first_chunk_out"]))
    assert "step parts, ms" in printed and "arrival -> first chunk out" in printed and "gc pauses" in printed


@pytest.mark.parametrize("script", ["engine_turns.py", "first_use.py"])
def test_a_server_probe_names_a_bad_model_in_one_line(tmp_path, script):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(open(find_fixture_model("chat-tiny-Q4_K_M.gguf"), "rb").read(1000))
    result = subprocess.run([sys.executable, f"benchmarks/{script}", "-m", str(truncated)], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "truncated or corrupt" in result.stderr


def test_serve_bench_and_speculative_serve_measure_a_real_server_and_rounds_pool(tmp_path):
    """serve_bench.py's clients (one kept-alive connection each) and speculative_serve.py against
    `mlxllama serve` on chat-tiny; --compare then pools each server's rounds: the pooled TTFT p95 is
    the p95 of every request's TTFT, not the mean of the runs' p95s."""
    from conftest import Server

    server = Server("--max-batch", "2")
    try:
        for round_ in (1, 2):
            run_script("benchmarks/serve_bench.py", "--url", server.url, "--clients", "2", "--requests", "2",
                       "--max-tokens", "4", "--label", f"mlxllama-{round_}", "--json", str(tmp_path / f"r{round_}.json"))
        prompt = tmp_path / "prompt.txt"
        prompt.write_text("The capital of Japan is Tokyo. The capital of Japan is")
        printed = run_script("benchmarks/speculative_serve.py", "--url", server.url, "--prompt-file", str(prompt),
                             "-n", "6", "-r", "2", "--extra", '{"lookup": 3}', "--label", "lookup",
                             "--json", str(tmp_path / "spec.json"))
    finally:
        server.stop()
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert len(spec["runs"]) == 2 and spec["runs"][0]["tokens"] == 6 and spec["runs"][0]["text"] == spec["runs"][1]["text"]
    assert printed.startswith("lookup: ")
    rounds = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in (1, 2)]
    for output in rounds:
        (row,) = output["runs"]
        assert row["requests"] == 4 and len(row["ttft_ms"]) == 4 and row["ttft_ms"] == sorted(row["ttft_ms"])
        assert abs(row["ttft_p95_ms"] - statistics.quantiles(row["ttft_ms"], n=100, method="inclusive")[94]) < 0.01
        # each client's two requests in order, the second sent after the first's answer began
        by_client = row["requests_by_client"]
        assert len(by_client) == 2 and all(len(c) == 2 and 0 <= c[0][0] < c[0][0] + c[0][1] <= c[1][0] for c in by_client)
        assert sorted(ttft for c in by_client for _, ttft in c) == row["ttft_ms"]
    (tmp_path / "both.json").write_text(json.dumps(rounds))
    table = run_script("benchmarks/serve_bench.py", "--compare", str(tmp_path / "both.json"))
    (line,) = [line for line in table.splitlines() if re.match(r"mlxllama +2 ", line)]
    fields = line.split()
    assert fields[1:3] == ["2", "2"]  # clients, runs: the two rounds are one server
    pooled = statistics.quantiles(sorted(t for o in rounds for t in o["runs"][0]["ttft_ms"]), n=100,
                                  method="inclusive")[94]
    assert float(fields[3]) == pytest.approx(statistics.mean(o["runs"][0]["ttft_p95_ms"] for o in rounds), abs=0.051)
    assert float(fields[5]) == pytest.approx(pooled, abs=0.051)
    # each client's first requests (they arrive together) apart from its second ones
    (turns,) = [line for line in table.splitlines() if line.startswith("mlxllama at 2 clients")]
    printed = [float(v) for v in re.search(r"1: (\d+) / (\d+) / (\d+), 2: (\d+) / (\d+) / (\d+)$", turns).groups()]
    expected = []
    for turn in (0, 1):
        ttfts = [c[turn][1] for o in rounds for c in o["runs"][0]["requests_by_client"]]
        quantiles = statistics.quantiles(ttfts, n=100, method="inclusive")
        expected += [quantiles[49], quantiles[89], max(ttfts)]
    assert printed == pytest.approx(expected, abs=0.51)


@pytest.mark.parametrize("content, message", [
    (None, "No such file or directory"),
    ('{"label":', "Expecting value"),
    ('[{"runs": []}]', "not serve_bench.py --json output (KeyError: 'label')"),
    ('[{"label": "a-1", "runs": [{"clients": "16", "ttft_p95_ms": 1, "tokens_per_second": 2}]}]',
     "a run's clients, ttft_p95_ms, tokens_per_second must be numbers"),
])
def test_serve_bench_compare_names_a_bad_file_in_one_line(tmp_path, content, message):
    path = tmp_path / "runs.json"
    if content is not None:
        path.write_text(content)
    result = subprocess.run([sys.executable, "benchmarks/serve_bench.py", "--compare", str(path)], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(f"serve_bench.py: {path}: ") and result.stderr.count("\n") == 1
    assert message in result.stderr


def test_first_use_times_each_kind_of_work_and_a_lone_clients_requests(tmp_path):
    """first_use.py on chat-tiny: every case of part 1 timed; part 2 asks the warm-up question and
    then four, the first of them the warm-up's question again, which the prompt cache holds but for
    its last token."""
    out = tmp_path / "first-use.json"
    printed = run_script("benchmarks/first_use.py", "--json", str(out))
    report = json.loads(out.read_text())
    kinds = {case["kind"] for case in report["model_firsts"]}
    assert len(kinds) == 4 and len(report["model_firsts"]) == 20
    assert all(case["ms"] > 0 for case in report["model_firsts"])
    served = report["served_firsts"]
    assert [s["case"] for s in served] == ["warm-up", "request 1", "request 2", "request 3", "request 4"]
    assert served[0]["cached_tokens"] == 0 and served[1]["cached_tokens"] == served[1]["prompt_tokens"] - 1
    assert all(s["first_token_ms"] > 0 for s in served)
    assert "one client through the engine" in printed


def test_multi_gpu_table_reads_the_committed_several_gpu_run():
    tables = run_script("benchmarks/multi_gpu_table.py", "benchmarks/results/h100x4-multi-gpu")
    # docs/benchmarks.md quotes these rows: ours split over 2 GPUs, llama.cpp's row split refusing to load
    assert "| 2 | mlxllama, tensor | 13673 | 87.6 | 1107 | 3105 |" in tables
    assert "| 2 | llama.cpp -sm layer | 9473 | 268.3 | 2023 | - |" in tables
    assert "| 4 | llama.cpp -sm row | failed to load |" in tables and "| 4 | mlxllama, pipeline | not run |" in tables
    assert "| 2 | 1 × 4096 | 45.6 |" in tables
    assert "part at 18: a near-tie (margin 0.0117 < 0.0742)" in tables
    missing = subprocess.run([sys.executable, "benchmarks/multi_gpu_table.py", "no-such-folder"], cwd=REPO,
                             capture_output=True, text=True)
    assert missing.returncode == 1 and missing.stderr == "multi_gpu_table.py: no-such-folder is not a folder\n"


def test_split_parity_names_a_bad_model_or_a_missing_reference_in_one_line(tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(open(find_fixture_model("chat-tiny-Q4_K_M.gguf"), "rb").read(1000))
    for args, message in (([str(truncated), "--save", str(tmp_path / "ref.npz")], "truncated or corrupt"),
                          ([str(find_fixture_model("chat-tiny-Q4_K_M.gguf")), "--against", str(tmp_path / "none.npz")],
                           "no reference")):
        result = subprocess.run([sys.executable, "benchmarks/split_parity.py", *args], cwd=REPO,
                                capture_output=True, text=True)
        assert result.returncode == 2 and result.stdout == "" and not (tmp_path / "ref.npz").exists()
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("split_parity.py: error: ")
        assert message in result.stderr
