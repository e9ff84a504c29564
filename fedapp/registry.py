"""Method name -> MethodSpec: the one place a method is added, and its written contract.

A spec names the method's three parts by import string, loaded on use, so that choosing `fedavg`
never imports diffusers: the protocol module (fedapp/protocols/<m>.py: `PHASES`, record keys,
validation), the strategy (a class taking a `fedapp.server.ServerRun`) and the client module
(`HANDLERS: {message_type: handler}`). Its other fields are the traits the app checks before and
during a run; nothing reads them off the modules. Nothing else in fedapp imports strategies/ or
clients/: only this module, by name.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class MethodSpec:
    protocol: str  # module of the message protocol (phases, keys, validation)
    strategy: str  # "module:Class" of the server side
    client: str  # module with HANDLERS
    paper: str = ""
    namespace: str | None = None  # prefix of its run-config keys (`espresso.clusters`); None: no options
    options: str | None = None  # "module:Class": the frozen dataclass of `opt(...)` fields under `namespace`
    uses_prior: bool = False  # runs a diffusion prior: `prior` must resolve, and it decides image-size=auto
    resumable: bool = False  # `resume` may continue a run from its per-round checkpoint
    samples_clients: bool = False  # honours fraction-train / fraction-evaluate (Flower FedAvg's sampling)
    preflight: str | None = None  # "module:function", cfg -> reason | None: its own check before the run
    server_only_keys: frozenset[str] = frozenset()  # run-config keys no client reads (ReplyCache ignores them)
    # per message type, the run-config keys its client handler does not read (ReplyCache ignores them for it)
    unread_keys: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.namespace is None) != (self.options is None):  # a namespace is the options' key prefix
            raise ValueError(f"MethodSpec({self.strategy!r}): namespace and options go together")


# Traits several specs share (typed Any: each unpacks into MethodSpec's differently typed fields)
_ROUNDS: dict[str, Any]
_ESPRESSO: dict[str, Any]
_PFDM: dict[str, Any]
_DCFM: dict[str, Any]

# The round-based classification methods: Flower's FedAvg loop samples clients; the global model is
# checkpointed every round (strategies/fedavg.py), and the clients keep nothing between rounds that a
# resumed run would lack -- except MOON's, whose previous local models live in the nodes' state.
_ROUNDS = dict(samples_clients=True, resumable=True)
_ESPRESSO = dict(namespace="espresso", options="fedapp.protocols.espresso:EspressoOptions", uses_prior=True,
                 preflight="fedapp.protocols.espresso:preflight",
                 # synthesis and the server's classifier: runs differing only in these send the clients
                 # the same work, so an experiment may reuse the replies (fedapp.simulation.ReplyCache)
                 server_only_keys=frozenset({
                     "espresso.sampler", "espresso.zigzag-t", "espresso.zigzag", "espresso.gamma1",
                     "espresso.gamma2", "espresso.ratio", "espresso.synth-batch", "espresso.save-synthetic",
                     "espresso.precision", "espresso.evaluate-clients", "server-epochs", "run-name", "out-dir"}))
_PFDM = dict(namespace="pfdm", options="fedapp.protocols.pfdm:PFDMOptions")
_DCFM = dict(namespace="dcfm", options="fedapp.protocols.dcfm:DcfmOptions",
             # what the server does after Stage I (variant, A's rounds, B's distillation, sampling, evaluation):
             # DCFM-A and DCFM-B send the clients the same Stage I, which an experiment may then reuse;
             # FedFlow's round count is the server's loop (each message carries its round), so a longer FedFlow
             # run finds a shorter one's rounds
             server_only_keys=frozenset({
                 "dcfm.variant", "dcfm.rounds", "dcfm.peer-schedule", "dcfm.distill-steps", "dcfm.replay",
                 "dcfm.replay-paths", "dcfm.path-steps", "dcfm.sample-steps", "dcfm.samples-per-pair",
                 "dcfm.fl-local-steps", "dcfm.router-steps", "dcfm.ref-epochs", "dcfm.a-sampler", "dcfm.ddm-ci",
                 "num-server-rounds", "run-name", "out-dir"}),
             # A's peer-phase keys: a sweep over them finds its Stage I (`train`) in the cache
             unread_keys={"train": frozenset({"dcfm.peer-steps", "dcfm.routes-per-batch", "dcfm.route-mask"})})

METHODS: dict[str, MethodSpec] = {
    "fedavg": MethodSpec("fedapp.protocols.classify", "strategies.fedavg:FedAvgStrategy", "clients.classify",
                         paper="McMahan et al., AISTATS 2017", **_ROUNDS),
    "fedprox": MethodSpec("fedapp.protocols.fedprox", "strategies.fedprox:FedProxStrategy", "clients.classify",
                          paper="Li et al., MLSys 2020", namespace="fedprox",
                          options="fedapp.protocols.fedprox:FedProxOptions", **_ROUNDS),
    "moon": MethodSpec("fedapp.protocols.moon", "strategies.moon:MoonStrategy", "clients.moon",
                       paper="Li, He & Song, CVPR 2021", namespace="moon", options="fedapp.protocols.moon:MoonOptions",
                       samples_clients=True, resumable=False),  # node state (z_prev) is not checkpointed
    "feddifrc": MethodSpec("fedapp.protocols.feddifrc", "strategies.feddifrc:FedDifRCStrategy", "clients.feddifrc",
                           paper="Wang et al., ICCV 2025", namespace="feddifrc",
                           options="fedapp.protocols.feddifrc:FedDifRCOptions", uses_prior=True,
                           preflight="fedapp.protocols.feddifrc:preflight", **_ROUNDS),
    # one-shot (OneShotStrategy): no rounds, so no checkpoint to resume from and no sampling
    "centralized": MethodSpec("fedapp.protocols.classify", "strategies.centralized:CentralizedStrategy",
                              "clients.classify", paper="oracle ceiling: classifier on the union of client data"),
    "espresso": MethodSpec("fedapp.protocols.espresso", "strategies.espresso:EspressoStrategy", "clients.espresso",
                           paper="Espresso, CVPR 2026", **_ESPRESSO),
    "prompts": MethodSpec("fedapp.protocols.espresso", "strategies.espresso:PromptsStrategy", "clients.espresso",
                          paper="class prompt only (Espresso's baseline)", **_ESPRESSO),
    "class-embed": MethodSpec("fedapp.protocols.espresso", "strategies.espresso:ClassEmbedStrategy",
                              "clients.espresso",
                              paper="one learned condition per class (FedDEO-like, Espresso's baseline)", **_ESPRESSO),
    "pfdm": MethodSpec("fedapp.protocols.pfdm", "strategies.pfdm:PFDMStrategy", "clients.pfdm",
                       paper="PFDM, CVPR 2026", **_PFDM),
    "local-only": MethodSpec("fedapp.protocols.pfdm", "strategies.ddpm_baselines:LocalOnlyStrategy",
                             "clients.ddpm_baselines", paper="non-collaborative DDPM per client (PFDM's baseline)",
                             **_PFDM),
    "fedavg-ddpm": MethodSpec("fedapp.protocols.pfdm", "strategies.ddpm_baselines:FedAvgDDPMStrategy",
                              "clients.ddpm_baselines",
                              paper="FedAvg over a DDPM, not private (FedDM-like, PFDM's baseline)", **_PFDM),
    "dpdm": MethodSpec("fedapp.protocols.pfdm", "strategies.ddpm_baselines:DPDMStrategy", "clients.dpdm",
                       paper="FedAvg over a DDPM trained with DP-SGD (DPDM-style, Opacus; PFDM's baseline)", **_PFDM),
    "centralized-ddpm": MethodSpec("fedapp.protocols.pfdm", "strategies.ddpm_baselines:CentralizedDDPMStrategy",
                                   "clients.ddpm_baselines",
                                   paper="oracle: one DDPM on the union of client data (PFDM's baseline)", **_PFDM),
    "dcfm": MethodSpec("fedapp.protocols.dcfm", "strategies.dcfm:DcfmStrategy", "clients.dcfm",
                       paper="Compositional Generative Modeling from Decentralized Data, ICML 2026", **_DCFM),
    "fedflow": MethodSpec("fedapp.protocols.dcfm", "strategies.fedflow:FedFlowStrategy", "clients.dcfm",
                          paper="FedAvg over one flow-matching model (DCFM's baseline)", **_DCFM),
    "ddm": MethodSpec("fedapp.protocols.dcfm", "strategies.fedflow:DdmStrategy", "clients.dcfm",
                      paper="local experts + a router (x_t, t) -> expert (DCFM's DDM baseline)", **_DCFM),
    "local-only-flow": MethodSpec("fedapp.protocols.dcfm", "strategies.fedflow:LocalOnlyFlowStrategy",
                                  "clients.dcfm", paper="each client's flow expert alone (DCFM's local-only baseline)",
                                  **_DCFM),
}


def register(name: str, spec: MethodSpec) -> None:
    """Add a method (e.g. from a test or a notebook); the ClientApp made after it carries it to Ray's actors
    (fedapp.client_app.Dispatcher)."""
    METHODS[name] = spec


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, name) if name else mod


def protocol(method: str) -> Any:
    return _load(METHODS[method].protocol)


def names(trait: Callable[[MethodSpec], Any]) -> list[str]:
    """The methods whose spec has `trait` (for error texts: `names(lambda s: s.resumable)`)."""
    return [m for m, s in METHODS.items() if trait(s)]


def namespaces() -> list[str]:
    return sorted({s.namespace for s in METHODS.values() if s.namespace})


def options_class(namespace: str) -> type:
    return _load(next(s.options for s in METHODS.values() if s.namespace == namespace and s.options))


def preflight_check(method: str) -> Callable[[Any], str | None] | None:
    """The method's own pre-run check (MethodSpec.preflight), or None."""
    path = METHODS[method].preflight
    return _load(path) if path else None


def strategy_class(method: str) -> type:
    return _load(METHODS[method].strategy)


def client_handlers(method: str) -> dict:
    return _load(METHODS[method].client).HANDLERS


def message_types() -> list[str]:
    """Every message type some registered protocol uses (the ClientApp registers each)."""
    return sorted({p.message_type for m in METHODS for p in protocol(m).PHASES})
