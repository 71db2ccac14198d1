"""`nri_plugin.dra.cdi`: the CDI spec of a prepared claim, its file, and what refuses to become one.

Every spec built here is checked against the CDI JSON schema (tests/data/cdi/spec.schema.json)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cdi_support import assert_valid_spec, load_valid_spec, schema_errors

from nri_plugin.deviceplugin.marker import MARKER_ENV, HostKey
from nri_plugin.dra import cdi
from nri_plugin.dra.claims import AllocatedDevice

UID = "0b5f6a1e-3c1d-4e8a-9f00-5a1b2c3d4e5f"
OTHER_UID = "9d3c2b1a-0000-4000-8000-00000000abcd"
CLAIM = cdi.ClaimRef(namespace="team-a", name="web-0-shared-cpus", uid=UID)
POOL = "node-1"
PUBLISHED = frozenset(f"shared-cpus-{n}" for n in range(8)) | {"d" * 59}


def _read(cdi_dir: Path, claim: cdi.ClaimRef, key: HostKey) -> tuple[AllocatedDevice, ...] | None:
    return cdi.read_recorded(cdi_dir, claim, key=key, pool=POOL, devices=PUBLISHED)


def _device(device: str = "shared-cpus-3", request: str = "shared") -> AllocatedDevice:
    return AllocatedDevice(request=request, pool=POOL, device=device)


@pytest.fixture
def key() -> HostKey:
    return HostKey(os.urandom(32))


@pytest.fixture
def cdi_dir(tmp_path: Path) -> Path:
    path = tmp_path / "cdi"
    path.mkdir()
    return path


def _env(cdi_device: dict[str, object]) -> dict[str, str]:
    edits = cdi_device["containerEdits"]
    assert isinstance(edits, dict)
    return dict(entry.split("=", 1) for entry in edits["env"])


def test_the_spec_carries_the_signed_marker_of_each_device(key: HostKey) -> None:
    spec = cdi.build_spec(CLAIM, [_device("shared-cpus-3"), _device("shared-cpus-7", "other")], key)
    assert_valid_spec(spec)
    assert spec["cdiVersion"] == "0.6.0"
    assert spec["kind"] == "mixed-cpu.openshift.io/shared-cpus"
    names = [d["name"] for d in spec["devices"]]
    assert names == [f"{UID}-shared-cpus-3", f"{UID}-shared-cpus-7"]
    envs = [_env(d) for d in spec["devices"]]
    assert [list(env) for env in envs] == [
        [f"{MARKER_ENV}_SHARED_CPUS_3"],
        [f"{MARKER_ENV}_SHARED_CPUS_7"],
    ]
    signed = [key.verify(value) for env in envs for value in env.values()]
    assert signed == ["dra.shared-cpus-3", "dra.shared-cpus-7"]


def test_two_devices_in_one_container_keep_both_markers(key: HostKey) -> None:
    """CDI merges a container's env entries by name: with one name per device, a container given
    devices of two claims keeps both markers (with one name it would keep only the last)."""
    first = cdi.build_spec(CLAIM, [_device("shared-cpus-3")], key)
    other = cdi.ClaimRef("team-a", "second", OTHER_UID)
    second = cdi.build_spec(other, [_device("shared-cpus-4")], key)
    merged: dict[str, str] = {}
    for spec in (first, second):
        merged.update(_env(spec["devices"][0]))
    assert {name: key.verify(value) for name, value in merged.items()} == {
        cdi.marker_env("shared-cpus-3"): "dra.shared-cpus-3",
        cdi.marker_env("shared-cpus-4"): "dra.shared-cpus-4",
    }


def test_device_annotations_record_the_claim_pool_device_and_requests(key: HostKey) -> None:
    spec = cdi.build_spec(CLAIM, [_device(request="a"), _device(request="b"), _device(request="a")], key)
    assert_valid_spec(spec)
    (device,) = spec["devices"]  # one device serving two requests is one CDI device
    assert device["annotations"] == {
        "mixed-cpu.openshift.io/claim-namespace": "team-a",
        "mixed-cpu.openshift.io/claim-name": "web-0-shared-cpus",
        "mixed-cpu.openshift.io/claim-uid": UID,
        "mixed-cpu.openshift.io/pool": POOL,
        "mixed-cpu.openshift.io/device": "shared-cpus-3",
        "mixed-cpu.openshift.io/requests": "a,b",
    }


def test_a_subrequest_is_recorded_whole_and_answered_as_its_request(key: HostKey, cdi_dir: Path) -> None:
    """firstAvailable: the result names ``shared/first``; kubelet matches the container's ``shared``."""
    devices = [_device("shared-cpus-3", "shared/first"), _device("shared-cpus-3", "other")]
    spec = cdi.build_spec(CLAIM, devices, key)
    assert_valid_spec(spec)
    assert spec["devices"][0]["annotations"]["mixed-cpu.openshift.io/requests"] == "shared/first,other"
    (prepared,) = cdi.prepared_devices(UID, devices)
    assert prepared.requests == ("shared", "other")
    # Two subrequests of one request (two alternatives that each got this device) answer it once.
    (twice,) = cdi.prepared_devices(UID, [_device(request="shared/a"), _device(request="shared/b")])
    assert twice.requests == ("shared",)
    # A prepare answered from the file later gives kubelet the same.
    cdi.write_spec(cdi_dir, CLAIM, spec, fsync=False)
    recorded = _read(cdi_dir, CLAIM, key)
    assert recorded is not None
    assert cdi.prepared_devices(UID, recorded) == cdi.prepared_devices(UID, devices)


def test_cdi_device_id_is_kind_equals_name() -> None:
    expected = f"mixed-cpu.openshift.io/shared-cpus={UID}-shared-cpus-3"
    assert cdi.cdi_device_id(UID, "shared-cpus-3") == expected


def test_write_publishes_one_file_per_claim_readable_by_root_only(key: HostKey, cdi_dir: Path) -> None:
    spec = cdi.build_spec(CLAIM, [_device()], key)
    path = cdi.write_spec(cdi_dir, CLAIM, spec, fsync=False)
    assert path == cdi_dir / f"mixed-cpu.openshift.io-shared-cpus_{UID}.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # the runtimes read it as root
    assert load_valid_spec(path) == spec
    spec = cdi.build_spec(CLAIM, [_device()], key, allocation=7)
    cdi.write_spec(cdi_dir, CLAIM, spec, fsync=False)
    first = path.read_bytes()
    cdi.write_spec(cdi_dir, CLAIM, cdi.build_spec(CLAIM, [_device()], key, allocation=7), fsync=False)
    assert path.read_bytes() == first  # the same claim, devices and allocation: the same file
    assert sorted(p.name for p in cdi_dir.iterdir()) == [path.name]  # no temporary file left


def test_the_marker_names_the_pods_the_claim_is_reserved_for_and_the_file_records_them(
    key: HostKey, cdi_dir: Path
) -> None:
    pods = ("aaaaaaaa-0000-4000-8000-000000000001", "bbbbbbbb-0000-4000-8000-000000000002")
    device = AllocatedDevice(request="shared", pool=POOL, device="shared-cpus-3", reserved_for=pods)
    spec = cdi.build_spec(CLAIM, [device], key)
    [entry] = spec["devices"]
    [env] = entry["containerEdits"]["env"]
    signed = key.read(env.partition("=")[2])
    assert signed is not None
    assert (signed.device, signed.pods) == ("dra.shared-cpus-3", frozenset(pods))
    cdi.write_spec(cdi_dir, CLAIM, spec, fsync=False)
    assert _read(cdi_dir, CLAIM, key) == (device,)  # the fallback signs for the same pods
    # An annotation edited to other pods than the marker names: not a file this driver wrote.
    entry["annotations"][cdi.ANN_PODS] = pods[0]
    cdi.write_spec(cdi_dir, CLAIM, spec, fsync=False)
    with pytest.raises(cdi.CdiError, match="names other pods than its annotation records"):
        _read(cdi_dir, CLAIM, key)
    # A spec written before the pods were recorded (none in its marker) reads back with none.
    old = cdi.build_spec(CLAIM, [_device()], key)
    cdi.write_spec(cdi_dir, CLAIM, old, fsync=False)
    assert cdi.ANN_PODS not in old["devices"][0]["annotations"]
    assert _read(cdi_dir, CLAIM, key) == (_device(),)


def test_a_claim_reserved_for_what_cannot_be_signed_is_refused_with_a_reason(key: HostKey) -> None:
    device = AllocatedDevice(request="shared", pool=POOL, device="shared-cpus-3", reserved_for=("a,b",))
    with pytest.raises(cdi.CdiError, match=r"status\.reservedFor"):
        cdi.build_spec(CLAIM, [device], key)


def test_write_makes_a_missing_spec_directory(key: HostKey, tmp_path: Path) -> None:
    cdi_dir = tmp_path / "run" / "cdi"  # a tmpfs /var/run emptied by a reboot
    path = cdi.write_spec(cdi_dir, CLAIM, cdi.build_spec(CLAIM, [_device()], key), fsync=False)
    assert path.parent == cdi_dir
    assert stat.S_IMODE(cdi_dir.stat().st_mode) & 0o755 == 0o755
    assert load_valid_spec(path)["kind"] == cdi.KIND


def test_read_recorded_gives_back_what_was_written(key: HostKey, cdi_dir: Path) -> None:
    devices = (_device("shared-cpus-1", "a"), _device("shared-cpus-1", "b"), _device("shared-cpus-2", "a"))
    cdi.write_spec(cdi_dir, CLAIM, cdi.build_spec(CLAIM, devices, key), fsync=False)
    assert _read(cdi_dir, CLAIM, key) == devices
    assert _read(cdi_dir, cdi.ClaimRef("team-a", "other", OTHER_UID), key) is None


def _planted(key: HostKey, device: str = "shared-cpus-3", pool: str = POOL) -> dict[str, Any]:
    """A spec as the driver writes it, with `device` of `pool`, signed with `key`."""
    return cdi.build_spec(CLAIM, [AllocatedDevice("shared", pool, device)], key)


def _moved_marker(key: HostKey) -> dict[str, Any]:
    """shared-cpus-5's entry carrying shared-cpus-3's valid marker."""
    spec = _planted(key, "shared-cpus-5")
    spec["devices"][0]["containerEdits"] = {
        "env": [f"{cdi.marker_env('shared-cpus-5')}={key.sign('dra.shared-cpus-3')}"]
    }
    return spec


@pytest.mark.parametrize(
    ("planted", "why"),
    [
        # Signed by another node's key (or forged): the markers do not verify here.
        (lambda key: _planted(HostKey(os.urandom(32))), "marker this node's key signs"),
        # A device this node never published, even with a marker signed by its own key.
        (lambda key: _planted(key, "shared-cpus-99999"), "not one this node published"),
        # Our device, but recorded as another node's pool.
        (lambda key: _planted(key, pool="node-2"), "not one this node published"),
        # One device's valid marker put on another device.
        (_moved_marker, "marker this node's key signs"),
    ],
)
def test_read_recorded_refuses_a_spec_the_driver_did_not_write(
    key: HostKey, cdi_dir: Path, planted: Callable[[HostKey], dict[str, Any]], why: str
) -> None:
    cdi.spec_path(cdi_dir, UID).write_text(json.dumps(planted(key)))
    with pytest.raises(cdi.CdiError, match=f"is not one this driver wrote .*{why}"):
        _read(cdi_dir, CLAIM, key)


def test_read_recorded_refuses_a_file_of_another_claim(key: HostKey, cdi_dir: Path) -> None:
    other = cdi.ClaimRef("team-b", "x", OTHER_UID)
    spec = cdi.build_spec(other, [_device()], key)
    cdi.spec_path(cdi_dir, UID).write_text(json.dumps(spec))  # another claim's content under our name
    with pytest.raises(cdi.CdiError, match=r"records claim team-b/x .*remove it"):
        _read(cdi_dir, CLAIM, key)


@pytest.mark.parametrize(
    "content",
    [b"", b"{not json", b"[]", b'{"kind": "other.vendor/x", "devices": []}', b"\xff\xfe", b'{"kind": 1}'],
)
def test_read_recorded_refuses_a_damaged_file(key: HostKey, cdi_dir: Path, content: bytes) -> None:
    cdi.spec_path(cdi_dir, UID).write_bytes(content)
    with pytest.raises(cdi.CdiError, match="is not one this driver wrote"):
        _read(cdi_dir, CLAIM, key)


def test_read_recorded_refuses_a_link(key: HostKey, cdi_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps(cdi.build_spec(CLAIM, [_device()], key)))
    cdi.spec_path(cdi_dir, UID).symlink_to(target)
    with pytest.raises(cdi.CdiError, match="symbolic link"):
        _read(cdi_dir, CLAIM, key)


def test_remove_is_idempotent(key: HostKey, cdi_dir: Path) -> None:
    cdi.write_spec(cdi_dir, CLAIM, cdi.build_spec(CLAIM, [_device()], key), fsync=False)
    assert cdi.remove_spec(cdi_dir, UID) is True
    assert cdi.remove_spec(cdi_dir, UID) is False
    assert list(cdi_dir.iterdir()) == []


@pytest.mark.parametrize(
    "uid",
    [
        "../x",
        "../../etc/passwd",
        "a/b",
        "",
        "x" * 5000,
        UID.upper(),
        UID + "/..",
        UID[:-1],
        f"{UID}\n",
        "0b5f6a1e-3c1d-4e8a-9f00-5a1b2c3d4e5f.json",
    ],
)
def test_a_uid_that_is_not_a_kubernetes_uid_names_no_file(key: HostKey, tmp_path: Path, uid: str) -> None:
    cdi_dir = tmp_path / "a" / "cdi"
    cdi_dir.mkdir(parents=True)
    claim = cdi.ClaimRef("team-a", "c", uid)
    for call in (
        lambda: cdi.build_spec(claim, [_device()], key),
        lambda: cdi.spec_path(cdi_dir, uid),
        lambda: cdi.write_spec(cdi_dir, claim, {}, fsync=False),
        lambda: cdi.remove_spec(cdi_dir, uid),
        lambda: _read(cdi_dir, claim, key),
    ):
        with pytest.raises(cdi.CdiError, match="is not a Kubernetes UID") as info:
            call()
        assert len(str(info.value)) < 400  # a huge uid is cut in the message
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize(
    ("namespace", "name", "match"),
    [
        ("Team", "c", "namespace 'Team'"),
        ("", "c", "namespace ''"),
        ("a" * 64, "c", "namespace"),
        ("team-a", "", "claim name ''"),
        ("team-a", "a/b", "claim name 'a/b'"),
        ("team-a", "a" * 254, "claim name"),
    ],
)
def test_a_claim_with_a_bad_name_is_refused(key: HostKey, namespace: str, name: str, match: str) -> None:
    with pytest.raises(cdi.CdiError, match=match):
        cdi.build_spec(cdi.ClaimRef(namespace, name, UID), [_device()], key)


@pytest.mark.parametrize(
    ("device", "match"),
    [
        (AllocatedDevice("shared", POOL, "d" * 60), "at most 59 characters"),
        (AllocatedDevice("shared", POOL, "Shared"), "not a DNS label"),
        (AllocatedDevice("shared", POOL, "a.b"), "not a DNS label"),
        (AllocatedDevice("Req", POOL, "shared-cpus-1"), "request name 'Req'"),
        (AllocatedDevice("shared/First", POOL, "shared-cpus-1"), "request name 'shared/First'"),
        (AllocatedDevice("a/b/c", POOL, "shared-cpus-1"), "request name 'a/b/c'"),
        (AllocatedDevice("shared/", POOL, "shared-cpus-1"), "request name 'shared/'"),
        (AllocatedDevice("shared", POOL, "shared-cpus-1", admin_access=True), "with adminAccess"),
        (AllocatedDevice("shared", "", "shared-cpus-1"), "pool name ''"),
    ],
)
def test_a_device_that_cannot_be_written_is_refused(
    key: HostKey, device: AllocatedDevice, match: str
) -> None:
    with pytest.raises(cdi.CdiError, match=match):
        cdi.build_spec(CLAIM, [device], key)


def test_a_device_name_of_the_longest_allowed_length_is_signed(key: HostKey) -> None:
    spec = cdi.build_spec(CLAIM, [_device("d" * 59)], key)
    assert_valid_spec(spec)
    assert key.verify(_env(spec["devices"][0])[cdi.marker_env("d" * 59)]) == "dra." + "d" * 59


def test_no_devices_or_one_device_in_two_pools_is_refused(key: HostKey) -> None:
    with pytest.raises(cdi.CdiError, match="no device of ours"):
        cdi.build_spec(CLAIM, [], key)
    with pytest.raises(cdi.CdiError, match="two pools"):
        cdi.build_spec(CLAIM, [_device(), AllocatedDevice("shared", "node-2", "shared-cpus-3")], key)


def test_the_schema_refuses_what_a_runtime_refuses(key: HostKey) -> None:
    """The schema is not a rubber stamp: each of these breaks one rule of the CDI SPEC."""
    good = cdi.build_spec(CLAIM, [_device()], key)
    assert schema_errors(good) == []
    device = good["devices"][0]
    broken = [
        {**good, "kind": "shared-cpus"},  # no vendor prefix
        {**good, "kind": "vendor.com/a/b"},
        {**good, "kind": "Vendor.com/a"},  # the prefix is a DNS subdomain
        {**good, "cdiVersion": "0.6"},
        {**good, "devices": []},
        {**good, "extra": 1},
        {**good, "devices": [{**device, "name": "-x"}]},
        {**good, "devices": [{**device, "name": "a/b"}]},
        {**good, "devices": [{k: v for k, v in device.items() if k != "containerEdits"}]},
        {**good, "devices": [{**device, "containerEdits": {"env": ["=value"]}}]},
        {**good, "devices": [{**device, "containerEdits": {"env": ["NOVALUE"]}}]},
        {**good, "devices": [{**device, "annotations": {"bad key!": "x"}}]},
        {**good, "devices": [{**device, "annotations": {"k": 1}}]},
    ]
    for spec in broken:
        assert schema_errors(spec), spec
