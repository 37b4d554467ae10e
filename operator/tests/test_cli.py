"""`specd gateway`'s config following (the mounted ConfigMap) and the new subcommands."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import yaml

from specd.workers import cli
from specd.workers.config import load_deployment

from .conftest import REPO


@dataclass
class _Pool:
    spec: object
    updates: list = field(default_factory=list)

    def update_spec(self, spec) -> None:
        self.updates.append(spec)
        self.spec = spec


@dataclass
class _Gateway:
    pool: _Pool
    stopped: bool = False

    def stop(self) -> None:
        self.stopped = True


async def test_gateway_follows_its_config_file(tmp_path):
    doc = yaml.safe_load((REPO / "examples/gpu-eagle3-tree.yaml").read_text())
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(doc))
    gateway = _Gateway(_Pool(load_deployment(path).spec))
    follow = asyncio.create_task(cli._follow_config(gateway, str(path), interval_s=0.02))
    await asyncio.sleep(0.05)
    doc["spec"]["replicas"] = 5
    path.write_text(yaml.safe_dump(doc))
    while not gateway.pool.updates:
        await asyncio.sleep(0.02)
    assert gateway.pool.updates[-1].replicas == 5
    path.write_text("spec: [not, a, deployment")  # invalid: ignored, still following
    await asyncio.sleep(0.1)
    assert len(gateway.pool.updates) == 1 and not follow.done()
    doc["spec"]["model"]["path"] = "/models/other"
    path.write_text(yaml.safe_dump(doc))
    async with asyncio.timeout(5):
        await follow
    assert gateway.stopped and len(gateway.pool.updates) == 1


def test_operator_command_needs_a_scope():
    parser = cli.build_parser()
    args = parser.parse_args(["operator", "--all-namespaces", "--standalone"])
    assert (args.all_namespaces, args.standalone, args.func) == (True, True, cli._operator)
    args = parser.parse_args(["gateway", "--config", "/etc/specd/deployment.yaml"])
    assert (args.config, args.port, args.func) == ("/etc/specd/deployment.yaml", 8000, cli._gateway)
