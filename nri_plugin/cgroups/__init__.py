"""cgroup v1/v2 files and paths for the plugin. Knows nothing of NRI: it takes plain strings (a
pod's cgroup parent, a container's cgroups path) and CPU sets.

Typical use::

    layout = read_layout()                                   # which hierarchy serves cpu, cpuset
    pod = layout.cpu.dir(pod_cgroup_path(cgroup_parent))
    ctr = layout.cpu.dir(container_cgroup_path(cgroups_path))
    write_parent_child_quota(pod, ctr, parent_quota=600_000, child_quota=400_000)
    write_cpuset(layout.cpuset.dir(container_cgroup_path(cgroups_path)), cpus)
    with open_cgroup(pod) as held:                           # one walk, several files
        limit = read_cpu_quota(held)

Modules: `cpuset` (cpu lists), `mode` (mountinfo), `paths` (validated cgroup paths),
`quota` (CFS values), `files` (reads and writes), `errors`.
"""

from nri_plugin.cgroups import cpuset
from nri_plugin.cgroups.cpuset import MAX_CPU, MAX_CPUS, CpusetError
from nri_plugin.cgroups.errors import (
    CgroupError,
    CgroupModeError,
    CgroupNotFound,
    CgroupPathError,
    CgroupPermissionError,
    CgroupValueError,
    CgroupWriteRejected,
)
from nri_plugin.cgroups.files import (
    Cgroup,
    CgroupOpener,
    OpenCgroup,
    cgroup_exists,
    open_cgroup,
    read_cpu_quota,
    read_cpuset,
    read_effective_cpuset,
    read_value,
    restore_cpu_quota,
    set_cpu_limit,
    write_cpu_limit,
    write_cpu_quota,
    write_cpuset,
    write_parent_child_quota,
    write_value,
)
from nri_plugin.cgroups.mode import (
    CgroupLayout,
    CgroupMode,
    CgroupMount,
    detect_layout,
    parse_mountinfo,
    read_layout,
)
from nri_plugin.cgroups.paths import (
    CgroupDir,
    CgroupPath,
    CgroupVersion,
    Hierarchy,
    check_name,
    container_cgroup_path,
    expand_slice,
    parse_cgroupfs_path,
    pod_cgroup_path,
)
from nri_plugin.cgroups.quota import MIN_CFS_QUOTA_US, CpuQuota, format_cpu_max, parse_cpu_max

parse_cpuset = cpuset.parse
format_cpuset = cpuset.format

__all__ = [
    "MAX_CPU",
    "MAX_CPUS",
    "MIN_CFS_QUOTA_US",
    "Cgroup",
    "CgroupDir",
    "CgroupError",
    "CgroupLayout",
    "CgroupMode",
    "CgroupModeError",
    "CgroupMount",
    "CgroupNotFound",
    "CgroupOpener",
    "CgroupPath",
    "CgroupPathError",
    "CgroupPermissionError",
    "CgroupValueError",
    "CgroupVersion",
    "CgroupWriteRejected",
    "CpuQuota",
    "CpusetError",
    "Hierarchy",
    "OpenCgroup",
    "cgroup_exists",
    "check_name",
    "container_cgroup_path",
    "cpuset",
    "detect_layout",
    "expand_slice",
    "format_cpu_max",
    "format_cpuset",
    "open_cgroup",
    "parse_cgroupfs_path",
    "parse_cpu_max",
    "parse_cpuset",
    "parse_mountinfo",
    "pod_cgroup_path",
    "read_cpu_quota",
    "read_cpuset",
    "read_effective_cpuset",
    "read_layout",
    "read_value",
    "restore_cpu_quota",
    "set_cpu_limit",
    "write_cpu_limit",
    "write_cpu_quota",
    "write_cpuset",
    "write_parent_child_quota",
    "write_value",
]
