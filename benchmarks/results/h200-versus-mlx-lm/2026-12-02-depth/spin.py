import sys, time, mlx.core as mx, mlxllama
rt = mlxllama.load(sys.argv[1]); m = rt.model; c = m.make_cache()
mx.eval(m.step(mx.array([[1] * int(sys.argv[2])]), c)); tok = mx.array([[1]])
def run(seconds):
    n = 0; end = time.time() + seconds; out = m.step(tok, c); mx.async_eval(out)
    while time.time() < end:
        nxt = m.step(tok, c); mx.async_eval(nxt); mx.eval(out); out = nxt; n += 1
        if n % 64 == 0:
            mx.eval(out)
            for l in c: l.trim(64)
    mx.eval(out)
    return n / seconds
run(3)
print(sys.argv[2], "steps/s", run(float(sys.argv[3])), flush=True)
