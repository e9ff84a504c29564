"""ClientApp: dispatch each message to the chosen method's client handler.

Every message carries the resolved run config (ConfigRecord `config`), so a SuperNode on
another machine needs nothing but `--node-config "partition-id=K num-partitions=N"`.
"""

from __future__ import annotations

from functools import lru_cache

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

from fedapp import registry
from fedapp.client_context import ClientContext
from fedapp.config import RunConfig, parse_run_config

# Keys Flower strategies add to the config record; not part of the run config.
_FLOWER_KEYS = ("server-round", "proximal-mu")


@lru_cache(maxsize=8)
def _parse(items: tuple) -> RunConfig:
    return parse_run_config(dict(items))


def run_config_of(msg: Message) -> RunConfig:
    rec = msg.content.config_records["config"]
    return _parse(tuple(sorted((k, v) for k, v in rec.items() if k not in _FLOWER_KEYS)))


def handle(msg: Message, context: Context) -> Message:
    cfg = run_config_of(msg)
    ctx = ClientContext(cfg=cfg, partition_id=int(context.node_config["partition-id"]),
                        num_partitions=int(context.node_config["num-partitions"]),
                        state=context.state)
    handlers = registry.client_handlers(cfg.method)
    mtype = msg.metadata.message_type
    if mtype not in handlers:
        raise ValueError(f"method {cfg.method!r} has no client handler for message type {mtype!r}")
    content = handlers[mtype](msg, ctx)
    who = {"partition-id": ctx.partition_id}
    if "shard" in ctx.__dict__ and isinstance(ctx.shard.meta.get("domain"), str):
        who["domain"] = ctx.shard.meta["domain"]
    content["client"] = ConfigRecord(who)
    return Message(content, reply_to=msg)


def make_client_app(mods: list | None = None) -> ClientApp:
    """The ClientApp with a handler for every message type a registered method uses."""
    client = ClientApp(mods=mods or [])
    for mtype in registry.message_types():
        category, _, action = mtype.partition(".")
        decorator = getattr(client, category)
        (decorator(action) if action else decorator())(handle)
    return client


app = make_client_app()
