"""ServerApp: run config -> strategy from the registry -> run -> results on disk."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedapp import registry
from fedapp.config import ConfigError, RunConfig, check_data, parse_run_config
from fedapp.preflight import preflight, sample_size_problem
from fedapp.progress import no_ray_log_dedup, setup_logging
from fedapp.results import RunDir
from fedapp.server import MeteredGrid, ServerRun, TooFewNodes, simulated_nodes, wait_for_nodes
from fedapp.server.checkpoint import load_checkpoint

log = logging.getLogger("fedapp")
app = ServerApp()


def run_server(grid: Grid, flat_config: Mapping[str, Any]) -> dict[str, Any]:
    """Validate the config, run the chosen strategy, write the run folder; return the summary.

    summary.json exists from the start with status "running", then says "completed" or "failed"
    (with the error), so a run that stopped early is never mistaken for one in progress."""
    setup_logging()
    cfg = parse_run_config(flat_config)  # a user error stops here, before any client work
    # out-dir, dataset, prior, model: before the run folder or any node; in a simulation, whose nodes are
    # known and fixed, also min-clients, the sampled share and the data against them (as fedapp.simulate)
    preflight(cfg, simulated_nodes(grid))
    out = RunDir(Path(cfg.resume) if cfg.resume else Path(cfg.out_dir) / cfg.resolved_run_name,
                 tensorboard=cfg.log.tensorboard)
    run = ServerRun(cfg=cfg, out=out, device=cfg.torch_device())
    if cfg.resume:
        run.resume_from = load_checkpoint(out.root)
        out.reload_metrics(lambda row: row.get("round", -1) <= run.resume_from.round)
        log.info("resuming %s after round %d", out.root, run.resume_from.round)
    else:
        out.write_json("config.json", cfg.flat())
    summary: dict[str, Any] = {
        "method": cfg.method, "dataset": cfg.dataset, "partitioner": cfg.partitioner,
        "partitioner_params": cfg.partitioner_params, "num_clients": None, "seed": cfg.seed,
        "run_dir": str(out.root), "status": "running",
    }
    if cfg.resume:
        summary["resumed_after_round"] = run.resume_from.round
    out.write_json("summary.json", summary)
    log.info("run %s: method=%s dataset=%s partitioner=%s -> %s", out.root.name, cfg.method,
             cfg.dataset, cfg.partitioner, out.root)
    run.started = time.time()
    strategy = None
    try:
        nodes = wait_for_nodes(grid, cfg.min_clients, timeout=cfg.node_timeout)
        summary["num_clients"] = len(nodes)
        check_data(cfg, len(nodes))
        if (why := sample_size_problem(cfg, len(nodes))) is not None:  # a deployment's may still grow: a warning
            log.warning("%s (on the %d nodes connected at the start)", why, len(nodes))
        strategy = registry.strategy_class(cfg.method)(run)
        summary["metrics"] = strategy.execute(MeteredGrid(grid, run))
        summary["status"] = "completed"
        from fedapp.models.checkpoints import drop_train_states

        drop_train_states(out.root)  # mid-run train states: nothing is left to continue
    except Exception as err:  # keep what we have: the summary says why it stopped
        summary["status"] = "failed"
        summary["error"] = f"{type(err).__name__}: {err}"
        raise
    except BaseException as err:  # Ctrl-C, SIGTERM turned into SystemExit: stopped, not broken
        summary["status"] = "interrupted"
        summary["error"] = type(err).__name__
        raise
    finally:
        summary["wall_seconds"] = round(run.wall_seconds(), 3)  # a resumed run's: the stopped part's too
        summary["phase_seconds"] = {k: round(v, 3) for k, v in run.total_phase_seconds().items()}
        summary["comm"] = run.comm()
        summary["failures"] = run.failures
        if strategy is not None and strategy.privacy:
            summary["privacy"] = strategy.privacy
        out.write_json("comm.json", {"totals": summary["comm"], "by_phase": run.ledger.as_dict()["by_phase"],
                                     # a resumed run: by_phase is this part's; totals add the stopped part's
                                     **({"before_resume": run.earlier()["per_client"]} if run.earlier() else {})})
        out.write_json("summary.json", summary)
        out.close()
        write_run_figures(out, summary, cfg)
        log.info("summary written to %s", out.path("summary.json"))
    return summary


def _draw(what: str, draw: Callable[[], Any]) -> None:
    """A figure that cannot be drawn is logged, never the reason a run fails."""
    try:
        draw()
    except Exception as err:  # noqa: BLE001 - the results themselves are already written
        log.warning("could not write %s: %s: %s", what, type(err).__name__, err)


def write_run_figures(out: RunDir, summary: Mapping[str, Any], cfg: RunConfig) -> None:
    """plots/phases.png (wall time per phase), plots/label_distribution.png (images per class and
    client) and report.md: every run folder has them."""
    from fedapp.data import label_partitioner
    from fedapp.report import write_report

    _draw("plots/phases.png", lambda: out.plot_phases(summary.get("phase_seconds") or {},
                                                      wall=summary.get("wall_seconds")))
    if summary.get("num_clients"):
        _draw("plots/label_distribution.png",
              lambda: out.plot_label_distribution(label_partitioner(cfg, summary["num_clients"])))
    _draw("report.md", lambda: write_report(out.root))  # last: it links every figure


@app.main()
def main(grid: Grid, context: Context) -> None:
    no_ray_log_dedup()  # `flwr run`: this process is Ray's driver; the clients' lines as they come, each
    try:
        run_server(grid, dict(context.run_config))
    except (ConfigError, TooFewNodes) as err:
        # one line, the ServerApp's last; Flower marks the run failed with it (`flwr list`) and then prints
        # its own traceback of the ServerApp's exception, which adds nothing to it
        log.error("%s", err)
        raise type(err)(str(err)) from None
