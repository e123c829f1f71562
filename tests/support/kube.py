"""A real Kubernetes API server for tests: kube-apiserver on kine's SQLite store, on loopback.

Owns: starting ``kine`` (SQLite in a temporary directory) and ``kube-apiserver`` (both built by
scripts/setup.sh from the Go module proxy, pinned below) on free loopback ports, with a serving
certificate, service-account keys and an admin token made here; the API server's admission plugins are
its defaults (PodSecurity included). ``KubeApiServer.request`` talks to its REST API and returns the
server's own answer (status and body); ``kubeconfig`` writes the file ``helm`` uses.
Must never: reach anything but 127.0.0.1, or stand in for the API server's answers: no kubelet or
controller-manager runs, so a Deployment's pods exist only when a test creates them.

Without the binaries a developer's test run skips, naming what to run; CI's (``CI=true``) fails.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.support.servers import BinaryNotFound, _Server, find_binary, free_port

KUBE_VERSION = "v1.37.2"  # scripts/setup.sh's pins
KINE_VERSION = "v0.17.5"
ADMIN_TOKEN_USER = "toolproxy-test-admin"
# kine's own SQLite parameters (its DefaultParams), given with a path of the test's.
SQLITE_PARAMS = "_journal_mode=WAL&_busy_timeout=30000&_synchronous=NORMAL&_txlock=immediate&cache=shared"


def kube_binaries() -> tuple[str, str]:
    """(kine, kube-apiserver); missing ones skip a developer's run and fail CI's (setup.sh builds both)."""
    try:
        return find_binary("kine"), find_binary("kube-apiserver")
    except BinaryNotFound as exc:
        message = (f"kube-apiserver {KUBE_VERSION} and kine {KINE_VERSION} are not installed (scripts/setup.sh "
                   f"builds both when Go is present): {exc}")
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _serving_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 / localhost (the client trusts exactly it)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / "serving.crt", directory / "serving.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(_key_pem(key))
    return cert_file, key_file


def _service_account_keys(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / "sa.key", directory / "sa.pub"
    private.write_bytes(_key_pem(key))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


class KineServer(_Server):
    """kine serving the etcd API on 127.0.0.1 from a SQLite file in ``directory``."""

    name = "kine"

    def __init__(self, binary: str, directory: Path, start_timeout: float = 60.0) -> None:
        super().__init__(None, start_timeout)
        self.binary, self.directory = binary, directory

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _command(self) -> list[str]:
        return [self.binary, "--endpoint", f"sqlite://{self.directory / 'state.db'}?{SQLITE_PARAMS}",
                "--listen-address", f"127.0.0.1:{self.port}", "--metrics-bind-address", "0"]

    def _is_ready(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1):
            return True


class KubeApiServer(_Server):
    """kube-apiserver on 127.0.0.1 with the store at ``etcd_url``; an admin token in system:masters."""

    name = "kube-apiserver"

    def __init__(self, binary: str, etcd_url: str, directory: Path, start_timeout: float = 180.0) -> None:
        super().__init__(None, start_timeout)
        self.binary, self.etcd_url, self.directory = binary, etcd_url, directory
        directory.mkdir(parents=True, exist_ok=True)
        self.cert_file, self.key_file = _serving_certificate(directory)
        self.sa_key, self.sa_pub = _service_account_keys(directory)
        self.token = os.urandom(24).hex()
        self.token_file = directory / "tokens.csv"
        self.token_file.write_text(f'{self.token},{ADMIN_TOKEN_USER},{ADMIN_TOKEN_USER},"system:masters"\n')
        self._tls = ssl.create_default_context(cafile=str(self.cert_file))

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _command(self) -> list[str]:
        return [self.binary,
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.port}",
                f"--tls-cert-file={self.cert_file}", f"--tls-private-key-file={self.key_file}",
                f"--cert-dir={self.directory}",
                f"--token-auth-file={self.token_file}",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={self.sa_pub}", f"--service-account-signing-key-file={self.sa_key}",
                "--service-cluster-ip-range=10.96.0.0/24",
                # No node, so no endpoint for the "kubernetes" Service to reconcile.
                "--endpoint-reconciler-type=none",
                "--profiling=false"]

    def _is_ready(self) -> bool:
        return self.request("GET", "/readyz")[0] == 200

    def request(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
        """The API server's answer to one request: (HTTP status, the body parsed as JSON, else its text)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {self.token}",
                                              "Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self._tls) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig for this server and the admin token (what ``helm --kubeconfig`` reads)."""
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url,
                                                      "certificate-authority": str(self.cert_file)}}],
            "users": [{"name": "admin", "user": {"token": self.token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}]}))
        path.chmod(0o600)
        return path


__all__ = ["KINE_VERSION", "KUBE_VERSION", "KineServer", "KubeApiServer", "kube_binaries"]
