"""The server runtime every strategy uses: run state, metered grid, node waiting, the validation
gate, the strategy bases. Strategies import this package; it imports no strategy."""

from fedapp.server.grid import MeteredGrid, TooFewNodes, make_messages, simulated_nodes, wait_for_nodes
from fedapp.server.rounds import RoundStrategy
from fedapp.server.run import ServerRun
from fedapp.server.strategy import FedappStrategy, PhasedStrategy
from fedapp.server.validation import keep_valid

__all__ = ["FedappStrategy", "MeteredGrid", "PhasedStrategy", "RoundStrategy", "ServerRun", "TooFewNodes",
           "keep_valid", "make_messages", "simulated_nodes", "wait_for_nodes"]
