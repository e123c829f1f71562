"""Lines to a pipe never block the writer (proxy/telemetry/outlet.py), on real pipes.

The case that wedged the sidecar (issue 30): a pipe whose unread bytes leave room by count, yet every one
of its page buffers is taken, so a small write would wait for the reader forever. ``write_now`` refuses
it; the line goes through the queue and reaches the reader once it reads. Every wait is bounded.
"""

from __future__ import annotations

import fcntl
import os
import time

from proxy.telemetry.outlet import Outlet

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
PAGE = 4096


def _pipe(pages: int) -> tuple[int, int]:
    read, write = os.pipe()
    fcntl.fcntl(write, F_SETPIPE_SZ, pages * PAGE)
    return read, write


def _would_block(fd: int, data: bytes) -> bool:
    """Whether a write of ``data`` would wait (tried on the non-blocking pipe; what fits is written)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    try:
        os.write(fd, data)
        return False
    except BlockingIOError:
        return True
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)


def _read_until(fd: int, count: int, bound_s: float = 10.0) -> bytes:
    got, end = b"", time.monotonic() + bound_s
    while len(got) < count and time.monotonic() < end:
        got += os.read(fd, count - len(got))
    return got


def test_a_pipe_with_room_by_count_but_no_free_page_is_not_written_from_the_caller():
    read, write = _pipe(pages=2)
    try:
        os.write(write, b"a" * PAGE)
        os.write(write, b"b" * PAGE)  # both pages taken
        assert _read_until(read, PAGE - 96) == b"a" * (PAGE - 96)  # 96 bytes left in the first page
        line = b"x" * 765 + b"\n"  # 4,192 unread of 8,192: room for this line by count
        assert _would_block(write, line)  # ...but no page is free: a blocking write would wait for the reader
        outlet = Outlet(write)
        assert outlet.is_pipe and not outlet.write_now(line)  # refused at once instead of waiting
        assert outlet.enqueue(line)  # the writer thread waits for the reader in its place
        assert _read_until(read, 96 + PAGE + len(line)) == b"a" * 96 + b"b" * PAGE + line
    finally:
        os.close(read)
        os.close(write)


def test_an_empty_pipe_is_written_at_once_and_a_full_queue_drops_and_counts():
    read, write = _pipe(pages=1)
    try:
        outlet = Outlet(write, max_queued=2)
        assert outlet.write_now(b"1\n")  # empty pipe: straight in
        assert not outlet.write_now(b"2\n")  # one unread byte: not trusted
        results = [outlet.write(b"%d\n" % n) for n in range(2, 40)]
        assert results.count(True) >= 2 and outlet.dropped == results.count(False) > 0
        written = b"".join(b"%d\n" % n for n, ok in zip(range(2, 40), results) if ok)
        assert _read_until(read, 2 + len(written)) == b"1\n" + written  # in order, nothing after a drop reordered
    finally:
        os.close(read)
        os.close(write)


def test_two_descriptors_of_one_pipe_share_one_lock_so_the_caller_never_races_the_writer_thread():
    read, write = _pipe(pages=1)
    other = os.dup(write)  # stdout and stderr merged into one pipe
    try:
        first, second = Outlet(write), Outlet(other)
        assert first._lock is second._lock
        os.write(write, b"z" * PAGE)  # full
        assert first.enqueue(b"queued\n")
        assert not second.write_now(b"now\n")  # the pipe is not empty: refused, whoever holds the lock
        assert _read_until(read, PAGE + len(b"queued\n")) == b"z" * PAGE + b"queued\n"
    finally:
        for fd in (read, write, other):
            os.close(fd)


def test_a_file_is_written_directly(tmp_path):
    with open(tmp_path / "out", "wb") as file:
        outlet = Outlet(file.fileno())
        assert not outlet.is_pipe and outlet.write_now(b"line\n")
    assert (tmp_path / "out").read_bytes() == b"line\n"
