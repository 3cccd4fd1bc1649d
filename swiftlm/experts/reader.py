"""Reading routed experts' slabs: concurrent ``preadv`` (default) or copies out of an mmap,
into reusable buffers, with every byte and every read counted.

The file descriptors are opened with ``POSIX_FADV_RANDOM`` (and maps with ``MADV_RANDOM``) so
that the kernel reads what was asked and no readahead: the bytes read are the routed experts'.
Adjacent slabs (one expert's projections, neighbouring experts of a stacked tensor) are
coalesced into one vectored read.  Reads run on a thread pool (the syscalls release the GIL),
so a layer's reads are in flight together.

Optional prefetch: ``hint(layer, experts)`` asks the kernel to start reading those slabs
(``POSIX_FADV_WILLNEED`` / ``MADV_WILLNEED``) in the background; the reader scores each hint
against the experts that layer then routes to (hit rate).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .layout import ExpertLayout, ExpertSlab

NP_DTYPES = {
    "BF16": np.uint16,
    "F16": np.float16,
    "F32": np.float32,
    "U32": np.uint32,
    "I32": np.int32,
    "U8": np.uint8,
    "I8": np.int8,
}
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
MAX_READ = 1 << 20  # bytes per read request: large slabs are split, so that one slab's reads are in flight together
MODES = ("pread", "mmap")


@dataclass
class StreamStats:
    bytes_read: int = 0  # bytes copied out of the files by expert reads
    reads: int = 0  # read requests (syscalls, or mmap copies)
    read_seconds: float = 0.0  # wall time the engine waited for expert reads
    layer_reads: int = 0  # read() calls (one per MoE layer per step)
    experts_read: int = 0
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0
    prefetch_bytes: int = 0  # bytes hinted to the kernel
    prefetch_hits: int = 0  # routed experts that had been hinted
    prefetch_scored: int = 0  # routed experts of layers that had a hint

    def observe(self, seconds: float) -> None:
        i = 0
        while i < len(LATENCY_BUCKETS) and seconds > LATENCY_BUCKETS[i]:
            i += 1
        self.latency_counts[i] += 1
        self.latency_sum += seconds

    def snapshot(self) -> dict:
        return {
            "bytes_read": self.bytes_read,
            "reads": self.reads,
            "read_seconds": round(self.read_seconds, 6),
            "layer_reads": self.layer_reads,
            "experts_read": self.experts_read,
            "read_bandwidth_bytes_per_s": (self.bytes_read / self.read_seconds) if self.read_seconds else 0.0,
            "prefetch_bytes": self.prefetch_bytes,
            "prefetch_hit_rate": (self.prefetch_hits / self.prefetch_scored) if self.prefetch_scored else None,
        }


def proc_io() -> dict[str, int]:
    """This process's /proc/self/io counters (rchar: bytes through read syscalls, cached or not;
    read_bytes: bytes the process made the kernel fetch from storage)."""
    out = {}
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            k, v = line.split(":")
            out[k.strip()] = int(v)
    except OSError:
        pass
    return out


def proc_memory() -> dict[str, int]:
    """Resident set of this process from /proc/self/status, in bytes: rss, peak (VmHWM), anon, file."""
    keys = {"VmRSS": "rss", "VmHWM": "peak_rss", "RssAnon": "rss_anon", "RssFile": "rss_file"}
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in keys:
                out[keys[k]] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def page_cache_bytes() -> int:
    """System page cache ('Cached' in /proc/meminfo), reported beside the resident set."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class ExpertReader:
    """Reads experts of one layer at a time into reusable buffers.

    ``read(layer, experts)`` returns ``{(proj, comp): array [n, *shape]}`` for the sorted
    unique ``experts``; the arrays are views of the reader's buffers, valid until the next
    ``read`` (backends copy them into their own arrays).  BF16 comes back as uint16 bits, or
    widened to float32 with ``float32=True``.  ``start()`` is the asynchronous form.
    ``alloc(nbytes)`` makes a buffer (the torch backend passes pinned host memory)."""

    def __init__(
        self,
        layout: ExpertLayout,
        mode: str = "pread",
        workers: int = 16,
        alloc: Callable[[int], np.ndarray] | None = None,
        chunk: int = 8,
    ):
        if mode not in MODES:
            raise ValueError(f"expert read mode must be one of {MODES}, not {mode!r}")
        self.layout, self.mode = layout, mode
        # experts read (and held in buffers) at once; a layer that routes to more (prefill,
        # batched decode) is computed chunk by chunk, so buffers stay at ``chunk`` experts
        self.chunk = max(1, chunk)
        self.stats = StreamStats()
        self._alloc = alloc or (lambda n: np.empty(n, dtype=np.uint8))
        self._buffers: dict[tuple[str, str], np.ndarray] = {}
        self._hints: dict[int, set[int]] = {}
        self._lock = threading.Lock()
        self.fds = [os.open(f, os.O_RDONLY) for f in layout.files]
        self.maps: list[mmap.mmap] = []
        for fd in self.fds:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            if mode == "mmap":
                m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                if hasattr(m, "madvise"):
                    m.madvise(mmap.MADV_RANDOM)
                self.maps.append(m)
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="swiftlm-experts")

    # ------------------------------------------------------------------ reads
    def _buffer(self, key: tuple, nbytes: int) -> np.ndarray:
        buf = self._buffers.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = self._alloc(nbytes)
            self._buffers[key] = buf
        return buf

    def buffer_bytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def _plan(self, layer: int, experts: Sequence[int], float32: bool) -> tuple[list, dict, list]:
        parts = self.layout.slabs[layer]
        n = len(experts)
        pieces = []  # (file, offset, nbytes, destination view, expert slot, bf16 -> f32 conversion)
        out = {}
        for key, slabs in parts.items():
            first = slabs[experts[0]] if n else slabs[0]
            buf = self._buffer(key, max(n, 1) * first.nbytes)
            raw = buf[: n * first.nbytes].view(NP_DTYPES[first.dtype]).reshape(n, *first.shape)
            conv = float32 and first.dtype == "BF16"
            if conv:
                wide = self._buffer(key + ("f32",), max(n, 1) * first.nbytes * 2)
                out[key] = wide[: n * first.nbytes * 2].view(np.float32).reshape(n, *first.shape)
            else:
                out[key] = raw
            for j, e in enumerate(experts):
                s = slabs[e]
                view = memoryview(buf)[j * s.nbytes : (j + 1) * s.nbytes]
                src = raw[j].reshape(-1) if conv else None
                dst = out[key][j].view(np.uint32).reshape(-1) if conv else None
                # large slabs are split so that even a few experts keep many reads in flight
                for a in range(0, s.nbytes, MAX_READ):
                    b = min(a + MAX_READ, s.nbytes)
                    pieces.append(
                        (
                            s.file,
                            s.offset + a,
                            b - a,
                            view[a:b],
                            j,
                            (src[a // 2 : b // 2], dst[a // 2 : b // 2]) if conv else None,
                        )
                    )
        pieces.sort(key=lambda p: (p[0], p[1]))
        runs: list[list] = []  # [file, offset, views, nbytes, expert slots, conversions]
        for f, off, nb, view, j, conv in pieces:
            r = runs[-1] if runs else None
            if r and r[0] == f and r[1] + r[3] == off and r[3] + nb <= MAX_READ and len(r[2]) < 512:
                r[2].append(view)
                r[3] += nb
            else:
                r = [f, off, [view], nb, set(), []]
                runs.append(r)
            r[4].add(j)
            r[5].append(conv)  # per view: (bf16 bits, fp32 destination) or None
        return runs, out, [r[4] for r in runs]

    def _run(self, f: int, off: int, views: list[memoryview], nbytes: int, convs: list) -> float:
        t0 = time.perf_counter()
        if self.mode == "pread":
            got = os.preadv(self.fds[f], views, off)
            if got != nbytes:  # short read: finish piece by piece
                pos = off
                for v in views:
                    done = 0
                    while done < len(v):
                        k = os.preadv(self.fds[f], [v[done:]], pos + done)
                        if k <= 0:
                            raise OSError(f"{self.layout.files[f]}: short read at {pos + done}")
                        done += k
                    pos += len(v)
        else:
            m = self.maps[f]
            pos = off
            for v, conv in zip(views, convs):
                if conv is None:
                    np.copyto(
                        np.frombuffer(v, dtype=np.uint8), np.frombuffer(m, dtype=np.uint8, count=len(v), offset=pos)
                    )
                else:  # widen straight out of the mapping: no intermediate copy
                    src = np.frombuffer(m, dtype=np.uint16, count=len(v) // 2, offset=pos).reshape(conv[1].shape)
                    np.left_shift(src, 16, out=conv[1], dtype=np.uint32, casting="unsafe")
                pos += len(v)
            return time.perf_counter() - t0
        lat = time.perf_counter() - t0
        for conv in convs:  # bf16 bits -> fp32 bits: exact, and off the engine's thread
            if conv is not None:
                np.left_shift(conv[0], 16, out=conv[1], dtype=np.uint32, casting="unsafe")
        return lat

    def start(self, layer: int, experts: Sequence[int], float32: bool = False) -> PendingRead:
        """Submit the reads of these experts' slabs; ``float32``: BF16 slabs come back widened to
        float32 (done by the reader threads).  Consume with ``PendingRead.expert(j)`` (waits only
        for expert j's reads) or ``result()``."""
        experts = sorted(set(int(e) for e in experts))
        runs, out, slots = self._plan(layer, experts, float32)
        futures = [self.pool.submit(self._run, *r[:4], r[5]) for r in runs]
        return PendingRead(self, layer, experts, out, futures, slots, sum(r[3] for r in runs))

    def read(self, layer: int, experts: Sequence[int], float32: bool = False) -> dict[tuple[str, str], np.ndarray]:
        return self.start(layer, experts, float32).result()

    def _account(self, pending: PendingRead, waited: float, lat: list[float]) -> None:
        st = self.stats
        with self._lock:
            st.read_seconds += waited
            st.layer_reads += 1
            st.experts_read += len(pending.experts)
            st.reads += len(lat)
            st.bytes_read += pending.nbytes
            for s in lat:
                st.observe(s)
            hinted = self._hints.pop(pending.layer, None)
            if hinted is not None:
                st.prefetch_scored += len(pending.experts)
                st.prefetch_hits += len(hinted.intersection(pending.experts))

    # ------------------------------------------------------------------ prefetch
    def hint(self, layer: int, experts: Sequence[int]) -> None:
        """Ask the kernel to start reading these experts' slabs; scored at the next read(layer)."""
        if layer not in self.layout.slabs:
            return
        experts = sorted(set(int(e) for e in experts))
        slabs = [s[e] for s in self.layout.slabs[layer].values() for e in experts]
        with self._lock:
            self._hints[layer] = set(experts)
            self.stats.prefetch_bytes += sum(s.nbytes for s in slabs)
        self.pool.submit(self._advise, slabs)

    def _advise(self, slabs: list[ExpertSlab]) -> None:
        for s in slabs:
            if self.mode == "mmap" and hasattr(self.maps[s.file], "madvise"):
                page = mmap.PAGESIZE
                start = s.offset // page * page
                self.maps[s.file].madvise(mmap.MADV_WILLNEED, start, s.offset + s.nbytes - start)
            elif hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fds[s.file], s.offset, s.nbytes, os.POSIX_FADV_WILLNEED)

    # ------------------------------------------------------------------ housekeeping
    def drop_page_cache(self) -> None:
        """Evict the checkpoint's pages from the OS page cache (POSIX_FADV_DONTNEED): a cold start."""
        for m in self.maps:  # mapped pages are not evicted while our page tables hold them
            m.madvise(mmap.MADV_DONTNEED)
        for fd in self.fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for m in self.maps:
            m.close()
        for fd in self.fds:
            os.close(fd)
        self.maps, self.fds = [], []

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


class PendingRead:
    """Reads in flight for one layer.  ``expert(j)`` blocks until the reads holding the j-th
    (sorted) expert's slabs are done, so a backend can compute expert j while later experts are
    still being read; ``result()`` waits for all.  Accounted once, when everything is done."""

    def __init__(
        self,
        reader: ExpertReader,
        layer: int,
        experts: list[int],
        out: dict,
        futures: list,
        slots: list[set[int]],
        nbytes: int,
    ):
        self.reader, self.layer, self.experts, self.out = reader, layer, experts, out
        self.nbytes = nbytes
        self._futures = futures
        self._by_expert: dict[int, list] = {}
        for fu, js in zip(futures, slots):
            for j in js:
                self._by_expert.setdefault(j, []).append(fu)
        self._waited = 0.0
        self._done = False

    def _wait(self, futures: list) -> None:
        t0 = time.perf_counter()
        for fu in futures:
            fu.result()
        self._waited += time.perf_counter() - t0

    def expert(self, j: int) -> dict[tuple[str, str], np.ndarray]:
        self._wait(self._by_expert.get(j, []))
        return {k: v[j] for k, v in self.out.items()}

    def result(self) -> dict[tuple[str, str], np.ndarray]:
        self._wait(self._futures)
        if not self._done:
            self._done = True
            self.reader._account(self, self._waited, [fu.result() for fu in self._futures])
        return self.out


def drop_file_pages(paths: Sequence[Path]) -> None:
    """Evict files from the page cache (cold-start measurements)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
