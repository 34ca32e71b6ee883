import importlib, statistics, sys
sys.path.insert(0, "ab")
import mlxllama
before = importlib.import_module("mlxllama_before")
bbench = importlib.import_module("mlxllama_before.bench")
from mlxllama import bench
after_rt, before_rt = mlxllama.load(sys.argv[1]), before.load(sys.argv[1])
engines = {"after": lambda s: 512 / bench.time_prompt(after_rt, 512, s), "before": lambda s: 512 / bbench.time_prompt(before_rt, 512, s)}
for f in engines.values(): f(99)
got = {k: [] for k in engines}
for r in range(9):
    for k in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
        got[k].append(engines[k](r))
print({k: round(statistics.median(v)) for k, v in got.items()})
print("after/before round by round:", sorted(round(a / b, 3) for a, b in zip(got["after"], got["before"])))
