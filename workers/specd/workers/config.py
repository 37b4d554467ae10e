"""The `SpecDecodeDeployment` schema (DESIGN §4), loaded from YAML.

Torch-free on purpose: the operator imports this module to validate specs.
Field names are camelCase in YAML and snake_case in Python.  Unknown fields are
rejected; every error names the field path (``spec.kvCache.pageSize``) and what
is allowed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from specd.workers.gateway_spec import AuthSpec, GatewaySpec, SecretKeyRef  # noqa: F401
from specd.workers.spec_model import ConfigError, DType, SpecModel, SubfieldError  # noqa: F401
from specd.workers.speculation_spec import (  # noqa: F401  (part of the spec)
    DRAFT_FREE,
    AdaptiveSpec,
    CandidateRung,
    CostModelSpec,
    DraftAlgorithm,
    DraftSpec,
    NgramSpec,
    SpeculationPolicySpec,
    SpeculativeSpec,
    SuffixSpec,
    check_drafter_settings,
    default_num_draft_tokens,
    speculative_rules,
)

API_GROUP = "specd.dev"
API_VERSION = "v1alpha1"
KIND = "SpecDecodeDeployment"
# the admin token `POST /admin/*` needs (`specd.workers.gateway.admin_auth`): the token itself,
# or the file holding it (the operator mounts its per-SDD Secret there; `specd serve`
# writes a new one there when it is missing)
ADMIN_TOKEN_ENV = "SPECD_ADMIN_TOKEN"
ADMIN_TOKEN_FILE_ENV = "SPECD_ADMIN_TOKEN_FILE"
API_KEY_ENV = "SPECD_API_KEY"  # the gateway's API keys, comma-separated
API_KEY_FILE_ENV = "SPECD_API_KEY_FILE"  # or a file of them, one per line


def ray_namespace(kube_namespace: str | None) -> str:
    """The Ray namespace a gateway starts (and adopts) its engine actors in: one per
    Kubernetes namespace, so same-named SDDs of two namespaces sharing one Ray
    cluster never adopt each other's actors."""
    return f"specd-{kube_namespace}" if kube_namespace else "specd"


class ModelSpec(SpecModel):
    path: str = Field(min_length=1, description="Local Hugging Face folder of the target model")
    tokenizer: str | None = Field(None, description="Tokenizer folder (default: model path)")
    dtype: DType = Field(
        DType.auto,
        description="Activation dtype, and the dtype of weights the checkpoint does not "
        "quantize (auto: the checkpoint's, bfloat16 for published FP8 models); FP8 "
        "weights are read from config.json's quantization_config, not set here",
    )
    context_length: int | None = Field(None, ge=16, description="Override max positions")
    name: str | None = Field(None, description="Model id served on /v1/models")


class KVCacheSpec(SpecModel):
    page_size: int = Field(1, ge=1, le=256)
    max_tokens: int | None = Field(None, ge=1, description="KV pool size in tokens")
    mem_fraction: float | None = Field(
        None, gt=0, lt=1, description="Share of free GPU memory for the KV pool"
    )
    prefix_cache: bool = Field(
        True,
        description="Keep finished requests' KV (whole pages) for later requests that "
        "start with the same tokens; evicted least recently used when the pool runs dry",
    )

    @model_validator(mode="after")
    def _one_size(self) -> KVCacheSpec:
        if self.max_tokens is not None and self.mem_fraction is not None:
            raise ValueError("set only one of maxTokens or memFraction")
        return self


class SchedulerSpec(SpecModel):
    chunked_prefill_size: int = Field(
        512, ge=1, description="Max prompt tokens prefetched per step (one chunk)"
    )
    overlap: bool = Field(False, description="Prepare step N+1 while step N runs")
    policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="fcfs: requests start in arrival order; priority: by each request's "
        "`priority` (lower first, then arrival), and a waiting request preempts running "
        "ones of lower priority",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        le=1024,
        description="Output tokens a streamed request gathers before its next delta is "
        "sent (the first token goes at once, the last delta when it finishes; requests "
        "with stop strings send every step); 1: every step. Larger: less CPU per token "
        "in the engine, gateway and client, burstier streams (SGLang's and vLLM's "
        "--stream-interval)",
    )


class CudaGraphSpec(SpecModel):
    enabled: bool = Field(
        True, description="Replay decode and speculative steps as CUDA graphs (CUDA backends)"
    )
    max_batch_size: int = Field(
        32, ge=1, le=1024, description="Largest batch captured; larger batches run eagerly"
    )


class RoutingSpec(SpecModel):
    """Gateway-only: which ready replica gets a request (not part of the config hash, so
    a change applies at once and rolls no replica)."""

    policy: Literal["cacheAware", "leastLoad"] = Field(
        "cacheAware",
        description="cacheAware: send a prompt to the replica predicted to hold the "
        "longest cached prefix of it, unless that replica is too busy; leastLoad: the "
        "least-loaded replica always",
    )
    cache_threshold: float = Field(
        0.3,
        ge=0,
        le=1,
        description="cacheAware: the least share of a prompt predicted cached on a replica "
        "for that replica to be preferred",
    )
    balance_abs_threshold: int = Field(
        16,
        ge=0,
        description="cacheAware: the cached replica is skipped for the least-loaded one when "
        "it has more than this many more open requests ...",
    )
    balance_rel_threshold: float = Field(
        1.5,
        ge=1,
        description="... and more than this many times as many",
    )


class AutoscalingSpec(SpecModel):
    """Gateway-only (not in the config hash): the replica count follows the load between
    ``minReplicas`` and ``maxReplicas`` (Ray Serve's policy on ongoing requests);
    ``spec.replicas`` is where it starts, and setting it (``kubectl scale``) moves the
    count there at once.  ``minReplicas: 0`` scales to zero when idle; a request then
    waits for a replica to start (at most ``coldStartTimeoutSeconds``)."""

    min_replicas: int = Field(
        1,
        ge=0,
        le=1024,
        description="Fewest replicas; 0: none while idle (no open stream or session), and "
        "the first request waits for a model load",
    )
    max_replicas: int = Field(ge=1, le=1024, description="Most replicas")
    target_ongoing_requests: float = Field(
        32,
        gt=0,
        description="Requests per replica (running or queued in its engine) the pool aims "
        "for: the count is the load averaged over lookBackSeconds / this, rounded up",
    )
    look_back_seconds: float = Field(30, gt=0, description="The load is averaged over this")
    upscale_delay_seconds: float = Field(
        30, ge=0, description="A higher count must be asked for this long before replicas start"
    )
    downscale_delay_seconds: float = Field(
        600, ge=0, description="A lower count must be asked for this long before replicas leave"
    )
    cold_start_timeout_seconds: float = Field(
        300,
        gt=0,
        description="minReplicas 0: how long a request waits for a replica to start before "
        "it gets 503",
    )

    @model_validator(mode="after")
    def _bounds_in_order(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"minReplicas ({self.min_replicas}) must be at most maxReplicas "
                f"({self.max_replicas})"
            )
        return self

    def clamp(self, replicas: int) -> int:
        """``replicas`` within [minReplicas, maxReplicas]."""
        return min(max(replicas, self.min_replicas), self.max_replicas)


class ToolCallsSpec(SpecModel):
    """Gateway-only (not in the config hash): how tool_choice auto finds tool calls."""

    parser: Literal["hermes", "llama3_json"] | None = Field(
        None,
        description="The model family's call format: hermes (<tool_call>{json}</tool_call>: "
        'Qwen 2.5/3, Hermes) or llama3_json ({"name", "parameters"}: Llama 3.1+); '
        "unset: tool_choice auto is refused",
    )


class ReasoningSpec(SpecModel):
    """Gateway-only (not in the config hash): how a thinking model's reasoning is found."""

    parser: Literal["deepseek_r1", "qwen3"] | None = Field(
        None,
        description="The model family's thinking format, returned as reasoning_content: "
        "deepseek_r1 (always thinks, up to </think>) or qwen3 (<think>...</think> when "
        "thinking is on); unset: the whole output is content",
    )


class ResourcesSpec(SpecModel):
    gpus: float = Field(0, ge=0)
    cpu: float = Field(1, ge=0, description="CPUs of each rank's actor (tensor 1: the replica's)")
    memory: str | None = None


# How long a replica's ranks may take to meet, load their shards (collectives at load
# included) and trade the KV layout: a busy node starts the other ranks' actors late, and
# they load at their own pace.  From the KV layout on, the group's timeout is the spec's.
RANK_START_TIMEOUT_S = 600.0


class ParallelismSpec(SpecModel):
    """How one replica spreads over devices.  Part of the config hash: a change rolls
    the replicas."""

    tensor: Literal[1, 2, 4, 8] = Field(
        1,
        description="Tensor-parallel size: ranks (one Ray actor each) per replica, one GPU "
        "per rank, all of a replica's ranks on one node; `resources.gpus` is this on GPUs "
        "(0 on CPU)",
    )
    collective_timeout_seconds: float = Field(
        120,
        gt=0,
        le=86400,  # a day; far larger ones overflow torch's timeout when the ranks start
        description="How long a collective between a replica's ranks may wait; past it "
        "the replica is reported failed (and replaced), never left hanging (while the ranks "
        f"start and load, they have {RANK_START_TIMEOUT_S:.0f} s)",
    )


class RaySpec(SpecModel):
    address: str | None = None
    cluster: dict[str, Any] | None = Field(None, description="RayCluster template overrides")

    @model_validator(mode="after")
    def _one_cluster(self) -> RaySpec:
        if self.address is not None and self.cluster is not None:
            raise ValueError(
                "set only one of address (an existing Ray cluster) or cluster "
                "(overrides for the RayCluster the operator manages)"
            )
        return self


class SessionsSpec(SpecModel):
    enabled: bool = Field(False, description="Serve /v1/sessions (multi-turn KV reuse)")
    timeout_seconds: float = Field(300, gt=0, description="Idle sessions close after this")
    max_sessions: int = Field(
        64, ge=1, le=65536, description="Open sessions per replica (each holds a KV row)"
    )


class MetricsSpec(SpecModel):
    """Operator-only: how Prometheus scrapes the gateway (not part of the engine config)."""

    service_monitor: bool = Field(
        False, description="Create a ServiceMonitor (when the Prometheus operator is installed)"
    )
    interval: str = Field("30s", pattern=r"^[0-9]+(ms|s|m|h)$", description="Scrape interval")


# a request default -> (its rule in words, the check): the bounds the OpenAI API puts on
# a request's own value
_SAMPLING_RULES: dict[str, tuple[str, Callable[[float], bool]]] = {
    "temperature": ("a number in [0, 2]", lambda v: 0 <= v <= 2),
    "top_p": ("a number in (0, 1]", lambda v: 0 < v <= 1),
    "top_k": ("an integer >= -1 (0 and -1: off)", lambda v: float(v).is_integer() and v >= -1),
    "repetition_penalty": ("a number > 0 (1: off)", lambda v: v > 0),
    "min_p": ("a number in [0, 1]", lambda v: 0 <= v <= 1),
}


class SamplingDefaultsSpec(SpecModel):
    """What a request that leaves a sampling field out gets (its own value always wins):
    this spec's values, then the model's ``generation_config.json`` (``fromModel``, as
    vLLM's ``--generation-config auto``), then the OpenAI API's (temperature 1, top_p 1)."""

    from_model: bool = Field(
        True,
        description="Use temperature, top_p, top_k, repetition_penalty and min_p from "
        "generation_config.json",
    )
    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off")
    repetition_penalty: float | None = Field(None, gt=0, description="1: off")
    min_p: float | None = Field(None, ge=0, le=1, description="0: off")

    def resolve(self, generation: dict[str, Any]) -> dict[str, float]:
        """Request defaults from this spec over ``generation`` (a model's
        generation_config.json sampling keys as written; refused when out of range)."""
        out: dict[str, float] = {}
        for key, value in generation.items() if self.from_model else ():
            if key not in _SAMPLING_RULES:
                continue
            rule, ok = _SAMPLING_RULES[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or not ok(value):
                raise ConfigError(
                    f"the model's generation_config.json has {key}={value!r}, which must be "
                    f"{rule}: fix the file, or set spec.samplingDefaults.fromModel: false"
                )
            out[key] = int(value) if key == "top_k" else value
        mine = {key: getattr(self, key) for key in _SAMPLING_RULES}
        out.update({key: value for key, value in mine.items() if value is not None})
        if out.get("top_k") == 0:
            out["top_k"] = -1
        return out


class DebugSpec(SpecModel):
    strict_mem_check: Literal[0, 1, 2] = 0


class DeploymentSpec(SpecModel):
    model: ModelSpec
    draft: DraftSpec | None = None
    speculative: SpeculativeSpec | None = None
    kv_cache: KVCacheSpec = Field(default_factory=KVCacheSpec)
    attention_backend: Literal["auto", "torch", "cpu", "flashinfer", "triton"] = "auto"
    cuda_graph: CudaGraphSpec = Field(default_factory=CudaGraphSpec)
    replicas: int = Field(1, ge=0, le=1024)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    parallelism: ParallelismSpec = Field(
        default_factory=ParallelismSpec,
        description="Tensor parallelism: one replica over several GPUs of one node",
    )
    max_running_requests: int = Field(64, ge=1, le=4096)
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    ray: RaySpec = Field(default_factory=RaySpec)
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    autoscaling: AutoscalingSpec | None = None
    tool_calls: ToolCallsSpec = Field(default_factory=ToolCallsSpec)
    auth: AuthSpec = Field(default_factory=AuthSpec)
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)
    reasoning: ReasoningSpec = Field(default_factory=ReasoningSpec)
    sessions: SessionsSpec = Field(default_factory=SessionsSpec)
    sampling_defaults: SamplingDefaultsSpec = Field(default_factory=SamplingDefaultsSpec)
    debug: DebugSpec = Field(default_factory=DebugSpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec, exclude=True)
    image: str | None = Field(
        None, exclude=True, description="Container image of the gateway and Ray pods (operator)"
    )

    @model_validator(mode="after")
    def _draft_and_speculative_together(self) -> DeploymentSpec:
        if self.speculative is not None and self.draft is None:
            raise ValueError(
                "spec.speculative needs spec.draft (the draft model folder and algorithm)"
            )
        if self.draft is not None and self.speculative is None:
            raise ValueError(
                "spec.draft needs spec.speculative (numSteps, topk, numDraftTokens); "
                "add `speculative: {}` for the defaults"
            )
        if self.speculative is not None:
            check_drafter_settings(self.draft, self.speculative)
        return self

    @property
    def ngram(self) -> NgramSpec | None:
        """Own-token matching for draft-free drafting (NGRAM, SUFFIX), the defaults when
        left out; None for a draft model."""
        if self.draft is None or self.draft.algorithm not in DRAFT_FREE:
            return None
        return self.speculative.ngram or NgramSpec()

    @property
    def suffix(self) -> SuffixSpec | None:
        """SUFFIX drafting's cache settings (the defaults when left out), those of a
        hybrid draft model, else None."""
        if self.draft is None:
            return None
        if self.draft.algorithm is DraftAlgorithm.SUFFIX:
            return self.speculative.suffix or SuffixSpec()
        return self.speculative.suffix

    @property
    def has_draft_model(self) -> bool:
        """A draft model to load from ``draft.path`` (EAGLE, EAGLE3; not NGRAM, SUFFIX)."""
        return self.draft is not None and self.draft.algorithm.has_model

    @model_validator(mode="after")
    def _gpus_match_tensor(self) -> DeploymentSpec:
        """One GPU per rank: ``resources.gpus`` (per replica) is 0 (CPU) or the tensor
        size; at tensor 1 a share of one GPU (below 1) packs replicas onto a GPU."""
        gpus, tensor = self.resources.gpus, self.parallelism.tensor
        if gpus == 0 or gpus == tensor or (tensor == 1 and gpus < 1):
            return self
        share = ", or below 1 to share one GPU" if tensor == 1 else ""
        raise ValueError(
            f"spec.resources.gpus ({gpus:g}) must be 0 or equal to spec.parallelism.tensor "
            f"({tensor}){share}: one GPU per rank (set gpus to {tensor}, or tensor to the "
            "GPUs one replica spans)"
        )

    @property
    def speculating(self) -> bool:
        return self.speculative is not None

    @property
    def most_replicas(self) -> int:
        """The most replicas this spec runs at once, a rolling update's surge aside."""
        if self.autoscaling is None:
            return self.replicas
        return max(self.autoscaling.max_replicas, self.replicas)

    @property
    def served_model_name(self) -> str:
        return self.model.name or Path(self.model.path).name

    def config_hash(self) -> str:
        """Hash of everything an engine replica is built from, `parallelism` included (not
        `replicas`, not the gateway's `routing`, `autoscaling`, `toolCalls`, `auth`,
        `gateway` and `reasoning`)."""
        gateway_only = {"routing", "autoscaling", "tool_calls", "auth", "gateway", "reasoning"}
        # the default parallelism is left out, so adding the field rolled no replica
        unset = {"parallelism"} if self.parallelism == ParallelismSpec() else set()
        exclude = {"replicas", *gateway_only, *unset}
        body = self.model_dump(mode="json", by_alias=True, exclude=exclude)
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]


class Metadata(SpecModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(min_length=1)
    namespace: str | None = None


class SpecDecodeDeployment(SpecModel):
    api_version: Literal["specd.dev/v1alpha1"] = Field("specd.dev/v1alpha1", alias="apiVersion")
    kind: Literal["SpecDecodeDeployment"] = "SpecDecodeDeployment"
    metadata: Metadata
    spec: DeploymentSpec
    status: dict[str, Any] | None = None


def _field_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for item in loc:
        path += f"[{item}]" if isinstance(item, int) else (f".{item}" if path else str(item))
    return path


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = _field_path(e["loc"])
        msg = e["msg"]
        error = (e.get("ctx") or {}).get("error")
        if isinstance(error, SubfieldError):
            path, msg = f"{path}.{error.subpath}" if path else error.subpath, str(error)
        elif e["type"] == "extra_forbidden":
            msg = "unknown field (remove it or check its spelling)"
        lines.append(f"{path or '<root>'}: {msg}")
    return "invalid SpecDecodeDeployment:\n  " + "\n  ".join(lines)


def parse_deployment(doc: dict[str, Any]) -> SpecDecodeDeployment:
    """Validate a parsed YAML/JSON document into a deployment (raises ConfigError)."""
    if not isinstance(doc, dict):
        raise ConfigError(
            "a SpecDecodeDeployment must be a mapping with apiVersion, kind, metadata, spec"
        )
    try:
        sdd = SpecDecodeDeployment.model_validate(doc)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
    return sdd


def load_deployment(path: str | Path) -> SpecDecodeDeployment:
    """Load a `SpecDecodeDeployment` YAML file; relative model paths resolve against it."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    sdd = parse_deployment(doc)
    return resolve_paths(sdd, path.parent)


def resolve_paths(sdd: SpecDecodeDeployment, base: Path) -> SpecDecodeDeployment:
    """Make model/tokenizer/draft/token-map paths absolute, relative to `base`."""

    def absolute(p: str | None) -> str | None:
        if p is None or Path(p).is_absolute():
            return p
        return str((base / p).resolve())

    spec = sdd.spec
    model = spec.model.model_copy(
        update={"path": absolute(spec.model.path), "tokenizer": absolute(spec.model.tokenizer)}
    )
    update: dict[str, Any] = {"model": model}
    if spec.draft is not None:
        update["draft"] = spec.draft.model_copy(
            update={"path": absolute(spec.draft.path), "token_map": absolute(spec.draft.token_map)}
        )
    return sdd.model_copy(update={"spec": spec.model_copy(update=update)})


def spec_for_model(model_path: str, name: str = "local", **spec: Any) -> DeploymentSpec:
    """A validated spec serving ``model_path`` (camelCase ``spec`` fields override).

    Used by ``specd generate`` and tests, which have a model folder but no YAML file.
    """
    spec = {**spec, "model": {"path": model_path, **spec.get("model", {})}}
    doc = {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": {"name": name},
        "spec": spec,
    }
    return parse_deployment(doc).spec
