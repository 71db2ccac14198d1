"""Hypothesis strategies for well-typed but hostile NRI messages.

`messages(cls)` builds any message of the NRI API from its descriptor: every field may be set, with
values picked to hurt — strings with ``..``, ``/``, NUL, newlines, look-alike slashes and dots,
right-to-left overrides, zero-width characters, 5,000-character runs; integers at the int64
extremes, negative quotas and periods; cpu lists such as ``0-999999999``; empty ids. Fields the
plugin reads (annotations, env, cpus, cgroup paths, ids) get values aimed at them: forged,
other-node and device-swapped markers, the pod annotation, ``OPENSHIFT_*`` variables.

`realistic_requests(method)` starts from a request a runtime would send for a Guaranteed pod and
overwrites a few of those fields with hostile values, so that the policy code behind the proof check
is reached too. Nothing here ever holds a marker signed with the node's own key.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hostile_models import CPU_LISTS, INT64_EDGES, REQUEST_TYPES, TRICKS
from hypothesis import strategies as st

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.deviceplugin.marker import ANNOTATION_KEY, HostKey
from nri_plugin.nri.routes import DEDICATED_METHODS

OTHER_NODE_KEY = HostKey(b"\x01" * 32)

tricky_text = st.lists(
    st.one_of(st.sampled_from(TRICKS), st.text(st.characters(exclude_categories=["Cs"]), max_size=6)),
    min_size=1,
    max_size=8,
).map("".join)

hostile_text = st.one_of(
    tricky_text,
    st.text(st.characters(exclude_categories=["Cs"]), max_size=12),
    st.sampled_from(["", "a" * 5000, "/" * 300, "../" * 100, "\0" * 10]),
)

# Cpu lists a pod spec cannot write but a confused runtime might send.
cpu_lists = st.one_of(
    st.sampled_from([*CPU_LISTS, ",".join(str(n) for n in range(0, 20000, 2))]),
    hostile_text,
)

int64 = st.one_of(
    st.sampled_from(INT64_EDGES),
    st.integers(-(2**63), 2**63 - 1),
)


def _forged_markers() -> st.SearchStrategy[str]:
    valid_other = OTHER_NODE_KEY.sign("shared-cpus-0")
    swapped = OTHER_NODE_KEY.sign("shared-cpus-1").replace("shared-cpus-1", "shared-cpus-0")
    return st.one_of(
        st.sampled_from(
            [
                valid_other,  # signed on another node
                swapped,  # a MAC of another device id
                "v1:shared-cpus-0:" + "A" * 43,
                "v1:shared-cpus-0:",
                "v2:shared-cpus-0:" + "A" * 43,
                "v1:../../etc:" + "A" * 43,
                "v1:shared-cpus-0:" + "A" * 43 + "\n",
                "v1:" + "x" * 70 + ":" + "A" * 43,
                "enable",
                "",
            ]
        ),
        st.builds(
            lambda mac: "v1:shared-cpus-0:" + mac,
            st.text(
                "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_", min_size=43, max_size=43
            ),
        ),
        hostile_text,
    )


forged_markers = _forged_markers()

annotation_keys = st.one_of(
    st.sampled_from(
        [ANNOTATION_KEY, "cpu-shared.crio.io/main", "cpu-shared.crio.io/", "cpu-shared.crio.io/" + "\u202e"]
    ),
    hostile_text.map(lambda t: "cpu-shared.crio.io/" + t),
    hostile_text,
)
annotation_maps = st.dictionaries(
    annotation_keys,
    st.one_of(forged_markers, st.sampled_from(["enable", "true", "Enable", "enable\n", "1"])),
    max_size=4,
)
env_entries = st.lists(
    st.one_of(
        st.sampled_from(
            [
                "OPENSHIFT_SHARED_CPUS=0-1",
                "OPENSHIFT_ISOLATED_CPUS=0-7",
                "OPENSHIFT_MUTUAL_CPUS=0-1",
                "OPENSHIFT_SHARED_CPUS",
                "=",
                "PATH=/bin",
            ]
        ),
        hostile_text,
    ),
    max_size=5,
)

# Field name -> strategy, for the fields the plugin reads.
_BY_NAME: dict[str, st.SearchStrategy[Any]] = {
    "annotations": annotation_maps,
    "env": env_entries,
    "cpus": cpu_lists,
    "mems": cpu_lists,
}

_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_STRING: hostile_text,
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=64),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_INT64: int64,
    FieldDescriptor.TYPE_SINT64: int64,
    FieldDescriptor.TYPE_SFIXED64: int64,
    FieldDescriptor.TYPE_UINT64: st.one_of(st.sampled_from([0, 2**64 - 1, 2**63]), st.integers(0, 2**64 - 1)),
    FieldDescriptor.TYPE_FIXED64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: st.one_of(st.sampled_from([0, 2**32 - 1]), st.integers(0, 2**32 - 1)),
    FieldDescriptor.TYPE_FIXED32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_DOUBLE: st.floats(),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32),
    # Open (proto3) enums: unknown numbers are legal on the wire.
    FieldDescriptor.TYPE_ENUM: st.one_of(st.integers(-2, 20), st.integers(-(2**31), 2**31 - 1)),
}


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    return _BY_NAME.get(field.name, _SCALARS[field.type])


def _fill(draw: st.DrawFn, message: Message, depth: int) -> None:
    descriptor: Descriptor = message.DESCRIPTOR  # type: ignore[assignment]  # upb's is the same API
    for field in descriptor.fields:
        if not draw(st.booleans()):
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field, value_field = field.message_type.fields
            if value_field.message_type is not None:
                continue  # no message-valued maps the plugin reads
            if field.name == "annotations":
                entries = draw(annotation_maps)
            else:
                entries = draw(st.dictionaries(_scalar(key_field), _scalar(value_field), max_size=3))
            getattr(message, field.name).update(entries)
            continue
        if field.is_repeated:
            if field.message_type is not None:
                if depth <= 0:
                    continue
                for _ in range(draw(st.integers(0, 2))):
                    _fill(draw, getattr(message, field.name).add(), depth - 1)
            elif field.name == "env":
                getattr(message, field.name).extend(draw(env_entries))
            else:
                getattr(message, field.name).extend(draw(st.lists(_scalar(field), max_size=3)))
            continue
        if field.message_type is not None:
            if depth > 0:
                _fill(draw, getattr(message, field.name), depth - 1)
                # An empty sub-message still counts as set (HasField), as a runtime may send it.
                getattr(message, field.name).SetInParent()
            continue
        setattr(message, field.name, draw(_scalar(field)))


@st.composite
def messages(draw: st.DrawFn, cls: type[Message], depth: int = 6) -> Message:
    """Any `cls` message, every field possibly set to a hostile value (see the module docstring)."""
    message = cls()
    _fill(draw, message, depth)
    return message


# -- realistic requests with hostile fields --------------------------------------------------------------


# Fields of a runtime-shaped request that may turn hostile; each example spoils a few of them, so
# that the rest stays plausible and the code behind the proof check is reached.
HOSTILE_FIELDS = (
    "uid",
    "sandbox_id",
    "pod_name",
    "namespace",
    "pod_annotations",
    "cgroup_parent",
    "pod_resources",
    "id",
    "pod_sandbox_id",
    "name",
    "env",
    "annotations",
    "state",
    "created_at",
    "cgroups_path",
    "cpus",
    "quota",
    "period",
    "shares",
)

_HOSTILE: dict[str, st.SearchStrategy[Any]] = {
    "uid": st.one_of(st.just(""), hostile_text),
    "sandbox_id": st.one_of(st.just(""), hostile_text),
    "pod_name": hostile_text,
    "namespace": hostile_text,
    "pod_annotations": annotation_maps,
    "cgroup_parent": st.one_of(
        st.just(""),
        tricky_text,
        tricky_text.map(lambda t: "/kubepods/" + t),
        tricky_text.map(lambda t: "kubepods-pod" + t + ".slice"),
        tricky_text.map(lambda t: "/kubepods/pod1111-2222/" + t),
    ),
    "pod_resources": st.tuples(int64, st.integers(0, 2**64 - 1)),
    "id": st.one_of(st.just(""), hostile_text),
    "pod_sandbox_id": hostile_text,
    "name": st.one_of(st.just(""), hostile_text),
    "env": env_entries,
    "annotations": annotation_maps,
    "state": st.integers(-(2**31), 2**31 - 1),
    "created_at": int64,
    "cgroups_path": st.one_of(tricky_text, tricky_text.map(lambda t: "a.slice:crio:" + t)),
    "cpus": cpu_lists,
    "quota": st.one_of(st.none(), int64),
    "period": st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    "shares": st.one_of(st.none(), st.integers(0, 2**64 - 1)),
}

_REALISTIC: dict[str, Any] = {
    "uid": "1111-2222",
    "sandbox_id": "sandbox-1",
    "pod_name": "app",
    "namespace": "ns",
    "pod_annotations": {},
    "cgroup_parent": "/kubepods/pod1111-2222",
    "pod_resources": None,
    "id": "c-1",
    "pod_sandbox_id": "sandbox-1",
    "name": "main",
    "env": ["PATH=/bin"],
    "annotations": {},
    "state": api.CONTAINER_RUNNING,
    "created_at": 1,
    "cgroups_path": "/kubepods/pod1111-2222/c-1",
    "cpus": "4-5",
    "quota": 200_000,
    "period": 100_000,
    "shares": 2048,
}


def _values(draw: st.DrawFn) -> dict[str, Any]:
    spoiled = draw(st.sets(st.sampled_from(HOSTILE_FIELDS), max_size=3))
    return {name: draw(_HOSTILE[name]) if name in spoiled else value for name, value in _REALISTIC.items()}


def _pod(values: dict[str, Any]) -> api.PodSandbox:
    pod = api.PodSandbox(
        id=values["sandbox_id"],
        uid=values["uid"],
        name=values["pod_name"],
        namespace=values["namespace"],
        annotations=values["pod_annotations"],
    )
    pod.linux.cgroup_parent = values["cgroup_parent"]
    if values["pod_resources"] is not None:
        cpu = pod.linux.pod_resources.cpu
        cpu.quota.value, cpu.period.value = values["pod_resources"]
    return pod


def _container(values: dict[str, Any]) -> api.Container:
    container = api.Container(
        id=values["id"],
        pod_sandbox_id=values["pod_sandbox_id"],
        name=values["name"],
        env=values["env"],
        annotations=values["annotations"],
        state=values["state"],
        created_at=values["created_at"],
    )
    container.linux.cgroups_path = values["cgroups_path"]
    cpu = container.linux.resources.cpu
    cpu.cpus = values["cpus"]
    for name in ("quota", "period", "shares"):
        if values[name] is not None:
            getattr(cpu, name).value = values[name]
    return container


@st.composite
def realistic_requests(draw: st.DrawFn, method: str) -> Message:
    """A `method` request with one pod and container shaped like a runtime's, fields made hostile."""
    values = _values(draw)
    pod, container = _pod(values), _container(values)
    if method == "Synchronize":
        return api.SynchronizeRequest(pods=[pod], containers=[container], more=draw(st.booleans()))
    if method == "CreateContainer":
        return api.CreateContainerRequest(pod=pod, container=container)
    if method == "UpdateContainer":
        request = api.UpdateContainerRequest(pod=pod, container=container)
        request.linux_resources.cpu.cpus = draw(cpu_lists)
        if draw(st.booleans()):
            request.linux_resources.cpu.quota.value = draw(int64)
        return request
    if method == "StopContainer":
        return api.StopContainerRequest(pod=pod, container=container)
    if method == "StartContainer":
        return api.StartContainerRequest(pod=pod, container=container)
    if method == "UpdatePodSandbox":
        return api.UpdatePodSandboxRequest(pod=pod)
    if method == "StateChange":
        return api.StateChangeEvent(
            event=api.Event.ValueType(draw(st.integers(-1, 16))), pod=pod, container=container
        )
    if method == "Configure":
        return api.ConfigureRequest(
            config=draw(hostile_text),
            runtime_name=draw(st.one_of(st.sampled_from(["containerd", "cri-o"]), hostile_text)),
            runtime_version=draw(st.one_of(st.just("v2.3.4"), hostile_text)),
            NRI_version=draw(
                st.one_of(st.sampled_from(["v0.12.0", "v99999999999999999999.1", ""]), hostile_text)
            ),
            registration_timeout=draw(int64),
            request_timeout=draw(int64),
        )
    for _event, (name, request_type, _response) in DEDICATED_METHODS.items():
        if name == method:
            dedicated: Message = request_type(pod=pod)
            if "container" in request_type.DESCRIPTOR.fields_by_name:
                dedicated.container.CopyFrom(container)  # type: ignore[attr-defined]
            return dedicated
    return draw(messages(REQUEST_TYPES[method]))
