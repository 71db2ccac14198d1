"""Prometheus metrics of the daemon, in a registry of their own.

One `Metrics` object per daemon (tests make as many as they like: nothing goes to prometheus_client's
global registry), made before the parts it observes: each is built with it as its observer, and
none of them imports this module. The stub calls ``request_done`` and ``reconnecting``
(`nri_plugin.nri.stub.StubObserver`), the mixed-CPU plugin ``cgroup_write_failed`` and ``healed``
(`nri_plugin.mixedcpu.plugin.PluginObserver`), the device plugin ``registration_done``
(`nri_plugin.deviceplugin.server.RegistrationObserver`), the pod-resources client
``pod_resources_lookup`` (`nri_plugin.deviceplugin.podresources.PodResourcesObserver`), the probe
server ``probe_connection_evicted`` (`nri_plugin.daemon.probes.ProbeObserver`); the stub also calls
``synchronized``, and the plugin ``creation_decided`` (`nri_plugin.mixedcpu.plugin.CreationObserver`).
Gauges are read from their owners when scraped, through callables bound once the owners exist
(``track``; `nri_plugin.daemon.wiring` does it): the shared-container count from the plugin's books,
readiness from the stub and the device plugin, so they cannot drift from what they describe and
cost nothing per request. Which optional parts run (device plugin, PodResources, DRA and its
ResourceSlice publisher) is set once (``features``), for alerts to be silent where a part is off.

| metric | type | labels | meaning |
|---|---|---|---|
| `mixed_cpu_nri_requests_total` | counter | `event`, `outcome` | NRI requests answered |
| `mixed_cpu_nri_request_duration_seconds` | histogram | `event` | time to answer one, 100 µs to 2 s |
| `mixed_cpu_shared_containers` | gauge | | containers holding the shared CPUs now |
| `mixed_cpu_cgroup_write_failures_total` | counter | `kind` | cgroup quota writes that failed (writes only) |
| `mixed_cpu_heals_total` | counter | `kind` | books or quotas put right by the reconciler |
| `mixed_cpu_nri_reconnects_total` | counter | | connections to the runtime lost (then retried) |
| `mixed_cpu_device_plugin_registrations_total` | counter | `outcome` | registrations with kubelet |
| `mixed_cpu_nri_ready` | gauge | | 1 while registered with the runtime and synchronized |
| `mixed_cpu_kubelet_registered` | gauge | | 1 while kubelet holds our registration (0 when off) |
| `mixed_cpu_dra_registered` | gauge | | 1 while kubelet holds the DRA driver's registration (0 when off) |
| `mixed_cpu_dra_resource_slices_published` | gauge | | 1 while the API server holds the node's pool |
| `mixed_cpu_device_plugin_enabled` | gauge | | 1 when the config turns the device plugin on |
| `mixed_cpu_pod_resources_enabled` | gauge | | 1 when kubelet's PodResources API is asked |
| `mixed_cpu_dra_enabled` | gauge | | 1 when the config turns the DRA front door on |
| `mixed_cpu_dra_publishing_enabled` | gauge | | 1 when the daemon publishes the node's ResourceSlices |
| `mixed_cpu_pod_resources_lookups_total` | counter | `outcome` | questions to kubelet's PodResources API |
| `mixed_cpu_pod_resources_reachable` | gauge | | 1 while kubelet's record proves requests (0: marker alone) |
| `mixed_cpu_pod_resources_degraded` | gauge | | 1 while List (no Get) or the marker alone proves |
| `mixed_cpu_probe_connections_evicted_total` | counter | `reason` | probe connections closed for newer ones |
| `mixed_cpu_shared_creations_total` | counter | `outcome` | creations that asked: granted, or refused |
| `mixed_cpu_nri_synchronize_pods` | gauge | | pods the runtime listed at its last Synchronize |
| `mixed_cpu_nri_synchronize_containers` | gauge | | containers it listed then |
| `mixed_cpu_nri_synchronize_bytes` | gauge | | that Synchronize's size, all chunks |
| `mixed_cpu_nri_synchronize_duration_seconds` | gauge | | how long it took, first chunk to answer |
| `mixed_cpu_nri_synchronize_timestamp_seconds` | gauge | | when it ended (Unix time; 0: none yet) |
| `mixed_cpu_nri_configure_duration_seconds` | gauge | | how long the last Configure took |
| `mixed_cpu_nri_configure_timestamp_seconds` | gauge | | when it ended (Unix time; 0: none yet) |
| `process_resident_memory_bytes`, `process_cpu_seconds_total`, ... | | | the daemon process (Linux) |

The Grafana dashboard (``packaging/helm/mixed-cpu-nri-plugin/dashboards/``) queries only these names.

Labels:

* `event`: `configure`, `synchronize` (each chunk of a chunked one), `shutdown`, or the plugin
  handler an event goes to (`create_container`, `update_container`, `stop_container`,
  `remove_container`, `remove_pod_sandbox`, ...), whether it came on its own method or in a
  StateChange; `unknown` for a StateChange event number we do not know.
* `outcome` of a request: `ok` (answered), `error` (the runtime got an error status, e.g. a
  container refused for a wrong request), `cancelled` (the connection closed or the runtime's
  deadline passed first). Of a registration: `ok`, or `failed` (kubelet refused, or our socket
  could not be served).
* `kind`: `pod_quota_raise` (at a creation, which is then refused; or at Synchronize),
  `pod_quota_lower` (retried later; on cgroup v1 a few are normal right after a container stops),
  `pod_quota_restore` (putting the pod quota back after a failed creation),
  `container_quota_lower` (a stopped container's own quota put back). Only writes count: a pod
  cgroup that cannot be opened or read is never written (its creation counts as refused for
  `cgroup` in `mixed_cpu_shared_creations_total`).
* `kind` of a heal (`nri_plugin.mixedcpu.heal`): `pod_gone` (a pod's cgroup gone, or the runtime
  no longer lists it, with no end reported: its books and device bindings dropped),
  `container_never_created` (the runtime showed the creation over without a container: on CRI-O no
  cgroup `creation_timeout` after CreateContainer; on containerd its cgroup gone after
  StartContainer), `container_gone` (the runtime's Synchronize no longer runs a
  container we held), `pod_quota` (a pod quota found off its target and brought back).
* `outcome` of a pod-resources lookup (`nri_plugin.deviceplugin.podresources`, asked for each
  container that presents an allocation marker): `ok` (kubelet's record decided, by Get), `list`
  (kubelet's record decided, by List: kubelet does not serve Get), `unavailable` (no socket or no
  answer: the marker binding alone decided).
* `reason` of a probe connection evicted (`nri_plugin.daemon.probes`): `peer_limit` (its source
  address already held 8 connections: it gave up its oldest), `total_limit` (64 were open: the oldest
  that said nothing, else the oldest still sending, gave way), `hard_limit` (256 open, none of them
  having had its chance to be read yet: new connections come faster than the loop reads them). Any
  rise means something holds the port's connections open (the warning log line names the last
  address); kubelet's probes and the scrape still get through.
* `outcome` of a creation that proved a request for the shared CPUs (`nri_plugin.mixedcpu.plugin`):
  `granted`, or why it was refused: `pod_spec` (the pod spec must change: no exclusive CPUs, no
  limit, ...), `node` (the node's setup must: an empty pool, a cpuset the runtime garbled), `cgroup`
  (the pod cgroup could not be opened or read, or its quota not raised), `state_file` (the books
  could not be saved). Every refused creation counts here once, whatever its reason: the one
  metric to alert on for refusals. A creation the runtime gave up waiting for counts
  in none (the request's own `outcome` is then `cancelled`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from nri_plugin.daemon.probes import EVICTION_REASONS
from nri_plugin.mixedcpu.heal import HEAL_KINDS

__all__ = [
    "CREATION_OUTCOMES",
    "DURATION_BUCKETS",
    "EVICTION_REASONS",
    "HEAL_KINDS",
    "WRITE_FAILURE_KINDS",
    "Metrics",
]

# From 100 µs (a cheap event) to 2 s, the runtime's default request deadline.
DURATION_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
)
WRITE_FAILURE_KINDS = ("pod_quota_raise", "pod_quota_lower", "pod_quota_restore", "container_quota_lower")
REGISTRATION_OUTCOMES = ("ok", "failed")
LOOKUP_OUTCOMES = ("ok", "list", "unavailable")
CREATION_OUTCOMES = ("granted", "pod_spec", "node", "cgroup", "state_file")


class Metrics:
    """The daemon's metrics; see the module docstring for the list."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "mixed_cpu_nri_requests",
            "NRI requests answered, by event and outcome.",
            ["event", "outcome"],
            registry=r,
        )
        self.duration = Histogram(
            "mixed_cpu_nri_request_duration_seconds",
            "Time to answer an NRI request, by event.",
            ["event"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.shared_containers = Gauge(
            "mixed_cpu_shared_containers", "Containers holding the shared CPUs.", registry=r
        )
        self.write_failures = Counter(
            "mixed_cpu_cgroup_write_failures",
            "Cgroup quota writes that failed, by kind.",
            ["kind"],
            registry=r,
        )
        self.heals = Counter(
            "mixed_cpu_heals",
            "Books or quotas put right by the reconciler (what the runtime did not report), by kind.",
            ["kind"],
            registry=r,
        )
        self.reconnects = Counter(
            "mixed_cpu_nri_reconnects", "Connections to the runtime lost and reconnected.", registry=r
        )
        self.registrations = Counter(
            "mixed_cpu_device_plugin_registrations",
            "Device plugin registrations with kubelet, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.nri_ready = Gauge(
            "mixed_cpu_nri_ready", "1 while registered with the runtime and synchronized.", registry=r
        )
        self.kubelet_registered = Gauge(
            "mixed_cpu_kubelet_registered", "1 while registered with kubelet.", registry=r
        )
        self.dra_registered = Gauge(
            "mixed_cpu_dra_registered", "1 while kubelet holds the DRA driver's registration.", registry=r
        )
        self.dra_resource_slices_published = Gauge(
            "mixed_cpu_dra_resource_slices_published",
            "1 while the API server holds the node's ResourceSlices as the daemon last published them.",
            registry=r,
        )
        self.device_plugin_enabled = Gauge(
            "mixed_cpu_device_plugin_enabled",
            "1 when the config turns the device plugin on ([device_plugin] enabled).",
            registry=r,
        )
        self.pod_resources_enabled = Gauge(
            "mixed_cpu_pod_resources_enabled",
            "1 when kubelet's PodResources API is asked (pod_resources_socket set, markers trusted).",
            registry=r,
        )
        self.dra_enabled = Gauge(
            "mixed_cpu_dra_enabled",
            "1 when the config turns the DRA front door on ([dra] enabled).",
            registry=r,
        )
        self.dra_publishing_enabled = Gauge(
            "mixed_cpu_dra_publishing_enabled",
            "1 when the daemon publishes the node's ResourceSlices ([dra] enabled, publish_resource_slices).",
            registry=r,
        )
        self.pod_resources_lookups = Counter(
            "mixed_cpu_pod_resources_lookups",
            "Questions to kubelet's PodResources API about a container's devices, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.pod_resources_reachable = Gauge(
            "mixed_cpu_pod_resources_reachable",
            "1 while kubelet's PodResources API proves requests; 0: the allocation marker alone does.",
            registry=r,
        )
        self.pod_resources_degraded = Gauge(
            "mixed_cpu_pod_resources_degraded",
            "1 while requests are proven by List (kubelet does not serve Get) or the marker alone.",
            registry=r,
        )
        self.probe_evictions = Counter(
            "mixed_cpu_probe_connections_evicted",
            "Connections to the metrics and probe port closed to make room for newer ones, by reason.",
            ["reason"],
            registry=r,
        )
        self.creations = Counter(
            "mixed_cpu_shared_creations",
            "Creations that proved a request for the shared CPUs: granted, or refused and why.",
            ["outcome"],
            registry=r,
        )
        self.sync_pods = Gauge(
            "mixed_cpu_nri_synchronize_pods", "Pods the runtime listed at its last Synchronize.", registry=r
        )
        self.sync_containers = Gauge(
            "mixed_cpu_nri_synchronize_containers",
            "Containers the runtime listed at its last Synchronize.",
            registry=r,
        )
        self.sync_bytes = Gauge(
            "mixed_cpu_nri_synchronize_bytes",
            "Size of the last Synchronize, all of its chunks, as received.",
            registry=r,
        )
        # The last Synchronize and Configure, kept: a daemon is synchronized a fraction of a second
        # after it starts, before any scrape, so a rate() over the histogram never shows that one.
        self.sync_duration = Gauge(
            "mixed_cpu_nri_synchronize_duration_seconds",
            "How long the last Synchronize took, from its first chunk to the answer.",
            registry=r,
        )
        self.sync_timestamp = Gauge(
            "mixed_cpu_nri_synchronize_timestamp_seconds",
            "When the last Synchronize ended, in seconds since the epoch (0: none yet).",
            registry=r,
        )
        self.configure_duration = Gauge(
            "mixed_cpu_nri_configure_duration_seconds", "How long the last Configure took.", registry=r
        )
        self.configure_timestamp = Gauge(
            "mixed_cpu_nri_configure_timestamp_seconds",
            "When the last Configure ended, in seconds since the epoch (0: none yet).",
            registry=r,
        )
        # RSS, CPU time, open files of the daemon (read from /proc/self at each scrape).
        ProcessCollector(registry=r)
        for kind in WRITE_FAILURE_KINDS:
            self.write_failures.labels(kind)
        for kind in HEAL_KINDS:
            self.heals.labels(kind)
        for outcome in REGISTRATION_OUTCOMES:
            self.registrations.labels(outcome)
        for outcome in LOOKUP_OUTCOMES:
            self.pod_resources_lookups.labels(outcome)
        for reason in EVICTION_REASONS:
            self.probe_evictions.labels(reason)
        # Each outcome's child, made once (a label lookup takes a lock and builds tuples).
        self._creation_children = {outcome: self.creations.labels(outcome) for outcome in CREATION_OUTCOMES}
        # Label lookups take a lock and build tuples; a request pays a dict lookup instead.
        self._request_children: dict[tuple[str, str], tuple[Counter, Histogram]] = {}

    # -- what the parts report (the observer protocols) ------------------------------------------------

    def request_done(self, event: str, outcome: str, seconds: float) -> None:
        children = self._request_children.get((event, outcome))
        if children is None:
            children = (self.requests.labels(event, outcome), self.duration.labels(event))
            self._request_children[(event, outcome)] = children
        children[0].inc()
        children[1].observe(seconds)
        if event == "configure" and outcome == "ok":
            self.configure_duration.set(seconds)
            self.configure_timestamp.set(time.time())

    def reconnecting(self) -> None:
        self.reconnects.inc()

    def cgroup_write_failed(self, kind: str) -> None:
        self.write_failures.labels(kind).inc()

    def healed(self, kind: str) -> None:
        self.heals.labels(kind).inc()

    def registration_done(self, outcome: str) -> None:
        self.registrations.labels(outcome).inc()

    def pod_resources_lookup(self, outcome: str) -> None:
        self.pod_resources_lookups.labels(outcome).inc()

    def probe_connection_evicted(self, reason: str) -> None:
        self.probe_evictions.labels(reason).inc()

    def creation_decided(self, outcome: str) -> None:
        child = self._creation_children.get(outcome)
        if child is None:
            child = self._creation_children[outcome] = self.creations.labels(outcome)
        child.inc()

    def synchronized(self, pods: int, containers: int, size: int, seconds: float) -> None:
        self.sync_pods.set(pods)
        self.sync_containers.set(containers)
        self.sync_bytes.set(size)
        self.sync_duration.set(seconds)
        self.sync_timestamp.set(time.time())

    def features(self, *, device_plugin: bool, pod_resources: bool, dra: bool, dra_publishing: bool) -> None:
        """Which optional parts the daemon runs: an alert on one of their gauges (registered,
        reachable, published) is silent on a node where the part is off (its gauge then reads 0 too)."""
        self.device_plugin_enabled.set(device_plugin)
        self.pod_resources_enabled.set(pod_resources)
        self.dra_enabled.set(dra)
        self.dra_publishing_enabled.set(dra_publishing)

    # -- gauges read at scrape time --------------------------------------------------------------------

    def track(
        self,
        *,
        shared_containers: Callable[[], int] | None = None,
        nri_ready: Callable[[], bool] | None = None,
        kubelet_registered: Callable[[], bool] | None = None,
        pod_resources_reachable: Callable[[], bool] | None = None,
        pod_resources_degraded: Callable[[], bool] | None = None,
        dra_registered: Callable[[], bool] | None = None,
        dra_resource_slices_published: Callable[[], bool] | None = None,
    ) -> None:
        """Read these gauges from their owners whenever the metrics are rendered (a gauge not
        tracked stays 0: ``kubelet_registered`` with the device plugin off)."""
        for gauge, read in (
            (self.shared_containers, shared_containers),
            (self.nri_ready, nri_ready),
            (self.kubelet_registered, kubelet_registered),
            (self.pod_resources_reachable, pod_resources_reachable),
            (self.pod_resources_degraded, pod_resources_degraded),
            (self.dra_registered, dra_registered),
            (self.dra_resource_slices_published, dra_resource_slices_published),
        ):
            if read is not None:
                gauge.set_function(_as_float(read))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (serve as ``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)


def _as_float(read: Callable[[], int] | Callable[[], bool]) -> Callable[[], float]:
    return lambda: float(read())
