"""Starting the ranks of a ``--tensor-parallel N`` or ``--pipeline-parallel N`` model.

One host (the default): rank 0 is the process that loads the engine (the engine process of
``--engine-process``, else the server's or the ``LLM`` object's own): it spawns ranks 1..N-1 (``multiprocessing`` spawn context: a fresh interpreter each, so no CUDA or
thread state is inherited), and each rank, itself included, loads only its shard through the
backend's usual ``load`` (the backend reads ``current_rank()`` to join its process group).

Several hosts (``--nnodes H --node-rank R --master-addr A --master-port P``, or torchrun's
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT): the user starts the same command on
every host; host R's process is rank R*k (k = N / H ranks per host) and spawns its host's other
k-1 ranks.  Rank 0 listens for the control connections on A:P (every other rank connects there),
the backend's process group meets on A:P+1 (under torchrun, whose own store holds MASTER_PORT:
P = MASTER_PORT+1).  The control plane's HMAC key comes from ``SWIFTLM_DIST_KEY`` (the same
secret on every host: nothing is unpickled from a peer that does not know it).  Ranks other than
0 never serve HTTP: they run rank 0's steps and exit when it stops.  Start-up order:

1. rank 0 listens on a control socket and spawns the followers;
2. each follower connects (HMAC-authenticated), loads its shard, and says ``ready`` (or sends its
   error and exits);
3. rank 0 loads its own shard on a helper thread meanwhile, so that a follower dying during the
   rendezvous or the load is reported at once, with its error, instead of a hang;
4. rank 0 wraps its model in ``control.Leader``; the followers run ``control.follow``.

Nothing here imports torch or mlx.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any

from ..errors import ConfigError, SwiftLMError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int  # the backend's process group rendezvous
    local_world: int = 0  # ranks on this host (0: all of them)


_current: RankInfo | None = None


def current_rank() -> RankInfo | None:
    """This process's place in a multi-rank model (None: a single-process model)."""
    return _current


class RankStartupError(SwiftLMError):
    exit_code = 1


def free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


CONNECT_TIMEOUT = float(os.environ.get("SWIFTLM_DIST_CONNECT_TIMEOUT", "300"))  # several hosts: seconds to wait


def parallel_mode(settings: Any) -> tuple[str, int]:
    """('tensor-parallel' | 'pipeline-parallel', ranks); ('', 1) for a single-process model."""
    tp = int(getattr(settings, "tensor_parallel", 1) or 1)
    pp = int(getattr(settings, "pipeline_parallel", None) or 1)
    if tp > 1 and pp > 1:
        raise ConfigError("--tensor-parallel and --pipeline-parallel cannot be combined yet; use one of them")
    if pp > 1:
        return "pipeline-parallel", pp
    if tp > 1:
        return "tensor-parallel", tp
    return "", 1


@dataclass(frozen=True)
class Topology:
    """Where this process stands among the hosts: ``base`` is its own rank, ``per`` the ranks per host."""

    world: int
    nnodes: int
    node_rank: int
    per: int
    addr: str
    ctrl_port: int  # rank 0's control socket (0: any free port, one host only)
    pg_port: int  # the backend's rendezvous (0: a free port, one host only)
    local_base: int = 0  # under torchrun: LOCAL_RANK (each process is one rank)

    @property
    def base(self) -> int:
        return self.node_rank * self.per

    @property
    def multi(self) -> bool:
        return self.nnodes > 1


def _torchrun() -> dict[str, str] | None:
    env = os.environ
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")) and int(env["WORLD_SIZE"]) > 1:
        return {k: env[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} | {
            "LOCAL_RANK": env.get("LOCAL_RANK", "0")
        }
    return None


def topology(settings: Any) -> Topology:
    """The hosts' layout from the flags (or torchrun's environment); one sentence when inconsistent."""
    flag, world = parallel_mode(settings)
    tr = _torchrun()
    if tr is not None and world > 1:  # torchrun started every rank: one process per rank, no spawning
        if int(tr["WORLD_SIZE"]) != world:
            raise ConfigError(f"--{flag} {world} does not match torchrun's WORLD_SIZE={tr['WORLD_SIZE']}")
        port = int(tr["MASTER_PORT"]) + 1  # torchrun's own store holds MASTER_PORT
        return Topology(world, world, int(tr["RANK"]), 1, tr["MASTER_ADDR"], port, port + 1, int(tr["LOCAL_RANK"]))
    nnodes = int(getattr(settings, "nnodes", 1) or 1)
    node = int(getattr(settings, "node_rank", 0) or 0)
    addr = getattr(settings, "master_addr", None) or "127.0.0.1"
    port = int(getattr(settings, "master_port", 0) or 0)
    if nnodes == 1:
        if node:
            raise ConfigError(f"--node-rank {node} needs --nnodes greater than {node}")
        return Topology(world, 1, 0, world, addr, 0, port)
    if world == 1:
        raise ConfigError(
            "--nnodes needs --pipeline-parallel N or --tensor-parallel N (the ranks spread over the hosts)"
        )
    if node >= nnodes:
        raise ConfigError(f"--node-rank {node} is not below --nnodes {nnodes}")
    if world % nnodes:
        raise ConfigError(f"--{flag} {world} ranks cannot be spread evenly over --nnodes {nnodes} hosts")
    if not port:
        port = 29500  # torchrun's default: every host must agree on it
    return Topology(world, nnodes, node, world // nnodes, addr, port, port + 1)


def _authkey(topo: Topology) -> bytes:
    if not topo.multi:
        return os.urandom(32)
    key = os.environ.get("SWIFTLM_DIST_KEY", "")
    if len(key) < 16:
        raise ConfigError(
            "several hosts need a shared secret: set SWIFTLM_DIST_KEY (16+ characters, the same on "
            "every host, e.g. `openssl rand -hex 16`) before starting each rank"
        )
    import hashlib

    return hashlib.sha256(b"swiftlm-dist\0" + key.encode()).digest()


def check_settings(settings: Any, spec: Any, backend: Any) -> None:
    """Refuse, with one sentence naming the flag, what --tensor-parallel / --pipeline-parallel do not do (yet)."""
    flag, n = parallel_mode(settings)
    if getattr(backend, "name", "") != "torch":
        raise ConfigError(f"--{flag} needs the torch backend (this one is {getattr(backend, 'name', '?')!r})")
    topology(settings)
    refuse = [
        (getattr(settings, "stream_experts", False), "--stream-experts"),
        (getattr(settings, "turbo_kv", None), "--turbo-kv"),
        (getattr(settings, "speculative", None) or getattr(settings, "draft_model", None), "--speculative"),
        (getattr(settings, "gpu_layers", None) is not None, "--gpu-layers"),
        (int(getattr(settings, "data_parallel", 1) or 1) > 1, "--data-parallel"),
        (getattr(settings, "vision", False) or getattr(settings, "audio", False), "--vision / --audio"),
        (str(getattr(settings, "device", None) or "").startswith("cuda"), "--device cuda:N (ranks use cuda:0..N-1)"),
    ]
    for on, what in refuse:
        if on:
            raise ConfigError(f"{what} cannot be combined with --{flag} yet")
    if spec.is_moe:
        raise ConfigError(f"--{flag} does not support MoE models yet (experts are not split)")
    if spec.vision or spec.audio:
        raise ConfigError(f"--{flag} does not support vision / audio models yet")
    check = getattr(backend, "check_" + flag.replace("-", "_"), None)
    if check is not None:
        check(spec, n)  # the backend's own split check (head / layer counts), before any process starts


def _spawn(
    topo: Topology, spec: Any, settings: Any, backend: Any, address: Any, authkey: bytes, pg_port: int
) -> dict[int, Any]:
    """Start this host's ranks other than this process (base+1 .. base+per-1)."""
    ctx = mp.get_context("spawn")
    level = logging.getLogger("swiftlm").getEffectiveLevel()
    procs: dict[int, Any] = {}
    for r in range(topo.base + 1, topo.base + topo.per):
        info = RankInfo(r, topo.world, r - topo.base, topo.addr, pg_port, topo.per)
        procs[r] = ctx.Process(
            target=_follower_main,
            name=f"swiftlm-rank{r}",
            daemon=True,
            args=(info, spec, settings, backend.name, address, authkey, level, topo.multi),
        )
        procs[r].start()
    return procs


def load_parallel(backend: Any, spec: Any, settings: Any) -> Any:
    """Start this host's other ranks, load rank 0's shard here, and return rank 0's model (a
    ``Leader``).  On a host other than the first (--node-rank > 0, or torchrun's RANK > 0): run
    this rank's part until rank 0 stops, then end the process (SystemExit)."""
    global _current
    from .control import Leader

    check_settings(settings, spec, backend)
    flag, world = parallel_mode(settings)
    topo = topology(settings)
    authkey = _authkey(topo)
    if topo.base != 0:
        raise SystemExit(run_node(topo, backend, spec, settings, authkey))
    addr = topo.addr
    try:
        listener = Listener((addr, topo.ctrl_port), authkey=authkey)  # bound first: the free port below differs
    except OSError as exc:
        raise RankStartupError(
            f"--{flag}: rank 0 cannot listen on {addr}:{topo.ctrl_port} ({exc.strerror}); "
            "--master-addr must be an address of this host that the other hosts reach"
        ) from None
    port = topo.pg_port or free_port(addr)
    procs = _spawn(topo, spec, settings, backend, listener.address, authkey, port)
    conns: dict[int, Connection] = {}
    try:
        accept_followers(listener, procs, conns, world - 1, flag, CONNECT_TIMEOUT if topo.multi else None)
        _current = RankInfo(0, world, topo.local_base, addr, port, topo.per)
        model = _load_rank0(backend, spec, settings, procs, conns, flag)
    except BaseException:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
        for c in conns.values():
            c.close()
        raise
    finally:
        listener.close()
    log.info("%s: %d ranks ready (local pids %s)", flag, world, ", ".join(str(p.pid) for p in procs.values()))
    return Leader(model, conns, procs, label=flag)


def follow_unless_rank0(settings: Any) -> int | None:
    """``swiftlm serve`` on a host other than rank 0's, before anything listens: run this host's
    ranks until rank 0 stops and return the exit code; None on rank 0 (or a one-host model)."""
    flag, world = parallel_mode(settings)
    if world == 1:
        return None
    topo = topology(settings)
    if topo.base == 0:
        return None
    from ..backend import choose_backend
    from ..registry import resolve

    backend, _ = choose_backend(settings.backend)
    spec = resolve(settings.model, allow_download=False if settings.offline else None)
    check_settings(settings, spec, backend)
    return run_node(topo, backend, spec, settings, _authkey(topo))


def run_node(topo: Topology, backend: Any, spec: Any, settings: Any, authkey: bytes) -> int:
    """A host other than rank 0's: spawn its other ranks, then be rank ``topo.base`` (connect to rank 0,
    load, follow).  Returns 0 when rank 0 has stopped or gone, 1 when this rank failed."""
    flag, _ = parallel_mode(settings)
    address = (topo.addr, topo.ctrl_port)
    procs = _spawn(topo, spec, settings, backend, address, authkey, topo.pg_port)
    info = RankInfo(topo.base, topo.world, topo.local_base, topo.addr, topo.pg_port, topo.per)
    log.info(
        "%s: rank %d of %d (host %d of %d), rank 0 at %s:%d",
        flag,
        topo.base,
        topo.world,
        topo.node_rank,
        topo.nnodes,
        topo.addr,
        topo.ctrl_port,
    )
    try:
        code = _follow_rank(info, spec, settings, backend.name, address, authkey, True)
    finally:
        for p in procs.values():
            p.join(10.0)
            if p.is_alive():
                p.terminate()
    return code


def accept_followers(
    listener: Listener, procs: dict[int, Any], conns: dict[int, Connection], n: int, flag: str, timeout: float | None
) -> None:
    """Accept one authenticated connection per follower; a follower of this host that dies first is
    an error, and so (several hosts) is a rank that has not connected within ``timeout`` seconds."""
    got: list[Any] = []
    end = time.monotonic() + timeout if timeout else None

    def run() -> None:
        for _ in range(n):
            try:
                got.append(listener.accept())
            except Exception as exc:  # noqa: BLE001 - reported below
                got.append(exc)
                return

    t = threading.Thread(target=run, name="swiftlm-tp-accept", daemon=True)
    t.start()
    while len(got) < n and not any(isinstance(c, Exception) for c in got):
        for r, p in procs.items():
            if p.exitcode is not None:
                raise RankStartupError(f"{flag} rank {r} exited with code {p.exitcode} before it connected")
        if end is not None and time.monotonic() > end:
            raise RankStartupError(
                f"{flag}: {n - len(got)} of {n} ranks did not connect to rank 0 at "
                f"{listener.address[0]}:{listener.address[1]} within {timeout:.0f} s (are the "
                "other hosts started, with the same --master-addr / --master-port / "
                "SWIFTLM_DIST_KEY?)"
            )
        time.sleep(0.05)
    for c in got:
        if isinstance(c, Exception):
            raise RankStartupError(f"{flag}: a rank's control connection failed: {c}")
        r = c.recv()  # its rank
        conns[r] = c


def _load_rank0(
    backend: Any,
    spec: Any,
    settings: Any,
    procs: dict[int, Any],
    conns: dict[int, Connection],
    flag: str = "tensor-parallel",
) -> Any:
    """Load rank 0's shard on a helper thread while watching the followers: each says ready, or
    its error, or dies; any failure raises here at once (the load thread is left behind, a daemon
    blocked in the rendezvous, when a follower never joins)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["model"] = backend.load(spec, settings)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = exc

    t = threading.Thread(target=run, name="swiftlm-rank0-load", daemon=True)
    t.start()
    ready: set[int] = set()
    sentinels = {p.sentinel: r for r, p in procs.items()}
    waiting = {r: c for r, c in conns.items()}
    while t.is_alive() or waiting:
        if "error" in out:
            raise out["error"]
        for obj in wait(list(waiting.values()) + list(sentinels), timeout=0.2):
            if obj in sentinels:
                r = sentinels[obj]
                if r in ready:
                    raise RankStartupError(f"{flag} rank {r} exited with code {procs[r].exitcode} during start-up")
                continue  # its error message, if it sent one, comes through its connection
            r = next(k for k, c in waiting.items() if c is obj)
            try:
                kind, text = obj.recv()
            except (EOFError, OSError):
                p = procs.get(r)
                if p is None:  # a rank on another host
                    raise RankStartupError(f"{flag} rank {r} closed its connection while loading its shard") from None
                p.join(2.0)
                raise RankStartupError(
                    f"{flag} rank {r} exited with code {p.exitcode} while loading its shard"
                ) from None
            if kind == "error":
                raise RankStartupError(f"{flag} rank {r} failed to load its shard: {text}")
            ready.add(r)
            del waiting[r]
    t.join()
    if "error" in out:
        raise out["error"]
    return out["model"]


def _follower_main(
    info: RankInfo,
    spec: Any,
    settings: Any,
    backend_name: str,
    address: Any,
    authkey: bytes,
    level: int,
    retry: bool = False,
) -> None:
    """A spawned rank: watch its parent, then ``_follow_rank``."""
    logging.basicConfig(level=level, format=f"%(asctime)s rank{info.rank} %(levelname)s %(name)s: %(message)s")
    parent = os.getppid()

    def orphaned() -> None:  # rank 0 killed outright: do not outlive it
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=orphaned, name="swiftlm-orphan-check", daemon=True).start()
    raise SystemExit(_follow_rank(info, spec, settings, backend_name, address, authkey, retry))


def _connect(address: Any, authkey: bytes, retry: bool, rank: int) -> Connection:
    """Rank 0's control socket; on several hosts rank 0 may not listen yet: retry until CONNECT_TIMEOUT."""
    end = time.monotonic() + (CONNECT_TIMEOUT if retry else 0.0)
    while True:
        try:
            return Client(address, authkey=authkey)
        except (ConnectionRefusedError, ConnectionResetError, OSError) as exc:
            if isinstance(exc, (ConnectionRefusedError, ConnectionResetError)) and time.monotonic() < end:
                time.sleep(0.5)
                continue
            raise RankStartupError(
                f"rank {rank} cannot reach rank 0's control socket {address[0]}:{address[1]} ({exc})"
            ) from None
        except Exception as exc:  # multiprocessing.AuthenticationError: another key
            raise RankStartupError(
                f"rank {rank}: rank 0 at {address[0]}:{address[1]} refused this rank ({exc}); "
                "is SWIFTLM_DIST_KEY the same on every host?"
            ) from None


def _follow_rank(
    info: RankInfo, spec: Any, settings: Any, backend_name: str, address: Any, authkey: bytes, retry: bool
) -> int:
    """Rank ``info.rank``: connect, load the shard, then make rank 0's calls until it stops."""
    global _current
    _current = info
    conn = _connect(address, authkey, retry, info.rank)
    conn.send(info.rank)
    try:
        from ..backend import discover_backends

        entry = discover_backends([backend_name]).get(backend_name)
        if entry is None or entry.backend is None:
            raise ConfigError(f"backend {backend_name!r} is not available on rank {info.rank}")
        model = entry.backend.load(spec, settings)
    except BaseException as exc:  # noqa: BLE001 - rank 0 reports it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        conn.close()
        return 1
    conn.send(("ready", None))
    from .control import follow

    follow(model, conn, info.rank)  # the process group is left at exit (parallel._leave_group)
    return 0
