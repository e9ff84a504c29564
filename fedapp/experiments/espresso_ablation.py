"""Espresso's component ablation (paper Fig. 4) on digit-styles, domain partitioner:
Prompts-only, class-embed (FedDEO-like, extra row), C, C+G, C+Z, C+G+Z and the centralized ceiling,
over several seeds; prints the paper-style table (per-domain and average accuracy, mean ± std),
writes docs/espresso_ablation.json, docs/espresso_ablation.png and docs/espresso_synthetic_<domain>.png.

    python -m fedapp.experiments espresso-ablation [--seeds 0 1 2] [--set espresso.steps=10 ...]

How it runs: in one process, without Flower messaging, but through the functions the protocol
calls. Per seed, each client's upload is computed once per kind of client work with the function
the `train` handler calls (clients.espresso.espresso_upload, with the client's seed from
ClientContext.seed_for), round-tripped through an ArrayRecord and checked with the strategy's
validate_upload: one "prompts" pass (class counts only), one "class" pass (one learned condition
per class) and one "cluster" pass (J conditions per class + the GMM). The G and Z switches only
change the server side, so C, C+G, C+Z and C+G+Z share the cluster pass, and the server side is the
strategy's own synthesize_client -> train_global_classifier -> accuracy_by_group. The ceiling is
strategies.centralized (an oracle on the union of the clients' real shards), trained for
server-epochs x ratio epochs so that it sees as many minibatches as a synthetic row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedapp.results import atomic_write_json

ROWS = [  # name, client pass, server switches (conditions, init, sampler)
    ("Prompts-only", "prompts", ("prompts", "gaussian", "ddim")),
    ("class-embed", "class", ("class", "gaussian", "ddim")),
    ("C", "cluster", ("cluster", "gaussian", "ddim")),
    ("C+G", "cluster", ("cluster", "gmm", "ddim")),
    ("C+Z", "cluster", ("cluster", "gaussian", "zigzag")),
    ("C+G+Z", "cluster", ("cluster", "gmm", "zigzag")),
    ("Ceiling", None, None),
]
PAPER_DOMAINNET = {"Prompts-only": 64.00, "C": 73.46, "C+G": 73.72, "C+Z": 74.26, "C+G+Z": 75.32, "Ceiling": 80.16}


def base_config(seed: int, clients: int, per_class: int, overrides: dict[str, Any]):
    from fedapp.config import all_defaults, parse_run_config

    flat = {**all_defaults(), "method": "espresso", "dataset": "digit-styles", "partitioner.name": "domain",
            "partitioner.per-class": per_class, "seed": seed, **overrides}
    return parse_run_config(flat)


def client_uploads(cfg, prior, shards, kind: str) -> list[dict[str, torch.Tensor]]:
    """Every client's validated upload for one kind of client work (prompts | class | cluster)."""
    from flwr.app import ArrayRecord, RecordDict

    from clients.espresso import espresso_upload
    from fedapp.client_context import ClientContext
    from fedapp.models.text import class_prompts
    from strategies.espresso import UPLOAD_KEY, upload_tensors, validate_upload

    opts = dataclasses.replace(cfg.options, conditions=kind, init="gmm" if kind == "cluster" else "gaussian")
    out = []
    for pid, shard in enumerate(shards):
        ctx = ClientContext(cfg=cfg, partition_id=pid, num_partitions=len(shards))
        up = espresso_upload(prior, shard.train.x, shard.train.y, num_classes=shard.info.num_classes,
                             prompts=class_prompts(cfg.dataset, shard.info.class_names), opts=opts,
                             seed=ctx.seed_for(0))
        rec = RecordDict({UPLOAD_KEY: ArrayRecord(up)})
        why = validate_upload(rec, opts=opts, num_classes=shard.info.num_classes, cond_shape=prior.cond_shape,
                              latent_dim=int(np.prod(prior.latent_shape)))
        assert why is None, why
        out.append(upload_tensors(rec[UPLOAD_KEY]))
    return out


def ceiling_epochs(cfg) -> int:
    """server-epochs x ratio: the ceiling sees as many minibatches as a synthetic row (|D'| = ratio |D|)."""
    return max(1, round(cfg.server_epochs * cfg.options.ratio))


def evaluate(model, server) -> dict[str, Any]:
    from fedapp.metrics import accuracy_by_group

    m = accuracy_by_group(model.cpu(), server.test, server.info)
    m["mean_domain_accuracy"] = float(np.mean(list(m["domain_accuracy"].values())))
    return m


def fidelity_readers(server, seed: int, epochs: int = 40) -> dict[str, Any]:
    """Two SmallCNNs trained on the server's real public split: a class reader and a domain reader
    (which of the four styles an image is in), with their accuracy on the real global test set."""
    from fedapp.models.classifier import SmallCNN, accuracy, train_classifier

    pub, test = server.public, server.test
    out = {}
    for name, y, y_test, k in (("class", pub.y, test.y, server.info.num_classes),
                               ("domain", pub.attrs["domain"], test.attrs["domain"],
                                len(server.info.attributes["domain"]))):
        torch.manual_seed(seed)
        net = train_classifier(SmallCNN(k, in_ch=pub.x.shape[1]), pub.x, y, epochs=epochs, seed=seed)
        out[name] = net.eval()
        out[f"{name}_reader_test_accuracy"] = accuracy(net, test.x, y_test)
    return out


def fidelity(readers: dict[str, Any], synth: list[tuple[torch.Tensor, torch.Tensor]], domains: list[int]) -> dict:
    """Share of the synthetic images whose class the class reader reads as the intended one, and
    share of client k's images the domain reader puts in client k's domain (chance: 1/4)."""
    from fedapp.models.classifier import predict

    cls = torch.cat([(predict(readers["class"], x) == y).float() for x, y in synth])
    dom = torch.cat([(predict(readers["domain"], x) == d).float() for (x, _), d in zip(synth, domains)])
    return {"class_fidelity": float(cls.mean()), "domain_fidelity": float(dom.mean())}


def run_seed(seed: int, args, overrides: dict[str, Any], keep_images: bool) -> tuple[dict, dict]:
    from feddata import load_client_shard, load_server_data
    from fedapp.models.text import class_prompts
    from strategies.centralized import union_of_client_shards
    from strategies.espresso import derive_seed, load_server_prior, synthesize_client, train_global_classifier

    cfg = base_config(seed, args.clients, args.per_class, overrides)
    device = cfg.torch_device()
    prior = load_server_prior(cfg.prior, cfg.dataset, device)
    server = load_server_data(cfg.dataset, cfg.partitioner, cfg.partitioner_params, seed, args.clients,
                              image_size=cfg.image_size)
    shards = [load_client_shard(cfg.dataset, cfg.partitioner, cfg.partitioner_params, seed, pid, args.clients,
                                image_size=cfg.image_size) for pid in range(args.clients)]
    prompt_cond = prior.encode_prompts(class_prompts(cfg.dataset, server.info.class_names)).float().cpu()
    results, uploads, images, seconds = {}, {}, {}, {}
    readers = fidelity_readers(server, seed, args.reader_epochs) if args.fidelity else None
    domain_ids = [server.info.attributes["domain"].index(s.meta["domain"]) for s in shards]
    for name, kind, switches in ROWS:
        if name not in args.rows:
            continue
        t0 = time.time()
        if kind is None:  # the oracle ceiling
            x, y = union_of_client_shards(cfg, args.clients)
            synth = [(sh.train.x, sh.train.y) for sh in shards]  # what the fidelity readers read: real data
        else:
            if kind not in uploads:
                t1 = time.time()
                uploads[kind] = client_uploads(cfg, prior, shards, kind)
                seconds[f"clients-{kind}"] = round(time.time() - t1, 1)
                print(f"  seed {seed}: client pass '{kind}' {seconds[f'clients-{kind}']} s", flush=True)
            opts = dataclasses.replace(cfg.options, **dict(zip(("conditions", "init", "sampler"), switches)))
            xs, ys = [], []
            for pid, u in enumerate(uploads[kind]):
                x, y, _ = synthesize_client(prior, u, opts, prompt_cond, derive_seed(seed, pid))
                xs.append(x)
                ys.append(y)
                if keep_images:
                    images[(name, shards[pid].meta["domain"])] = (x, y)
            synth = list(zip(xs, ys))
            x, y = torch.cat(xs), torch.cat(ys)
        t_synth = time.time() - t0
        # the ceiling trains for as many minibatches as the synthetic rows: |D'| = ratio x |D|
        epochs = cfg.server_epochs if kind is not None else ceiling_epochs(cfg)
        model = train_global_classifier(cfg.model, x, y, server.info.num_classes, epochs=epochs,
                                        seed=seed, device=device)
        results[name] = {**evaluate(model, server), "num_train": len(x)}
        if readers is not None:
            results[name].update(fidelity(readers, synth, domain_ids))
        seconds[name] = {"data": round(t_synth, 1), "classifier": round(time.time() - t0 - t_synth, 1)}
        print(f"  seed {seed}: {name:12s} mean-domain acc {results[name]['mean_domain_accuracy']:.4f} "
              f"({seconds[name]['data']} s data, {seconds[name]['classifier']} s classifier)", flush=True)
    if keep_images:
        images["real"] = {s.meta["domain"]: (s.train.x, s.train.y) for s in shards}
    out = {"results": results, "seconds": seconds}
    if readers is not None:
        out["readers"] = {k: v for k, v in readers.items() if k.endswith("test_accuracy")}
    return out, images


def timed_seed(seed: int, args, overrides: dict[str, Any], keep_images: bool) -> tuple[int, dict, dict]:
    if args.threads:  # again: a spawned worker starts with torch's default
        torch.set_num_threads(args.threads)
    t0 = time.time()
    print(f"seed {seed}", flush=True)
    res, images = run_seed(seed, args, overrides, keep_images)
    res["wall_seconds"] = round(time.time() - t0, 1)
    return seed, res, images


def seed_results(seeds: list[int], args, overrides: dict[str, Any]):
    """Yield (seed, results, images) as seeds finish; --jobs > 1 runs seeds in spawned processes
    (seeds are independent, and one torch thread per seed uses small cores better than one seed on
    all of them: the tiny UNet's batches do not scale past one or two threads)."""
    keep = {s: s == args.seeds[0] for s in seeds}
    if args.jobs <= 1:
        for s in seeds:
            yield timed_seed(s, args, overrides, keep[s])
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(timed_seed, s, args, overrides, keep[s]) for s in seeds]
        for f in as_completed(futures):
            yield f.result()


def table(per_seed: dict[str, dict], domains: list[str]) -> tuple[str, dict]:
    """The paper-style markdown table: per-domain and average accuracy (%), mean ± std over seeds."""
    names = [n for n, _, _ in ROWS if all(n in s["results"] for s in per_seed.values())]
    cols = domains + ["avg"]
    head = "| config | C | G | Z | " + " | ".join(cols) + " | DomainNet (paper) |"
    lines = [head, "|" + "---|" * (len(cols) + 5)]
    summary = {}
    flags = {n: sw for n, _, sw in ROWS}
    for n in names:
        vals = {d: [100 * s["results"][n]["domain_accuracy"][d] for s in per_seed.values()] for d in domains}
        vals["avg"] = [100 * s["results"][n]["mean_domain_accuracy"] for s in per_seed.values()]
        summary[n] = {c: {"mean": float(np.mean(v)), "std": float(np.std(v))} for c, v in vals.items()}
        sw = flags[n]
        c, g, z = ("" if sw is None else ("✓" if sw[0] == "cluster" else "class" if sw[0] == "class" else ""),
                   "" if sw is None else ("✓" if sw[1] == "gmm" else ""),
                   "" if sw is None else ("✓" if sw[2] == "zigzag" else ""))
        paper = f"{PAPER_DOMAINNET[n]:.2f}" if n in PAPER_DOMAINNET else "—"
        cells = " | ".join(f"{summary[n][col]['mean']:.1f} ± {summary[n][col]['std']:.1f}" for col in cols)
        lines.append(f"| {n} | {c} | {g} | {z} | {cells} | {paper} |")
    return "\n".join(lines), summary


def fidelity_table(per_seed: dict[str, dict]) -> str:
    """Class and domain fidelity (%) of each row's training images, mean ± std over seeds ('' if not measured)."""
    names = [n for n, _, _ in ROWS if all("domain_fidelity" in s["results"].get(n, {}) for s in per_seed.values())]
    if not names:
        return ""
    lines = ["| config | class fidelity | domain fidelity |", "|---|---|---|"]
    for n in names:
        cells = []
        for key in ("class_fidelity", "domain_fidelity"):
            v = [100 * s["results"][n][key] for s in per_seed.values()]
            cells.append(f"{np.mean(v):.1f} ± {np.std(v):.1f}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bar_chart(summary: dict, domains: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, cols = list(summary), domains + ["avg"]
    fig, ax = plt.subplots(figsize=(10, 3.8))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        means = [summary[n][c]["mean"] for c in cols]
        stds = [summary[n][c]["std"] for c in cols]
        ax.bar(np.arange(len(cols)) + (i - (len(names) - 1) / 2) * width, means, width, yerr=stds, capsize=2,
               label=n)
    ax.set_xticks(np.arange(len(cols)), cols)
    ax.set_ylabel("test accuracy (%)")
    lo = min(summary[n][c]["mean"] - summary[n][c]["std"] for n in names for c in cols)
    ax.set_ylim(max(0, lo - 10), 100)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(ncol=len(names), fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    ax.set_title("Espresso ablation, digit-styles (domain partitioner), mean ± std over seeds", pad=30)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def image_grids(images: dict, num_classes: int, out: Path, panels=("Prompts-only", "C+G+Z")) -> list[str]:
    """docs/espresso_synthetic_<domain>.png: real training images | Prompts-only | C+G+Z (rows = classes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from strategies.espresso import synthetic_grid

    def grid(x, y, cols=6):
        g = synthetic_grid(x, y, num_classes, cols)
        h, w = g.shape[-2:]
        g = g.reshape(num_classes, cols, 3, h, w).permute(0, 3, 1, 4, 2).reshape(num_classes * h, cols * w, 3)
        return ((g.clamp(-1, 1) + 1) / 2).numpy()

    written = []
    for domain, (xr, yr) in images["real"].items():
        shown = [("real (client's data)", xr, yr)] + [(p, *images[(p, domain)]) for p in panels if (p, domain) in images]
        fig, axes = plt.subplots(1, len(shown), figsize=(2.6 * len(shown), 4.4))
        for ax, (title, x, y) in zip(np.atleast_1d(axes), shown):
            ax.imshow(grid(x, y), interpolation="nearest")
            ax.set_title(title, fontsize=9)
            ax.axis("off")
        fig.suptitle(f"domain: {domain}", fontsize=10)
        path = out / f"espresso_synthetic_{domain}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(str(path))
    return written


def parse_set(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m fedapp.experiments espresso-ablation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--per-class", type=int, default=16)
    p.add_argument("--rows", nargs="+", default=[n for n, _, _ in ROWS], help="subset of rows")
    p.add_argument("--set", nargs="*", default=[], help="run-config overrides, e.g. espresso.steps=10 model=resnet18")
    p.add_argument("--out", default="docs")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--resume", action="store_true", help="skip seeds already in the JSON file")
    p.add_argument("--fidelity", action="store_true",
                   help="also read the synthetic images with a class and a domain classifier trained on real public images")
    p.add_argument("--reader-epochs", type=int, default=40, help="epochs of the --fidelity readers")
    p.add_argument("--jobs", type=int, default=1, help="seeds run in parallel processes (use with --threads 1)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = parse_set(a.set)
    path = out / "espresso_ablation.json"
    per_seed: dict[str, dict] = {}
    if a.resume and path.is_file():
        per_seed = json.loads(path.read_text()).get("per_seed", {})
    cfg = base_config(a.seeds[0], a.clients, a.per_class, overrides)
    from feddata import dataset_info

    info = dataset_info(cfg.dataset, image_size=cfg.image_size)
    domains = list(info.attributes["domain"])
    t_all = time.time()
    todo = [s for s in a.seeds if str(s) not in per_seed]
    for seed, res, images in seed_results(todo, a, overrides):
        per_seed[str(seed)] = res
        if images:
            image_grids(images, info.num_classes, out)
        md, summary = table(per_seed, domains)
        opts = {k: v for k, v in cfg.flat().items() if k.startswith("espresso.") or k in
                ("model", "server-epochs", "prior", "image-size")}
        atomic_write_json(path, {
            "setting": {"dataset": cfg.dataset, "partitioner": "domain", "clients": a.clients,
                        "per-class": a.per_class, "seeds": a.seeds, "config": opts,
                        "ceiling_epochs": ceiling_epochs(cfg)},
            "how": "one process per seed (--jobs); client uploads from clients.espresso.espresso_upload (one pass per kind: "
                   "prompts, class, cluster), validated by strategies.espresso.validate_upload; server side "
                   "strategies.espresso.synthesize_client + train_global_classifier; ceiling = "
                   "strategies.centralized.union_of_client_shards (oracle)",
            "accuracy": "percent on the server's global test set; avg = mean over the four domains",
            "summary": summary, "table_markdown": md, "fidelity_markdown": fidelity_table(per_seed),
            "per_seed": per_seed,
            "paper_domainnet": PAPER_DOMAINNET})
        bar_chart(summary, domains, out / "espresso_ablation.png")
    md, _ = table(per_seed, domains)
    print(md)
    fid = fidelity_table(per_seed)
    if fid:
        print(f"\nread by classifiers trained on real public images (Ceiling row: the clients' real data)\n{fid}")
    print(f"({time.time() - t_all:.0f} s; {path}, {out / 'espresso_ablation.png'}, {out}/espresso_synthetic_<domain>.png)")
