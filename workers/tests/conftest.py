"""Shared fixtures: tiny checkpoints built offline, and engines over them."""

from __future__ import annotations

import pytest

from specd.workers.tools.tiny_checkpoint import make_tiny_checkpoint


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
