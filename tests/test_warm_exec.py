"""fedapp.deploy.warm_exec: the SuperExec that forks each ClientApp task from a warm fork server.

- the Flower symbols it relies on are where it expects them (else it would silently run Flower's own executor);
- a forked task runs Flower's `run_clientapp` with the task's values, as `flwr-clientapp` would;
- tasks are forks of one warm server (torch, Flower, fedapp.client_app and torch._dynamo imported before they
  start, no thread in the server), each in a process of its own; a task killed or failing ends alone;
- other task kinds, and a task that installs its dependencies, go to Flower's own executor.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

from flwr.supercore.constant import ExecutorType, TaskType
from flwr.supercore.superexec.executor import ExecutionSpec, LaunchResult

from fedapp.deploy import warm_exec

ROOT = Path(__file__).resolve().parents[1]


def spec(task_id: int, token: str = "t", **kw) -> ExecutionSpec:
    fields = dict(task_type=TaskType.CLIENT_APP, runtime_api_address="127.0.0.1:9094", token=token, insecure=True,
                  root_certificates_path=None, runtime_dependency_install=False, parent_pid=os.getpid(),
                  suppress_output=False, task_id=task_id)
    return ExecutionSpec(**{**fields, **kw})


def test_the_flower_symbols_the_launcher_replaces_and_calls_are_where_it_expects(monkeypatch):
    """Flower moving any of these would leave fedapp-warm-exec running Flower's executor, or nothing: fail here."""
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    run_superexec = importlib.import_module(warm_exec.FLOWER_SELECTION)  # its package exports a function so named
    flower_superexec = importlib.import_module("flwr.supercore.cli.flower_superexec")  # the CLI main() runs
    assert callable(run_superexec.get_executor)
    assert "get_executor(" in inspect.getsource(run_superexec.run_superexec)  # looked up when SuperExec starts
    assert "run_superexec(" in inspect.getsource(flower_superexec.flower_superexec)
    assert {"runtime_api_address", "token", "insecure", "certificates", "parent_pid",
            "runtime_dependency_install"} <= set(inspect.signature(run_clientapp).parameters)

    monkeypatch.setattr(run_superexec, "get_executor", run_superexec.get_executor)  # restored after the test
    monkeypatch.setattr(warm_exec.WarmForkExecutor, "warm_up", lambda self: [])
    warm_exec.use_warm_executor()
    assert isinstance(run_superexec.get_executor(ExecutorType.SUBPROCESS), warm_exec.WarmForkExecutor)


def test_a_task_runs_flowers_run_clientapp_with_the_tasks_values(monkeypatch, tmp_path):
    from flwr.supernode.runtime import run_clientapp as flower

    calls = []
    monkeypatch.setattr(flower, "run_clientapp", lambda **kw: calls.append(kw))
    ca = tmp_path / "ca.crt"
    ca.write_bytes(b"-----BEGIN CERTIFICATE-----\nnot checked here\n-----END CERTIFICATE-----\n")
    warm_exec.run_task(spec(7, token="secret", insecure=False, root_certificates_path=str(ca), parent_pid=4242))
    assert calls == [{"runtime_api_address": "127.0.0.1:9094", "token": "secret", "insecure": False,
                      "certificates": ca.read_bytes(), "parent_pid": 4242, "runtime_dependency_install": False}]


def test_other_task_kinds_and_dependency_installs_go_to_flowers_executor(monkeypatch):
    ex = warm_exec.WarmForkExecutor()
    cold = []
    monkeypatch.setattr(ex._cold, "launch", lambda s: cold.append(s.task_id) or LaunchResult.accepted())
    assert ex.launch(spec(1, task_type=TaskType.SERVER_APP)).status == "accepted"
    assert ex.launch(spec(2, runtime_dependency_install=True)).status == "accepted"
    assert cold == [1, 2] and not ex.finished  # nothing forked


DRIVER = """
import json, os, sys, time
from fedapp.deploy.warm_exec import WarmForkExecutor
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor import ExecutionSpec
import warm_exec_tasks

out = sys.argv[1]
ex = WarmForkExecutor(task=warm_exec_tasks.act)
missing = ex.warm_up()
tokens = [f"record:{out}/1.json", "kill", "raise", f"record:{out}/4.json"]
launched = []
for i, token in enumerate(tokens, 1):
    launched.append(str(ex.launch(ExecutionSpec(
        task_type=TaskType.CLIENT_APP, runtime_api_address="127.0.0.1:1", token=token, insecure=True,
        root_certificates_path=None, runtime_dependency_install=False, parent_pid=os.getpid(),
        suppress_output=False, task_id=i)).status))
    while len(ex.finished) < i:  # one after another, as a node's messages come
        time.sleep(0.01)
print(json.dumps({"launcher": os.getpid(), "missing": missing, "launched": launched,
                  "exits": {e.task_id: e.exitcode for e in ex.finished}}))
"""


def test_tasks_are_forks_of_one_warm_server_and_a_crash_ends_only_its_task(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    run = json.loads(res.stdout.strip().splitlines()[-1])
    first, last = (json.loads((tmp_path / f"{i}.json").read_text()) for i in (1, 4))

    assert run["missing"] == [] and run["launched"] == ["accepted"] * 4
    assert run["exits"] == {"1": 0, "2": -9, "3": 1, "4": 0}  # the killed and the failed task ended alone
    assert len({first["pid"], last["pid"], run["launcher"]}) == 3  # a process per task, none the launcher
    assert first["server"] == last["server"] != run["launcher"]  # forks of one server, which outlived the crash
    for task in (first, last):
        assert all(task["at_start"].values()), task["at_start"]  # imported before the task started
        assert task["server_threads"] == 1  # the preload started no thread: the fork is safe
