"""Render the Helm chart and run its pod's containers on this machine, for tests.

``render()`` runs the real ``helm template`` and parses the manifests with
PyYAML. ``LocalPod`` plays the kubelet for one rendered pod spec: it writes
each mounted ConfigMap/Secret into a directory in the kubelet's atomic-writer
layout (``..<timestamp>/`` + ``..data`` symlink + per-key symlinks; an update
swaps ``..data`` with one rename), maps container paths to those directories,
resolves ``env`` (values, secretKeyRef, fieldRef), and starts a container's
entrypoint + args as a subprocess. Nothing is faked: the binaries are the
real ``opa`` and the real ``toolproxy`` entrypoint from the Dockerfile.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import yaml

from tests.support.servers import _UnixConnection, find_binary

REPO = Path(__file__).resolve().parent.parent.parent
CHART = REPO / "deploy" / "helm" / "toolproxy"
PRODUCTION_VALUES = CHART / "ci" / "production-values.yaml"
# The defaults plus the one thing a release must add: Redis credentials (the chart refuses a Redis without).
MINIMAL_VALUES = CHART / "ci" / "minimal-values.yaml"
DOCKERFILE = REPO / "Dockerfile"


class HelmError(RuntimeError):
    """``helm`` exited non-zero; the message carries its stderr."""


def newest_kube_version(chart: Path = CHART) -> str:
    """The newest Kubernetes the chart's kubeVersion admits (">=1.A.0-0 <1.B.0-0" -> "1.(B-1).0")."""
    kube_version = yaml.safe_load((chart / "Chart.yaml").read_text())["kubeVersion"]
    upper = re.search(r"<\s*v?1\.(\d+)", kube_version)
    assert upper, f"kubeVersion {kube_version!r} has no upper bound"
    return f"1.{int(upper.group(1)) - 1}.0"


def helm(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    if args and args[0] in ("template", "lint") and "--kube-version" not in args:
        # The helm that setup.sh builds with `go install` assumes Kubernetes v1.20
        # when no cluster is asked, below the chart's kubeVersion: name one it supports.
        args = (*args, "--kube-version", newest_kube_version())
    proc = subprocess.run([find_binary("helm"), *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        output = _without_symlink_notes(proc.stdout + "\n" + proc.stderr)  # `helm lint` reports on stdout
        raise HelmError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{output}")
    return proc


def _without_symlink_notes(text: str) -> str:
    # Helm notes every symlink it follows (files/policies -> policies/); not an error.
    return "\n".join(line for line in text.splitlines() if "found symbolic link in path" not in line)


def render(values_files: Sequence[Path] | None = None, set_values: Mapping[str, Any] | None = None,
           *, chart: Path = CHART, release: str = "t", set_json: Mapping[str, Any] | None = None
           ) -> list[dict[str, Any]]:
    """``helm template`` -> list of manifests (documents that are not empty). No ``values_files``: the
    chart's defaults plus ``MINIMAL_VALUES`` (for this chart; another chart: its defaults)."""
    if values_files is None:
        values_files = [MINIMAL_VALUES] if chart == CHART else []
    args = ["template", release, str(chart)]
    for path in values_files:
        args += ["-f", str(path)]
    for key, value in (set_values or {}).items():
        args += ["--set", f"{key}={value}"]
    for key, value in (set_json or {}).items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    out = helm(*args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def find(manifests: Iterable[dict[str, Any]], kind: str, name_suffix: str = "") -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind and m["metadata"]["name"].endswith(name_suffix)]


def one(manifests: Iterable[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = find(manifests, kind, name_suffix)
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {[m['metadata']['name'] for m in found]}"
    return found[0]


def native_sidecars(pod_spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The init containers that keep running beside the pod's containers (restartPolicy: Always)."""
    return [c for c in pod_spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]


def containers(pod_spec: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Every container that runs for the pod's life, by name: the native sidecars, then the containers."""
    return {c["name"]: c for c in [*native_sidecars(pod_spec), *pod_spec["containers"]]}


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuations joined."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        instruction, _, rest = line.partition(" ")
        result.append((instruction.upper(), rest.strip()))
    return result


def dockerfile_stages(path: Path = DOCKERFILE) -> list[list[tuple[str, str]]]:
    """Instructions grouped by stage (each starts with FROM); global ARGs are dropped."""
    stages: list[list[tuple[str, str]]] = []
    for instruction, rest in dockerfile_instructions(path):
        if instruction == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((instruction, rest))
    return stages


def entrypoint(path: Path = DOCKERFILE) -> list[str]:
    """The final stage's ENTRYPOINT (exec form)."""
    values = [rest for instruction, rest in dockerfile_stages(path)[-1] if instruction == "ENTRYPOINT"]
    assert values, "the final stage has no ENTRYPOINT"
    return json.loads(values[-1])


# ---------------------------------------------------------------------------
# A pod on localhost
# ---------------------------------------------------------------------------

_STAMP = itertools.count(1)


def write_atomic_volume(directory: Path, files: Mapping[str, str | bytes]) -> None:
    """Publish ``files`` into ``directory`` the way the kubelet updates a ConfigMap volume.

    New content goes to a fresh hidden ``..<stamp>`` directory; ``..data`` is
    switched to it with a single rename; each key is a symlink ``key ->
    ..data/key`` (new keys get a link, removed keys lose theirs); the old
    directory is deleted.
    """
    directory.mkdir(parents=True, exist_ok=True)
    stamp = f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{os.getpid()}_{next(_STAMP)}"
    target = directory / stamp
    target.mkdir()
    for name, content in files.items():
        mode = "wb" if isinstance(content, bytes) else "w"
        with open(target / name, mode) as fh:
            fh.write(content)
    data = directory / "..data"
    old = os.readlink(data) if data.is_symlink() else None
    tmp = directory / "..data_tmp"
    tmp.symlink_to(stamp)
    os.replace(tmp, data)
    for name in files:
        link = directory / name
        if not link.is_symlink():
            link.symlink_to(Path("..data") / name)
    for entry in directory.iterdir():
        if entry.is_symlink() and not entry.name.startswith("..") and entry.name not in files:
            entry.unlink()
    if old:
        for child in (directory / old).iterdir():
            child.unlink()
        (directory / old).rmdir()


@dataclass
class LocalPod:
    """One rendered pod, its volumes under ``root``, its containers as subprocesses."""

    manifests: list[dict[str, Any]]
    pod_spec: dict[str, Any]
    root: Path
    secrets: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    namespace: str = "default"
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.configmaps = {m["metadata"]["name"]: m.get("data", {}) for m in self.manifests
                           if m["kind"] == "ConfigMap"}
        rendered = {m["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in m.get("data", {}).items()}
                    for m in self.manifests if m["kind"] == "Secret"}  # the chart's own (generated) Secrets
        self.secrets = {**rendered, **self.secrets}
        self.volumes = {v["name"]: v for v in self.pod_spec.get("volumes", [])}
        # emptyDirs under a short path of their own: OPA's Unix socket lives in one (a socket path has at most
        # 107 bytes, and a test's tmp_path can take most of that).
        self._empty_dirs = Path(tempfile.mkdtemp(prefix="pod-"))
        for name in self.volumes:
            self.publish(name)

    # -- volumes ----------------------------------------------------------
    def volume_dir(self, volume: str) -> Path:
        if "emptyDir" in self.volumes[volume]:
            return self._empty_dirs / volume
        return self.root / "volumes" / volume

    def volume_files(self, volume: str) -> dict[str, str]:
        spec = self.volumes[volume]
        if "configMap" in spec:
            name = spec["configMap"]["name"]
            assert name in self.configmaps, f"volume {volume}: ConfigMap {name} is not rendered by the chart"
            return dict(self.configmaps[name])
        if "secret" in spec:
            data = self.secrets[spec["secret"]["secretName"]]
            items = spec["secret"].get("items")
            return {i["path"]: data[i["key"]] for i in items} if items else dict(data)
        if "emptyDir" in spec:
            return {}
        raise AssertionError(f"volume {volume}: unsupported source {spec}")

    def publish(self, volume: str, files: Mapping[str, str] | None = None) -> None:
        """(Re)publish a volume's files, atomically, as the kubelet does on a ConfigMap change."""
        if "emptyDir" in self.volumes[volume]:
            self.volume_dir(volume).mkdir(parents=True, exist_ok=True)
            return
        write_atomic_volume(self.volume_dir(volume), self.volume_files(volume) if files is None else files)

    def update_configmap(self, name: str, data: Mapping[str, str]) -> None:
        """Edit a ConfigMap: every volume that mounts it gets the new files."""
        self.configmaps[name] = dict(data)
        for volume, spec in self.volumes.items():
            if spec.get("configMap", {}).get("name") == name:
                self.publish(volume)

    # -- containers -------------------------------------------------------
    def container(self, name: str) -> dict[str, Any]:
        every = {c["name"]: c for c in [*self.pod_spec.get("initContainers", []), *self.pod_spec["containers"]]}
        return every[name]

    def path_map(self, container: str) -> list[tuple[str, Path]]:
        """(mountPath, host dir) for each of the container's mounts, longest first."""
        mounts = [(m["mountPath"].rstrip("/"), self.volume_dir(m["name"]))
                  for m in self.container(container).get("volumeMounts", [])]
        return sorted(mounts, key=lambda m: -len(m[0]))

    def translate(self, container: str, text: str) -> str:
        """Replace container paths under a mount with the host paths that hold them (one pass)."""
        table = dict(self.path_map(container))
        if not table:
            return text
        # A path stands alone, after "=", ":" or a quote, or as a unix:// URL's path (OPA's socket).
        pattern = re.compile(r"(?:(?<=unix://)|(?<![^\s:=,\[\]\"']))("
                             + "|".join(re.escape(m) for m in table)
                             + r")(?=/|$|[\s,\"'\]])")
        return pattern.sub(lambda match: str(table[match.group(1)]), text)

    def env(self, container: str) -> dict[str, str]:
        result: dict[str, str] = {}
        for item in self.container(container).get("env", []):
            if "value" in item:
                result[item["name"]] = str(item["value"])
                continue
            source = item["valueFrom"]
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                result[item["name"]] = self.secrets[ref["name"]][ref["key"]]
            elif "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                fields = {"spec.serviceAccountName": self.pod_spec.get("serviceAccountName", "default"),
                          "metadata.namespace": self.namespace}
                result[item["name"]] = fields[path]
            else:
                raise AssertionError(f"unsupported env source {source}")
        return result

    def start(self, container: str, entrypoint: Sequence[str], *, extra_env: Mapping[str, str] | None = None,
              translate_files: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        """Run the container: its ``command`` (else the image's ``entrypoint``) + ``args``, with its env.

        ``translate_files`` are container paths of mounted files whose contents
        mention other mount paths (e.g. the proxy config's registry.paths):
        they are rewritten in place with host paths, like the args.
        """
        spec = self.container(container)
        command = [self.translate(container, a) for a in spec["command"]] if spec.get("command") else list(entrypoint)
        args = [self.translate(container, a) for a in spec.get("args", [])]
        for path in translate_files:
            host = Path(self.translate(container, path))
            text = host.read_text()
            host.resolve().write_text(self.translate(container, text))
        # `python` in a command means the image's interpreter: this test run's.
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        env = {"PATH": path, "PYTHONPATH": str(REPO), "HOME": str(self.root),
               **{k: self.translate(container, v) for k, v in self.env(container).items()}, **(extra_env or {})}
        log = self.root / f"{container}.log"
        self.logs[container] = log
        proc = subprocess.Popen([*command, *args], stdin=subprocess.DEVNULL, stdout=open(log, "wb"),
                                stderr=subprocess.STDOUT, env=env, cwd=self.root)
        self.processes[container] = proc
        return proc

    def run_init_containers(self, entrypoints: Mapping[str, Sequence[str]], timeout: float = 60.0) -> None:
        """Run each init container that is not a native sidecar to completion, in order, as the kubelet does;
        all must exit 0. (The native sidecars are started by the test, each with ``start``.)"""
        for spec in self.pod_spec.get("initContainers", []):
            if spec.get("restartPolicy") == "Always":
                continue
            name = spec["name"]
            proc = self.start(name, entrypoints.get(name, ()))
            code = proc.wait(timeout=timeout)
            assert code == 0, f"init container {name} exited {code}:\n{self.log(name)}"

    def log(self, container: str) -> str:
        path = self.logs.get(container)
        return path.read_text(errors="replace")[-4000:] if path and path.exists() else ""

    def stop(self) -> None:
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        shutil.rmtree(self._empty_dirs, ignore_errors=True)


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http(method: str, url: str, body: bytes | None = None, timeout: float = 2.0,
         content_type: str = "application/json", headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": content_type, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_unix(socket_path: str, method: str, path: str, body: bytes | None = None, timeout: float = 2.0,
              content_type: str = "application/json", headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
    """One HTTP/1.1 request over a Unix socket (OPA's decision socket): (status, body)."""
    connection = _UnixConnection(socket_path, timeout)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": content_type, **(headers or {})})
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def wait_until(check, timeout: float, what: str, proc: subprocess.Popen[bytes] | None = None,
               log=lambda: "") -> Any:
    """Poll ``check()`` until it returns a truthy value; bounded by ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}\n{log()}")
        try:
            last = check()
            if last:
                return last
        except (OSError, urllib.error.URLError) as exc:
            last = exc
        time.sleep(0.05)
    raise AssertionError(f"{what}: not true after {timeout}s (last: {last!r})\n{log()}")


def python_entrypoint() -> list[str]:
    """The Dockerfile's ENTRYPOINT with ``python`` mapped to this interpreter."""
    command = entrypoint()
    if command[0] in {"python", "python3"}:
        command = [sys.executable, *command[1:]]
    return command


__all__ = ["CHART", "PRODUCTION_VALUES", "DOCKERFILE", "HelmError", "LocalPod", "containers", "dockerfile_stages",
           "http_unix", "native_sidecars",
           "entrypoint", "find", "helm", "http", "http_get", "one", "python_entrypoint", "render", "wait_until",
           "write_atomic_volume"]
