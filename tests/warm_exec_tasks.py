"""Tasks that tests/test_warm_exec.py has fedapp's warm launcher fork: each acts on its spec's token (opaque to the
launcher), `record:PATH`, `kill` or `raise`. A module of its own, importable in the forked processes by name."""

import json
import os
import signal
import sys
import time

# what a forked task finds imported when it starts: Flower's task runner, torch with the first optimizer's
# torch._dynamo, fedapp's ClientApp and the method packages
WATCHED = ("flwr.supernode.runtime.run_clientapp", "torch", "torch._dynamo", "fedapp.client_app", "clients")


def act(spec) -> None:
    kind, _, path = spec.token.partition(":")
    if kind == "kill":  # as the kernel ends a task that ran out of memory
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "raise":
        raise RuntimeError("a task that fails")
    at_start = {m: m in sys.modules for m in WATCHED}
    server = os.getppid()
    with open(path, "w") as fh:
        json.dump({"pid": os.getpid(), "server": server, "at_start": at_start, "t": time.time(),
                   "server_threads": len(os.listdir(f"/proc/{server}/task"))}, fh)
