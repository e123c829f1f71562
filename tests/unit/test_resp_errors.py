"""``resp_wire.error_reply``: an error reply becomes the exception redis-py raises for it (the class and the
message), so the store's handling (``NoScriptError`` reloads, ``ReadOnlyError`` after a failover) is the same
on the hot path's wire as on redis-py's client. redis-py's own parser is read here, in the test only, as the
reference."""

from __future__ import annotations

import re

import pytest
from redis._parsers.base import BaseParser  # the reference, never imported by proxy/

from proxy.wire.resp import _reader, error_reply

pytestmark = pytest.mark.unit

MESSAGES = [
    "NOSCRIPT No matching script. Please use EVAL.",
    "READONLY You can't write against a read only replica.",
    "LOADING Redis is loading the dataset in memory",
    "EXECABORT Transaction discarded because of previous errors.",
    "NOAUTH Authentication required.",
    "WRONGPASS invalid username-password pair or user is disabled.",
    "NOPERM this user has no permissions to run the 'evalsha' command",
    "OOM command not allowed when used memory > 'maxmemory'.",
    "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "ERR invalid password",
    "ERR Client sent AUTH, but no password is set",
    "ERR Error running script (call to f_0123): @user_script:1: boom",
    "ERR unknown command 'FOO'",
    "ERR max number of clients reached",
    "ERR wrong number of arguments for 'auth' command",
    "ERR AUTH <password> called without any password configured for the default user. Are you sure your "
    "configuration is correct?",
    "WRONGTYPE Operation against a key holding the wrong kind of value",
    "BUSY Redis is busy running a script.",
]


@pytest.mark.parametrize("message", MESSAGES)
def test_an_error_reply_is_the_exception_redis_py_raises(message):
    ours, theirs = error_reply(message), BaseParser.parse_error(message)
    assert (type(ours), str(ours)) == (type(theirs), str(theirs))


def test_replies_in_a_batch_come_back_in_place():
    reader = _reader()
    reader.feed(b"*3\r\n$3\r\nabc\r\n:-7\r\n*1\r\n$-1\r\n-NOSCRIPT No matching script.\r\n+OK\r\n$-1\r\n")
    first, error, ok, none = reader.gets(), reader.gets(), reader.gets(), reader.gets()
    assert first == [b"abc", -7, [None]] and ok == b"OK" and none is None
    assert type(error).__name__ == "NoScriptError" and reader.gets() is False


def test_no_module_of_the_proxy_imports_a_private_redis_py_name():
    from tests.unit import REPO
    offenders = [str(path.relative_to(REPO)) for path in (REPO / "proxy").rglob("*.py")
                 if re.search(r"^\s*(from|import)\s+redis(\.[a-z_]+)*\._", path.read_text(encoding="utf-8"), re.M)]
    assert offenders == []


def test_commands_are_packed_as_redis_py_packs_them():
    import hiredis  # redis-py's packer when hiredis is installed: the reference

    from redis.exceptions import DataError

    from proxy.wire.resp import pack
    command = ("EVALSHA", "s" * 40, 2, "k:{t}:a", b"raw\x00bytes", "caf\u00e9", 0, -12, 1.5, 1e20, "")
    assert pack([command, ("PING",)]) == hiredis.pack_command(command) + hiredis.pack_command(("PING",))
    for wrong in (True, None, {"a": 1}, ["x"]):
        with pytest.raises(DataError):
            pack([("SET", "k", wrong)])
