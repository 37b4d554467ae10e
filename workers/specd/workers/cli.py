"""The ``specd`` command.

    specd serve FILE.yaml [--host 127.0.0.1] [--port 8000]   gateway + engine actors on Ray
    specd generate --model DIR [--max-tokens N] PROMPT     one engine in-process, no Ray
    specd validate FILE.yaml [--schema-only]               check a SpecDecodeDeployment and
                                                           that its model folders would load
    specd gateway --config FILE [--host H] [--port P]      the gateway pod: `serve` on
                                                           RAY_ADDRESS, following FILE's changes;
                                                           stopped, it leaves its actors running
                                                           for the next gateway pod to adopt
    specd crd                                              print the SpecDecodeDeployment CRD
    specd operator [--namespace NS ... | --all-namespaces] run the Kubernetes operator

Exit codes: 0 success (``serve`` also after SIGINT/SIGTERM), 1 a failed generation,
2 an invalid spec or model folder (the message names the field; no traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import sys
from pathlib import Path

from specd.workers.bench_knobs import ENV_VAR, BenchKnobs, BenchKnobsError
from specd.workers.config import (
    API_KEY_ENV,
    API_KEY_FILE_ENV,
    ConfigError,
    load_deployment,
    spec_for_model,
)
from specd.workers.gateway.admin_auth import AdminToken, load_admin_token
from specd.workers.gateway.api_keys import ApiKeys
from specd.workers.model.config import ModelLoadError

EXIT_FAILED = 1
EXIT_INVALID = 2


def _serve(args: argparse.Namespace, follow_config: bool = False, on_stop: str = "release") -> int:
    sdd = load_deployment(args.file)
    spec = sdd.spec
    api_keys = ApiKeys.from_env()
    check_api_keys_given(spec, api_keys)
    admin = load_admin_token()  # always one: /admin/* never runs open (docs/security.md)
    knobs = BenchKnobs.from_env()
    if knobs != BenchKnobs():
        print(f"specd: warning: {ENV_VAR} is set, benchmark-only engine settings: {knobs}; "
              "the replicas do not serve the model as its weights say", file=sys.stderr)  # fmt: skip
    if not follow_config and not (os.environ.get("RAY_ADDRESS") or spec.ray.address):
        # a local Ray reads these folders too: refuse one that cannot load before it
        # (the benchmarks' dummy weights need no weight file)
        from specd.workers.model.preflight import check_model_folders

        check_model_folders(spec, weights=not knobs.dummy_weights)
    from specd.workers.gateway.app import Gateway  # imports Ray: only for `serve` and `gateway`
    from specd.workers.gateway.event_loop import run_gateway_loop

    gateway = Gateway(
        spec,
        name=sdd.metadata.name,
        namespace=sdd.metadata.namespace,
        host=args.host,
        port=args.port,
        drain_timeout_s=args.drain_timeout,
        on_stop=on_stop,
        admin_token=admin.value,
        api_keys=api_keys,
        stop_on_failure=not follow_config,  # the pod stays up to report it
    )

    def ready(url: str) -> None:
        body = f'{{"model": "{spec.served_model_name}", "prompt": "Hello", "max_tokens": 32}}'
        key = ' -H "Authorization: Bearer $SPECD_API_KEY"' if api_keys.enabled else ""
        print(f"specd: {sdd.metadata.name} ready ({spec.replicas} replicas) on {url}", flush=True)
        print(
            f"  curl {url}/v1/completions -H 'Content-Type: application/json'{key} "
            f"-d {shlex.quote(body)}",
            flush=True,
        )

    print(
        f"specd: starting {sdd.metadata.name} ({spec.replicas} replicas of {spec.served_model_name})",
        flush=True,
    )
    print(admin_token_note(admin), flush=True)
    run_gateway_loop(_run_gateway(gateway, ready, args.file if follow_config else None))
    if (failure := gateway.failure) is not None:  # the model cannot load: a spec error
        print(
            f"specd: replica {failure.replica} failed to load: {failure.message}", file=sys.stderr
        )
        return EXIT_INVALID
    print("specd: stopped", flush=True)
    return 0


def admin_token_note(admin: AdminToken) -> str:
    """Where the admin token is (never the token: stdout often ends up in logs)."""
    if admin.path is None:
        where = "from SPECD_ADMIN_TOKEN"
    else:
        where = f"{'written to' if admin.generated else 'read from'} {admin.path}"
    return f"specd: admin token {where} (POST /admin/* needs it; see docs/security.md)"


def check_api_keys_given(spec, api_keys: ApiKeys) -> None:
    """Keys never silently off (fails closed): a key setting given that names no key is
    refused, and so is a spec that asks for API keys without any."""
    if blank := api_keys.blank_settings():
        raise ConfigError(
            f"{' and '.join(blank)} given but holding no API key (blank, or only commas and "
            "blank lines): put keys in it, or unset it to serve without API keys"
        )
    if spec.auth.api_key_secret is not None and not api_keys.enabled:
        raise ConfigError(
            "spec.auth.apiKeySecret asks for API keys but this process has none: set "
            f"{API_KEY_ENV} (comma-separated keys) or {API_KEY_FILE_ENV} (a file, one key "
            "per line); the operator sets the file from the Secret"
        )


async def _run_gateway(gateway, on_ready, follow: str | None) -> None:
    """``gateway.run``; with ``follow``, also apply that file's changes (`_follow_config`)."""
    watcher = asyncio.create_task(_follow_config(gateway, follow)) if follow else None
    try:
        await gateway.run(on_ready=on_ready)
    finally:
        if watcher is not None:
            watcher.cancel()


async def _follow_config(gateway, path: str, interval_s: float = 2.0) -> None:
    """Roll the pool to the spec in ``path`` whenever the file changes (a mounted
    ConfigMap): replicas scale, a new config hash rolls actors one at a time.  A new
    model or tokenizer needs a new gateway process: it stops (Kubernetes restarts it).
    An invalid file is logged and ignored; the running spec stays."""
    log = logging.getLogger("specd.gateway")
    last = Path(path).read_text()
    while True:
        await asyncio.sleep(interval_s)
        text = Path(path).read_text()
        if text == last or gateway.pool is None:
            continue
        last = text
        try:
            spec = load_deployment(path).spec
        except ConfigError as err:
            log.error("ignoring the changed %s: %s", path, err)
            continue
        old = gateway.pool.spec
        if (spec.model.path, spec.model.tokenizer) != (old.model.path, old.model.tokenizer):
            log.warning("%s: the model changed; restarting the gateway", path)
            gateway.stop()
            return
        log.info("%s changed: config %s -> %s", path, old.config_hash(), spec.config_hash())
        gateway.pool.update_spec(spec)


def _gateway(args: argparse.Namespace) -> int:
    args.file = args.config
    # a pod that stops leaves its actors to the next gateway pod (see `Gateway`)
    return _serve(args, follow_config=True, on_stop="detach")


def _crd(args: argparse.Namespace) -> int:
    from specd.operator.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _operator(args: argparse.Namespace) -> int:
    from specd.operator.children import ChildOptions
    from specd.operator.main import run_operator

    return run_operator(
        namespaces=args.namespace,
        clusterwide=args.all_namespaces,
        options=ChildOptions(image=args.image, ray_version=args.ray_version),
        poll_interval_s=args.poll_interval,
        metrics_port=args.metrics_port or None,
        liveness=args.liveness or None,
        standalone=args.standalone,
        priority=args.priority,
    )


def _generate(args: argparse.Namespace) -> int:
    import torch

    from specd.workers.engine.engine import Engine
    from specd.workers.model.tokenizer import apply_chat_template
    from specd.workers.types import FinishReason, GenerateRequest, SamplingParams

    kv = {"kvCache": {"maxTokens": args.kv_tokens}} if args.kv_tokens else {}
    spec = spec_for_model(str(Path(args.model).resolve()), **kv)
    engine = Engine(spec, device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    engine.start()
    try:
        tok = engine.tokenizer
        ids = (
            apply_chat_template(tok, [{"role": "user", "content": args.prompt}])
            if args.chat
            else tok(args.prompt)["input_ids"]
        )
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            grammar=_cli_grammar(args),
        )

        async def run() -> int:
            async for delta in engine.generate(GenerateRequest("cli", tuple(ids), params)):
                print(delta.text, end="", flush=True)
                if delta.finish_reason is FinishReason.ERROR:
                    print(f"\nspecd: {delta.error}", file=sys.stderr)
                    return EXIT_FAILED
            print()
            return 0

        return asyncio.run(run())
    finally:
        engine.shutdown()


def _cli_grammar(args: argparse.Namespace):
    """``--regex`` / ``--json-schema`` as the engine's structured-output grammar."""
    from specd.workers.types import Grammar

    if args.regex is not None:
        return Grammar("regex", args.regex, "--regex")
    if args.json_schema is not None:
        return Grammar("json_schema", Path(args.json_schema).read_text(), "--json-schema")
    return None


def _validate(args: argparse.Namespace) -> int:
    """The schema, then (unless ``--schema-only``) whether the model folders would load:
    configs, tokenizer and safetensors headers read, no weight (`preflight`)."""
    sdd = load_deployment(args.file)
    spec = sdd.spec
    if not args.schema_only:
        from specd.workers.model.preflight import check_model_folders  # imports torch

        check_model_folders(spec)
    print(
        f"OK: {args.file}: {sdd.metadata.name} serves {spec.served_model_name} "
        f"({spec.replicas} replicas, config hash {spec.config_hash()}"
        f"{'; model folders not checked' if args.schema_only else ''})"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description="Speculative-decoding LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve", help="serve a SpecDecodeDeployment file on a local (or RAY_ADDRESS) Ray"
    )
    serve.add_argument("file", help="SpecDecodeDeployment YAML")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds open requests get at shutdown"
    )
    serve.set_defaults(func=_serve)

    gen = sub.add_parser("generate", help="generate text from a local model folder (no Ray)")
    gen.add_argument("--model", required=True, help="Hugging Face model folder")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)"
    )
    gen.add_argument("--kv-tokens", type=int, default=None, help="KV pool size in tokens")
    held = gen.add_mutually_exclusive_group()
    held.add_argument("--regex", help="the output matches this regular expression")
    held.add_argument("--json-schema", help="the output is JSON valid against this schema file")
    gen.add_argument("prompt")
    gen.set_defaults(func=_generate)

    val = sub.add_parser("validate", help="check a SpecDecodeDeployment file")
    val.add_argument("file")
    val.add_argument(
        "--schema-only",
        action="store_true",
        help="check the spec only, not that its model folders exist and would load",
    )
    val.set_defaults(func=_validate)
    _add_operator_commands(sub)
    return parser


def _add_operator_commands(sub) -> None:
    from specd.operator.children import ChildOptions

    gw = sub.add_parser(
        "gateway", help="run the gateway of a deployment on RAY_ADDRESS (the Kubernetes pod)"
    )
    gw.add_argument("--config", required=True, help="SpecDecodeDeployment YAML (followed)")
    gw.add_argument("--host", default="0.0.0.0")
    gw.add_argument("--port", type=int, default=8000)
    gw.add_argument("--drain-timeout", type=float, default=30.0)
    gw.set_defaults(func=_gateway)

    crd = sub.add_parser("crd", help="print the SpecDecodeDeployment CRD (YAML)")
    crd.set_defaults(func=_crd)

    op = sub.add_parser("operator", help="run the Kubernetes operator (kopf)")
    scope = op.add_mutually_exclusive_group(required=True)
    scope.add_argument("--namespace", action="append", help="watch this namespace (repeatable)")
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace")
    defaults = ChildOptions()
    op.add_argument("--image", default=defaults.image, help="gateway and Ray image")
    op.add_argument("--ray-version", default=defaults.ray_version, help="RayCluster rayVersion")
    op.add_argument("--poll-interval", type=float, default=10.0, help="gateway poll, seconds")
    op.add_argument("--metrics-port", type=int, default=9090, help="0: no /metrics")
    op.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="'' to disable")
    op.add_argument("--standalone", action="store_true", help="no peering (a single replica)")
    op.add_argument("--priority", type=int, default=0, help="peering priority")
    op.set_defaults(func=_operator)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("specd").setLevel(logging.INFO)
    try:
        return args.func(args)
    except (ConfigError, ModelLoadError, BenchKnobsError) as err:
        print(f"specd: {err}", file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
