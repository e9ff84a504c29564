"""Reconstruction: how close generated or inverted images come to a client's members, against its non-members.

For every generated image g: d_member(g), the distance to its nearest member, and d_nonmember(g), to its
nearest non-member, in the same feature space, over equally many members and non-members (a nearest
neighbour among more images is nearer). Without a leak both are draws of one distribution. A near-copy is a g
with d_member(g) below the threshold tau set on the non-members: the `quantile` (1 %) of d_nonmember. Without a
leak the share of near-copies is about `quantile`; a planted copy of a member is one at distance 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedapp.audit.scores import nearest_distances

NEAR_COPY_QUANTILE = 0.01


def near_copy_figures(generated: torch.Tensor, members: torch.Tensor, nonmembers: torch.Tensor,
                      quantile: float = NEAR_COPY_QUANTILE) -> dict[str, Any]:
    """d_member and d_nonmember of every generated image (features (N, d)), their medians, the threshold
    tau = `quantile` of d_nonmember, and the shares of generated images under tau: near-copies of members
    (`near_copy_share`) and, for reference, of non-members (about `quantile` by construction)."""
    if len(members) != len(nonmembers):
        raise ValueError(f"members: {len(members)} and non-members: {len(nonmembers)}; must be equally many "
                         "(a nearest neighbour among more images is nearer)")
    if not 0 < quantile < 1:
        raise ValueError(f"quantile={quantile!r}: must be in (0, 1)")
    d_mem, d_non = nearest_distances(generated, members), nearest_distances(generated, nonmembers)
    tau = float(np.quantile(d_non, quantile))
    return {"near_copy_share": float((d_mem < tau).mean()), "nonmember_share": float((d_non < tau).mean()),
            "threshold": tau, "quantile": quantile, "generated": len(generated),
            "median_member_distance": float(np.median(d_mem)), "median_nonmember_distance": float(np.median(d_non)),
            "member_closer_share": float((d_mem < d_non).mean()),
            "member_distances": d_mem.tolist(), "nonmember_distances": d_non.tolist()}
