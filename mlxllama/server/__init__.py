"""`mlxllama serve`: the model over HTTP, OpenAI-compatible (app.py), every request through one engine (engine.py)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import sys

from ..errors import MlxLlamaError

# With --max-kv-size, the slots past each row's window kept for speculative decoding's drafts: a
# request may draft this many tokens at a time (or the server's --draft-tokens, if more).
DRAFT_ROOM = 16
# MLX's CUDA backend records its launches into CUDA graphs of about 100 launches each, and builds
# (instantiates) a graph anew for every sequence of launches it has not met before, on the host.
# A served burst's joins and stores are such new sequences every time: on an H100 the server's
# TTFT p95 at 16 clients was 117-143 ms with the graphs off against 141-214 ms with them, in four
# alternating rounds, at the same throughput (docs/benchmarks.md). MLX reads this at its first launch.
CUDA_GRAPHS_ENV = "MLX_USE_CUDA_GRAPHS"


def launch_without_cuda_graphs() -> None:
    """Have MLX's CUDA backend launch kernels one by one in this process, unless the environment
    already says (elsewhere the setting means nothing); before anything runs on the device."""
    os.environ.setdefault(CUDA_GRAPHS_ENV, "0")


def default_engine() -> str:
    """serve's --engine where it is not given. On a GPU (Metal, CUDA) the engine's Python and the
    HTTP side's take turns at one interpreter lock: a process of its own halved TTFT p95 at 16
    clients on an H100. On MLX's CPU backend the model's work is the CPU's: on this project's 2
    cores the split changed nothing beyond the noise (docs/benchmarks.md) and costs a second
    interpreter, so a thread there. Under mlx.launch rank 0's engine is a thread (server/replicas.py)."""
    import mlx.core as mx

    from ..distributed import launched

    return "thread" if launched() or mx.default_device() == mx.cpu else "process"


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is on this machine alone (127.0.0.0/8, ::1)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        raise MlxLlamaError(f"--host {host}: not an address or a name this machine resolves") from None
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def check_listen(host: str, port: int, api_key: str | None) -> None:
    """Whether the server may listen there, checked before the model loads: a host other machines
    reach needs an API key, and the port must be free."""
    if not is_loopback(host) and not api_key:
        raise MlxLlamaError(f"--host {host} is reachable from other machines: give --api-key KEY too")
    check_port_free(host, port)


def serve(model, engine, settings, host: str = "127.0.0.1", port: int = 8080, on_ready=lambda url: None,
          webui: bool = True) -> None:
    """Serve `model` (a Runtime, or a ModelFile beside an EngineProcess) through `engine` until
    Ctrl-C or SIGTERM (check_listen first); in-flight requests are finished or cancelled, then the
    engine stops. An engine process that ends on its own stops the server with exit code 1."""
    import uvicorn

    from .app import create_app
    from .engine_process import EngineProcess

    config = uvicorn.Config(create_app(model, engine, settings, webui), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=10)
    server = _server_class()(config)
    lost: list[str] = []

    def on_lost(message: str) -> None:
        lost.append(message)
        server.should_exit = True

    if isinstance(engine, EngineProcess):
        engine.on_lost = on_lost
    try:
        on_ready(f"http://{host}:{port}")
        server.run()
    finally:
        engine.stop()
    if lost:
        print(f"mlxllama serve: {lost[0]}; stopped", file=sys.stderr)
    # Stopped cleanly: leave without the interpreter's teardown, in which MLX (0.32) aborts the
    # process ("terminate called without an active exception") when it frees arrays that the
    # engine's thread made, that thread being gone by then.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if lost else 0)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but a Ctrl-C or SIGTERM ends the process with exit code 0 once the
        graceful shutdown is done (uvicorn raises the signal again, which kills the process)."""

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise MlxLlamaError(f"cannot listen on {host}:{port}: {e.strerror}") from None
