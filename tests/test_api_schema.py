"""Schema checks for the committed protos: generated code is current, wire numbers are the Go ones,
and real captured NRI traffic decodes (and re-encodes byte for byte) with our generated types."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.descriptor_pb2 import FileDescriptorProto
from google.protobuf.message import Message
from vectors import comment_lines, ttrpc_message, ttrpc_parts, vector_names

from nri_plugin.api.nri import api_pb2
from nri_plugin.api.ttrpc import request_pb2

ROOT = Path(__file__).resolve().parents[1]
NRI = api_pb2.DESCRIPTOR
PACKAGE = "nri.pkg.api.v1alpha1"

# ---------------------------------------------------------------------------------------------------
# Generated code is current
# ---------------------------------------------------------------------------------------------------


def _generated_files(base: Path) -> dict[str, bytes]:
    api = base / "nri_plugin" / "api"
    files = [
        *api.rglob("*_pb2.py"),
        *api.rglob("*_pb2.pyi"),
        *api.rglob("*_pb2_grpc.py"),
        *api.rglob("*_pb2_grpc.pyi"),
    ]
    return {p.relative_to(base).as_posix(): p.read_bytes() for p in files}


def test_committed_generated_code_is_current(tmp_path: Path) -> None:
    missing_tools = [m for m in ("grpc_tools", "mypy_protobuf") if importlib.util.find_spec(m) is None]
    if missing_tools:
        pytest.fail(f"cannot check generated code: {missing_tools} not installed (install the 'test' extra)")
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    fresh = _generated_files(tmp_path)
    committed = _generated_files(ROOT)
    assert fresh, "scripts/gen_proto.py generated nothing"
    problems = [f"missing: {p}" for p in sorted(fresh.keys() - committed.keys())]
    problems += [f"extra (no .proto generates it): {p}" for p in sorted(committed.keys() - fresh.keys())]
    problems += [f"stale: {p}" for p in sorted(fresh.keys() & committed.keys()) if fresh[p] != committed[p]]
    assert not problems, "generated code is out of date; run `python scripts/gen_proto.py`:\n" + "\n".join(
        problems
    )


# ---------------------------------------------------------------------------------------------------
# Field numbers and types
# ---------------------------------------------------------------------------------------------------

_SCALARS = {
    FieldDescriptor.TYPE_DOUBLE: "double",
    FieldDescriptor.TYPE_FLOAT: "float",
    FieldDescriptor.TYPE_INT64: "int64",
    FieldDescriptor.TYPE_UINT64: "uint64",
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_FIXED64: "fixed64",
    FieldDescriptor.TYPE_FIXED32: "fixed32",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_BYTES: "bytes",
    FieldDescriptor.TYPE_UINT32: "uint32",
    FieldDescriptor.TYPE_SFIXED32: "sfixed32",
    FieldDescriptor.TYPE_SFIXED64: "sfixed64",
    FieldDescriptor.TYPE_SINT32: "sint32",
    FieldDescriptor.TYPE_SINT64: "sint64",
}


def _type_of(field: FieldDescriptor) -> str:
    """Field type as written in a .proto file, e.g. ``repeated Mount`` or ``map<string,string>``."""
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        return f"map<{_type_of(key)},{_type_of(value)}>"
    if field.message_type is not None:
        base = field.message_type.full_name.removeprefix(PACKAGE + ".")
    elif field.enum_type is not None:
        base = field.enum_type.full_name.removeprefix(PACKAGE + ".")
    else:
        base = _SCALARS[field.type]
    return f"repeated {base}" if field.is_repeated else base


def _fields(message: Descriptor) -> dict[str, str]:
    return {f.name: f"{f.number} {_type_of(f)}" for f in message.fields}


def _table(spec: str) -> dict[str, str]:
    """Parse ``"1 string plugin_name; 2 string plugin_idx"`` into ``{name: "number type"}``."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        number, *type_words, name = item.split()
        out[name] = f"{number} {' '.join(type_words)}"
    return out


_POD_CTR = "1 PodSandbox pod; 2 Container container"

# Complete field lists (numbers and types) of every NRI message, as in NRI v0.12.2 (containerd/nri
# pkg/api/api.proto at tag v0.12.2). Any added, missing, renumbered or retyped field fails; the
# dossier's surprises (ConfigureResponse and ContainerAdjustment have no field 1) are here too.
NRI_MESSAGES: dict[str, str] = {
    "RegisterPluginRequest": "1 string plugin_name; 2 string plugin_idx; 3 string NRI_version",
    "UpdateContainersRequest": "1 repeated ContainerUpdate update; 2 repeated ContainerEviction evict",
    "UpdateContainersResponse": "1 repeated ContainerUpdate failed",
    "ConfigureRequest": "1 string config; 2 string runtime_name; 3 string runtime_version;"
    " 4 int64 registration_timeout; 5 int64 request_timeout; 6 string NRI_version",
    "ConfigureResponse": "2 int32 events",  # there is no field 1
    "SynchronizeRequest": "1 repeated PodSandbox pods; 2 repeated Container containers; 3 bool more",
    "SynchronizeResponse": "1 repeated ContainerUpdate update; 2 bool more",
    "CreateContainerRequest": _POD_CTR,
    "CreateContainerResponse": "1 ContainerAdjustment adjust; 2 repeated ContainerUpdate update;"
    " 3 repeated ContainerEviction evict",
    "UpdateContainerRequest": _POD_CTR + "; 3 LinuxResources linux_resources",
    "UpdateContainerResponse": "1 repeated ContainerUpdate update; 2 repeated ContainerEviction evict",
    "StopContainerRequest": _POD_CTR,
    "StopContainerResponse": "1 repeated ContainerUpdate update",
    "StateChangeEvent": "1 Event event; 2 PodSandbox pod; 3 Container container",
    "UpdatePodSandboxRequest": "1 PodSandbox pod; 2 LinuxResources overhead_linux_resources;"
    " 3 LinuxResources linux_resources",
    **{
        f"{event}Response": ""  # the replies to the pod and container events carry nothing
        for event in (
            "RunPodSandbox",
            "UpdatePodSandbox",
            "PostUpdatePodSandbox",
            "StopPodSandbox",
            "RemovePodSandbox",
            "PostCreateContainer",
            "StartContainer",
            "PostStartContainer",
            "PostUpdateContainer",
            "RemoveContainer",
        )
    },
    "RunPodSandboxRequest": "1 PodSandbox pod",
    "StopPodSandboxRequest": "1 PodSandbox pod",
    "RemovePodSandboxRequest": "1 PodSandbox pod",
    "PostUpdatePodSandboxRequest": "1 PodSandbox pod",
    "PostCreateContainerRequest": _POD_CTR,
    "StartContainerRequest": _POD_CTR,
    "PostStartContainerRequest": _POD_CTR,
    "PostUpdateContainerRequest": _POD_CTR,
    "RemoveContainerRequest": _POD_CTR,
    "ValidateContainerAdjustmentRequest": _POD_CTR + "; 3 ContainerAdjustment adjust;"
    " 4 repeated ContainerUpdate update; 5 OwningPlugins owners; 6 repeated PluginInstance plugins",
    "ValidateContainerAdjustmentResponse": "1 bool reject; 2 string reason",
    "PluginInstance": "1 string name; 2 string index",
    "Empty": "",
    "PodSandbox": "1 string id; 2 string name; 3 string uid; 4 string namespace;"
    " 5 map<string,string> labels; 6 map<string,string> annotations; 7 string runtime_handler;"
    " 8 LinuxPodSandbox linux; 9 uint32 pid; 10 repeated string ips",
    "LinuxPodSandbox": "1 LinuxResources pod_overhead; 2 LinuxResources pod_resources;"
    " 3 string cgroup_parent; 4 string cgroups_path; 5 repeated LinuxNamespace namespaces;"
    " 6 LinuxResources resources",
    "Container": "1 string id; 2 string pod_sandbox_id; 3 string name; 4 ContainerState state;"
    " 5 map<string,string> labels; 6 map<string,string> annotations; 7 repeated string args;"
    " 8 repeated string env; 9 repeated Mount mounts; 10 Hooks hooks; 11 LinuxContainer linux;"
    " 12 uint32 pid; 13 repeated POSIXRlimit rlimits; 14 int64 created_at; 15 int64 started_at;"
    " 16 int64 finished_at; 17 int32 exit_code; 18 string status_reason; 19 string status_message;"
    " 20 repeated CDIDevice CDI_devices; 21 User user; 22 Image image",
    "Image": "1 string name; 2 string digest; 3 string config_digest",
    "LinuxContainer": "1 repeated LinuxNamespace namespaces; 2 repeated LinuxDevice devices;"
    " 3 LinuxResources resources; 4 OptionalInt oom_score_adj; 5 string cgroups_path;"
    " 6 LinuxIOPriority io_priority; 7 SecurityProfile seccomp_profile; 8 LinuxSeccomp seccomp_policy;"
    " 9 map<string,string> sysctl; 10 map<string,LinuxNetDevice> net_devices;"
    " 11 LinuxScheduler scheduler; 12 LinuxRdt rdt",
    "LinuxResources": "1 LinuxMemory memory; 2 LinuxCPU cpu; 3 repeated HugepageLimit hugepage_limits;"
    " 4 OptionalString blockio_class; 5 OptionalString rdt_class; 6 map<string,string> unified;"
    " 7 repeated LinuxDeviceCgroup devices; 8 LinuxPids pids",
    "LinuxCPU": "1 OptionalUInt64 shares; 2 OptionalInt64 quota; 3 OptionalUInt64 period;"
    " 4 OptionalInt64 realtime_runtime; 5 OptionalUInt64 realtime_period; 6 string cpus; 7 string mems",
    "LinuxMemory": "1 OptionalInt64 limit; 2 OptionalInt64 reservation; 3 OptionalInt64 swap;"
    " 4 OptionalInt64 kernel; 5 OptionalInt64 kernel_tcp; 6 OptionalUInt64 swappiness;"
    " 7 OptionalBool disable_oom_killer; 8 OptionalBool use_hierarchy",
    "LinuxPids": "1 int64 limit",
    "ContainerAdjustment": "2 map<string,string> annotations; 3 repeated Mount mounts;"  # no field 1
    " 4 repeated KeyValue env; 5 Hooks hooks; 6 LinuxContainerAdjustment linux;"
    " 7 repeated POSIXRlimit rlimits; 8 repeated CDIDevice CDI_devices; 9 repeated string args",
    "LinuxContainerAdjustment": "1 repeated LinuxDevice devices; 2 LinuxResources resources;"
    " 3 string cgroups_path; 4 OptionalInt oom_score_adj; 5 LinuxIOPriority io_priority;"
    " 6 LinuxSeccomp seccomp_policy; 7 repeated LinuxNamespace namespaces; 8 map<string,string> sysctl;"
    " 9 map<string,LinuxNetDevice> net_devices; 10 LinuxScheduler scheduler; 11 LinuxRdt rdt;"
    " 12 LinuxMemoryPolicy memory_policy",
    "ContainerUpdate": "1 string container_id; 2 LinuxContainerUpdate linux; 3 bool ignore_failure",
    "LinuxContainerUpdate": "1 LinuxResources resources",
    "ContainerEviction": "1 string container_id; 2 string reason",
    "KeyValue": "1 string key; 2 string value",
    "Hooks": "1 repeated Hook prestart; 2 repeated Hook create_runtime; 3 repeated Hook create_container;"
    " 4 repeated Hook start_container; 5 repeated Hook poststart; 6 repeated Hook poststop",
    "Hook": "1 string path; 2 repeated string args; 3 repeated string env; 4 OptionalInt timeout",
    "Mount": "1 string destination; 2 string type; 3 string source; 4 repeated string options",
    "User": "1 uint32 uid; 2 uint32 gid; 3 repeated uint32 additional_gids",
    "LinuxScheduler": "1 LinuxSchedulerPolicy policy; 2 int32 nice; 3 int32 priority;"
    " 4 repeated LinuxSchedulerFlag flags; 5 uint64 runtime; 6 uint64 deadline; 7 uint64 period",
    "LinuxMemoryPolicy": "1 MpolMode mode; 2 string nodes; 3 repeated MpolFlag flags",
    "LinuxIOPriority": "1 IOPrioClass class; 2 int32 priority",
    "SecurityProfile": "1 SecurityProfile.ProfileType profile_type; 2 string localhost_ref",
    "LinuxRdt": "1 OptionalString clos_id; 2 OptionalRepeatedString schemata;"
    " 3 OptionalBool enable_monitoring; 4 bool remove",
    "OwningPlugins": "1 map<string,FieldOwners> owners",
    "FieldOwners": "1 map<int32,string> simple; 2 map<int32,CompoundFieldOwners> compound",
    "CompoundFieldOwners": "1 map<string,string> owners",
    "HugepageLimit": "1 string page_size; 2 uint64 limit",
    "LinuxNamespace": "1 string type; 2 string path",
    "LinuxDevice": "1 string path; 2 string type; 3 int64 major; 4 int64 minor;"
    " 5 OptionalFileMode file_mode; 6 OptionalUInt32 uid; 7 OptionalUInt32 gid",
    "LinuxDeviceCgroup": "1 bool allow; 2 string type; 3 OptionalInt64 major; 4 OptionalInt64 minor;"
    " 5 string access",
    "CDIDevice": "1 string name",
    "POSIXRlimit": "1 string type; 2 uint64 hard; 3 uint64 soft",
    "LinuxNetDevice": "1 string name",
    "LinuxSeccomp": "1 string default_action; 2 OptionalUInt32 default_errno;"
    " 3 repeated string architectures; 4 repeated string flags; 5 string listener_path;"
    " 6 string listener_metadata; 7 repeated LinuxSyscall syscalls",
    "LinuxSyscall": "1 repeated string names; 2 string action; 3 OptionalUInt32 errno_ret;"
    " 4 repeated LinuxSeccompArg args",
    "LinuxSeccompArg": "1 uint32 index; 2 uint64 value; 3 uint64 value_two; 4 string op",
    "OptionalString": "1 string value",
    "OptionalRepeatedString": "1 repeated string value",
    "OptionalInt": "1 int64 value",
    "OptionalInt32": "1 int32 value",
    "OptionalUInt32": "1 uint32 value",
    "OptionalInt64": "1 int64 value",
    "OptionalUInt64": "1 uint64 value",
    "OptionalBool": "1 bool value",
    "OptionalFileMode": "1 uint32 value",
}


def test_nri_file_header() -> None:
    proto = FileDescriptorProto()
    NRI.CopyToProto(proto)
    assert (proto.package, proto.syntax) == (PACKAGE, "proto3")
    assert list(proto.dependency) == []  # plain proto3: no gogoproto or other imports


@pytest.mark.parametrize(("message", "spec"), sorted(NRI_MESSAGES.items()))
def test_nri_message_fields(message: str, spec: str) -> None:
    assert _fields(NRI.message_types_by_name[message]) == _table(spec)


@pytest.mark.parametrize(
    ("message", "spec"),
    [
        pytest.param(
            request_pb2.Request.DESCRIPTOR,
            "1 string service; 2 string method; 3 bytes payload;"
            " 4 int64 timeout_nano; 5 repeated nri_plugin.api.ttrpc.KeyValue metadata",
            id="ttrpc.Request",
        ),
        pytest.param(
            request_pb2.Response.DESCRIPTOR,
            "1 nri_plugin.api.ttrpc.Status status; 2 bytes payload",
            id="ttrpc.Response",
        ),
        pytest.param(request_pb2.KeyValue.DESCRIPTOR, "1 string key; 2 string value", id="ttrpc.KeyValue"),
        pytest.param(
            request_pb2.Status.DESCRIPTOR,
            "1 int32 code; 2 string message; 3 repeated google.protobuf.Any details",
            id="google.rpc.Status",
        ),
    ],
)
def test_envelope_message_fields(message: Descriptor, spec: str) -> None:
    assert _fields(message) == _table(spec)


# ---------------------------------------------------------------------------------------------------
# Living beside other protobuf users in one process
# ---------------------------------------------------------------------------------------------------
# Every generated module registers its messages by full name in protobuf's process-wide descriptor pool,
# which refuses a second file defining a name already there. So a name of ours that a third party also
# defines breaks whichever of the two is imported second.


def _generated_modules() -> list[str]:
    api = ROOT / "nri_plugin" / "api"
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in api.rglob("*_pb2.py"))


@pytest.mark.parametrize("module", _generated_modules())
def test_upstream_package_names_only_where_the_wire_carries_them(module: str) -> None:
    """A file keeps its upstream package only when it defines a service: gRPC and ttrpc put
    `package.Service` on the wire (method paths, Request.service). Messages alone cross the wire as
    field numbers, so a file without services takes a package of our own, under our import name."""
    file = importlib.import_module(module).DESCRIPTOR
    assert file.name.startswith("nri_plugin/api/")
    assert not file.package.startswith("google."), f"{file.name} defines {file.package} names"
    if not file.services_by_name:
        assert file.package == module.rsplit(".", 1)[0], f"{file.name}: package {file.package}"


_OURS = "from nri_plugin.api.ttrpc import request_pb2"
# googleapis-common-protos (a dependency of grpcio-status, so often installed beside us) defines
# google.rpc.Status in google/rpc/status.proto: the message our ttrpc Status mirrors.
_THEIRS = "from google.rpc import status_pb2"
_SAME_WIRE = """
from google.protobuf import any_pb2
detail = any_pb2.Any(type_url="type.googleapis.com/google.rpc.ErrorInfo", value=b"\\x0a\\x01x")
ours = request_pb2.Status(code=12, message="method X", details=[detail])
theirs = status_pb2.Status(code=12, message="method X", details=[detail])
assert ours.SerializeToString() == theirs.SerializeToString()
assert status_pb2.Status.FromString(ours.SerializeToString()) == theirs
assert request_pb2.Status.FromString(theirs.SerializeToString()) == ours
response = request_pb2.Response.FromString(request_pb2.Response(status=ours).SerializeToString())
assert response.status == ours
print("both imported; same bytes")
"""


@pytest.mark.parametrize(
    "imports", [(_OURS, _THEIRS), (_THEIRS, _OURS)], ids=["ours-first", "googleapis-first"]
)
def test_imports_beside_googleapis_status_and_speaks_its_wire(imports: tuple[str, str]) -> None:
    """In a fresh interpreter (the descriptor pool is per process), in both orders."""
    script = "\n".join(["import warnings", "warnings.simplefilter('error')", *imports, _SAME_WIRE])
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    if "No module named 'google.rpc'" in result.stderr:
        pytest.fail("googleapis-common-protos is not installed (install the 'test' extra)")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "both imported; same bytes\n"


def test_every_nri_message_is_in_the_table() -> None:
    assert set(NRI.message_types_by_name) == set(NRI_MESSAGES)


# ---------------------------------------------------------------------------------------------------
# Enums
# ---------------------------------------------------------------------------------------------------

NRI_ENUMS: dict[str, str] = {
    "Event": "UNKNOWN RUN_POD_SANDBOX STOP_POD_SANDBOX REMOVE_POD_SANDBOX CREATE_CONTAINER"
    " POST_CREATE_CONTAINER START_CONTAINER POST_START_CONTAINER UPDATE_CONTAINER POST_UPDATE_CONTAINER"
    " STOP_CONTAINER REMOVE_CONTAINER UPDATE_POD_SANDBOX POST_UPDATE_POD_SANDBOX"
    " VALIDATE_CONTAINER_ADJUSTMENT LAST",
    "ContainerState": "CONTAINER_UNKNOWN CONTAINER_CREATED CONTAINER_PAUSED CONTAINER_RUNNING"
    " CONTAINER_STOPPED",
    "IOPrioClass": "IOPRIO_CLASS_NONE IOPRIO_CLASS_RT IOPRIO_CLASS_BE IOPRIO_CLASS_IDLE",
    "LinuxSchedulerPolicy": "SCHED_NONE SCHED_OTHER SCHED_FIFO SCHED_RR SCHED_BATCH SCHED_ISO SCHED_IDLE"
    " SCHED_DEADLINE",
    "LinuxSchedulerFlag": "SCHED_FLAG_RESET_ON_FORK SCHED_FLAG_RECLAIM SCHED_FLAG_DL_OVERRUN"
    " SCHED_FLAG_KEEP_POLICY SCHED_FLAG_KEEP_PARAMS SCHED_FLAG_UTIL_CLAMP_MIN SCHED_FLAG_UTIL_CLAMP_MAX",
    "MpolMode": "MPOL_DEFAULT MPOL_PREFERRED MPOL_BIND MPOL_INTERLEAVE MPOL_LOCAL MPOL_PREFERRED_MANY"
    " MPOL_WEIGHTED_INTERLEAVE",
    "MpolFlag": "MPOL_F_STATIC_NODES MPOL_F_RELATIVE_NODES MPOL_F_NUMA_BALANCING",
    "SecurityProfile.ProfileType": "RUNTIME_DEFAULT UNCONFINED LOCALHOST",
    "Field": "None Annotations Mounts OciHooks Devices CdiDevices Env Args MemLimit MemReservation"
    " MemSwapLimit MemKernelLimit MemTCPLimit MemSwappiness MemDisableOomKiller MemUseHierarchy CPUShares"
    " CPUQuota CPUPeriod CPURealtimeRuntime CPURealtimePeriod CPUSetCPUs CPUSetMems PidsLimit"
    " HugepageLimits BlockioClass RdtClass CgroupsUnified CgroupsPath OomScoreAdj Rlimits IoPriority"
    " SeccompPolicy Namespace Sysctl LinuxNetDevices LinuxSched RdtClosID RdtSchemata RdtEnableMonitoring"
    " MemoryPolicy",
}


def _enum(name: str) -> EnumDescriptor:
    if "." in name:
        outer, inner = name.split(".")
        return NRI.message_types_by_name[outer].enum_types_by_name[inner]
    return NRI.enum_types_by_name[name]


@pytest.mark.parametrize(("name", "values"), sorted(NRI_ENUMS.items()))
def test_nri_enum_values(name: str, values: str) -> None:
    """Every NRI enum numbers its values 0, 1, 2, ... in this order."""
    assert {v.name: v.number for v in _enum(name).values} == {n: i for i, n in enumerate(values.split())}


def test_every_nri_enum_is_checked() -> None:
    nested = {f"{m.name}.{e.name}" for m in NRI.message_types_by_name.values() for e in m.enum_types}
    assert set(NRI.enum_types_by_name) | nested == set(NRI_ENUMS)


@pytest.mark.parametrize(
    ("event", "number", "mask_bit"),
    [
        ("RUN_POD_SANDBOX", 1, 0x0001),
        ("CREATE_CONTAINER", 4, 0x0008),
        ("UPDATE_CONTAINER", 8, 0x0080),
        ("STOP_CONTAINER", 10, 0x0200),
        ("REMOVE_CONTAINER", 11, 0x0400),
        ("VALIDATE_CONTAINER_ADJUSTMENT", 14, 0x2000),
        ("LAST", 15, 0x4000),
    ],
)
def test_event_numbers_and_mask_bits(event: str, number: int, mask_bit: int) -> None:
    assert api_pb2.Event.Value(event) == number
    assert 1 << (number - 1) == mask_bit


# ---------------------------------------------------------------------------------------------------
# Services
# ---------------------------------------------------------------------------------------------------

SERVICES: dict[str, dict[str, tuple[str, str]]] = {
    "Runtime": {
        "RegisterPlugin": ("RegisterPluginRequest", "Empty"),
        "UpdateContainers": ("UpdateContainersRequest", "UpdateContainersResponse"),
    },
    "Plugin": {
        "Configure": ("ConfigureRequest", "ConfigureResponse"),
        "Synchronize": ("SynchronizeRequest", "SynchronizeResponse"),
        "Shutdown": ("Empty", "Empty"),
        "CreateContainer": ("CreateContainerRequest", "CreateContainerResponse"),
        "UpdateContainer": ("UpdateContainerRequest", "UpdateContainerResponse"),
        "StopContainer": ("StopContainerRequest", "StopContainerResponse"),
        "StateChange": ("StateChangeEvent", "Empty"),
        "UpdatePodSandbox": ("UpdatePodSandboxRequest", "UpdatePodSandboxResponse"),
        "ValidateContainerAdjustment": (
            "ValidateContainerAdjustmentRequest",
            "ValidateContainerAdjustmentResponse",
        ),
        **{
            method: (f"{method}Request", f"{method}Response")
            for method in (
                "RunPodSandbox",
                "PostUpdatePodSandbox",
                "StopPodSandbox",
                "RemovePodSandbox",
                "PostCreateContainer",
                "StartContainer",
                "PostStartContainer",
                "PostUpdateContainer",
                "RemoveContainer",
            )
        },
    },
}


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_service_methods(service: str) -> None:
    descriptor = NRI.services_by_name[service]
    assert descriptor.full_name == f"{PACKAGE}.{service}"
    actual = {
        m.name: (m.input_type.full_name, m.output_type.full_name, m.client_streaming, m.server_streaming)
        for m in descriptor.methods
    }
    expected = {
        name: (f"{PACKAGE}.{req}", f"{PACKAGE}.{resp}", False, False)
        for name, (req, resp) in SERVICES[service].items()
    }
    assert actual == expected


def test_only_the_two_nri_services() -> None:
    assert set(NRI.services_by_name) == set(SERVICES)


# ---------------------------------------------------------------------------------------------------
# Captured wire vectors
# ---------------------------------------------------------------------------------------------------


_TRUNCATED = re.compile(r"(?P<prefix>.*)\.\.\.\((?P<length>\d+) chars\)", re.DOTALL)


def _payload_comment(name: str) -> tuple[str, str]:
    """(full message name, proto JSON text) from a vector's ``# payload <type>...: {json}`` line."""
    [line] = [c for c in comment_lines(name) if c.startswith("payload ")]
    head, text = line.removeprefix("payload ").split(": ", 1)
    return head.split()[0], text


def _assert_matches_captured_json(message: Message, captured: str) -> None:
    """Compare with the JSON the capture printed (proto field names, compact, declaration order).

    Long payloads are printed cut short as ``<prefix>...(<total length> chars)``; then the prefix and
    the total length must match.
    """
    ours = json_format.MessageToDict(message, preserving_proto_field_name=True)
    cut = _TRUNCATED.fullmatch(captured)
    if cut is None:
        assert ours == json.loads(captured)
        return
    text = json.dumps(ours, separators=(",", ":"))
    assert text.startswith(cut["prefix"])
    assert len(text) == int(cut["length"])


def _reply_to(name: str) -> str | None:
    [line] = [c for c in comment_lines(name) if c.startswith("payload ")]
    head = line.split(": ", 1)[0]
    return head.split("(reply to ", 1)[1].rstrip(")") if "(reply to " in head else None


def _decode(name: str) -> tuple[request_pb2.Request | request_pb2.Response, bytes, Message]:
    """(ttrpc envelope, NRI payload bytes, decoded NRI message) of a vector."""
    _, msg_type, _, data = ttrpc_parts(name)
    envelope: request_pb2.Request | request_pb2.Response
    if msg_type == 1:
        envelope = request_pb2.Request.FromString(data)
    else:
        assert msg_type == 2, f"{name}: ttrpc type {msg_type}"
        envelope = request_pb2.Response.FromString(data)
    payload = envelope.payload
    full_name, _ = _payload_comment(name)
    assert full_name.startswith(PACKAGE + ".")
    cls = getattr(api_pb2, full_name.removeprefix(PACKAGE + "."))
    return envelope, payload, cls.FromString(payload)


ALL_VECTORS = vector_names()


def test_vector_set_includes_the_nri_requests() -> None:
    for prefix in ("05-", "07-", "09-", "13-", "14-"):
        assert any(n.startswith(prefix) for n in ALL_VECTORS), f"vector {prefix}* missing"


@pytest.mark.parametrize("name", ALL_VECTORS)
def test_vector_payload_decodes_to_the_captured_json(name: str) -> None:
    _, payload, message = _decode(name)
    _assert_matches_captured_json(message, _payload_comment(name)[1])
    # Every map in the vectors has at most one entry, so Go's output is canonical: re-encoding matches.
    assert message.SerializeToString() == payload


@pytest.mark.parametrize("name", ALL_VECTORS)
def test_vector_envelope_reencodes_identically(name: str) -> None:
    envelope, _, _ = _decode(name)
    assert envelope.SerializeToString() == ttrpc_parts(name)[3]


@pytest.mark.parametrize("name", ALL_VECTORS)
def test_vector_method_types_match_our_services(name: str) -> None:
    """The payload type the Go peer used for a method is the type our service declares for it."""
    conn_id, _ = ttrpc_message(name)
    service = NRI.services_by_name["Plugin" if conn_id == 1 else "Runtime"]
    envelope, _, message = _decode(name)
    if isinstance(envelope, request_pb2.Request):
        assert envelope.service == service.full_name
        method, want = envelope.method, "input_type"
    else:
        method, want = _reply_to(name) or "", "output_type"
    if method == "NoSuchMethod":  # the deliberately unknown method of vectors 11 and 12
        assert method not in service.methods_by_name
        return
    assert getattr(service.methods_by_name[method], want) is message.DESCRIPTOR


def _request(prefix: str) -> Message:
    [name] = [n for n in ALL_VECTORS if n.startswith(prefix)]
    return _decode(name)[2]


def test_vector_05_synchronize_request() -> None:
    req = _request("05-")
    assert isinstance(req, api_pb2.SynchronizeRequest)
    assert [p.id for p in req.pods] == ["pod0"]
    assert req.pods[0].linux.cgroup_parent == "/kubepods/pod1234"
    [ctr] = req.containers
    assert (ctr.id, ctr.pod_sandbox_id, ctr.state) == ("ctr9", "pod0", api_pb2.CONTAINER_RUNNING)
    cpu = ctr.linux.resources.cpu
    assert (cpu.shares.value, cpu.quota.value, cpu.period.value, cpu.cpus) == (1024, 100000, 100000, "1")
    assert ctr.linux.cgroups_path == "/kubepods/pod1234/ctr9"
    assert req.more is False


def test_vector_07_create_container_request() -> None:
    req = _request("07-")
    assert isinstance(req, api_pb2.CreateContainerRequest)
    assert req.pod.id == "pod0"
    ctr = req.container
    assert (ctr.id, ctr.name, ctr.state) == ("ctr0", "app", api_pb2.CONTAINER_CREATED)
    assert list(ctr.env) == ["OPENSHIFT_MUTUAL_CPUS=0"]
    # The runtime sends empty sub-messages for nil parts: they must decode as present.
    assert ctr.HasField("hooks")
    assert ctr.linux.resources.HasField("memory")
    assert ctr.linux.resources.cpu.quota.value == 100000
    assert ctr.linux.resources.cpu.cpus == "1"


def test_vector_09_update_container_request() -> None:
    req = _request("09-")
    assert isinstance(req, api_pb2.UpdateContainerRequest)
    assert req.container.id == "ctr0"
    assert req.container.state == api_pb2.CONTAINER_RUNNING
    assert req.linux_resources.cpu.cpus == "0-1"
    assert req.linux_resources.HasField("memory")
    assert not req.linux_resources.cpu.HasField("quota")


@pytest.mark.parametrize(
    ("prefix", "ctr_id", "blob_len"), [("13-", "big5000", 4600), ("14-", "big10000", 9600)]
)
def test_vector_large_create_container_request(prefix: str, ctr_id: str, blob_len: int) -> None:
    req = _request(prefix)
    assert isinstance(req, api_pb2.CreateContainerRequest)
    assert req.container.id == ctr_id
    assert dict(req.container.annotations) == {"example.com/blob": "x" * blob_len}
