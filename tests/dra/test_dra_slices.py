"""The ResourceSlice and DeviceClass builders, checked against the resource.k8s.io/v1 OpenAPI schema.

The schema (kubernetes-validate, strict: unknown fields refused) checks shapes, types and required
fields. It does not carry the API server's own rules (device names are DNS labels, at most 128 devices
in a slice, object names are DNS subdomains): those are asserted here directly.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from nri_plugin.dra import slices

DRIVER = "shared-cpus.mixed-cpu.openshift.io"
NODE = "worker-1"
UID = "9a3c1f0e-5b8d-4c1e-8f2a-0d6b7e4c3a21"
# The newest Kubernetes the installed schemas know; resource.k8s.io/v1 needs at least 1.34.
K8S_VERSION = kubernetes_validate.latest_version()
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(rf"{DNS_LABEL.pattern}(\.{DNS_LABEL.pattern})*")


def validate(obj: dict[str, Any]) -> str:
    """The Kubernetes version the object validated against (raises on a schema violation)."""
    return str(kubernetes_validate.validate(obj, K8S_VERSION, strict=True))


def build(device_count: int, node: str = NODE, generation: int = 1) -> tuple[dict[str, Any], ...]:
    return slices.resource_slices(
        node_name=node, node_uid=UID, driver=DRIVER, device_count=device_count, generation=generation
    )


def test_schema_version_is_new_enough_for_dra_v1() -> None:
    major, minor = (int(part) for part in K8S_VERSION.split(".")[:2])
    assert (major, minor) >= (1, 34)


@pytest.mark.parametrize("device_count", [1, 127, 128, 129, 256, 300])
def test_slices_validate_and_cover_every_device_once(device_count: int) -> None:
    published = build(device_count, generation=3)
    expected_slices = -(-device_count // 128)
    assert len(published) == expected_slices
    names: list[str] = []
    for index, obj in enumerate(published):
        assert validate(obj) == kubernetes_validate.utils.major_minor(K8S_VERSION)
        spec = obj["spec"]
        assert spec["driver"] == DRIVER
        assert spec["nodeName"] == NODE
        assert spec["pool"] == {"name": NODE, "generation": 3, "resourceSliceCount": expected_slices}
        assert 1 <= len(spec["devices"]) <= slices.MAX_DEVICES_PER_SLICE
        assert obj["metadata"]["name"] == f"{NODE}-{DRIVER}-{index}"
        assert obj["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": UID, "controller": True}
        ]
        names.extend(device["name"] for device in spec["devices"])
    assert names == [f"shared-cpus-{n}" for n in range(device_count)]
    assert all(len(name) <= 63 and DNS_LABEL.fullmatch(name) for name in names)


def test_default_device_count_needs_two_slices() -> None:
    assert slices.slice_count(256) == 2
    assert [len(obj["spec"]["devices"]) for obj in build(256)] == [128, 128]


def test_device_class_validates_and_selects_the_driver() -> None:
    obj = slices.device_class(DRIVER)
    validate(obj)
    assert obj["metadata"]["name"] == DRIVER
    assert obj["spec"] == {
        "selectors": [{"cel": {"expression": 'device.driver == "shared-cpus.mixed-cpu.openshift.io"'}}],
        "extendedResourceName": "workload.openshift.io/enable-shared-cpus",
    }
    without = slices.device_class(DRIVER, extended_resource_name="")
    validate(without)
    assert "extendedResourceName" not in without["spec"]


def test_a_long_node_name_is_shortened_to_a_distinct_dns_subdomain() -> None:
    long_a = ".".join(["a" * 60] * 4)  # 243 characters: a valid node name
    long_b = ".".join(["a" * 60] * 3 + ["b" * 60])
    names = {slices.slice_name(node, DRIVER, index) for node in (long_a, long_b) for index in (0, 1)}
    assert len(names) == 4
    for name in names:
        assert len(name) <= 253
        assert DNS_SUBDOMAIN.fullmatch(name), name
    # A cut that lands just after a '.' or '-' is stripped back to a letter or digit.
    # The head kept is 240 characters: put a '.' (or the '-' after the node name) at each spot near
    # its end.
    nodes = ["n" * dot + "." + "m" * 5 for dot in range(236, 242)] + ["n" * 239]
    for node in nodes:
        name = slices.slice_name(node, DRIVER, 0)
        assert len(name) <= 253
        assert DNS_SUBDOMAIN.fullmatch(name), name
    validate(build(1, node=long_a)[0])


@pytest.mark.parametrize(
    ("what", "kwargs", "message"),
    [
        ("driver", {"driver": "Shared-CPUs"}, "driver name 'Shared-CPUs' is not a DNS subdomain"),
        ("driver", {"driver": "a" * 64}, "of at most 63 characters"),
        ("node", {"node_name": "worker_1"}, "node name 'worker_1' is not a DNS subdomain"),
        ("uid", {"node_uid": ""}, "node uid is empty"),
        ("count", {"device_count": 0}, "device count 0 must be a positive integer"),
        ("count", {"device_count": True}, "device count True must be a positive integer"),
        ("generation", {"generation": 0}, "pool generation 0 must be a positive integer"),
    ],
)
def test_bad_inputs_are_refused_with_the_cause(what: str, kwargs: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {
        "node_name": NODE,
        "node_uid": UID,
        "driver": DRIVER,
        "device_count": 4,
        "generation": 1,
    }
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        slices.resource_slices(**arguments)


def _broken(mutate: str) -> dict[str, Any]:
    obj = copy.deepcopy(build(3)[0])
    spec = obj["spec"]
    if mutate == "device without a name":
        spec["devices"][1] = {}
    elif mutate == "pool without a slice count":
        del spec["pool"]["resourceSliceCount"]
    elif mutate == "generation as a string":
        spec["pool"]["generation"] = "1"
    elif mutate == "unknown field":
        spec["devices"][0]["basic"] = {}  # the v1beta1 shape, gone from v1
    elif mutate == "no driver":
        del spec["driver"]
    return obj


@pytest.mark.parametrize(
    "mutate",
    [
        "device without a name",
        "pool without a slice count",
        "generation as a string",
        "unknown field",
        "no driver",
    ],
)
def test_the_schema_refuses_a_broken_slice(mutate: str) -> None:
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(_broken(mutate))


def test_the_schema_refuses_a_broken_device_class() -> None:
    obj = slices.device_class(DRIVER)
    obj["spec"]["selectors"][0]["cel"] = {"expr": "true"}  # "expression" is the field
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(obj)


def _doc_examples() -> list[dict[str, Any]]:
    """The API objects in docs/dra.md's yaml blocks."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "dra.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    return [doc for block in blocks for doc in yaml.safe_load_all(block) if doc]


def test_the_examples_in_docs_dra_are_valid_objects() -> None:
    examples = _doc_examples()
    kinds = sorted(obj["kind"] for obj in examples)
    assert kinds == ["DeviceClass", "ResourceClaimTemplate", "ResourceClaimTemplate"]
    for obj in examples:
        validate(obj)
    [device_class] = [obj for obj in examples if obj["kind"] == "DeviceClass"]
    assert device_class == slices.device_class(DRIVER)
    alternatives = [
        request["firstAvailable"]
        for obj in examples
        if obj["kind"] == "ResourceClaimTemplate"
        for request in obj["spec"]["spec"]["devices"]["requests"]
        if "firstAvailable" in request
    ]
    assert [subs[0]["deviceClassName"] for subs in alternatives] == [DRIVER]  # ours first


# -- watch events --------------------------------------------------------------------------------------


def _published() -> dict[str, tuple[object, ...]]:
    return {obj["metadata"]["name"]: slices.slice_shape(obj) for obj in build(256)}


def test_the_events_of_our_own_writes_need_nothing() -> None:
    published = _published()
    for obj in build(256):
        stored = copy.deepcopy(obj)
        stored["metadata"].update(resourceVersion="42", uid="x", managedFields=[{"manager": "us"}])
        for kind in ("ADDED", "MODIFIED"):
            assert not slices.event_needs_publish(kind, stored, published)
    assert not slices.event_needs_publish("BOOKMARK", {"metadata": {"resourceVersion": "9"}}, published)


def test_a_deleted_slice_of_ours_needs_publishing_a_stale_one_not() -> None:
    published = _published()
    first, second = build(256)
    assert slices.event_needs_publish("DELETED", first, published)
    assert slices.event_needs_publish("DELETED", second, published)
    (stale,) = [obj for obj in build(300) if obj["metadata"]["name"].endswith("-2")]
    assert not slices.event_needs_publish("DELETED", stale, published)


@pytest.mark.parametrize(
    "change",
    [
        lambda obj: obj["spec"].update(devices=obj["spec"]["devices"][:3]),
        lambda obj: obj["spec"]["pool"].update(generation=7),
        lambda obj: obj["spec"]["pool"].update(resourceSliceCount=1),
        lambda obj: obj["metadata"].update(ownerReferences=[]),
        lambda obj: obj["spec"].update(nodeName="worker-2"),
    ],
    ids=["devices", "generation", "slice-count", "owner", "node"],
)
def test_a_slice_changed_by_someone_else_needs_publishing(change: Any) -> None:
    published = _published()
    obj = copy.deepcopy(build(256)[0])
    change(obj)
    assert slices.event_needs_publish("MODIFIED", obj, published)


def test_a_slice_we_did_not_write_needs_publishing() -> None:
    """Publishing deletes it (a leftover of a larger count, or someone else's slice in our pool)."""
    (extra,) = [obj for obj in build(300) if obj["metadata"]["name"].endswith("-2")]
    assert slices.event_needs_publish("ADDED", extra, _published())
    assert not slices.event_needs_publish("ADDED", {"metadata": {}}, _published())  # no name: not one
