"""The tensor-parallel control connections (swiftlm/distributed/control.py): Nagle's algorithm is off on both ends
of every TCP connection, so a step message over 16 KB (written as its length, then the payload) is not held back
by the receiver's delayed acknowledgement."""

from __future__ import annotations

import socket
import threading
from multiprocessing.connection import Client, Listener, Pipe

from swiftlm.backend import ModelHooks
from swiftlm.distributed.control import Leader, follow, no_delay


def _nodelay(conn) -> int:
    s = socket.socket(fileno=conn.fileno())
    try:
        return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        s.detach()  # the connection keeps its descriptor


def _tcp_pair():
    listener = Listener(("127.0.0.1", 0), authkey=b"test")
    got = []
    t = threading.Thread(target=lambda: got.append(listener.accept()))
    t.start()
    client = Client(listener.address, authkey=b"test")
    t.join(10)
    listener.close()
    return got[0], client


def test_no_delay_on_tcp_not_on_pipes():
    a, b = _tcp_pair()
    assert _nodelay(a) == 0 and _nodelay(b) == 0  # the default this works around
    assert no_delay(a) and _nodelay(a) == 1 and _nodelay(b) == 0
    a.send_bytes(b"x" * 20_000)  # the connection still works after the option is set
    assert b.recv_bytes() == b"x" * 20_000
    p, q = Pipe()
    assert not no_delay(p)
    a.close(), b.close()
    assert not no_delay(a)  # closed: nothing to set, no error


def test_leader_and_follower_turn_nagle_off():
    leader_end, follower_end = _tcp_pair()

    class Model(ModelHooks):
        def __init__(self):
            self.calls = []

        def free(self, seq_ids):
            self.calls.append(list(seq_ids))

    model = Model()
    t = threading.Thread(target=follow, args=(model, follower_end, 1), daemon=True)
    t.start()
    leader = Leader(Model(), {1: leader_end})
    assert _nodelay(leader_end) == 1
    leader.free([3, 4])  # made on both ranks
    leader.close(timeout=10)
    t.join(10)
    assert not t.is_alive() and model.calls == [[3, 4]]
    assert _nodelay(follower_end) == 1
