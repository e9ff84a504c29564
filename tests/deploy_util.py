"""What the deployment tests share: a Flower home with named SuperLink connections, certificates
and SuperNode keys made on the spot, and real `flower-superlink` / `flower-supernode` / `flwr`
processes started in their own process groups, watched through their log files and stopped.

Every process writes to its own log file, so a test can wait for (and assert on) what one given
process said, and a failing test prints the tail of each.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
HAVE_FLWR_CLI = all(shutil.which(b, path=str(BIN)) for b in ("flower-superlink", "flower-supernode", "flwr"))
NO_FLWR_CLI = "flwr CLI (flower-superlink, flower-supernode, flwr) not installed beside this Python"

# The run config every deployment test starts from: FedAvg on the built-in digits (no download,
# one CPU-second per local epoch), one round unless a test asks for more.
FEDAVG_DIGITS = {"method": "fedavg", "dataset": "digits", "partitioner.name": "iid",
                 "partitioner.per-class": 0, "num-server-rounds": 1, "local-epochs": 1}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def flwr_env(home: Path) -> dict[str, str]:
    """The environment of every Flower process of one test: its own FLWR_HOME (connections,
    state), no dependency installation or update check, the repo importable, and this venv's
    bin first (the SuperLink and SuperNodes spawn `flower-superexec` by name)."""
    return {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1", "PYTHONPATH": str(ROOT),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def run_config(**overrides) -> str:
    """`--run-config` text: FEDAVG_DIGITS with `overrides` (underscores in names become dashes)."""
    cfg = {**FEDAVG_DIGITS, **{k.replace("_", "-"): v for k, v in overrides.items()}}
    return " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in cfg.items())


# -- certificates and keys -------------------------------------------------------------------

@dataclass
class Certs:
    ca: Path
    cert: Path
    key: Path


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


# -- processes -------------------------------------------------------------------------------

@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self) -> None:
        """SIGKILL the whole process group (the SuperNode, its SuperExec and ClientApp)."""
        _signal_group(self.popen, signal.SIGKILL)
        self.popen.wait(timeout=15)


@dataclass
class Federation:
    """One test's Flower processes, all under `folder`, all stopped by `stop()`."""

    folder: Path
    home: Path = field(init=False)
    env: dict[str, str] = field(init=False)
    procs: list[Proc] = field(default_factory=list)

    def __post_init__(self):
        self.home = self.folder / "flwr-home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.env = flwr_env(self.home)

    def start(self, name: str, args: Sequence[str], prefix: Sequence[str] = ()) -> Proc:
        """Start `args` (a Flower executable from this venv, then its flags) in its own session;
        `prefix` goes before it (e.g. `ip netns exec NS`)."""
        log = self.folder / f"{name}.log"
        with open(log, "w") as fh:
            p = subprocess.Popen([*prefix, str(BIN / args[0]), *args[1:]], env=self.env, stdout=fh,
                                 stderr=subprocess.STDOUT, start_new_session=True, cwd=self.folder)
        proc = Proc(name, p, log)
        self.procs.append(proc)
        return proc

    def superlink(self, host: str, port: int, certs: Certs | None = None, auth: bool = False) -> Proc:
        tls = (["--ssl-ca-certfile", str(certs.ca), "--ssl-certfile", str(certs.cert),
                "--ssl-keyfile", str(certs.key)] if certs else ["--insecure"])
        p = self.start("superlink", ["flower-superlink", *tls, *(["--enable-supernode-auth"] if auth else []),
                                     "--host", host, "--port", str(port),
                                     "--database", str(self.folder / "state.db")])
        wait_for(p, r"Application startup complete", 60)
        return p

    def supernode(self, name: str, superlink: str, partition: int, partitions: int,
                  certs: Certs | None = None, key: Path | None = None, prefix: Sequence[str] = (),
                  launcher: Sequence[str] = ("flower-supernode",)) -> Proc:
        """A SuperNode serving partition `partition` of `partitions`; its own Runtime API on a free
        loopback port (several nodes share this machine)."""
        tls = ["--root-certificates", str(certs.ca)] if certs else ["--insecure"]
        auth = ["--auth-supernode-private-key", str(key)] if key else []
        return self.start(name, [*launcher, *tls, *auth, "--superlink", superlink,
                                 "--host", "127.0.0.1", "--port", str(free_port()),
                                 "--node-config", f"partition-id={partition} num-partitions={partitions}"],
                          prefix=prefix)

    def connection(self, name: str, address: str, certs: Certs | None = None) -> None:
        """Add a named SuperLink connection to FLWR_HOME/config.toml (what `flwr run . NAME` uses)."""
        cfg = self.home / "config.toml"
        text = cfg.read_text() if cfg.exists() else ""
        if "[superlink]" not in text:
            text = f'[superlink]\ndefault = "{name}"\n' + text
        tls = f'root-certificates = "{certs.ca}"' if certs else "insecure = true"
        cfg.write_text(text + f'\n[superlink.{name}]\naddress = "{address}"\n{tls}\n')

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "flwr"), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=self.folder)

    def run_app(self, connection: str, run_name: str, timeout: float = 240, **overrides) -> dict:
        """`flwr run` this app with FEDAVG_DIGITS + overrides; return its summary.json."""
        out_dir = self.folder / "runs"
        cfg = run_config(out_dir=str(out_dir), run_name=run_name, **overrides)
        res = self.flwr("run", str(ROOT), connection, "--run-config", cfg, "--stream", timeout=timeout)
        path = out_dir / run_name / "summary.json"
        assert path.exists(), f"no summary.json\n{res.stdout[-3000:]}{res.stderr[-3000:]}\n{self.logs()}"
        return json.loads(path.read_text())

    def logs(self, tail: int = 2500) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.text()[-tail:]}" for p in self.procs)

    def stop(self) -> None:
        """SIGTERM every process group, SIGKILL what is left after 15 s. The group, not just the
        leader: a SuperNode that exits (e.g. refused) leaves its SuperExec retrying behind it."""
        for p in self.procs:
            _signal_group(p.popen, signal.SIGTERM)
        t0 = time.time()
        for p in self.procs:
            try:
                p.popen.wait(timeout=max(0.1, 15 - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(p.popen, signal.SIGKILL)


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except ProcessLookupError:  # the whole group is gone already
        pass


def wait_for(proc: Proc, pattern: str, timeout: float, count: int = 1) -> str:
    """Block until `proc`'s log holds `count` matches of `pattern`; return the log. Fails fast
    with the log's tail when the process exits or the time runs out."""
    t0 = time.time()
    while True:
        text = proc.text()
        if len(re.findall(pattern, text)) >= count:
            return text
        if proc.popen.poll() is not None:
            raise AssertionError(f"{proc.name} exited ({proc.popen.returncode}) before /{pattern}/:\n{text[-3000:]}")
        if time.time() - t0 > timeout:
            raise AssertionError(f"{proc.name}: no /{pattern}/ x{count} after {timeout:.0f} s:\n{text[-3000:]}")
        time.sleep(0.2)
