"""Python API: run a run config and return its summary.

`simulate` runs it with Flower's Ray simulation engine (what `flwr run` does). `simulate_in_process`
runs the same server (`fedapp.server_app.run_server`: strategy, Flower's round loop, validation,
metering) on an `InProcessGrid`, which hands each message to the ClientApp's handler in this process:
no Ray start-up, one client after another, and a `ReplyCache` may reuse client replies across the
runs of an experiment's grid. Tests, experiments and benchmarks share these two.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping

from fedapp.config import all_defaults, normalize_keys, parse_run_config
from fedapp.progress import no_ray_log_dedup

log = logging.getLogger("fedapp")


def _keep_ray_on_loopback() -> None:
    """Ray on Linux resolves 127.0.0.1 to the machine's routable address unless its
    "cluster" mode is off; off, every Ray process binds to the loopback interface."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read by Ray at import
    if "ray._private.ray_constants" in sys.modules:  # Ray already imported in this process
        setattr(sys.modules["ray._private.ray_constants"], "ENABLE_RAY_CLUSTER", False)


def own_ray_under_flwr_run() -> bool:
    """In `flwr run`'s simulation process, make the Ray that Flower starts a private one, as `simulate`'s is:
    a new instance bound to the loopback, even where another Ray runs on the machine. True when it did.

    That process (flwr-simulation) is Ray's driver, and Flower calls `ray.init(**init_args)` there with the
    federation config's init-args only (num-cpus, num-gpus, logging-level, log-to-driver:
    flwr/simulation/app.py:99-106); without an address `ray.init()` joins the cluster of the last `ray start`
    on the machine (ray/_private/services.py:421-454), someone else's included. The app's code runs in that
    process before `ray.init`: Flower loads the ClientApp (fedapp.client_app, so this package, whose __init__
    calls this) in the thread that then starts the backend (flwr/server/superlink/fleet/vce/vce_api.py:373,
    then :214; raybackend.py:104-119). RAY_ADDRESS, which `ray.init()` reads, set to "local" starts a new
    instance. A RAY_ADDRESS the user set (a cluster's HEAD:6379, or "auto" for the `ray start` cluster on this
    machine) in the environment of the `flwr` command that starts the SuperLink wins, as with `simulate`."""
    if Path(sys.argv[0]).name != "flwr-simulation" or os.environ.get("RAY_ADDRESS"):
        return False
    os.environ["RAY_ADDRESS"] = "local"
    _keep_ray_on_loopback()
    return True


def resolve_run_config(run_config: Mapping[str, Any], num_clients: int) -> tuple[dict[str, Any], Path]:
    """The flat config a run executes (defaults filled in, keys normalised, run-name resolved) and its
    run folder. User errors (bad key or value, too little data for `num_clients`) raise here, before
    anything starts."""
    from fedapp.preflight import preflight

    flat = {**all_defaults(), **normalize_keys(run_config)}
    cfg = parse_run_config(flat)
    preflight(cfg, num_clients)
    flat["run-name"] = cfg.resolved_run_name
    return flat, Path(cfg.resume) if cfg.resume else Path(cfg.out_dir) / flat["run-name"]


def _read_summary(run_dir: Path) -> dict[str, Any]:
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise RuntimeError(f"the simulation ended without writing {summary_path}; see the log above")
    return json.loads(summary_path.read_text())


def simulate(run_config: Mapping[str, Any], num_clients: int, backend: dict | None = None,
             client_mods: list | None = None) -> dict[str, Any]:
    """Run `run_config` (flat keys, as in pyproject.toml; missing keys take their defaults)
    on `num_clients` virtual SuperNodes with Flower's Ray backend; return summary.json.

    `backend` is Flower's backend config, e.g. {"client_resources": {"num_cpus": 1,
    "num_gpus": 0.25}}. Without an address Ray starts privately, bound to 127.0.0.1 with its files
    in a temp dir; with one ({"init_args": {"address": "HEAD:6379"}}, or RAY_ADDRESS set) the run
    joins that Ray cluster and its client actors spread over the cluster's nodes.
    `client_mods` are Flower client mods (tests use one to inject failures). Methods added with
    `fedapp.registry.register` travel with the ClientApp into Ray's actors.
    """
    flat, run_dir = resolve_run_config(run_config, num_clients)  # user errors surface here, before Ray starts
    backend, ray_tmp = _ray_backend(backend)
    no_ray_log_dedup()  # this process is Ray's driver: the clients' lines as they come
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from fedapp.client_app import make_client_app
    from fedapp.server_app import run_server

    server = ServerApp()

    @server.main()
    def _main(grid, context) -> None:
        run_server(grid, flat)

    try:
        run_simulation(server_app=server, client_app=make_client_app(client_mods),
                       num_supernodes=num_clients, backend_config=backend)
    finally:
        if ray_tmp:  # Ray has shut down: its session files are no longer needed
            shutil.rmtree(ray_tmp, ignore_errors=True)
    return _read_summary(run_dir)


def _ray_backend(backend: dict | None) -> tuple[dict, str | None]:
    """Flower's backend config with fedapp's defaults filled in, and the temp dir a private Ray keeps
    its files in (None when the run joins an existing cluster, whose files are its own)."""
    backend = dict(backend or {})
    init_args = dict(backend.get("init_args", {}))
    ray_tmp = None
    if not (init_args.get("address") or os.environ.get("RAY_ADDRESS")):
        _keep_ray_on_loopback()  # a private, single-node Ray; a cluster's nodes must reach each other
        init_args.setdefault("address", "local")  # a new instance even where a Ray cluster runs on this machine
        init_args.setdefault("_node_ip_address", "127.0.0.1")
        if "_temp_dir" not in init_args:
            ray_tmp = init_args["_temp_dir"] = tempfile.mkdtemp(prefix="fedapp-ray-")
    init_args.setdefault("include_dashboard", False)
    init_args.setdefault("logging_level", "warning")
    backend["init_args"] = init_args
    backend.setdefault("client_resources", {"num_cpus": 1, "num_gpus": 0.0})
    return backend, ray_tmp


# ---- in process -----------------------------------------------------------------------------------
def _feed(h: Any, value: Any) -> None:
    """Hash a record value; bytes (a shipped prior) directly, not through repr."""
    if isinstance(value, (bytes, bytearray)):
        h.update(b"b%d:" % len(value))
        h.update(value)
    elif isinstance(value, list):
        h.update(b"l%d:" % len(value))
        for v in value:
            _feed(h, v)
    else:
        h.update(repr(value).encode())
    h.update(b";")


def _feed_records(h: Any, records: Mapping[str, Any], skip: frozenset = frozenset()) -> None:
    from flwr.app import ArrayRecord

    for name in sorted(records):
        rec = records[name]
        h.update(f"[{type(rec).__name__} {name}]".encode())
        if isinstance(rec, ArrayRecord):
            for k, a in rec.items():
                _feed(h, (k, a.dtype, tuple(a.shape), a.stype))
                _feed(h, a.data)
        else:
            for k in sorted(rec):
                if k not in skip:
                    _feed(h, k)
                    _feed(h, rec[k])


@functools.lru_cache(maxsize=1)
def client_code_digest() -> str:
    """16 hex digits over the source of every module a client's reply depends on (fedapp, clients, feddata):
    a disk-kept reply is only read back by the code that wrote it."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for package in ("fedapp", "clients", "feddata"):
        for path in sorted((root / package).rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _write_reply(path: Path, content: Any, state: Any) -> None:
    """(reply content, node state) as two length-prefixed protobuf RecordDicts, written atomically; a write
    that fails is a warning (the cache saves time, never a run)."""
    from flwr.common.serde import recorddict_to_proto

    from fedapp.results import atomic_write_bytes

    blobs = [recorddict_to_proto(r).SerializeToString() for r in (content, state)]
    try:
        atomic_write_bytes(path, b"".join(len(b).to_bytes(8, "little") + b for b in blobs))
    except OSError as err:
        log.warning("reply cache %s not written (%s)", path, err)


def _read_reply(path: Path) -> tuple[Any, Any] | None:
    """What _write_reply wrote; None when the file is absent or does not parse (a warning then)."""
    if not path.is_file():
        return None
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    try:
        data, out, at = path.read_bytes(), [], 0
        for _ in range(2):
            n = int.from_bytes(data[at:at + 8], "little")
            if n > len(data) - at - 8:
                raise ValueError("truncated")
            out.append(recorddict_from_proto(ProtoRecordDict.FromString(data[at + 8:at + 8 + n])))
            at += 8 + n
        if at != len(data):
            raise ValueError("trailing bytes")
        return out[0], out[1]
    except Exception as err:  # noqa: BLE001 - any unreadable entry is a miss
        log.warning("reply cache %s unreadable (%s: %s); the client runs again", path, type(err).__name__, err)
        return None


class ReplyCache:
    """Client replies kept across the runs of an experiment's grid, so that runs which send the
    clients the same work get it done once.

    A client is a deterministic function of its message, its partition and its node's state (every
    draw comes from the run seed and the partition id), so a message it has answered before gets the
    reply it gave then. The key: the message type, the partition id, the run config record (RUN_KEY)
    less the keys only the server reads (the method's MethodSpec.server_only_keys; the round, ROUND_KEY,
    stays) and those this message type's handler does not read (MethodSpec.unread_keys: DCFM's Stage I
    ignores A's peer-phase keys), a digest of every other record of the message, and a digest of the
    node's state before the call. A hit returns a copy of the reply and sets the node's state to what
    the call left, so later rounds of a stateful client stay exact. Error replies are not kept.

    The method itself is keyed by its client module (MethodSpec.client), not its name: a client reads
    `method` only to pick its handlers (fedapp.client_app), so methods that share a client module and send
    it the same message get the same reply (DCFM's DDM and local-only-flow: the same plain Stage I).

    Not exact where a client draws from the OS (PFDM's DP noise): a hit replays the first draw.

    `folder`: the replies are also kept on disk (Flower's own protobuf serialisation of the reply and the
    state, no pickle), so that a table that spans sessions trains a Stage I once, not once a session. The
    entries go under a subfolder named by a digest of the code a reply depends on (`client_code_digest`):
    after any change to fedapp, clients or feddata the old entries are not read. A prior named by a path is
    assumed not to change in place (the built-in ones are cached under a key of their build). A file that
    does not read back is a miss (and a warning), never a failed run.
    """

    def __init__(self, folder: str | Path | None = None) -> None:
        self._entries: dict[str, tuple[Any, Any]] = {}  # key -> (reply content, node state after)
        self.folder = Path(folder) / client_code_digest() if folder is not None else None
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, msg: Any, partition_id: int, state: Any) -> str | None:
        """The cache key of `msg` to this partition; None when the message names no known method (the
        handler then answers with its error, uncached)."""
        from fedapp import registry
        from fedapp.protocols import RUN_KEY

        run = msg.content.config_records.get(RUN_KEY)
        method = run.get("method") if run is not None else None
        if method not in registry.METHODS:
            return None
        spec = registry.METHODS[method]
        h = hashlib.sha256()
        _feed(h, (spec.client, msg.metadata.message_type, int(partition_id)))
        unread = spec.unread_keys.get(msg.metadata.message_type, frozenset())
        _feed_records(h, {RUN_KEY: run}, spec.server_only_keys | unread | {"method"})
        _feed_records(h, {k: v for k, v in msg.content.items() if k != RUN_KEY})
        h.update(b"|state|")
        _feed_records(h, dict(state.items()) if state is not None else {})
        return h.hexdigest()

    def get(self, key: str) -> tuple[Any, Any] | None:
        """(reply content, node state after the call), copied; None on a miss. Counts hits and misses."""
        entry = self._entries.get(key)
        if entry is None and self.folder is not None:
            entry = _read_reply(self.folder / f"{key}.reply")  # kept by an earlier process
            if entry is not None:
                self._entries[key] = entry
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        return copy.deepcopy(entry)

    def put(self, key: str, content: Any, state_after: Any) -> None:
        self._entries[key] = copy.deepcopy((content, state_after))
        if self.folder is not None:
            _write_reply(self.folder / f"{key}.reply", content, state_after)

    def replies(self) -> list[Any]:
        """Copies of the kept reply contents, in the order they were first answered."""
        return [copy.deepcopy(content) for content, _ in self._entries.values()]


class InProcessGrid:
    """The part of Flower's Grid that fedapp's server uses (get_node_ids, send_and_receive), serving
    each message in this process with a `fedapp.client_app.Dispatcher` (the ClientApp's handler) on a
    per-node Flower Context whose state persists across rounds. A handler's exception becomes an
    error reply, as Flower's ClientApp sends one. Node ids are 1000 + partition id.

    `reply_cache`: a ReplyCache shared with other grids (other runs) whose replies this one may reuse."""

    FIRST_NODE_ID = 1000

    def __init__(self, num_nodes: int, reply_cache: ReplyCache | None = None):
        from flwr.app import Context, RecordDict
        from flwr.common.constant import SUPERLINK_NODE_ID
        from flwr.supercore.task_identity import TaskIdentity

        from fedapp.client_app import Dispatcher

        if TaskIdentity._run_id is None:  # what Flower's ServerApp runtime sets before a ServerApp runs
            TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 0, SUPERLINK_NODE_ID
        self.dispatch = Dispatcher()
        self.reply_cache = reply_cache
        self.nodes = {self.FIRST_NODE_ID + i: Context(
            run_id=0, node_id=self.FIRST_NODE_ID + i, node_config={"partition-id": i, "num-partitions": num_nodes},
            state=RecordDict(), run_config={}) for i in range(num_nodes)}

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list:
        # node order, not Flower's random.sample order: the float sum of an aggregation then does not
        # depend on the order, and a run is reproducible (non-IID FedAvg amplifies the last-bit noise)
        return [self.deliver(m) for m in sorted(messages, key=lambda m: m.metadata.dst_node_id)]

    def deliver(self, msg):
        """One message to its node: the cached reply, or the handler's (an error reply if it raises)."""
        from flwr.app import Error, Message
        from flwr.common.constant import ErrorCode

        context = self.nodes[msg.metadata.dst_node_id]
        key = None
        if self.reply_cache is not None:
            key = self.reply_cache.key(msg, context.node_config["partition-id"], context.state)
            hit = self.reply_cache.get(key) if key is not None else None
            if hit is not None:
                content, state = hit
                context.state.clear()
                for name, record in state.items():
                    context.state[name] = record
                return Message(content, reply_to=msg)
        try:
            reply = self.dispatch(msg, context)
        except Exception as err:  # noqa: BLE001 - the server records it like a remote failure
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(err).__name__}: {err}"),
                           reply_to=msg)
        if key is not None:
            self.reply_cache.put(key, reply.content, context.state)
        return reply


def simulate_in_process(run_config: Mapping[str, Any], num_clients: int,
                        reply_cache: ReplyCache | None = None) -> dict[str, Any]:
    """Run `run_config` like `simulate` (same defaults and checks before anything runs, same run
    folder, summary.json returned) with the clients served in this process by an InProcessGrid.
    A strategy's exception propagates (after summary.json records it)."""
    from fedapp.server_app import run_server

    flat, run_dir = resolve_run_config(run_config, num_clients)
    run_server(InProcessGrid(num_clients, reply_cache=reply_cache), flat)
    return _read_summary(run_dir)
