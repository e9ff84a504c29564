"""FedDifRC's diffusion representations: what each client's embedding is pulled toward.

For an image x_i, the frozen prior's decoder maps (fedapp.models.features.UNetFeatureExtractor.maps:
x_i noised to timestep t with a seeded eps, one UNet pass under a prompt, up-block outputs) become a
vector as the official code builds it (model/diffu_feature.py, main_FedDifRC.py's get_noise_fea):

  1. per up-block, a PCA over *pixels* (each position's C-channel vector is one row), fitted once;
  2. each position projected onto the block's components, then pooled over positions per component:
     the L2 norm (official; non-negative) or the mean (`feddifrc.pool`);
  3. each block divided by its RMS norm over the fitting rows (this code's choice: blocks weigh alike
     whatever the prior's channel scales), zero-padded to its dims, the blocks concatenated.

The basis (step 1 and the scales of step 3) is a `TargetBasis`, fitted on the dataset's public split
(`feddifrc.pca-fit = public`: one basis for the federation, from images no client owns) or on the
client's own images (`client`). Targets per client: F~ (N, P, D) under the P TDCL prompts, H~ (N, D)
under NDCR's prompt. With `feddifrc.dynamic-condition` > 0 the TDCL prompts carry c_i = h_k(x_i)
(the paper's dynamic condition): F~ is recomputed every round from the model the client received.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from fedapp.models.text import class_prompts

SIMILAR_PROMPT = "a photo of a similar object"  # self-supervised TDCL positive
VISUAL_PROMPT = "a photo of a visual object"  # self-supervised NDCR prompt
GENERIC_PROMPT = ""  # NDCR prompt with labels: the unconditional branch
FIT_IMAGES = 128  # images the basis is fitted on (all prompts each)
FIT_ROWS = 20_000  # pixel rows per block the PCA sees (sampled evenly from every fitting map)


def prompts_for(dataset: str, class_names: list[str], labels: bool) -> tuple[list[str], str]:
    """(the TDCL prompts P_0..P_{P-1}, the NDCR prompt). With labels: one per class (pos = y);
    without: the "similar object" prompt first (pos = 0), then every class prompt as a negative."""
    cls = class_prompts(dataset, class_names)
    return (cls, GENERIC_PROMPT) if labels else ([SIMILAR_PROMPT] + cls, VISUAL_PROMPT)


def _pixels(m: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h*w, C): one row per position."""
    return m.flatten(2).transpose(1, 2)


@dataclass
class TargetBasis:
    """Per used up-block: PCA mean (C,), components (k, C), RMS scale; plus dims (padding) and pooling."""

    means: list[torch.Tensor]
    components: list[torch.Tensor]
    scales: torch.Tensor  # (blocks,)
    dims: tuple[int, ...]
    pool: str

    def pooled(self, maps: list[torch.Tensor]) -> list[torch.Tensor]:
        """Maps [(B, C, h, w)] -> per block (B, k): per-pixel projection, pooled over positions."""
        out = []
        for mean, comp, m in zip(self.means, self.components, maps):
            r = (_pixels(m) - mean.to(m.device)) @ comp.to(m.device).T  # (B, h*w, k)
            out.append(r.norm(dim=1) if self.pool == "l2norm" else r.mean(dim=1))
        return out

    def reduce(self, maps: list[torch.Tensor]) -> torch.Tensor:
        """Maps [(B, C, h, w)] -> (B, sum dims): pooled, divided by each block's scale, zero-padded."""
        blocks = [p / s for p, s in zip(self.pooled(maps), self.scales.tolist())]
        return torch.cat([F.pad(b, (0, d - b.shape[1])) for b, d in zip(blocks, self.dims)], dim=1).cpu()

    def to_arrays(self) -> dict[str, torch.Tensor]:
        out = {"scales": self.scales, "dims": torch.tensor(self.dims)}
        for k, (m, c) in enumerate(zip(self.means, self.components)):
            out[f"mean{k}"], out[f"comp{k}"] = m, c
        return out

    @classmethod
    def from_arrays(cls, a: dict[str, torch.Tensor], pool: str) -> "TargetBasis":
        n = len(a["scales"])
        return cls([a[f"mean{k}"] for k in range(n)], [a[f"comp{k}"] for k in range(n)], a["scales"],
                   tuple(int(d) for d in a["dims"]), pool)


def fit_basis(extractor, x: torch.Tensor, prompts: list[str], dims: tuple[int, ...], pool: str,
              seed: int) -> TargetBasis:
    """Fit each block's per-pixel PCA (scikit-learn, min(dims, channels) components) on the maps of the
    first FIT_IMAGES of `x` under every prompt, then the blocks' RMS scales on the same maps."""
    from sklearn.decomposition import PCA

    x = x[:FIT_IMAGES]
    g = torch.Generator().manual_seed(seed)
    per_map = max(1, -(-FIT_ROWS // (len(x) * len(prompts))))  # positions sampled from each image's map
    rows: list[list[torch.Tensor]] = [[] for _ in dims]
    for p in prompts:
        for maps in extractor.maps(x, prompts=p):
            for k, m in enumerate(maps):
                pix = _pixels(m)
                pick = torch.randint(pix.shape[1], (pix.shape[0], min(per_map, pix.shape[1])), generator=g)
                pick = pick.to(pix.device).unsqueeze(-1).expand(-1, -1, pix.shape[2])
                rows[k].append(torch.gather(pix, 1, pick).flatten(0, 1).cpu())
    means, comps = [], []
    for r, d in zip(rows, dims):
        r = torch.cat(r).double().numpy()
        pca = PCA(n_components=min(d, r.shape[1], r.shape[0]), random_state=seed).fit(r)
        means.append(torch.from_numpy(pca.mean_).float())
        comps.append(torch.from_numpy(pca.components_).float())
    basis = TargetBasis(means, comps, torch.ones(len(dims)), tuple(dims), pool)
    sq = torch.zeros(len(dims))
    n = 0
    for p in prompts:  # second pass: the scales, without keeping every map in memory
        for maps in extractor.maps(x, prompts=p):
            sq += torch.stack([(b ** 2).sum(1).sum().cpu() for b in basis.pooled(maps)])
            n += len(maps[0])
    basis.scales = (sq / max(n, 1)).sqrt().clamp_min(1e-12)
    return basis


def reduced(extractor, basis: TargetBasis, x: torch.Tensor, prompt: str | None = None,
            cond: torch.Tensor | None = None) -> torch.Tensor:
    """(N, D) targets of images x under one prompt (or raw per-image conditions)."""
    return torch.cat([basis.reduce(maps) for maps in extractor.maps(x, prompts=prompt, cond=cond)])


def memo_reduced(extractor, basis: TargetBasis, x: torch.Tensor, prompt: str, rows: torch.Tensor,
                 memo: dict) -> torch.Tensor:
    """`reduced`, reusing rows already computed with the same extractor and basis (memo: {(prompt, row): (D,)});
    a sample's target depends only on (image, prompt, t, eps, basis), so a shared basis makes it reusable."""
    todo = [i for i, r in enumerate(rows.tolist()) if (prompt, r) not in memo]
    if todo:
        for i, v in zip(todo, reduced(extractor, basis, x[todo], prompt)):
            memo[(prompt, int(rows[i]))] = v
    return torch.stack([memo[(prompt, int(r))] for r in rows.tolist()])


@torch.no_grad()
def condition_offsets(model: torch.nn.Module, x: torch.Tensor, text_width: int, token_norm: float,
                      relative: float, seed: int, batch: int = 256) -> torch.Tensor:
    """c_i = h_k(x_i) in the prompt embedding's space, (N, text_width): the model's embedding through a
    fixed seeded Gaussian map (the paper does not say how h_k's output meets the text width), scaled to
    `relative` x a prompt token's mean norm so the prompt keeps its meaning."""
    model.eval()
    device = next(model.parameters()).device
    h = torch.cat([model.embed(x[i:i + batch].to(device)).float().cpu() for i in range(0, len(x), batch)])
    g = torch.Generator().manual_seed(seed)
    u = h @ torch.randn(h.shape[1], text_width, generator=g)
    return relative * token_norm * F.normalize(u, dim=1)


def conditioned_targets(extractor, basis: TargetBasis, x: torch.Tensor, prompts: list[str],
                        offsets: torch.Tensor) -> torch.Tensor:
    """F~ (N, P, D) with every prompt's tokens shifted by each image's c_i (the dynamic condition)."""
    out = []
    for p in prompts:
        cond = extractor.prior.encode_prompts([p]).cpu() + offsets.unsqueeze(1)  # (N, L, D_text)
        out.append(reduced(extractor, basis, x, cond=cond))
    return torch.stack(out, dim=1)


def token_norm(prior, prompts: list[str]) -> float:
    """Mean norm of the prompts' token embeddings: the scale c_i is measured against."""
    return float(prior.encode_prompts(prompts).float().norm(dim=-1).mean())
