"""What the plan needs of a run's data: every client's class counts and test size, the server's splits.

A shard is a pure function of the run config and the partition id (fedapp.data), so the planner derives
them exactly as the clients will, before anything runs; fedapp.config.check_data's checks come first
(too few images for the clients, a partitioner the dataset cannot serve: one ConfigError line). Which rows a
client holds does not depend on the image size, so the shards are read at the dataset's native size (an
SD-1.5 run's 512 px would render the whole dataset at 512 px just to count labels); the run's image size
is checked against the dataset: where the dataset cannot be rendered at it (SD-1.5's 512 px beside the
built-in sets' 64 px cap) the plan goes on at the run's size and says the run would be refused there.
Where the data is not on this machine (a hub dataset offline, a folder elsewhere), `assumed_facts` plans
from an assumed shape of it (classes, training images per client, balanced), said so in the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DataFacts:
    num_clients: int
    num_classes: int
    channels: int
    image_size: int
    class_counts: list[list[int]]  # per client, per class: training images
    n_test: list[int]  # per client: test images
    server_test: int
    public: int
    domains: list[str | None]
    attribute_sizes: dict[str, int] = field(default_factory=dict)  # values per attribute (DCFM's pairs)
    meta: dict[str, Any] = field(default_factory=dict)  # the server split's meta (seen/novel pairs)
    refusals: list[str] = field(default_factory=list)  # checks the run would stop at that the plan passes over

    @property
    def n_train(self) -> list[int]:
        return [sum(c) for c in self.class_counts]


TEST_FRACTION = 0.2  # feddata.load_client_shard's default: a client's rows split 80/20 into train and test
HINT = "plan without the data: --classes K --images-per-client N"


def assumed_facts(cfg, num_clients: int, classes: int, per_client: int) -> DataFacts:
    """Facts of an assumed dataset: `classes` classes, `per_client` training images a client, balanced;
    test splits of a client's rows' TEST_FRACTION, as large a server test and public split."""
    counts = [per_client // classes + (1 if c < per_client % classes else 0) for c in range(classes)]
    test = round(per_client * TEST_FRACTION / (1 - TEST_FRACTION))
    return DataFacts(num_clients=num_clients, num_classes=classes, channels=3, image_size=cfg.image_size,
                     class_counts=[list(counts) for _ in range(num_clients)], n_test=[test] * num_clients,
                     server_test=test * num_clients, public=test * num_clients, domains=[None] * num_clients,
                     refusals=[f"ASSUMED data (dataset={cfg.dataset!r} not read): {classes} classes, {per_client} "
                               f"training and {test} test images a client, balanced"] + size_refusals(cfg))


def size_refusals(cfg) -> list[str]:
    """The run's image size against what feddata renders the dataset at (no data read)."""
    from feddata.sources import check_image_size

    try:
        check_image_size(cfg.dataset, cfg.image_size)
    except ValueError as err:
        return [f"the run's data check refuses it: {err}"]
    return []


def data_facts(cfg, num_clients: int, assume: tuple[int, int] | None = None) -> DataFacts:
    """The run's data facts, or with `assume` = (classes, images per client) assumed ones (assumed_facts)."""
    from fedapp.options import ConfigError

    if assume is not None:
        return assumed_facts(cfg, num_clients, *assume)
    try:
        return read_facts(cfg, num_clients)
    except ConfigError as err:
        raise ConfigError(f"{err} ({HINT})") from None
    except (ValueError, OSError) as err:  # a dataset that cannot be read here
        raise ConfigError(f"dataset={cfg.dataset!r}: {str(err).splitlines()[0]} ({HINT})") from None


def read_facts(cfg, num_clients: int) -> DataFacts:
    import torch

    from feddata import load_client_shard, load_server_data, validate

    from fedapp.options import ConfigError

    args = (cfg.dataset, cfg.partitioner, cfg.partitioner_params, cfg.seed)
    refusals = size_refusals(cfg)
    try:
        validate(*args[:3], num_clients, seed=cfg.seed)  # fedapp.config.check_data's checks, at the native size
    except ValueError as err:
        raise ConfigError(str(err)) from None
    server = load_server_data(*args, num_clients)
    info = server.info
    counts, tests, domains = [], [], []
    for k in range(num_clients):
        shard = load_client_shard(*args, k, num_clients)
        counts.append(torch.bincount(shard.train.y.long(), minlength=info.num_classes).tolist())
        tests.append(len(shard.test))
        dom = shard.meta.get("domain")
        domains.append(dom if isinstance(dom, str) else None)
    return DataFacts(num_clients=num_clients, num_classes=info.num_classes, channels=info.channels,
                     image_size=cfg.image_size, class_counts=counts, n_test=tests, server_test=len(server.test),
                     public=len(server.public), domains=domains,
                     attribute_sizes={a: len(v) for a, v in info.attributes.items()}, meta=dict(server.meta),
                     refusals=refusals)
