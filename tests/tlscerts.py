"""Certificates for TLS tests, made by the ``openssl`` command (the ``cryptography`` package is not a
dependency of gpuprims) in a directory the caller owns: a CA, a server certificate for 127.0.0.1 and
localhost signed by it, a client certificate signed by it, and a second CA that signed nothing here."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

OPENSSL_TIMEOUT_S = 60
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_key: Path


def _openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True, timeout=OPENSSL_TIMEOUT_S)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)
    return d / f"{name}.pem", d / f"{name}.key"


def _signed(d: Path, name: str, ca: tuple[Path, Path], ext: str) -> tuple[Path, Path]:
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial", "-days", "2",
             "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)
    return d / f"{name}.pem", d / f"{name}.key"


def make_certs(d: Path) -> Certs:
    """The certificates of this module's docstring, as PEM files in ``d`` (EC P-256 keys, valid two days)."""
    ca = _ca(d, "ca")
    server = _signed(d, "server", ca, "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    client = _signed(d, "client", ca, "extendedKeyUsage=clientAuth\n")
    other = _ca(d, "other")
    return Certs(ca[0], server[0], server[1], client[0], client[1], other[0], other[1])
