"""What the deployment tests share: certificates and SuperNode keys made on the spot, SuperNodes on a second
network, and the app's test runs, on benchmarks/local_federation.py's Flower home with named SuperLink connections
and real `flower-superlink` / `flower-supernode` / `flwr` processes.

Every process writes to its own log file, so a test can wait for (and assert on) what one given
process said, and a failing test prints the tail of each.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import local_federation  # noqa: E402
from local_federation import BIN, Certs, Proc, flower, free_port, flwr_env, wait_for  # noqa: E402, F401

HAVE_FLWR_CLI = all(shutil.which(b, path=str(BIN)) for b in ("flower-superlink", "flower-supernode", "flwr"))
NO_FLWR_CLI = "flwr CLI (flower-superlink, flower-supernode, flwr) not installed beside this Python"

# The run config every deployment test starts from: one round of FedAvg on the built-in digits (no
# download; the app's 3 local epochs take a CPU-second or two and lift the global test accuracy
# from chance, 0.10, to 0.85 with one client and 0.61 with two, as in an in-process run).
FEDAVG_DIGITS = {"method": "fedavg", "dataset": "digits", "partitioner.name": "iid",
                 "partitioner.per-class": 0, "num-server-rounds": 1}


def run_config(**overrides) -> str:
    """`--run-config` text: FEDAVG_DIGITS with `overrides` (underscores in names become dashes)."""
    cfg = {**FEDAVG_DIGITS, **{k.replace("_", "-"): v for k, v in overrides.items()}}
    return " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in cfg.items())


# -- certificates and keys -------------------------------------------------------------------

def make_certs(folder: Path, ips: Sequence[str] = ("127.0.0.1",)) -> Certs:
    """A throwaway CA and a server certificate it signs, valid for `ips` and `localhost`.

    Flower's SuperLink spawns its SuperExec against 127.0.0.1 when it listens on 0.0.0.0, so a
    certificate for a SuperLink on all interfaces must name 127.0.0.1 as well as its public address.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))

    def pem_key(k):
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedapp test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(valid[0]).not_valid_after(valid[1])
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost")] + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "superlink")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(valid[0]).not_valid_after(valid[1])
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    out = Certs(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    out.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    out.key.write_bytes(pem_key(key))
    return out


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode's key pair as `ssh-keygen -t ecdsa -b 384 -N ""` writes it: (private, public)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    k = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    private.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                        serialization.NoEncryption()))
    public.write_bytes(k.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                   serialization.PublicFormat.OpenSSH))
    private.chmod(0o600)
    return private, public


# -- a SuperNode that is found dead in seconds, not a minute ----------------------------------

# A SuperNode promises a heartbeat every HEARTBEAT_DEFAULT_INTERVAL (30 s, a module constant, no
# flag) and the SuperLink declares it unavailable after 2 missed intervals: a killed node is noticed
# 30-60 s later. A test SuperNode started through this launcher promises 10 s (the least the
# SuperLink accepts), so a killed one is noticed within 20 s. Only the heartbeat interval changes.
FAST_HEARTBEAT_S = 10
_HEARTBEAT_MODULES = ("flwr.supernode.fleet_http_connection", "flwr.supercore.heartbeat")


def fast_heartbeat_supernode() -> list[str]:
    """The command that runs `flower-supernode` with a FAST_HEARTBEAT_S heartbeat."""
    imports = "; ".join(f"import {m}" for m in _HEARTBEAT_MODULES)
    patch = "; ".join(f"{m}.HEARTBEAT_DEFAULT_INTERVAL = {FAST_HEARTBEAT_S}" for m in _HEARTBEAT_MODULES)
    return [sys.executable, "-c", f"{imports}; {patch}; from flwr.supernode.cli import flower_supernode; "
                                  "raise SystemExit(flower_supernode())"]


def fast_heartbeat_missing() -> str | None:
    """Why fast_heartbeat_supernode cannot work with the installed flwr, or None."""
    import importlib

    from flwr.common import constant

    for m in _HEARTBEAT_MODULES:
        try:
            if not hasattr(importlib.import_module(m), "HEARTBEAT_DEFAULT_INTERVAL"):
                return f"{m} has no HEARTBEAT_DEFAULT_INTERVAL in this flwr version"
        except ImportError:
            return f"no module {m} in this flwr version"
    if getattr(constant, "HEARTBEAT_MIN_INTERVAL", FAST_HEARTBEAT_S) > FAST_HEARTBEAT_S:
        return f"this flwr's SuperLink refuses a {FAST_HEARTBEAT_S} s heartbeat interval"
    return None


# -- a second network, for a SuperNode that is not on the SuperLink's machine --------------------

def netns_missing() -> str | None:
    """Why this process cannot make network namespaces, or None."""
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root to create a network namespace"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2)"
    return None


def _in_use(ip: str) -> bool:
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    return f"inet {ip}/" in out


@dataclass
class VethNamespace:
    """A network namespace joined to this one by a veth pair, like a second host on a LAN:
    `host_ip` on this side, `ns_ip` inside, nothing else reachable from inside."""

    name: str
    host_ip: str
    ns_ip: str

    @property
    def exec(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    @classmethod
    def create(cls) -> "VethNamespace":
        """Make one on a free 10.200.X.0/24 (X from the pid: concurrent test runs do not clash).
        Raises RuntimeError with `ip`'s message when the kernel refuses (e.g. no CAP_NET_ADMIN)."""
        pid = os.getpid()
        octet = next(x for x in ((pid + i) % 250 + 1 for i in range(250)) if not _in_use(f"10.200.{x}.1"))
        ns = cls(f"fedapp{pid % 100000}", f"10.200.{octet}.1", f"10.200.{octet}.2")
        host_if, ns_if = ns._ifaces
        steps = [["ip", "netns", "add", ns.name],
                 ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
                 ["ip", "link", "set", ns_if, "netns", ns.name],
                 ["ip", "addr", "add", f"{ns.host_ip}/24", "dev", host_if],
                 ["ip", "link", "set", host_if, "up"],
                 [*ns.exec, "ip", "addr", "add", f"{ns.ns_ip}/24", "dev", ns_if],
                 [*ns.exec, "ip", "link", "set", ns_if, "up"],
                 [*ns.exec, "ip", "link", "set", "lo", "up"]]  # the SuperNode's own Runtime API
        for step in steps:
            res = subprocess.run(step, capture_output=True, text=True)
            if res.returncode != 0:
                ns.remove()
                raise RuntimeError(f"`{' '.join(step)}` failed: {res.stderr.strip()}")
        return ns

    @property
    def _ifaces(self) -> tuple[str, str]:
        return f"{self.name[:12]}h", f"{self.name[:12]}n"  # interface names: at most 15 characters

    def remove(self) -> None:
        """Delete the pair and the namespace (each step tolerates what is already gone)."""
        subprocess.run(["ip", "link", "del", self._ifaces[0]], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


# -- the app's test runs -------------------------------------------------------------------------

class Federation(local_federation.Federation):
    """A local federation that also runs this app with FEDAVG_DIGITS (`run_app`)."""

    def run_app(self, connection: str, run_name: str, timeout: float = 240, **overrides) -> dict:
        """`flwr run` this app with FEDAVG_DIGITS + overrides; return its summary.json."""
        out_dir = self.folder / "runs"
        cfg = run_config(out_dir=str(out_dir), run_name=run_name, **overrides)
        res = self.flwr("run", str(ROOT), connection, "--run-config", cfg, "--stream", timeout=timeout)
        (self.folder / f"flwr-run-{run_name}.log").write_text(res.stdout + res.stderr)  # the ServerApp's log
        path = out_dir / run_name / "summary.json"
        assert path.exists(), f"no summary.json\n{res.stdout[-3000:]}{res.stderr[-3000:]}\n{self.logs()}"
        return json.loads(path.read_text())
