"""nri_plugin.cgroups.paths: pod and container cgroup paths for every runtime x driver x cgroup version, and
every input we refuse."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nri_plugin.cgroups import (
    CgroupDir,
    CgroupNotFound,
    CgroupPath,
    CgroupPathError,
    Hierarchy,
    check_name,
    container_cgroup_path,
    expand_slice,
    open_cgroup,
    parse_cgroupfs_path,
    pod_cgroup_path,
    read_cpu_quota,
    read_value,
    write_cpu_quota,
    write_value,
)
from nri_plugin.cgroups import paths as cgroup_paths

UID = "6b9c1a52-3d1e-4f5a-9b7c-0123456789ab"
UID_ = UID.replace("-", "_")  # kubelet's systemd driver turns the UID's dashes into underscores
CID = "4f2c0e8a9b1d" * 5 + "abcd"  # 64 hex digits, as containerd and CRI-O make them

V1_CPU = Hierarchy(1, "/sys/fs/cgroup/cpu,cpuacct")
V1_CPUSET = Hierarchy(1, "/sys/fs/cgroup/cpuset")
V2 = Hierarchy(2, "/sys/fs/cgroup")


@pytest.mark.parametrize(
    ("name", "expanded"),
    [
        ("kubepods.slice", "/kubepods.slice"),
        ("kubepods-burstable.slice", "/kubepods.slice/kubepods-burstable.slice"),
        (
            f"kubepods-burstable-pod{UID_}.slice",
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice",
        ),
        (f"kubepods-pod{UID_}.slice", f"/kubepods.slice/kubepods-pod{UID_}.slice"),
        ("foo-bar-test.slice", "/foo.slice/foo-bar.slice/foo-bar-test.slice"),
        ("system.slice", "/system.slice"),
        ("a.b-c:d.slice", "/a.b.slice/a.b-c:d.slice"),
        ("-.slice", "/"),
    ],
)
def test_expand_slice(name: str, expanded: str) -> None:
    assert str(expand_slice(name)) == expanded


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "is not a slice name"),
        (".slice", "is not a slice name"),
        ("kubepods", "is not a slice name"),
        ("kubepods.scope", "is not a slice name"),
        ("a--b.slice", "contains '--'"),
        ("-a.slice", "starts or ends with '-'"),
        ("a-.slice", "starts or ends with '-'"),
        ("--.slice", "starts or ends with '-'"),
        ("a/b.slice", "contains character '/'"),
        ("a b.slice", "contains character ' '"),
        ("a@b.slice", "contains character '@'"),
        ("a\\x2db.slice", "contains character '\\\\'"),
        ("a\x00.slice", "contains a NUL byte"),
        ("a\n.slice", "contains control character U+000A"),
        ("kube\uff0epods.slice", "contains non-ASCII character U+FF0E"),
        ("x" * 250 + ".slice", "longer than 255 characters"),
    ],
)
def test_expand_slice_rejects_what_systemd_rejects(name: str, reason: str) -> None:
    with pytest.raises(CgroupPathError) as info:
        expand_slice(name)
    assert reason in str(info.value)
    assert str(info.value).startswith("invalid slice name ")
    assert info.value.input == name


# (runtime / driver, pod cgroup parent, container cgroups path, pod path, container path)
LAYOUTS = [
    (
        "crio-systemd-guaranteed",
        f"kubepods-pod{UID_}.slice",
        f"kubepods-pod{UID_}.slice:crio:{CID}",
        f"/kubepods.slice/kubepods-pod{UID_}.slice",
        f"/kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope",
    ),
    (
        "crio-systemd-burstable",
        f"kubepods-burstable-pod{UID_}.slice",
        f"kubepods-burstable-pod{UID_}.slice:crio:{CID}",
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice",
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-{CID}.scope",
    ),
    (
        "crio-systemd-besteffort",
        f"kubepods-besteffort-pod{UID_}.slice",
        f"kubepods-besteffort-pod{UID_}.slice:crio:{CID}",
        f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice",
        f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/crio-{CID}.scope",
    ),
    (
        "containerd-systemd-guaranteed",
        f"/kubepods.slice/kubepods-pod{UID_}.slice",
        f"kubepods-pod{UID_}.slice:cri-containerd:{CID}",
        f"/kubepods.slice/kubepods-pod{UID_}.slice",
        f"/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope",
    ),
    (
        "containerd-systemd-burstable",
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice",
        f"kubepods-burstable-pod{UID_}.slice:cri-containerd:{CID}",
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice",
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope",
    ),
    (
        "crio-cgroupfs-guaranteed",
        f"/kubepods/pod{UID}",
        f"/kubepods/pod{UID}/crio-{CID}",
        f"/kubepods/pod{UID}",
        f"/kubepods/pod{UID}/crio-{CID}",
    ),
    (
        "crio-cgroupfs-burstable",
        f"/kubepods/burstable/pod{UID}",
        f"/kubepods/burstable/pod{UID}/crio-{CID}",
        f"/kubepods/burstable/pod{UID}",
        f"/kubepods/burstable/pod{UID}/crio-{CID}",
    ),
    (
        "containerd-cgroupfs-guaranteed",
        f"/kubepods/pod{UID}",
        f"/kubepods/pod{UID}/{CID}",
        f"/kubepods/pod{UID}",
        f"/kubepods/pod{UID}/{CID}",
    ),
    (
        "containerd-cgroupfs-besteffort",
        f"/kubepods/besteffort/pod{UID}",
        f"/kubepods/besteffort/pod{UID}/{CID}",
        f"/kubepods/besteffort/pod{UID}",
        f"/kubepods/besteffort/pod{UID}/{CID}",
    ),
]


@pytest.mark.parametrize(
    ("parent", "cgroups_path", "pod", "container"),
    [row[1:] for row in LAYOUTS],
    ids=[row[0] for row in LAYOUTS],
)
@pytest.mark.parametrize("hierarchy", [V1_CPU, V1_CPUSET, V2], ids=["v1-cpu", "v1-cpuset", "v2"])
def test_layouts(hierarchy: Hierarchy, parent: str, cgroups_path: str, pod: str, container: str) -> None:
    pod_dir = hierarchy.dir(pod_cgroup_path(parent))
    container_dir = hierarchy.dir(container_cgroup_path(cgroups_path))
    assert str(pod_dir.path) == pod
    assert str(container_dir.path) == container
    assert pod_dir.fs_path == hierarchy.mount_point + pod
    assert container_dir.fs_path == hierarchy.mount_point + container
    assert container_dir.path.is_below(pod_dir.path)


def test_go_plugin_oracle_rows() -> None:
    # T19 / T20 of the behaviour note (Go plugin cgroups_test.go), on v1 and v2.
    pod = pod_cgroup_path("foo-bar-test.slice")
    assert V1_CPU.dir(pod).fs_path == "/sys/fs/cgroup/cpu,cpuacct/foo.slice/foo-bar.slice/foo-bar-test.slice"
    assert V2.dir(pod).fs_path == "/sys/fs/cgroup/foo.slice/foo-bar.slice/foo-bar-test.slice"
    ctr = container_cgroup_path("bob-lucky-test.slice:crio:abcdefghijklmnopqrstvuwxyz")
    expected = "/bob.slice/bob-lucky.slice/bob-lucky-test.slice/crio-abcdefghijklmnopqrstvuwxyz.scope"
    assert V1_CPU.dir(ctr).fs_path == "/sys/fs/cgroup/cpu,cpuacct" + expected
    assert V2.dir(ctr).fs_path == "/sys/fs/cgroup" + expected


def test_other_accepted_forms() -> None:
    assert str(pod_cgroup_path("kubepods.slice/kubepods-pod1.slice")) == "/kubepods.slice/kubepods-pod1.slice"
    assert str(container_cgroup_path("/kubepods.slice/kubepods-pod1.slice:crio:x")) == (
        "/kubepods.slice/kubepods-pod1.slice:crio:x"
    )  # a leading '/' means cgroupfs, ':' and all
    assert str(container_cgroup_path("kubepods.slice/kubepods-pod1.slice:crio:x")) == (
        "/kubepods.slice/kubepods-pod1.slice/crio-x.scope"
    )
    assert str(container_cgroup_path("-.slice:crio:x")) == "/crio-x.scope"
    assert (
        str(container_cgroup_path("kubepods-pod1.slice:docker:x"))
        == "/kubepods.slice/kubepods-pod1.slice/docker-x.scope"
    )
    assert str(parse_cgroupfs_path("/")) == "/"
    assert parse_cgroupfs_path("/").is_root


ESCAPES_AND_GARBAGE_POD = [
    ("", "empty"),
    ("/", "names the root cgroup"),
    ("-.slice", "names the root cgroup"),
    ("kubepods/pod1", "must be absolute"),
    ("../../etc", "must be absolute"),
    ("/kubepods/../../x", 'component ".." is not allowed'),
    ("/kubepods/./pod1", 'component "." is not allowed'),
    ("/kubepods/.../pod1", 'component "..." is not allowed'),
    ("/kubepods//pod1", "empty path component"),
    ("/kubepods/pod1/", "empty path component"),
    ("/kubepods/pod1\n", "control character U+000A"),
    ("/kubepods/pod1\x00/x", "a NUL byte"),
    ("/kubepods/\uff0e\uff0e/x", "non-ASCII character U+FF0E"),
    ("/kubepods/pod 1", "character ' '"),
    ("/kubepods/pod\\1", "character '\\\\'"),
    ("/kubepods.slice/../x.slice", '".." is not a slice name'),
    ("/kubepods.slice//kubepods-pod1.slice", "empty path component"),
    ("/kubepods.slice/-.slice", "cannot be a level"),
    ("/kubepods/pod1.slice", '"kubepods" is not a slice name'),
    ("kubepods--pod1.slice", "contains '--'"),
    ("/" + "a/" * 3000 + "pod1", "longer than 4096 characters"),
    ("/kubepods/" + "p" * 256, "longer than 255 characters"),
]


@pytest.mark.parametrize(("parent", "reason"), ESCAPES_AND_GARBAGE_POD)
def test_pod_path_rejects(parent: str, reason: str) -> None:
    with pytest.raises(CgroupPathError) as info:
        pod_cgroup_path(parent)
    assert reason in str(info.value)
    assert str(info.value).startswith("invalid pod cgroup parent ")
    assert info.value.input == parent


ESCAPES_AND_GARBAGE_CONTAINER = [
    ("", "expected an absolute cgroupfs path"),
    ("/", "names the root cgroup"),
    ("crio-x", "expected an absolute cgroupfs path"),
    ("kubepods.slice:x", "expected an absolute cgroupfs path"),
    ("kubepods.slice:crio:x:y", "expected an absolute cgroupfs path"),
    (":crio:x", "empty slice"),
    ("kubepods.slice::x", "empty prefix"),
    ("kubepods.slice:crio:", "empty name"),
    ("kubepods.slice:crio:../../etc", "name \"../../etc\" contains character '/'"),
    ("kubepods.slice:crio:/etc/passwd", "contains character '/'"),
    ("kubepods.slice:../crio:x", "prefix \"../crio\" contains character '/'"),
    ("kubepods.slice:crio:x\n", "control character U+000A"),
    ("kubepods.slice:crio:x\x00", "a NUL byte"),
    ("kubepods.slice:crio:\uff0e\uff0e", "non-ASCII character U+FF0E"),
    ("kubepods.slice:crio:x@y", "character '@'"),
    ("kubepods.slice:crio:x.slice", "nested slice"),
    ("kubepods.slice:crio:" + "a" * 250, "longer than 255 characters"),
    ("../x.slice:crio:x", '".." is not a slice name'),
    ("kube--pods.slice:crio:x", "contains '--'"),
    ("kubepods:crio:x", "is not a slice name"),
    ("/kubepods/pod1/../../../etc", 'component ".." is not allowed'),
    ("/kubepods/pod1/\uff0e\uff0e", "non-ASCII character U+FF0E"),
    ("/kubepods/pod1/crio-x\r", "control character U+000D"),
    ("/kubepods/pod1/crio-x\t", "control character U+0009"),
]


@pytest.mark.parametrize(("cgroups_path", "reason"), ESCAPES_AND_GARBAGE_CONTAINER)
def test_container_path_rejects(cgroups_path: str, reason: str) -> None:
    with pytest.raises(CgroupPathError) as info:
        container_cgroup_path(cgroups_path)
    assert reason in str(info.value)
    assert str(info.value).startswith("invalid container cgroups path ")
    assert info.value.input == cgroups_path


@pytest.mark.parametrize("bad", ["..", ".", "", "a/b", "a\x00", "\uff0e\uff0e", "x" * 256])
def test_cgroup_path_components_are_checked_however_built(bad: str) -> None:
    with pytest.raises(CgroupPathError):
        CgroupPath(("kubepods", bad))
    with pytest.raises(CgroupPathError):
        CgroupPath(("kubepods",)).child(bad)
    with pytest.raises(CgroupPathError):
        V2.dir(CgroupPath(("kubepods",))).child(bad)


def test_cgroup_path_helpers() -> None:
    pod = CgroupPath(("kubepods", "pod1"))
    ctr = pod.child("ctr")
    assert str(ctr) == "/kubepods/pod1/ctr"
    assert ctr.is_below(pod)
    assert not pod.is_below(pod)
    assert not pod.is_below(ctr)
    assert not CgroupPath(("kubepods", "pod10")).is_below(CgroupPath(("kubepods", "pod1", "x")))
    assert pod.is_below(CgroupPath())
    assert str(V2.dir(ctr)) == "/sys/fs/cgroup/kubepods/pod1/ctr"
    assert V1_CPU.dir(ctr).version == 1


@pytest.mark.parametrize("mount", ["relative", "/a/../b", "/a/", "/a//b"])
def test_hierarchy_mount_point_must_be_absolute_and_normalized(mount: str) -> None:
    with pytest.raises(ValueError, match="mount point"):
        Hierarchy(1, mount)


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def test_escape_attempts_touch_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mount = tmp_path / "cpu"
    pod = mount / "kubepods" / "pod1"
    pod.mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    for directory in (mount, pod, tmp_path, tmp_path / "etc"):
        (directory / "cpu.cfs_quota_us").write_text("-1\n")
        (directory / "cpu.cfs_period_us").write_text("100000\n")
    before = _snapshot(tmp_path)
    opened: list[object] = []
    real_open = os.open

    def spy(path: object, *args: object, **kwargs: object) -> int:
        opened.append(path)
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", spy)
    hierarchy = Hierarchy(1, str(mount))
    for text, _ in ESCAPES_AND_GARBAGE_CONTAINER:
        with pytest.raises(CgroupPathError):
            write_cpu_quota(hierarchy.dir(container_cgroup_path(text)), 200_000)
    for text, _ in ESCAPES_AND_GARBAGE_POD:
        with pytest.raises(CgroupPathError):
            write_cpu_quota(hierarchy.dir(pod_cgroup_path(text)), 200_000)
    assert opened == []
    assert _snapshot(tmp_path) == before


def test_symlinks_below_the_mount_are_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "cpu.cfs_quota_us").write_text("-1\n")
    mount = tmp_path / "cpu"
    (mount / "kubepods").mkdir(parents=True)
    (mount / "kubepods" / "pod1").symlink_to(outside)  # directory symlink leaving the mount
    (mount / "kubepods" / "pod2").mkdir()
    (mount / "kubepods" / "pod2" / "cpu.cfs_quota_us").symlink_to(
        outside / "cpu.cfs_quota_us"
    )  # file symlink
    (mount / "kubepods" / "pod3").symlink_to(mount / "kubepods" / "pod2")  # even one staying inside
    hierarchy = Hierarchy(1, str(mount))
    for pod in ("pod1", "pod2", "pod3"):
        cgroup = hierarchy.dir(parse_cgroupfs_path(f"/kubepods/{pod}"))
        with pytest.raises(CgroupPathError, match="symlink") as info:
            write_value(cgroup, "cpu.cfs_quota_us", "200000")
        assert info.value.input.startswith(str(mount / "kubepods"))
        with pytest.raises(CgroupPathError, match="symlink"):
            read_value(cgroup, "cpu.cfs_quota_us")
    assert (outside / "cpu.cfs_quota_us").read_text() == "-1\n"


def test_symlinks_are_refused_through_an_open_cgroup(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "cpu.cfs_quota_us").write_text("-1\n")
    mount = tmp_path / "cpu"
    (mount / "kubepods" / "pod2").mkdir(parents=True)
    (mount / "kubepods" / "pod1").symlink_to(outside)
    (mount / "kubepods" / "pod2" / "cpu.cfs_quota_us").symlink_to(outside / "cpu.cfs_quota_us")
    hierarchy = Hierarchy(1, str(mount))
    # The walk to the directory refuses a symlinked component...
    with pytest.raises(CgroupPathError, match="symlink") as info:
        open_cgroup(hierarchy.dir(parse_cgroupfs_path("/kubepods/pod1")))
    assert info.value.input == str(mount / "kubepods" / "pod1")
    # ...and a file opened through the held directory is not followed either.
    with open_cgroup(hierarchy.dir(parse_cgroupfs_path("/kubepods/pod2"))) as held:
        with pytest.raises(CgroupPathError, match="symlink"):
            write_value(held, "cpu.cfs_quota_us", "200000")
        with pytest.raises(CgroupPathError, match="symlink"):
            read_cpu_quota(held)
        with pytest.raises(CgroupPathError, match=r"^invalid cgroup file name "):
            read_value(held, "../pod1/cpu.cfs_quota_us")
    assert (outside / "cpu.cfs_quota_us").read_text() == "-1\n"
    with pytest.raises(CgroupNotFound):
        open_cgroup(hierarchy.dir(parse_cgroupfs_path("/kubepods/pod9")))


@given(st.text(max_size=40))
def test_the_whole_component_match_agrees_with_the_character_scan(text: str) -> None:
    for allowed in (cgroup_paths._COMPONENT, cgroup_paths._UNIT_NAME):
        scanned = next((c for c in text if allowed.fullmatch(c) is None), None)
        assert cgroup_paths._first_bad_char(text, allowed) == scanned


@given(st.text(alphabet="ab.-_:@\x00\n/\\\uff0e ", max_size=12))
def test_the_whole_component_match_agrees_on_near_misses(text: str) -> None:
    for allowed in (cgroup_paths._COMPONENT, cgroup_paths._UNIT_NAME):
        scanned = next((c for c in text if allowed.fullmatch(c) is None), None)
        assert cgroup_paths._first_bad_char(text, allowed) == scanned


def _refused_step_by_step(part: str) -> bool:
    """What `_check_component`'s checks, one by one, say of `part` (True: refused)."""
    return (
        not part
        or len(part) > cgroup_paths.NAME_MAX
        or cgroup_paths._first_bad_char(part, cgroup_paths._COMPONENT) is not None
        or part.strip(".") == ""
    )


@given(st.one_of(st.text(alphabet="ab.-_:@\x00\n/\\\uff0e ", max_size=12), st.text(max_size=300)))
def test_the_one_match_of_a_component_agrees_with_its_checks_one_by_one(part: str) -> None:
    """The fast path (`_VALID_COMPONENT`) takes exactly the components the step-by-step checks pass;
    those it does not take still get the step-by-step message."""
    assert (cgroup_paths._VALID_COMPONENT.fullmatch(part) is None) == _refused_step_by_step(part)


@pytest.mark.parametrize(
    ("part", "valid"),
    [("a" * 255, True), ("a" * 256, False), ("...", False), (".a.", True), ("a\n", False), ("", False)],
)
def test_the_one_match_of_a_component_at_its_edges(part: str, valid: bool) -> None:
    assert (cgroup_paths._VALID_COMPONENT.fullmatch(part) is not None) == valid
    assert _refused_step_by_step(part) == (not valid)


def test_a_symlinked_mount_point_is_followed(tmp_path: Path) -> None:
    # Hosts link /sys/fs/cgroup/cpu -> cpu,cpuacct; the mount point comes from the mount table.
    real = tmp_path / "cpu,cpuacct"
    (real / "kubepods").mkdir(parents=True)
    (real / "kubepods" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu").symlink_to(real)
    cgroup = CgroupDir(Hierarchy(1, str(tmp_path / "cpu")), CgroupPath(("kubepods",)))
    assert read_value(cgroup, "cpu.cfs_quota_us") == "-1\n"


@pytest.mark.parametrize("name", ["../cpu.cfs_quota_us", "cpu.cfs_quota_us/", "", "..", "cpu\x00"])
def test_file_names_are_validated(tmp_path: Path, name: str) -> None:
    cgroup = CgroupDir(Hierarchy(1, str(tmp_path)), CgroupPath())
    with pytest.raises(CgroupPathError, match=r"^invalid cgroup file name "):
        read_value(cgroup, name)
    with pytest.raises(CgroupPathError, match=r"^invalid cgroup file name "):
        write_value(cgroup, name, "1")


# Text built from the characters that matter most (separators, dots, dashes, look-alikes, controls)
# plus arbitrary text: whatever comes in, the result is an error or a path that cannot escape.
_tricky = st.text(alphabet="/.-:_@ak0\x00\n\uff0e\u2024\\", max_size=30) | st.text(max_size=30)


def _cannot_escape(path: CgroupPath) -> None:
    assert path.parts
    for part in path.parts:
        assert part.strip(".")
        assert part.isascii()
        assert all(c.isalnum() or c in "_.:@-" for c in part)


def _check_resolved(resolve: Callable[[str], CgroupPath], text: str) -> None:
    try:
        path = resolve(text)
    except CgroupPathError as exc:
        error = exc
    else:
        _cannot_escape(path)
        return
    assert error.input == text


@given(_tricky)
def test_pod_path_never_escapes(text: str) -> None:
    _check_resolved(pod_cgroup_path, text)


@given(st.tuples(_tricky, _tricky, _tricky).map(":".join) | _tricky)
def test_container_path_never_escapes(text: str) -> None:
    _check_resolved(container_cgroup_path, text)


_level = st.text(alphabet="abcxyz019_.:", min_size=1, max_size=8)


@given(st.lists(_level, min_size=1, max_size=6))
def test_expand_slice_builds_every_level(levels: list[str]) -> None:
    name = "-".join(levels) + ".slice"
    expanded = expand_slice(name).parts
    assert expanded == tuple("-".join(levels[: i + 1]) + ".slice" for i in range(len(levels)))
    assert pod_cgroup_path(name) == pod_cgroup_path("/" + "/".join(expanded))


def test_one_match_of_a_cgroupfs_path_decides_as_its_components_do() -> None:
    """`parse_cgroupfs_path` takes a valid path with one match: exactly the paths whose every
    component `check_name` takes, with the same refusals for the others."""
    rnd = random.Random(14)
    alphabet = "ab9_.:@-/ \x00é"

    def by_component(text: str) -> tuple[str, ...] | None:
        if not text.startswith("/") or len(text) > 4096:
            return None
        if text == "/":
            return ()
        parts = tuple(text[1:].split("/"))
        try:
            for part in parts:
                check_name(part, "part")
        except CgroupPathError:
            return None
        return parts

    texts = ["/" + "a" * 255, "/" + "a" * 256, "/..", "/.../a", "/a/..b", "/a.", "/a//b", "/a/"]
    texts += ["".join(rnd.choice(alphabet) for _ in range(rnd.randrange(10))) for _ in range(20000)]
    for text in texts:
        try:
            parsed: tuple[str, ...] | None = parse_cgroupfs_path(text).parts
        except CgroupPathError:
            parsed = None
        assert parsed == by_component(text), text
