"""Waking a thread that sleeps in `zmq.Poller.poll`: other threads cannot touch its sockets (ZeroMQ
sockets are not thread-safe), so they queue their work and send one empty frame over an inproc pair.

    wakeup = Wakeup(context)
    poller.register(wakeup.socket, zmq.POLLIN)   # the polling thread
    wakeup.wake()                                # any thread, after queueing work
    wakeup.drain()                               # the polling thread, when woken
"""

from __future__ import annotations

import contextlib
import threading

import zmq


class Wakeup:
    def __init__(self, context: zmq.Context):
        address = f"inproc://retouch-wakeup-{id(self)}"
        self.socket = context.socket(zmq.PULL)
        self.socket.bind(address)
        self._sender = context.socket(zmq.PUSH)
        self._sender.connect(address)
        self._lock = threading.Lock()  # the sending socket is shared by every waking thread

    def wake(self) -> None:
        with self._lock, contextlib.suppress(zmq.Again):  # a full wake queue is a woken thread
            self._sender.send(b"", zmq.NOBLOCK)

    def drain(self) -> None:
        while self.socket.poll(0):
            self.socket.recv()

    def close(self) -> None:
        self._sender.close(0)
        self.socket.close(0)
