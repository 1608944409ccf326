"""TLS material for a cluster that serves clients over HTTPS (made with ``trustme``)."""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass


@dataclass(frozen=True)
class TLSFiles:
    """Paths of the PEM files of a TLS-enabled cluster."""

    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    #: Whether the server requires client certificates.
    client_cert_auth: bool = False

    def client_ssl_context(self) -> ssl.SSLContext:
        """An SSL context that trusts the CA and presents the client certificate."""
        context = ssl.create_default_context(cafile=self.ca_cert)
        context.load_cert_chain(self.client_cert, self.client_key)
        return context


def _make_tls_files(directory: str, client_cert_auth: bool) -> TLSFiles:
    try:
        import trustme
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "EtcdCluster(tls=True) needs the 'trustme' package "
            "(pip install trustme, or the project's 'test' extra)"
        ) from exc
    os.makedirs(directory, mode=0o700, exist_ok=True)
    ca = trustme.CA(organization_name="etcd-leases test CA")
    server = ca.issue_cert("127.0.0.1", "localhost", common_name="127.0.0.1")
    client = ca.issue_cert("etcd-leases-client", common_name="etcd-leases-client")

    def write(name: str, data: bytes) -> str:
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        return path

    return TLSFiles(
        ca_cert=write("ca.pem", ca.cert_pem.bytes()),
        server_cert=write("server.pem", b"".join(b.bytes() for b in server.cert_chain_pems)),
        server_key=write("server-key.pem", server.private_key_pem.bytes()),
        client_cert=write("client.pem", b"".join(b.bytes() for b in client.cert_chain_pems)),
        client_key=write("client-key.pem", client.private_key_pem.bytes()),
        client_cert_auth=client_cert_auth,
    )
