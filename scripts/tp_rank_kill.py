#!/usr/bin/env python3
"""Kill one tensor-parallel rank of a running `swiftlm serve --tensor-parallel N` while streams are
open, and record what each client receives and how long the server takes to exit.

    swiftlm serve --model DIR --tensor-parallel 2 --port 8000 &
    python scripts/tp_rank_kill.py --base-url http://127.0.0.1:8000 --server-pid $! --json out.json

The follower ranks are the server process's `multiprocessing` spawn children (swiftlm.distributed.
launch); the one killed (SIGKILL) is the first of them.  Each stream is a streamed chat completion
with EOS banned and a large max_tokens, so it is mid-generation when the rank dies.  Per stream:
content chunks received before and after the kill, the error event if one came (its message), whether
a finish_reason chunk and `data: [DONE]` came, and how the connection ended.  The server is expected
to end every stream with an error event and exit non-zero within seconds (never hang).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx


def followers(pid: int) -> list[int]:
    """The server's spawned rank processes (children whose command line is multiprocessing's spawn)."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            pass
    out = []
    for k in sorted(set(kids)):
        try:
            if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes():
                out.append(k)
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def stream(base: str, i: int, rec: dict, kill_at: list[float], max_tokens: int) -> None:
    body = {
        "model": "x",
        "messages": [{"role": "user", "content": f"Stream {i}: count to a million."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    rec.update(chunks_before_kill=0, chunks_after_kill=0, error=None, finish_reason=None, done=False, ended=None)
    t0 = time.time()
    try:
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = r.read().decode(errors="replace")[:300]
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    rec["done"] = True
                    continue
                ev = json.loads(data)
                if "error" in ev:
                    rec["error"] = ev["error"].get("message") if isinstance(ev["error"], dict) else str(ev["error"])
                    continue
                for ch in ev.get("choices", []):
                    if ch.get("finish_reason"):
                        rec["finish_reason"] = ch["finish_reason"]
                    if ch.get("delta", {}).get("content"):
                        rec["chunks_after_kill" if kill_at else "chunks_before_kill"] += 1
        rec["ended"] = "stream closed by the server"
    except Exception as exc:  # noqa: BLE001 - recorded: how the connection ended is the measurement
        rec["ended"] = f"{type(exc).__name__}: {exc}"[:300]
    rec["seconds_after_kill"] = round(time.time() - kill_at[0], 2) if kill_at else None
    rec["seconds"] = round(time.time() - t0, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--server-pid", type=int, required=True)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--kill-after", type=float, default=3.0, help="seconds of streaming before the kill")
    ap.add_argument("--max-tokens", type=int, default=900, help="per stream (inside the served context)")
    ap.add_argument("--exit-timeout", type=float, default=120.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ranks = followers(a.server_pid)
    if not ranks:
        print(f"no follower rank under pid {a.server_pid}", file=sys.stderr)
        return 2
    recs: list[dict] = [{"stream": i} for i in range(a.streams)]
    kill_at: list[float] = []
    threads = [
        threading.Thread(target=stream, args=(a.base_url, i, recs[i], kill_at, a.max_tokens), daemon=True)
        for i in range(a.streams)
    ]
    for t in threads:
        t.start()
    time.sleep(a.kill_after)
    victim = ranks[0]
    kill_at.append(time.time())
    os.kill(victim, signal.SIGKILL)
    exit_s = None
    while time.time() - kill_at[0] < a.exit_timeout:
        if not alive(a.server_pid):
            exit_s = round(time.time() - kill_at[0], 2)
            break
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=max(1.0, a.exit_timeout - (time.time() - kill_at[0])))
    try:  # the exit code, when this script is the server's parent (else the caller reads it)
        _, status = os.waitpid(a.server_pid, os.WNOHANG)
        code = os.waitstatus_to_exitcode(status) if status else None
    except ChildProcessError:
        code = None
    out = {
        "followers": ranks,
        "killed": victim,
        "streams": recs,
        "server_exit_s_after_kill": exit_s,
        "server_exit_code": code,
        "server_still_running": alive(a.server_pid),
        "streams_with_error_event": sum(1 for r in recs if r.get("error")),
        "streams_with_done": sum(1 for r in recs if r.get("done")),
        "streams_hung": sum(1 for t in threads if t.is_alive()),
    }
    if a.json:  # first: a reader of stdout that goes away early must not lose the record
        Path(a.json).write_text(json.dumps(out, indent=1))
    try:
        print(json.dumps({k: v for k, v in out.items() if k != "streams"}))
        for r in recs:
            print(json.dumps(r))
    except BrokenPipeError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
