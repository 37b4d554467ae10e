"""Fault toggles: ``SPECD_DEBUG_REVERT=<name>[,<name>]`` re-enables a known-bad behaviour.

Each toggle undoes one fix from the seed reports so a test can show that the checks
catch the bug it fixed.  Off by default; the environment is read once per process
(``reverted.cache_clear()`` in tests that change it).
"""

from __future__ import annotations

import functools
import os

ENV_VAR = "SPECD_DEBUG_REVERT"

TOGGLES = {
    "row-headroom": "req_to_token rows are context + 4 + T wide, not widened to the reserve",
    "reserve-single": "the per-decode reserve is one allocation length, not two",
    "bonus-preclaim": "no bonus-slot pre-claim; resolve adds the whole accept length",
    "tail-duplication": "branches 1..k-1 of a paged tree get no copy of the prefix tail KV",
}


@functools.cache
def reverted_behaviours() -> frozenset[str]:
    """The toggles named in ``SPECD_DEBUG_REVERT`` (unknown names are an error)."""
    names = {n.strip() for n in os.environ.get(ENV_VAR, "").split(",") if n.strip()}
    unknown = names - TOGGLES.keys()
    if unknown:
        raise ValueError(
            f"{ENV_VAR}: unknown toggle(s) {sorted(unknown)}; known: {sorted(TOGGLES)}"
        )
    return frozenset(names)


def reverted(name: str) -> bool:
    """True when the known-bad behaviour ``name`` is switched back on."""
    if name not in TOGGLES:
        raise KeyError(f"no fault toggle named {name!r}")
    return name in reverted_behaviours()
