"""The real modules a plan counts calls of, built from a module spec (ledger.modules) with random weights,
and one call of each in each mode at a number of rows: what the benchmark times (bench.py) and what the
byte counts serialise (comm.py: a model's ArrayRecord as the grid meters it).

A spec is a dict with "kind": classifier | prior.unet | prior.vae.encode | prior.vae.decode | ddpm |
velocity | gmm, and the sizes its builder takes.
"""

from __future__ import annotations

from typing import Any, Callable


def build(spec: dict[str, Any], device: str):
    """The module of `spec`, random weights, on `device` (meta: shapes only)."""
    kind = spec["kind"]
    if kind == "classifier":
        from fedapp.models.classifier import build_classifier

        net = build_classifier(spec["model"], spec["num_classes"], proj_dim=spec.get("proj_dim", 0),
                               keep_embedding=spec.get("keep_embedding", False))
    elif kind == "ddpm":
        from fedapp.models.ddpm import build_ddpm

        net = build_ddpm(spec["image_size"], spec["num_classes"], flag=spec["flag"], channels=spec["widths"])
    elif kind == "velocity":
        from fedapp.models.compose import build_velocity

        net = build_velocity(spec["image_size"], spec["sizes"], spec["width"], spec["channels"],
                             spec["label_embedding"])
    elif kind.startswith("prior."):
        from fedapp.plan.arch import meta_module

        part = kind.split(".")[1]
        return meta_module(part, getattr(spec["arch"], part), device)
    else:
        raise ValueError(f"module kind {kind!r} has no network")
    return net.to(device)


def inputs(spec: dict[str, Any], rows: int, device: str) -> dict[str, Any]:
    import torch

    kind = spec["kind"]
    if kind.startswith("prior."):
        arch = spec["arch"]
        z = torch.randn(rows, *arch.latent_shape, device=device)
        if kind == "prior.vae.encode":
            return {"x": torch.randn(rows, 3, arch.image_size, arch.image_size, device=device)}
        return {"z": z, "t": torch.full((rows,), 500, device=device),
                "cond": torch.randn(rows, *arch.cond_shape, device=device)}
    size, ch = spec["image_size"], spec["channels"]
    x = torch.randn(rows, ch, size, size, device=device)
    if kind == "classifier":
        return {"x": x, "y": torch.randint(spec["num_classes"], (rows,), device=device)}
    if kind == "ddpm":
        y = torch.randint(spec["num_classes"], (rows,), device=device)
        return {"x": x, "y": y, "flag": torch.zeros(rows, dtype=torch.long, device=device) if spec["flag"] else None}
    return {"x": x, "t": torch.rand(rows, device=device),
            "y": torch.stack([torch.randint(s, (rows,), device=device) for s in spec["sizes"]], 1)}


def forward(spec: dict[str, Any], net, a: dict[str, Any]):
    """One forward of `net` on inputs `a`; returns a tensor to reduce to a loss."""
    import torch

    kind = spec["kind"]
    if kind == "prior.unet":
        return net(a["z"], a["t"], encoder_hidden_states=a["cond"]).sample
    if kind == "prior.vae.encode":
        return net.encode(a["x"]).latent_dist.mean
    if kind == "prior.vae.decode":
        return net.decode(a["z"]).sample
    if kind == "classifier":
        return torch.nn.functional.cross_entropy(net(a["x"]), a["y"])
    if kind == "ddpm":
        return net.loss(a["x"], a["y"], a["flag"])
    return net(a["x"], a["t"], a["y"])


def step(spec: dict[str, Any], net, mode: str, rows: int, device: str) -> Callable[[], None]:
    """A callable making one call of `net` in `mode` (infer | train | grad-input) at `rows` rows."""
    import torch

    a = inputs(spec, rows, device)
    if mode == "infer":
        def infer() -> None:
            with torch.no_grad():
                forward(spec, net, a)
        return infer
    if mode == "grad-input":  # a frozen network, gradients to its condition input (condition learning)
        net.requires_grad_(False)
        a["cond"].requires_grad_(True)

        def grad_input() -> None:
            scalar(forward(spec, net, a)).backward()
        return grad_input
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9) if spec["kind"] == "classifier" \
        else torch.optim.Adam(net.parameters(), lr=1e-4)

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        scalar(forward(spec, net, a)).backward()
        opt.step()
    return run


def scalar(out):
    """A loss to back-propagate: the forward's own loss, or the mean square of its output."""
    return out if out.ndim == 0 else out.float().pow(2).mean()


def gmm_fit(spec: dict[str, Any], rows: int) -> Callable[[], None]:
    """One fit of Espresso's noise GMM (clients.espresso.fit_noise_gmm's settings) on `rows` samples."""
    import numpy as np
    from sklearn.mixture import GaussianMixture

    x = np.random.default_rng(0).standard_normal((rows, spec["dim"]))
    return lambda: GaussianMixture(n_components=spec["components"], covariance_type="diag", random_state=0,
                                   reg_covar=1e-6).fit(x)


def state_bytes(spec: dict[str, Any]) -> int:
    """Bytes of the module's weights as an ArrayRecord (what a model transfer meters)."""
    from flwr.app import ArrayRecord

    return ArrayRecord(build(spec, "cpu").state_dict()).count_bytes()


def packed_bytes(spec: dict[str, Any]) -> int:
    """Bytes of the module's weights packed as the FedAvg family sends them (fedapp.protocols.weights)."""
    from fedapp.protocols.weights import weights_record

    return weights_record(build(spec, "cpu").state_dict()).count_bytes()
