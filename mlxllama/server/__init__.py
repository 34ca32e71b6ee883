"""`mlxllama serve`: the model over HTTP, OpenAI-compatible (app.py), every request through one engine (engine.py)."""

from __future__ import annotations

import ipaddress
import socket

from ..errors import MlxLlamaError


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is on this machine alone (127.0.0.0/8, ::1)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        raise MlxLlamaError(f"--host {host}: not an address or a name this machine resolves") from None
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def serve(runtime, settings, host: str = "127.0.0.1", port: int = 8080, max_batch: int = 16,
          prefill_chunk: int = 512, kv_budget: int | None = None, max_queue: int = 64, prompt_cache_bytes: int = 0,
          on_ready=lambda url: None) -> None:
    """Serve until Ctrl-C or SIGTERM; in-flight requests are finished or cancelled, then the engine stops."""
    import uvicorn

    from .app import create_app
    from .engine import Engine

    if not is_loopback(host) and not settings.api_key:
        raise MlxLlamaError(f"--host {host} is reachable from other machines: give --api-key KEY too")
    check_port_free(host, port)
    engine = Engine(runtime, max_batch, prefill_chunk, kv_budget, max_queue, prompt_cache_bytes)
    config = uvicorn.Config(create_app(runtime, engine, settings), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=10)
    server = uvicorn.Server(config)
    try:
        on_ready(f"http://{host}:{port}")
        server.run()
    finally:
        engine.stop()


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise MlxLlamaError(f"cannot listen on {host}:{port}: {e.strerror}") from None
