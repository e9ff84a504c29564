"""Loopback deployment: a real SuperLink, two SuperNodes and `flwr run`, all on 127.0.0.1.

The same app that runs as a Ray simulation runs unchanged on SuperNodes; each SuperNode
learns its shard only from `--node-config "partition-id=K num-partitions=N"`.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args, env, log):
    return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.skipif(shutil.which("flower-superlink", path=str(BIN)) is None, reason="flwr CLI not installed")
def test_loopback_deployment_runs_one_fedavg_round(tmp_path):
    home = tmp_path / "flwr-home"
    home.mkdir()
    port = _free_port()
    node_ports = [_free_port(), _free_port()]
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_DISABLE_UPDATE_CHECK": "1", "PYTHONPATH": str(ROOT),
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}  # SuperLink spawns flower-superexec
    log = open(tmp_path / "processes.log", "w")
    procs = [_start([str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(port),
                     "--database", str(tmp_path / "state.db")], env, log)]
    try:
        time.sleep(4)
        for k, p in enumerate(node_ports):
            procs.append(_start([str(BIN / "flower-supernode"), "--insecure", "--superlink",
                                 f"127.0.0.1:{port}", "--host", "127.0.0.1", "--port", str(p),
                                 "--node-config", f"partition-id={k} num-partitions=2"], env, log))
        out_dir = tmp_path / "runs"
        overrides = (f"method='fedavg' dataset='digits' partitioner.name='iid' partitioner.per-class=0 num-server-rounds=1 min-clients=2 "
                     f"run-name='deploy' out-dir='{out_dir}'")
        run = subprocess.run([str(BIN / "flwr"), "run", str(ROOT), "loopback", "--run-config", overrides,
                              "--stream"], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        summary_path = out_dir / "deploy" / "summary.json"
        assert summary_path.exists(), run.stdout[-3000:] + run.stderr[-3000:] + (tmp_path / "processes.log").read_text()[-3000:]
        s = json.loads(summary_path.read_text())
        assert s["status"] == "completed" and s["num_clients"] == 2
        assert set(s["metrics"]["per_client_accuracy"]) == {"0", "1"}
        assert s["metrics"]["accuracy"] > 0.1
    finally:
        _stop(procs)
        log.close()
