"""mTLS on the internal gRPC links: `tessera certs` makes a development CA and certificates,
`tessera serve --tls-dir` runs the whole cluster with them, and a completion goes through
gateway -> coordinator -> worker over mutual TLS. The coordinator's and a worker's gRPC ports
refuse a client without a certificate, one with another CA's certificate and plain-text
HTTP/2; with the cluster's client certificate they answer (HTTP/2 SETTINGS), so the probe
itself is shown to work. Half-configured flags stop a role at start-up.

In etcd mode (when an etcd binary exists, as in test_etcd.py) the gateway finds the leader
and dials it over mTLS, and after a worker is killed and started again the coordinator's
supervisor re-forms the replica over mTLS; a gateway without certificates cannot use it.

The probe is the standard library's `ssl` with ALPN h2: a gRPC server's first HTTP/2 frame
after the connection preface is SETTINGS; a refused client gets a TLS alert or a closed
connection instead."""
import os
import re
import signal
import socket
import ssl
import subprocess
import time

import pytest
import requests

from support import MODEL_NAME, Cluster, free_port, model_path, tessera_bin, wait_until
from test_etcd import complete, etcd_cluster, wait_for  # noqa: F401 (etcd_cluster is a fixture)

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS


def make_certs(out, *extra):
    r = subprocess.run([str(tessera_bin()), "certs", "--out", str(out), *extra], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    base = tmp_path_factory.mktemp("mtls")
    return {"cluster": make_certs(base / "cluster"), "other": make_certs(base / "other")}


@pytest.fixture(scope="module")
def mtls_cluster(request, tmp_path_factory, certs):
    c = Cluster("mtls", tmp_path_factory.mktemp("mtls_cluster"), serve_args=("--tls-dir", str(certs["cluster"])))
    yield c
    leftovers = c.stop()
    assert not leftovers, f"mtls: {leftovers}\n{c.log_tail()}"


def grpc_addresses(cluster):
    """The coordinator's and the workers' gRPC addresses, as `tessera serve` printed them."""
    def find():
        cluster.log.flush()
        return re.search(r"tessera: gRPC: coordinator (\S+), workers (\S+)", cluster.log_path.read_text(errors="replace"))
    m = wait_until(find, 10, "the gRPC addresses in the serve log")
    return m.group(1), m.group(2).split(",")


def first_frame(addr, cert_dir=None, ca_dir=None, client="client", tls=True):
    """Opens a connection to `addr`, sends the HTTP/2 preface and returns the first bytes the
    server answers, or a string saying how the connection was refused."""
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        if tls:
            ctx = ssl.create_default_context(cafile=str(ca_dir / "ca.pem"))
            ctx.set_alpn_protocols(["h2"])
            if cert_dir is not None:
                ctx.load_cert_chain(str(cert_dir / f"{client}.pem"), str(cert_dir / f"{client}.key"))
            sock = ctx.wrap_socket(sock, server_hostname=host)
        sock.sendall(H2_PREFACE)
        data = sock.recv(64)
        return data if data else "closed"
    except (ssl.SSLError, ConnectionError) as e:
        return f"refused: {e}"
    finally:
        sock.close()


def is_settings(answer):
    # An HTTP/2 frame header: 3 bytes length, type 0x04 (SETTINGS), flags, stream 0.
    return isinstance(answer, bytes) and len(answer) >= 9 and answer[3] == 0x04


def refused(answer):
    return answer == "closed" or (isinstance(answer, str) and answer.startswith("refused"))


def test_a_completion_goes_through_mutual_tls(mtls_cluster):
    r = mtls_cluster.client().completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=6,
                                                 temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens >= 1
    mtls_cluster.log.flush()
    assert "mTLS inside" in mtls_cluster.log_path.read_text(errors="replace")


def test_grpc_ports_refuse_clients_without_a_cluster_certificate(mtls_cluster, certs):
    coordinator, workers = grpc_addresses(mtls_cluster)
    assert workers, "no worker address printed"
    for addr in [coordinator, *workers]:
        # The gateway's certificate (and the coordinator's server one, which also authenticates clients) work.
        ok = first_frame(addr, cert_dir=certs["cluster"], ca_dir=certs["cluster"])
        assert is_settings(ok), f"{addr}: a client with the cluster's certificate got {ok!r}"
        ok = first_frame(addr, cert_dir=certs["cluster"], ca_dir=certs["cluster"], client="server")
        assert is_settings(ok), f"{addr}: the server certificate as client got {ok!r}"
        # No certificate: refused in the handshake (TLS 1.3: the server's alert arrives on the first read).
        anon = first_frame(addr, ca_dir=certs["cluster"])
        assert refused(anon), f"{addr}: a client without a certificate got {anon!r}"
        # Another CA's certificate: refused.
        stranger = first_frame(addr, cert_dir=certs["other"], ca_dir=certs["cluster"])
        assert refused(stranger), f"{addr}: a client with another CA's certificate got {stranger!r}"
        # Plain-text HTTP/2 (what an insecure gRPC client speaks): a TLS alert record (0x15) or a close.
        plain = first_frame(addr, tls=False)
        assert plain == "closed" or plain[:1] == b"\x15", f"{addr}: a plain-text client got {plain!r}"


def test_half_configured_flags_stop_a_role_at_start(certs):
    d = certs["cluster"]
    for role in (["worker", "--listen", "127.0.0.1:0"], ["gateway", "--coordinator", "127.0.0.1:1"]):
        r = subprocess.run([str(tessera_bin()), *role, "--tls-cert", str(d / "server.pem")], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode != 0, f"{role[0]} started with half the TLS flags"
        assert "half configured" in r.stderr and "--tls-key" in r.stderr, r.stderr
    r = subprocess.run([str(tessera_bin()), "worker", "--listen", "127.0.0.1:0", "--tls-cert", str(d / "nope.pem"),
                        "--tls-key", str(d / "server.key"), "--tls-ca", str(d / "ca.pem")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "nope.pem" in r.stderr, r.stderr


def tls_flags(d, role):
    return ["--tls-cert", str(d / f"{role}.pem"), "--tls-key", str(d / f"{role}.key"), "--tls-ca", str(d / "ca.pem")]


def test_etcd_mode_leader_and_reforming_use_mtls(etcd_cluster, certs):
    procs, endpoint = etcd_cluster
    binary, model, d = str(tessera_bin()), model_path(), certs["cluster"]
    common = ["--etcd-endpoints", endpoint, "--cluster-name", "mtls", "--lease-ttl-s", "2"]
    worker_listen = f"127.0.0.1:{free_port()}"
    worker_argv = [binary, "worker", "--listen", worker_listen, "--threads", "1", *common, *tls_flags(d, "server")]
    worker = procs.start("worker", worker_argv)
    procs.start("coordinator", [binary, "coordinator", "--listen", f"127.0.0.1:{free_port()}", "--model", model,
                                "--kv-memory-mib", "64", "--connect-timeout-s", "60", *common,
                                *tls_flags(d, "server")])
    http, plain_http = free_port(), free_port()
    procs.start("gateway", [binary, "gateway", "--listen", f"127.0.0.1:{http}", "--model", model, *common,
                            *tls_flags(d, "client")])
    base = f"http://127.0.0.1:{http}"
    first: list[str] = []
    wait_for("a completion through the mTLS leader", lambda: first.append(complete(base)) or first[-1], 90, procs)

    # A gateway without certificates finds the same leader but cannot talk to it.
    procs.start("plain_gateway", [binary, "gateway", "--listen", f"127.0.0.1:{plain_http}", "--model", model,
                                  *common])
    plain = f"http://127.0.0.1:{plain_http}"
    wait_for("the plain gateway to listen", lambda: _status(plain + "/health") == 200, 60, procs)
    time.sleep(3)
    assert _status(plain + "/ready") != 200, "a gateway without a certificate reached the coordinator"
    assert complete(plain) is None, "a gateway without a certificate was served"

    # The worker dies and comes back on its address: the replica is re-formed over mTLS.
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    procs.start("worker_again", worker_argv)
    again: list[str] = []
    wait_for("a completion after re-forming", lambda: again.append(complete(base)) or again[-1], 90, procs)
    assert again[-1] == first[-1]


def _status(url):
    try:
        return requests.get(url, timeout=2).status_code
    except requests.RequestException:
        return None
