"""``--distributed``: a model over ranks that an external launcher started (``mlx.launch``).

Every rank runs the same command (``swiftlm serve --distributed ...``); the backend's group
(``mx.distributed.init()``) tells each its rank and the world size.  Rank 0 becomes the
``control.Leader`` and serves HTTP; the others connect to rank 0's control socket and ``follow``
(the control plane of ``--tensor-parallel``, unchanged).  Start-up:

1. every rank joins the backend's group (``backend.join_distributed``) and checks that the model
   can be split over that many ranks (``backend.check_distributed``): the same answer everywhere,
   so a refusal ends every rank with the same sentence before anything is loaded;
2. rank 0 listens on a control socket (rank 0's address in the launcher's hostfile, or
   --master-addr; port --master-port or a free one) and shares the address and a fresh random
   HMAC key with the other ranks through the group itself (``ranks.share``: one collective over
   the launcher's own channel, so nothing secret travels in the environment or on the command line);
3. the others connect, load their shards and say ``ready`` (or send their error and exit);
   rank 0 loads its shard meanwhile, then waits for every ``ready``;
4. rank 0 returns a ``Leader`` (which mirrors each model call to the followers); a follower runs
   ``follow`` until rank 0 stops or goes, then its process ends.

A rank that dies afterwards closes its socket: the Leader's watchdog fails the model and the
server stops with the message.  Nothing here imports mlx or torch.
"""

from __future__ import annotations

import json
import logging
import os
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any

from ..errors import ConfigError
from .launch import RankStartupError, accept_followers

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 120.0  # seconds rank 0 waits for the other ranks to connect to its control socket


def check_settings(settings: Any, backend: Any) -> None:
    """Refuse, with one sentence naming the flag, what --distributed does not do (yet)."""
    if getattr(backend, "join_distributed", None) is None:
        raise ConfigError(
            f"--distributed needs a backend with distributed support (mlx, under mlx.launch); "
            f"this one is {getattr(backend, 'name', '?')!r} (torch: use --tensor-parallel N)"
        )
    refuse = [
        (int(getattr(settings, "tensor_parallel", 1) or 1) > 1, "--tensor-parallel (the torch backend's)"),
        (int(getattr(settings, "data_parallel", 1) or 1) > 1, "--data-parallel"),
        (getattr(settings, "engine_process", "off") == "on", "--engine-process on"),
        (
            getattr(settings, "models_file", None) or isinstance(getattr(settings, "model", None), list),
            "--models-file / several --model",
        ),
        (getattr(settings, "turbo_kv", None), "--turbo-kv"),
        (getattr(settings, "speculative", None) or getattr(settings, "draft_model", None), "--speculative"),
        (getattr(settings, "stream_experts", False), "--stream-experts"),
        (getattr(settings, "vision", False) or getattr(settings, "audio", False), "--vision / --audio"),
    ]
    for on, flag in refuse:
        if on:
            raise ConfigError(f"{flag} cannot be combined with --distributed yet")


def join(settings: Any, backend: Any, spec: Any) -> Any:
    """Check, join the backend's group, check the split for its size; the ranks object."""
    check_settings(settings, backend)
    backend.check_distributed(spec, settings)  # can this architecture be split at all (before joining)
    ranks = backend.join_distributed(settings)
    if ranks.size < 2:
        raise ConfigError(
            "--distributed: this process is the only rank (the distributed group has size 1); "
            "start every rank with mlx.launch (see docs/guide/distributed.md)"
        )
    backend.check_distributed(spec, settings, ranks.size)
    return ranks


def follow_unless_rank0(settings: Any) -> int | None:
    """For ``swiftlm serve --distributed``, before anything listens: on rank 0 return None (serve as
    usual; ``load_distributed`` finds the group joined); on the other ranks load the shard and run
    rank 0's steps, then return the exit code (these ranks never serve HTTP)."""
    from ..backend import choose_backend
    from ..registry import resolve

    backend, _ = choose_backend(settings.backend)
    spec = resolve(settings.model, allow_download=False if settings.offline else None)
    ranks = join(settings, backend, spec)
    if ranks.rank == 0:
        return None
    return run_follower(backend, spec, settings, ranks)


def load_distributed(backend: Any, spec: Any, settings: Any) -> Any:
    """Rank 0: return its model (a ``Leader``).  Another rank (the Python API, ``swiftlm generate``):
    follow rank 0 here, then end the process (SystemExit) -- its work is rank 0's steps."""
    ranks = join(settings, backend, spec)
    if ranks.rank != 0:
        raise SystemExit(run_follower(backend, spec, settings, ranks))
    return _leader(backend, spec, settings, ranks)


# ---------------------------------------------------------------------------------------- rank 0
def _leader(backend: Any, spec: Any, settings: Any, ranks: Any) -> Any:
    from .control import Leader

    host = ranks.leader_host
    key = os.urandom(32)
    try:
        listener = Listener((host, int(getattr(settings, "master_port", 0) or 0)), authkey=key)
    except OSError as exc:
        raise RankStartupError(
            f"--distributed: rank 0 cannot listen on {host} for the other ranks ({exc.strerror}); "
            "set --master-addr to an address of this host that they can reach"
        ) from None
    port = listener.address[1]
    ranks.share(json.dumps({"host": host, "port": port, "key": key.hex()}).encode())
    log.info("distributed: rank 0 of %d, control socket %s:%d", ranks.size, host, port)
    conns: dict[int, Connection] = {}
    try:
        accept_followers(listener, {}, conns, ranks.size - 1, "--distributed", CONNECT_TIMEOUT)
        model = backend.load(spec, settings)
        _wait_ready(conns)
    except BaseException:
        for c in conns.values():
            c.close()
        raise
    finally:
        listener.close()
    log.info("distributed: %d ranks ready", ranks.size)
    return Leader(model, conns)


def _wait_ready(conns: dict[int, Connection]) -> None:
    """Each follower says ready, or sends its error, or dies (its socket closes)."""
    waiting = dict(conns)
    while waiting:
        for obj in wait(list(waiting.values())):
            r = next(k for k, c in waiting.items() if c is obj)
            try:
                kind, text = obj.recv()
            except (EOFError, OSError):
                raise RankStartupError(f"distributed rank {r} exited while loading its shard") from None
            if kind == "error":
                raise RankStartupError(f"distributed rank {r} failed to load its shard: {text}")
            del waiting[r]


# ---------------------------------------------------------------------------------------- followers
def run_follower(backend: Any, spec: Any, settings: Any, ranks: Any) -> int:
    """Connect to rank 0, load this rank's shard, make rank 0's calls until it stops; exit code."""
    from .control import follow

    info = json.loads(ranks.share(None).decode())
    addr = (info["host"], int(info["port"]))
    try:
        conn = Client(addr, authkey=bytes.fromhex(info["key"]))
    except OSError as exc:
        raise RankStartupError(
            f"--distributed: rank {ranks.rank} cannot reach rank 0's control socket {addr[0]}:{addr[1]} ({exc})"
        ) from None
    conn.send(ranks.rank)
    try:
        model = backend.load(spec, settings)
    except BaseException as exc:  # noqa: BLE001 - rank 0 reports it (and so does this rank)
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        finally:
            conn.close()
        raise
    conn.send(("ready", None))
    log.info("distributed: rank %d of %d ready", ranks.rank, ranks.size)
    follow(ranks.follower_model(model), conn, ranks.rank)
    return 0
