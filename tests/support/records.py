"""An operation record's fields as a test reads and alters them in Redis (a tamperer's view): the record is
one packed string (proxy/operations.py), so a field is changed by reading, editing and writing it back."""

from __future__ import annotations

from typing import Any

from proxy.operations import LONG_NAMES, pack_record, unpack_record


async def read_fields(redis: Any, name: str) -> dict[str, str]:
    """The record's fields by long name (``state``, ``outcome``, ``omac``, ...)."""
    return {LONG_NAMES.get(k, k): v for k, v in unpack_record(await redis.get(name)).items()}


async def alter_fields(redis: Any, name: str, *, drop: tuple[str, ...] = (), **changes: Any) -> None:
    """Set ``changes`` (bytes as they are: a planted packed text) and remove ``drop`` in the stored record,
    keeping its TTL."""
    fields = await read_fields(redis, name)
    fields.update({k: v if isinstance(v, bytes) else str(v) for k, v in changes.items()})
    for field in drop:
        fields.pop(field, None)
    await redis.set(name, pack_record(fields), keepttl=True)
