"""Our v1beta1 proto against the facts of kubelet's (k8s.io/kubelet pkg/apis/deviceplugin/v1beta1/
api.proto): package, services, method paths and streaming, every message's fields with numbers and
types. Any renamed, renumbered, retyped, missing or extra field fails."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.descriptor_pb2 import FileDescriptorProto

from nri_plugin.api.deviceplugin.v1beta1 import api_pb2 as api
from nri_plugin.api.deviceplugin.v1beta1 import api_pb2_grpc as api_grpc

FILE = api.DESCRIPTOR

_SCALARS = {
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_INT64: "int64",
}

MESSAGES: dict[str, str] = {
    "Empty": "",
    "DevicePluginOptions": "1 bool pre_start_required; 2 bool get_preferred_allocation_available",
    "RegisterRequest": "1 string version; 2 string endpoint; 3 string resource_name;"
    " 4 DevicePluginOptions options",
    "ListAndWatchResponse": "1 repeated Device devices",
    "TopologyInfo": "1 repeated NUMANode nodes",
    "NUMANode": "1 int64 ID",
    "Device": "1 string ID; 2 string health; 3 TopologyInfo topology",
    "PreStartContainerRequest": "1 repeated string devices_ids",
    "PreStartContainerResponse": "",
    "PreferredAllocationRequest": "1 repeated ContainerPreferredAllocationRequest container_requests",
    "ContainerPreferredAllocationRequest": "1 repeated string available_deviceIDs;"
    " 2 repeated string must_include_deviceIDs; 3 int32 allocation_size",
    "PreferredAllocationResponse": "1 repeated ContainerPreferredAllocationResponse container_responses",
    "ContainerPreferredAllocationResponse": "1 repeated string deviceIDs",
    "AllocateRequest": "1 repeated ContainerAllocateRequest container_requests",
    "ContainerAllocateRequest": "1 repeated string devices_ids",
    "CDIDevice": "1 string name",
    "AllocateResponse": "1 repeated ContainerAllocateResponse container_responses",
    "ContainerAllocateResponse": "1 map<string,string> envs; 2 repeated Mount mounts;"
    " 3 repeated DeviceSpec devices; 4 map<string,string> annotations; 5 repeated CDIDevice cdi_devices",
    "Mount": "1 string container_path; 2 string host_path; 3 bool read_only",
    "DeviceSpec": "1 string container_path; 2 string host_path; 3 string permissions",
}

# method: (request, response, server streaming)
SERVICES: dict[str, dict[str, tuple[str, str, bool]]] = {
    "Registration": {"Register": ("RegisterRequest", "Empty", False)},
    "DevicePlugin": {
        "GetDevicePluginOptions": ("Empty", "DevicePluginOptions", False),
        "ListAndWatch": ("Empty", "ListAndWatchResponse", True),
        "GetPreferredAllocation": ("PreferredAllocationRequest", "PreferredAllocationResponse", False),
        "Allocate": ("AllocateRequest", "AllocateResponse", False),
        "PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse", False),
    },
}


def _type_of(field: FieldDescriptor) -> str:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        return f"map<{_type_of(key)},{_type_of(value)}>"
    base = field.message_type.name if field.message_type is not None else _SCALARS[field.type]
    return f"repeated {base}" if field.is_repeated else base


def _fields(message: Descriptor) -> dict[str, str]:
    return {f.name: f"{f.number} {_type_of(f)}" for f in message.fields}


def _table(spec: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        number, *type_words, name = item.split()
        out[name] = f"{number} {' '.join(type_words)}"
    return out


def test_file_header() -> None:
    proto = FileDescriptorProto()
    FILE.CopyToProto(proto)
    assert (proto.package, proto.syntax) == ("v1beta1", "proto3")
    assert proto.name == "nri_plugin/api/deviceplugin/v1beta1/api.proto"
    assert not proto.dependency, "plain proto3: no gogoproto or other imports"


@pytest.mark.parametrize(("message", "spec"), MESSAGES.items(), ids=list(MESSAGES))
def test_message_fields(message: str, spec: str) -> None:
    assert _fields(FILE.message_types_by_name[message]) == _table(spec)


def test_every_message_is_checked() -> None:
    assert set(FILE.message_types_by_name) == set(MESSAGES)


@pytest.mark.parametrize("service", SERVICES)
def test_services_and_method_paths(service: str) -> None:
    descriptor = FILE.services_by_name[service]
    assert descriptor.full_name == f"v1beta1.{service}"
    methods = {
        m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in descriptor.methods
    }
    assert methods == SERVICES[service]
    assert not any(m.client_streaming for m in descriptor.methods)


def test_generated_grpc_module_uses_kubelets_paths() -> None:
    source = Path(api_grpc.__file__).read_text(encoding="utf-8")
    for service, methods in SERVICES.items():
        for method in methods:
            assert f"'/v1beta1.{service}/{method}'" in source
