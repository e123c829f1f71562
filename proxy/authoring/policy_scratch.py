"""A scratch OPA for the policy-authoring commands (replay, explain).

Owns: starting the real ``opa`` binary on a Unix socket in a private directory (mode 0700: no other
local process can bind its address first or connect to it) with a policy
directory and data paths, and talking to it through ``opa-python-client``
(waiting for health, loading the tool catalog and a small batch module,
batched evaluation with ``strict-builtin-errors`` as the proxy asks, an
erring decision read as the proxy's deny (``POLICY_ERROR``), partial
evaluation, explanations); stopping it on every path. It is locked like the proxy's OPA (--authentication=token
--authorization=basic, proxy/policy/opa_authz.rego): the policy data and the
replayed inputs it holds answer only this command's one-off token, never another
local process. Must never: touch the OPA the proxy uses, or outlive the command.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import aiohttp

from ..policy.opa_control import AUTHZ_POLICY, ControlError, control_client, put_data

# Decisions are asked as the proxy asks them: a failing builtin is an error, not an undefined expression.
STRICT = {"strict-builtin-errors": "true"}
# What replay records for an input whose decision erred (OPA answered 500): the proxy's deny
# (forbidden, details.reason policy_error), never an allow or "undefined".
POLICY_ERROR = {"allow": False, "require_approval": False, "reasons": ["policy_error"]}
BATCH_PACKAGE = "toolproxy_replay"
BATCH_CHUNK = 250          # inputs per query: large enough to amortize HTTP, small enough to stream
BATCH_CONCURRENCY = 4      # queries in flight at once


def find_opa(explicit: str | None = None) -> str:
    """The opa binary: --opa, then the venv's bin (scripts/setup.sh), then PATH."""
    candidates = [explicit] if explicit else [str(Path(sys.executable).parent / "opa"), shutil.which("opa")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise ControlError("no opa binary found (run scripts/setup.sh, or pass --opa PATH)")


def rego_ref(path: Sequence[str | int]) -> str:
    """``["arguments", "reason"]`` -> ``input["arguments"]["reason"]`` (a ref OPA parses for unknowns)."""
    return "input" + "".join(f"[{json.dumps(p)}]" for p in path)


class ScratchOpa:
    """``async with ScratchOpa(policy_dir, data_paths, decision_path=...) as opa: await opa.evaluate(...)``."""

    def __init__(self, policy_dir: str, data_paths: Sequence[str], *, decision_path: str = "toolproxy/decision",
                 opa_binary: str | None = None, catalog: dict[str, Any] | None = None) -> None:
        self._paths = [policy_dir, *data_paths]
        self._decision_ref = "data." + ".".join(decision_path.strip("/").split("/"))
        self.binary = find_opa(opa_binary)
        self._catalog = catalog
        self._process: subprocess.Popen[bytes] | None = None
        self._directory: str | None = None  # holds the socket
        self.client: Any = None
        self.queries = 0  # HTTP round trips to OPA (the bench and tests count them)

    async def __aenter__(self) -> "ScratchOpa":
        for path in self._paths:
            if not Path(path).exists():
                raise ControlError(f"{path}: no such file or directory")
        self._directory = tempfile.mkdtemp(prefix="toolproxy-opa-")
        socket_path = os.path.join(self._directory, "opa.sock")
        token = secrets.token_urlsafe(32)  # full access, held by this command alone
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLPROXY_")}
        self._process = subprocess.Popen(
            [self.binary, "run", "--server", "--addr", f"unix://{socket_path}", "--log-level", "error",
             "--disable-telemetry", "--authentication=token", "--authorization=basic", str(AUTHZ_POLICY),
             *self._paths],
            env={**env, "TOOLPROXY_OPA_ADMIN_TOKEN": token},
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.client = control_client(f"unix://{socket_path}", timeout_s=120.0, retries=0, token=token)
        await self.client.__aenter__()
        try:
            await self._wait_ready()
            if self._catalog is not None:
                await put_data(self.client, "toolproxy/catalog", self._catalog)
            await self.client.update_policy_from_string(
                f"package {BATCH_PACKAGE}\n\n"
                f"results := [d | some x in input.batch; d := {self._decision_ref} with input as x]\n",
                BATCH_PACKAGE, rego_compat=False)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _wait_ready(self) -> None:
        assert self._process is not None
        for _ in range(300):  # 30 s at most: loading a large policy directory takes a while
            if self._process.poll() is not None:
                problem = (self._process.stderr.read() if self._process.stderr else b"").decode(errors="replace")
                raise ControlError("opa did not start: " + (problem.strip().splitlines() or ["(no output)"])[-1])
            if await self.client.check_health():
                return
            await asyncio.sleep(0.1)
        raise ControlError("opa did not become healthy within 30 s")

    async def __aexit__(self, *exc: Any) -> None:
        if self.client is not None:
            await self.client.close_connection()
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._process is not None and self._process.stderr:
            self._process.stderr.close()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)

    async def evaluate(self, inputs: Sequence[dict[str, Any]]) -> list[Any]:
        """The decision for every input, in order: chunks of inputs per query, a few queries at once."""
        chunks = [list(inputs[i:i + BATCH_CHUNK]) for i in range(0, len(inputs), BATCH_CHUNK)]
        gate = asyncio.Semaphore(BATCH_CONCURRENCY)

        async def one(chunk: list[dict[str, Any]]) -> list[Any]:
            async with gate:
                self.queries += 1
                try:
                    answer = await self.client.query_rule({"batch": chunk}, BATCH_PACKAGE, "results",
                                                          query_params=STRICT)
                except aiohttp.ClientResponseError as error:
                    if error.status != 500:
                        raise
                    answer = {}  # one input of the chunk erred: decide them one by one
            results = answer.get("result")
            if not isinstance(results, list) or len(results) != len(chunk):
                # An input for which the decision is undefined drops out of the comprehension.
                return [await self.decide(x) for x in chunk]
            return results

        out: list[Any] = []
        for part in await asyncio.gather(*(one(c) for c in chunks)):
            out.extend(part)
        return out

    async def decide(self, document: dict[str, Any], *, explain: bool = False) -> Any:
        """One decision (None when undefined); with ``explain`` the answer carries OPA's full trace."""
        self.queries += 1
        package, _, rule = self._decision_ref[len("data."):].rpartition(".")
        try:
            answer = await self.client.query_rule(document, package, rule,
                                                  query_params={**STRICT, **({"explain": "full"} if explain else {})})
        except aiohttp.ClientResponseError as error:
            if error.status != 500:
                raise
            return POLICY_ERROR  # the proxy denies a call whose decision errs (proxy/policy/client.py)
        return answer if explain else answer.get("result")

    async def partial(self, document_ref: str, known: dict[str, Any], unknowns: Sequence[str]) -> Any:
        """Partially evaluate ``document_ref`` with ``known`` as input except ``unknowns``; the residual."""
        self.queries += 1
        answer = await self.client.compile_query(f"x = {document_ref}", input_data=known, unknowns=list(unknowns))
        return answer.get("result") or {}
