"""Method name -> (strategy, client handlers, options): the one place a method is added.

Entries are import strings so that choosing `fedavg` never imports diffusers. A client
module exposes `HANDLERS: dict[message_type, handler]`; a strategy module exposes the
strategy class named here and, when the method has options, their dataclass.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MethodSpec:
    strategy: str            # "module:Class" of the server side
    client: str              # module with HANDLERS
    namespace: str | None    # config namespace of its options (`fedprox.mu`)
    options: str | None      # "module:Class" of the options dataclass
    actions: tuple[str, ...] = ("train", "evaluate")  # message types its clients handle
    paper: str = ""


METHODS: dict[str, MethodSpec] = {
    "fedavg": MethodSpec("strategies.fedavg:FedAvgStrategy", "clients.classify", None, None,
                         paper="McMahan et al., AISTATS 2017"),
    "fedprox": MethodSpec("strategies.fedprox:FedProxStrategy", "clients.classify", "fedprox",
                          "strategies.fedprox:FedProxOptions", paper="Li et al., MLSys 2020"),
    "feddifrc": MethodSpec("strategies.feddifrc:FedDifRCStrategy", "clients.feddifrc", "feddifrc",
                           "strategies.feddifrc:FedDifRCOptions", paper="Wang et al., ICCV 2025"),
    "moon": MethodSpec("strategies.moon:MoonStrategy", "clients.moon", "moon", "strategies.moon:MoonOptions",
                       paper="Li, He & Song, CVPR 2021"),
    "espresso": MethodSpec("strategies.espresso:EspressoStrategy", "clients.espresso", "espresso",
                           "strategies.espresso:EspressoOptions", paper="Espresso, CVPR 2026"),
    "prompts": MethodSpec("strategies.espresso:PromptsStrategy", "clients.espresso", "espresso",
                          "strategies.espresso:EspressoOptions", paper="class prompt only (Espresso's baseline)"),
    "class-embed": MethodSpec("strategies.espresso:ClassEmbedStrategy", "clients.espresso", "espresso",
                              "strategies.espresso:EspressoOptions",
                              paper="one learned condition per class (FedDEO-like, Espresso's baseline)"),
    "dcfm": MethodSpec("strategies.dcfm:DcfmStrategy", "clients.dcfm", "dcfm", "strategies.dcfm:DcfmOptions",
                       actions=("train", "query.peer", "query.receive"),
                       paper="Compositional Generative Modeling from Decentralized Data, ICML 2026"),
    "fedflow": MethodSpec("strategies.fedflow:FedFlowStrategy", "clients.dcfm", "dcfm", "strategies.dcfm:DcfmOptions",
                          actions=("train",), paper="FedAvg over one flow-matching model (DCFM's baseline)"),
    "ddm": MethodSpec("strategies.fedflow:DdmStrategy", "clients.dcfm", "dcfm", "strategies.dcfm:DcfmOptions",
                      actions=("train", "query.receive"),
                      paper="local experts + a router (x_t, t) -> expert (DCFM's DDM baseline)"),
    "local-only-flow": MethodSpec("strategies.fedflow:LocalOnlyFlowStrategy", "clients.dcfm", "dcfm",
                                  "strategies.dcfm:DcfmOptions", actions=("train",),
                                  paper="each client's flow expert alone (DCFM's local-only baseline)"),
    "centralized": MethodSpec("strategies.centralized:CentralizedStrategy", "clients.classify", None, None,
                              actions=("evaluate",), paper="oracle ceiling: classifier on the union of client data"),
    "pfdm": MethodSpec("strategies.pfdm:PFDMStrategy", "clients.pfdm", "pfdm", "strategies.pfdm:PFDMOptions",
                       actions=("train", "query.sample"), paper="PFDM, CVPR 2026"),
    "local-only": MethodSpec("strategies.ddpm_baselines:LocalOnlyStrategy", "clients.ddpm_baselines", "pfdm",
                             "strategies.pfdm:PFDMOptions", actions=("query.sample",),
                             paper="non-collaborative DDPM per client (PFDM's baseline)"),
    "fedavg-ddpm": MethodSpec("strategies.ddpm_baselines:FedAvgDDPMStrategy", "clients.ddpm_baselines", "pfdm",
                              "strategies.pfdm:PFDMOptions", actions=("train",),
                              paper="FedAvg over a DDPM, not private (FedDM-like, PFDM's baseline)"),
    "centralized-ddpm": MethodSpec("strategies.ddpm_baselines:CentralizedDDPMStrategy", "clients.ddpm_baselines",
                                   "pfdm", "strategies.pfdm:PFDMOptions", actions=(),
                                   paper="oracle: one DDPM on the union of client data (PFDM's baseline)"),
}


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, name) if name else mod


def namespaces() -> list[str]:
    return sorted({s.namespace for s in METHODS.values() if s.namespace})


def options_class(namespace: str) -> type:
    spec = next(s for s in METHODS.values() if s.namespace == namespace)
    return _load(spec.options)


def strategy_class(method: str) -> type:
    return _load(METHODS[method].strategy)


def client_handlers(method: str) -> dict:
    return _load(METHODS[method].client).HANDLERS


def message_types() -> list[str]:
    """Every message type some method uses (the ClientApp registers each)."""
    return sorted({t for spec in METHODS.values() for t in spec.actions})
