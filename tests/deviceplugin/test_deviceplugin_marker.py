"""The allocation marker: signing and checking, with a key in memory (its file: test_deviceplugin_keyfile)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nri_plugin.deviceplugin.marker import ANNOTATION_KEY, HostKey, Signed

KEY_A = HostKey(bytes(range(32)))
KEY_B = HostKey(bytes(range(1, 33)))
device_id_strategy = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", fullmatch=True)

# ---------------------------------------------------------------------------------------------------
# sign / verify
# ---------------------------------------------------------------------------------------------------


def test_annotation_key_is_a_valid_kubernetes_annotation_key() -> None:
    prefix, name = ANNOTATION_KEY.split("/")
    assert len(prefix) <= 253
    assert len(name) <= 63
    assert prefix == prefix.lower()


def _v1(key_bytes: bytes, device_id: str) -> str:
    """A marker as earlier versions signed it (``v1:<device id>:<mac>``), from its documented form."""
    context = b"mixed-cpu-nri-plugin shared-cpus-allocation v1\0"
    digest = hmac.new(key_bytes, context + device_id.encode(), hashlib.sha256).digest()
    return f"v1:{device_id}:{base64.urlsafe_b64encode(digest).rstrip(b'=').decode()}"


def test_sign_then_verify() -> None:
    value = KEY_A.sign("shared-cpus-7")
    assert value.startswith("v2:shared-cpus-7:")
    assert KEY_A.verify(value) == "shared-cpus-7"
    assert KEY_A.verify_annotations({ANNOTATION_KEY: value, "other": "x"}) == "shared-cpus-7"


def test_every_allocation_is_a_new_marker_numbered_above_the_last() -> None:
    key = HostKey(bytes(range(32)))
    first, second = key.sign("shared-cpus-1"), key.sign("shared-cpus-1")
    assert first != second
    read_first, read_second = key.read(first), key.read(second)
    assert read_first is not None
    assert read_second is not None
    assert read_first.device == read_second.device == "shared-cpus-1"
    assert read_second.allocation > read_first.allocation >= 1


def test_allocations_are_numbered_above_the_floor_whatever_the_clock() -> None:
    key = HostKey(bytes(range(32)))
    ahead = 10**19  # a spent allocation far ahead of this clock (a clock stepped back since)
    key.raise_floor(ahead)
    signed = key.read(key.sign("shared-cpus-1"))
    assert signed is not None
    assert signed.allocation == ahead + 1


def test_a_given_allocation_signs_the_same_marker() -> None:
    assert KEY_A.sign("shared-cpus-1", allocation=5) == KEY_A.sign("shared-cpus-1", allocation=5)
    assert KEY_A.sign("shared-cpus-1", allocation=5) != KEY_A.sign("shared-cpus-1", allocation=6)
    assert KEY_A.sign("shared-cpus-1", allocation=5) != KEY_B.sign("shared-cpus-1", allocation=5)


def test_pods_are_signed_into_the_marker() -> None:
    pods = ["0b5f6a1e-3c1d-4e8a-9f00-5a1b2c3d4e5f", "1b5f6a1e-3c1d-4e8a-9f00-5a1b2c3d4e5f"]
    value = KEY_A.sign("dra.shared-cpus-1", pods=pods, allocation=3)
    signed = KEY_A.read(value)
    assert signed is not None
    assert signed.pods == frozenset(pods)
    assert signed.allocation == 3
    # Another pod list under the same MAC is not a marker.
    assert KEY_A.read(value.replace(pods[1], "2b5f6a1e-3c1d-4e8a-9f00-5a1b2c3d4e5f")) is None
    assert KEY_A.read(value.replace(f",{pods[1]}", "")) is None
    with pytest.raises(ValueError, match="pod uids"):
        KEY_A.sign("dra.shared-cpus-1", pods=["a,b"])


def test_an_allocation_number_edited_is_refused() -> None:
    value = KEY_A.sign("shared-cpus-1", allocation=5)
    assert KEY_A.read(value.replace(":5:", ":6:")) is None


def test_markers_of_earlier_versions_are_read_as_allocation_0() -> None:
    value = _v1(bytes(range(32)), "shared-cpus-7")
    assert KEY_A.read(value) == Signed("shared-cpus-7", 0, frozenset())
    assert KEY_A.verify(value) == "shared-cpus-7"
    assert KEY_B.read(value) is None


def test_marker_made_with_another_key_is_refused() -> None:
    assert KEY_B.verify(KEY_A.sign("shared-cpus-1")) is None


def test_signature_moved_to_another_device_id_is_refused() -> None:
    value = KEY_A.sign("shared-cpus-1", allocation=9)
    assert KEY_A.verify(value.replace("shared-cpus-1", "shared-cpus-2")) is None
    mac = _v1(bytes(range(32)), "shared-cpus-1").rpartition(":")[2]
    assert KEY_A.verify(f"v1:shared-cpus-2:{mac}") is None


def test_forged_mac_is_refused() -> None:
    forged = base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode()
    assert KEY_A.verify(f"v1:shared-cpus-1:{forged}") is None
    assert KEY_A.verify(f"v2:shared-cpus-1:5::{forged}") is None


@pytest.mark.parametrize(
    "value",
    [
        None,
        7,
        b"v1:shared-cpus-1:x",
        "",
        "1",
        "true",
        "shared-cpus-1",
        "v2:shared-cpus-1:" + "A" * 43,
        "v2:shared-cpus-1:5:" + "A" * 43,
        "v2:shared-cpus-1::" + ":" + "A" * 43,
        "v2:shared-cpus-1:" + "1" * 21 + "::" + "A" * 43,
        "v2:shared-cpus-1:5:x:" + "A" * 43,
        "v3:shared-cpus-1:5::" + "A" * 43,
        "v1::" + "A" * 43,
        "v1:shared-cpus-1:" + "A" * 42,
        "v1:shared-cpus-1:" + "A" * 44,
        "v1:shared-cpus-1:" + "A" * 42 + "=",
        "v1:a:b:" + "A" * 43,
    ],
)
def test_malformed_values_are_refused(value: object) -> None:
    assert KEY_A.verify(value) is None


def test_altered_marker_is_refused() -> None:
    value = KEY_A.sign("shared-cpus-1")
    assert KEY_A.verify(value + " ") is None
    assert KEY_A.verify(" " + value) is None
    assert KEY_A.verify(value.upper()) is None
    last = value[-1]
    assert KEY_A.verify(value[:-1] + ("B" if last != "B" else "C")) is None


def test_missing_annotation() -> None:
    assert KEY_A.verify_annotations({}) is None
    assert KEY_A.verify_annotations({"workload.openshift.io/enable-shared-cpus": "1"}) is None


@pytest.mark.parametrize("device_id", ["", "a:b", "-x", "x" * 64, "é", "a b"])
def test_sign_refuses_ids_kubelet_would_not_give(device_id: str) -> None:
    with pytest.raises(ValueError, match="cannot sign device id"):
        KEY_A.sign(device_id)


@given(device_id_strategy)
def test_round_trip_for_every_valid_id(device_id: str) -> None:
    assert KEY_A.verify(KEY_A.sign(device_id)) == device_id
    assert KEY_B.verify(KEY_A.sign(device_id)) is None


@given(st.text(max_size=200))
def test_verify_never_raises_and_never_accepts_noise(value: str) -> None:
    assert KEY_A.verify(value) is None


def test_secret_size_and_repr() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        HostKey(b"short")
    assert "00010203" not in repr(KEY_A)
    assert repr(KEY_A) == "HostKey(path=None)"


def test_importing_the_marker_loads_no_io_or_logging() -> None:
    """The pure policy imports the marker: it must not bring asyncio, sockets, grpc, logging or file I/O."""
    heavy = [
        "asyncio",
        "socket",
        "grpc",
        "structlog",
        "logging",
        "nri_plugin.common.atomicfile",
        "nri_plugin.deviceplugin.keyfile",
    ]
    probe = (
        "import sys; import nri_plugin.deviceplugin.marker;"
        f" print(','.join(m for m in {heavy!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""
