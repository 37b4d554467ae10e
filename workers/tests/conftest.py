"""Shared fixtures: tiny checkpoints built offline, and engines over them."""

from __future__ import annotations

import pytest

from specd.devtools.testing import DEMO_EAGLE, DEMO_TARGET
from specd.devtools.tiny_checkpoint import make_tiny_checkpoint
from specd.devtools.tiny_draft import make_tiny_eagle, make_tiny_eagle3


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """variant -> checkpoint folder, built once per session."""
    cache: dict[str, str] = {}

    def get(variant: str = "gqa") -> str:
        if variant not in cache:
            cache[variant] = str(
                make_tiny_checkpoint(tmp_path_factory.mktemp(variant), variant=variant)
            )
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def serve_gateway(ray_cluster):
    """Start gateways on the module's Ray cluster; ``serve_gateway(spec, name)`` returns
    one whose replicas are all ready.  Each is stopped at the module's end, before the
    cluster."""
    import contextlib

    from specd.devtools.testing import running_gateway

    with contextlib.ExitStack() as stack:
        yield lambda spec, name, ready_timeout_s=90: stack.enter_context(
            running_gateway(spec, name, ready_timeout_s)
        )


@pytest.fixture(scope="session")
def pair(tiny_models, tmp_path_factory):
    """(target folder, EAGLE draft folder, EAGLE-3 draft folder): random weights, so the
    drafts' acceptance is near zero."""
    target = tiny_models("gqa")
    eagle = make_tiny_eagle(tmp_path_factory.mktemp("eagle"), target)
    eagle3 = make_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target)
    return target, str(eagle), str(eagle3)


@pytest.fixture(scope="session")
def gpu_pair(tmp_path_factory):
    """The CUDA matrix's (target, EAGLE, EAGLE-3): the shipped trained pair and a random
    EAGLE-3 head on its target.  Trained weights keep bf16 rounding far below most top-two
    logit gaps (random weights large enough to give varied text stray by whole logits in
    bf16), the trained draft really accepts, and the heads are 64 wide (flashinfer runs
    64, 128 and 256)."""
    eagle3 = make_tiny_eagle3(tmp_path_factory.mktemp("eagle3-demo"), DEMO_TARGET)
    return DEMO_TARGET, DEMO_EAGLE, str(eagle3)
