"""ClientApp: dispatch each message to the chosen method's client handler.

Every message carries the resolved run config (RUN_KEY: the common keys and the method's namespace), so
a SuperNode on another machine needs nothing but `--node-config "partition-id=K num-partitions=N"`.
"""

from __future__ import annotations

import time

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

from fedapp import registry
from fedapp.client_context import ClientContext
from fedapp.config import RunConfig, parse_run_config
from fedapp.progress import client_scope, flush_lines, setup_logging
from fedapp.protocols import (CLIENT_KEY, DOMAIN_KEY, FLOWER_CONFIG_KEYS, NUM_PARTITIONS_KEY, PARTITION_KEY, RUN_KEY,
                              SECONDS_KEY)


class Dispatcher:
    """The ClientApp's one handler. It snapshots the registry when made, and re-registers what the
    registry where it is unpickled lacks: a method registered in the driver (a test, a notebook) thus
    travels with the app into Ray's actors, where everything reads fedapp.registry.METHODS."""

    def __init__(self):
        self.methods = dict(registry.METHODS)
        self._parsed: dict[tuple, RunConfig] = {}

    def __setstate__(self, state: dict) -> None:  # arriving in another process (a Ray actor)
        self.__dict__.update(state)
        for name, spec in self.methods.items():
            registry.METHODS.setdefault(name, spec)

    def run_config_of(self, msg: Message) -> RunConfig:
        rec = msg.content.config_records[RUN_KEY]
        key = tuple(sorted((k, v) for k, v in rec.items() if k not in FLOWER_CONFIG_KEYS))
        if key not in self._parsed:
            self._parsed = {key: parse_run_config(dict(key))}  # one run at a time
        return self._parsed[key]

    def __call__(self, msg: Message, context: Context) -> Message:
        cfg = self.run_config_of(msg)
        ctx = ClientContext(cfg=cfg, partition_id=int(context.node_config["partition-id"]),
                            num_partitions=int(context.node_config["num-partitions"]), state=context.state)
        handlers = registry.client_handlers(cfg.method)
        mtype = msg.metadata.message_type
        if mtype not in handlers:
            raise ValueError(f"method {cfg.method!r} has no client handler for message type {mtype!r}")
        setup_logging()  # this process' progress lines reach Flower's log stream (fedapp.progress)
        t0 = time.perf_counter()
        try:
            with client_scope(ctx.partition_id):
                content = handlers[mtype](msg, ctx)
        finally:
            flush_lines()  # the handler's lines are written before its reply (or its error) leaves
        who = {PARTITION_KEY: ctx.partition_id, NUM_PARTITIONS_KEY: ctx.num_partitions,
               SECONDS_KEY: time.perf_counter() - t0}
        if "shard" in ctx.__dict__ and isinstance(ctx.shard.meta.get("domain"), str):
            who[DOMAIN_KEY] = ctx.shard.meta["domain"]
        content[CLIENT_KEY] = ConfigRecord(who)
        return Message(content, reply_to=msg)


def make_client_app(mods: list | None = None) -> ClientApp:
    """The ClientApp with a handler for every message type a registered method uses."""
    client = ClientApp(mods=mods or [])
    dispatch = Dispatcher()
    for mtype in registry.message_types():
        category, _, action = mtype.partition(".")
        decorator = getattr(client, category)
        (decorator(action) if action else decorator())(dispatch)
    return client


app = make_client_app()
