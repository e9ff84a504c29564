"""Results that survive a stop: checkpoints and the final model in safetensors, a round-based run
resumed from its folder to the same final accuracy as an uninterrupted one, status "interrupted"; PFDM's
table cells continued mid-training from their train states to the weights of an uninterrupted run."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import Error, Message

from fedapp.config import ConfigError
from fedapp.protocols import ROUND_KEY, RUN_KEY
from fedapp.server.checkpoint import CHECKPOINT_META, FINAL_MODEL, load_checkpoint
from fedapp.simulation import InProcessGrid, resolve_run_config, simulate_in_process

CFG = {"method": "fedavg", "dataset": "digits", "partitioner.name": "iid", "partitioner.per-class": 10,
       "num-server-rounds": 3, "local-epochs": 1, "min-clients": 3}


class _DiesInRound(InProcessGrid):
    """Every client fails the train message of one round, as if the federation went down."""

    def __init__(self, n, dead_round):
        super().__init__(n)
        self.dead_round = dead_round

    def deliver(self, msg):
        if msg.metadata.message_type == "train" and msg.content.config_records[RUN_KEY][ROUND_KEY] == self.dead_round:
            return Message(Error(code=0, reason="node went down"), reply_to=msg)
        return super().deliver(msg)


def test_a_stopped_run_resumes_to_the_same_final_accuracy(tmp_path):
    from fedapp.server_app import run_server

    whole = simulate_in_process({**CFG, "out-dir": str(tmp_path), "run-name": "whole"}, 3)
    flat, run_dir = resolve_run_config({**CFG, "out-dir": str(tmp_path), "run-name": "stopped"}, 3)
    with pytest.raises(RuntimeError, match="min-clients"):
        run_server(_DiesInRound(3, dead_round=3), flat)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"
    assert json.loads((run_dir / CHECKPOINT_META).read_text())["round"] == 2

    resumed = simulate_in_process({**CFG, "out-dir": str(tmp_path), "resume": str(run_dir)}, 3)
    assert resumed["status"] == "completed" and resumed["resumed_after_round"] == 2
    assert resumed["metrics"]["accuracy"] == whole["metrics"]["accuracy"]
    rounds = [json.loads(line)["round"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2, 3]  # the stopped run's rounds, then the resumed one's, nothing twice
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "whole" / FINAL_MODEL)), load_file(str(run_dir / FINAL_MODEL))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert load_checkpoint(run_dir).round == 3


def test_resume_refuses_another_config_or_method(tmp_path):
    done = simulate_in_process({**CFG, "num-server-rounds": 1, "out-dir": str(tmp_path), "run-name": "r"}, 3)
    folder = done["run_dir"]
    with pytest.raises(ConfigError, match=r"^resume=.*: the run config differs in lr \(0.5 here, 0.02 in the run\)"):
        resolve_run_config({**CFG, "num-server-rounds": 1, "lr": 0.5, "resume": folder}, 3)
    # logging may change
    resolve_run_config({**CFG, "num-server-rounds": 1, "log.tensorboard": True, "resume": folder}, 3)
    with pytest.raises(ConfigError, match=r"method='espresso' is not resumable"):
        resolve_run_config({"method": "espresso", "resume": folder}, 3)
    with pytest.raises(ConfigError, match=r"not a run folder with config.json and a checkpoint"):
        resolve_run_config({**CFG, "resume": str(tmp_path)}, 3)
    with pytest.raises(ConfigError, match=r"method='centralized' is not resumable; allowed for the resumable "
                                          r"methods \(fedavg, fedprox, feddifrc\)"):  # one-shot: no checkpoint
        resolve_run_config({**CFG, "method": "centralized", "resume": folder}, 3)
    # a run folder written when config.json listed every method's keys resumes too: they are not this run's
    from pathlib import Path

    from fedapp.config import all_defaults

    config = Path(folder) / "config.json"
    every = {k: v for k, v in all_defaults().items() if "." in k and not k.startswith("partitioner.")}
    config.write_text(json.dumps({**every, **json.loads(config.read_text())}))
    resolve_run_config({**CFG, "num-server-rounds": 1, "resume": folder}, 3)
    # a run saved before a key existed resumes where this run leaves the key at its default, not elsewhere
    recorded = json.loads(config.read_text())
    config.write_text(json.dumps({k: v for k, v in recorded.items() if k != "classifier-size"}))
    resolve_run_config({**CFG, "num-server-rounds": 1, "resume": folder}, 3)
    size = recorded["image-size"]
    with pytest.raises(ConfigError, match=rf"differs in classifier-size \({size + 4} here, {size} in the run\)"):
        resolve_run_config({**CFG, "num-server-rounds": 1, "classifier-size": size + 4, "resume": folder}, 3)


def test_an_interrupted_run_says_so(tmp_path):
    from fedapp.server_app import run_server

    class _CtrlC(InProcessGrid):
        def deliver(self, msg):
            raise KeyboardInterrupt

    flat, run_dir = resolve_run_config({**CFG, "out-dir": str(tmp_path), "run-name": "i"}, 3)
    with pytest.raises(KeyboardInterrupt):
        run_server(_CtrlC(3), flat)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["error"] == "KeyboardInterrupt"


def test_a_stopped_table_cell_continues_and_its_summary_counts_the_whole_run(tmp_path):
    """experiments.common.run on a config whose run stopped after round 2 (its federation went down in round 3)
    continues it from the checkpoint, to the accuracy and the per-client bytes and messages of a run that was
    never stopped: the checkpoint keeps what the run had spent (ServerRun.progress), the resumed summary adds it."""
    from experiments.common import run, stopped_run
    from fedapp.server_app import run_server

    cfg = {**CFG, "fraction-evaluate": 0.0, "out-dir": str(tmp_path)}  # the tables': no client evaluation
    whole = simulate_in_process({**cfg, "run-name": "whole"}, 3)
    flat, run_dir = resolve_run_config({**cfg, "run-name": "cell"}, 3)
    assert stopped_run(flat, 3) is None  # nothing to continue yet
    with pytest.raises(RuntimeError, match="min-clients"):
        run_server(_DiesInRound(3, dead_round=3), flat)
    kept = json.loads((run_dir / CHECKPOINT_META).read_text())
    assert kept["round"] == 2 and {c["messages_up"] for c in kept["progress"]["per_client"].values()} == {2}
    assert stopped_run(flat, 3) == str(run_dir)
    assert stopped_run({**flat, "lr": 0.5}, 3) is None  # another config starts over

    resumed = run(flat, 3, "inprocess")
    assert resumed["resumed_after_round"] == 2 and resumed["metrics"]["accuracy"] == whole["metrics"]["accuracy"]
    got, want = resumed["comm"]["per_client"], whole["comm"]["per_client"]
    assert got.keys() == want.keys() and resumed["comm"]["up_bytes"] == whole["comm"]["up_bytes"]
    for c in want:  # both parts: 3 train messages each way per client, the same bytes up
        assert (got[c]["messages_up"], got[c]["messages_down"], got[c]["up_bytes"]) == (3, 3, want[c]["up_bytes"])
        # down: the resumed round's message also carries `resume` (the folder's path) in its run config
        assert 0 < got[c]["down_bytes"] - want[c]["down_bytes"] < 2 * len(str(run_dir)) + 64
    assert set(resumed["phase_seconds"]) == set(whole["phase_seconds"])
    assert resumed["wall_seconds"] >= kept["progress"]["wall_seconds"]
    assert stopped_run(flat, 3) is None  # completed: a rerun starts over


# ---- PFDM's table cells: a denoiser stopped mid-training continues from its train state ----------------------
class _Stop(BaseException):
    """A stop right after a train state was written (as a kill, it is no Exception: nothing catches it)."""


class _Stopper:
    """Stops a run once, right after train state `name` was saved at `step` (`arm`), and records which train
    states each run continued rather than trained from step 0 (`restored`: name -> the step it went on from)."""

    def __init__(self, monkeypatch):
        from fedapp.models.checkpoints import TrainState

        save, restore = TrainState.save, TrainState.restore
        self.at: tuple[str, int] | None = None
        self.restored: dict[str, int] = {}

        def saving(state, k, *args):
            save(state, k, *args)
            if (state.signature["name"], k) == self.at:
                self.at = None
                raise _Stop

        def restoring(state, *args):
            k = restore(state, *args)
            if k:
                self.restored[state.signature["name"]] = k
            return k

        monkeypatch.setattr(TrainState, "save", saving)
        monkeypatch.setattr(TrainState, "restore", restoring)

    def arm(self, name: str, step: int) -> None:
        self.at, self.restored = (name, step), {}


def _cell_args(runs):
    from experiments.pfdm import parser

    return parser().parse_args(["--clients", "2", "--steps", "6", "--samples", "10", "--sample-steps", "2",
                                "--attack-samples", "10", "--runs", str(runs), "--set", "pfdm.ref-epochs=1",
                                "pfdm.batch=16", "pfdm.checkpoint-every=2"])


@pytest.mark.parametrize("method, stops", [
    # the oracle (18 steps at 2 clients), stopped at step 6; what the rerun continued
    ("centralized-ddpm", [(("centralized-ddpm", 6), {"centralized-ddpm": 6})]),
    # pfdm stopped in z_w's training (after every upload), then again in client 1's reference model (the
    # samples' phase); each rerun continues every finished denoiser from its final state, the cut one from its step
    ("pfdm", [(("shared", 4), {"client0-private": 6, "client1-private": 6, "shared": 4}),
              (("client1-reference", 2), {"client0-private": 6, "client1-private": 6, "shared": 6,
                                          "client0-reference": 6, "client1-reference": 2})]),
])
def test_a_table_cell_stopped_mid_training_ends_as_an_uninterrupted_one(tmp_path, monkeypatch, method, stops):
    """experiments.pfdm.run_one stopped right after a denoiser's mid-training state was written, then run again
    (as a rerun of the table does): the cell continues in its own folder, every finished denoiser from its final
    state and the cut one from its step (restored, not retrained), to the released weights and every figure of
    an uninterrupted run, bit for bit; the finished run keeps no train state. The upload noise is the OS's
    (stubbed here by a counter, so that two runs can agree): the resumed clients send the uploads they drew
    before the stop again, with no second draw."""
    import itertools
    from pathlib import Path

    import numpy as np
    from safetensors.torch import load_file

    import fedapp.privacy
    from experiments.pfdm import run_one
    from fedapp.models.checkpoints import STATE_DIR
    from fedapp.server.checkpoint import FINAL_MODEL

    draws = []

    def counted():  # each upload's "OS" generator: the next of a sequence, so a second draw differs
        draws.append(1)
        return np.random.default_rng(next(seq))

    monkeypatch.setattr(fedapp.privacy, "os_generator", counted)
    seq = itertools.count()
    whole = run_one(_cell_args(tmp_path / "whole"), method, 2, 10.0, 0)
    assert len(draws) == (2 if method == "pfdm" else 0)

    seq, stopper, continued, drawn = itertools.count(), _Stopper(monkeypatch), None, 0  # the first draws: the same
    for i, (stop, then) in enumerate(stops):
        stopper.arm(*stop)
        with pytest.raises(_Stop):
            run_one(_cell_args(tmp_path / "cut"), method, 2, 10.0, 0)
        folder = next((tmp_path / "cut").iterdir())
        assert json.loads((folder / "summary.json").read_text())["status"] == "interrupted"
        assert i == 0 or stopper.restored == continued  # what the stop before this one left, continued
        continued, drawn = then, (len(draws) if i == 0 else drawn)  # the uploads drawn before the first stop
    stopper.restored = {}
    resumed = run_one(_cell_args(tmp_path / "cut"), method, 2, 10.0, 0)

    assert stopper.restored == continued  # resumed mid-cell: nothing finished was trained again
    assert len(draws) == drawn  # the resumed clients drew no new upload noise
    assert resumed["continued"] and not whole["continued"] and resumed["run_dir"] == str(folder)
    skip = ("wall_seconds", "run_dir", "continued")
    assert json.dumps({k: v for k, v in resumed.items() if k not in skip}, sort_keys=True) == \
        json.dumps({k: v for k, v in whole.items() if k not in skip}, sort_keys=True)
    a, b = load_file(str(folder / FINAL_MODEL)), load_file(str(Path(whole["run_dir"]) / FINAL_MODEL))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (folder / STATE_DIR).exists()


def test_a_train_state_saved_every_n_steps_brings_back_the_global_rngs_but_never_the_upload_noise(tmp_path):
    """TrainState(every=3) saves at steps 3, 6, 9 and the last; a run cut after step 6's save and continued in a
    process whose global RNGs were elsewhere ends with the uninterrupted run's weights and global RNG states
    (torch, numpy, python). DP noise is the OS's: restoring those states twice gives two different uploads."""
    import random

    import numpy as np

    from clients.pfdm import make_upload
    from fedapp.models.checkpoints import TrainState, rng_states, set_rng_states
    from fedapp.models.ddpm import DDPM, train_ddpm

    x, y = torch.randn(24, 3, 8, 8), torch.arange(24) % 3

    def fresh():
        torch.manual_seed(0)
        model = DDPM(image_size=8, num_classes=3, block_out_channels=(8, 16), attention=False)
        np.random.seed(1)
        random.seed(1)
        return model

    def global_draws():
        return torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random()

    whole = fresh()
    train_ddpm(whole, x, y, steps=10, batch=8, ema=0.9)
    after_whole = global_draws()

    state, saved = TrainState(tmp_path / "s.pt", {"name": "t"}, every=3), []
    save = state.save

    def saving(k, *args):  # a kill right after step 6's state is on disk
        save(k, *args)
        saved.append(k)
        if k == 6 and saved.count(6) == 1:
            raise _Stop

    state.save = saving
    with pytest.raises(_Stop):
        train_ddpm(fresh(), x, y, steps=10, batch=8, ema=0.9, state=state)
    resumed = fresh()
    torch.manual_seed(99), np.random.seed(99), random.seed(99)  # another process: its RNGs elsewhere
    train_ddpm(resumed, x, y, steps=10, batch=8, ema=0.9, state=state)
    assert saved == [3, 6, 9, 10]
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))
    assert global_draws() == after_whole

    rngs = rng_states()
    set_rng_states(rngs)
    up1, _ = make_upload(x, y, 10.0, 693)
    set_rng_states(rngs)
    up2, _ = make_upload(x, y, 10.0, 693)
    assert not torch.equal(up1, up2)


def test_two_table_runners_on_disjoint_seeds_keep_each_others_cells(tmp_path, monkeypatch):
    """Two `python -m experiments pfdm` runners share one json: while one trains seed 0, the other finishes
    seed 1; the first's next write keeps the other's cell (the json is merged under its lock), and a rerun
    of either skips both."""
    import experiments.pfdm as X

    ran = []

    def cell(args, method, clients, epsilon, seed):  # a finished cell, instantly; seed 0's lets seed 1 finish
        ran.append(seed)
        if seed == 0 and ran.count(0) == 1:
            X.main(argv("1"))
        return {"method": method, "clients": clients, "epsilon": X.eps_key(epsilon), "seed": seed,
                "run_dir": str(tmp_path / f"s{seed}"), "wall_seconds": 1.0, "sample_accuracy": 0.5 + seed / 10}

    def argv(seeds):
        return ["--methods", "local-only", "--scaling", "", "--seeds", seeds, "--out", str(tmp_path),
                "--runs", str(tmp_path / "runs")]

    monkeypatch.setattr(X, "run_one", cell)
    X.main(argv("0"))
    runs = json.loads((tmp_path / "pfdm.json").read_text())["runs"]
    assert sorted(r["seed"] for r in runs) == [0, 1]
    assert json.loads((tmp_path / "pfdm.json").read_text())["table"][0]["seeds"] == [0, 1]
    X.main(argv("0,1"))
    assert ran == [0, 1]  # nothing ran twice


def test_a_named_runs_train_states_follow_its_config_and_a_stale_one_starts_over(tmp_path, caplog):
    """run_train_state: only a named run with pfdm.checkpoint-every > 0 keeps train states, under
    <out-dir>/<run-name>/train_state; a key written at its default signs as if left out (a key added later at its
    default keeps old states usable), where it writes and how often it saves do not count, any other value does.
    A state or kept upload saved for another config is started over (removed, a warning), never an error."""
    from fedapp.config import parse_run_config
    from fedapp.models.checkpoints import kept_tensors, run_train_state, state_signature
    from fedapp.models.ddpm import DDPM, train_ddpm

    base = {"method": "pfdm", "out-dir": str(tmp_path), "run-name": "cell", "pfdm.local-steps": 4}
    cfg = parse_run_config(base)
    assert run_train_state(parse_run_config({**base, "run-name": ""}), "a") is None
    assert run_train_state(parse_run_config({**base, "pfdm.checkpoint-every": 0}), "a") is None
    state = run_train_state(cfg, "client0-private")
    assert state.path == tmp_path / "cell" / "train_state" / "client0-private.pt" and state.every == 200
    same = ({"pfdm.ema": 0.0}, {"out-dir": str(tmp_path / "moved")}, {"pfdm.checkpoint-every": 7}, {"device": "cpu"})
    for extra in same:
        assert state_signature(parse_run_config({**base, **extra}), "x") == state_signature(cfg, "x"), extra
    other = parse_run_config({**base, "pfdm.ema": 0.5})
    assert state_signature(other, "x") != state_signature(cfg, "x")

    x, y = torch.randn(16, 3, 8, 8), torch.arange(16) % 2
    torch.manual_seed(0)
    train_ddpm(DDPM(image_size=8, num_classes=2, block_out_channels=(8, 16), attention=False), x, y, steps=4,
               batch=8, state=state)
    assert state.saved_step() == 4
    stale = run_train_state(other, "client0-private")
    with caplog.at_level("WARNING", logger="fedapp"):
        assert stale.saved_step() == 0 and not stale.path.exists()
    assert "starting it over" in caplog.text

    up = kept_tensors(cfg, "client0-upload", lambda: {"x": torch.ones(2)})
    assert torch.equal(kept_tensors(cfg, "client0-upload", lambda: {"x": torch.zeros(2)})["x"], up["x"])
    assert torch.equal(kept_tensors(other, "client0-upload", lambda: {"x": torch.zeros(2)})["x"], torch.zeros(2))
