"""DCFM's protocol (ICML 2026) and its composition baselines' (fedflow, ddm, local-only-flow).

    train          down: PHASE_KEY {lambda, steps} (+ ARRAYS_KEY: the global model, fedflow's rounds)
                   up:   EXPERT_KEY (the velocity net), COUNTS_KEY {pairs: n_a(y_1, y_2)}, metrics
    query.peer     variant A's allgather: down "peer.<pid>" experts + "peer-counts.<pid>" counts of the
                   N - 1 peers; up: the client's expert after L_peerCI training, its counts, metrics
    query.receive  the result goes back: variant B's student (ARRAYS_KEY), or ddm's router (ROUTER_KEY)
                   and the N - 1 peers; up: metrics (received)
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.app import ConfigRecord, RecordDict

from fedapp.options import ConfigError, opt
import numpy as np

from fedapp.protocols import ARRAYS_KEY, METRICS_KEY, NUM_EXAMPLES_KEY, Phase, ShardFacts
from fedapp.protocols.records import check_arrays, check_at_most

ATTRS = ("digit", "color")  # the two attributes y = (y_1, y_2) of the composition data
EXPERT_KEY = "expert"  # ArrayRecord: a velocity net's state dict
COUNTS_KEY = "counts"  # ArrayRecord {PAIRS: (|Y_1|, |Y_2|) int64}: the client's label counts per pair
PAIRS = "pairs"
ARRAY_NAMES = (PAIRS,)  # names inside its ArrayRecords (a state dict's keys aside): spelled here only
PEER_PREFIX = "peer."  # ArrayRecords "peer.<pid>" (allgather)
PEER_COUNTS_PREFIX = "peer-counts."  # ArrayRecords "peer-counts.<pid>"
PHASE_KEY = "dcfm-phase"  # ConfigRecord {LAMBDA, STEPS}: per-phase settings beside the run config
LAMBDA, STEPS = "lambda", "steps"
ROUTER_KEY = "router"  # ArrayRecord: ddm's router
RECEIVED = "received"  # query.receive metric
STATE_EXPERT = "dcfm-expert"  # node state: the client's own expert between rounds
STATE_STUDENT = "dcfm-student"  # node state: variant B's student once received

TRAIN_FM, TRAIN_CI = "train_fm", "train_ci"  # train metrics: mean L_FM and CI penalty over the local steps
EXPERT_METRICS = (NUM_EXAMPLES_KEY, TRAIN_FM, TRAIN_CI)


def attribute_sizes(info) -> list[int]:
    """|Y_1|, |Y_2|: how many values each of ATTRS takes in a dataset (its DatasetInfo); the velocity net's
    label-embedding sizes, so the server and every client build the same net."""
    return [len(info.attributes[a]) for a in ATTRS]


def within_shard(content: RecordDict, facts: ShardFacts) -> str | None:
    """Pair counts n_a(y_1, y_2) at most the shard's (they weight the server's mixture of experts),
    summing to num-examples (FedFlow's averaging weight)."""
    pairs = content.array_records[COUNTS_KEY][PAIRS].numpy()
    a, b = ATTRS
    if a not in facts.attrs or b not in facts.attrs:
        return f"the data has no {a!r}/{b!r} attributes to count pairs of"
    shard = np.zeros((facts.attr_sizes[a], facts.attr_sizes[b]), dtype=np.int64)
    np.add.at(shard, (facts.attrs[a], facts.attrs[b]), 1)
    why = check_at_most("pair counts", pairs, shard)
    n = content.metric_records[METRICS_KEY][NUM_EXAMPLES_KEY]
    if why is None and int(pairs.sum()) != n:
        why = f"pair counts sum to {int(pairs.sum())} but {NUM_EXAMPLES_KEY}={n!r}"
    return why


TRAIN = Phase("train", down=(PHASE_KEY, ARRAYS_KEY), up=(EXPERT_KEY, COUNTS_KEY, METRICS_KEY),
              doc="Stage I expert (L_FM + lambda L_CI) or one fedflow local round from the global model",
              metrics=EXPERT_METRICS, bound=within_shard)
PEER = Phase("query.peer", down=(PEER_PREFIX, PEER_COUNTS_PREFIX), up=(EXPERT_KEY, COUNTS_KEY, METRICS_KEY),
             doc="variant A: the expert trained with L_peerCI against the frozen peers",
             metrics=EXPERT_METRICS, bound=within_shard)
RECEIVE = Phase("query.receive", down=(ARRAYS_KEY, ROUTER_KEY, PEER_PREFIX), up=(METRICS_KEY,),
                doc="the generator goes back to the clients", metrics=(RECEIVED,))
PHASES = (TRAIN, PEER, RECEIVE)


@dataclass(frozen=True)
class DcfmOptions:
    variant: str = opt("b", choices=("a", "b"), help="a: peer-CI allgather rounds; b: distil one student")
    pi_full: float = opt(1.0, low=0.0, help="pi_full: probability of the full label y in the mask m (eq. 8); "
                                             "Stage I, variant A and B's student alike")
    pi_marg: float = opt(0.0, low=0.0, help="pi_marg: probability of one attribute y_i alone")
    pi_uncond: float = opt(0.0, low=0.0, help="pi_uncond: probability of no label")
    lambda_ci: float = opt(1.0, low=0.0, help="lambda of L_CI (eq. 11), L_peerCI (A) and L_studentCI (B, eq. 17)")
    ci_batch: int = opt(0, low=0, help="samples of each minibatch the CI terms (L_CI, L_peerCI, L_studentCI) are "
                                       "estimated on; 0: all of them (each CI term costs 3-4 forward passes a "
                                       "sample where L_FM costs one)")
    rounds: int = opt(2, low=1, help="R: peer-CI allgather rounds of variant A (paper ~2)")
    peer_schedule: str = opt("sequential", choices=("allgather", "sequential"),
                             help="variant A: a round retrains all experts at once against the round's start "
                                  "(the paper), or one after another against the peers already retrained")
    routes_per_batch: int = opt(1, low=1, help="variant A: routing vectors r per minibatch (each on its own "
                                               "slice of the batch)")
    route_mask: bool = opt(True, help="route only to experts that have seen the requested value (peer-CI "
                                      "training, A's sampler, B's teacher); false: uniform routes")
    a_sampler: str = opt("expected", choices=("expected", "routed"),
                         help="variant A's sampler: the composite over all experts with the routing vector in "
                              "expectation, or one routing vector per sample drawn from the same weights and "
                              "kept along its trajectory (the z^(r) that L_peerCI trains)")
    local_steps: int = opt(300, low=1, help="Stage I Adam steps per client (also DDM / local-only experts)")
    peer_steps: int = opt(100, low=1, help="variant A: Adam steps per client per round")
    distill_steps: int = opt(300, low=1, help="variant B: Adam steps of the student on the server")
    replay: str = opt("teacher", choices=("teacher", "composite"),
                      help="variant B: replay paths follow one frozen teacher's joint field each, or the "
                           "routed composite over all experts")
    replay_paths: int = opt(256, low=1, help="variant B: synthetic replay paths (ODE trajectories)")
    path_steps: int = opt(8, low=1, help="variant B: Euler steps of each replay path (states kept per path)")
    sample_steps: int = opt(16, low=1, help="Euler steps of every sampler")
    samples_per_pair: int = opt(12, low=2, help="evaluation: samples per (digit, colour) pair")
    lr: float = opt(2e-3, low=0.0, low_open=True, help="AdamW learning rate of experts, student, FedFlow")
    width: int = opt(32, low=8, help="velocity UNet channels (width, 2 width)")
    label_embedding: str = opt("sum", choices=("sum", "joint"),
                               help="the velocity net's label embedding: sum, one learned vector per attribute "
                                    "value summed; joint, one vector per (digit, colour) tuple, none shared "
                                    "(an ablation: a pair no client holds keeps its random vector)")
    fl_local_steps: int = opt(20, low=1, help="fedflow: local steps per round (rounds = num-server-rounds)")
    router_steps: int = opt(200, low=1, help="ddm: Adam steps of the router (x_t, t) -> expert")
    ddm_ci: bool = opt(False, help="ddm: its experts train with L_CI at dcfm.lambda-ci, DCFM's Stage I (the paper's "
                                   "DDM+L); false: plain masked L_FM")
    ref_epochs: int = opt(8, low=1, help="epochs of the reference classifiers (digit, colour) on real data")

    def __post_init__(self) -> None:
        total = self.pi_full + self.pi_marg + self.pi_uncond
        if abs(total - 1.0) > 1e-6:  # the mask's distribution (eq. 8): never silently renormalised
            raise ConfigError(f"dcfm.pi-full + dcfm.pi-marg + dcfm.pi-uncond = {total:g} "
                              f"({self.pi_full:g} + {self.pi_marg:g} + {self.pi_uncond:g}): must sum to 1, "
                              "the probabilities of the full label, one attribute and none")

    @property
    def pi(self) -> tuple[float, float, float]:
        return self.pi_full, self.pi_marg, self.pi_uncond


def phase_record(lambda_ci: float, steps: int | None = None) -> ConfigRecord:
    """PHASE_KEY of a train message: lambda of L_CI (0: plain masked L_FM) and, for FedFlow's rounds,
    the local steps (without it the client runs dcfm.local-steps)."""
    rec = ConfigRecord({LAMBDA: float(lambda_ci)})
    if steps is not None:
        rec[STEPS] = steps
    return rec


def validate_expert(content: RecordDict, expected: dict[str, tuple], sizes: list[int],
                    max_bytes: float | None, dtypes: dict[str, str] | None = None) -> str | None:
    """An expert upload: the velocity net's exact keys/shapes (and, with `dtypes`, dtypes; finite), and
    integer, non-negative, non-empty pair counts of shape (|Y_1|, |Y_2|)."""
    why = check_arrays(content.array_records.get(EXPERT_KEY), expected, max_bytes, dtypes)
    if why is not None:
        return why
    why = check_arrays(content.array_records.get(COUNTS_KEY), {PAIRS: tuple(sizes)})
    if why is not None:
        return f"counts: {why}"
    c = content.array_records[COUNTS_KEY][PAIRS].numpy()
    if c.dtype.kind not in "iu" or (c < 0).any() or c.sum() == 0:
        return "counts: not non-negative integers, or all zero"
    return None
