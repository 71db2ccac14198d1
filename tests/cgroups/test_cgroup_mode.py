"""nri_plugin.cgroups.mode: cgroup mode and cpu/cpuset hierarchies from mountinfo."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nri_plugin.cgroups import (
    CgroupLayout,
    CgroupMode,
    CgroupModeError,
    Hierarchy,
    detect_layout,
    parse_mountinfo,
    read_layout,
)

# CentOS 7 style: v1 only, cpu and cpuacct co-mounted, systemd's named hierarchy without controllers.
V1_MOUNTINFO = """\
18 62 0:17 / /sys rw,nosuid,nodev,noexec,relatime shared:6 - sysfs sysfs rw
24 18 0:20 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:7 - tmpfs tmpfs ro,mode=755
25 24 0:21 / /sys/fs/cgroup/systemd rw,nosuid,nodev,noexec,relatime shared:8 - cgroup cgroup rw,xattr,release_agent=/usr/lib/systemd/systemd-cgroups-agent,name=systemd
28 24 0:24 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:11 - cgroup cgroup rw,cpu,cpuacct
29 24 0:25 / /sys/fs/cgroup/cpuset rw,nosuid,nodev,noexec,relatime shared:12 - cgroup cgroup rw,cpuset
30 24 0:26 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:13 - cgroup cgroup rw,memory
31 24 0:27 / /sys/fs/cgroup/net_cls,net_prio rw,nosuid,nodev,noexec,relatime shared:14 - cgroup cgroup rw,net_cls,net_prio
62 1 253:0 / / rw,relatime shared:1 - xfs /dev/mapper/centos-root rw,attr2,inode64,noquota
"""  # noqa: E501

# Ubuntu 20.04 style: v1 controllers plus systemd's cgroup2 at unified.
HYBRID_MOUNTINFO = """\
25 24 0:21 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:4 - tmpfs tmpfs ro,mode=755
26 25 0:22 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:5 - cgroup2 cgroup2 rw,nsdelegate
27 25 0:23 / /sys/fs/cgroup/systemd rw,nosuid,nodev,noexec,relatime shared:6 - cgroup cgroup rw,xattr,name=systemd
31 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:10 - cgroup cgroup rw,cpu,cpuacct
32 25 0:28 / /sys/fs/cgroup/cpuset rw,nosuid,nodev,noexec,relatime shared:11 - cgroup cgroup rw,cpuset,clone_children
33 25 0:29 / /sys/fs/cgroup/pids rw,nosuid,nodev,noexec,relatime shared:12 - cgroup cgroup rw,pids
"""  # noqa: E501

# The development machines: separate cpu and cpuacct, no propagation fields.
DEV_MACHINE_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""

# Fedora / Ubuntu 22.04 style: unified hierarchy at the root.
V2_MOUNTINFO = """\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
26 22 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:2 - sysfs sysfs rw
35 26 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
"""  # noqa: E501


@pytest.mark.parametrize(
    ("mountinfo", "expected"),
    [
        (
            V1_MOUNTINFO,
            CgroupLayout(
                CgroupMode.V1,
                Hierarchy(1, "/sys/fs/cgroup/cpu,cpuacct"),
                Hierarchy(1, "/sys/fs/cgroup/cpuset"),
            ),
        ),
        (
            HYBRID_MOUNTINFO,
            CgroupLayout(
                CgroupMode.HYBRID,
                Hierarchy(1, "/sys/fs/cgroup/cpu,cpuacct"),
                Hierarchy(1, "/sys/fs/cgroup/cpuset"),
            ),
        ),
        (
            DEV_MACHINE_MOUNTINFO,
            CgroupLayout(
                CgroupMode.HYBRID, Hierarchy(1, "/sys/fs/cgroup/cpu"), Hierarchy(1, "/sys/fs/cgroup/cpuset")
            ),
        ),
        (
            V2_MOUNTINFO,
            CgroupLayout(CgroupMode.V2, Hierarchy(2, "/sys/fs/cgroup"), Hierarchy(2, "/sys/fs/cgroup")),
        ),
    ],
    ids=["v1", "hybrid", "dev-machine", "v2"],
)
def test_detect_layout(mountinfo: str, expected: CgroupLayout) -> None:
    assert detect_layout(mountinfo) == expected


def test_parse_mountinfo_keeps_cgroup_mounts_with_their_controllers() -> None:
    mounts = parse_mountinfo(HYBRID_MOUNTINFO)
    assert [(m.version, m.mount_point, m.controllers) for m in mounts] == [
        (2, "/sys/fs/cgroup/unified", frozenset()),
        (1, "/sys/fs/cgroup/systemd", frozenset()),
        (1, "/sys/fs/cgroup/cpu,cpuacct", frozenset({"cpu", "cpuacct"})),
        (1, "/sys/fs/cgroup/cpuset", frozenset({"cpuset"})),
        (1, "/sys/fs/cgroup/pids", frozenset({"pids"})),
    ]
    assert all(m.root == "/" for m in mounts)


def test_root_is_configurable_and_mounts_outside_it_are_ignored() -> None:
    host_view = "".join(
        line.replace(" /sys/fs/cgroup", " /host/sys/fs/cgroup") + "\n"
        for line in HYBRID_MOUNTINFO.splitlines()
    )
    layout = detect_layout(V2_MOUNTINFO + host_view, root="/host/sys/fs/cgroup/")
    assert layout == CgroupLayout(
        CgroupMode.HYBRID,
        Hierarchy(1, "/host/sys/fs/cgroup/cpu,cpuacct"),
        Hierarchy(1, "/host/sys/fs/cgroup/cpuset"),
    )
    assert detect_layout(V2_MOUNTINFO + host_view).mode is CgroupMode.V2


def test_escaped_mount_points_and_several_optional_fields() -> None:
    text = (
        "40 31 0:29 / /tmp/my\\040cgroups/cpu rw shared:3 master:7 propagate_from:2 - cgroup cgroup rw,cpu\n"
        "41 31 0:31 / /tmp/my\\040cgroups/cpuset rw - cgroup none rw,cpuset\n"
    )
    layout = detect_layout(text, root="/tmp/my cgroups")
    assert layout.mode is CgroupMode.V1
    assert layout.cpu == Hierarchy(1, "/tmp/my cgroups/cpu")
    assert layout.cpuset == Hierarchy(1, "/tmp/my cgroups/cpuset")


def test_a_later_mount_on_the_same_point_hides_the_earlier() -> None:
    text = V1_MOUNTINFO + "90 24 0:50 / /sys/fs/cgroup/cpuset rw - cgroup2 cgroup2 rw\n"
    layout = detect_layout(text)
    assert layout.cpuset == Hierarchy(2, "/sys/fs/cgroup/cpuset")


def test_v1_mount_of_a_subtree_is_refused_unless_the_whole_tree_is_mounted_too() -> None:
    container_view = V1_MOUNTINFO.replace("0:24 / ", "0:24 /kubepods/pod1/ctr ")
    with pytest.raises(CgroupModeError, match=r"mounted at .* from \"/kubepods/pod1/ctr\""):
        detect_layout(container_view)
    also_whole = container_view + "99 24 0:24 / /host/cpu rw - cgroup cgroup rw,cpu,cpuacct\n"
    assert detect_layout(also_whole, root="/").cpu == Hierarchy(1, "/host/cpu")


@pytest.mark.parametrize(
    ("mountinfo", "message"),
    [
        ("", "no cgroup filesystem is mounted"),
        ("62 1 253:0 / / rw,relatime shared:1 - xfs /dev/root rw\n", "no cgroup filesystem is mounted"),
        (V1_MOUNTINFO.replace("rw,cpuset\n", "rw,memory\n"), "serves the cpuset controller"),
        (V1_MOUNTINFO.replace("rw,cpu,cpuacct\n", "rw,cpuacct\n"), "serves the cpu controller"),
        ("31 23 0:28 / /sys/fs/cgroup rw\n", "mountinfo line 1 is malformed"),
        ("31 23 0:28 / /sys/fs/cgroup rw - cgroup2\n", "mountinfo line 1 is malformed"),
    ],
)
def test_detect_layout_errors(mountinfo: str, message: str) -> None:
    with pytest.raises(CgroupModeError, match=message):
        detect_layout(mountinfo)


def test_read_layout_checks_v2_controllers(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"35 26 0:30 / {root} rw - cgroup2 cgroup2 rw,nsdelegate\n")
    controllers = root / "cgroup.controllers"
    controllers.write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    layout = read_layout(mountinfo_path=str(mountinfo), root=str(root))
    assert layout == CgroupLayout(CgroupMode.V2, Hierarchy(2, str(root)), Hierarchy(2, str(root)))

    controllers.write_text("cpu io memory pids\n")
    with pytest.raises(CgroupModeError, match="does not offer the cpuset controller"):
        read_layout(mountinfo_path=str(mountinfo), root=str(root))
    controllers.unlink()
    with pytest.raises(CgroupModeError, match="cannot read"):
        read_layout(mountinfo_path=str(mountinfo), root=str(root))


def test_read_layout_missing_mountinfo(tmp_path: Path) -> None:
    with pytest.raises(CgroupModeError, match="cannot read"):
        read_layout(mountinfo_path=str(tmp_path / "absent"))


def test_read_layout_on_this_machine() -> None:
    if not os.path.exists("/proc/self/mountinfo"):
        pytest.skip("no /proc/self/mountinfo")
    layout = read_layout()
    assert layout.cpu.mount_point.startswith("/sys/fs/cgroup")
    assert layout.cpuset.mount_point.startswith("/sys/fs/cgroup")
