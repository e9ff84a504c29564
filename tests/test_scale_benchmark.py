"""benchmarks/scale.py's per-node memory: a node's RSS is its raylet's and every process below it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import scale  # noqa: E402


def test_a_subtree_holds_the_root_and_all_its_descendants_and_nothing_else():
    # 1 -> (2 -> 4 -> 5), 3; 6 is another node's raylet with its worker 7
    kids = {1: [2, 3], 2: [4], 4: [5], 6: [7]}
    assert sorted(scale.subtree(1, kids)) == [1, 2, 3, 4, 5]
    assert sorted(scale.subtree(6, kids)) == [6, 7]
    assert scale.subtree(5, kids) == [5]  # a leaf
