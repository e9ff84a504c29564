"""The one gate every reply passes before the server uses it.

A protocol's validator returns why an upload is unacceptable (or None); `keep_valid` applies it to
every reply, records each rejection with the node and the reason, and never lets a malformed reply
raise: a validator that throws is itself a rejection. The phase goes on while `min-clients` valid
replies remain.
"""

from __future__ import annotations

from typing import Callable, Iterable

from flwr.app import Message, RecordDict

from fedapp.protocols import CLIENT_KEY, Phase
from fedapp.server.run import ServerRun

Validator = Callable[[RecordDict], "str | None"]


def check_records(content: RecordDict, phase: Phase) -> str | None:
    """The reply carries exactly the phase's records (plus CLIENT_KEY)."""
    got = set(content.keys()) - {CLIENT_KEY}
    if got != set(phase.up):
        return f"records {sorted(got)} != expected {sorted(phase.up)}"
    return None


def safe_reason(validate: Validator, content: RecordDict) -> str | None:
    try:
        return validate(content)
    except Exception as err:  # a malformed upload must not take the run down
        return f"malformed upload ({type(err).__name__}: {str(err)[:200]})"


def keep_valid(run: ServerRun, replies: Iterable[Message], phase: str | Phase, validate: Validator) -> list[Message]:
    """Drop error replies and uploads `validate` rejects; enforce min-clients.

    With a `Phase`, the reply's record keys are checked against it first."""
    name = phase.name if isinstance(phase, Phase) else phase
    kept = []
    for r in replies:
        if r.has_error():
            continue  # already recorded by MeteredGrid
        reason = safe_reason(lambda c: check_records(c, phase), r.content) if isinstance(phase, Phase) else None
        if reason is None:
            reason = safe_reason(validate, r.content)
        if reason is not None:
            run.fail(r.metadata.src_node_id, name, f"invalid upload: {reason}")
            continue
        kept.append(r)
    if len(kept) < run.cfg.min_clients:
        raise RuntimeError(f"[{name}] only {len(kept)} valid replies, fewer than "
                           f"min-clients={run.cfg.min_clients}; see failures")
    return kept
