"""A throwaway certificate authority for tests: a CA, a server certificate for 127.0.0.1 and
localhost, and a client certificate, made with the ``openssl`` command line (no Python
dependency). Everything is valid for two days and lives in the test's temp dir.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.harness.ci import unavailable


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def server_context(self, require_client_cert: bool = False) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.server_cert, self.server_key)
        if require_client_cert:
            context.load_verify_locations(self.ca_cert)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True,
                            timeout=30, check=False)
    if result.returncode != 0:
        unavailable(f"a working openssl ({args[0]} failed: {result.stderr.strip()[-500:]})")


def _leaf(directory: Path, name: str, usage: str, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    key, csr, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.crt"
    ext = directory / f"{name}.ext"
    ext.write_text(f"subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage={usage}\n"
                   "basicConstraints=CA:FALSE\n")
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", key.name, "-out", csr.name, "-subj", f"/CN={name}",
             cwd=directory)
    _openssl("x509", "-req", "-in", csr.name, "-CA", ca[0].name, "-CAkey", ca[1].name,
             "-CAcreateserial", "-out", cert.name, "-days", "2", "-extfile", ext.name,
             cwd=directory)
    return cert, key


def make_tls_files(directory: Path) -> TlsFiles:
    """A fresh CA with a server and a client certificate under ``directory``. Without an
    ``openssl`` binary the test is skipped, or failed in CI (:func:`~tests.harness.ci.unavailable`)."""
    if shutil.which("openssl") is None:
        unavailable("openssl")
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = directory / "ca.crt", directory / "ca.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", ca_key.name, "-out", ca_cert.name, "-days", "2",
             "-subj", "/CN=llm-sidecar test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)
    server_cert, server_key = _leaf(directory, "server", "serverAuth", (ca_cert, ca_key))
    client_cert, client_key = _leaf(directory, "client", "clientAuth", (ca_cert, ca_key))
    return TlsFiles(ca_cert, server_cert, server_key, client_cert, client_key)
