"""Espresso's component ablation (paper Fig. 4) on digit-styles, domain partitioner:
Prompts-only, class-embed (FedDEO-like, extra row), C, C+G, C+Z, C+G+Z and the centralized ceiling,
over several seeds; prints the paper-style table (per-domain and average accuracy, mean ± std),
writes <out>/espresso_ablation.json, <out>/espresso_ablation.png and <out>/espresso_synthetic_<domain>.png
(--out defaults to docs/results).

    python -m experiments espresso-ablation [--seeds 0 1 2] [--set espresso.steps=10 ...]
    # the label-skew setting: real 28 px digits, a prior that has seen photo only, label skew in one domain
    python -m experiments espresso-ablation --set dataset=mnist-styles prior=tiny@photo
    python -m experiments espresso-ablation --set partitioner.name=dirichlet-domain \
        partitioner.domain=photo partitioner.alpha=0.5

How it runs: every row is a run config executed by the real strategy through
`fedapp.simulation.simulate_in_process` (the server's run_server, the clients' handlers in this
process): Prompts-only = method `prompts`, class-embed = `class-embed`, C / C+G / C+Z / C+G+Z =
`espresso` with espresso.init gaussian|gmm and espresso.sampler ddim|zigzag, Ceiling = `centralized`
(an oracle on the union of the clients' real shards) trained for server-epochs x ratio epochs so that
it sees as many minibatches as a synthetic row. The rows of a seed share one ReplyCache: the sampler
only changes the server side (its MethodSpec.server_only_keys), so C+Z reuses C's client replies and C+G+Z
reuses C+G's. Accuracies come from each run's summary.json; the fidelity readers (--fidelity) and the
image grids read the synthetic set each run writes (espresso.save-synthetic: synthetic.safetensors).

Resuming (--resume): seeds already in the JSON are skipped, and within a seed every row that finished
before a stop is read back from <out>/rows/ (its figures, named by a digest of the row's whole run config
but its out-dir, and the readers' settings; committed beside the table's JSON, so a seed longer than a
machine's time slot, or cut on one machine, continues on another and loses at most the row it was running).
--reader-seed N trains the two readers once, with seed N, before the seeds start, for every seed of the
table (a fixed instrument, as FID's Inception network is; at 28 px a reader trains on 17,000 images);
without it each seed trains its own.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from experiments.cli import common_args, pin_threads
from experiments.common import (accuracy_curve, all_converged, check_configs, classification_verdict,
                                config_errors_exit, paired_difference, paired_text, parse_set, prog, quiet_logs)
from fedapp.results import atomic_write_json

ROWS = [  # name, method, switches (conditions, init, sampler); None: trained on real data (ceiling, FedAvg)
    ("Prompts-only", "prompts", ("prompts", "gaussian", "ddim")),
    ("class-embed", "class-embed", ("class", "gaussian", "ddim")),
    ("C", "espresso", ("cluster", "gaussian", "ddim")),
    ("C+G", "espresso", ("cluster", "gmm", "ddim")),
    ("C+Z", "espresso", ("cluster", "gaussian", "zigzag")),
    ("C+G+Z", "espresso", ("cluster", "gmm", "zigzag")),
    ("Ceiling", "centralized", None),
    ("FedAvg", "fedavg", None),  # the multi-round reference on the same clients: --fedavg-rounds rounds
]
PANELS = ("Prompts-only", "C+G+Z")  # the synthetic columns of the image grids
PAPER_DOMAINNET = {"Prompts-only": 64.00, "C": 73.46, "C+G": 73.72, "C+Z": 74.26, "C+G+Z": 75.32, "Ceiling": 80.16}


def base_config(seed: int, args, overrides: dict[str, Any]) -> dict[str, Any]:
    """The seed's settings every row shares (the run-config overrides of --set on top)."""
    return {"method": "espresso", "dataset": "digit-styles", "partitioner.name": "domain",
            "partitioner.per-class": args.per_class, "seed": seed, "min-clients": args.clients,
            "out-dir": args.runs, **overrides}


def parsed(flat: dict[str, Any], clients: int):
    from fedapp.config import parse_run_config
    from fedapp.simulation import resolve_run_config

    return parse_run_config(resolve_run_config(flat, clients)[0])


def diagnostic_config(seed: int, clients: int, overrides: dict[str, Any], runs: str):
    """The parsed config of a diagnostic that reads Espresso images outside a table run (vae-round-trip,
    espresso-conditions): the table's partition (16 images a class per client) and settings, so its readers
    and test images are the table's."""
    import argparse

    return parsed(base_config(seed, argparse.Namespace(per_class=16, clients=clients, runs=runs), overrides), clients)


def ceiling_epochs(cfg) -> int:
    """server-epochs x ratio: the ceiling sees as many minibatches as a synthetic row (|D'| = ratio |D|)."""
    return max(1, round(cfg.server_epochs * cfg.options.ratio))


def row_config(name: str, seed: int, args, overrides: dict[str, Any]) -> dict[str, Any]:
    """The run config of one row: the seed's settings with the row's method and switches pinned."""
    method, switches = next((m, sw) for n, m, sw in ROWS if n == name)
    flat = {**base_config(seed, args, overrides), "method": method,
            "run-name": f"{name.lower().replace('+', '-')}-s{seed}"}
    if method == "espresso":
        flat.update(zip(("espresso.conditions", "espresso.init", "espresso.sampler"), switches))
    if method == "centralized":
        flat["server-epochs"] = ceiling_epochs(parsed(base_config(seed, args, overrides), args.clients))
    elif method == "fedavg":
        flat["num-server-rounds"] = args.fedavg_rounds
    else:
        flat["espresso.save-synthetic"] = True
    return flat


def synthetic_set(run_dir: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """partition id -> (x, y) of the synthetic images the run trained on (its synthetic.safetensors)."""
    from safetensors.torch import load_file

    from fedapp.protocols.espresso import SYNTHETIC_FILE

    path = Path(run_dir) / SYNTHETIC_FILE
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: the Espresso strategy writes it when espresso.save-synthetic = true")
    t = load_file(str(path))
    return {int(pid): (t["x"][t["client"] == pid], t["y"][t["client"] == pid]) for pid in t["client"].unique()}


def accuracies(summary: dict[str, Any], method: str) -> dict[str, Any]:
    """The row's figures from summary.json: global test accuracy, per domain, their mean, the training set size
    (synthetic rows: the synthetic set; the ceiling: the union of the real shards; FedAvg: None, it trains on
    the clients) and, for FedAvg, its convergence verdict from its per-round accuracy curve."""
    m = summary["metrics"]
    num_train = None if method == "fedavg" else m["num_train"] if m.get("oracle") else m["num_synthetic"]
    out = {"accuracy": m["accuracy"], "domain_accuracy": m["domain_accuracy"],
           "mean_domain_accuracy": float(np.mean(list(m["domain_accuracy"].values()))), "num_train": num_train}
    if method == "fedavg":
        out["verdict"] = classification_verdict(accuracy_curve(summary))
    return out


def reference_converged(per_seed: dict[str, dict]) -> dict[str, Any] | None:
    """Whether the FedAvg reference row converged on every seed that kept a verdict (rows measured before
    verdicts were kept have none and are not counted); None when no seed has one."""
    verdicts = [r["results"]["FedAvg"]["verdict"] for r in per_seed.values()
                if "verdict" in r.get("results", {}).get("FedAvg", {})]
    return all_converged(verdicts) if verdicts else None


def prior_build(flat: dict[str, Any]) -> str | None:
    """The prior a row's figures depend on: for a built-in tiny prior its cache folder's name, whose key changes
    with the build's recipe (the spec `tiny-sd@photo` names a new build when its VAE's images change); else the
    spec; None for a row that runs no prior (the ceiling, FedAvg)."""
    from fedapp import registry
    from fedapp.config import all_defaults
    from fedapp.models.prior.spec import resolve_prior

    run = {**all_defaults(), **flat}
    if not registry.METHODS[run["method"]].uses_prior:
        return None
    src = resolve_prior(run["prior"], run["dataset"])
    return Path(src.location).name if src.kind == "tiny" else str(run["prior"])


def row_file(flat: dict[str, Any], args) -> Path:
    """Where a finished row's figures wait for a resumed table (<out>/rows/, beside the table's JSON): named by
    the row's whole run config, the prior build it ran and the readers' settings, so that a row measured under
    other settings is never read back; the runs' folder (out-dir) is left out, as it moves nothing but where
    the run wrote."""
    from fedapp.models.cache import facts_digest

    facts = {"config": {k: v for k, v in flat.items() if k != "out-dir"}, "fidelity": args.fidelity,
             "reader_epochs": args.reader_epochs, "reader_seed": args.reader_seed}
    if (build := prior_build(flat)) is not None:  # rows without a prior keep the names they had
        facts["prior_build"] = build
    return Path(args.out) / "rows" / f"{flat['run-name']}-{facts_digest(facts)}.json"


def reader_seed(seed: int, args) -> int:
    """The seed the fidelity readers train with: --reader-seed for every table seed, else the table seed."""
    return seed if args.reader_seed is None else args.reader_seed


def fidelity_readers(server, seed: int, epochs: int = 40) -> dict[str, Any]:
    """Two readers (fedapp.readers) trained on the server's real public split: a class reader and a domain
    reader (which of the four styles an image is in), with their accuracy on the real global test set and
    whether they are good enough to trust (`reader_unreliable`)."""
    from fedapp.readers import LABEL, reader_metrics, server_reader

    readers = {"class": server_reader(server, seed, LABEL, epochs=epochs),
               "domain": server_reader(server, seed, "domain", epochs=epochs)}
    out: dict[str, Any] = {name: r.model for name, r in readers.items()}
    out.update({f"{name}_reader_test_accuracy": r.held_out_accuracy for name, r in readers.items()})
    out.update(reader_metrics(readers.values()))
    return out


def fidelity(readers: dict[str, Any], synth: list[tuple[torch.Tensor, torch.Tensor]], domains: list[int],
             real: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """Share of the synthetic images whose class the class reader reads as the intended one, and
    share of client k's images the domain reader puts in client k's domain (chance: 1/4), and the class share
    per client (`class_fidelity_by_client`, in `synth`'s order: which clients' conditions lose the class). With the
    clients' real images: diversity, the intra-class spread of the class reader's features, synthetic
    over real (fedapp.metrics.diversity_ratio; 1 = as diverse as the real data)."""
    from fedapp.models.classifier import predict

    per_client = [(predict(readers["class"], x) == y).float() for x, y in synth]
    cls = torch.cat(per_client)
    dom = torch.cat([(predict(readers["domain"], x) == d).float() for (x, _), d in zip(synth, domains)])
    out = {"class_fidelity": float(cls.mean()), "domain_fidelity": float(dom.mean()),
           "class_fidelity_by_client": [float(c.mean()) for c in per_client]}
    if real is not None:
        from fedapp.metrics import diversity_ratio
        from fedapp.models.classifier import embed_all

        x, y = torch.cat([x for x, _ in synth]), torch.cat([y for _, y in synth])
        out["diversity"] = diversity_ratio(embed_all(readers["class"], x), y, embed_all(readers["class"], real[0]),
                                           real[1])["mean"]
    return out


def run_seed(seed: int, args, overrides: dict[str, Any], keep_images: bool) -> tuple[dict, dict]:
    from fedapp.data import all_client_shards, server_data
    from fedapp.protocols.espresso import SYNTHETIC_FILE
    from fedapp.simulation import ReplyCache, simulate_in_process

    cfg = parsed(base_config(seed, args, overrides), args.clients)
    server = server_data(cfg, args.clients)
    shards = all_client_shards(cfg, args.clients)  # ORACLE, for the diagnostics: readers' truth, real panels
    domains = list(server.info.attributes["domain"])
    domain_ids = [domains.index(s.meta["domain"]) for s in shards]
    readers = fidelity_readers(server, reader_seed(seed, args), args.reader_epochs) if args.fidelity else None
    # the rows of a seed reuse each other's client replies where the client work is the same, also across a
    # stop (kept under <runs>/reply-cache: a resumed C+G+Z reuses the C+G clients' work done before the stop)
    cache = ReplyCache(Path(args.runs) / "reply-cache")
    results, images, seconds = {}, {}, {}
    for name, method, _ in ROWS:
        if name not in args.rows:
            continue
        flat = row_config(name, seed, args, overrides)
        saved = row_file(flat, args)
        if args.resume and saved.is_file():  # finished before a stop: its figures, not a second run
            row = json.loads(saved.read_text())
            if method == "fedavg" and "verdict" not in row["results"]:  # a row from before verdicts were kept
                if Path(row["run_dir"], "metrics.jsonl").is_file():      # (its curve, where its run folder is)
                    row["results"]["verdict"] = classification_verdict(accuracy_curve(row))
            results[name], seconds[name] = row["results"], row["seconds"]
            if keep_images and name in PANELS and Path(row["run_dir"], SYNTHETIC_FILE).is_file():
                images.update({(name, shards[p].meta["domain"]): xy
                               for p, xy in synthetic_set(row["run_dir"]).items()})
            print(f"  seed {seed}: {name:12s} read back from {saved}", flush=True)
            continue
        t0 = time.time()
        hits, misses = cache.hits, cache.misses
        summary = simulate_in_process(flat, args.clients, reply_cache=cache)
        results[name] = accuracies(summary, method)
        if method == "centralized":
            synth = {pid: (sh.train.x, sh.train.y) for pid, sh in enumerate(shards)}  # what it trained on: real data
        elif method == "fedavg":
            synth = {}  # no server-side training set to read: its clients train on their own shards
        elif readers is not None or (keep_images and name in PANELS):
            synth = synthetic_set(summary["run_dir"])
        else:
            synth = {}
        if readers is not None and synth:
            pids = sorted(synth)
            real = (torch.cat([s.train.x for s in shards]), torch.cat([s.train.y for s in shards]))
            results[name].update(fidelity(readers, [synth[p] for p in pids], [domain_ids[p] for p in pids], real))
        if keep_images and name in PANELS:
            images.update({(name, shards[p].meta["domain"]): xy for p, xy in synth.items()})
        seconds[name] = {"wall": round(time.time() - t0, 1), **summary["phase_seconds"],
                         "client_calls_reused": cache.hits - hits, "client_calls_run": cache.misses - misses}
        atomic_write_json(saved, {"results": results[name], "seconds": seconds[name], "run_dir": summary["run_dir"]})
        verdict = results[name].get("verdict")
        print(f"  seed {seed}: {name:12s} mean-domain acc {results[name]['mean_domain_accuracy']:.4f} "
              f"({seconds[name]['wall']} s; client calls: {seconds[name]['client_calls_run']} run, "
              f"{seconds[name]['client_calls_reused']} reused)" + (
                  f"; {'' if verdict['converged'] else 'not '}converged: {verdict['reason']}" if verdict else ""),
              flush=True)
    if keep_images:
        images["real"] = {s.meta["domain"]: (s.train.x, s.train.y) for s in shards}
    out = {"results": results, "seconds": seconds}
    if readers is not None:
        out["readers"] = {k: v for k, v in readers.items() if not isinstance(v, torch.nn.Module)}
    return out, images


def timed_seed(seed: int, args, overrides: dict[str, Any], keep_images: bool) -> tuple[int, dict, dict]:
    pin_threads(args.threads, args.jobs)  # again: a spawned worker starts with torch's default
    quiet_logs()
    t0 = time.time()
    print(f"seed {seed}", flush=True)
    res, images = run_seed(seed, args, overrides, keep_images)
    res["wall_seconds"] = round(time.time() - t0, 1)
    return seed, res, images


def seed_complete(entry: dict | None, rows: list[str]) -> bool:
    """A seed of the table's JSON is done only when it holds every row asked for now; the rows it lacks run (or
    are read back from <out>/rows/), so runners filling one table with different rows each add theirs."""
    return entry is not None and all(r in entry["results"] for r in rows)


def merged_seed(old: dict | None, new: dict) -> dict:
    """A seed's entry with `new`'s rows added to the rows another invocation saved before."""
    if old is None:
        return new
    return {**old, **new, "results": {**old["results"], **new["results"]},
            "seconds": {**old.get("seconds", {}), **new.get("seconds", {})}}


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


# The paper's steps (Espresso, DomainNet: prompts 64.0 -> C 73.5 -> C+G+Z 75.3), as same-seed differences;
# the last is the whole method against plain prompts, the pair a `--rows Prompts-only C+G+Z` run measures
STEPS = (("C", "Prompts-only"), ("C+G", "C"), ("C+G+Z", "C+G"), ("C+G+Z", "class-embed"), ("C+G+Z", "Prompts-only"))


def paired_steps(per_seed: dict[str, dict]) -> dict[str, dict]:
    """Each of STEPS as the same-seed difference of mean domain accuracy (points; experiments.common's
    paired_difference: mean, std, seeds paired, seeds favouring the row)."""
    def by_seed(row: str) -> dict[str, float]:
        return {s: 100 * r["results"][row]["mean_domain_accuracy"] for s, r in per_seed.items()
                if row in r.get("results", {})}

    return {f"{a} - {b}": paired_difference(by_seed(a), by_seed(b), True) for a, b in STEPS}


def fidelity_table(per_seed: dict[str, dict]) -> str:
    """Class and domain fidelity (%) and diversity (synthetic / real intra-class feature spread) of each row's
    training images, mean ± std over seeds ('' if not measured)."""
    names = [n for n, _, _ in ROWS if all("domain_fidelity" in s["results"].get(n, {}) for s in per_seed.values())]
    if not names:
        return ""
    lines = ["| config | class fidelity | domain fidelity | diversity (synthetic / real) |", "|---|---|---|---|"]
    for n in names:
        cells = []
        for key in ("class_fidelity", "domain_fidelity"):
            v = [100 * s["results"][n][key] for s in per_seed.values()]
            cells.append(f"{np.mean(v):.1f} ± {np.std(v):.1f}")
        v = [s["results"][n].get("diversity", np.nan) for s in per_seed.values()]
        cells.append(f"{np.mean(v):.2f} ± {np.std(v):.2f}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bar_chart(summary: dict, domains: list[str], path: Path) -> None:
    if not summary:  # no row yet in every seed (runners filling one table with different rows): nothing to draw
        return
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
    """<out>/espresso_synthetic_<domain>.png: real training images | Prompts-only | C+G+Z (rows = classes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedapp.images import synthetic_grid

    def grid(x, y, cols=6):
        g = synthetic_grid(x, y, num_classes, cols)
        h, w = g.shape[-2:]
        g = g.reshape(num_classes, cols, 3, h, w).permute(0, 3, 1, 4, 2).reshape(num_classes * h, cols * w, 3)
        return ((g.clamp(-1, 1) + 1) / 2).numpy()

    written = []
    for domain, (xr, yr) in images["real"].items():
        shown = [("real (client's data)", xr, yr)] + [(p, *images[(p, domain)]) for p in panels
                                                       if (p, domain) in images]
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


def main(argv: list[str]) -> None:
    shared = common_args(set=[], out="docs/results", runs="runs/espresso-ablation", threads=0,
                         helps={"set": "run-config overrides, e.g. espresso.steps=10 model=resnet18",
                                "out": "folder for the JSON and PNGs"})
    p = argparse.ArgumentParser(prog=prog("espresso-ablation"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, parents=[shared])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--per-class", type=int, default=16)
    p.add_argument("--rows", nargs="+", default=[n for n, _, _ in ROWS], choices=[n for n, _, _ in ROWS],
                   help="subset of rows")
    p.add_argument("--fedavg-rounds", type=int, default=30,
                   help="rounds of the FedAvg reference row (local epochs: the run config's local-epochs)")
    p.add_argument("--resume", action="store_true",
                   help="skip seeds already in the JSON file, and rows of a stopped seed already finished")
    p.add_argument("--fidelity", action="store_true",
                   help="also read the synthetic images with a class and a domain classifier "
                        "trained on real public images")
    p.add_argument("--reader-epochs", type=int, default=40, help="epochs of the --fidelity readers")
    p.add_argument("--reader-seed", type=int, default=None,
                   help="train the --fidelity readers once with this seed for every table seed "
                        "(default: each seed its own)")
    p.add_argument("--jobs", type=int, default=1, help="seeds run in parallel processes (use with --threads 1)")
    a = p.parse_args(argv)
    pin_threads(a.threads, a.jobs)
    overrides = parse_set(a.set)
    with config_errors_exit():  # the ceiling's row reads the run config
        configs = [row_config(n, s, a, overrides) for s in a.seeds for n in a.rows]
    check_configs(configs, a.clients)
    quiet_logs()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "espresso_ablation.json"
    per_seed: dict[str, dict] = {}
    if a.resume and path.is_file():
        per_seed = json.loads(path.read_text()).get("per_seed", {})
    cfg = parsed(row_config("C+G+Z", a.seeds[0], a, overrides), a.clients)
    from feddata import dataset_info

    info = dataset_info(cfg.dataset, image_size=cfg.image_size)
    domains = list(info.attributes["domain"])
    t_all = time.time()
    todo = [s for s in a.seeds if not seed_complete(per_seed.get(str(s)), a.rows)]
    if todo and a.fidelity and a.reader_seed is not None:  # the one pair of readers, trained here before
        from fedapp.data import server_data                 # --jobs processes would each train it at once

        fidelity_readers(server_data(cfg, a.clients), a.reader_seed, a.reader_epochs)
    for seed, res, images in seed_results(todo, a, overrides):
        per_seed[str(seed)] = merged_seed(per_seed.get(str(seed)), res)
        if images:
            image_grids(images, info.num_classes, out)
        md, summary = table(per_seed, domains)
        opts = {k: v for k, v in cfg.flat().items() if k.startswith("espresso.") and k != "espresso.save-synthetic"
                or k in ("model", "server-epochs", "prior", "image-size")}
        atomic_write_json(path, {
            "setting": {"dataset": cfg.dataset, "partitioner": cfg.partitioner, **cfg.partitioner_params,
                        "clients": a.clients,
                        "per-class": a.per_class, "seeds": a.seeds, "config": opts,
                        "ceiling_epochs": ceiling_epochs(cfg),
                        **({"reader_seed": a.reader_seed} if a.reader_seed is not None else {})},
            "how": "one process per seed (--jobs); each row a run of the real strategy (prompts, class-embed, espresso "
                   "with init/sampler switches, centralized = oracle ceiling) through "
                   "fedapp.simulation.simulate_in_process, the seed's rows sharing one ReplyCache (rows that differ "
                   "only in server-side keys reuse the clients' replies); accuracies from each run's summary.json, "
                   "fidelity from its synthetic.safetensors",
            "accuracy": "percent on the server's global test set; avg = mean over the four domains",
            "summary": summary, "paired": paired_steps(per_seed), "table_markdown": md,
            "fedavg_reference_converged": reference_converged(per_seed),
            "fidelity_markdown": fidelity_table(per_seed),
            "per_seed": per_seed,
            "paper_domainnet": PAPER_DOMAINNET})
        bar_chart(summary, domains, out / "espresso_ablation.png")
    md, _ = table(per_seed, domains)
    print(md)
    print("\nsame seeds, mean domain accuracy (points): " + "; ".join(
        f"{k} {paired_text(v)}" for k, v in paired_steps(per_seed).items()))
    fid = fidelity_table(per_seed)
    if fid:
        print(f"\nread by classifiers trained on real public images (Ceiling row: the clients' real data)\n{fid}")
    print(f"({time.time() - t_all:.0f} s; {path}, {out / 'espresso_ablation.png'}, "
          f"{out}/espresso_synthetic_<domain>.png)")
