"""DCFM (ICML 2026) and its flow baselines: masks, L_CI, L_peerCI stop-gradient, the 2-D toy, and
end-to-end simulations with their model-transfer counts."""

import pytest
import torch

from clients.dcfm import train_expert
from fedapp.models.compose import (ci_penalty, composite, mask_labels, mixture_composite, peer_ci_errors,
                                   peer_ci_penalty, route_valid, sample_route)
from fedapp.models.flow import VectorVelocityNet
from warning_policy import GC_OF_EARLIER_LEAKS


def test_masks_follow_their_probabilities():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 5, (40000, 2), generator=g)
    m = mask_labels(y, 0.5, 0.3, 0.2, generator=g)
    kept = (m >= 0).sum(1)
    assert abs((kept == 2).float().mean().item() - 0.5) < 0.015
    assert abs((kept == 1).float().mean().item() - 0.3) < 0.015
    assert abs((kept == 0).float().mean().item() - 0.2) < 0.015
    one = m[kept == 1]
    assert abs((one[:, 0] >= 0).float().mean().item() - 0.5) < 0.03  # the kept attribute is uniform
    assert torch.equal(m[m >= 0], y[m >= 0])  # kept entries are the labels themselves


class Additive(torch.nn.Module):
    """v(x, t, y) = a(t) x + sum_i g_i(y_i), g_i(null) = 0: additive in the attributes."""

    def __init__(self, nonadditive: float = 0.0):
        super().__init__()
        self.g = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(5, 2)) for _ in range(2)])
        self.c = nonadditive

    def forward(self, x, t, y):
        out = (1 - t)[:, None] * x
        for i, g in enumerate(self.g):
            out = out + torch.where((y[:, i] >= 0)[:, None], g[y[:, i].clamp(min=0)], torch.zeros(1, 2))
        both = ((y >= 0).all(1)).float()[:, None]
        return out + self.c * both * x.pow(2)  # an interaction term only under the joint label


def test_ci_penalty_is_zero_for_an_additive_field_and_positive_otherwise():
    torch.manual_seed(0)
    x, t, y = torch.randn(64, 2), torch.rand(64), torch.randint(0, 5, (64, 2))
    assert ci_penalty(Additive(), x, t, y).item() < 1e-10
    assert ci_penalty(Additive(nonadditive=1.0), x, t, y).item() > 1e-2
    v0, v1, v2 = torch.zeros(3, 2), torch.ones(3, 2), 2 * torch.ones(3, 2)
    assert torch.allclose(composite(v0, [v1, v2]), 3 * torch.ones(3, 2))  # eq. 5 with w_i = 1


def test_routes_always_include_the_local_expert():
    g = torch.Generator().manual_seed(0)
    routes = [sample_route(5, 2, 3, g) for _ in range(500)]
    assert all(3 in r and len(r) == 3 for r in routes)
    assert {r[0] for r in routes} == set(range(5))  # peers do get routed


def test_peers_receive_no_gradient_in_variant_a():
    torch.manual_seed(0)
    own = VectorVelocityNet(dim=2, attribute_sizes=[2, 2], hidden=32)
    peer = VectorVelocityNet(dim=2, attribute_sizes=[2, 2], hidden=32)  # deliberately left trainable
    x, t, y = torch.randn(16, 2), torch.rand(16), torch.randint(0, 2, (16, 2))
    loss = peer_ci_penalty(own, {1: peer}, 0, x, t, y, routes=[[1, 0, 1]])
    loss.backward()
    assert all(p.grad is None for p in peer.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in own.parameters())
    counts = {1: torch.tensor([[3, 0], [0, 0]])}  # peer 1 has seen only (0, 0)
    valid = route_valid([0, 0, 1], torch.tensor([[0, 0], [1, 1]]), counts)
    assert valid.tolist() == [1.0, 0.0]


def test_several_routes_score_each_slice_of_the_batch_under_its_own_route():
    torch.manual_seed(0)
    own, peer = (VectorVelocityNet(dim=2, attribute_sizes=[2, 2], hidden=32) for _ in range(2))
    x, t, y = torch.randn(8, 2), torch.rand(8), torch.randint(0, 2, (8, 2))
    routes = [[1, 0, 1], [0, 0, 0]]
    want = torch.cat([peer_ci_errors(own, {1: peer}, 0, x[:4], t[:4], y[:4], routes[0]),
                      peer_ci_errors(own, {1: peer}, 0, x[4:], t[4:], y[4:], routes[1])]).mean()
    got = peer_ci_penalty(own, {1: peer}, 0, x, t, y, routes)
    assert torch.allclose(got, want)
    assert not torch.allclose(got, peer_ci_penalty(own, {1: peer}, 0, x, t, y, [routes[0]]))
    # route-mask: a sample routed to a peer that never saw its value drops out; without counts it stays
    y = torch.tensor([[0, 0], [1, 1]])
    x, t = x[:2], t[:2]
    counts = {1: torch.tensor([[3, 0], [0, 0]])}
    masked = peer_ci_penalty(own, {1: peer}, 0, x, t, y, [[0, 0, 1]], counts)
    assert torch.allclose(masked, peer_ci_errors(own, {1: peer}, 0, x[:1], t[:1], y[:1], [0, 0, 1]).mean())
    assert torch.allclose(peer_ci_penalty(own, {1: peer}, 0, x, t, y, [[0, 0, 1]]),
                          peer_ci_errors(own, {1: peer}, 0, x, t, y, [0, 0, 1]).mean())


class Constant(torch.nn.Module):
    """v(x, t, y) = a table entry per query: base (no label), + 10 y_1 + 1 for attribute 1, + 100 for 2."""

    def __init__(self, base: float):
        super().__init__()
        self.base = base

    def forward(self, x, t, y):
        out = torch.full((len(x),), self.base)
        out = out + torch.where(y[:, 0] >= 0, 10.0 * y[:, 0] + 1, 0.0) + torch.where(y[:, 1] >= 0, 100.0, 0.0)
        return out[:, None].expand(-1, 2)


def test_mixture_composite_routes_by_counts_or_uniformly():
    experts = [Constant(0.0), Constant(4.0)]
    counts = [torch.tensor([[3, 0], [0, 0]]), torch.tensor([[0, 0], [1, 0]])]  # 0 saw y_1 = 0 only, 1 y_1 = 1
    y = torch.tensor([[1, 0]])
    x, t = torch.zeros(1, 2), torch.zeros(1)
    v, v0, (v1, v2) = mixture_composite(experts, counts, y, route_mask=True)(x, t, parts=True)
    assert torch.allclose(v0, torch.full((1, 2), 0.0 * 3 / 4 + 4.0 / 4))  # pi_a ∝ n_a
    assert torch.allclose(v1, torch.full((1, 2), 4.0 + 11.0))  # only expert 1 has seen y_1 = 1
    assert torch.allclose(v2, torch.full((1, 2), 0.0 * 3 / 4 + 4.0 / 4 + 100.0))
    v, v0, (v1, _) = mixture_composite(experts, counts, y, route_mask=False)(x, t, parts=True)
    assert torch.allclose(v0, torch.full((1, 2), 2.0)) and torch.allclose(v1, torch.full((1, 2), 13.0))


def test_routed_mixture_composite_draws_one_expert_per_term_and_sample_from_the_same_weights():
    """dcfm.a-sampler = routed: each sample's v_0 and v_i come from one expert each (never a blend), drawn ∝ the
    expectation's weights, and fixed for the whole trajectory (the same route at every call of the field)."""
    experts = [Constant(0.0), Constant(4.0)]
    counts = [torch.tensor([[3, 0], [0, 0]]), torch.tensor([[0, 0], [1, 0]])]
    y = torch.tensor([[1, 0]]).repeat(4000, 1)
    x, t = torch.zeros(4000, 2), torch.zeros(4000)
    field = mixture_composite(experts, counts, y, route_mask=True, routes=torch.Generator().manual_seed(0))
    v, v0, (v1, v2) = field(x, t, parts=True)
    assert set(v0[:, 0].tolist()) == {0.0, 4.0}  # one expert's unconditional each, never their mean
    assert abs(float((v0[:, 0] == 4.0).float().mean()) - 1 / 4) < 0.03  # pi_a ∝ n_a = (3, 1)
    assert torch.all(v1 == 4.0 + 11.0)  # y_1 = 1: only expert 1 has seen it, as in expectation
    assert set(v2[:, 0].tolist()) == {100.0, 104.0}
    assert torch.equal(field(x, t), v)  # the route is drawn once, not at every Euler step
    expected = mixture_composite(experts, counts, y, route_mask=True)(x, t)
    assert torch.allclose(v.mean(0), expected.mean(0), atol=0.5)  # routes average to the expectation's field


class Interacting(torch.nn.Module):
    """Constant plus a digit x colour interaction on the full label: its composite misses the interaction."""

    def forward(self, x, t, y):
        both = (y[:, 0] >= 0) & (y[:, 1] >= 0)
        out = Constant(0.0)(x, t, y)[:, 0] + torch.where(both, 5.0 * y[:, 0] * y[:, 1], 0.0)
        return out[:, None].expand(-1, 2)


def test_attribute_sizes_follow_the_datasets_attributes_in_protocol_order():
    import feddata as fd
    from fedapp.protocols.dcfm import ATTRS, attribute_sizes

    info = fd.dataset_info("colored-digits")
    assert attribute_sizes(info) == [10, len(info.attributes["color"])] and ATTRS[0] == "digit"
    other = fd.DatasetInfo("toy", 3, ["a", "b", "c"], {"color": ["r", "g"], "digit": ["0", "1", "2", "3"]}, 8)
    assert attribute_sizes(other) == [4, 2]  # by name, not by the dict's order


def test_of_pairs_marks_the_rows_of_the_wanted_pairs():
    from fedapp.models.compose import of_pairs

    y = torch.tensor([[0, 1], [1, 0], [0, 1], [2, 2]])
    assert of_pairs(y, [[0, 1], [2, 2]]).tolist() == [True, False, True, True]
    assert not of_pairs(y, []).any()


def test_ci_residuals_are_zero_only_where_the_composite_is_the_joint_field():
    from fedapp.models.compose import ci_residuals

    y = torch.tensor([[0, 0], [1, 0], [1, 1]]).repeat(20, 1)
    x1 = torch.randn(len(y), 2)
    full = torch.ones(2, 2, dtype=torch.long)
    same = ci_residuals([Constant(1.0), Constant(1.0)], [full, full], x1, y, seed=0)
    assert same == {"ci_residual_self": 0.0, "ci_residual_mixture": 0.0}  # additive and one gauge
    apart = ci_residuals([Constant(0.0), Constant(4.0)], [full, full], x1, y, seed=0)
    assert apart["ci_residual_self"] == 0.0 and apart["ci_residual_mixture"] > 0.0  # each additive, gauges apart
    inter = ci_residuals([Interacting()], [full], x1, y, seed=0)
    # joint - uncond = 10 y1 + 1 + 100 + 5 y1 y2; the composite misses 5 y1 y2 = 5 on a third of the samples
    want = (20 * 25) / (20 * 101 ** 2 + 20 * 111 ** 2 + 20 * 116 ** 2)
    assert abs(inter["ci_residual_self"] - want) < 1e-6 and inter["ci_residual_mixture"] == inter["ci_residual_self"]


def test_ddm_router_learns_from_each_experts_samples_of_its_own_pairs():
    """train_router asks each expert only for the pairs it trained on (drawn by its counts), never the null label
    a plain expert never learned; on experts whose velocity is their label's digit, x1 = x0 + digit, so the
    router tells them apart near t = 1."""
    from strategies.fedflow import train_router

    asked = {0: [], 1: []}

    def expert(a):
        def v(x, t, y):
            asked[a].append(y.clone())
            return y[:, :1].float().expand_as(x)
        return v

    counts = [torch.zeros(10, 6, dtype=torch.long), torch.zeros(10, 6, dtype=torch.long)]
    counts[0][1, 2], counts[0][2, 3] = 5, 1  # expert 0: digits 1, 2; expert 1: digit 7
    counts[1][7, 0] = 3
    router = train_router([expert(0), expert(1)], counts, (2,), steps=300, batch=64, lr=0.01, sample_steps=4,
                          seed=0, per_expert=128, clip=10.0)
    for a, pairs in ((0, {(1, 2), (2, 3)}), (1, {(7, 0)})):
        ys = {tuple(r) for y in asked[a] for r in y.tolist()}
        assert ys == pairs  # each of its pairs, nothing else (no null label -1)
    first = asked[0][0][:, 0]  # the labels of its first Euler step
    assert 0.6 < (first == 1).float().mean() < 0.95  # drawn by its counts: 5 of 6
    x0 = torch.randn(200, 2, generator=torch.Generator().manual_seed(1))
    t = torch.full((200,), 0.9)
    for a, digit in ((0, 1.0), (1, 7.0)):
        x_t = 0.9 * (x0 + digit) + 0.1 * torch.randn(200, 2)
        assert (router(x_t, t).argmax(1) == a).float().mean() > 0.9


def test_router_holder_weight_is_the_routers_weight_on_the_asked_pairs_holders():
    """Seen pairs (1, 2) and (2, 3) are expert 0's, (7, 0) expert 1's, each asked a third of the time: a router
    sure of expert 0 puts 2/3 of its weight on holders, one sure of expert 1 1/3; one that switches from 0 to 1 at
    t = 0.5 averages the two over 4 Euler steps (t = 0, .25, .5, .75) and ends at 1/3."""
    from strategies.fedflow import router_holder_weight

    counts = [torch.zeros(10, 6, dtype=torch.long), torch.zeros(10, 6, dtype=torch.long)]
    counts[0][1, 2], counts[0][2, 3], counts[1][7, 0] = 50, 1, 9  # the share asked ignores the counts
    experts = [lambda x, t, y: torch.zeros_like(x)] * 2

    def router(choose):
        return lambda x, t: 50.0 * torch.nn.functional.one_hot(choose(t), 2).float()

    def weight(r):
        return router_holder_weight(experts, r, counts, (2,), n=4000, sample_steps=4, seed=0)

    zero = weight(router(lambda t: torch.zeros_like(t, dtype=torch.long)))
    one = weight(router(lambda t: torch.ones_like(t, dtype=torch.long)))
    switch = weight(router(lambda t: (t >= 0.5).long()))
    assert abs(zero["router_holder_weight"] - 2 / 3) < 0.03
    assert zero["router_holder_weight_end"] == zero["router_holder_weight"]
    assert abs(one["router_holder_weight"] - 1 / 3) < 0.03
    assert abs(switch["router_holder_weight"] - 0.5) < 0.03
    assert abs(switch["router_holder_weight_end"] - 1 / 3) < 0.03
    calls = []  # the probe reads the weights the sampler used: one router pass an Euler step
    weight(lambda x, t: calls.append(1) or torch.zeros(len(x), 2))
    assert len(calls) == 4


def test_replay_paths_follow_the_routed_composite_teacher_and_the_student_sees_masked_labels():
    from strategies.dcfm import distill_student, replay_buffer

    experts = {0: Constant(0.0), 1: Constant(4.0)}
    counts = {0: torch.tensor([[3, 0], [0, 0]]), 1: torch.tensor([[0, 0], [1, 0]])}
    own = replay_buffer(experts, counts, (2,), paths=64, steps=4, seed=0, mode="teacher")
    from_1 = own["y"][:, 0] == 1  # only teacher 1 holds (1, 0): those paths follow its joint field
    assert from_1.any() and torch.allclose(own["v"][from_1], experts[1](own["x"], own["t"], own["y"])[from_1])
    buf = replay_buffer(experts, counts, (2,), paths=64, steps=4, seed=0, mode="composite")
    assert set(map(tuple, buf["y"].tolist())) == {(0, 0), (1, 0)}  # the seen pairs only
    v = mixture_composite(list(experts.values()), list(counts.values()), buf["y"])(buf["x"], buf["t"])
    assert torch.allclose(buf["v"], v)  # the target: the routed composite at the full label
    first, second = buf["x"][:64], buf["x"][64:128]
    assert torch.allclose(second, first + buf["v"][:64] / 4)  # each path is an Euler step of that field

    seen = []

    class Recorder(VectorVelocityNet):
        def forward(self, x, t, y=None):
            seen.append(y.clone())
            return super().forward(x, t, y)

    torch.manual_seed(0)
    student = Recorder(dim=2, attribute_sizes=[2, 2], hidden=16)
    distill_student(student, buf, steps=20, batch=64, lr=1e-3, pi=(0.5, 0.3, 0.2), lambda_ci=0.0, seed=0)
    kept = torch.cat(seen).ge(0).sum(1).float()
    assert abs((kept == 2).float().mean().item() - 0.5) < 0.05
    assert abs((kept == 0).float().mean().item() - 0.2) < 0.05


def test_local_training_with_peer_ci_leaves_peers_unchanged():
    torch.manual_seed(0)
    own, peer = (VectorVelocityNet(dim=2, attribute_sizes=[2, 2], hidden=32) for _ in range(2))
    before = {k: v.clone() for k, v in peer.state_dict().items()}
    x, y = torch.randn(64, 2), torch.randint(0, 2, (64, 2))
    stats = train_expert(own, x, y, steps=5, batch=32, lr=1e-2, pi=(0.5, 0.3, 0.2), lambda_ci=1.0, seed=0,
                         peers={1: peer}, self_index=0)
    assert stats["ci"] > 0
    assert all(torch.equal(before[k], v) for k, v in peer.state_dict().items())


@pytest.mark.parametrize("ci_batch, ci_rows", [(0, 4 * 32), (8, 4 * 8), (64, 4 * 32)])
def test_ci_batch_estimates_the_ci_term_on_that_many_samples_of_the_minibatch(ci_batch, ci_rows):
    """dcfm.ci-batch: L_FM sees the whole minibatch (32), L_CI's one batched query (joint, unconditional,
    one per attribute: 4 label sets) only its first ci_batch samples (0, or more than the batch: all)."""
    from fedapp.models.compose import ci_sample

    rows = []

    class Recorder(VectorVelocityNet):
        def forward(self, x, t, y=None):
            rows.append(len(x))
            return super().forward(x, t, y)

    torch.manual_seed(0)
    x, y = torch.randn(64, 2), torch.randint(0, 2, (64, 2))
    train_expert(Recorder(dim=2, attribute_sizes=[2, 2], hidden=8), x, y, steps=3, batch=32, lr=1e-2,
                 pi=(1.0, 0.0, 0.0), lambda_ci=1.0, seed=0, ci_batch=ci_batch)
    assert rows == [32, ci_rows] * 3
    from strategies.dcfm import distill_student  # B's L_studentCI, on the server, the same way

    rows.clear()
    buf = {"x": x, "t": torch.rand(64), "y": y, "v": torch.randn(64, 2)}
    distill_student(Recorder(dim=2, attribute_sizes=[2, 2], hidden=8), buf, steps=2, batch=32, lr=1e-3,
                    pi=(1.0, 0.0, 0.0), lambda_ci=1.0, seed=0, ci_batch=ci_batch)
    assert rows == [32, ci_rows] * 2
    a, b = torch.arange(5), torch.arange(5, 10)
    assert [v.tolist() for v in ci_sample(2, a, b)] == [[0, 1], [5, 6]]
    assert all(v is w for v, w in zip(ci_sample(0, a, b), (a, b)))


def test_expert_training_reports_its_progress_for_its_client(fedapp_log, monkeypatch):
    """A 2,000-step expert is minutes of one core: the log carries `client K: expert steps i/n`, the
    peer-CI loop and the server's distillation theirs."""
    from fedapp import progress

    monkeypatch.setattr(progress, "EVERY_SECONDS", float("inf"))  # the count rule only: a loaded machine adds none
    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)  # test-sized loops are no long phases
    torch.manual_seed(0)
    own, peer = (VectorVelocityNet(dim=2, attribute_sizes=[2, 2], hidden=8) for _ in range(2))
    x, y = torch.randn(16, 2), torch.randint(0, 2, (16, 2))
    with progress.client_scope(3):
        train_expert(own, x, y, steps=20, batch=8, lr=1e-2, pi=(1.0, 0.0, 0.0), lambda_ci=0.0, seed=0)
        train_expert(own, x, y, steps=10, batch=8, lr=1e-2, pi=(1.0, 0.0, 0.0), lambda_ci=1.0, seed=0,
                     peers={1: peer}, self_index=0)
    from strategies.dcfm import distill_student  # DCFM-B's student, on the server: no client prefix

    buf = {"x": x, "t": torch.rand(16), "y": y, "v": torch.randn(16, 2)}
    distill_student(own, buf, steps=5, batch=8, lr=1e-3, pi=(1.0, 0.0, 0.0), lambda_ci=0.0, seed=0)
    lines = [r.getMessage().split(",")[0] for r in fedapp_log.records]
    assert lines == ([f"client 3: expert steps {i}/20" for i in range(2, 21, 2)]
                     + [f"client 3: peer-CI steps {i}/10" for i in range(1, 11)]
                     + [f"distillation steps {i}/5" for i in range(1, 6)])


def test_toy_dcfm_a_aligns_the_experts_unconditional_fields_and_fedflow_misses_the_mode():
    """The toy at the run config's defaults, seed 0 (docs/dcfm.md has 5 seeds)."""
    from experiments.dcfm_toy import run_toy

    torch.set_num_threads(1)
    res = run_toy(methods=("fedflow", "dcfm-a"), samples=256)
    # eq. 13's routes with r_0 = a peer pull each expert's unconditional field onto the others'. Measured
    # relative gap on the clients' paths: ~0.45 after Stage I; after Stage II < 0.01 with sequential rounds
    # (the default), 0.12-0.49 with the paper's allgather and 0.22 with an earlier peer loss, where the
    # simultaneous rounds swap the experts' fields instead of aligning them (docs/dcfm.md)
    assert res["uncond_gap_stage1"] > 0.2 and res["uncond_gap"] < 0.05, res
    share = res["mode_share"]
    assert share["dcfm-a"] > 0.8, share  # mean over 5 seeds: docs/dcfm.md
    assert share["fedflow"] < 0.1, share
    # ... while it has learnt the pairs the clients hold (the toy's convergence reading; 0.95 measured)
    assert res["fedflow_seen_share"] > 0.9, res["fedflow_seen_share"]


def test_toy_dcfm_b_fills_the_missing_mode():
    from experiments.dcfm_toy import run_toy

    torch.set_num_threads(1)
    share = run_toy(methods=("dcfm-b",), samples=256)["mode_share"]
    assert share["dcfm-b"] > 0.8, share  # mean over 5 seeds: docs/dcfm.md


TINY = {"dataset": "colored-digits", "partitioner": "attribute-holdout", "partitioner.per-class": 0,
        "partitioner.coverage": 0.5, "partitioner.split": "non-iid", "image-size": 8, "num-server-rounds": 2,
        "min-clients": 2, "batch-size": 8, "dcfm.local-steps": 2, "dcfm.peer-steps": 2, "dcfm.distill-steps": 2,
        "dcfm.replay-paths": 4, "dcfm.path-steps": 2, "dcfm.sample-steps": 2, "dcfm.samples-per-pair": 2,
        "dcfm.width": 8, "dcfm.router-steps": 2, "dcfm.fl-local-steps": 2, "dcfm.ref-epochs": 1}


def _sim(tmp_path, method, **kw):
    import fedapp

    return fedapp.simulate({**TINY, "method": method, "out-dir": str(tmp_path), **kw}, num_clients=3)


def _check_summary(s):
    assert s["status"] == "completed" and s["failures"] == []
    m = s["metrics"]
    for k in ("seen_composition_accuracy", "novel_composition_accuracy", "seen_distance", "novel_distance",
              "seen_kid", "seen_kid_std", "novel_kid", "novel_kid_std"):
        assert k in m and m[k] == m[k], k  # present and not NaN
    # the digit and colour readers' held-out accuracy, and whether either is below its threshold
    assert set(m["reader_accuracy"]) == {"digit", "color"} and m["reader_unreliable"] == bool(m["unreliable_readers"])
    return m


def test_simulation_dcfm_b_moves_exactly_two_model_transfers_per_client(tmp_path):
    """Through Ray (the flow methods' one Ray run; every flow method's transfers on the in-process grid
    below: A 1 + R N, FedFlow 2 T, DDM, local-only)."""
    s = _sim(tmp_path, "dcfm", **{"dcfm.variant": "b"})
    m = _check_summary(s)
    assert set(m["model_transfers_by_client"]) == {"0", "1", "2"}
    for c, v in m["model_transfers_by_client"].items():
        assert round(v) == 2 and abs(v - 2) < 0.05, (c, v)  # expert up + student down
        per = s["comm"]["per_client"][c]
        assert per["messages_up"] == 2 and per["messages_down"] == 2  # train, query.receive


def test_simulation_dcfm_a_sequential_schedule_moves_as_many_models_as_the_allgather(tmp_path):
    from fedapp.simulation import simulate_in_process

    torch.set_num_threads(1)
    s = simulate_in_process({**TINY, "method": "dcfm", "dcfm.variant": "a", "dcfm.rounds": 1,
                             "dcfm.peer-schedule": "sequential", "out-dir": str(tmp_path)}, num_clients=3)
    m = _check_summary(s)
    assert m["num_experts"] == 3
    for c, v in m["model_transfers_by_client"].items():
        assert abs(v - 4) < 0.1, (c, v)  # 1 + R N, as the allgather
        assert s["comm"]["per_client"][c]["messages_up"] == 2  # train, one query.peer


# The metric names every composition method reports (strategies/flow.py: FlowEvaluation.finish), and
# each method's own: one name set per method, as the experiment tables read them.
SHARED_METRICS = {f"{kind}_{m}" for kind in ("seen", "novel")
                  for m in ("composition_accuracy", "digit_accuracy", "color_accuracy", "distance", "kid",
                            "kid_std")} | {
    "model_bytes", "model_transfers_per_client", "model_transfers_by_client", "num_experts",
    "reader_accuracy", "reader_unreliable", "unreliable_readers"}
CI_RESIDUALS = ("ci_residual_self", "ci_residual_mixture")  # DCFM's composites against its joint fields
IN_PROCESS = {  # run config, own metrics, server phases timed, model transfers per client (N = 3, R = 1, T = 2)
    "dcfm-a": ({"method": "dcfm", "dcfm.variant": "a", "dcfm.rounds": 1},
               {"variant", "rounds", "peer_schedule", "ci_by_round", *CI_RESIDUALS},
               {"stage1", "peer_round1", "evaluation"}, 4),
    "dcfm-b": ({"method": "dcfm", "dcfm.variant": "b"}, {"variant", "distill_student", "distill_student_ci",
                                                         "replay_states", *CI_RESIDUALS},
               {"stage1", "distill", "evaluation"}, 2),
    "fedflow": ({"method": "fedflow"}, {"rounds"}, {"fedavg", "evaluation"}, 4),
    "ddm": ({"method": "ddm"}, {"router_steps", "router_holder_weight", "router_holder_weight_end"},
            {"stage1", "router", "evaluation"}, 3),
    "local-only-flow": ({"method": "local-only-flow"}, set(), {"stage1", "evaluation"}, 1),
}


@pytest.mark.filterwarnings(GC_OF_EARLIER_LEAKS)
@pytest.mark.filterwarnings("error")  # a run prints no warning, fedapp's or a library's
@pytest.mark.parametrize("name", sorted(IN_PROCESS))
def test_every_flow_method_runs_its_protocol_on_an_in_process_grid(tmp_path, name):
    from fedapp.simulation import simulate_in_process

    torch.set_num_threads(1)
    cfg, own, phases, transfers = IN_PROCESS[name]
    s = simulate_in_process({**TINY, **cfg, "out-dir": str(tmp_path)}, num_clients=3)
    m = _check_summary(s)
    assert set(m) == SHARED_METRICS | own
    assert m["num_experts"] == 3
    assert all(m[k] >= 0.0 for k in CI_RESIDUALS if k in own)
    assert phases <= set(s["phase_seconds"])
    from pathlib import Path

    # the one generator the method ends with is saved: B's student, FedFlow's global model
    saved = (Path(s["run_dir"]) / "model.safetensors").exists()
    assert saved == (name in ("dcfm-b", "fedflow")), name
    for c, v in m["model_transfers_by_client"].items():
        # ddm: the router (32 channels) rides beside the N - 1 peers: 0.4 of this width-8 velocity net
        assert transfers <= v < transfers + (0.5 if name == "ddm" else 0.1), (c, v)
    # the table's recount from the files on disk (experiments/dcfm.py) agrees, and leaves the caller's RNG alone
    from experiments.dcfm import transfers_from_run

    rng = torch.random.get_rng_state()
    assert transfers_from_run(s["run_dir"]) == pytest.approx(m["model_transfers_per_client"], abs=0.01)
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_fedflow_with_the_joint_label_embedding_trains_and_saves_a_joint_model(tmp_path):
    """dcfm.label-embedding reaches both sides: the clients train, and the server loads and saves, a net with
    one embedding row per label tuple ((10 + 1) x (6 + 1) on colored digits)."""
    from safetensors.torch import load_file

    from fedapp.simulation import simulate_in_process

    torch.set_num_threads(1)
    s = simulate_in_process({**TINY, "method": "fedflow", "dcfm.label-embedding": "joint",
                             "out-dir": str(tmp_path)}, num_clients=3)
    _check_summary(s)
    from pathlib import Path

    saved = load_file(Path(s["run_dir"]) / "model.safetensors")
    assert saved["unet.class_embedding.table.weight"].shape == (77, 4 * 8)
    assert not any(k.startswith("unet.class_embedding.tables") for k in saved)


FIGURES = ("seen_composition_accuracy", "novel_composition_accuracy", "seen_distance", "novel_distance")


def _through_one_cache(first: dict, second: dict):
    """Run `second` alone, then `first` and `second` through one ReplyCache. Returns the cache's hits after
    `first`, its hits after `second`, the entries `second` added, and the second run's figures shared and alone."""
    from fedapp.simulation import ReplyCache, simulate_in_process

    torch.set_num_threads(1)
    alone = simulate_in_process(second, num_clients=3)["metrics"]
    cache = ReplyCache()
    simulate_in_process(first, num_clients=3, reply_cache=cache)
    hits, entries = cache.hits, len(cache)
    shared = simulate_in_process(second, num_clients=3, reply_cache=cache)["metrics"]
    return hits, cache.hits, len(cache) - entries, shared, alone


def _assert_same_figures(shared: dict, alone: dict):
    for k in FIGURES:
        assert shared[k] == pytest.approx(alone[k], abs=1e-6), k


IN_PROCESS_DDM_L = ({"method": "ddm", "dcfm.ddm-ci": True}, *IN_PROCESS["ddm"][1:])  # the paper's DDM+L


@pytest.mark.parametrize("first, second", [("dcfm-a", "dcfm-b"), ("ddm", "local-only-flow"), ("dcfm-a", "ddm+l")])
def test_a_row_after_one_with_the_same_stage_one_reuses_it_exactly_through_a_reply_cache(tmp_path, first, second):
    """The DCFM table's rows of a (seed, split) share one ReplyCache. A and B send the clients the same Stage I
    (their configs differ only in server-only keys); DDM and local-only-flow send the same plain Stage I under
    two method names that share one client module; DDM+L sends DCFM's Stage I (L_CI at dcfm.lambda-ci). So the
    second row's Stage I is the first's replies, and its figures equal those of a run that trained its own
    experts."""
    cfgs = {**IN_PROCESS, "ddm+l": IN_PROCESS_DDM_L}
    a_cfg, b_cfg = ({**TINY, **cfgs[name][0], "out-dir": str(tmp_path / name)} for name in (first, second))
    before, after, _, shared, alone = _through_one_cache(a_cfg, b_cfg)
    assert before == 0 and after == 3  # each client's Stage I, once
    _assert_same_figures(shared, alone)


def test_a_sweep_over_a_peer_phase_key_finds_its_stage_one_in_the_reply_cache(tmp_path):
    """Stage I (`train`) does not read A's peer-phase keys (MethodSpec.unread_keys), so an A row that changes
    only them reuses the earlier row's Stage I and trains its own peer round; its figures equal those of the
    same row run alone, which would not hold if Stage I read a key the cache ignores."""
    first = {**TINY, **IN_PROCESS["dcfm-a"][0], "out-dir": str(tmp_path / "first")}
    second = {**first, "dcfm.peer-steps": 3, "dcfm.routes-per-batch": 2, "dcfm.route-mask": False,
              "out-dir": str(tmp_path / "second")}
    before, after, added, shared, alone = _through_one_cache(first, second)
    assert before == 0 and after == 3 and added == 3  # Stage I reused; a new peer round
    _assert_same_figures(shared, alone)


def test_a_longer_fedflow_run_finds_a_shorter_ones_rounds_in_the_reply_cache(tmp_path):
    """FedFlow's clients never read num-server-rounds (the server's loop; each message carries its round), so a
    2-round run after a 1-round one reuses round 1's replies and trains round 2; its figures equal the 2-round run
    alone, which would not hold if a client's round-1 work depended on the round count."""
    short = {**TINY, "method": "fedflow", "num-server-rounds": 1, "out-dir": str(tmp_path / "short")}
    long = {**short, "num-server-rounds": 2, "out-dir": str(tmp_path / "long")}
    before, after, added, shared, alone = _through_one_cache(short, long)
    assert before == 0 and after == 3 and added == 3  # round 1 reused; round 2 trained
    _assert_same_figures(shared, alone)


def test_a_reply_cache_keeps_rows_apart_whose_stage_one_differs(tmp_path):
    """DCFM's Stage I trains with the CI penalty, DDM's without: the same client module, different work, no hit."""
    from fedapp.simulation import ReplyCache, simulate_in_process

    torch.set_num_threads(1)
    cache = ReplyCache()
    for name in ("dcfm-a", "ddm"):
        simulate_in_process({**TINY, **IN_PROCESS[name][0], "out-dir": str(tmp_path / name)}, num_clients=3,
                            reply_cache=cache)
    assert cache.hits == 0 and len(cache) >= 6


def test_toy_verdict_needs_fedflow_to_draw_every_seeds_seen_pairs():
    from experiments.dcfm_toy import SEEN, mode_share, toy_verdict

    assert len(SEEN) == 3 and (1, 1) not in SEEN  # (right, up) is on no client
    x = torch.tensor([[-2.0, 2.0], [-2.0, 2.5], [2.0, 2.0], [0.0, 0.0]])
    assert mode_share(x, (0, 1)) == 0.5 and mode_share(x) == 0.25
    v = toy_verdict({"fedflow_seen_share": {"per_seed": [0.95, 0.93]}})
    assert v["converged"] and v["converged_seeds"] == 2
    v = toy_verdict({"fedflow_seen_share": {"per_seed": [0.95, 0.5]}})
    assert not v["converged"] and v["converged_seeds"] == 1
    assert not toy_verdict({})["converged"]  # no FedFlow run: no verdict to lean on


def test_toy_json_pairs_each_method_with_fedflow_seed_by_seed():
    from experiments.dcfm_toy import paired_with_fedflow

    table = {"fedflow": {"per_seed": [0.1, 0.0]}, "dcfm-a": {"per_seed": [0.9, 0.7]}, "ddm": {"per_seed": [0.0, 0.0]},
             "uncond_gap": {"per_seed": [0.4, 0.5]}}
    d = paired_with_fedflow(table)
    assert set(d) == {"dcfm-a - fedflow", "ddm - fedflow"}  # methods only, not the diagnostics
    a, ddm = d["dcfm-a - fedflow"], d["ddm - fedflow"]
    assert a["per_seed"] == pytest.approx({"0": 0.8, "1": 0.7}) and a["favour"] == 2
    assert ddm["per_seed"] == pytest.approx({"0": -0.1, "1": 0.0}) and ddm["favour"] == 0


@pytest.mark.parametrize("argv", [["--help"], ["--seeds", "0"], ["--methods", "dcfm-c"], ["--sweep", "1,x"],
                                  ["--lambda-ci", "-1"], ["--route-mask", "maybe"]])
def test_toy_cli_writes_nothing_on_help_or_a_bad_argument(tmp_path, monkeypatch, argv):
    from experiments.dcfm_toy import main

    monkeypatch.chdir(tmp_path)  # the default --out is docs/results/ under the working directory
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--out", str(tmp_path / "out")] if argv != ["--help"] else argv)
    assert exit_.value.code == (0 if argv == ["--help"] else 2)
    assert list(tmp_path.iterdir()) == []


# ---- the table's rows as the paper names them: A's allgather, DDM+L; A's record per peer round ---------------
def _table_row(tmp_path, name: str, monkeypatch, **settings) -> tuple[dict, list, list]:
    """One row of `python -m experiments dcfm` (its own run config, experiments.dcfm.config) on TINY, 3 clients:
    its metrics, the node groups of each variant-A peer exchange, and the lambda of each Stage I."""
    from experiments import dcfm
    from fedapp.protocols import dcfm as P
    from fedapp.simulation import simulate_in_process
    from strategies.dcfm import DcfmStrategy
    from strategies.flow import FlowStrategy

    groups, lambdas = [], []
    exchange, stage_one = DcfmStrategy.exchange, FlowStrategy.stage_one

    def spy_exchange(self, grid, phase, nodes, *a, **kw):
        if phase is P.PEER:
            groups.append(sorted(nodes))
        return exchange(self, grid, phase, nodes, *a, **kw)

    def spy_stage_one(self, grid, nodes, lambda_ci):
        lambdas.append(lambda_ci)
        return stage_one(self, grid, nodes, lambda_ci)

    monkeypatch.setattr(DcfmStrategy, "exchange", spy_exchange)
    monkeypatch.setattr(FlowStrategy, "stage_one", spy_stage_one)
    torch.set_num_threads(1)
    cfg = dcfm.config(name, dict(dcfm.ROWS)[name], "non-iid", 3, {**TINY, **settings}, str(tmp_path))
    return _check_summary(simulate_in_process(cfg, num_clients=3)), groups, lambdas


def test_the_allgather_row_retrains_every_expert_at_once_and_records_each_round(tmp_path, monkeypatch):
    """dcfm-a-allgather: each peer round is one exchange with all N clients (the paper's allgather), where the
    sequential row sends one client at a time; the cell keeps R + 1 records (Stage I, then each round) of the
    composites' residuals and the experts' gauge figures, the last one the row's residuals."""
    m, groups, lambdas = _table_row(tmp_path, "dcfm-a-allgather", monkeypatch, **{"dcfm.rounds": 2})
    assert len(groups) == 2 and all(len(g) == 3 for g in groups) and groups[0] == groups[1]
    assert lambdas == [1.0] and m["peer_schedule"] == "allgather"
    trace = m["ci_by_round"]
    assert [r["round"] for r in trace] == [0, 1, 2]
    assert set(trace[0]) == {"round", *CI_RESIDUALS, "uncond_gap"}  # nothing to move from after Stage I
    for rec in trace[1:]:
        assert set(rec) == {"round", *CI_RESIDUALS, "uncond_gap", "uncond_moved", "uncond_to_peers"}
        assert all(rec[k] >= 0 and rec[k] == rec[k] for k in rec)
        assert rec["uncond_moved"] > 0  # peer-CI training changed the experts
    assert {k: m[k] for k in CI_RESIDUALS} == {k: trace[-1][k] for k in CI_RESIDUALS}
    from experiments.dcfm import row_figures

    assert row_figures(m)["ci_by_round"] == trace  # what the table's cell keeps

    m, groups, _ = _table_row(tmp_path, "dcfm-a", monkeypatch, **{"dcfm.rounds": 1})
    assert [len(g) for g in groups] == [1, 1, 1] and len({g[0] for g in groups}) == 3  # one client at a time
    assert m["peer_schedule"] == "sequential" and len(m["ci_by_round"]) == 2


def test_the_ddm_l_row_trains_its_experts_with_the_ci_penalty_and_ddm_without(tmp_path, monkeypatch):
    from experiments import dcfm
    from fedapp.config import parse_run_config

    cfg = parse_run_config(dcfm.config("ddm+l", dict(dcfm.ROWS)["ddm+l"], "non-iid", 5,
                                       {**dcfm.SETTINGS, "dataset": "colored-digits"}, "runs"))
    assert cfg.method == "ddm" and cfg.options.ddm_ci and cfg.options.lambda_ci > 0
    m, groups, lambdas = _table_row(tmp_path, "ddm+l", monkeypatch)
    assert lambdas == [cfg.options.lambda_ci] and groups == []
    assert "router_holder_weight" in m
    _, _, lambdas = _table_row(tmp_path, "ddm", monkeypatch)
    assert lambdas == [0.0]


def test_gauge_figures_tell_experts_that_swapped_gauges_from_experts_that_agree():
    """The toy's allgather failure: each expert takes its peer's field, so the gap stays, each field moved, and
    each sits where its peer stood (to peers 0); experts that adopt one field close the gap."""
    from strategies.dcfm import gauge_figures

    g = torch.Generator().manual_seed(0)
    f, h = torch.randn(6, 3, 4, 4, generator=g), torch.randn(6, 3, 4, 4, generator=g)
    before = {0: f, 1: h}
    swapped = gauge_figures({0: h, 1: f}, before)
    assert swapped["uncond_gap"] == pytest.approx(gauge_figures(before, None)["uncond_gap"])
    assert swapped["uncond_gap"] > 0.2 and swapped["uncond_to_peers"] == pytest.approx(0.0)
    assert swapped["uncond_moved"] > 0.5
    agreed = gauge_figures({0: (f + h) / 2, 1: (f + h) / 2}, before)
    assert agreed["uncond_gap"] == pytest.approx(0.0, abs=1e-12) and agreed["uncond_moved"] > 0
    assert set(gauge_figures(before, None)) == {"uncond_gap"}


def test_the_table_counts_the_new_rows_steps_pairs_them_and_shows_as_rounds():
    """ddm+l and dcfm-a-allgather cost what ddm and dcfm-a do; A's allgather pairs with the sequential A and
    every DCFM row with DDM+L, and DDM+L with DDM; the --doc page lists each A run's record per round."""
    from experiments.dcfm import SETTINGS, flow_compute, markdown, paired_rows

    settings = {**SETTINGS, "dataset": "colored-digits"}
    assert flow_compute("ddm+l", settings, 5) == flow_compute("ddm", settings, 5)
    assert flow_compute("dcfm-a-allgather", settings, 5) == flow_compute("dcfm-a", settings, 5)

    def row(method, seed, novel_acc, trace=None):
        return {"method": method, "split": "non-iid", "seed": seed, "seen_distance": 1.0, "novel_distance": 9.0,
                "seen_composition_accuracy": 0.5, "novel_composition_accuracy": novel_acc,
                "model_transfers_per_client": 6.0, **({"ci_by_round": trace} if trace else {})}

    trace = [{"round": 0, "ci_residual_self": 0.03, "ci_residual_mixture": 0.07, "uncond_gap": 0.4},
             {"round": 1, "ci_residual_self": 0.02, "ci_residual_mixture": 0.3, "uncond_gap": 0.41,
              "uncond_moved": 0.8, "uncond_to_peers": 0.1}]
    rows = [row("dcfm-a", s, 0.2) for s in (0, 1)] + [row("dcfm-a-allgather", s, 0.1, trace) for s in (0, 1)]
    rows += [row("ddm+l", 0, 0.05), row("ddm", 0, 0.08)]
    pairs = {(q["method"], q["against"]): q for q in paired_rows(rows)}
    assert set(pairs) == {("dcfm-a-allgather", "dcfm-a"), ("dcfm-a", "ddm+l"), ("dcfm-a-allgather", "ddm+l"),
                          ("dcfm-a", "ddm"), ("dcfm-a-allgather", "ddm"), ("ddm+l", "ddm")}
    assert pairs["ddm+l", "ddm"]["novel_composition_accuracy"]["mean"] == pytest.approx(-0.03)
    assert pairs["dcfm-a-allgather", "dcfm-a"]["novel_composition_accuracy"]["mean"] == pytest.approx(-0.1)
    lines = markdown({"rows": rows, "paired": []}).splitlines()
    assert "| non-iid | dcfm-a-allgather | 1 | 1 | 0.020 / 0.300 | 0.410 | 0.800 | 0.100 |" in lines
    assert "| non-iid | dcfm-a-allgather | 0 | 0 | 0.030 / 0.070 | 0.400 |  |  |" in lines
    assert not [ln for ln in lines if ln.startswith("| non-iid | dcfm-a | 0 | 0 |")]  # no record, no line
