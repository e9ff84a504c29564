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
                             "min-clients": 2, "out-dir": str(tmp_path), "run-name": "r"}, 2)
    run = tmp_path / "r"
    assert (run / "plots" / "phases.png").read_bytes()[:4] == b"\x89PNG"
    page = (run / "report.md").read_text()
    assert page == render(run) and "status: **completed**" in page
    assert f"{s['metrics']['accuracy']:.4g}" in page and "![plots/phases.png](plots/phases.png)" in page
    assert "## Failures\n\nnone" in page
