"""The mixed-CPU policy: pure functions from NRI objects and bookkeeping to decisions. No I/O.

Who gets shared CPUs: a container whose request is *proven* by a trusted source (`check_request`):

* the signed allocation marker, backed by kubelet's own record when it answers
  (`nri_plugin.mixedcpu.allocations`): the device ids kubelet's PodResources API says it allocated
  to this very container are the proof, and a marker on a container kubelet gave none is refused,
  however valid its signature (replayed, harvested from kubelet's checkpoint, or planted). When
  kubelet does not answer (not configured, its socket missing, an error), the marker alone: verified
  with the node's `HostKey`; a forged value is refused, a DRA marker presented outside the pods its
  claim was reserved for is refused, and so is a valid one whose allocation another slot (pod and
  container name, see `nri_plugin.mixedcpu.books`) presented first, unless the marker's own
  allocation is newer: kubelet's newest allocation of a device wins (a fresh ``Allocate`` or DRA
  prepare is kubelet's word that the previous holder is gone), and the same or an older allocation
  in another slot is a copy, refused whether its first holder still runs or not. The marker is found
  in ``container.annotations`` (the device plugin's ``Allocate`` answer) or, for a request served
  through DRA, in the container's env as ``MIXED_CPU_SHARED_CPUS_ALLOCATION=<marker>`` (set by our
  DRA driver's CDI spec; its device id is ``dra.<device name>``). Both get the same checks; a
  container with both is judged by the annotation;
* when enabled in the config, the pod annotation ``cpu-shared.crio.io/<container name>: enable``
  that OpenShift's admission plugin adds.

An ``OPENSHIFT_SHARED_CPUS`` / ``OPENSHIFT_ISOLATED_CPUS`` (or the older ``OPENSHIFT_MUTUAL_CPUS``)
variable in the container's env is never proof: anyone writing a pod spec can set it. (So can they
the marker's env entry; but not its signature, and kubelet's record or the binding still decide.)

What a proven container gets (`plan_create`): cpus = exclusive | shared; CFS quota = n(cpus) * its
period (an unlimited quota stays unlimited); both sets in its environment, canonical, replacing what
the pod author set. Only the fields that change are set in the adjustment. Its pod's quota gains
n(shared) * the pod's period (`pod_quota_target`). A requesting container that has no exclusive CPUs
(not Guaranteed, a fractional CPU request, an empty cpuset, a cpuset inside the shared pool) or a
node with an empty shared pool is a `PolicyError` whose message says why and how to fix the pod spec.

NUMA-local shared CPUs (opt-in, `SharedPool.numa_nodes`): "shared" above then means the shared CPUs on
the NUMA nodes of the container's exclusive CPUs (`choose_shared`), in its cpus, quota, environment and
pod quota share alike; a container whose nodes hold no shared CPU gets the whole pool, and the choice
says why.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Literal, NamedTuple, Protocol

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups.cpuset import CpusetError
from nri_plugin.cgroups.cpuset import format as _format_cpus
from nri_plugin.cgroups.cpuset import parse as parse_cpuset
from nri_plugin.deviceplugin.marker import ANNOTATION_KEY as MARKER_ANNOTATION
from nri_plugin.deviceplugin.marker import DRA_ID_PREFIX, MARKER_ENV
from nri_plugin.mixedcpu.books import Slot, Spent

__all__ = [
    "DEFAULT_CFS_PERIOD",
    "ISOLATED_ENV",
    "LEGACY_SHARED_ENV",
    "MARKER_ANNOTATION",
    "MARKER_ENV",
    "POD_ANNOTATION_PREFIX",
    "SHARED_ENV",
    "CreatePlan",
    "MarkerKey",
    "NumaNodes",
    "PolicyError",
    "Proof",
    "RequestCheck",
    "SharedChoice",
    "SharedPool",
    "SyncPlan",
    "UpdatePlan",
    "baseline_from_pod_resources",
    "baseline_from_resources",
    "check_pod_resources",
    "check_request",
    "choose_shared",
    "container_slot",
    "cpus_or_empty",
    "describe",
    "exclusive_cpus",
    "format_cpuset",
    "plan_create",
    "plan_sync",
    "plan_update",
    "pod_key",
    "pod_quota_target",
    "presents_marker",
    "shared_by_node",
    "shows_evidence",
]

SHARED_ENV: Final = "OPENSHIFT_SHARED_CPUS"
ISOLATED_ENV: Final = "OPENSHIFT_ISOLATED_CPUS"
# The variable the first OpenShift mixed-CPU device plugins put in a container's env; pod specs written
# for them may still set it. Never proof either, and never set by us: only noted.
LEGACY_SHARED_ENV: Final = "OPENSHIFT_MUTUAL_CPUS"
# What the three names above begin with: an env without it sets none of them.
_ENV_PREFIX: Final = "OPENSHIFT_"
# The env entries of the DRA marker, up to their value: the DRA driver's specs set one per device,
# MIXED_CPU_SHARED_CPUS_ALLOCATION_<DEVICE>= (CDI merges env entries by name); specs written before
# that set the bare name.
_MARKER_ENV_DEVICE: Final = MARKER_ENV + "_"
POD_ANNOTATION_PREFIX: Final = "cpu-shared.crio.io/"
POD_ANNOTATION_VALUE: Final = "enable"
REQUEST_RESOURCE: Final = "workload.openshift.io/enable-shared-cpus"
# The kernel's default CFS period, used when neither the request nor the container carries one.
DEFAULT_CFS_PERIOD: Final = 100_000
# kubelet maps milli-CPUs to shares as milli * 1024 / 1000: whole CPUs are multiples of 1024.
SHARES_PER_CPU: Final = 1024

_GUARANTEED_FIX: Final = (
    "give every container of the pod CPU and memory limits equal to its requests (Guaranteed QoS) "
    "and this container a whole number of CPUs"
)


class PolicyError(Exception):
    """A request for shared CPUs that cannot be honoured; the message says why and what to fix.

    `kind` is ``"pod-spec"`` when the pod spec must change, ``"node"`` when the node's setup must.
    """

    def __init__(self, message: str, *, kind: Literal["pod-spec", "node"] = "pod-spec") -> None:
        super().__init__(message)
        self.kind = kind


# -- identities --------------------------------------------------------------------------------------


def pod_key(pod: api.PodSandbox) -> str:
    """How the books name a pod: its UID (stable across sandbox re-creation), else the sandbox id."""
    return pod.uid or pod.id


def container_slot(pod: api.PodSandbox, container: api.Container) -> Slot:
    return Slot(pod_key(pod), container.name or container.id)


@functools.lru_cache(maxsize=4096)
def _format_known(cpus: frozenset[int]) -> str:
    return _format_cpus(cpus)


def format_cpuset(cpus: frozenset[int]) -> str:
    """`cgroups.cpuset.format`, remembered: a node's containers keep to a few CPU sets, and every
    creation formats three of them (its cpus, its exclusive and its shared ones)."""
    try:
        return _format_known(cpus)
    except TypeError:  # a set, not a frozenset: not remembered
        return _format_cpus(cpus)


def describe(pod: api.PodSandbox, container: api.Container | None = None) -> str:
    """``namespace/pod/container`` for messages."""
    text = f"{pod.namespace or '-'}/{pod.name or pod.id}"
    return f"{text}/{container.name or container.id}" if container is not None else text


# -- proof of request ---------------------------------------------------------------------------------


class Proof(NamedTuple):
    """Why we believe the container asked for shared CPUs (a named tuple: immutable, made in C)."""

    source: Literal["device-plugin", "kubelet", "pod-annotation"]
    device: str | None = None
    allocation: int = 0  # the marker's allocation number, for the books' `spent` entry

    def __str__(self) -> str:
        if self.source == "kubelet":
            return f"kubelet's allocation ({self.device})"
        if self.device is None:
            return "pod annotation"
        # The same source either way (a signed marker, bound to its device id); a DRA device's id
        # tells where it came from.
        kind = "DRA marker" if self.device.startswith(DRA_ID_PREFIX) else "device-plugin marker"
        return f"{kind} ({self.device})"


class RequestCheck(NamedTuple):
    """The outcome of `check_request`: a proof, or none. `refusals` say which evidence was refused
    as forged or replayed (worth a warning); `notes` what else was ignored and why. (A named tuple:
    immutable, made in C at every event.)"""

    proof: Proof | None
    notes: tuple[str, ...] = ()
    refusals: tuple[str, ...] = ()
    # A device id when the marker was refused only because that device is bound to a container of
    # another pod the same claim was reserved for: it is granted once that binding ends.
    waits_for: str | None = None


_BY_ANNOTATION: Final = Proof("pod-annotation")


class Signed(Protocol):
    """What a valid marker says (`nri_plugin.deviceplugin.marker.Signed`)."""

    @property
    def device(self) -> str: ...
    @property
    def allocation(self) -> int: ...
    @property
    def pods(self) -> frozenset[str]: ...


class MarkerKey(Protocol):
    """What checks an allocation marker: the node's `HostKey` (`nri_plugin.deviceplugin.marker`)."""

    def read(self, value: str) -> Signed | None:
        """What the marker says; None for a marker not made with this key."""


def check_request(
    pod: api.PodSandbox,
    container: api.Container,
    *,
    marker_key: MarkerKey | None,
    trust_pod_annotation: bool,
    device_holders: Mapping[str, Slot],
    kubelet_devices: frozenset[str] | None = None,
    spent: Mapping[str, Spent] | None = None,
) -> RequestCheck:
    """Does a trusted source prove that this container asked for shared CPUs?

    `marker_key` is None when the allocation marker (annotation or DRA env entry, `presents_marker`)
    is not a trusted source. `device_holders` maps device ids to the slots they are bound to
    (`Books.device_holders`), `spent` to the newest allocation presented (`Books.spent`; a bound
    device missing from it counts as allocation 0 of its holder; `spent` None: allocations are not
    compared, a device bound to another slot is refused whatever its marker). `kubelet_devices`: the
    device ids of our resource kubelet's record says it allocated to this container, or None when
    kubelet did not answer (then the marker and the allocations presented before decide). The marker is looked
    at first, then the pod annotation; the env only when neither proves anything.
    """
    said = _Said([], [], [])
    notes, refusals = said.notes, said.refusals
    marker = _find_marker(container, notes)
    if marker is None:
        proof = None
    elif kubelet_devices is not None and marker_key is not None:
        proof = _kubelet_proof(pod, container, marker, marker_key, kubelet_devices, spent or {}, refusals)
    else:
        proof = _marker_proof(pod, container, marker, marker_key, device_holders, spent, said)
    if proof is None:
        proof = _annotation_proof(pod, container, trust_pod_annotation, notes)
    if proof is None:
        notes.extend(_env_notes(container))
    waits = said.waits[0] if said.waits and proof is None else None
    return RequestCheck(proof, tuple(notes), tuple(refusals), waits)


def shows_evidence(pod: api.PodSandbox, container: api.Container) -> bool:
    """Whether the container carries anything `check_request` looks at: the allocation marker (an
    annotation, or the DRA env entry), its pod annotation, or a CPU variable in its env. Without any,
    `check_request` proves nothing and notes nothing: Synchronize skips such containers (most of a
    node's) with this one test (a look-alike env text costs a `check_request`, nothing more)."""
    if MARKER_ANNOTATION in container.annotations:
        return True
    if POD_ANNOTATION_PREFIX + container.name in pod.annotations:
        return True
    env = container.env
    if not env:
        return False
    text = "\n".join(env)
    return _ENV_PREFIX in text or (MARKER_ENV in text and bool(_env_markers(container)))


def presents_marker(container: api.Container) -> bool:
    """Whether the container presents an allocation marker, valid or not: the annotation (device
    plugin) or the env entry (DRA). Such a container is checked against kubelet's record and the
    device bindings."""
    return MARKER_ANNOTATION in container.annotations or _env_marker(container) is not None


class _Marker(NamedTuple):
    """A marker the container presents, and where it was found, for messages."""

    value: str
    kind: str  # "device-plugin marker" or "DRA marker"
    where: str  # "the <annotation key> annotation" or "the <env name> env entry (...)"


_IN_ENV: Final = f"the {MARKER_ENV} env entry (set by the DRA driver's CDI spec)"
_IN_ANNOTATION: Final = f"the {MARKER_ANNOTATION} annotation"


def _env_markers(container: api.Container) -> dict[str, str]:
    """The container's DRA marker env entries, name -> value (the last of a name wins, as for the
    CPU variables)."""
    found: dict[str, str] = {}
    # A slice: upb's repeated fields have no __iter__ (a plain loop ends on an IndexError).
    for entry in container.env[:]:
        if entry.startswith(MARKER_ENV):
            name, equals, value = entry.partition("=")
            if equals and (name == MARKER_ENV or name.startswith(_MARKER_ENV_DEVICE)):
                found[name] = value
    return found


def _env_marker(container: api.Container, notes: list[str] | None = None) -> str | None:
    """The value of the container's DRA marker env entry, None when it has none. A container given
    two devices of the driver carries one entry each: the first by name is checked (one device is
    all a container needs), and `notes` say which were not."""
    markers = _env_markers(container)
    if not markers:
        return None
    first, *others = sorted(markers)
    if others and notes is not None:
        notes.append(
            f"{len(markers)} DRA marker env entries; {first} is checked, not {', '.join(others)}: "
            "a container needs one shared-CPUs device, give it one claim of one device"
        )
    return markers[first]


def _find_marker(container: api.Container, notes: list[str]) -> _Marker | None:
    """The marker the container presents: the annotation when it has one (a differing env entry is
    noted as ignored), else the DRA env entry; None when it presents neither."""
    annotation = container.annotations.get(MARKER_ANNOTATION)
    env = _env_marker(container, notes if annotation is None else None)
    if annotation is None:
        return None if env is None else _Marker(env, "DRA marker", _IN_ENV)
    if env is not None and env != annotation:
        notes.append(f"{_IN_ENV} ignored: the container also has {_IN_ANNOTATION}, which is checked instead")
    return _Marker(annotation, "device-plugin marker", _IN_ANNOTATION)


class _Said(NamedTuple):
    """What a check says besides its proof: `notes`, `refusals`, and `waits` (the device whose
    binding's end will grant the container: `RequestCheck.waits_for`)."""

    notes: list[str]
    refusals: list[str]
    waits: list[str]


def _marker_proof(
    pod: api.PodSandbox,
    container: api.Container,
    marker: _Marker,
    marker_key: MarkerKey | None,
    device_holders: Mapping[str, Slot],
    spent: Mapping[str, Spent] | None,
    said: _Said,
) -> Proof | None:
    """The marker's own proof (kubelet not asked), if it holds one; why not goes to `said`."""
    if marker_key is None:
        said.notes.append(f"{marker.kind} ignored: trusted_sources.device_plugin_marker is false")
        return None
    signed = marker_key.read(marker.value)
    if signed is None:
        said.refusals.append(
            f"refused {marker.where}: it was not signed with this node's key "
            "(forged, or copied from another node)"
        )
        return None
    if signed.pods and pod.uid not in signed.pods:
        said.refusals.append(
            f"refused {marker.where}: device {signed.device} was prepared for a claim reserved for "
            f"other pods ({', '.join(sorted(signed.pods)[:3])}{', ...' if len(signed.pods) > 3 else ''}), "
            f"not pod {pod.uid or '(no uid)'} (a copied marker)"
        )
        return None
    holder = device_holders.get(signed.device)
    last = spent.get(signed.device) if spent is not None else None
    if last is None and holder is not None:
        # Bound before allocations were numbered (0); not compared at all without `spent`.
        last = Spent(0 if spent is not None else signed.allocation, holder.pod, holder.name)
    if last is None or _newest(container_slot(pod, container), signed, last, holder, marker, said):
        return Proof("device-plugin", signed.device, signed.allocation)
    return None


def _newest(
    mine: Slot, signed: Signed, last: Spent, holder: Slot | None, marker: _Marker, said: _Said
) -> bool:
    """Whether the slot `mine` may take `signed`'s device, whose newest allocation presented is
    `last` (bound to `holder`, None: its binding ended): its own slot's, a newer allocation, or a claim
    reserved for this pod too whose holder's binding has ended. Why not goes to `said`."""
    if last.slot == mine or signed.allocation > last.allocation:
        return True
    device = signed.device
    # A claim reserved for several pods is one allocation for each of them: once its holder's binding
    # has ended, the next of those pods may take the device; until then it waits.
    shared_claim = mine.pod in signed.pods and last.pod != mine.pod and signed.allocation == last.allocation
    if shared_claim and holder is None:
        return True
    if shared_claim and holder == last.slot:
        said.waits.append(device)
        said.refusals.append(
            f"refused {marker.where} for now: device {device} is held by container {holder} of another "
            "pod its claim is reserved for; it is given to this one when that pod ends"
        )
    elif holder is not None and holder != mine:
        said.refusals.append(
            f"refused {marker.where}: device {device} is already held by container {holder} "
            "(a replayed marker)"
        )
    else:
        said.refusals.append(
            f"refused {marker.where}: this allocation of device {device} was presented by container "
            f"{last.slot} first; a marker is good for one allocation, also once its holder is gone "
            "(a replayed marker)"
        )
    return False


def _kubelet_proof(
    pod: api.PodSandbox,
    container: api.Container,
    marker: _Marker,
    marker_key: MarkerKey,
    devices: frozenset[str],
    spent: Mapping[str, Spent],
    refusals: list[str],
) -> Proof | None:
    """kubelet's record as the proof of a container that presents a marker: the device kubelet
    allocated to it (by the device plugin or our DRA driver), whatever the marker says; none
    allocated: the marker is refused. Its allocation number: the marker's, when it names that
    device, and never below the newest presented (kubelet says this container holds it now)."""
    if devices:
        device = min(devices)
        signed = marker_key.read(marker.value)
        allocation = signed.allocation if signed is not None and signed.device == device else 0
        last = spent.get(device)
        return Proof("kubelet", device, max(allocation, last.allocation if last is not None else 0))
    refusals.append(
        f"refused {marker.where}: kubelet's record shows no shared-CPUs device "
        f"allocated to container {describe(pod, container)} (a replayed, harvested or planted marker)"
    )
    return None


def _annotation_proof(
    pod: api.PodSandbox, container: api.Container, trusted: bool, notes: list[str]
) -> Proof | None:
    """The pod annotation's proof, if it holds one; why not goes to `notes`."""
    annotation_key = POD_ANNOTATION_PREFIX + container.name
    annotation = pod.annotations.get(annotation_key)
    if annotation is None:
        return None
    if not trusted:
        notes.append(f"pod annotation {annotation_key} ignored: trusted_sources.pod_annotation is false")
        return None
    if annotation != POD_ANNOTATION_VALUE:
        notes.append(f"pod annotation {annotation_key}={annotation!r} ignored: the value must be 'enable'")
        return None
    return _BY_ANNOTATION


def _env_notes(container: api.Container) -> list[str]:
    """A note for each of the CPU variables the container's env sets: never proof."""
    env = container.env
    if not env or _ENV_PREFIX not in "\n".join(env):
        return []  # none of the three names is set
    names = {entry.partition("=")[0] for entry in env}
    return [
        f"{name} in the container's env is not a request: env set in a pod spec proves nothing"
        for name in (SHARED_ENV, ISOLATED_ENV, LEGACY_SHARED_ENV)
        if name in names
    ]


# -- NUMA-local shared CPUs ---------------------------------------------------------------------------

# NUMA node id -> its online CPUs, as the daemon read them from sysfs at start.
NumaNodes = Mapping[int, frozenset[int]]


@dataclass(frozen=True, slots=True)
class SharedPool:
    """The node's shared CPUs, and how a container's are chosen among them.

    `numa_nodes` None (the default): every container gets the whole pool. Given: each container gets
    the shared CPUs on the NUMA nodes of its exclusive CPUs (`choose_shared`), so that the threads it
    runs on them touch memory and caches local to its exclusive CPUs.
    """

    cpus: frozenset[int]
    numa_nodes: NumaNodes | None = None


@dataclass(frozen=True, slots=True)
class SharedChoice:
    """The shared CPUs one container gets, and why.

    `nodes`: the NUMA nodes its exclusive CPUs are on (empty when locality is off). `fallback`: why it
    gets the whole pool although locality is on (no shared CPU is local to it); None otherwise.
    """

    cpus: frozenset[int]
    nodes: tuple[int, ...] = ()
    fallback: str | None = None


def choose_shared(
    shared: frozenset[int], exclusive: frozenset[int], numa_nodes: NumaNodes | None
) -> SharedChoice:
    """The shared CPUs of a container with `exclusive` CPUs: all of `shared` when `numa_nodes` is None,
    else those on the nodes its exclusive CPUs touch (every such node: a container spanning nodes gets
    the shared CPUs of each); the whole pool, with the reason, when none of them is local."""
    if numa_nodes is None:
        return SharedChoice(shared)
    nodes = tuple(sorted(node for node, cpus in numa_nodes.items() if cpus & exclusive))
    local = shared.intersection(frozenset().union(*(numa_nodes[node] for node in nodes)))
    if local:
        return SharedChoice(local, nodes)
    if not nodes:
        why = (
            f"none of its exclusive CPUs ({format_cpuset(exclusive) or 'none'}) is on a NUMA node with "
            "online CPUs"
        )
    else:
        where = ", ".join(str(node) for node in nodes)
        why = (
            f"none of the shared CPUs ({format_cpuset(shared)}) is on NUMA node {where}, where its exclusive "
            f"CPUs ({format_cpuset(exclusive)}) are; add CPUs of that node to shared_cpuset (and to "
            "kubelet's reservedSystemCPUs)"
        )
    return SharedChoice(shared, nodes, why)


def shared_by_node(shared: frozenset[int], numa_nodes: NumaNodes) -> dict[int, frozenset[int]]:
    """Each NUMA node with online CPUs -> the shared CPUs on it; an empty set: none, so a container
    whose exclusive CPUs are all on that node gets the whole pool."""
    return {node: shared & cpus for node, cpus in sorted(numa_nodes.items()) if cpus}


# -- eligibility and container values ---------------------------------------------------------------


def _who(pod: api.PodSandbox, container: api.Container, tail: str = "") -> str:
    """How a message names a container: ``container ns/pod/name`` and `tail`. Made only when a
    message is (the checks take the pod and container): a refusal is rare, creation the hot path."""
    return f"container {describe(pod, container)}{tail}"


# CPU lists longer than this are parsed afresh each time: the cache holds a node's few short lists,
# never whatever long text a runtime sends.
_REMEMBERED_LIST_LENGTH: Final = 64


@functools.lru_cache(maxsize=1024)
def _parse_known(text: str) -> frozenset[int]:
    return parse_cpuset(text)


def _parse(text: str) -> frozenset[int]:
    """`cgroups.cpuset.parse`, remembered for short lists: a Synchronize parses the cpuset, the
    recorded exclusive CPUs and the environment's lists of every shared container, and a node's
    containers keep to a few of them. A malformed list raises each time (errors are not kept)."""
    if len(text) > _REMEMBERED_LIST_LENGTH:
        return parse_cpuset(text)
    return _parse_known(text)


def _cpus(text: str, what: str, pod: api.PodSandbox, container: api.Container) -> frozenset[int]:
    try:
        return _parse(text)
    except CpusetError as exc:
        raise PolicyError(
            f"{_who(pod, container)}: the runtime sent a malformed {what}: {exc}", kind="node"
        ) from None


def exclusive_cpus(shared: frozenset[int], pod: api.PodSandbox, container: api.Container) -> frozenset[int]:
    """The exclusive CPUs of a requesting container; `PolicyError` when it has none or the node
    has no shared CPUs."""
    _check_eligible(shared, pod, container)
    cpus = _cpus(container.linux.resources.cpu.cpus, "cpuset", pod, container)
    return _exclusive_of(cpus, shared, pod, container)


_ASKS: Final = " asks for shared CPUs"  # how `_check_eligible`'s and `_exclusive_of`'s messages begin


def _check_eligible(shared: frozenset[int], pod: api.PodSandbox, container: api.Container) -> None:
    """`exclusive_cpus`' checks of the node, the pod and the CPU request, before its cpuset's."""
    if not shared:
        raise PolicyError(
            f"{_who(pod, container, _ASKS)} but the node's shared CPU pool is empty; set shared_cpuset in "
            f"the plugin's config, or remove the {REQUEST_RESOURCE} request from the pod spec",
            kind="node",
        )
    parent = pod.linux.cgroup_parent.lower()
    if "burstable" in parent or "besteffort" in parent:
        qos = "Burstable" if "burstable" in parent else "Besteffort"
        raise PolicyError(
            f"{_who(pod, container, _ASKS)} but its pod is not Guaranteed (QoS class {qos}), so it has no "
            f"exclusive CPUs; {_GUARANTEED_FIX}"
        )
    shares = container.linux.resources.cpu.shares.value  # (0 when not given)
    if shares % SHARES_PER_CPU:
        raise PolicyError(
            f"{_who(pod, container, _ASKS)} but its CPU request is fractional ({shares} CPU shares, about "
            f"{shares / SHARES_PER_CPU:.2f} CPUs), so it has no exclusive CPUs; request a whole "
            'number of CPUs equal to the limit, e.g. cpu: "2"'
        )


def _exclusive_of(
    cpus: frozenset[int], shared: frozenset[int], pod: api.PodSandbox, container: api.Container
) -> frozenset[int]:
    """The rest of `exclusive_cpus`, on the container's CPUs (`cpus`) once its pod and request passed."""
    if not cpus:
        raise PolicyError(
            f"{_who(pod, container, _ASKS)} but has no exclusive CPUs (its cpuset is empty); exclusive "
            f"CPUs come from kubelet's static CPU manager policy: {_GUARANTEED_FIX}"
        )
    exclusive = cpus - shared
    if not exclusive:
        raise PolicyError(
            f"{_who(pod, container, _ASKS)} but has no exclusive CPUs: all its CPUs ({format_cpuset(cpus)}) "
            f"are in the shared pool ({format_cpuset(shared)}); {_GUARANTEED_FIX}, on a kubelet whose "
            "reservedSystemCPUs include the shared pool"
        )
    return exclusive


def _period(*candidates: api.LinuxCPU) -> int:
    for cpu in candidates:
        if cpu.HasField("period") and cpu.period.value > 0:
            return min(cpu.period.value, 1_000_000)
    return DEFAULT_CFS_PERIOD


def _limited(cpu: api.LinuxCPU) -> bool | None:
    """True: a quota is set; False: unlimited (-1); None: no quota given (absent or 0)."""
    if not cpu.HasField("quota") or cpu.quota.value == 0:
        return None
    return cpu.quota.value > 0


def _env(adjust: api.ContainerAdjustment, shared: frozenset[int], exclusive: frozenset[int]) -> None:
    adjust.env.add(key=SHARED_ENV, value=format_cpuset(shared))
    adjust.env.add(key=ISOLATED_ENV, value=format_cpuset(exclusive))


@dataclass(frozen=True, slots=True)
class CreatePlan:
    """What a shared container gets at creation. Immutable: every creation with the same CPUs and
    limits shares one (`plan_create`), so it holds its adjustment as bytes, and `adjustment` is a
    message of the caller's own."""

    exclusive: frozenset[int]
    cpus: frozenset[int]
    quota: int | None  # the container's new quota; None: unlimited, left alone
    period: int
    adjustment_bytes: bytes  # the api.ContainerAdjustment, serialized
    shared: SharedChoice  # its shared CPUs (the pod quota share is their number)

    @property
    def adjustment(self) -> api.ContainerAdjustment:
        """The CreateContainer adjustment, a new message at each call."""
        return api.ContainerAdjustment.FromString(self.adjustment_bytes)


# (shared CPUs, the container's cpuset text, its quota and period, 0 when not given) -> its plan.
_PlanKey = tuple[frozenset[int], str, int, int]
# The plans made so far: a creation's plan found here, not made anew, is 7% of the asking round trip
# (bench/opcount.py: 4,310 -> 4,621 bytecodes without). Plans are immutable, so sharing them is safe.
_PLANS: dict[_PlanKey, CreatePlan] = {}
# A node's containers come in a few shapes; more than this many means churn: start afresh.
_MAX_PLANS: Final = 1024


def plan_create(
    shared: frozenset[int],
    pod: api.PodSandbox,
    container: api.Container,
    *,
    numa_nodes: NumaNodes | None = None,
) -> CreatePlan:
    """The CreateContainer adjustment of a proven container; `PolicyError` if it cannot have one.
    `numa_nodes` given: its shared CPUs are those local to its exclusive ones (`choose_shared`).

    The plan depends only on the shared CPUs and the container's cpuset, quota and period: once the
    pod and the request have passed `exclusive_cpus`' checks, the plan made for the same values
    before is the answer (without NUMA locality: its node map may change)."""
    _check_eligible(shared, pod, container)
    cpu = container.linux.resources.cpu
    # A quota or period not given reads 0, which the plan takes as not given too.
    key = (shared, cpu.cpus, cpu.quota.value, cpu.period.value)
    known = _PLANS.get(key) if numa_nodes is None else None
    if known is not None:
        return known
    exclusive = _exclusive_of(_cpus(cpu.cpus, "cpuset", pod, container), shared, pod, container)
    plan = _new_plan(shared, exclusive, cpu, numa_nodes)
    if numa_nodes is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _new_plan(
    shared: frozenset[int], exclusive: frozenset[int], cpu: api.LinuxCPU, numa_nodes: NumaNodes | None
) -> CreatePlan:
    given = choose_shared(shared, exclusive, numa_nodes)
    cpus = exclusive | given.cpus
    period = _period(cpu)
    quota = len(cpus) * period if _limited(cpu) else None
    adjust = api.ContainerAdjustment()
    text = format_cpuset(cpus)
    if text != cpu.cpus:
        adjust.linux.resources.cpu.cpus = text
    if quota is not None and quota != cpu.quota.value:
        adjust.linux.resources.cpu.quota.value = quota
    _env(adjust, given.cpus, exclusive)
    return CreatePlan(exclusive, cpus, quota, period, adjust.SerializeToString(), given)


@dataclass(frozen=True, slots=True)
class UpdatePlan:
    """The UpdateContainer answer for a shared container, and what it then holds."""

    update: api.ContainerUpdate
    exclusive: frozenset[int]  # its exclusive CPUs as the update leaves them
    shared: SharedChoice  # its shared CPUs as the update leaves them


def plan_update(
    shared: frozenset[int],
    pod: api.PodSandbox,
    container: api.Container,
    requested: api.LinuxResources,
    exclusive: frozenset[int],
    *,
    numa_nodes: NumaNodes | None = None,
) -> UpdatePlan:
    """The UpdateContainer answer for a shared container: the requested cpus plus its shared ones (an
    empty requested cpuset keeps the current one), and the quota raised to match unless unlimited.
    `exclusive`: the ones the books recorded, for a request that names none outside the pool.

    Its shared CPUs follow the requested exclusive ones (with `numa_nodes`, those local to them).
    Only cpus and quota are set: the runtime merges them over the requested resources.
    """
    current_cpu = container.linux.resources.cpu
    wanted = _cpus(requested.cpu.cpus, "requested cpuset", pod, container)
    if not wanted:
        wanted = _cpus(current_cpu.cpus, "cpuset", pod, container) or exclusive
    own = wanted - shared
    given = choose_shared(shared, own or exclusive, numa_nodes)
    cpus = own | given.cpus  # (wanted | shared when every container gets the whole pool)
    update = api.ContainerUpdate(container_id=container.id)
    update.linux.resources.cpu.cpus = format_cpuset(cpus)
    limited = _limited(requested.cpu)
    if limited is None:
        limited = _limited(current_cpu)
    if limited:
        update.linux.resources.cpu.quota.value = _update_quota(requested.cpu, current_cpu, cpus, own)
    return UpdatePlan(update, own or exclusive, given)


def _update_quota(
    requested: api.LinuxCPU, current: api.LinuxCPU, cpus: frozenset[int], own: frozenset[int]
) -> int:
    """A shared container's quota on update: n(cpus) x period, its exclusive and shared CPUs; but a
    quota kubelet asks for other than n(exclusive) x period is the container's own new limit (an
    in-place resize that keeps its cpuset): that, plus its shared CPUs. kubelet asks for its own
    limits only (a resize), or for none (the CPU manager's cpuset-only updates)."""
    period = _period(requested, current)
    quota = len(cpus) * period
    if not _limited(requested) or not own:
        return quota
    raised = requested.quota.value + len(cpus - own) * period
    if raised > MAX_CFS_QUOTA:
        raise PolicyError(
            f"requested CFS quota {requested.quota.value} plus the shared CPUs' share is {raised} us,"
            f" above the kernel's largest quota ({MAX_CFS_QUOTA} us); ask for a CPU limit the kernel"
            " accepts, or for none"
        )
    return raised


class SyncPlan(NamedTuple):
    """An existing shared container, as found at Synchronize (a named tuple: made in C, one for each
    shared container of a Synchronize)."""

    exclusive: frozenset[int]
    cpus: frozenset[int]
    update: api.ContainerUpdate | None  # None: it already has what it should
    env_stale: bool  # its environment does not show the current sets (a restart would fix it)
    applied_shared: int  # how many of its CPUs are beyond its exclusive ones (already given shared)
    shared: SharedChoice  # the shared CPUs it is to have (the pod quota share is their number)
    exclusive_text: str  # `exclusive` as a cpu list (for the books, its env and its lines)


def _cpu_env(container: api.Container) -> tuple[str | None, str | None]:
    """The values of ``OPENSHIFT_SHARED_CPUS`` and ``OPENSHIFT_ISOLATED_CPUS`` in the container's env
    (the last of each wins), None for one that is not set."""
    env = container.env
    if not env or _ENV_PREFIX not in "\n".join(env):
        return None, None
    found: dict[str, str] = {}
    for entry in reversed(env):  # the last of each wins: looked for from the end (we append them)
        key, sep, rest = entry.partition("=")
        if sep and key in _CPU_ENV_NAMES and key not in found:
            found[key] = rest
            if len(found) == len(_CPU_ENV_NAMES):
                break
    return found.get(SHARED_ENV), found.get(ISOLATED_ENV)


_CPU_ENV_NAMES: Final = frozenset({SHARED_ENV, ISOLATED_ENV})


@functools.lru_cache(maxsize=64)
def _format_shared(shared: frozenset[int]) -> str:
    """The shared set's text, formatted once: `plan_sync` needs it for every container of a
    Synchronize, and the set changes only with the config (one per combination of NUMA nodes when
    shared CPUs are NUMA-local)."""
    return format_cpuset(shared)


def cpus_or_empty(text: str | None) -> frozenset[int]:
    """The CPUs of a list we wrote or recorded ourselves; empty when it is missing or malformed."""
    try:
        return _parse(text or "")
    except CpusetError:
        return frozenset()


def plan_sync(
    shared: frozenset[int],
    pod: api.PodSandbox,
    container: api.Container,
    recorded_exclusive: frozenset[int] = frozenset(),
    *,
    numa_nodes: NumaNodes | None = None,
) -> SyncPlan:
    """Bring an existing proven container to the current shared set (with `numa_nodes`, the shared
    CPUs local to its exclusive ones: `choose_shared`).

    Its exclusive CPUs are, in order of trust: those the books recorded at creation; those in the
    ``OPENSHIFT_ISOLATED_CPUS`` we injected (only CPUs it really has count); its CPUs minus the shared
    pool, old (from ``OPENSHIFT_SHARED_CPUS``) and current.
    """
    cpu = container.linux.resources.cpu
    current = _cpus(cpu.cpus, "cpuset", pod, container)
    shared_env, isolated_env = _cpu_env(container)
    exclusive = recorded_exclusive & current
    if not exclusive:
        exclusive = cpus_or_empty(isolated_env) & current
    if not exclusive:
        exclusive = current - shared - cpus_or_empty(shared_env)
    if not exclusive:
        exclusive = current - shared
    # The same checks as at creation, on the exclusive CPUs found.
    _check_eligible(shared, pod, container)
    exclusive = _exclusive_of(exclusive, shared, pod, container)
    given = choose_shared(shared, exclusive, numa_nodes)
    cpus = exclusive | given.cpus
    quota = len(cpus) * _period(cpu) if _limited(cpu) else None
    new_cpus = format_cpuset(cpus) if cpus != current else ""
    new_quota = quota if quota is not None and quota != cpu.quota.value else None
    update = _sync_update(container.id, new_cpus, new_quota) if new_cpus or new_quota is not None else None
    exclusive_text = format_cpuset(exclusive)
    env_stale = shared_env != _format_shared(given.cpus) or isolated_env != exclusive_text
    applied = len(current - exclusive)
    return SyncPlan(exclusive, cpus, update, env_stale, applied, given, exclusive_text)


def _sync_update(container_id: str, cpus: str, quota: int | None) -> api.ContainerUpdate:
    """The update of an existing container: its `cpus` ("" to keep them), its `quota` (None to keep
    it). Built only when something changes: most containers of a restart's Synchronize already
    have what they should, and a message per container is most of what `plan_sync` costs them."""
    update = api.ContainerUpdate(container_id=container_id)
    if cpus:
        update.linux.resources.cpu.cpus = cpus
    if quota is not None:
        update.linux.resources.cpu.quota.value = quota
    return update


# -- pod quota -----------------------------------------------------------------------------------------


def pod_quota_target(baseline: int | None, period: int, shared_counts: Iterable[int]) -> int | None:
    """baseline + sum of n(shared) * period; None (unlimited) stays None."""
    if baseline is None:
        return None
    return baseline + sum(shared_counts) * period


# The kernel's CFS bounds (kernel/sched/core.c): a period of 1 ms to 1 s; a quota of at least 1 ms and
# at most 2^44 - 1 us, or -1 for none. 0 in NRI's messages means "not given".
MIN_CFS_PERIOD: Final = 1_000
MAX_CFS_PERIOD: Final = 1_000_000
MIN_CFS_QUOTA: Final = 1_000
MAX_CFS_QUOTA: Final = (1 << 44) - 1


def check_pod_resources(pod: api.PodSandbox) -> None:
    """`PolicyError` (a node problem: the runtime sent it) when ``pod_resources`` or ``pod_overhead``
    carries a CFS period or quota outside the kernel's ranges: such values must never reach the pod
    quota's arithmetic (a period of 1 us would multiply the pod's quota by 100,000)."""
    linux = pod.linux
    if linux.HasField("pod_resources"):
        _check_cfs_ranges(pod, "pod_resources", linux.pod_resources.cpu)
    if linux.HasField("pod_overhead"):
        _check_cfs_ranges(pod, "pod_overhead", linux.pod_overhead.cpu)


def _check_cfs_ranges(pod: api.PodSandbox, name: str, cpu: api.LinuxCPU) -> None:
    # A period or quota not sent reads 0: not given.
    period = cpu.period.value
    if period and not MIN_CFS_PERIOD <= period <= MAX_CFS_PERIOD:
        raise _out_of_range(pod, name, f"a CFS period of {period} us", "1000 to 1000000 us")
    quota = cpu.quota.value
    if quota and quota != -1 and not MIN_CFS_QUOTA <= quota <= MAX_CFS_QUOTA:
        raise _out_of_range(
            pod, name, f"a CFS quota of {quota} us", f"-1 (no limit) or 1000 to {MAX_CFS_QUOTA} us"
        )


def _out_of_range(pod: api.PodSandbox, name: str, what: str, allowed: str) -> PolicyError:
    return PolicyError(
        f"pod {describe(pod)}: the runtime sent {name} with {what}, outside the kernel's range "
        f"({allowed}); its pod quota cannot be computed from that: check the runtime and its NRI "
        "version",
        kind="node",
    )


def baseline_from_pod_resources(pod: api.PodSandbox, period: int) -> int | None:
    """The pod's own quota from ``pod_resources`` (+ ``pod_overhead``) in microseconds per `period`
    (the pod cgroup's), or None when the runtime did not send a limited quota. `PolicyError` when
    those values are outside the kernel's ranges (`check_pod_resources`)."""
    check_pod_resources(pod)
    linux = pod.linux
    if not linux.HasField("pod_resources"):
        return None
    return baseline_from_resources(linux.pod_resources, linux.pod_overhead, period)


def baseline_from_resources(
    resources: api.LinuxResources, overhead: api.LinuxResources | None, period: int
) -> int | None:
    """The pod's own quota from its `resources` (+ `overhead`) in microseconds per `period`, or None
    when `resources` carry no limited quota. UpdatePodSandbox (an in-place resize) sends these."""
    if not _limited(resources.cpu):
        return None
    total = 0
    for cpu in (resources.cpu, overhead.cpu if overhead is not None else None):
        if cpu is not None and _limited(cpu):
            own_period = cpu.period.value if cpu.HasField("period") and cpu.period.value > 0 else period
            total += -(-cpu.quota.value * period // own_period)  # rounded up into the pod's period
    return total
