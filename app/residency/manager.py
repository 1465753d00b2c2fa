"""Which models are resident, on which nodes, and who is using them: loads, leases, eviction, expiry."""

# One lock guards all state; HTTP, process starts and stops happen outside it, and events are
# emitted outside it, in order, so an on_event callback may call back into the manager.

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from app.policy import MODEL_POLICIES, ModelPolicy
from app.residency.budget import ANY_GPU, RAM_DEVICE, plan_on_devices, short_devices, used_by_device
from app.residency.pagecache import WEIGHTS_CHOICES, WEIGHTS_WARM, WeightsFile
from app.residency.remote import RemoteNode
from app.residency.runner_spec import RunnerSpec
from app.residency.supervisor import RunnerProcess, RunnerStartFailed, new_runner_key

log = logging.getLogger(__name__)

LOCAL = "local"


class ModelState(StrEnum):
    """A model's residency state, as status() reports it; the dashboard's words are derived from these."""

    UNLOADED = "unloaded"  # no runner (never loaded, unloaded, evicted or expired)
    LOADING = "loading"  # a runner is starting
    READY = "ready"  # a runner serves it (for a remote-only model: some node is healthy)
    FAILED = "failed"  # its last load failed (a remote-only model: no node is healthy); the next request retries
    CRASHED = "crashed"  # its runner died; the next request restarts it


# The states in which a model holds (or is about to hold) a runner's memory.
RESIDENT_STATES = (ModelState.LOADING, ModelState.READY)

STATUS_LOG_LINES = 50
ERROR_LOG_LINES = 20
# After a failed load, a request for the same model, file and runner settings gets the same error at once for this
# long instead of starting another runner that fails the same way (an app retrying every second would otherwise keep a
# core busy starting runners). The admin's Load button, a changed file and changed settings retry at once.
FAILED_LOAD_COOLDOWN_S = 15.0


@dataclass(frozen=True)
class ModelSpec:
    """A servable model: its local runner (None = remote-only), remote nodes and residency policy."""

    name: str
    path: str | None
    estimate_bytes: int
    policy: ModelPolicy = "keep_alive"
    keep_alive_s: float = 300.0
    runner: RunnerSpec | None = None
    remote: tuple[tuple[str, str], ...] = ()
    # How the runner's slots and KV cells were chosen when the admin set none (size_runner's reason).
    sizing_note: str | None = None
    # The weights in the page cache while no runner maps them (app.residency.pagecache): pinned, warm or cold.
    weights: str = WEIGHTS_WARM
    # Bytes per device its runner takes ("CPU" for RAM, "Vulkan0", or ANY_GPU for the GPU the residency places it on),
    # summing to estimate_bytes; empty: all of estimate_bytes in RAM. Counted against a budget per device.
    need_by_device: tuple[tuple[str, int], ...] = ()
    # Why its GPU layers, experts in RAM and KV type are what they are, when the fit chose them (app.residency.fit).
    fit_note: str | None = None

    def __post_init__(self):
        if self.policy not in MODEL_POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {MODEL_POLICIES}")
        if self.weights not in WEIGHTS_CHOICES:
            raise ValueError(f"unknown weights choice {self.weights!r}; choose from {WEIGHTS_CHOICES}")
        object.__setattr__(self, "remote", tuple((url, label) for url, label in self.remote))
        need = self.need_by_device.items() if isinstance(self.need_by_device, dict) else self.need_by_device
        object.__setattr__(self, "need_by_device", tuple((d, int(n)) for d, n in need))

    def need(self) -> dict[str, int]:
        """Bytes per device its runner takes (all in RAM where no split was given)."""
        return dict(self.need_by_device) or {RAM_DEVICE: self.estimate_bytes}


@dataclass(frozen=True)
class ResidencyEvent:
    """One load, unload, eviction, crash or failed load, for the store and the dashboard."""

    model_name: str
    event: Literal["load", "unload", "evict", "crash", "load_failed"]
    reason: str
    node: str | None = None
    cold_start_ms: float | None = None
    estimate_bytes: int | None = None
    measured_bytes: int | None = None
    pid: int | None = None
    at: float = field(default_factory=time.time)
    # A load's split in ms (see app.residency.supervisor.LoadSplit): None where it was not measured.
    load_read_ms: float | None = None
    load_context_ms: float | None = None
    load_upload_ms: float | None = None
    load_restore_ms: float | None = None
    first_prefill_ms: float | None = None
    weights_source: str | None = None  # page_cache | disk
    kv_source: str | None = None  # ram | disk | none


def _on_device(spec: ModelSpec, placed: dict[str, int]) -> ModelSpec:
    """`spec` with its runner started on the GPU the plan placed its ANY_GPU bytes on (--device NAME)."""
    need = spec.need()
    if ANY_GPU not in need or spec.runner is None:
        return spec
    gpu = next((d for d in placed if d != RAM_DEVICE and d not in need), None)
    if gpu is None:
        return spec
    return dataclasses.replace(spec, runner=dataclasses.replace(spec.runner, devices=(gpu,)))


def weights_files(specs: dict[str, ModelSpec]) -> list[WeightsFile]:
    """The files each local model's runner maps (its GGUF, its projector), with the model's weights choice."""
    return [WeightsFile(spec.name, spec.weights, (spec.runner.model_path,) + ((spec.runner.mmproj,) if spec.runner.mmproj else ()))
            for spec in specs.values() if spec.runner is not None]


class ResidencyError(Exception):
    """Base of the errors acquire() raises."""


class UnknownModel(ResidencyError):
    """No model of that name in the catalog."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(f"unknown model {name!r}")


class ModelLoadFailed(ResidencyError):
    """The model's runner could not be started, and no other node can serve it."""

    def __init__(self, name: str, reason: str, retry_after_s: float | None = None):
        self.name = name
        self.reason = reason
        # Set while a failed load cools down: when a request will try to load it again.
        self.retry_after_s = retry_after_s
        super().__init__(f"model {name!r} could not be loaded: {reason}")


class ModelBusy(ResidencyError):
    """The model cannot be unloaded now: it is loading or serving requests."""


class NotEnoughMemory(ResidencyError):
    """The model does not fit the budget even after evicting every evictable model."""

    def __init__(self, message: str, *, needed_bytes: int = 0, budget_bytes: int = 0,
                 resident: dict[str, int] | None = None, blocked: dict[str, str] | None = None,
                 busy_only: bool = False):
        self.needed_bytes = needed_bytes
        # True when models with requests in flight stand in the way, and evicting them once idle makes room.
        self.busy_only = busy_only
        self.budget_bytes = budget_bytes
        self.resident = resident or {}
        self.blocked = blocked or {}
        super().__init__(message)


def _ttl_s(m: _Model) -> float | None:
    """How long `m` may stay idle before it is unloaded; None: never (pinned, or a client's inf)."""
    if m.spec.policy == "pinned":
        return None
    ttl = m.client_keep_alive_s
    if ttl is None:
        ttl = 0.0 if m.spec.policy == "on_demand" else m.spec.keep_alive_s
    return None if ttl == float("inf") else ttl


def _expires_in_s(m: _Model, now: float) -> float | None:
    """Seconds until `m`'s idle expiry (its full TTL while it serves); None when it never expires."""
    ttl = _ttl_s(m)
    if ttl is None or m.state != ModelState.READY or m.spec.runner is None:
        return None
    idle_s = 0.0 if m.in_flight or m.last_used is None else now - m.last_used
    return max(0.0, ttl - idle_s)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


class _Node:
    """A place a model is served: its local runner or one remote server."""

    def __init__(self, label: str, url: str, probe: RemoteNode, runner: RunnerProcess | None = None):
        self.label = label
        self.url = url
        self.probe = probe
        self.runner = runner
        self.in_flight = 0
        self.healthy = True
        # Remote nodes are checked once before first use, then after each cool-down.
        self.checked = runner is not None
        self.retry_at = 0.0
        self.load: float | None = None
        self.error: str | None = None

    @property
    def local(self) -> bool:
        return self.runner is not None


class _Model:
    """The manager's state for one model."""

    def __init__(self, spec: ModelSpec):
        self.name = spec.name
        self.spec = spec
        self.state = ModelState.UNLOADED
        self.runner: RunnerProcess | None = None
        self.local: _Node | None = None
        self.remotes: dict[str, _Node] = {}
        self.loading: Future | None = None
        self.loading_since: float | None = None
        self.starting: RunnerProcess | None = None
        self.last_runner: RunnerProcess | None = None
        self.resident_bytes = 0
        # Its resident runner's bytes per device, as placed by the budget per device (else all in RAM).
        self.placed: dict[str, int] = {}
        self.in_flight = 0
        self.last_used: float | None = None
        self.cold_start_ms: float | None = None
        # The load event of the current runner, until its first request has completed it (hearth runners).
        self.first_use: ResidencyEvent | None = None
        self.measured_bytes: int | None = None
        self.error: str | None = None
        # When the last load failed and what it tried (the spec and its file's size and mtime), for the cool-down.
        self.failed_at: float | None = None
        self.failed_key: tuple | None = None
        self.failure = ""  # the failed load's ModelLoadFailed reason
        self.error_log: list[str] = []
        self.returncode: int | None = None
        # A client's keep-alive (Ollama's keep_alive) for the current residency; None: the admin's.
        self.client_keep_alive_s: float | None = None

    @property
    def resident(self) -> bool:
        return self.state in RESIDENT_STATES

    def nodes(self) -> list[_Node]:
        return ([self.local] if self.local else []) + list(self.remotes.values())


class Lease:
    """The right to send one request to one node; release() when the response is done."""

    def __init__(self, manager: ResidencyManager, model: _Model, node: _Node):
        self._manager = manager
        self._model = model
        self._node = node
        self.url = node.url
        self.node_label = node.label
        self.model_name = model.name
        self.local = node.local
        self.pid = node.runner.pid if node.runner else None
        self.released = False

    def __repr__(self) -> str:
        return f"<Lease {self.model_name} on {self.node_label} {self.url}>"

    def release(self) -> None:
        """End the lease (idempotent)."""
        self._manager._release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class ResidencyManager:
    """Starts, shares, evicts and restarts model runners under a memory budget."""

    def __init__(self, models: Callable[[], dict[str, ModelSpec]], budget_bytes: Callable[[], int],
                 on_event: Callable[[ResidencyEvent], None], clock: Callable[[], float] = time.monotonic,
                 start_timeout_s: float = 120, node_cooldown_s: float = 10.0,
                 failed_load_cooldown_s: float = FAILED_LOAD_COOLDOWN_S,
                 busy_wait_s: Callable[[], float] = lambda: 0.0,
                 on_first_use: Callable[[ResidencyEvent], None] | None = None,
                 on_stopped: Callable[[str], None] | None = None,
                 device_budgets: Callable[[], dict[str, int]] | None = None):
        # on_first_use: a load's event again, completed with its first request's KV restore and prefill (the
        # store updates the load's row). on_stopped: a model's local runner has exited (the weights warmer).
        # models() is called on every acquire: it must be cheap (a cached catalog).
        self._models_fn = models
        self._budget_fn = budget_bytes
        # Usable bytes per device ("CPU" for RAM, each GPU by llama.cpp's name): when given (and not empty) each device
        # is a budget of its own, and a model is placed on the GPU with room (app.residency.budget.plan_on_devices).
        self._device_budgets_fn = device_budgets
        self._on_event = on_event
        self._on_first_use = on_first_use
        self._on_stopped = on_stopped
        self._clock = clock
        self.start_timeout_s = start_timeout_s
        self.node_cooldown_s = node_cooldown_s
        self.failed_load_cooldown_s = failed_load_cooldown_s
        self._lock = threading.Lock()
        # Notified whenever a lease is released: a load waiting for a busy model to go idle looks again.
        self._idle = threading.Condition(self._lock)
        # How long (s, real time) a load waits for busy models in its way to finish before it is refused.
        self._busy_wait_s = busy_wait_s
        self._emit_lock = threading.Lock()
        self._models: dict[str, _Model] = {}
        self._closed = False

    # --- acquiring ---------------------------------------------------------------------------

    def acquire(self, name: str) -> Lease:
        """A lease on the least loaded healthy node serving `name`, loading its runner if needed."""
        lease = self._serve(name, want_lease=True)
        assert lease is not None
        return lease

    def _serve(self, name: str, want_lease: bool, why: str = "pinned") -> Lease | None:
        catalog = self._models_fn()
        # Each turn of the loop, until a lease is handed out (or, for want_lease=False, until ready):
        #   1. the local runner is ready (or there is none) → choose a node and lease it;
        #   2. another request is loading it → wait for that one load, then look again;
        #   3. otherwise plan room under the budget (evict least recently used idle unpinned
        #      models, or refuse without evicting anything), stop the victims, start the runner.
        # Choosing a node: healthy nodes only (local runner + remotes); with more than one, each
        # node's reported load (running + waiting from /metrics), never below the leases we hold
        # on it; the local runner wins ties.
        # Set once this call has seen a load fail: it then serves from remotes or raises, never retries.
        failure: ResidencyError | None = None
        # A load that only busy models stand in the way of waits for them to finish (a family member's
        # question to one model right after another model's answer), at most busy_wait_s, then is refused.
        busy_deadline: float | None = None
        while True:
            events: list[ResidencyEvent] = []
            victims: list[RunnerProcess] = []
            wait_for: Future | None = None
            owner = False
            with self._lock:
                if self._closed:
                    raise ModelLoadFailed(name, "Hearth is shutting down")
                spec = catalog.get(name)
                if spec is None:
                    raise UnknownModel(name)
                m = self._sync(spec)
                if m.state == ModelState.READY or spec.runner is None or failure is not None:
                    if not want_lease:
                        if failure is not None:
                            raise failure
                        return None
                    nodes = [n for n in m.nodes() if n.healthy or self._clock() >= n.retry_at]
                    if not nodes:
                        raise failure or ModelLoadFailed(name, self._no_node_reason(m))
                elif m.state == ModelState.LOADING:
                    wait_for = m.loading
                elif want_lease and self._cooling_down(m, spec):
                    # As if this request's load had failed the same way: its remote nodes, if any, serve it; else it
                    # gets the same error, with how long until a request tries the load again.
                    failure = ModelLoadFailed(name, m.failure,
                                              retry_after_s=m.failed_at + self.failed_load_cooldown_s - self._clock())
                    continue
                else:
                    try:
                        evict, placed = self._plan_room(m)
                    except NotEnoughMemory as exc:
                        if exc.busy_only:
                            now = time.monotonic()
                            if busy_deadline is None:
                                busy_deadline = now + self._busy_wait_s()
                            if now < busy_deadline:
                                self._idle.wait(busy_deadline - now)
                                continue
                        failure = exc
                        continue
                    for victim in evict:
                        runner, event = self._detach(victim, "evict", f"evicted to make room for {name}")
                        victims.append(runner)
                        events.append(event)
                    reason = {ModelState.CRASHED: "restart after a crash", ModelState.FAILED: "retry after a failed load"}.get(
                        m.state, "first request" if want_lease else why)
                    m.state = ModelState.LOADING
                    m.loading_since = self._clock()
                    m.loading = wait_for = Future()
                    m.resident_bytes = spec.estimate_bytes
                    m.placed = placed
                    spec = _on_device(spec, placed)
                    owner = True
            if owner:
                self._emit(events)
                self._stop_all(victims)
                self._load(m, spec, wait_for, reason)
            if wait_for is not None:
                try:
                    wait_for.result()
                except ModelLoadFailed as exc:
                    failure = exc
                continue
            lease = self._choose(m, nodes, failure)
            if lease is not None:
                return lease

    def _cooling_down(self, m: _Model, spec: ModelSpec) -> bool:
        """True while `m`'s last load failed under a cool-down ago and nothing it tried has changed since."""
        return (m.state == ModelState.FAILED and m.failed_at is not None
                and self._clock() - m.failed_at < self.failed_load_cooldown_s and m.failed_key == _load_key(spec))

    def _sync(self, spec: ModelSpec) -> _Model:
        """The state for `spec`'s model, with its remote nodes brought in line with the spec."""
        m = self._models.get(spec.name)
        if m is None:
            m = self._models[spec.name] = _Model(spec)
        m.spec = spec
        wanted = dict(spec.remote)
        for url in list(m.remotes):
            if url not in wanted:
                del m.remotes[url]
        for url, label in wanted.items():
            if url not in m.remotes:
                m.remotes[url] = _Node(label, url, RemoteNode(url, label))
        return m

    def _no_node_reason(self, m: _Model) -> str:
        if not m.remotes:
            return "no runner configured and no remote node"
        down = ", ".join(f"{n.label} ({n.error or 'unhealthy'})" for n in m.remotes.values())
        return f"no healthy node: {down}"

    def _plan_room(self, m: _Model) -> tuple[list[_Model], dict[str, int]]:
        """The models to evict so `m` fits the budget, and its bytes per device as placed; raises NotEnoughMemory and
        evicts nothing."""
        budgets = self._device_budgets_fn() if self._device_budgets_fn is not None else None
        if budgets:
            return self._plan_on_devices(m, budgets)
        budget = self._budget_fn()
        need = m.spec.estimate_bytes
        resident = [x for x in self._models.values() if x is not m and x.resident]
        used = sum(x.resident_bytes for x in resident)
        if used + need <= budget:
            return [], m.spec.need()
        blocked, evictable = _evictable(resident)
        evictable.sort(key=lambda x: x.last_used if x.last_used is not None else float("-inf"))
        victims, freed = [], 0
        for x in evictable:
            victims.append(x)
            freed += x.resident_bytes
            if used - freed + need <= budget:
                return victims, m.spec.need()
        sizes = ", ".join(f"{x.name} {_mib(x.resident_bytes)}" + (f" ({blocked[x.name]})" if x.name in blocked else "")
                          for x in resident) or "none"
        message = (f"not enough memory for {m.name}: needs {_mib(need)}, budget {_mib(budget)}, "
                   f"resident {_mib(used)} [{sizes}]")
        if blocked:
            message += "; cannot evict " + ", ".join(f"{k} ({v})" for k, v in blocked.items())
        busy = [x for x in resident if x.name in blocked and x.state != ModelState.LOADING
                and x.spec.policy != "pinned" and x.in_flight]
        # Waiting helps when the busy models, once idle and evicted, leave room (pinned and loading ones stay).
        room_once_idle = used - freed - sum(x.resident_bytes for x in busy) + need <= budget
        raise NotEnoughMemory(message, needed_bytes=need, budget_bytes=budget,
                              resident={x.name: x.resident_bytes for x in resident}, blocked=blocked,
                              busy_only=bool(busy) and room_once_idle)

    def _plan_on_devices(self, m: _Model, budgets: dict[str, int]) -> tuple[list[_Model], dict[str, int]]:
        """_plan_room with a budget per device: a device short of room evicts only the models holding memory there."""
        need = m.spec.need()
        resident = [x for x in self._models.values() if x is not m and x.resident]
        placed = {x.name: x.placed or {RAM_DEVICE: x.resident_bytes} for x in resident}
        blocked, evictable = _evictable(resident)
        lru = sorted(evictable, key=lambda x: x.last_used if x.last_used is not None else float("-inf"))
        plan = plan_on_devices(need, budgets, placed, [x.name for x in lru])
        if plan is not None:
            where, victims = plan
            return [self._models[v] for v in victims], where
        used = used_by_device(placed)
        wanted = {d: n for d, n in need.items() if d != ANY_GPU}
        if ANY_GPU in need:
            # Shown against the GPU with the most room: where it would have gone.
            gpu = max((d for d in budgets if d != RAM_DEVICE), key=lambda d: budgets[d] - used.get(d, 0), default=None)
            if gpu is not None:
                wanted[gpu] = wanted.get(gpu, 0) + need[ANY_GPU]
        short = short_devices(wanted, budgets, used) or wanted
        device = max(short, key=short.get)
        on = ", ".join(f"{d} needs {_mib(n)} beside {_mib(used.get(d, 0))} of {_mib(budgets.get(d, 0))}"
                       for d, n in wanted.items() if d in short)
        sizes = ", ".join(f"{x.name} {' + '.join(f'{_mib(n)} {d}' for d, n in placed[x.name].items() if n)}"
                          + (f" ({blocked[x.name]})" if x.name in blocked else "") for x in resident) or "none"
        message = f"not enough memory for {m.name}: {on}; resident [{sizes}]"
        if blocked:
            message += "; cannot evict " + ", ".join(f"{k} ({v})" for k, v in blocked.items())
        busy = [x for x in resident if x.name in blocked and x.state != ModelState.LOADING
                and x.spec.policy != "pinned" and x.in_flight]
        # Waiting helps when the busy models, once idle and evicted, leave room (pinned and loading ones stay).
        once_idle = plan_on_devices(need, budgets, placed, [x.name for x in lru + busy]) is not None
        raise NotEnoughMemory(message, needed_bytes=wanted.get(device, 0), budget_bytes=budgets.get(device, 0),
                              resident={x.name: x.resident_bytes for x in resident}, blocked=blocked,
                              busy_only=bool(busy) and once_idle)

    def _load(self, m: _Model, spec: ModelSpec, done: Future, reason: str) -> None:
        """Start `m`'s runner (the caller owns the load) and settle `done` for everyone waiting."""
        # A key of its own per start: only serve can call the runner, not any other process on the host.
        runner = RunnerProcess(spec.runner, on_exit=self._runner_exited, api_key=new_runner_key())
        with self._lock:
            m.starting = runner
        try:
            runner.start(self.start_timeout_s)
        except RunnerStartFailed as exc:
            tail = exc.log_tail[-ERROR_LOG_LINES:]
            with self._lock:
                closed = self._closed
                if closed:
                    m.state, m.loading, m.starting, m.resident_bytes = ModelState.UNLOADED, None, None, 0
            if closed:
                done.set_exception(ModelLoadFailed(m.name, "Hearth is shutting down"))
                return
            with self._lock:
                m.state, m.loading, m.starting = ModelState.FAILED, None, None
                m.last_runner, m.resident_bytes = runner, 0
                m.error, m.error_log, m.returncode = exc.reason, tail, runner.returncode
                m.failed_at, m.failed_key, m.failure = self._clock(), _load_key(m.spec), str(exc)
            event = ResidencyEvent(m.name, "load_failed", "\n".join([exc.reason, *tail]), node=LOCAL,
                                   estimate_bytes=spec.estimate_bytes, pid=runner.pid)
            self._emit([event])
            done.set_exception(ModelLoadFailed(m.name, str(exc)))
            return
        measured = runner.rss_bytes()
        events = []
        with self._lock:
            m.starting = None
            m.loading = None
            if self._closed:
                m.state = ModelState.UNLOADED
                closed = True
            else:
                closed = False
                m.state, m.runner, m.last_runner = ModelState.READY, runner, runner
                m.local = _Node(LOCAL, runner.url, RemoteNode(runner.url, LOCAL), runner=runner)
                m.cold_start_ms, m.measured_bytes = runner.cold_start_ms, measured
                m.error, m.error_log, m.returncode = None, [], None
                m.last_used = self._clock()
                split = runner.load_split
                load_event = ResidencyEvent(m.name, "load", reason, node=LOCAL, cold_start_ms=runner.cold_start_ms,
                                            estimate_bytes=spec.estimate_bytes, measured_bytes=measured,
                                            pid=runner.pid, **split.event_fields())
                events.append(load_event)
                m.first_use = load_event if split.measured_by_runner else None
                # It may have died before it was ours to watch: its exit report found nobody.
                if not runner.alive:
                    events.append(self._mark_crashed(m, runner))
        self._emit(events)
        if closed:
            runner.stop()
            done.set_exception(ModelLoadFailed(m.name, "Hearth is shutting down"))
        else:
            done.set_result(None)

    def _choose(self, m: _Model, nodes: list[_Node], failure: ResidencyError | None) -> Lease | None:
        """Lease the best of `nodes`, probing outside the lock; None if the model's nodes changed meanwhile."""
        for n in nodes:
            if not n.local and (not n.checked or not n.healthy):
                self._probe(n)
        live = [n for n in nodes if n.healthy]
        if len(live) > 1:
            for n in live:
                n.load = n.probe.load()
        with self._lock:
            current = m.nodes()
            if any(n not in current for n in nodes) or (m.local is not None and m.local not in nodes):
                return None
            live = [n for n in nodes if n.healthy]
            if not live:
                raise failure or ModelLoadFailed(m.name, self._no_node_reason(m))
            # A node that said 503 (loading, or full) last is used only when no other can serve.
            # Reported load lags behind the leases just handed out: never count fewer than ours.
            best = min(live, key=lambda n: (n.probe.busy, n.in_flight if n.load is None else max(n.load, n.in_flight),
                                            0 if n.local else 1, n.label))
            best.in_flight += 1
            m.in_flight += 1
            m.last_used = self._clock()
            return Lease(self, m, best)

    def _probe(self, n: _Node) -> None:
        """Health-check one remote node (outside the lock)."""
        ok = n.probe.healthy()
        with self._lock:
            n.checked = True
            self._set_health(n, ok, None if ok else "health check failed")

    def _set_health(self, n: _Node, ok: bool, error: str | None) -> None:
        if ok and not n.healthy:
            log.info("node %s (%s) is healthy again", n.label, n.url)
        if not ok and n.healthy:
            log.warning("node %s (%s) is unhealthy: %s", n.label, n.url, error)
        n.healthy = ok
        n.error = error
        if not ok:
            n.retry_at = self._clock() + self.node_cooldown_s

    def _release(self, lease: Lease) -> None:
        m = lease._model
        runner = event = None
        with self._lock:
            if lease.released:
                return
            lease.released = True
            lease._node.in_flight -= 1
            m.in_flight -= 1
            m.last_used = self._clock()
            self._idle.notify_all()
            first_use = None
            if m.first_use is not None and m.runner is not None and lease.pid == m.runner.pid:
                first_use, m.first_use = (m.first_use, m.runner), None
            if m.in_flight == 0 and m.state == ModelState.READY and _ttl_s(m) == 0:
                why = "on demand" if m.client_keep_alive_s is None else "keep_alive 0 from a client"
                runner, event = self._detach(m, "unload", f"{why}: the last request finished")
        if first_use is not None and self._on_first_use is not None:
            # Before a stop below: one loopback GET, after the answer went out, on the releasing request's greenlet.
            self._complete_load(*first_use)
        if runner is not None:
            self._emit([event])
            self._stop(runner)

    def _complete_load(self, load_event: ResidencyEvent, runner: RunnerProcess) -> None:
        """Read the runner's load timings once its first request is done and hand on the completed load event."""
        split = runner.read_load_split()
        if split is None or split.first_prefill_ms is None:
            return
        try:
            self._on_first_use(dataclasses.replace(load_event, **split.event_fields()))
        except Exception:
            log.exception("completing the load event of %s failed", load_event.model_name)

    def _stop(self, runner: RunnerProcess) -> None:
        """Stop a runner and tell on_stopped once it has exited (its file's pages are then no one's mapping)."""
        runner.stop()
        if self._on_stopped is not None:
            try:
                self._on_stopped(runner.spec.model_name)
            except Exception:
                log.exception("on_stopped of %s failed", runner.spec.model_name)

    # --- failures ----------------------------------------------------------------------------

    def report_failure(self, lease: Lease, error: BaseException | str) -> None:
        """The gateway could not talk to the lease's node: mark a dead runner crashed, a remote unhealthy."""
        m, node = lease._model, lease._node
        event = None
        with self._lock:
            if node.local:
                # A live runner failed one request: not ours to judge. A dead one is a crash.
                if not node.runner.alive and m.runner is node.runner:
                    event = self._mark_crashed(m, node.runner)
            elif node in m.remotes.values():
                self._set_health(node, False, str(error) or type(error).__name__)
        if event is not None:
            self._emit([event])

    def report_busy(self, lease: Lease) -> None:
        """The lease's node answered 503 (loading or full): it stays healthy, others are preferred until its next check."""
        with self._lock:
            lease._node.probe.busy = True

    def _runner_exited(self, runner: RunnerProcess, returncode: int, expected: bool) -> None:
        if expected:
            return
        event = None
        with self._lock:
            for m in self._models.values():
                if m.runner is runner:
                    event = self._mark_crashed(m, runner)
                    break
        if event is not None:
            self._emit([event])

    def _mark_crashed(self, m: _Model, runner: RunnerProcess) -> ResidencyEvent:
        """Under the lock: the runner died; the next acquire restarts it."""
        tail = runner.log_tail(ERROR_LOG_LINES)
        m.state, m.runner, m.local, m.last_runner = ModelState.CRASHED, None, None, runner
        m.resident_bytes = 0
        m.first_use = None
        m.returncode = runner.poll()
        m.error = f"runner exited with code {m.returncode}"
        m.error_log = tail
        return ResidencyEvent(m.name, "crash", "\n".join([m.error, *tail]), node=LOCAL,
                              estimate_bytes=m.spec.estimate_bytes, measured_bytes=m.measured_bytes,
                              pid=runner.pid)

    def check_nodes(self) -> None:
        """Re-check remote nodes past their cool-down and refresh every node's reported load."""
        with self._lock:
            now = self._clock()
            nodes = [n for m in self._models.values() for n in m.nodes() if n.local or n.healthy or now >= n.retry_at]
        for n in nodes:
            ok = True if n.local else n.probe.healthy()
            load = n.probe.load() if ok else None
            with self._lock:
                n.load = load
                if not n.local:
                    n.checked = True
                    self._set_health(n, ok, None if ok else "health check failed")

    # --- unloading ---------------------------------------------------------------------------

    def _detach(self, m: _Model, event: str, reason: str) -> tuple[RunnerProcess, ResidencyEvent]:
        """Under the lock: take `m`'s runner out of service; the caller stops it outside the lock."""
        runner = m.runner
        ev = ResidencyEvent(m.name, event, reason, node=LOCAL, estimate_bytes=m.spec.estimate_bytes,
                            measured_bytes=runner.rss_bytes(), pid=runner.pid)
        m.state, m.runner, m.local, m.resident_bytes = ModelState.UNLOADED, None, None, 0
        m.client_keep_alive_s = None
        m.first_use = None
        return runner, ev

    def expire_idle(self) -> list[str]:
        """Unload keep-alive models idle past keep_alive_s, idle on-demand ones, and ones gone from the catalog."""
        catalog = self._models_fn()
        stops: list[RunnerProcess] = []
        events: list[ResidencyEvent] = []
        with self._lock:
            now = self._clock()
            for m in self._models.values():
                if m.state != ModelState.READY or m.in_flight:
                    continue
                spec = catalog.get(m.name)
                idle_s = now - (m.last_used if m.last_used is not None else now)
                ttl_s = _ttl_s(m)
                if spec is None:
                    reason = "removed from the catalog"
                elif ttl_s == 0:
                    reason = "on demand: idle" if m.client_keep_alive_s is None else "keep_alive 0 from a client: idle"
                elif ttl_s is not None and idle_s >= ttl_s:
                    whose = "keep-alive" if m.client_keep_alive_s is None else "client keep_alive"
                    reason = f"idle {idle_s:.0f} s, {whose} {ttl_s:g} s"
                else:
                    continue
                runner, event = self._detach(m, "unload", reason)
                stops.append(runner)
                events.append(event)
        self._emit(events)
        self._stop_all(stops)
        return [e.model_name for e in events]

    def set_client_keep_alive(self, name: str, keep_alive_s: float | None) -> None:
        """A client's wish for how long `name` stays resident once idle (Ollama's keep_alive): seconds,
        inf to keep it, 0 to unload it after its requests, None for the admin's setting. It lasts
        until the model is unloaded, and a pinned model stays pinned whatever a client asks."""
        if keep_alive_s is not None and keep_alive_s < 0:
            raise ValueError(f"keep_alive must be ≥ 0 s or inf (got {keep_alive_s})")
        spec = self._models_fn().get(name)
        if spec is None:
            raise UnknownModel(name)
        with self._lock:
            self._sync(spec).client_keep_alive_s = keep_alive_s

    def load(self, name: str, reason: str = "loaded by the admin") -> None:
        """Make `name` resident without leasing it (the dashboard's Load, a preload); raises ResidencyError.

        `reason` is the load event's (a restart after a crash or a failed load says so instead)."""
        self._serve(name, want_lease=False, why=reason)

    def unload(self, name: str, reason: str = "unloaded by the admin") -> bool:
        """Stop `name`'s local runner now; False if it was not resident; ModelBusy while loading or serving."""
        with self._lock:
            m = self._models.get(name)
            if m is None or m.state not in RESIDENT_STATES:
                return False
            if m.state == ModelState.LOADING:
                raise ModelBusy(f"{name} is still loading; unload it once it is ready")
            if m.in_flight:
                raise ModelBusy(f"{name} is serving {m.in_flight} request(s); unload it when they finish")
            runner, event = self._detach(m, "unload", reason)
        self._emit([event])
        self._stop(runner)
        return True

    def start_pinned(self) -> dict[str, str | None]:
        """Load every pinned model with a local runner; name → None, or the reason it failed."""
        results: dict[str, str | None] = {}
        for name, spec in self._models_fn().items():
            if spec.policy != "pinned" or spec.runner is None:
                continue
            try:
                self._serve(name, want_lease=False)
                results[name] = None
            except ResidencyError as exc:
                log.error("pinned model %s not loaded: %s", name, exc)
                results[name] = str(exc)
        return results

    def shutdown(self) -> None:
        """Stop every runner, loading ones included; later acquires fail."""
        stops: list[RunnerProcess] = []
        events: list[ResidencyEvent] = []
        with self._lock:
            self._closed = True
            self._idle.notify_all()  # a load waiting for a busy model is refused now, not at its deadline
            for m in self._models.values():
                if m.state == ModelState.READY:
                    runner, event = self._detach(m, "unload", "shutdown")
                    stops.append(runner)
                    events.append(event)
                if m.starting is not None:
                    stops.append(m.starting)
        self._emit(events)
        self._stop_all(stops)

    def _stop_all(self, runners: Iterable[RunnerProcess]) -> None:
        threads = [threading.Thread(target=self._stop, args=(r,), name=f"stop-{r.spec.model_name}") for r in runners]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _emit(self, events: list[ResidencyEvent]) -> None:
        # A separate lock keeps events in order without holding the state lock while recording.
        with self._emit_lock:
            for event in events:
                log.info("residency %s %s: %s", event.event, event.model_name, event.reason.splitlines()[0])
                try:
                    self._on_event(event)
                except Exception:
                    log.exception("recording residency event %s failed", event)

    # --- reading -----------------------------------------------------------------------------

    def device_status(self) -> dict[str, dict]:
        """Per device of the budget per device ("CPU" is RAM): its usable bytes, the bytes resident models hold there
        (Hearth's count, as placed) and each model's share; empty without a budget per device."""
        budgets = self._device_budgets_fn() if self._device_budgets_fn is not None else {}
        if not budgets:
            return {}
        with self._lock:
            placed = {m.name: m.placed or {RAM_DEVICE: m.resident_bytes} for m in self._models.values() if m.resident}
        out = {d: {"budget_bytes": b, "used_bytes": 0, "models": {}} for d, b in budgets.items()}
        for name, by_device in sorted(placed.items()):
            for device, n in by_device.items():
                row = out.setdefault(device, {"budget_bytes": 0, "used_bytes": 0, "models": {}})
                row["used_bytes"] += n
                row["models"][name] = n
        return out

    def status(self) -> list[dict]:
        """Every model in the catalog or resident: state, policy, nodes, memory, in-flight, log tail."""
        catalog = self._models_fn()
        with self._lock:
            for spec in catalog.values():
                self._sync(spec)
            models = [m for m in self._models.values() if m.name in catalog or m.resident]
            now = self._clock()
            rows = []
            for m in sorted(models, key=lambda m: m.name):
                runner = m.runner or m.starting or m.last_runner
                state = m.state
                if m.spec.runner is None:
                    state = ModelState.READY if any(n.healthy for n in m.remotes.values()) else ModelState.FAILED
                rows.append({
                    "name": m.name,
                    "state": state,
                    "policy": m.spec.policy,
                    "keep_alive_s": m.spec.keep_alive_s,
                    "client_keep_alive_s": m.client_keep_alive_s,
                    # Seconds until an idle expiry unloads it: None never (pinned, inf, remote-only).
                    "expires_in_s": _expires_in_s(m, now),
                    "estimate_bytes": m.spec.estimate_bytes,
                    # Bytes per device of its resident runner ("CPU" is RAM); empty when not resident.
                    "placed": dict(m.placed) if m.resident else {},
                    "measured_bytes": m.measured_bytes,
                    "rss_bytes": m.runner.rss_bytes() if m.runner else None,
                    "pid": runner.pid if runner is not None and m.state in RESIDENT_STATES else None,
                    "in_flight": m.in_flight,
                    "last_used": m.last_used,
                    "idle_s": now - m.last_used if m.last_used is not None else None,
                    "cold_start_ms": m.cold_start_ms,
                    "loading_s": now - m.loading_since if m.state == ModelState.LOADING and m.loading_since is not None else None,
                    "error": m.error,
                    "returncode": m.returncode,
                    "nodes": [{"label": n.label, "url": n.url, "local": n.local, "healthy": n.healthy,
                               "load": n.load, "in_flight": n.in_flight, "error": n.error} for n in m.nodes()],
                    "log_tail": runner.log_tail(STATUS_LOG_LINES) if runner is not None else list(m.error_log),
                })
        return rows


def _load_key(spec: ModelSpec) -> tuple:
    """What a load tried: the spec, and its file's size and mtime (a file replaced in place is a new try)."""
    try:
        st = os.stat(spec.path) if spec.path else None
    except OSError:
        st = None
    return spec, (st.st_size, st.st_mtime_ns) if st else None


def _evictable(resident: list[_Model]) -> tuple[dict[str, str], list[_Model]]:
    """Why each resident model that cannot be evicted now stays (loading, pinned, busy), and the ones that can."""
    blocked: dict[str, str] = {}
    evictable = []
    for x in resident:
        if x.state == ModelState.LOADING:
            blocked[x.name] = "loading"
        elif x.spec.policy == "pinned":
            blocked[x.name] = "pinned"
        elif x.in_flight:
            blocked[x.name] = f"busy: {x.in_flight} in flight"
        else:
            evictable.append(x)
    return blocked, evictable
