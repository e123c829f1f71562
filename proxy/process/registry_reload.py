"""Registry reload without a restart: file changes (polled) or SIGHUP.

Owns: noticing that the registry files changed (a digest of their paths and
bytes, read through the configured paths, so a Kubernetes ConfigMap update —
an atomic symlink swap under the mount — is seen like an edit), loading and
validating the whole new registry, swapping it into the ``LiveRegistry`` at
once, pushing the new catalog to OPA, and saying what happened: the metric
``toolproxy_registry_reloads_total{result}`` and one log line per reload.

Must never: apply part of a registry (a new set that fails validation is
refused as a whole and the running one stays), change a contract under a call
that already resolved it (calls hold their frozen contract), or stop the
process because a new registry is bad.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ..telemetry.metrics import Metrics
from ..policy.client import PolicyClient
from ..registry import LiveRegistry, Registry, RegistryError, load_registry, registry_files, unmapped_services

log = logging.getLogger("toolproxy.registry")


def files_digest(paths: Sequence[str], named: Sequence[str] = ()) -> str:
    """What the registry files, and the files their contracts name (``named``: alias tables), say now; a
    missing or unreadable file changes it too."""
    digest = hashlib.sha256()
    try:
        for path in [*registry_files(paths), *map(Path, named)]:
            digest.update(str(path).encode() + b"\x00" + path.read_bytes() + b"\x00")
    except (RegistryError, OSError) as exc:
        digest.update(b"error\x00" + type(exc).__name__.encode())
    return digest.hexdigest()


class RegistryReloader:
    def __init__(self, *, paths: Sequence[str], live: LiveRegistry, policy: PolicyClient, metrics: Metrics,
                 interval_ms: int, push_catalog: bool,
                 on_swap: Callable[[Registry], None] | None = None,
                 services: Mapping[str, str] | None = None,
                 check: Callable[[Registry], None] | None = None) -> None:
        self._paths = list(paths)
        self._services = services  # backends.services: a contract naming an unmapped service is refused
        self._check = check  # what else a new registry must pass (its credential references): RegistryError
        self._on_swap = on_swap  # told of every applied registry (the pin watcher re-checks its upstreams)
        self._live = live
        self._policy = policy
        self._metrics = metrics
        self._interval_s = interval_ms / 1000.0
        self._push_catalog = push_catalog
        self._seen = files_digest(self._paths, live.named_files)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="registry-reload")

    def request(self) -> None:
        """SIGHUP: reload now, whether or not the files look changed."""
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            forced = False
            try:
                async with asyncio.timeout(self._interval_s or None):
                    await self._wake.wait()
                    forced = True
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.reload(force=forced)
            except Exception:  # the loop outlives any one bad reload
                log.exception("registry reload failed unexpectedly; the running registry stays")

    async def reload(self, *, force: bool = True) -> str:
        """Reload when forced or when the files changed: ``applied``, ``refused`` or ``unchanged``."""
        async with self._lock:
            digest = await asyncio.to_thread(files_digest, self._paths, self._live.named_files)
            if digest == self._seen and not force:
                return "unchanged"
            self._seen = digest
            try:
                registry = await asyncio.to_thread(load_registry, self._paths)
                unmapped = unmapped_services(registry, self._services) if self._services else []
                if unmapped:
                    raise RegistryError("; ".join(unmapped))
                if self._check is not None:
                    self._check(registry)
            except RegistryError as exc:
                self._metrics.registry_reloads.labels("refused").inc()
                log.error("registry reload refused, the running registry (%d contracts) stays: %s",
                          len(self._live), exc)
                return "refused"
            named_before = self._live.named_files
            self._live.swap(registry)
            if registry.named_files != named_before:  # watch the files the new contracts name from now on
                self._seen = await asyncio.to_thread(files_digest, self._paths, registry.named_files)
            self._policy.use_registry(registry)
            if self._on_swap is not None:
                self._on_swap(self._live)
            pushed = await self._policy.push_catalog() if self._push_catalog else False
            self._metrics.registry_reloads.labels("applied").inc()
            log.info("registry reloaded: %d contracts, catalog %s%s", len(registry),
                     self._policy.catalog_digest[:12], "" if pushed or not self._push_catalog
                     else " (OPA push failed; it is retried on the first decision that sees an old catalog)")
            return "applied"
