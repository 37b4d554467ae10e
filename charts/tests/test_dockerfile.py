"""The image recipe (Dockerfile) agrees with the chart and the package it installs.

No Docker engine runs here, so the image is not built in CI; these checks catch the
drift that would break it: a COPY of a path that moved, a user id the chart's
securityContext does not run as, a pinned torch the package refuses, an extra that
does not exist.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def instructions(kind: str) -> list[str]:
    """The arguments of every ``kind`` instruction (continuation lines joined)."""
    text = DOCKERFILE.replace("\\\n", " ")
    return [m.group(1) for m in re.finditer(rf"^{kind}\s+(.*)$", text, re.MULTILINE)]


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_every_copied_path_exists():
    sources = [src for args in instructions("COPY") for src in shlex.split(args)[:-1]]
    assert sources, "no COPY found"
    missing = [src for src in sources if not (REPO / src).exists()]
    assert not missing, f"the Dockerfile copies paths the repo lacks: {missing}"


def test_the_image_user_is_the_one_the_chart_runs_as():
    (useradd,) = [run for run in instructions("RUN") if "useradd" in run]
    uid = int(re.search(r"--uid\s+(\d+)", useradd).group(1))
    values = yaml.safe_load((REPO / "charts/specd/values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == uid
    assert instructions("USER") == [str(uid)]


def test_pinned_torch_is_one_the_package_accepts():
    pins = re.findall(r'"torch==([^"]+)"', DOCKERFILE)
    assert len(pins) == 1, pins
    (torch,) = [Requirement(r) for r in project()["dependencies"] if r.startswith("torch")]
    assert torch.specifier.contains(pins[0]), f"torch=={pins[0]} outside {torch.specifier}"


def test_the_gpu_build_names_an_existing_extra():
    named = set(re.findall(r"EXTRAS=(\w+)", DOCKERFILE))
    assert named and named <= set(project()["optional-dependencies"]), named
