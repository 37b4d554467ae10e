"""scripts/offline_gpu_bundle.py: what it packs for an offline CUDA host runs there.

Wheels are zip files, and ``ZipFile.extractall`` drops the mode bits: Ray's raylet and
GCS server then cannot start (``PermissionError`` at ``ray.init``, seen 2026-11-30).
The bundle's ``--serving`` part trims Ray to what a local Ray runs.
"""

from __future__ import annotations

import importlib.util
import os
import stat
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bundle():
    spec = importlib.util.spec_from_file_location(
        "offline_gpu_bundle", REPO / "scripts" / "offline_gpu_bundle.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["offline_gpu_bundle"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("offline_gpu_bundle", None)


def _member(name: str, mode: int, data: bytes = b"x") -> tuple[zipfile.ZipInfo, bytes]:
    info = zipfile.ZipInfo(name)
    info.external_attr = (stat.S_IFREG | mode) << 16
    return info, data


def test_a_wheels_executables_stay_executable(bundle, tmp_path):
    wheel = tmp_path / "ray-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for info, data in (
            _member("ray/core/src/ray/raylet/raylet", 0o755),
            _member("ray/__init__.py", 0o644),
            _member("ray/plain", 0),  # a wheel made without modes: the defaults
        ):
            z.writestr(info, data)
    site = tmp_path / "site"
    bundle.extract_wheel(wheel, site)
    raylet = site / "ray/core/src/ray/raylet/raylet"
    assert os.access(raylet, os.X_OK) and raylet.stat().st_mode & 0o777 == 0o755
    assert not os.access(site / "ray/__init__.py", os.X_OK)
    assert (site / "ray/plain").read_bytes() == b"x"
    # the site's archive keeps them executable through the host's unpacking (data filter)
    archive = tmp_path / "site.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(site, arcname=".")
    out = tmp_path / "host"
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    assert os.access(out / "ray/core/src/ray/raylet/raylet", os.X_OK)


def test_ray_is_trimmed_to_what_a_local_ray_runs(bundle, tmp_path):
    site = tmp_path / "site"
    kept = ["ray/_raylet.so", "ray/core/src/ray/gcs/gcs_server", "ray/dashboard/agent.py"]
    dropped = ["ray/jars/ray_dist.jar", "ray/dashboard/client/build/index.html", "ray/rllib/a.py"]
    for rel in kept + dropped:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(b"12345")
    assert bundle.trim_ray(site) == 5 * len(dropped)
    assert all((site / rel).exists() for rel in kept)
    assert not any((site / rel).exists() for rel in dropped)
    assert bundle.trim_ray(site) == 0  # nothing left to drop
