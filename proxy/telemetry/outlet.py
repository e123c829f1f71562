"""Lines to the process's standard streams without ever blocking the event loop.

Owns: writing the bytes of whole lines to one file descriptor — at once when that cannot block, else
through a bounded queue that one writer thread per descriptor drains with blocking writes — and
telling the caller when a queued line left (``on_done``) or that it was dropped (the queue was full).

Why: a pipe nobody reads (a log collector that stalls, a parent process that does not drain its
child's output, stdout and stderr merged into one such pipe) fills up, and a blocking ``write(2)`` from
the event loop then stops every call, every probe and every timer of the process at 0% CPU, for good.
That is how the sidecar wedged under a burst of slow calls: the audit records and the
"failed closed" warnings of a few hundred calls filled a merged stdout/stderr pipe.

When a write cannot block: the descriptor is not a pipe (a file, a terminal), or the pipe holds no
unread byte (then all of its buffers are free: a write of at most its capacity goes in whole) and no
other writer of this process writes to the same pipe meanwhile (each pipe has one lock, taken by every
writer here; the event loop only tries it). A partly filled pipe is not trusted: its free space is
counted in pages, not bytes, so a byte count could promise room that a write then waits for.

Must never: block the caller on a full pipe, reorder the lines of one descriptor, or hold more than
``max_queued`` lines.
"""

from __future__ import annotations

import collections
import fcntl
import os
import stat
import struct
import termios
import threading
from typing import Callable

_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)

_pipe_locks: dict[tuple[int, int], threading.Lock] = {}  # (device, inode) of a pipe -> its writers' lock
_outlets: dict[int, "Outlet"] = {}
_registry_lock = threading.Lock()


def outlet(fd: int, *, max_queued: int = 10000) -> "Outlet":
    """The one outlet of a descriptor (shared by everything in the process that writes to it)."""
    with _registry_lock:
        found = _outlets.get(fd)
        if found is None:
            found = _outlets[fd] = Outlet(fd, max_queued=max_queued)
        return found


class Outlet:
    def __init__(self, fd: int, *, max_queued: int = 10000) -> None:
        self.fd = fd
        self.max_queued = max_queued
        self.dropped = 0
        self._capacity: int | None = None
        self._lock: threading.Lock | None = None
        try:
            info = os.fstat(fd)
            if stat.S_ISFIFO(info.st_mode):
                self._capacity = fcntl.fcntl(fd, _F_GETPIPE_SZ)
                self._lock = _pipe_locks.setdefault((info.st_dev, info.st_ino), threading.Lock())
        except OSError:
            pass
        self._queue: collections.deque[tuple[bytes, Callable[[], None] | None]] = collections.deque()
        self._wake = threading.Condition()
        self._writer: threading.Thread | None = None

    @property
    def is_pipe(self) -> bool:
        return self._capacity is not None

    @property
    def queued(self) -> int:
        return len(self._queue)

    def write_now(self, data: bytes) -> bool:
        """Write ``data`` at once if that cannot block (not a pipe; or an empty pipe, nothing queued before
        it, no other writer of this process on the pipe); False: it was not written."""
        if self._capacity is None or self._lock is None:
            _write_all(self.fd, data)
            return True
        if self._queue or len(data) > self._capacity or not self._lock.acquire(blocking=False):
            return False
        try:
            if _unread(self.fd):
                return False
            _write_all(self.fd, data)  # an empty pipe takes it whole: does not block
            return True
        finally:
            self._lock.release()

    def enqueue(self, data: bytes, on_done: Callable[[], None] | None = None) -> bool:
        """Queue ``data`` for the writer thread (``on_done`` is called from that thread once it left);
        False (and counted in ``dropped``): the queue is full, the line is dropped."""
        with self._wake:
            if len(self._queue) >= self.max_queued:
                self.dropped += 1
                return False
            self._queue.append((data, on_done))
            self._wake.notify()
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._drain, name=f"outlet-fd{self.fd}", daemon=True)
            self._writer.start()
        return True

    def write(self, data: bytes) -> bool:
        """At once if that cannot block, else queued; False: dropped."""
        return self.write_now(data) or self.enqueue(data)

    def _drain(self) -> None:
        while True:
            with self._wake:
                while not self._queue:
                    self._wake.wait()
                data, on_done = self._queue[0]
            try:
                if self._lock is not None:
                    with self._lock:
                        _write_all(self.fd, data)  # may block for as long as nobody reads: this thread only
                else:
                    _write_all(self.fd, data)
            except OSError:
                pass  # the stream is gone: the line is lost (durable writers time out and fail closed)
            else:
                if on_done is not None:
                    on_done()
            with self._wake:
                self._queue.popleft()


def _unread(fd: int) -> int:
    """Bytes written to the pipe that its reader has not read yet."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
