"""The Qwen3 examples run for real: ``examples/qwen3-agent.yaml`` (Qwen3 dense) and
``examples/qwen3-moe.yaml`` (Qwen3-MoE), each with an EAGLE-3 head, served by
``specd serve`` as a user runs it and called with the official ``openai`` client.

Only what ties a file to a GPU cluster changes: the model folders become tiny offline
checkpoints of the same architectures (and a tiny EAGLE-3 head in the published
layout), the KV pool gets a token count instead of a GPU memory share, the attention
backend is torch, the API key comes from ``SPECD_API_KEY`` (``specd serve``'s form of
the Secret) and scale-to-zero keeps one replica so the served answer can be checked.
The answer must be transformers' greedy text for the same prompt ids."""

from __future__ import annotations

import signal
from pathlib import Path

import openai
import pytest
import yaml
from transformers import AutoTokenizer

from specd.devtools.testing import hf_greedy, random_prompts, specd_serve
from specd.devtools.tiny_draft import make_tiny_eagle3

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = {"qwen3-agent.yaml": "qwen3", "qwen3-moe.yaml": "qwen3-moe"}
MAX_NEW = 12
API_KEY = "test-key-0123456789"


def _local_copy(example: str, target: str, draft: str, out: Path) -> Path:
    """The example with its cluster-only settings swapped for local ones (module docstring)."""
    doc = yaml.safe_load((REPO / "examples" / example).read_text())
    spec = doc["spec"]
    spec["model"].update(path=target, dtype="float32")
    spec["draft"]["path"] = draft
    spec["kvCache"] = {"pageSize": spec["kvCache"].get("pageSize", 1), "maxTokens": 4096}
    spec["attentionBackend"] = "torch"
    spec["resources"] = {"cpu": 0.5}
    spec["replicas"] = 1
    if "autoscaling" in spec:
        spec["autoscaling"]["minReplicas"] = 1
    spec["samplingDefaults"] = {"temperature": 0}
    path = out / example
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_serves_transformers_greedy_text(example, tiny_models, tmp_path):
    target = tiny_models(EXAMPLES[example])
    draft = str(make_tiny_eagle3(tmp_path / "eagle3", target))
    spec_file = _local_copy(example, target, draft, tmp_path)
    name = yaml.safe_load(spec_file.read_text())["metadata"]["name"]
    served_name = yaml.safe_load(spec_file.read_text())["spec"]["model"]["name"]
    prompts = random_prompts(2, 300, seed=5, lo=8, hi=20)
    tokenizer = AutoTokenizer.from_pretrained(target)
    expected = [
        tokenizer.decode(tokens, skip_special_tokens=True)
        for tokens in hf_greedy(target, prompts, MAX_NEW)
    ]
    with specd_serve(
        spec_file, name, tmp_path / "state", env={"SPECD_API_KEY": API_KEY}, ready_timeout_s=180
    ) as served:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=API_KEY, max_retries=0)
        assert [m.id for m in client.models.list()] == [served_name]
        for prompt, text in zip(prompts, expected, strict=True):
            done = client.completions.create(
                model=served_name,
                prompt=prompt,
                max_tokens=MAX_NEW,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert done.choices[0].text == text
            assert done.usage.completion_tokens == MAX_NEW
        refused = openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            refused.models.list()
        served.proc.send_signal(signal.SIGINT)
        assert served.proc.wait(timeout=60) == 0, served.output
    assert "Traceback" not in served.output, served.output
