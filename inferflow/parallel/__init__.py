"""Partitioning a model across devices: layouts, the cost-model planner, torch.distributed glue."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it), for a process
    group's rendezvous or a local server. Kept here, free of torch, so light clients
    (benchmarks/serve_load.py) import it cheaply."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
