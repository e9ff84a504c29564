"""`fedapp-warm-exec`: the SuperExec of a SuperNode started with `--isolation process`, which starts each ClientApp
task as a fork of a process that has already imported torch, Flower and fedapp's ClientApp.

    flower-supernode --isolation process --superlink SERVER:8000 --port 9094 --node-config "..." ...
    fedapp-warm-exec --runtime-api-address 127.0.0.1:9094 --insecure   # or: python -m fedapp.deploy.warm_exec

It is `flower-superexec` (the same arguments, the same polling of the SuperNode's Runtime API, Flower's own
`run_clientapp` in every task) with one part swapped: where Flower's SubprocessExecutor starts `flwr-clientapp` anew
for every message (a new interpreter importing Flower and torch, then torch.optim's first optimizer importing
torch._dynamo), this executor asks multiprocessing's fork server, which did that once (fedapp.deploy.warm_preload),
for a fork that runs `run_clientapp` with the task's token. Every task is still a process of its own, so a task that
crashes ends alone. The fork server holds no network connection (the polling runs in this process, never forked), so
no task inherits one.

A task runs the fedapp installed beside this launcher: the FAB Flower installs for the run is on its path, but
fedapp and the method packages were imported before it, from the installation. Tasks of other kinds, and any task
that asks Flower to install its app's dependencies, start as Flower starts them.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from logging import INFO, WARNING
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

from flwr.supercore import log
from flwr.supercore.constant import ExecutorType, TaskType
from flwr.supercore.superexec.executor import ExecutionSpec, LaunchResult, SubprocessExecutor

PRELOAD = "fedapp.deploy.warm_preload"
FLOWER_SELECTION = "flwr.supercore.superexec.run_superexec"  # the module whose `get_executor` is replaced


@dataclass(frozen=True)
class TaskExit:
    task_id: int
    exitcode: int | None  # negative: the signal that ended it
    seconds: float  # from the fork's request to the task process' exit


def run_task(spec: ExecutionSpec) -> None:
    """A forked task: what `flwr-clientapp --token T --runtime-api-address A [--insecure | --root-certificates P]
    [--parent-pid PID]` runs (flwr/supernode/cli/flwr_clientapp.py), with the spec's values."""
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    from flwr.supernode.runtime import run_clientapp as flower

    flower.run_clientapp(runtime_api_address=spec.runtime_api_address, token=spec.token, insecure=spec.insecure,
                         certificates=validate_and_resolve_root_certificates(spec.root_certificates_path,
                                                                             spec.insecure),
                         parent_pid=spec.parent_pid, runtime_dependency_install=False)


def _serve(task: Callable[[ExecutionSpec], None], spec: ExecutionSpec) -> None:
    """The forked process' entry: Flower's output switch, then the task."""
    if spec.suppress_output:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    task(spec)


def _report_missing(path: str) -> None:
    """A probe fork's entry: write which of the preloaded modules it lacks (none when the fork server is warm)."""
    preload = sys.modules.get(PRELOAD)
    names = [PRELOAD] if preload is None else [*preload.MODULES, "torch._dynamo"]
    Path(path).write_text(json.dumps([m for m in names if m not in sys.modules]))


class WarmForkExecutor:
    """Flower's Executor protocol (flwr/supercore/superexec/executor/types.py) over multiprocessing's fork server.

    `task` is what a forked ClientApp task runs (run_task; a test passes its own), a module-level function."""

    def __init__(self, task: Callable[[ExecutionSpec], None] = run_task):
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload([PRELOAD])
        self._task = task
        self._cold = SubprocessExecutor()
        self._lock = threading.Lock()  # multiprocessing's bookkeeping of children: one thread at a time
        self._running: dict[int, Any] = {}
        self.finished: deque[TaskExit] = deque(maxlen=1000)  # the latest exits; a node runs for months

    def warm_up(self, timeout: float = 600.0) -> list[str]:
        """Start the fork server now rather than at the first message, and fork one probe from it once it has
        imported everything: the preloaded modules a fork lacks (empty when warm), logged."""
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "missing.json"
            probe = self._ctx.Process(target=_report_missing, args=(str(out),), name="fedapp-warm-exec probe")
            with self._lock:
                probe.start()
                probe.join(timeout)
            missing = json.loads(out.read_text()) if out.exists() else [PRELOAD]
        if missing:
            log(WARNING, "fedapp-warm-exec: the fork server lacks %s; tasks import them themselves",
                ", ".join(missing))
        else:
            log(INFO, "fedapp-warm-exec: fork server ready in %.1f s (Flower, torch and fedapp.client_app imported)",
                time.perf_counter() - t0)
        return missing

    # -- Flower's Executor protocol --------------------------------------------------------------------------
    def get_eligible_capacity(self, supported_task_types: set[TaskType], *, insecure: bool = False,
                              root_certificates_path: str | None = None) -> tuple[set[TaskType], set[str]]:
        return supported_task_types, set()  # like Flower's SubprocessExecutor: no capacity gate

    def wait_for_capacity(self, task_type: TaskType | None = None, *, fab_hash: str | None = None,
                          insecure: bool = False, root_certificates_path: str | None = None) -> None:
        return None

    def launch(self, spec: ExecutionSpec) -> LaunchResult:
        if spec.task_type != TaskType.CLIENT_APP or spec.runtime_dependency_install:
            return self._cold.launch(spec)  # a preloaded process cannot take another app's packages
        proc = self._ctx.Process(target=_serve, args=(self._task, spec), name=f"flwr-clientapp task {spec.task_id}")
        started = time.perf_counter()
        try:
            with self._lock:
                proc.start()
                self._running[spec.task_id] = proc
        except (OSError, EOFError) as err:  # the fork server died and could not be restarted, or the fork failed
            return LaunchResult.failed(f"fedapp-warm-exec could not fork task {spec.task_id}: {err}")
        threading.Thread(target=self._await_exit, args=(spec.task_id, proc, started), daemon=True,
                         name=f"fedapp-warm-exec task {spec.task_id}").start()
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        return None  # each task's thread reaps its process

    def close(self) -> None:
        """SuperExec stops: SIGTERM the running tasks, whose Flower handler reports them stopped (as flwr-clientapp
        processes stop when their SuperExec's pid goes)."""
        with self._lock:
            for proc in list(self._running.values()):
                if proc.exitcode is None:
                    proc.terminate()

    def _await_exit(self, task_id: int, proc: Any, started: float) -> None:
        wait([proc.sentinel])  # ready when the process exits; reading it is join's
        seconds = time.perf_counter() - started
        with self._lock:
            proc.join()
            code = proc.exitcode
            proc.close()
            self._running.pop(task_id, None)
        self.finished.append(TaskExit(task_id, code, seconds))
        log(INFO if code == 0 else WARNING, "fedapp-warm-exec: task %d exited with code %s after %.3f s",
            task_id, code, seconds)


def use_warm_executor() -> None:
    """Make Flower's SuperExec use WarmForkExecutor where it would use its SubprocessExecutor.

    Flower 1.42 has no way to register an executor of one's own (`--executor` takes its ExecutorType only), and
    `run_superexec` looks up `get_executor` in its module when it starts: this assignment is the whole substitution.
    tests/test_warm_exec.py fails if Flower moves it; here a moved symbol stops the launcher with one line."""
    selection = importlib.import_module(FLOWER_SELECTION)
    flower_get_executor = getattr(selection, "get_executor", None)
    if flower_get_executor is None:
        raise SystemExit(f"fedapp-warm-exec: this flwr has no {FLOWER_SELECTION}.get_executor to replace "
                         "(written for flwr 1.42); start flower-superexec instead")

    def get_executor(executor_type: ExecutorType, executor_config: Any = None, **kwargs: Any) -> Any:
        if executor_type != ExecutorType.SUBPROCESS:
            return flower_get_executor(executor_type, executor_config, **kwargs)
        executor = WarmForkExecutor()
        executor.warm_up()
        return executor

    setattr(selection, "get_executor", get_executor)


def main() -> None:
    """`fedapp-warm-exec`: flower-superexec's command line, with ClientApp tasks forked warm."""
    use_warm_executor()
    from flwr.supercore.cli.flower_superexec import flower_superexec

    flower_superexec()


if __name__ == "__main__":  # `python -m`: run the importable module's main, whose functions forked tasks can find
    from fedapp.deploy.warm_exec import main as _main

    _main()
