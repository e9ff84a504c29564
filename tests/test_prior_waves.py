"""The prior reaches each machine about once (fedapp.server.prior_waves)."""

import pytest

from fedapp.server.prior_waves import distribute


class Machines:
    """Virtual clients on machines that share a disk: a node holds the prior once any node of its machine
    received it. Counts the weights sent."""

    def __init__(self, machine_of: dict[int, int], holding: set[int] = frozenset(), broken: set[int] = frozenset()):
        self.machine_of, self.holding, self.broken, self.sent = machine_of, set(holding), set(broken), 0

    def ask(self, nodes):
        return {n: self.machine_of[n] in self.holding for n in nodes if n not in self.broken}

    def send(self, nodes):
        self.sent += len(nodes)
        self.holding |= {self.machine_of[n] for n in nodes if n not in self.broken}
        return self.ask(nodes)


@pytest.mark.parametrize("clients,machines", [(1000, 2), (1000, 1), (100, 7), (16, 16), (5, 3)])
def test_every_node_gets_the_prior_and_each_machine_is_sent_it_at_most_twice(clients, machines):
    world = Machines({n: n % machines for n in range(clients)})
    out = distribute(range(clients), world.ask, world.send)
    assert sorted(out.holders) == list(range(clients)) and out.lost == out.refused == []
    assert world.sent == len(out.sent_to) <= 2 * machines  # the doubling waves' overshoot bounds it
    assert world.sent >= machines  # and no machine gets it without being sent it
    assert out.asked < 2 * clients  # a node is asked again only while it lacks the prior and waits for a wave
    if machines == 1:  # one node is asked and sent it; every other node is asked once
        assert world.sent == 1 and out.asked == clients and out.questions == 3


def test_nodes_that_hold_it_already_are_sent_nothing():
    world = Machines({n: n % 4 for n in range(40)}, holding={0, 1, 2, 3})
    out = distribute(range(40), world.ask, world.send)
    assert world.sent == 0 and out.asked == 40 and out.questions == 2 and len(out.holders) == 40


def test_lacking_nodes_left_out_of_a_wave_are_asked_again_until_their_machine_holds_it():
    # the first node asked holds it, so the rest are asked at once: 30 lack it, on 3 machines, more than a wave
    world = Machines({n: n % 4 for n in range(40)}, holding={0})
    out = distribute(range(40), world.ask, world.send)
    assert sorted(out.holders) == list(range(40)) and out.lost == out.refused == []
    assert 3 <= world.sent <= 2 * 3 and world.sent == len(out.sent_to)


def test_a_node_that_never_answers_is_lost_and_the_others_still_get_it():
    world = Machines({n: n for n in range(6)}, broken={2})
    out = distribute(range(6), world.ask, world.send)
    assert sorted(out.holders) == [0, 1, 3, 4, 5] and out.lost == [2] and 2 not in out.sent_to


def test_one_wave_sends_every_node_that_lacks_it_after_one_question():
    """waves=False (ship-prior=all, a deployment: each node its own machine): one round of questions, the
    weights to each lacking node once, none to a node that holds it."""
    world = Machines({n: n for n in range(7)}, holding={3})
    out = distribute(range(7), world.ask, world.send, waves=False)
    assert out.questions == 1 and out.asked == 7 and sorted(out.sent_to) == [0, 1, 2, 4, 5, 6] and world.sent == 6
    assert sorted(out.holders) == list(range(7))
