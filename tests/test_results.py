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


def test_label_distribution_plot_counts_every_clients_images(tmp_path):
    from feddata import base_split, dataset_info, label_partitioner

    run = RunDir(tmp_path / "r")
    png, counts = run.plot_label_distribution(label_partitioner("digits", "dirichlet", {"alpha": 0.5}, 0, 5))
    assert png == tmp_path / "r" / "plots" / "label_distribution.png" and png.read_bytes()[:4] == b"\x89PNG"
    assert counts.shape == (5, 10) and list(counts.columns) == dataset_info("digits").class_names
    assert counts.to_numpy().sum() == len(base_split("digits")["pool"])


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
