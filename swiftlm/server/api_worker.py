"""One API worker of ``--api-workers`` (``server/workers.py`` starts it as ``python -c ... worker_main(fd)``): it
receives its listening socket and its connections to the engine processes from the supervisor, attaches an
``EngineClient`` to each (a ``ReplicaSet`` over several), and runs the app on the socket."""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from ..distributed.replicas import ReplicaSet
from ..engine_process import ID_STRIDE, EngineClient
from .app import serve
from .workers import WorkerSetup


def _orphan_watch(ppid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != ppid:
            os._exit(4)


def worker_main(ctl_fd: int) -> None:
    """An API worker (``python -c ... worker_main(fd)``): attach to the engines, serve on the socket."""
    ctl = Connection(ctl_fd)
    threading.Thread(target=_orphan_watch, args=(os.getppid(),), daemon=True).start()
    setup: WorkerSetup = ctl.recv()
    settings = setup.settings
    logging.basicConfig(
        level=getattr(logging, str(settings.log_level).upper(), logging.INFO),
        format=f"%(levelname)s [api worker {setup.index}] %(name)s: %(message)s",
    )
    sock = socket.socket(fileno=setup.sock_fd)

    def attach() -> Any:
        clients = [EngineClient.attach(settings, setup.backend, setup.spec, Connection(fd)) for fd in setup.engine_fds]
        if len(clients) == 1:
            return clients[0]
        rs = ReplicaSet(clients, devices=setup.devices)
        k = len(clients)
        for i, c in enumerate(clients):  # disjoint from the other workers' too: (id - 1) % k is still the replica
            c.slots.ids = itertools.count((c.id_base // ID_STRIDE) * k * ID_STRIDE + i + 1, k)
        return rs

    def listening() -> None:
        ctl.send(("listening", os.getpid()))

    try:
        code = serve(settings, worker=(sock, attach, listening))
    except BaseException as exc:  # noqa: BLE001 - the supervisor reports it
        try:
            ctl.send(("error", f"{type(exc).__name__}: {exc}"))
        finally:
            os._exit(1)
    os._exit(code)
