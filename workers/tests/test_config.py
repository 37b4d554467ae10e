"""The SpecDecodeDeployment schema: defaults, path resolution, and errors that name the field."""

import pytest

from specd.workers.config import ConfigError, load_deployment, parse_deployment, ray_namespace


def doc(**spec):
    return {
        "apiVersion": "specd.dev/v1alpha1",
        "kind": "SpecDecodeDeployment",
        "metadata": {"name": "t"},
        "spec": {"model": {"path": "m"}, **spec},
    }


def test_defaults():
    spec = parse_deployment(doc()).spec
    assert (spec.replicas, spec.kv_cache.page_size, spec.attention_backend) == (1, 1, "auto")
    assert spec.served_model_name == "m" and spec.draft is None
    assert (spec.parallelism.tensor, spec.parallelism.collective_timeout_seconds) == (1, 120)


@pytest.mark.parametrize(
    ("tensor", "gpus"),
    [
        pytest.param(2, 0, id="cpu-ranks"),
        pytest.param(4, 4, id="one-gpu-per-rank"),
        pytest.param(8, 8.0, id="float-gpus"),
        pytest.param(1, 0.5, id="shared-gpu-at-tensor-1"),
        pytest.param(1, 1, id="one-gpu"),
    ],
)
def test_gpus_are_zero_or_one_per_rank(tensor, gpus):
    spec = parse_deployment(doc(parallelism={"tensor": tensor}, resources={"gpus": gpus})).spec
    assert (spec.parallelism.tensor, spec.resources.gpus) == (tensor, gpus)


@pytest.mark.parametrize(
    "spec,message",
    [
        pytest.param(
            {"kvCache": {"pageSize": 0}},
            "spec.kvCache.pageSize: Input should be greater",
            id="range",
        ),
        pytest.param(
            {"model": {"path": "m", "dtype": "fp8"}},
            "spec.model.dtype: Input should be 'auto'",
            id="enum",
        ),
        pytest.param(
            {"attentionBackend": "cuda"},
            "spec.attentionBackend: Input should be 'auto', 'torch'",
            id="literal",
        ),
        pytest.param(
            {"replicas": "two"}, "spec.replicas: Input should be a valid integer", id="type"
        ),
        pytest.param(
            {"kvCache": {"maxTokens": 8, "memFraction": 0.5}},
            "spec.kvCache: Value error, set only one",
            id="conflict",
        ),
        pytest.param(
            {"scheduler": {"chunkSize": 8}}, "spec.scheduler.chunkSize: unknown field", id="unknown"
        ),
        pytest.param(
            {"routing": {"policy": "random"}},
            "spec.routing.policy: Input should be 'cacheAware' or 'leastLoad'",
            id="routing-policy",
        ),
        pytest.param(
            {"routing": {"balanceRelThreshold": 0.5}},
            "spec.routing.balanceRelThreshold: Input should be greater than or equal to 1",
            id="routing-balance",
        ),
        pytest.param(
            {"toolCalls": {"parser": "mistral"}},
            "spec.toolCalls.parser: Input should be 'hermes' or 'llama3_json'",
            id="tool-calls-parser",
        ),
        pytest.param(
            {"draft": {"path": "d"}, "speculative": {"numSteps": 3, "numDraftTokens": 5}},
            "spec.speculative: Value error, numDraftTokens must be numSteps + 1 = 4",
            id="chain-tokens",
        ),
        pytest.param(
            {
                "draft": {"path": "d"},
                "speculative": {"numSteps": 2, "topk": 4, "numDraftTokens": 10},
            },
            "numDraftTokens must be at most topk * numSteps + 1 = 9",
            id="tree-too-big",
        ),
        pytest.param(
            {"speculative": {"numSteps": 3}},
            "spec.speculative needs spec.draft",
            id="speculative-without-draft",
        ),
        pytest.param(
            {"samplingDefaults": {"temperature": 2.5}},
            "spec.samplingDefaults.temperature: Input should be less than or equal to 2",
            id="sampling-default",
        ),
        pytest.param(
            {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
            "spec.autoscaling: Value error, minReplicas (3) must be at most maxReplicas (2)",
            id="autoscaling-bounds",
        ),
        pytest.param(
            {"autoscaling": {"minReplicas": 1}},
            "spec.autoscaling.maxReplicas: Field required",
            id="autoscaling-max",
        ),
        pytest.param(
            {"autoscaling": {"minReplicas": -1, "maxReplicas": 2}},
            "spec.autoscaling.minReplicas: Input should be greater than or equal to 0",
            id="autoscaling-negative",
        ),
        pytest.param(
            {"autoscaling": {"maxReplicas": 2, "coldStartTimeoutSeconds": 0}},
            "spec.autoscaling.coldStartTimeoutSeconds: Input should be greater than 0",
            id="autoscaling-cold-start",
        ),
        pytest.param(
            {"autoscaling": {"maxReplicas": 2, "targetOngoingRequests": 0}},
            "spec.autoscaling.targetOngoingRequests: Input should be greater than 0",
            id="autoscaling-target",
        ),
        pytest.param(
            {"sessions": {"enabled": True, "maxSessions": 0}},
            "spec.sessions.maxSessions: Input should be greater than or equal to 1",
            id="max-sessions",
        ),
        pytest.param(
            {"parallelism": {"tensor": 3}},
            "spec.parallelism.tensor: Input should be 1, 2, 4 or 8",
            id="tensor-enum",
        ),
        pytest.param(
            {"parallelism": {"tensor": 4}, "resources": {"gpus": 2}},
            "spec: Value error, spec.resources.gpus (2) must be 0 or equal to "
            "spec.parallelism.tensor (4): one GPU per rank (set gpus to 4",
            id="gpus-not-tensor",
        ),
        pytest.param(
            {"resources": {"gpus": 2}},
            "spec.resources.gpus (2) must be 0 or equal to spec.parallelism.tensor (1), or "
            "below 1 to share one GPU",
            id="gpus-over-tensor-1",
        ),
        pytest.param(
            {"parallelism": {"tensor": 2}, "resources": {"gpus": 0.5}},
            "spec.resources.gpus (0.5) must be 0 or equal to spec.parallelism.tensor (2)",
            id="shared-gpu-at-tensor-2",
        ),
        pytest.param(
            {"parallelism": {"collectiveTimeoutSeconds": 0}},
            "spec.parallelism.collectiveTimeoutSeconds: Input should be greater than 0",
            id="collective-timeout",
        ),
        pytest.param(
            {"parallelism": {"collectiveTimeoutSeconds": 1e15}},
            "spec.parallelism.collectiveTimeoutSeconds: Input should be less than or equal to 86400",
            id="collective-timeout-huge",
        ),
    ],
)
def test_errors_name_the_field(spec, message):
    with pytest.raises(ConfigError) as err:
        parse_deployment(doc(**spec))
    assert message in str(err.value)


def speculative(**adaptive):
    return {
        "draft": {"path": "d"},
        "speculative": {"adaptive": {"enabled": True, **adaptive}},
    }


@pytest.mark.parametrize(
    "spec,message",
    [
        pytest.param(
            speculative(),
            "spec.speculative.adaptive.candidateSteps: list at least one step count",
            id="empty",
        ),
        pytest.param(
            speculative(candidateSteps=[1, 5, 3]),
            "spec.speculative.adaptive.candidateSteps[2]: steps 3 is out of order",
            id="unsorted",
        ),
        pytest.param(
            speculative(candidateSteps=[0, 2, 2]),
            "spec.speculative.adaptive.candidateSteps[2]: steps 2 is a duplicate",
            id="duplicate",
        ),
        pytest.param(
            speculative(candidateSteps=[1, {"steps": 3, "numDraftTokens": 5}]),
            "spec.speculative.adaptive.candidateSteps[1]: numDraftTokens must be numSteps + 1 = 4",
            id="rung-chain-tokens",
        ),
        pytest.param(
            speculative(candidateSteps=[{"steps": 2, "topk": 2, "numDraftTokens": 6}]),
            "spec.speculative.adaptive.candidateSteps[0]: numDraftTokens must be at most "
            "topk * numSteps + 1 = 5",
            id="rung-tree-too-big",
        ),
        pytest.param(
            speculative(candidateSteps=[{"steps": 0, "topk": 2}]),
            "spec.speculative.adaptive.candidateSteps[0]: steps 0 is plain decode",
            id="plain-rung-with-topk",
        ),
        pytest.param(
            speculative(candidateSteps=[-1]),
            "spec.speculative.adaptive.candidateSteps[0].steps: Input should be greater",
            id="negative-steps",
        ),
        pytest.param(
            speculative(candidateSteps=[1], upThreshold=0.2, downThreshold=0.5),
            "spec.speculative.adaptive: Value error, downThreshold (0.5) must not exceed",
            id="thresholds",
        ),
        pytest.param(
            speculative(candidateSteps=[1], upHysteresis=0),
            "spec.speculative.adaptive.upHysteresis: Input should be greater than or equal to 1",
            id="hysteresis",
        ),
        pytest.param(
            {"draft": {"path": "d"}, "speculative": {"policy": {"maxBatchForSpec": 0}}},
            "spec.speculative.policy.maxBatchForSpec: Input should be greater",
            id="policy",
        ),
    ],
)
def test_adaptive_errors_name_the_field(spec, message):
    with pytest.raises(ConfigError) as err:
        parse_deployment(doc(**spec))
    assert message in str(err.value)


def test_adaptive_ladder_round_trips_through_a_dump():
    """The engine config (ConfigMap) is a dump of the spec: the ladder survives it."""
    spec = parse_deployment(doc(**speculative(candidateSteps=[0, 2, {"steps": 4, "topk": 2}])))
    dumped = spec.model_dump(mode="json", by_alias=True)
    again = parse_deployment(dumped).spec.speculative
    assert again.ladder == spec.spec.speculative.ladder
    assert [r.steps for r in again.ladder] == [0, 2, 4]
    assert again.max_draft_tokens == 4  # min(numDraftTokens 4, 2 * 4 + 1)


def test_missing_model_is_named():
    with pytest.raises(ConfigError, match=r"spec.model: Field required"):
        parse_deployment({**doc(), "spec": {}})


def test_relative_paths_resolve_against_the_file(tmp_path):
    (tmp_path / "sdd.yaml").write_text(
        "apiVersion: specd.dev/v1alpha1\nkind: SpecDecodeDeployment\nmetadata: {name: x}\n"
        "spec: {model: {path: models/t}}\n"
    )
    assert load_deployment(tmp_path / "sdd.yaml").spec.model.path == str(tmp_path / "models/t")


def test_config_hash_ignores_what_only_the_gateway_reads():
    """None changes what a replica runs: scaling (by hand or autoscaled), re-routing, a
    tool-call or reasoning parser or API keys roll no replica."""
    a = parse_deployment(doc(replicas=1)).spec
    assert a.config_hash() == parse_deployment(doc(replicas=5)).spec.config_hash()
    routed = doc(routing={"policy": "leastLoad", "cacheThreshold": 0.9})
    assert a.config_hash() == parse_deployment(routed).spec.config_hash()
    autoscaled = doc(autoscaling={"maxReplicas": 4, "targetOngoingRequests": 8})
    assert a.config_hash() == parse_deployment(autoscaled).spec.config_hash()
    parsed = doc(toolCalls={"parser": "hermes"})
    assert a.config_hash() == parse_deployment(parsed).spec.config_hash()
    keyed = doc(auth={"apiKeySecret": {"name": "llm-keys"}})
    assert a.config_hash() == parse_deployment(keyed).spec.config_hash()
    reasoned = doc(reasoning={"parser": "qwen3"})
    assert a.config_hash() == parse_deployment(reasoned).spec.config_hash()
    assert a.config_hash() != parse_deployment(doc(maxRunningRequests=3)).spec.config_hash()


def test_config_hash_follows_the_tensor_size():
    """A replica of another tensor size is another replica: the change rolls them all."""
    one = parse_deployment(doc(resources={"gpus": 1})).spec
    four = parse_deployment(doc(parallelism={"tensor": 4}, resources={"gpus": 4})).spec
    cpu_two = parse_deployment(doc(parallelism={"tensor": 2})).spec
    timeout = parse_deployment(doc(parallelism={"collectiveTimeoutSeconds": 30})).spec
    hashes = {s.config_hash() for s in (one, four, cpu_two, timeout, parse_deployment(doc()).spec)}
    assert len(hashes) == 5
    assert "parallelism" in four.model_dump(by_alias=True)  # in the engine config too


@pytest.mark.parametrize(
    ("auth", "message"),
    [
        ({"apiKeySecret": {"name": "Bad_Name"}}, "spec.auth.apiKeySecret.name"),
        ({"apiKeySecret": {"name": "keys", "key": "a/b"}}, "spec.auth.apiKeySecret.key"),
        ({"apiKeySecret": {}}, "spec.auth.apiKeySecret.name"),
    ],
)
def test_a_bad_api_key_secret_is_refused_naming_the_field(auth, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        parse_deployment(doc(auth=auth))


def test_an_unknown_reasoning_parser_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match=r"spec\.reasoning\.parser: .*'deepseek_r1' or 'qwen3'"):
        parse_deployment(doc(reasoning={"parser": "o1"}))


def test_each_kubernetes_namespace_gets_its_own_ray_namespace():
    """Same-named SDDs of two namespaces on one Ray cluster: their actor names may
    collide, their Ray namespaces do not."""
    assert ray_namespace("team-a") != ray_namespace("team-b")
    assert ray_namespace(None) == "specd"  # `specd serve` of a file with no namespace
    assert ray_namespace("team-a") == "specd-team-a"


def test_sampling_defaults_take_the_spec_over_the_model_file():
    model_file = {"temperature": 0.6, "top_p": 0.9, "top_k": 0}  # top_k 0: transformers' off
    defaults = parse_deployment(doc()).spec.sampling_defaults
    assert defaults.resolve(model_file) == {"temperature": 0.6, "top_p": 0.9, "top_k": -1}
    mine = parse_deployment(doc(samplingDefaults={"temperature": 0, "topK": 20})).spec
    assert mine.sampling_defaults.resolve(model_file) == {
        "temperature": 0,
        "top_p": 0.9,
        "top_k": 20,
    }
    ignored = parse_deployment(doc(samplingDefaults={"fromModel": False})).spec
    assert ignored.sampling_defaults.resolve(model_file) == {}


def test_the_model_files_penalty_and_min_p_are_defaults_too():
    model_file = {"temperature": 0.7, "repetition_penalty": 1.05, "min_p": 0.0}
    defaults = parse_deployment(doc()).spec.sampling_defaults
    assert defaults.resolve(model_file) == model_file
    mine = parse_deployment(doc(samplingDefaults={"repetitionPenalty": 1, "minP": 0.05})).spec
    assert mine.sampling_defaults.resolve(model_file) == {
        "temperature": 0.7,
        "repetition_penalty": 1,
        "min_p": 0.05,
    }


@pytest.mark.parametrize(
    "model_file,message",
    [
        ({"temperature": -0.5}, "temperature=-0.5, which must be a number in [0, 2]"),
        ({"top_p": 0}, "top_p=0, which must be a number in (0, 1]"),
        ({"top_k": 2.5}, "top_k=2.5, which must be an integer >= -1"),
        ({"temperature": "0.7"}, "temperature='0.7', which must be a number"),
        ({"repetition_penalty": 0}, "repetition_penalty=0, which must be a number > 0"),
        ({"min_p": 1.2}, "min_p=1.2, which must be a number in [0, 1]"),
    ],
)
def test_an_out_of_range_model_default_is_refused_unless_the_file_is_ignored(model_file, message):
    defaults = parse_deployment(doc()).spec.sampling_defaults
    with pytest.raises(ConfigError, match="spec.samplingDefaults.fromModel: false") as err:
        defaults.resolve(model_file)
    assert message in str(err.value)
    ignored = parse_deployment(doc(samplingDefaults={"fromModel": False})).spec
    assert ignored.sampling_defaults.resolve(model_file) == {}
