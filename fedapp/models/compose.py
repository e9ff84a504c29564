"""DCFM's equations as tensor functions, shared by the clients (clients/dcfm.py), the server
(strategies/flow.py, strategies/dcfm.py, strategies/fedflow.py) and the 2-D toy. Paper symbols (grep them):

- y = (y_1..y_k) attributes (here digit, colour), -1 = masked / null.
- Masks (eq. 8): y_m = y ⊙ m, m drawn as full labels (pi_full), one attribute (pi_marg), none (pi_uncond).
- Composite velocity (eq. 5): v^(x_t, y) = v(x_t) + sum_i w_i (v(x_t, y_i) - v(x_t)).
- L_CI (eq. 7, w_i = 1): E || v(x_t, y) - v^(x_t, y) ||^2 on one model (Stage I eq. 11; student eq. 16).
- L_peerCI (eqs. 12-13, variant A): routing vector r = (r_0..r_k) assigns an expert to the unconditional
  term (r_0) and to each attribute term (r_i); at least one r_i is the local expert a; peers are frozen:
  v-bar^r = delta_{r,a} v^(a) + (1 - delta_{r,a}) StopGrad(v^(r)).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .flow import ImageVelocityNet, euler

NULL = -1


# ---- the network and labels ---------------------------------------------------------------------------
def build_velocity(image_size: int, attribute_sizes: Sequence[int], width: int,
                   channels: int = 3, label_embedding: str = "sum") -> ImageVelocityNet:
    """The image velocity net every method shares (so experts, students and FedFlow models have one shape)."""
    return ImageVelocityNet(image_size, list(attribute_sizes), channels=channels,
                            block_out_channels=(width, 2 * width), attention=False, label_embedding=label_embedding)


def attribute_labels(split, names: Sequence[str]) -> torch.Tensor:
    """y (N, k) int64 from a feddata Split's attributes."""
    return torch.stack([torch.as_tensor(split.attrs[n]).long() for n in names], dim=1)


def of_pairs(y: torch.Tensor, pairs) -> torch.Tensor:
    """Bool mask of the rows of y (N, 2) whose (y_1, y_2) is one of `pairs`."""
    wanted = {tuple(p) for p in pairs}
    return torch.tensor([tuple(r) in wanted for r in y.tolist()], dtype=torch.bool)


def pair_counts(y: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """n_a(y_1, y_2): how many local samples carry each attribute pair (the server's mixture weights)."""
    counts = torch.zeros(*sizes, dtype=torch.long)
    counts.index_put_(tuple(y.T), torch.ones(len(y), dtype=torch.long), accumulate=True)
    return counts


def marginal_labels(y: torch.Tensor, i: int) -> torch.Tensor:
    """(∅, .., y_i, .., ∅): only attribute i kept."""
    out = torch.full_like(y, NULL)
    out[:, i] = y[:, i]
    return out


def mask_labels(y: torch.Tensor, pi_full: float, pi_marg: float, pi_uncond: float,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """y_m = y ⊙ m, m ~ p(m) (eq. 8): full with pi_full, one uniformly chosen attribute with pi_marg, none
    with pi_uncond (the three are normalised to sum to 1)."""
    b, k = y.shape
    p = torch.tensor([pi_full, pi_marg, pi_uncond], dtype=torch.float64)
    kind = torch.multinomial(p / p.sum(), b, replacement=True, generator=generator)
    which = torch.randint(k, (b,), generator=generator)
    keep = torch.zeros(b, k, dtype=torch.bool)
    keep[kind == 0] = True
    keep[torch.arange(b), which] |= kind == 1
    return torch.where(keep, y, torch.full_like(y, NULL))


def label_sets(y: torch.Tensor) -> list[torch.Tensor]:
    """[y, ∅, (y_1, ∅..), .., (∅.., y_k)]: the k + 2 queries of one composite-velocity evaluation."""
    return [y, torch.full_like(y, NULL)] + [marginal_labels(y, i) for i in range(y.shape[1])]


def query(v: Callable, x: torch.Tensor, t: torch.Tensor, labels: list[torch.Tensor]) -> list[torch.Tensor]:
    """v at the same (x_t, t) under several label sets, as one batched forward."""
    n = len(labels)
    out = v(x.repeat(n, *[1] * (x.ndim - 1)), t.repeat(n), torch.cat(labels))
    return list(out.chunk(n))


# ---- eq. 5: the composite velocity --------------------------------------------------------------------
def composite(v_uncond: torch.Tensor, v_margs: Sequence[torch.Tensor],
              weights: Sequence[float] | None = None) -> torch.Tensor:
    """v^ = v(x_t) + sum_i w_i (v(x_t, y_i) - v(x_t))."""
    weights = weights if weights is not None else [1.0] * len(v_margs)
    return v_uncond + sum(w * (vi - v_uncond) for w, vi in zip(weights, v_margs))


# ---- eq. 7: L_CI on one expert ------------------------------------------------------------------------
def ci_penalty(model: Callable, x_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """L_CI = E || v(x_t, y) - v^(x_t, y) ||^2 with w_i = 1 (gradients flow through both sides)."""
    v_joint, v_uncond, *v_margs = query(model, x_t, t, label_sets(y))
    return (v_joint - composite(v_uncond, v_margs)).pow(2).flatten(1).mean(1).mean()


def ci_sample(k: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The first k rows of each tensor (all of them when k <= 0): the samples a CI term (L_CI, L_peerCI,
    L_studentCI) is estimated on (dcfm.ci-batch). A minibatch is drawn at random, so its first k rows are a
    random subset and the estimate of the expectation stays unbiased; each CI term queries the net three or
    four times per sample (joint, unconditional, one per attribute) where L_FM queries it once."""
    return tensors if k <= 0 else tuple(x[:k] for x in tensors)


# ---- eqs. 12-13: L_peerCI over routing vectors --------------------------------------------------------
def sample_route(num_experts: int, k: int, self_index: int, generator: torch.Generator | None = None) -> list[int]:
    """r = (r_0..r_k) uniformly over the experts, with at least one entry equal to the local expert a."""
    r = torch.randint(num_experts, (k + 1,), generator=generator).tolist()
    if self_index not in r:
        r[int(torch.randint(k + 1, (1,), generator=generator))] = self_index
    return r


def peer_ci_errors(model: Callable, peers: dict[int, Callable], self_index: int, x_t: torch.Tensor,
                   t: torch.Tensor, y: torch.Tensor, route: Sequence[int]) -> torch.Tensor:
    """Per-sample || v^(a)(x_t, y) - z^(r)(x_t, y) ||^2 (eq. 12) with
    z^(r) = v-bar^{r_0}(x_t) + sum_i (v-bar^{r_i}(x_t, y_i) - v-bar^{r_0}(x_t)) and
    v-bar^r = v^(a) if r = a else StopGrad(v^(r)) (eq. 13: peers are frozen, no gradient reaches them)."""
    def v_bar(r: int, labels: torch.Tensor) -> torch.Tensor:
        if r == self_index:
            return model(x_t, t, labels)
        with torch.no_grad():
            return peers[r](x_t, t, labels).detach()

    null = torch.full_like(y, NULL)
    z = composite(v_bar(route[0], null), [v_bar(r, marginal_labels(y, i)) for i, r in enumerate(route[1:])])
    return (model(x_t, t, y) - z).pow(2).flatten(1).mean(1)


def peer_ci_penalty(model: Callable, peers: dict[int, Callable], self_index: int, x_t: torch.Tensor,
                    t: torch.Tensor, y: torch.Tensor, routes: Sequence[Sequence[int]],
                    counts: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """L_peerCI over several routing vectors per minibatch: the batch is split into len(routes) chunks,
    chunk j scored under routes[j] (same forward cost as one route, lower-variance gradient).
    `counts` given (dcfm.route-mask): a sample whose routed expert never saw the requested value y_i is
    left out (the paper is silent on this; our switch)."""
    errs, keep = [], []
    for idx, route in zip(torch.arange(len(y)).chunk(len(routes)), routes):
        errs.append(peer_ci_errors(model, peers, self_index, x_t[idx], t[idx], y[idx], route))
        ok = route_valid(route, y[idx].cpu(), counts) if counts is not None else torch.ones(len(idx))
        keep.append(ok.to(x_t.device))
    err, valid = torch.cat(errs), torch.cat(keep)
    return (err * valid).sum() / valid.sum().clamp(min=1)


def route_valid(route: Sequence[int], y: torch.Tensor, counts: dict[int, torch.Tensor]) -> torch.Tensor:
    """1 where every routed expert r_i (i >= 1) has seen the value y_i (from its pair counts), else 0."""
    ok = torch.ones(len(y), dtype=torch.bool)
    for i, r in enumerate(route[1:]):
        if r in counts:
            seen_value = counts[r].sum(dim=1 - i) > 0  # marginal counts of attribute i
            ok &= seen_value[y[:, i]]
    return ok.float()


# ---- the composite sampler --------------------------------------------------------------------------
def composite_field(v: Callable, y: torch.Tensor, weights: Sequence[float] | None = None) -> Callable:
    """(x, t) -> v^(x, y) of one model (eq. 5), for the ODE samplers."""
    def field(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        _, v_uncond, *v_margs = query(v, x, t, label_sets(y.to(x.device)))
        return composite(v_uncond, v_margs, weights)
    return field


def mixture_composite(experts: Sequence[Callable], counts: Sequence[torch.Tensor], y: torch.Tensor,
                      route_mask: bool = True, routes: torch.Generator | None = None) -> Callable:
    """The composite velocity over several experts (DCFM-A's sampler, DCFM-B's composite teacher): eq. 12's
    z^(r),
    v^(x, y) = v_0(x) + sum_i (v_i(x, y_i) - v_0(x)),  v_0 = sum_a pi_a v^(a)(x),
    v_i(x, y_i) = sum_a pi_{a,i}(y_i) v^(a)(x, y_i).
    route_mask (dcfm.route-mask): pi_a ∝ n_a and pi_{a,i}(y_i) ∝ n_a(y_i), so an expert answers only values it
    has seen; off: uniform routes, pi_a = pi_{a,i} = 1 / A (the paper's routes are uniform; it is silent on
    masking). routes None: the routing vector r in expectation (the weights above); a generator: one r per
    sample, drawn from those weights once and kept along its whole trajectory (dcfm.a-sampler = routed: the
    composite z^(r) that L_peerCI trains, eq. 12). Returns (x, t) -> (v^, v_0, [v_1, .., v_k]) when called
    with parts=True."""
    k, b = y.shape[1], len(y)
    if route_mask:
        n = torch.stack([c.sum() for c in counts]).float()
        margs = [torch.stack([c.sum(dim=tuple(d for d in range(k) if d != i)) for c in counts]).float()
                 for i in range(k)]  # (A, |Y_i|)
    else:
        n = torch.ones(len(counts))
        margs = [torch.ones(len(counts), counts[0].shape[i]) for i in range(k)]
    yc = y.cpu()
    weights = [(n / n.sum())[:, None].expand(-1, b)]  # (A, B) per term: v_0, then v_1 .. v_k
    for i in range(k):
        w = margs[i][:, yc[:, i]]
        weights.append(w / w.sum(0, keepdim=True).clamp(min=1e-9))
    if routes is not None:  # one expert per term and sample, drawn from the same weights (uniform where none)
        weights = [torch.where(w.sum(0, keepdim=True) > 0, w, 1.0) for w in weights]
        weights = [torch.nn.functional.one_hot(torch.multinomial(w.T, 1, generator=routes)[:, 0],
                                               len(experts)).T.float() for w in weights]

    def field(x: torch.Tensor, t: torch.Tensor, parts: bool = False):
        yy = y.to(x.device)
        outs = [query(e, x, t, label_sets(yy)[1:]) for e in experts]  # per expert [v(x), v(x, y_1), ..]
        terms = []
        for j, w in enumerate(weights):
            w = w.to(x.device)
            terms.append(sum(w[a].view(-1, *[1] * (x.ndim - 1)) * outs[a][j] for a in range(len(experts))))
        v0, vi = terms[0], terms[1:]
        v = composite(v0, vi)
        return (v, v0, vi) if parts else v
    return field


@torch.no_grad()
def ci_residuals(experts: Sequence[Callable], counts: Sequence[torch.Tensor], x1: torch.Tensor, y: torch.Tensor,
                 seed: int, route_mask: bool = True) -> dict[str, float]:
    """How far the composites sit from the joint fields they stand in for, on real images x1 of seen pairs
    noised to x_t = t x1 + (1 - t) x0 (t ~ U(0, 1)). For each expert a and the samples of pairs it holds,
    relative to its conditional signal E||v_a(x_t, y) - v_a(x_t)||^2:
    self: E||v_a(x_t, y) - v^_a(x_t, y)||^2, its own composite (eq. 5; L_CI's residual);
    mixture: E||v_a(x_t, y) - v^(x_t, y)||^2, the composite over all experts (mixture_composite, routes in
    expectation: DCFM-A's sampler). 0: the composite is the joint field; 1: as far from it as the
    unconditional field is. Forward passes only: a cause of a poor composite sampler without sampling."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(x1.shape, generator=g).to(x1.device)
    t = torch.rand(len(x1), generator=g).to(x1.device)
    x_t = t.view(-1, *[1] * (x1.ndim - 1)) * x1 + (1 - t.view(-1, *[1] * (x1.ndim - 1))) * x0
    sq = lambda d: d.pow(2).flatten(1).sum(1)  # noqa: E731
    mix = mixture_composite(experts, counts, y, route_mask)(x_t, t)  # one field for every expert's comparison
    num_self = num_mix = den = 0.0
    for e, c in zip(experts, counts):
        mine = (c[y[:, 0].cpu(), y[:, 1].cpu()] > 0).to(x1.device)
        if not mine.any():
            continue
        joint, uncond, *margs = query(e, x_t[mine], t[mine], label_sets(y[mine]))
        num_self += float(sq(joint - composite(uncond, margs)).sum())
        num_mix += float(sq(joint - mix[mine]).sum())
        den += float(sq(joint - uncond).sum())
    den = max(den, 1e-12)
    return {"ci_residual_self": num_self / den, "ci_residual_mixture": num_mix / den}


def joint_field(v: Callable, y: torch.Tensor) -> Callable:
    """(x, t) -> v(x, y): plain conditional sampling (the baselines)."""
    return lambda x, t: v(x, t, y.to(x.device))


@torch.no_grad()
def generate(field: Callable, shape: tuple[int, ...], steps: int, seed: int, device: str = "cpu",
             clip: float | None = 1.0) -> torch.Tensor:
    """Euler ODE from x0 ~ N(0, I) at t = 0 to t = 1; clipped to [-clip, clip] (images: [-1, 1])."""
    x0 = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)
    x = euler(field, x0, steps=steps)
    return x.clamp(-clip, clip) if clip is not None else x
