"""The benchmark's plugin imports what the image's would (bench/image_imports.py).

The image installs ``pip install .`` only; the development venv adds the test tools and, with them,
packages a runtime dependency picks up when present (structlog.dev: rich). With the refusing finder
installed, the daemon's whole import set, and the benchmark child's, must come from the plugin's
own runtime dependencies (and theirs) and the standard library: nothing the image would lack.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in a fresh interpreter: prints the top-level modules imported whose distribution is not among
# the runtime dependencies' closure, and whether rich was imported.
_PROBE = """
import importlib.metadata as md, io, json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "bench"))
from image_imports import refuse_not_in_image
refuse_not_in_image()
import nri_plugin.daemon.cli, nri_plugin.daemon.app, nri_plugin.daemon.wiring
from nri_plugin.daemon.logs import configure_logging
configure_logging("info", "console", stream=io.StringIO())
configure_logging("info", "json", stream=io.StringIO())
import plugin_child
from packaging.requirements import Requirement  # the probe's own import, left out below

def closure(name, seen):
    key = name.lower().replace("_", "-")
    if key in seen:
        return
    seen.add(key)
    for text in md.distribution(name).requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            closure(req.name, seen)

image = set()
closure("mixed-cpu-nri-plugin", image)
image |= {"setuptools", "packaging"}  # the interpreter's own site hook (_distutils_hack); the probe
owners = md.packages_distributions()
foreign = sorted(
    top for top in {name.partition(".")[0] for name in sys.modules}
    if top in owners and not any(d.lower().replace("_", "-") in image for d in owners[top])
)
print(json.dumps({"foreign": foreign, "rich": "rich" in sys.modules}))
"""


def _probe() -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(ROOT)], capture_output=True, text=True, timeout=60, check=True
    )
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_daemon_imports_nothing_the_image_lacks_once_dev_packages_are_refused() -> None:
    found = _probe()
    assert found == {"foreign": [], "rich": False}


def test_a_refused_package_fails_as_a_missing_one() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]);"
            "from image_imports import refuse_not_in_image; refuse_not_in_image()\n"
            "try:\n import rich\nexcept ModuleNotFoundError as exc: print(exc.name)",
            str(ROOT / "bench"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert done.stdout.strip() == "rich"
