"""Shared fixtures."""

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture
def inside_a_run():
    """Flower stamps new messages with the running task's identity; unit tests have none."""
    old = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = old
