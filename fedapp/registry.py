"""Method name -> (protocol, strategy, client): the one place a method is added.

Entries are import strings so that choosing `fedavg` never imports diffusers. A protocol module
(fedapp/protocols/<m>.py) exposes `PHASES` (its message exchanges) and, when the method has options,
`NAMESPACE` and `OPTIONS` (a dataclass of `opt(...)` fields); a client module exposes
`HANDLERS: {message_type: handler}`; the strategy is a class taking a `fedapp.server.ServerRun`.
Nothing else in fedapp imports strategies/ or clients/: only this module, by name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class MethodSpec:
    protocol: str  # module of the message protocol (options, phases, keys, validation)
    strategy: str  # "module:Class" of the server side
    client: str  # module with HANDLERS
    paper: str = ""


METHODS: dict[str, MethodSpec] = {
    "fedavg": MethodSpec("fedapp.protocols.classify", "strategies.fedavg:FedAvgStrategy", "clients.classify",
                         paper="McMahan et al., AISTATS 2017"),
    "fedprox": MethodSpec("fedapp.protocols.fedprox", "strategies.fedprox:FedProxStrategy", "clients.classify",
                          paper="Li et al., MLSys 2020"),
    "moon": MethodSpec("fedapp.protocols.moon", "strategies.moon:MoonStrategy", "clients.moon",
                       paper="Li, He & Song, CVPR 2021"),
    "feddifrc": MethodSpec("fedapp.protocols.feddifrc", "strategies.feddifrc:FedDifRCStrategy", "clients.feddifrc",
                           paper="Wang et al., ICCV 2025"),
    "centralized": MethodSpec("fedapp.protocols.classify", "strategies.centralized:CentralizedStrategy",
                              "clients.classify", paper="oracle ceiling: classifier on the union of client data"),
    "espresso": MethodSpec("fedapp.protocols.espresso", "strategies.espresso:EspressoStrategy", "clients.espresso",
                           paper="Espresso, CVPR 2026"),
    "prompts": MethodSpec("fedapp.protocols.espresso", "strategies.espresso:PromptsStrategy", "clients.espresso",
                          paper="class prompt only (Espresso's baseline)"),
    "class-embed": MethodSpec("fedapp.protocols.espresso", "strategies.espresso:ClassEmbedStrategy",
                              "clients.espresso",
                              paper="one learned condition per class (FedDEO-like, Espresso's baseline)"),
    "pfdm": MethodSpec("fedapp.protocols.pfdm", "strategies.pfdm:PFDMStrategy", "clients.pfdm",
                       paper="PFDM, CVPR 2026"),
    "local-only": MethodSpec("fedapp.protocols.pfdm", "strategies.ddpm_baselines:LocalOnlyStrategy",
                             "clients.ddpm_baselines", paper="non-collaborative DDPM per client (PFDM's baseline)"),
    "fedavg-ddpm": MethodSpec("fedapp.protocols.pfdm", "strategies.ddpm_baselines:FedAvgDDPMStrategy",
                              "clients.ddpm_baselines",
                              paper="FedAvg over a DDPM, not private (FedDM-like, PFDM's baseline)"),
    "dpdm": MethodSpec("fedapp.protocols.pfdm", "strategies.ddpm_baselines:DPDMStrategy", "clients.dpdm",
                       paper="FedAvg over a DDPM trained with DP-SGD (DPDM-style, Opacus; PFDM's baseline)"),
    "centralized-ddpm": MethodSpec("fedapp.protocols.pfdm", "strategies.ddpm_baselines:CentralizedDDPMStrategy",
                                   "clients.ddpm_baselines",
                                   paper="oracle: one DDPM on the union of client data (PFDM's baseline)"),
    "dcfm": MethodSpec("fedapp.protocols.dcfm", "strategies.dcfm:DcfmStrategy", "clients.dcfm",
                       paper="Compositional Generative Modeling from Decentralized Data, ICML 2026"),
    "fedflow": MethodSpec("fedapp.protocols.dcfm", "strategies.fedflow:FedFlowStrategy", "clients.dcfm",
                          paper="FedAvg over one flow-matching model (DCFM's baseline)"),
    "ddm": MethodSpec("fedapp.protocols.dcfm", "strategies.fedflow:DdmStrategy", "clients.dcfm",
                      paper="local experts + a router (x_t, t) -> expert (DCFM's DDM baseline)"),
    "local-only-flow": MethodSpec("fedapp.protocols.dcfm", "strategies.fedflow:LocalOnlyFlowStrategy",
                                  "clients.dcfm", paper="each client's flow expert alone (DCFM's local-only baseline)"),
}


def register(name: str, spec: MethodSpec) -> None:
    """Add a method (e.g. from a test or a notebook); `fedapp.simulate` carries it to the clients."""
    METHODS[name] = spec


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, name) if name else mod


def protocol(method: str, methods: Mapping[str, MethodSpec] | None = None) -> Any:
    return _load((methods or METHODS)[method].protocol)


def namespace_of(method: str, methods: Mapping[str, MethodSpec] | None = None) -> str | None:
    return getattr(protocol(method, methods), "NAMESPACE", None)


def namespaces(methods: Mapping[str, MethodSpec] | None = None) -> list[str]:
    return sorted({ns for m in (methods or METHODS) if (ns := namespace_of(m, methods))})


def options_class(namespace: str, methods: Mapping[str, MethodSpec] | None = None) -> type:
    methods = methods or METHODS
    return next(protocol(m, methods).OPTIONS for m in methods if namespace_of(m, methods) == namespace)


def strategy_class(method: str, methods: Mapping[str, MethodSpec] | None = None) -> type:
    return _load((methods or METHODS)[method].strategy)


def client_handlers(method: str, methods: Mapping[str, MethodSpec] | None = None) -> dict:
    return _load((methods or METHODS)[method].client).HANDLERS


def message_types(methods: Mapping[str, MethodSpec] | None = None) -> list[str]:
    """Every message type some registered protocol uses (the ClientApp registers each)."""
    methods = methods or METHODS
    return sorted({p.message_type for m in methods for p in protocol(m, methods).PHASES})
