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

# The run config every deployment test starts from: one round of FedAvg on the built-in digits (no
# download; the app's 3 local epochs take a CPU-second or two and lift the global test accuracy
# from chance, 0.10, to 0.85 with one client and 0.61 with two, as in an in-process run).
FEDAVG_DIGITS = {"method": "fedavg", "dataset": "digits", "partitioner.name": "iid",
                 "partitioner.per-class": 0, "num-server-rounds": 1}


def flower(executable: str) -> str:
    """A Flower executable from this venv (not whatever `flwr` is first on PATH)."""
    return str(BIN / executable)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def flwr_env(home: Path) -> dict[str, str]:
    """The environment of every Flower process of one test: its own FLWR_HOME (connections,
    state), no dependency installation or update check, the repo importable, this venv's bin first
    (the SuperLink and SuperNodes spawn `flower-superexec` by name), and one OpenMP thread per
    process: several ClientApps share the test machine's cores, and torch's default of one thread
    per core made a 2-second local training take 40 s on a busy 2-core machine."""
    return {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
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

    def start(self, name: str, cmd: Sequence[str], prefix: Sequence[str] = (),
              env: dict[str, str] | None = None) -> Proc:
        """Start `cmd` in its own session, logging to `<name>.log`; `prefix` goes before it
        (e.g. `ip netns exec NS`); `env` adds to the federation's environment."""
        log = self.folder / f"{name}.log"
        with open(log, "w") as fh:
            p = subprocess.Popen([*prefix, *cmd], env={**self.env, **(env or {})}, stdout=fh, stderr=subprocess.STDOUT,
                                 start_new_session=True, cwd=self.folder)
        proc = Proc(name, p, log)
        self.procs.append(proc)
        return proc

    def superlink(self, host: str, port: int, certs: Certs | None = None, auth: bool = False) -> Proc:
        tls = (["--ssl-ca-certfile", str(certs.ca), "--ssl-certfile", str(certs.cert),
                "--ssl-keyfile", str(certs.key)] if certs else ["--insecure"])
        p = self.start("superlink", [flower("flower-superlink"), *tls, *(["--enable-supernode-auth"] if auth else []),
                                     "--host", host, "--port", str(port),
                                     "--database", str(self.folder / "state.db")])
        wait_for(p, r"Application startup complete", 60)
        return p

    def supernode(self, name: str, superlink: str, partition: int, partitions: int,
                  certs: Certs | None = None, key: Path | None = None, prefix: Sequence[str] = (),
                  launcher: Sequence[str] | None = None, env: dict[str, str] | None = None) -> Proc:
        """A SuperNode serving partition `partition` of `partitions`; its own Runtime API on a free
        loopback port (several nodes share this machine); `env` adds to its environment (e.g. a
        FEDAPP_CACHE of its own, as a node on another machine has)."""
        tls = ["--root-certificates", str(certs.ca)] if certs else ["--insecure"]
        auth = ["--auth-supernode-private-key", str(key)] if key else []
        return self.start(name, [*(launcher or [flower("flower-supernode")]), *tls, *auth, "--superlink", superlink,
                                 "--host", "127.0.0.1", "--port", str(free_port()),
                                 "--node-config", f"partition-id={partition} num-partitions={partitions}"],
                          prefix=prefix, env=env)

    def connection(self, name: str, address: str, certs: Certs | None = None) -> None:
        """Add a named SuperLink connection to FLWR_HOME/config.toml (what `flwr run . NAME` uses)."""
        cfg = self.home / "config.toml"
        text = cfg.read_text() if cfg.exists() else ""
        if "[superlink]" not in text:
            text = f'[superlink]\ndefault = "{name}"\n' + text
        tls = f'root-certificates = "{certs.ca}"' if certs else "insecure = true"
        cfg.write_text(text + f'\n[superlink.{name}]\naddress = "{address}"\n{tls}\n')

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([flower("flwr"), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=self.folder)

    def run_app(self, connection: str, run_name: str, timeout: float = 240, **overrides) -> dict:
        """`flwr run` this app with FEDAVG_DIGITS + overrides; return its summary.json."""
        out_dir = self.folder / "runs"
        cfg = run_config(out_dir=str(out_dir), run_name=run_name, **overrides)
        res = self.flwr("run", str(ROOT), connection, "--run-config", cfg, "--stream", timeout=timeout)
        (self.folder / f"flwr-run-{run_name}.log").write_text(res.stdout + res.stderr)  # the ServerApp's log
        path = out_dir / run_name / "summary.json"
        assert path.exists(), f"no summary.json\n{res.stdout[-3000:]}{res.stderr[-3000:]}\n{self.logs()}"
        return json.loads(path.read_text())

    def logs(self, tail: int = 2500) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.text()[-tail:]}" for p in self.procs)

    def stop(self) -> None:
        """SIGTERM every process group, SIGKILL what is left after 15 s. The group, not just the
        leader: a SuperNode that exits (e.g. refused) leaves its SuperExec retrying behind it. And
        every descendant: the SuperLink starts its SuperExec (and so the ServerApp) in a session
        of its own, which a ServerApp still running when its SuperLink dies outlives."""
        tree = [pid for p in self.procs for pid in _descendants(p.popen.pid)]
        for p in self.procs:
            _signal_group(p.popen, signal.SIGTERM)
        t0 = time.time()
        for p in self.procs:
            try:
                p.popen.wait(timeout=max(0.1, 15 - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(p.popen, signal.SIGKILL)
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except ProcessLookupError:  # the whole group is gone already
        pass


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` now, from /proc (empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after "(comm)": state, ppid
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we read
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def wait_for(proc: Proc, pattern: str, timeout: float, count: int = 1) -> str:
    """Block until `proc`'s log holds `count` matches of `pattern`; return the log. Fails fast
    with the log's tail when the process exits without it or the time runs out."""
    t0 = time.time()
    while True:
        exited = proc.popen.poll() is not None  # before reading: what it wrote before exiting counts
        text = proc.text()
        if len(re.findall(pattern, text)) >= count:
            return text
        if exited:
            raise AssertionError(f"{proc.name} exited ({proc.popen.returncode}) before /{pattern}/:\n{text[-3000:]}")
        if time.time() - t0 > timeout:
            raise AssertionError(f"{proc.name}: no /{pattern}/ x{count} after {timeout:.0f} s:\n{text[-3000:]}")
        time.sleep(0.2)
