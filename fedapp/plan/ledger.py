"""The counted work of a run: calls of a module at a number of rows, server side or per client.

A `Term` is one kind of call (what, side, module, mode, rows per call) with its number of calls per
client (client work) or on the server (key SERVER). The method counters (fedapp/plan/counts.py,
generative.py) add terms to a `Ledger`; the benchmark (bench.py) times each distinct
(module, mode, rows) once and the plan multiplies.

Modules: prior.unet, prior.vae.encode, prior.vae.decode (the diffusion prior), classifier, ddpm (PFDM's
denoisers), velocity (DCFM's flow nets), router (DDM's), gmm (a scikit-learn GaussianMixture fit: rows
are samples). Modes: infer (a no-grad forward), train (forward, backward, optimiser step), grad-input (a
frozen network back-propagated to its input: Espresso's condition learning).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SERVER = -1  # the calls_by key of server work
MODEL_EVAL_MODULES = ("prior.unet", "ddpm", "velocity")  # (prefixes of) modules whose rows are model evaluations


@dataclass
class Term:
    what: str
    side: str  # "server" | "client"
    module: str
    mode: str  # "infer" | "train" | "grad-input"
    rows: int  # rows per call
    calls_by: dict[int, float] = field(default_factory=dict)  # client id (or SERVER) -> calls
    unet_factor: int = 1  # evaluations a row stands for (a velocity row of a composite: 1 per label set)

    @property
    def calls(self) -> float:
        return sum(self.calls_by.values())

    @property
    def evals(self) -> float:
        """Model evaluations (rows through the network); a backward pass counts as part of its call."""
        return self.calls * self.rows if self.module.startswith(MODEL_EVAL_MODULES) else 0.0


class Ledger:
    def __init__(self) -> None:
        self.terms: dict[tuple, Term] = {}
        self.notes: list[str] = []  # what the counts leave out
        self.modules: dict[str, dict] = {}  # module name -> what the benchmark builds (modules.build)
        self.figures: dict[str, object] = {}  # counted facts worth a line (images synthesised, conditions)

    def add(self, what: str, module: str, mode: str, rows: int, calls: float, client: int = SERVER) -> None:
        if rows <= 0 or calls <= 0:
            return
        side = "server" if client == SERVER else "client"
        key = (what, side, module, mode, int(rows))
        term = self.terms.setdefault(key, Term(what, side, module, mode, int(rows)))
        term.calls_by[client] = term.calls_by.get(client, 0.0) + calls

    def add_batched(self, what: str, module: str, mode: str, n: int, batch: int, times: float = 1.0,
                    client: int = SERVER) -> None:
        """`times` passes over n rows in minibatches of `batch` (the last one smaller)."""
        for count, rows in batches(n, batch):
            self.add(what, module, mode, rows, count * times, client)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def all(self) -> list[Term]:
        return list(self.terms.values())


def batches(n: int, batch: int) -> list[tuple[int, int]]:
    """[(count, rows)]: n rows cut into minibatches of `batch`, as torch.split does."""
    full, rest = divmod(int(n), int(batch))
    return [(c, r) for c, r in ((full, batch), (1 if rest else 0, rest)) if c and r]


def ceil_div(a: int, b: int) -> int:
    return -(-int(a) // int(b))
