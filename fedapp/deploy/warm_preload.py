"""What the warm launcher's fork server holds before it forks a ClientApp task (fedapp.deploy.warm_exec).

multiprocessing's fork server imports this module once (`set_forkserver_preload`); every task is a fork of that
process and starts with these modules imported. Nothing here starts a thread or runs a parallel torch op: a fork keeps
only the forking thread, and an OpenMP pool started before a fork can hang the child's first parallel region.
"""

from __future__ import annotations

import importlib

# What flwr-clientapp runs for a task, torch, fedapp's ClientApp with the modules it imports (config, data, models,
# protocols) and the launcher's own task entry. Imported by name, as flwr-clientapp and Flower's app loader would.
MODULES = ("flwr.supernode.runtime.run_clientapp", "torch", "fedapp.client_app", "fedapp.deploy.warm_exec")


def _pin_method_packages() -> None:
    """Import the top-level packages of the methods' client modules (`clients`), by the names the registry holds.
    A task's FAB folder goes first on sys.path; a method module imported later (`clients.classify`) is then found
    through its package's path, beside the preloaded fedapp, never in the FAB's copy."""
    from fedapp import registry

    for package in sorted({spec.client.partition(".")[0] for spec in registry.METHODS.values()}):
        importlib.import_module(package)


def _import_optimizer_machinery() -> None:
    """torch.optim imports torch._dynamo when a process builds its first optimizer (about 1 s, most of a fresh
    process's first training): build one over a one-element parameter, which enters no parallel region."""
    import torch

    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


for _name in MODULES:
    importlib.import_module(_name)
_pin_method_packages()
_import_optimizer_machinery()
