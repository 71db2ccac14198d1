"""The mixed-CPU policy: the upstream oracle cases that apply to a plugin, and the pure functions.

The oracle rows come from the behaviour reference (§3, T* upstream tests, D* derived examples). Rows
marked "-fixed" expect the corrected behaviour where the upstream code is wrong. Each row runs the
real plugin object against a fake cgroup v1 tree (no NRI transport: see test_mixedcpu_end_to_end).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mixedcpu_support import PERIOD, FakeCgroups, Naming, make_container, make_plugin, make_pod, marker

from nri_plugin.api.nri import api_pb2 as api
from nri_plugin.cgroups import format_cpuset, parse_cpuset
from nri_plugin.deviceplugin.marker import ANNOTATION_KEY, MARKER_ENV, HostKey, dra_device_id
from nri_plugin.mixedcpu.books import Slot, Spent
from nri_plugin.mixedcpu.policy import (
    ISOLATED_ENV,
    MAX_CFS_QUOTA,
    SHARED_ENV,
    PolicyError,
    Proof,
    RequestCheck,
    _cpu_env,
    baseline_from_pod_resources,
    check_request,
    container_slot,
    exclusive_cpus,
    plan_create,
    plan_sync,
    plan_update,
    pod_quota_target,
    presents_marker,
    shows_evidence,
)
from nri_plugin.nri.errors import PluginRefusal
from nri_plugin.ttrpc.errors import Code

CGROUPFS = Naming("containerd", "cgroupfs")
KEY = HostKey(b"k" * 32)


def adjusted_env(adjust: api.ContainerAdjustment) -> dict[str, str]:
    return {e.key: e.value for e in adjust.env}


# -- the oracle table: CreateContainer ---------------------------------------------------------------


@dataclass(frozen=True)
class CreateCase:
    shared: str
    cpus: str
    quota: int | None = 200_000
    shares: int | None = 2048
    request: str = "marker"  # marker | annotation | none
    trust_annotation: bool = False
    env: tuple[str, ...] = ()
    qos: str = ""
    pod_quota: int | None = 400_000
    # expected
    error: str | None = None
    code: int = Code.INVALID_ARGUMENT
    cpus_out: str | None = None  # None: the adjustment does not set cpus
    quota_out: int | None = None  # None: the adjustment does not set the quota
    env_out: dict[str, str] = field(default_factory=dict)
    pod_after: int | None = None  # the pod's quota afterwards (None: unlimited)
    untouched: bool = False  # no adjustment at all


CREATE_CASES = [
    pytest.param(
        CreateCase(
            "3,4",
            "1-2",
            quota=None,
            request="annotation",
            trust_annotation=True,
            cpus_out="1-4",
            env_out={ISOLATED_ENV: "1-2", SHARED_ENV: "3-4"},
            pod_after=600_000,
        ),
        id="T3-HPT-precreate-env-and-union",
    ),
    pytest.param(
        CreateCase("3,4", "1-2", request="none", untouched=True, pod_after=400_000),
        id="T5-HPT-no-request-no-env",
    ),
    pytest.param(
        CreateCase(
            "3,4",
            "",
            request="annotation",
            trust_annotation=True,
            error="has no exclusive CPUs (its cpuset is empty)",
            pod_after=400_000,
        ),
        id="T6-HPT-request-without-cpus-fails",
    ),
    pytest.param(
        CreateCase("3,4", "", request="none", untouched=True, pod_after=400_000),
        id="T7-HPT-no-cpus-no-request-no-error",
    ),
    pytest.param(
        CreateCase(
            "",
            "1-2",
            request="annotation",
            trust_annotation=True,
            error="shared CPU pool is empty",
            code=Code.FAILED_PRECONDITION,
            pod_after=400_000,
        ),
        id="T8-HPT-empty-shared-set-fails",
    ),
    pytest.param(
        CreateCase(
            "", "0,1", error="shared CPU pool is empty", code=Code.FAILED_PRECONDITION, pod_after=400_000
        ),
        id="T1-T2-HPT-setSharedCPUs-empty-shared",
    ),
    pytest.param(
        CreateCase("0,5,7-10", "1,2", quota=20_000, request="none", untouched=True, pod_after=400_000),
        id="T18-GNT-pod-without-request-no-adjustment",
    ),
    pytest.param(
        CreateCase(
            "3,4",
            "5,6",
            cpus_out="3-6",
            quota_out=400_000,
            env_out={ISOLATED_ENV: "5-6", SHARED_ENV: "3-4"},
            pod_quota=200_000,
            pod_after=400_000,
        ),
        id="T26-ENH-worked-example",
    ),
    pytest.param(
        CreateCase(
            "2-3",
            "4-5",
            cpus_out="2-5",
            quota_out=400_000,
            env_out={ISOLATED_ENV: "4-5", SHARED_ENV: "2-3"},
            pod_quota=400_000,
            pod_after=600_000,
        ),
        id="D1-v1-pod-raised-by-n-shared-times-period",
    ),
    pytest.param(
        CreateCase(
            "2-3",
            "4-5",
            pod_quota=None,
            cpus_out="2-5",
            quota_out=400_000,
            env_out={ISOLATED_ENV: "4-5", SHARED_ENV: "2-3"},
            pod_after=None,
        ),
        id="D2-fixed-unlimited-pod-stays-unlimited",
    ),
    pytest.param(
        CreateCase(
            "2-3",
            "4-5",
            quota=-1,
            cpus_out="2-5",
            env_out={ISOLATED_ENV: "4-5", SHARED_ENV: "2-3"},
            pod_after=600_000,
        ),
        id="D2-fixed-unlimited-container-stays-unlimited",
    ),
    pytest.param(
        CreateCase(
            "2-3", "4-6", shares=2355, error="CPU request is fractional (2355 CPU shares", pod_after=400_000
        ),
        id="D7-fixed-fractional-request-fails-instead-of-silence",
    ),
    pytest.param(
        CreateCase(
            "2-3", "4-5", qos="burstable", error="not Guaranteed (QoS class Burstable)", pod_after=400_000
        ),
        id="E13-fixed-burstable-request-fails",
    ),
    pytest.param(
        CreateCase("2-3", "2-3", error="all its CPUs (2-3) are in the shared pool (2-3)", pod_after=400_000),
        id="E6-cpus-inside-shared-pool-fail",
    ),
    pytest.param(
        CreateCase(
            "0-63",
            "4-5",
            request="none",
            env=("OPENSHIFT_SHARED_CPUS=0-63",),
            untouched=True,
            pod_after=400_000,
        ),
        id="D11-fixed-env-is-never-proof",
    ),
    pytest.param(
        CreateCase(
            "0-1",
            "4-5",
            cpus_out="0-1,4-5",
            quota_out=400_000,
            env_out={ISOLATED_ENV: "4-5", SHARED_ENV: "0-1"},
            pod_quota=200_000,
            pod_after=400_000,
        ),
        id="D12-GNT-union-and-quota-pod-raised-not-overwritten",
    ),
    pytest.param(
        CreateCase(
            "3-4",
            "1-2",
            env=("OPENSHIFT_SHARED_CPUS=0-63", "OPENSHIFT_ISOLATED_CPUS=9"),
            cpus_out="1-4",
            quota_out=400_000,
            env_out={ISOLATED_ENV: "1-2", SHARED_ENV: "3-4"},
            pod_after=600_000,
        ),
        id="T36-env-replaces-author-values",
    ),
    pytest.param(
        CreateCase(
            "3,4", "1-2", request="annotation", trust_annotation=False, untouched=True, pod_after=400_000
        ),
        id="E14-annotation-untrusted-by-config-ignored",
    ),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("case", CREATE_CASES)
async def test_oracle_create(tmp_path: Path, case: CreateCase) -> None:
    tree = FakeCgroups(tmp_path / "cgroup")
    plugin, key = make_plugin(
        tmp_path / "state", tree.layout, parse_cpuset(case.shared), trust_pod_annotation=case.trust_annotation
    )
    pod = make_pod(CGROUPFS, qos=case.qos)
    if case.request == "annotation":
        pod.annotations["cpu-shared.crio.io/cnt1"] = "enable"
    tree.add_pod(pod, case.pod_quota)
    container = make_container(
        CGROUPFS,
        pod,
        "c1",
        "cnt1",
        cpus=case.cpus,
        quota=case.quota,
        shares=case.shares,
        env=case.env,
        annotations=marker(key) if case.request == "marker" else None,
    )
    if case.error is not None:
        with pytest.raises(PluginRefusal) as info:
            await plugin.create_container(pod, container)
        assert case.error in str(info.value)
        assert info.value.code == case.code
        assert tree.pod_quota(pod) == case.pod_after
        assert plugin.books.find("c1") is None
        return
    reply = await plugin.create_container(pod, container)
    assert tree.pod_quota(pod) == case.pod_after
    if case.untouched:
        assert reply is None
        return
    assert reply is not None
    assert not reply.update, "never an update for the container being created"
    cpu = reply.adjust.linux.resources.cpu
    assert cpu.cpus == (case.cpus_out or "")
    assert cpu.HasField("quota") == (case.quota_out is not None)
    if case.quota_out is not None:
        assert cpu.quota.value == case.quota_out
    # Only the fields we change: no period, shares, memory, mems.
    assert not cpu.HasField("period")
    assert not cpu.HasField("shares")
    assert not cpu.mems
    assert not reply.adjust.linux.resources.HasField("memory")
    assert adjusted_env(reply.adjust) == case.env_out


# -- the oracle table: UpdateContainer ----------------------------------------------------------------


@dataclass(frozen=True)
class UpdateCase:
    shared: str
    requested: str
    shared_container: bool = True
    env: tuple[str, ...] = ()
    requested_quota: int | None = None
    expect_cpus: str | None = None  # None: no update at all
    expect_quota: int | None = None


UPDATE_CASES = [
    pytest.param(UpdateCase("2-3", "0-1", expect_cpus="0-3", expect_quota=400_000), id="D8-union-re-added"),
    pytest.param(
        UpdateCase("2-3", "", expect_cpus="0-3", expect_quota=400_000), id="D9-fixed-empty-keeps-exclusive"
    ),
    pytest.param(UpdateCase("2-3", "0-1", shared_container=False), id="D10-not-shared-no-update"),
    pytest.param(
        UpdateCase("2-3", "0-1", shared_container=False, env=("OPENSHIFT_SHARED_CPUS=0-63",)),
        id="D11-fixed-env-never-proof-on-update",
    ),
    pytest.param(
        UpdateCase("2-3", "0-1", requested_quota=200_000, expect_cpus="0-3", expect_quota=400_000),
        id="CRI-O-update-quota-kept-raised",
    ),
    pytest.param(
        UpdateCase("2-3", "0-1", requested_quota=-1, expect_cpus="0-3"), id="update-unlimited-stays"
    ),
    pytest.param(
        UpdateCase("2-3", "0", expect_cpus="0,2-3", expect_quota=300_000), id="OCPBUGS-25926-kubelet-shrinks"
    ),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("case", UPDATE_CASES)
async def test_oracle_update(tmp_path: Path, case: UpdateCase) -> None:
    tree = FakeCgroups(tmp_path / "cgroup")
    plugin, key = make_plugin(tmp_path / "state", tree.layout, parse_cpuset(case.shared))
    pod = make_pod(CGROUPFS)
    tree.add_pod(pod, 200_000)
    container = make_container(
        CGROUPFS,
        pod,
        "c1",
        cpus="0-1",
        env=case.env,
        annotations=marker(key) if case.shared_container else None,
    )
    reply = await plugin.create_container(pod, container)
    if reply is not None:  # what the runtime keeps after applying the adjustment
        container.linux.resources.cpu.cpus = reply.adjust.linux.resources.cpu.cpus
        container.linux.resources.cpu.quota.value = reply.adjust.linux.resources.cpu.quota.value
    requested = api.LinuxResources()
    requested.cpu.cpus = case.requested
    if case.requested_quota is not None:
        requested.cpu.quota.value = case.requested_quota
        requested.cpu.period.value = PERIOD
    updates = await plugin.update_container(pod, container, requested)
    if case.expect_cpus is None:
        assert list(updates) == []
        return
    [update] = updates
    assert update.container_id == "c1"
    cpu = update.linux.resources.cpu
    assert cpu.cpus == case.expect_cpus
    assert cpu.HasField("quota") == (case.expect_quota is not None)
    if case.expect_quota is not None:
        assert cpu.quota.value == case.expect_quota
    assert not cpu.HasField("period")
    assert not update.linux.resources.HasField("memory")


# -- the oracle table: pod quota across a pod's life ---------------------------------------------------

LIFECYCLES = [
    # (steps, pod quota after each step); pod starts at 400000 (two 2-CPU containers), S = 2-3.
    pytest.param(["create a1"], [600_000], id="D1-one-shared-container"),
    pytest.param(["create a1", "create b1"], [600_000, 800_000], id="D3-each-shared-container-adds"),
    pytest.param(
        ["create a1", "stop a1", "create a2", "remove a1"],
        [600_000, 400_000, 600_000, 600_000],
        id="D4-fixed-restart-does-not-leak",
    ),
    pytest.param(
        ["create a1", "create a2", "stop a1", "remove a1"],
        [600_000, 600_000, 600_000, 600_000],
        id="D4-fixed-restart-new-before-old-stops",
    ),
    pytest.param(["create a1", "create a1"], [600_000, 600_000], id="idempotent-same-create-twice"),
    pytest.param(
        ["create a1", "stop a1", "stop a1", "remove a1"],
        [600_000, 400_000, 400_000, 400_000],
        id="idempotent-stop-twice-then-remove",
    ),
    pytest.param(
        ["create a1", "create b1", "remove b1", "remove a1"],
        [600_000, 800_000, 600_000, 400_000],
        id="remove-lowers-back",
    ),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("steps", "quotas"), LIFECYCLES)
async def test_oracle_pod_quota_lifecycle(tmp_path: Path, steps: list[str], quotas: list[int]) -> None:
    tree = FakeCgroups(tmp_path / "cgroup")
    plugin, key = make_plugin(tmp_path / "state", tree.layout, frozenset({2, 3}))
    pod = make_pod(CGROUPFS)
    tree.add_pod(pod, 400_000)
    devices = {"a": "shared-cpus-0", "b": "shared-cpus-1"}
    containers: dict[str, api.Container] = {}
    for step, expected in zip(steps, quotas, strict=True):
        action, cid = step.split()
        if action == "create":
            name = cid[0]
            containers[cid] = make_container(
                CGROUPFS,
                pod,
                cid,
                name,
                cpus="4-5" if name == "a" else "6-7",
                annotations=marker(key, devices[name]),
            )
            await plugin.create_container(pod, containers[cid])
        elif action == "stop":
            await plugin.stop_container(pod, containers[cid])
        else:
            await plugin.remove_container(pod, containers[cid])
        assert tree.pod_quota(pod) == expected, step


# -- proof of request ------------------------------------------------------------------------------------


def _request(
    annotations: dict[str, str] | None = None,
    pod_annotations: dict[str, str] | None = None,
    env: tuple[str, ...] = (),
    name: str = "main",
) -> tuple[api.PodSandbox, api.Container]:
    pod = make_pod(CGROUPFS)
    pod.annotations.update(pod_annotations or {})
    return pod, make_container(CGROUPFS, pod, "c1", name, env=env, annotations=annotations)


def test_signed_marker_proves_a_request() -> None:
    pod, container = _request(marker(KEY, "shared-cpus-7"))
    check = check_request(pod, container, marker_key=KEY, trust_pod_annotation=False, device_holders={})
    assert check.proof is not None
    assert (check.proof.source, check.proof.device) == ("device-plugin", "shared-cpus-7")
    assert check.refusals == ()


@pytest.mark.parametrize(
    "value",
    [
        "v1:shared-cpus-0:" + "A" * 43,  # right shape, wrong MAC
        HostKey(b"x" * 32).sign("shared-cpus-0"),  # another node's key
        KEY.sign("shared-cpus-0").replace("shared-cpus-0", "shared-cpus-1"),  # MAC of another device
        "enable",
        "",
    ],
    ids=["wrong-mac", "other-node-key", "device-swapped", "plain-word", "empty"],
)
def test_forged_marker_is_refused(value: str) -> None:
    pod, container = _request({ANNOTATION_KEY: value})
    check = check_request(pod, container, marker_key=KEY, trust_pod_annotation=False, device_holders={})
    assert check.proof is None
    assert "not signed with this node's key" in check.refusals[0]


def test_replayed_marker_is_refused_but_a_restart_of_the_holder_is_not() -> None:
    pod, container = _request(marker(KEY, "shared-cpus-3"))
    other = Slot("other-pod", "main")
    check = check_request(
        pod, container, marker_key=KEY, trust_pod_annotation=False, device_holders={"shared-cpus-3": other}
    )
    assert check.proof is None
    assert "already held by container other-pod/main (a replayed marker)" in check.refusals[0]
    # The same slot (same pod, same container name: a restart) may present its device again.
    same = container_slot(pod, container)
    check = check_request(
        pod, container, marker_key=KEY, trust_pod_annotation=False, device_holders={"shared-cpus-3": same}
    )
    assert check.proof is not None


def test_marker_ignored_when_its_source_is_not_trusted() -> None:
    pod, container = _request(marker(KEY))
    check = check_request(pod, container, marker_key=None, trust_pod_annotation=False, device_holders={})
    assert check.proof is None
    assert "device_plugin_marker is false" in check.notes[0]


@pytest.mark.parametrize(
    ("annotations", "trusted", "proven"),
    [
        ({"cpu-shared.crio.io/main": "enable"}, True, True),
        ({"cpu-shared.crio.io/main": "enable"}, False, False),
        ({"cpu-shared.crio.io/main": "true"}, True, False),  # E15: only "enable"
        ({"cpu-shared.crio.io/other": "enable"}, True, False),  # another container's
        ({"cpu-shared.crio.io": "enable"}, True, False),  # no pod-level form
    ],
    ids=["enable", "untrusted", "E15-value-true", "other-container", "E-pod-level-key"],
)
def test_pod_annotation_source(annotations: dict[str, str], trusted: bool, proven: bool) -> None:
    pod, container = _request(pod_annotations=annotations)
    check = check_request(pod, container, marker_key=KEY, trust_pod_annotation=trusted, device_holders={})
    assert (check.proof is not None) == proven


def test_env_is_never_proof_and_is_noted() -> None:
    pod, container = _request(env=("OPENSHIFT_SHARED_CPUS=0-63", "OPENSHIFT_ISOLATED_CPUS=4"))
    check = check_request(pod, container, marker_key=KEY, trust_pod_annotation=True, device_holders={})
    assert check.proof is None
    assert any("env set in a pod spec proves nothing" in note for note in check.notes)


def test_legacy_mutual_cpus_env_is_not_proof_and_is_noted() -> None:
    # The first OpenShift mixed-CPU plugins' variable: ignoring it silently left no trace of why.
    pod, container = _request(env=("OPENSHIFT_MUTUAL_CPUS=0-1",))
    check = check_request(pod, container, marker_key=KEY, trust_pod_annotation=True, device_holders={})
    assert check.proof is None
    assert check.notes == (
        "OPENSHIFT_MUTUAL_CPUS in the container's env is not a request: env set in a pod spec proves nothing",
    )


def test_env_notes_need_the_exact_name() -> None:
    # The prefix in a value, a longer name or a name without "=" is not one of the variables.
    env = ("NOTE=OPENSHIFT_SHARED_CPUS=1", "OPENSHIFT_SHARED_CPUS_X=1", "XOPENSHIFT_ISOLATED_CPUS=2")
    pod, container = _request(env=env)
    check = check_request(pod, container, marker_key=KEY, trust_pod_annotation=True, device_holders={})
    assert check.notes == ()
    pod, container = _request(env=("OPENSHIFT_ISOLATED_CPUS",))
    check = check_request(pod, container, marker_key=KEY, trust_pod_annotation=True, device_holders={})
    assert check.notes == (
        "OPENSHIFT_ISOLATED_CPUS in the container's env is not a request: "
        "env set in a pod spec proves nothing",
    )


_EVIDENCE_KEYS = st.sampled_from(
    [ANNOTATION_KEY, "cpu-shared.crio.io/main", "cpu-shared.crio.io/other", "cpu-shared.crio.io", "app"]
)
_EVIDENCE_VALUES = st.sampled_from(["enable", "true", "forged", ""])
_ENV_ENTRIES = st.sampled_from(
    [
        "OPENSHIFT_SHARED_CPUS=0-1",
        "OPENSHIFT_ISOLATED_CPUS",
        "OPENSHIFT_MUTUAL_CPUS=2",
        "NOTE=OPENSHIFT_SHARED_CPUS=1",
        "PATH=/bin",
        "OPENSHIFT_X=1",
        f"{MARKER_ENV}=forged",
        f"NOTE={MARKER_ENV}=x",
        f"{MARKER_ENV}_X=1",
    ]
)


@given(
    annotations=st.dictionaries(_EVIDENCE_KEYS, _EVIDENCE_VALUES, max_size=3),
    pod_annotations=st.dictionaries(_EVIDENCE_KEYS, _EVIDENCE_VALUES, max_size=3),
    env=st.lists(_ENV_ENTRIES, max_size=3).map(tuple),
    marker_trusted=st.booleans(),
    annotation_trusted=st.booleans(),
    kubelet=st.sampled_from([None, frozenset(), frozenset({"shared-cpus-1"})]),
)
def test_no_evidence_means_the_check_finds_nothing(
    annotations: dict[str, str],
    pod_annotations: dict[str, str],
    env: tuple[str, ...],
    marker_trusted: bool,
    annotation_trusted: bool,
    kubelet: frozenset[str] | None,
) -> None:
    """Synchronize checks only the containers `shows_evidence` picks: for every other one,
    `check_request` must prove, refuse and note nothing, whatever is trusted."""
    pod, container = _request(annotations, pod_annotations, env)
    check = check_request(
        pod,
        container,
        marker_key=KEY if marker_trusted else None,
        trust_pod_annotation=annotation_trusted,
        device_holders={},
        kubelet_devices=kubelet,
    )
    if not shows_evidence(pod, container):
        assert (check.proof, check.notes, check.refusals) == (None, (), ())


def test_shows_evidence_sees_each_kind() -> None:
    assert not shows_evidence(*_request())
    assert shows_evidence(*_request({ANNOTATION_KEY: "forged"}))
    assert shows_evidence(*_request(pod_annotations={"cpu-shared.crio.io/main": "no"}))
    assert not shows_evidence(*_request(pod_annotations={"cpu-shared.crio.io/other": "enable"}))
    assert shows_evidence(*_request(env=("OPENSHIFT_SHARED_CPUS=0-1",)))
    assert shows_evidence(*_request(env=(f"{MARKER_ENV}=forged",)))
    assert not shows_evidence(*_request(env=(f"{MARKER_ENV}_OTHER", "PATH=/bin")))


def test_forged_marker_does_not_hide_a_trusted_annotation() -> None:
    pod, container = _request({ANNOTATION_KEY: "forged"}, {"cpu-shared.crio.io/main": "enable"})
    check = check_request(pod, container, marker_key=KEY, trust_pod_annotation=True, device_holders={})
    assert check.proof is not None
    assert check.proof.source == "pod-annotation"
    assert check.refusals


# -- the marker through DRA: the env entry the DRA driver's CDI spec sets ---------------------------------

DRA_ID = dra_device_id("shared-cpus-4")
IN_ENV = f"the {MARKER_ENV} env entry (set by the DRA driver's CDI spec)"


def _dra_request(value: str, *more_env: str) -> tuple[api.PodSandbox, api.Container]:
    return _request(env=("PATH=/bin", f"{MARKER_ENV}={value}", *more_env))


def test_signed_env_marker_proves_a_request_as_a_dra_marker() -> None:
    pod, container = _dra_request(KEY.sign(DRA_ID))
    assert presents_marker(container)
    check = check_request(pod, container, marker_key=KEY, trust_pod_annotation=False, device_holders={})
    assert check.proof is not None
    assert (check.proof.source, check.proof.device) == ("device-plugin", "dra.shared-cpus-4")
    assert str(check.proof) == "DRA marker (dra.shared-cpus-4)"
    assert (check.notes, check.refusals) == ((), ())


def test_the_env_marker_is_not_mistaken_for_a_cpu_variable() -> None:
    """The OPENSHIFT_ env notes name only the CPU variables: the marker entry gets none, valid or not."""
    for value in (KEY.sign(DRA_ID), "forged"):
        pod, container = _dra_request(value)
        check = check_request(pod, container, marker_key=KEY, trust_pod_annotation=True, device_holders={})
        assert not any("is not a request" in note for note in check.notes)


@pytest.mark.parametrize(
    "value",
    [
        "v1:dra.shared-cpus-4:" + "A" * 43,  # right shape, wrong MAC
        HostKey(b"x" * 32).sign(DRA_ID),  # another node's key
        KEY.sign(DRA_ID).replace("shared-cpus-4", "shared-cpus-5"),  # MAC of another device
        "",
    ],
    ids=["wrong-mac", "other-node-key", "device-swapped", "empty"],
)
def test_forged_env_marker_is_refused_naming_the_env_entry(value: str) -> None:
    pod, container = _dra_request(value)
    check = check_request(pod, container, marker_key=KEY, trust_pod_annotation=False, device_holders={})
    assert check.proof is None
    assert check.refusals == (
        f"refused {IN_ENV}: it was not signed with this node's key (forged, or copied from another node)",
    )


def test_replayed_env_marker_is_refused_but_a_restart_of_the_holder_is_not() -> None:
    pod, container = _dra_request(KEY.sign(DRA_ID))
    other = Slot("other-pod", "main")
    check = check_request(
        pod, container, marker_key=KEY, trust_pod_annotation=False, device_holders={DRA_ID: other}
    )
    assert check.proof is None
    assert check.refusals == (
        f"refused {IN_ENV}: device dra.shared-cpus-4 is already held by container other-pod/main "
        "(a replayed marker)",
    )
    same = container_slot(pod, container)
    check = check_request(
        pod, container, marker_key=KEY, trust_pod_annotation=False, device_holders={DRA_ID: same}
    )
    assert check.proof is not None


def test_the_last_env_marker_entry_is_the_one_checked() -> None:
    """As for the CPU variables, the last entry of a name is the one the process sees."""
    pod, container = _dra_request("forged", f"{MARKER_ENV}={KEY.sign(DRA_ID)}")
    check = check_request(pod, container, marker_key=KEY, trust_pod_annotation=False, device_holders={})
    assert check.proof is not None
    pod, container = _dra_request(KEY.sign(DRA_ID), f"{MARKER_ENV}=forged")
    check = check_request(pod, container, marker_key=KEY, trust_pod_annotation=False, device_holders={})
    assert check.proof is None


def test_kubelets_record_decides_an_env_marker_first() -> None:
    pod, container = _dra_request(KEY.sign(DRA_ID))
    check = check_request(
        pod,
        container,
        marker_key=KEY,
        trust_pod_annotation=False,
        device_holders={DRA_ID: Slot("other-pod", "main")},  # not looked at: kubelet answered
        kubelet_devices=frozenset({DRA_ID}),
    )
    assert check.proof is not None
    assert (check.proof.source, check.proof.device) == ("kubelet", DRA_ID)
    check = check_request(
        pod,
        container,
        marker_key=KEY,
        trust_pod_annotation=False,
        device_holders={},
        kubelet_devices=frozenset(),
    )
    assert check.proof is None
    assert check.refusals == (
        f"refused {IN_ENV}: kubelet's record shows no shared-CPUs device allocated to container "
        f"{pod.namespace}/{pod.name}/main (a replayed, harvested or planted marker)",
    )


def test_env_marker_ignored_when_markers_are_not_trusted() -> None:
    pod, container = _dra_request(KEY.sign(DRA_ID))
    check = check_request(pod, container, marker_key=None, trust_pod_annotation=False, device_holders={})
    assert check.proof is None
    assert check.notes == ("DRA marker ignored: trusted_sources.device_plugin_marker is false",)


def test_the_annotation_is_preferred_to_the_env_marker_and_a_difference_noted() -> None:
    env = (f"{MARKER_ENV}={KEY.sign(DRA_ID)}",)
    pod, container = _request(marker(KEY, "shared-cpus-7"), env=env)
    check = check_request(pod, container, marker_key=KEY, trust_pod_annotation=False, device_holders={})
    assert check.proof is not None
    assert check.proof.device == "shared-cpus-7"
    assert check.notes == (
        f"{IN_ENV} ignored: the container also has the {ANNOTATION_KEY} annotation, which is checked instead",
    )
    # The annotation decides even when it fails: it is refused, naming the annotation.
    pod, container = _request({ANNOTATION_KEY: "forged"}, env=env)
    check = check_request(pod, container, marker_key=KEY, trust_pod_annotation=False, device_holders={})
    assert check.proof is None
    assert check.refusals[0].startswith(f"refused the {ANNOTATION_KEY} annotation: it was not signed")
    # The same value in both: nothing to note.
    same = KEY.sign("shared-cpus-7")
    pod, container = _request({ANNOTATION_KEY: same}, env=(f"{MARKER_ENV}={same}",))
    check = check_request(pod, container, marker_key=KEY, trust_pod_annotation=False, device_holders={})
    assert (check.proof is not None, check.notes) == (True, ())


def test_presents_marker() -> None:
    assert presents_marker(_request(marker(KEY))[1])
    assert presents_marker(_request(env=(f"{MARKER_ENV}=",))[1])
    assert presents_marker(_request(env=(f"{MARKER_ENV}_SHARED_CPUS_3=x",))[1])  # one entry per device
    look_alikes = (f"{MARKER_ENV}X=1", f"X{MARKER_ENV}=1", MARKER_ENV, f"{MARKER_ENV}_X")
    assert not presents_marker(_request(env=look_alikes)[1])
    assert not shows_evidence(*_request(env=look_alikes))


def test_a_container_given_two_dra_devices_is_proven_by_one_and_told_of_the_other() -> None:
    """CDI keeps one env entry per device (they are named after it): a container given two of our
    devices carries both markers; the first by name is checked, and the note names the other."""
    first, second = dra_device_id("shared-cpus-3"), dra_device_id("shared-cpus-4")
    pod, container = _request(
        env=(
            f"{MARKER_ENV}_SHARED_CPUS_4={KEY.sign(second)}",
            f"{MARKER_ENV}_SHARED_CPUS_3={KEY.sign(first)}",
        )
    )
    check = check_request(pod, container, marker_key=KEY, trust_pod_annotation=False, device_holders={})
    assert check.proof is not None
    assert (check.proof.source, check.proof.device) == ("device-plugin", first)
    assert check.refusals == ()
    assert check.notes == (
        f"2 DRA marker env entries; {MARKER_ENV}_SHARED_CPUS_3 is checked, not {MARKER_ENV}_SHARED_CPUS_4: "
        "a container needs one shared-CPUs device, give it one claim of one device",
    )


# -- pure planning functions ---------------------------------------------------------------------------------


def test_malformed_cpuset_from_the_runtime_is_a_clear_error() -> None:
    pod = make_pod(CGROUPFS)
    container = make_container(CGROUPFS, pod, "c1", cpus="4-x")
    with pytest.raises(PolicyError, match=r'runtime sent a malformed cpuset: invalid cpu list "4-x"') as info:
        exclusive_cpus(frozenset({0}), pod, container)
    assert info.value.kind == "node"


def test_create_sets_only_what_changes() -> None:
    pod = make_pod(CGROUPFS)
    # Already holding the union and the right quota: only the env is set.
    container = make_container(CGROUPFS, pod, "c1", cpus="0-1,4-5", quota=400_000)
    plan = plan_create(frozenset({0, 1}), pod, container)
    assert plan.exclusive == {4, 5}
    assert plan.adjustment.linux.resources.cpu.cpus == ""
    assert not plan.adjustment.linux.resources.cpu.HasField("quota")
    assert adjusted_env(plan.adjustment) == {SHARED_ENV: "0-1", ISOLATED_ENV: "4-5"}


def test_create_keeps_the_containers_own_period() -> None:
    pod = make_pod(CGROUPFS)
    container = make_container(CGROUPFS, pod, "c1", cpus="4-5", quota=100_000, period=50_000)
    plan = plan_create(frozenset({0, 1}), pod, container)
    assert plan.adjustment.linux.resources.cpu.quota.value == 4 * 50_000  # D5-fixed: period not reset
    assert not plan.adjustment.linux.resources.cpu.HasField("period")


def test_update_quota_falls_back_to_the_containers_current_quota() -> None:
    pod = make_pod(CGROUPFS)
    limited = make_container(CGROUPFS, pod, "c1", cpus="0-1,4-5", quota=400_000)
    unlimited = make_container(CGROUPFS, pod, "c2", cpus="0-1,4-5", quota=-1)
    requested = api.LinuxResources()
    requested.cpu.cpus = "4-5"
    requested.cpu.quota.value = 0  # how containerd relays kubelet's "no quota in this update"
    assert (
        plan_update(
            frozenset({0, 1}), pod, limited, requested, frozenset({4, 5})
        ).update.linux.resources.cpu.quota.value
        == 400_000
    )
    update = plan_update(frozenset({0, 1}), pod, unlimited, requested, frozenset({4, 5})).update
    assert not update.linux.resources.cpu.HasField("quota")
    bad = api.LinuxResources()
    bad.cpu.cpus = "4,,5"
    with pytest.raises(PolicyError, match="malformed requested cpuset"):
        plan_update(frozenset({0, 1}), pod, limited, bad, frozenset({4, 5}))


@pytest.mark.parametrize("quota", [MAX_CFS_QUOTA, MAX_CFS_QUOTA - 100_000, (1 << 63) - 1])
def test_an_update_quota_raised_past_the_kernels_largest_is_refused(quota: int) -> None:
    # The raise adds the shared CPUs' share: past 2^44 - 1 us the kernel refuses it, past int64
    # protobuf cannot even hold it (hypothesis found ValueError: Value out of range).
    pod = make_pod(CGROUPFS)
    container = make_container(CGROUPFS, pod, "c1", cpus="0-1,4-5", quota=400_000)
    requested = api.LinuxResources()
    requested.cpu.cpus = "4-5"
    requested.cpu.quota.value = quota
    with pytest.raises(PolicyError, match="above the kernel's largest quota"):
        plan_update(frozenset({0, 1}), pod, container, requested, frozenset({4, 5}))
    requested.cpu.quota.value = MAX_CFS_QUOTA - 200_000  # plus 2 x 100 ms: exactly the largest
    update = plan_update(frozenset({0, 1}), pod, container, requested, frozenset({4, 5})).update
    assert update.linux.resources.cpu.quota.value == MAX_CFS_QUOTA


def test_pod_quota_target() -> None:
    assert pod_quota_target(300_000, 100_000, [2, 2]) == 700_000
    assert pod_quota_target(None, 100_000, [2]) is None
    assert pod_quota_target(300_000, 50_000, []) == 300_000


def test_baseline_from_pod_resources() -> None:
    pod = make_pod(CGROUPFS)
    assert baseline_from_pod_resources(pod, PERIOD) is None
    pod.linux.pod_resources.cpu.quota.value = 300_000
    pod.linux.pod_resources.cpu.period.value = 100_000
    assert baseline_from_pod_resources(pod, PERIOD) == 300_000
    assert baseline_from_pod_resources(pod, 50_000) == 150_000  # in the pod cgroup's period
    pod.linux.pod_overhead.cpu.quota.value = 25_000
    assert baseline_from_pod_resources(pod, PERIOD) == 325_000
    pod.linux.pod_resources.cpu.quota.value = -1
    assert baseline_from_pod_resources(pod, PERIOD) is None


@pytest.mark.parametrize(
    ("cpus", "env", "recorded", "exclusive", "update_cpus", "stale"),
    [
        ("4-5", (), "", "4-5", "0-1,4-5", True),  # plugin started late: nothing applied yet
        ("0-1,4-5", ("OPENSHIFT_SHARED_CPUS=0-1", "OPENSHIFT_ISOLATED_CPUS=4-5"), "", "4-5", None, False),
        ("0-1,4-5", ("OPENSHIFT_SHARED_CPUS=0-1", "OPENSHIFT_ISOLATED_CPUS=4-5"), "4-5", "4-5", None, False),
        # shared_cpuset changed from 0-1 to 0-2: found from the env we injected
        ("0-1,4-5", ("OPENSHIFT_SHARED_CPUS=0-1", "OPENSHIFT_ISOLATED_CPUS=4-5"), "", "4-5", "0-2,4-5", True),
        # ... or from the books when the env is gone
        ("0-1,4-5", (), "4-5", "4-5", "0-2,4-5", True),
    ],
    ids=[
        "started-late",
        "already-done",
        "already-done-recorded",
        "shared-changed-env",
        "shared-changed-books",
    ],
)
def test_plan_sync(
    cpus: str, env: tuple[str, ...], recorded: str, exclusive: str, update_cpus: str | None, stale: bool
) -> None:
    shared = frozenset({0, 1, 2}) if update_cpus and "0-2" in update_cpus else frozenset({0, 1})
    pod = make_pod(CGROUPFS)
    container = make_container(
        CGROUPFS,
        pod,
        "c1",
        cpus=cpus,
        quota=200_000 if update_cpus else len(parse_cpuset(cpus)) * PERIOD,
        env=env,
    )
    plan = plan_sync(shared, pod, container, parse_cpuset(recorded))
    assert format_cpuset(plan.exclusive) == exclusive
    assert plan.env_stale == stale
    if update_cpus is None:
        assert plan.update is None
    else:
        assert plan.update is not None
        assert plan.update.linux.resources.cpu.cpus == update_cpus
        assert plan.update.linux.resources.cpu.quota.value == len(parse_cpuset(update_cpus)) * PERIOD


@pytest.mark.parametrize(
    ("env", "stale"),
    [
        (("OPENSHIFT_SHARED_CPUS=0-1", "OPENSHIFT_ISOLATED_CPUS=4-5"), False),
        # the last entry of a name wins, as in the process's environment
        (("OPENSHIFT_SHARED_CPUS=0-1", "OPENSHIFT_ISOLATED_CPUS=4-5", "OPENSHIFT_SHARED_CPUS=0-3"), True),
        (("OPENSHIFT_SHARED_CPUS=0-3", "OPENSHIFT_ISOLATED_CPUS=4-5", "OPENSHIFT_SHARED_CPUS=0-1"), False),
        # an entry without "=" sets nothing
        (("OPENSHIFT_SHARED_CPUS=0-1", "OPENSHIFT_ISOLATED_CPUS=4-5", "OPENSHIFT_SHARED_CPUS"), False),
        (("OPENSHIFT_SHARED_CPUS=0-1",), True),
    ],
)
def test_plan_sync_reads_the_env_as_the_process_would(env: tuple[str, ...], stale: bool) -> None:
    pod = make_pod(CGROUPFS)
    container = make_container(CGROUPFS, pod, "c1", cpus="0-1,4-5", quota=4 * PERIOD, env=env)
    plan = plan_sync(frozenset({0, 1}), pod, container)
    assert format_cpuset(plan.exclusive) == "4-5"
    assert plan.env_stale == stale


cpu_ids = st.frozensets(st.integers(0, 63), max_size=12)


@given(shared=cpu_ids.filter(bool), exclusive=cpu_ids.filter(bool), period=st.integers(1_000, 1_000_000))
def test_create_plan_properties(shared: frozenset[int], exclusive: frozenset[int], period: int) -> None:
    pod = make_pod(CGROUPFS)
    container = make_container(
        CGROUPFS, pod, "c1", cpus=format_cpuset(exclusive), quota=len(exclusive) * period, period=period
    )
    if not exclusive - shared:
        with pytest.raises(PolicyError):
            plan_create(shared, pod, container)
        return
    plan = plan_create(shared, pod, container)
    assert plan.exclusive == exclusive - shared
    assert plan.cpus == exclusive | shared
    assert plan.quota == len(exclusive | shared) * period
    env = adjusted_env(plan.adjustment)
    assert env == {SHARED_ENV: format_cpuset(shared), ISOLATED_ENV: format_cpuset(exclusive - shared)}
    assert parse_cpuset(env[ISOLATED_ENV]) | parse_cpuset(env[SHARED_ENV]) == plan.cpus
    text = plan.adjustment.linux.resources.cpu.cpus
    assert text in ("", format_cpuset(plan.cpus))


def test_cpu_env_takes_the_last_value_of_each_variable() -> None:
    """As a process's environment: the last entry of a name wins; an entry without ``=`` sets
    nothing; the other names are not taken for ours (looked for from the end, stopping once both
    are found)."""
    container = api.Container(
        env=[
            "OPENSHIFT_SHARED_CPUS=0",
            "OPENSHIFT_ISOLATED_CPUS=4",
            "OPENSHIFT_SHARED_CPUS=0-1",
            "OPENSHIFT_ISOLATED_CPUS",
            "OPENSHIFT_MUTUAL_CPUS=9",
            "XOPENSHIFT_SHARED_CPUS=7",
        ]
    )
    assert _cpu_env(container) == ("0-1", "4")
    container.env.append("OPENSHIFT_ISOLATED_CPUS=5-6")
    assert _cpu_env(container) == ("0-1", "5-6")
    assert _cpu_env(api.Container(env=["PATH=/bin", "OPENSHIFT_SHARED_CPUS=2"])) == ("2", None)
    assert _cpu_env(api.Container(env=["PATH=/bin"])) == (None, None)


# -- kubelet's newest allocation wins (issue 29) --------------------------------------------------------


def _allocation(
    value: str, spent: dict[str, Spent], holders: dict[str, Slot] | None = None, *, uid: str = "0000-1111"
) -> RequestCheck:
    """The marker-only check of a container (slot `<uid>/main`) presenting `value`."""
    pod, container = _request({ANNOTATION_KEY: value})
    pod.uid = uid
    return check_request(
        pod, container, marker_key=KEY, trust_pod_annotation=False, device_holders=holders or {}, spent=spent
    )


def test_a_newer_allocation_takes_the_device_from_its_holder_running_or_gone() -> None:
    other = Slot("other-pod", "main")
    newer = KEY.sign("shared-cpus-3", allocation=8)
    for holders in ({"shared-cpus-3": other}, {}):
        check = _allocation(newer, {"shared-cpus-3": Spent(7, *other)}, holders)
        assert check.proof == Proof("device-plugin", "shared-cpus-3", 8)
        assert check.refusals == ()


def test_the_same_or_an_older_allocation_in_another_slot_is_a_copy() -> None:
    other = Slot("other-pod", "main")
    spent = {"shared-cpus-3": Spent(7, *other)}
    for allocation in (7, 6):
        value = KEY.sign("shared-cpus-3", allocation=allocation)
        held = _allocation(value, spent, {"shared-cpus-3": other})
        assert held.proof is None
        assert held.refusals == (
            f"refused the {ANNOTATION_KEY} annotation: device shared-cpus-3 is already held by container "
            "other-pod/main (a replayed marker)",
        )
        gone = _allocation(value, spent)  # its holder's pod ended: the binding is over, the allocation spent
        assert gone.proof is None
        assert "a marker is good for one allocation, also once its holder is gone" in gone.refusals[0]
        assert gone.waits_for is None


def test_its_own_slot_presents_its_allocation_again_whatever_its_number() -> None:
    mine = Slot("0000-1111", "main")
    for allocation in (5, 7, 9):
        check = _allocation(
            KEY.sign("shared-cpus-3", allocation=allocation), {"shared-cpus-3": Spent(7, *mine)}
        )
        assert check.proof is not None


def test_a_marker_of_an_earlier_version_is_allocation_0() -> None:
    context = b"mixed-cpu-nri-plugin shared-cpus-allocation v1\0"  # v1:<device>:<mac>, as documented
    digest = hmac.new(b"k" * 32, context + b"shared-cpus-3", hashlib.sha256).digest()
    legacy = f"v1:shared-cpus-3:{base64.urlsafe_b64encode(digest).rstrip(b'=').decode()}"
    other = Slot("other-pod", "main")
    assert _allocation(legacy, {}).proof == Proof("device-plugin", "shared-cpus-3", 0)
    # Bound to another slot (at allocation 0, as every binding saved before numbers existed): a copy.
    assert _allocation(legacy, {"shared-cpus-3": Spent(0, *other)}, {"shared-cpus-3": other}).proof is None
    # ... and any numbered allocation is newer than such a binding.
    check = _allocation(KEY.sign("shared-cpus-3", allocation=1), {}, {"shared-cpus-3": other})
    assert check.proof is not None


def test_a_dra_marker_proves_nothing_outside_the_pods_its_claim_was_reserved_for() -> None:
    value = KEY.sign(DRA_ID, pods=["aaaa-1111"], allocation=3)
    outside = _allocation(value, {}, uid="bbbb-2222")
    assert outside.proof is None
    assert "reserved for other pods (aaaa-1111), not pod bbbb-2222 (a copied marker)" in outside.refusals[0]
    assert _allocation(value, {}, uid="aaaa-1111").proof is not None


def test_a_claim_reserved_for_two_pods_waits_for_the_holders_binding_to_end() -> None:
    value = KEY.sign(DRA_ID, pods=["aaaa-1111", "bbbb-2222"], allocation=3)
    holder = Slot("aaaa-1111", "main")
    spent = {DRA_ID: Spent(3, *holder)}
    waiting = _allocation(value, spent, {DRA_ID: holder}, uid="bbbb-2222")
    assert waiting.proof is None
    assert waiting.waits_for == DRA_ID
    assert "for now" in waiting.refusals[0]
    assert _allocation(value, spent, {}, uid="bbbb-2222").proof is not None  # its binding ended
    assert _allocation(value, spent, {}, uid="cccc-3333").proof is None  # not reserved for that one
