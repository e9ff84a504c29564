"""Run folder writes are atomic and complete."""

import json

import pytest

from fedapp.results import RunDir, atomic_write_json


def test_atomic_write_leaves_old_file_when_serialisation_fails(tmp_path):
    p = tmp_path / "summary.json"
    atomic_write_json(p, {"a": 1})
    with pytest.raises(TypeError):
        atomic_write_json(p, {"a": object()})
    assert json.loads(p.read_text()) == {"a": 1}
    assert [f.name for f in tmp_path.iterdir()] == ["summary.json"]  # no temp files left


def test_metrics_jsonl_and_plot(tmp_path):
    run = RunDir(tmp_path / "r")
    for r in range(3):
        run.log_metrics({"round": r, "accuracy": 0.5 + 0.1 * r, "nan": float("nan")})
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [0, 1, 2]
    assert json.loads(lines[0])["nan"] is None  # NaN is written as null, valid JSON
    png = run.plot_accuracy()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _scalars(run_dir):
    """{tag: [(step, value), ...]} of the TensorBoard event files in run_dir, read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_are_the_logged_metrics(tmp_path):
    run = RunDir(tmp_path / "r", tensorboard=True)
    rows = [{"round": r, "accuracy": 0.5 + 0.1 * r, "domain_accuracy": {"photo": 0.25 * r}, "nan": float("nan"),
             "method": "fedavg"} for r in range(3)]
    for row in rows:
        run.log_metrics(row)
    run.log_metrics({"phase": "final", "accuracy": 0.75, "num_synthetic": 40})
    run.close()
    got = _scalars(tmp_path / "r")
    assert set(got) == {"accuracy", "domain_accuracy/photo", "final/accuracy", "final/num_synthetic"}
    assert got["accuracy"] == [(r, pytest.approx(0.5 + 0.1 * r)) for r in range(3)]
    assert got["domain_accuracy/photo"] == [(r, pytest.approx(0.25 * r)) for r in range(3)]
    assert got["final/accuracy"] == [(3, 0.75)] and got["final/num_synthetic"] == [(3, 40.0)]  # line 3 of metrics.jsonl


def test_tensorboard_is_off_by_default_and_a_resumed_run_replaces_the_dropped_rounds(tmp_path):
    plain = RunDir(tmp_path / "plain")
    plain.log_metrics({"round": 1, "accuracy": 0.5})
    assert [p.name for p in (tmp_path / "plain").iterdir()] == ["metrics.jsonl"]

    first = RunDir(tmp_path / "r", tensorboard=True)
    for r in range(4):
        first.log_metrics({"round": r, "accuracy": 0.1 * r})
    first.close()
    resumed = RunDir(tmp_path / "r", tensorboard=True)  # continued after round 1's checkpoint
    resumed.reload_metrics(lambda row: row["round"] <= 1)
    resumed.log_metrics({"round": 2, "accuracy": 0.9})
    resumed.close()
    assert _scalars(tmp_path / "r")["accuracy"] == [(0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(0.9))]


# ---- phases: a phase inside another is nested, not a second phase ---------------------------------------
class _SlowGrid:
    """A grid whose nodes answer nothing after 0.2 s (MeteredGrid records them as failed)."""

    def get_node_ids(self):
        return [1, 2]

    def send_and_receive(self, messages, *, timeout=None):
        import time

        time.sleep(0.2)
        return []


@pytest.mark.usefixtures("inside_a_run")
def test_a_message_phase_inside_a_server_phase_is_kept_under_it(tmp_path):
    """Espresso's ship-prior phase sends query.prior, which the grid times as a phase of its own: report.md
    and phases.png showed two 2.8 s phases. The inner one is `ship-prior/query.prior`, and the top-level
    phases add up to no more than the wall time."""
    from flwr.app import RecordDict

    from fedapp.config import all_defaults, parse_run_config
    from fedapp.server import MeteredGrid, ServerRun
    from fedapp.server.grid import make_messages

    run = ServerRun(cfg=parse_run_config(all_defaults()), out=RunDir(tmp_path / "r"))
    grid = MeteredGrid(_SlowGrid(), run)
    with run.phase("prior"):
        pass
    with run.phase("ship-prior", "ask 2 nodes"):
        grid.send_and_receive(make_messages([1, 2], "query.prior", lambda n: RecordDict()))
    grid.send_and_receive(make_messages([1, 2], "train", lambda n: RecordDict()))
    sec = run.total_phase_seconds()
    assert list(sec) == ["prior", "ship-prior", "ship-prior/query.prior", "train"]
    assert 0.2 <= sec["ship-prior/query.prior"] <= sec["ship-prior"]
    assert sum(v for k, v in sec.items() if "/" not in k) <= run.wall_seconds()
    assert [f["phase"] for f in run.failures] == ["query.prior"] * 2 + ["train"] * 2  # the message type, as before


def test_report_and_phase_plot_show_a_nested_phase_inside_its_outer_one(tmp_path, monkeypatch):
    from fedapp.report import phases_text
    from fedapp.results import phase_rows

    # as an earlier summary.json ordered them: the inner phase ends first
    sec = {"prior": 1.0, "ship-prior/query.prior": 2.8, "ship-prior": 2.85, "train": 61.0, "evaluate": 3.0}
    assert phases_text(sec) == ("prior 1.0 s, ship-prior 2.9 s (of which query.prior 2.8 s), train 61.0 s, "
                                "evaluate 3.0 s")
    assert phases_text({"a": 1.0, "a/b": 0.5, "a/b/c": 0.25}) == "a 1.0 s (of which b 0.5 s (of which c 0.2 s))"
    assert phase_rows(sec) == [(0, "prior", 1.0), (0, "ship-prior", 2.85), (1, "query.prior", 2.8),
                               (0, "train", 61.0), (0, "evaluate", 3.0)]
    drawn = {}

    def keep(self, fig, name):  # the figure's data, not its pixels
        ax = fig.axes[0]
        drawn.update(labels=[t.get_text() for t in ax.get_yticklabels()],
                     widths=[b.get_width() for b in ax.patches], wall=[line.get_xdata()[0] for line in ax.lines])
        return tmp_path / name

    monkeypatch.setattr(RunDir, "save_figure", keep)
    RunDir(tmp_path / "r").plot_phases(sec, wall=70.0)
    assert [t.strip() for t in drawn["labels"]] == ["prior", "ship-prior", "└ query.prior", "train", "evaluate"]
    assert drawn["labels"][2].startswith(" ") and not drawn["labels"][1].startswith(" ")  # indented below its outer
    assert drawn["widths"] == [1.0, 2.85, 2.8, 61.0, 3.0] and drawn["wall"] == [70.0]
    top = [w for w, label in zip(drawn["widths"], drawn["labels"]) if not label.startswith(" ")]
    assert sum(top) <= 70.0


def test_label_distribution_plot_counts_every_clients_images(tmp_path):
    from feddata import base_split, dataset_info, label_partitioner

    run = RunDir(tmp_path / "r")
    part = label_partitioner("digits", "dirichlet", {"alpha": 0.5, "per-class": 0}, 0, 5)  # whole shards
    png, counts = run.plot_label_distribution(part)
    assert png == tmp_path / "r" / "plots" / "label_distribution.png" and png.read_bytes()[:4] == b"\x89PNG"
    assert counts.shape == (5, 10) and list(counts.columns) == dataset_info("digits").class_names
    assert counts.to_numpy().sum() == len(base_split("digits")["pool"])


def _drawn_figure(monkeypatch, tmp_path) -> dict:
    """RunDir.save_figure replaced by one that keeps the figure's texts: its data, not its pixels."""
    drawn = {}

    def keep(self, fig, name):
        ax = fig.axes[0]
        drawn.update(title=ax.get_title(), xlabel=ax.get_xlabel(), xticks=[t.get_text() for t in ax.get_xticklabels()])
        return tmp_path / name

    monkeypatch.setattr(RunDir, "save_figure", keep)
    return drawn


def test_label_distribution_of_a_domain_split_names_each_clients_domain(tmp_path, monkeypatch):
    """Under the `domain` partitioner every client holds the same classes: four identical bars. What differs
    is the domain, so each bar says its client's."""
    from feddata import label_partitioner

    drawn = _drawn_figure(monkeypatch, tmp_path)
    part = label_partitioner("digit-styles", "domain", {"per-class": 4}, 0, 4)
    assert part.client_domains == ["photo", "sketch", "clipart", "quickdraw"]
    _, counts = RunDir(tmp_path / "r").plot_label_distribution(part)
    assert (counts.to_numpy() > 0).all()  # the same classes on every client
    assert drawn["xticks"] == ["0\nphoto", "1\nsketch", "2\nclipart", "3\nquickdraw"]
    assert "domain" in drawn["title"] and "domain" in drawn["xlabel"]
    # one domain for all (dirichlet-domain): the title says which; a split without domains: plain ids
    RunDir(tmp_path / "r").plot_label_distribution(label_partitioner("digit-styles", "dirichlet-domain",
                                                                     {"domain": "sketch", "alpha": 1.0}, 0, 3))
    assert drawn["xticks"] == ["0", "1", "2"] and "all of domain sketch" in drawn["title"]
    RunDir(tmp_path / "r").plot_label_distribution(label_partitioner("digits", "dirichlet", {"alpha": 0.5}, 0, 3))
    assert drawn["xticks"] == ["0", "1", "2"] and "domain" not in drawn["title"]


def test_class_grids_label_each_row_with_its_class_name(tmp_path):
    """Espresso's synthetic_client*.png (and the generation methods' grids): a row per class, named."""
    import numpy as np
    import torch
    from PIL import Image

    from fedapp.images import read_row_labels, save_class_grid

    x, y = torch.rand(12, 3, 16, 16) * 2 - 1, torch.tensor([0, 1, 2] * 4)
    names = ["zero", "one", "two"]
    drawn = save_class_grid(x, y, 3, tmp_path / "labelled.png", cols=4, class_names=names)
    assert drawn == names and read_row_labels(tmp_path / "labelled.png") == names
    assert save_class_grid(x, y, 3, tmp_path / "plain.png", cols=4) == []
    assert read_row_labels(tmp_path / "plain.png") == []
    with Image.open(tmp_path / "labelled.png") as a, Image.open(tmp_path / "plain.png") as b:
        labelled, plain = np.asarray(a.convert("RGB")), np.asarray(b.convert("RGB"))
    margin = labelled.shape[1] - plain.shape[1]
    assert labelled.shape[0] == plain.shape[0] and margin > 0  # a margin for the names, left of the images
    assert (labelled[:, :margin] < 128).any() and (labelled[:, :margin] == 255).mean() > 0.5  # dark text on white
    assert np.array_equal(labelled[:, margin:], plain)  # the images themselves unchanged
    with pytest.raises(ValueError, match="2 class names for 3 classes"):
        save_class_grid(x, y, 3, tmp_path / "bad.png", class_names=names[:2])


def test_result_files_are_readable_by_the_group(tmp_path):
    """Atomic writes go through mkstemp (mode 0600); the result must get a plain file's mode instead."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        atomic_write_json(tmp_path / "summary.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "summary.json").stat().st_mode) == 0o644


def test_every_run_folder_gets_plots_and_a_report(tmp_path):
    """run_server writes plots/phases.png and report.md; the report quotes the summary's figures."""
    from fedapp.report import render
    from fedapp.simulation import simulate_in_process

    s = simulate_in_process({"method": "fedavg", "dataset": "digits", "partitioner.name": "iid",
                             "partitioner.per-class": 5, "num-server-rounds": 1, "local-epochs": 1,
                             "min-clients": 2, "out-dir": str(tmp_path), "run-name": "r", "log.tensorboard": True}, 2)
    run = tmp_path / "r"
    for png in ("phases.png", "label_distribution.png"):
        assert (run / "plots" / png).read_bytes()[:4] == b"\x89PNG"
    rounds = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert _scalars(run)["accuracy"] == [(r["round"], pytest.approx(r["accuracy"])) for r in rounds]
    page = (run / "report.md").read_text()
    assert page == render(run) and "status: **completed**" in page
    assert f"{s['metrics']['accuracy']:.4g}" in page and "![plots/phases.png](plots/phases.png)" in page
    assert "## Failures\n\nnone" in page
