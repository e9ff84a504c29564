"""A Flower federation on this machine: real `flower-superlink` / `flower-supernode` / `flwr` processes started in
their own process groups, each logging to its own file, watched through those files and stopped with everything
they started. benchmarks/deployed_clients.py runs its deployments on it; the deployment tests build theirs on it
(tests/deploy_util.py adds certificates, SuperNode keys and the app's test runs).
"""

from __future__ import annotations

import os
import re
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


def flower(executable: str) -> str:
    """A Flower executable from this venv (not whatever `flwr` is first on PATH)."""
    return str(BIN / executable)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def flwr_env(home: Path) -> dict[str, str]:
    """The environment of every Flower process of one federation: its own FLWR_HOME (connections,
    state), no dependency installation or update check, the repo importable, this venv's bin first
    (the SuperLink and SuperNodes spawn `flower-superexec` by name), and one OpenMP thread per
    process: several ClientApps share the test machine's cores, and torch's default of one thread
    per core made a 2-second local training take 40 s on a busy 2-core machine."""
    return {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


@dataclass
class Certs:
    """A CA certificate and the SuperLink's certificate and key it signs (tests/deploy_util.make_certs)."""

    ca: Path
    cert: Path
    key: Path


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
    """One federation's Flower processes, all under `folder`, all stopped by `stop()`."""

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
