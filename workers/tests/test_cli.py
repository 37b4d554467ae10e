"""`specd generate` and `specd validate` as a user runs them (in-process `main`), and
`specd serve`'s admin token (docs/security.md)."""

import json
import stat

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specd.devtools.testing import DEMO_MODELS
from specd.workers.cli import EXIT_FAILED, EXIT_INVALID, admin_token_note, main
from specd.workers.config import ConfigError
from specd.workers.gateway.admin_auth import load_admin_token


def test_generate_prints_transformers_greedy_text(tiny_models, capsys):
    path = tiny_models("gqa")
    assert main(["generate", "--model", path, "--max-tokens", "8", "--device", "cpu", "Hello"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok("Hello")["input_ids"]])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
    assert printed == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_generate_holds_the_output_to_a_regex_or_a_schema(tiny_models, capsys, tmp_path):
    base = ["generate", "--model", tiny_models("gqa"), "--max-tokens", "48", "--device", "cpu"]
    assert main([*base, "--regex", "(yes|no)!", "Hello"]) == 0
    assert capsys.readouterr().out.rstrip("\n") in ("yes!", "no!")
    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps(
            {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        )
    )
    assert main([*base, "--json-schema", str(schema), "Hello"]) == 0
    assert set(json.loads(capsys.readouterr().out)) == {"ok"}
    assert main([*base, "--regex", "(a", "Hello"]) == EXIT_FAILED
    assert "--regex: Regex parsing error" in capsys.readouterr().err


def test_validate_accepts_a_good_file_and_names_the_bad_field(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(
        "apiVersion: specd.dev/v1alpha1\nkind: SpecDecodeDeployment\nmetadata: {name: g}\n"
        "spec: {model: {path: m}, replicas: 2}\n"
    )
    assert main(["validate", "--schema-only", str(good)]) == 0  # no folder m here
    assert "g serves m (2 replicas" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("replicas: 2", "replicas: 2, maxRunningRequest: 3"))
    assert main(["validate", str(bad)]) == EXIT_INVALID
    assert "spec.maxRunningRequest: unknown field" in capsys.readouterr().err


@pytest.mark.parametrize("example", ["demo", "ngram", "suffix", "hybrid"])
def test_the_demo_examples_pass_validation_with_every_drafter(example, capsys):
    """The preflight loads what each would serve: NGRAM and SUFFIX have no draft folder."""
    assert main(["validate", str(DEMO_MODELS.parent / f"{example}.yaml")]) == 0
    assert "demo" in capsys.readouterr().out


def test_draft_without_speculative_is_refused(tmp_path, capsys):
    f = tmp_path / "spec.yaml"
    f.write_text(
        "apiVersion: specd.dev/v1alpha1\nkind: SpecDecodeDeployment\nmetadata: {name: s}\n"
        "spec: {model: {path: m}, draft: {path: d}}\n"
    )
    assert main(["validate", str(f)]) == EXIT_INVALID
    assert "spec.draft needs spec.speculative" in capsys.readouterr().err


def test_validate_names_a_bad_tensor_size_and_gpus_that_do_not_match_it(tmp_path, capsys):
    f = tmp_path / "spec.yaml"
    head = "apiVersion: specd.dev/v1alpha1\nkind: SpecDecodeDeployment\nmetadata: {name: s}\n"
    f.write_text(head + "spec: {model: {path: m}, parallelism: {tensor: 3}}\n")
    assert main(["validate", "--schema-only", str(f)]) == EXIT_INVALID
    assert "spec.parallelism.tensor: Input should be 1, 2, 4 or 8" in capsys.readouterr().err
    f.write_text(
        head + "spec: {model: {path: m}, parallelism: {tensor: 4}, resources: {gpus: 1}}\n"
    )
    assert main(["validate", "--schema-only", str(f)]) == EXIT_INVALID
    assert "must be 0 or equal to spec.parallelism.tensor (4)" in capsys.readouterr().err


def test_serve_makes_an_admin_token_file_only_its_user_reads(tmp_path):
    """Without SPECD_ADMIN_TOKEN, `specd serve` writes a random admin token to a 0600 file
    (by default under $XDG_STATE_HOME/specd, in a 0700 folder) and reuses it next time;
    SPECD_ADMIN_TOKEN_FILE moves it; a token set but blank is refused (exit 2)."""
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    first = load_admin_token(env)
    path = tmp_path / "state" / "specd" / "admin-token"
    assert (first.path, first.generated) == (path, True) and len(first.value) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    again = load_admin_token(env)
    assert (again.value, again.generated) == (first.value, False)
    assert str(path) in admin_token_note(first) and first.value not in admin_token_note(first)
    moved = load_admin_token({**env, "SPECD_ADMIN_TOKEN_FILE": str(tmp_path / "t")})
    assert moved.path == tmp_path / "t" and moved.value != first.value
    given = load_admin_token({**env, "SPECD_ADMIN_TOKEN": " s3cret "})
    assert (given.value, given.path) == ("s3cret", None)
    (tmp_path / "empty").write_text("\n")
    for blank, setting in [
        ({"SPECD_ADMIN_TOKEN": " "}, "SPECD_ADMIN_TOKEN"),
        ({"SPECD_ADMIN_TOKEN_FILE": ""}, "SPECD_ADMIN_TOKEN_FILE"),
        ({"SPECD_ADMIN_TOKEN_FILE": str(tmp_path / "empty")}, "is blank"),
    ]:
        with pytest.raises(ConfigError, match=setting):
            load_admin_token({**env, **blank})


def test_serve_refuses_a_blank_admin_token(tmp_path, monkeypatch, capsys):
    for name in ("SPECD_API_KEY", "SPECD_API_KEY_FILE", "SPECD_ADMIN_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPECD_ADMIN_TOKEN", "")
    f = tmp_path / "spec.yaml"
    f.write_text(
        "apiVersion: specd.dev/v1alpha1\nkind: SpecDecodeDeployment\nmetadata: {name: s}\n"
        "spec: {model: {path: m}}\n"
    )
    assert main(["serve", str(f)]) == EXIT_INVALID
    assert "SPECD_ADMIN_TOKEN is set but blank" in capsys.readouterr().err


def test_serve_warns_of_bench_knobs_and_refuses_malformed_ones(tmp_path, monkeypatch, capsys):
    """SPECD_BENCH_KNOBS is benchmark-only: `specd serve` says so when it is set, skips
    the weight-file check only for dummy weights, and refuses a malformed one (exit 2)."""
    for name in ("SPECD_API_KEY", "SPECD_API_KEY_FILE", "SPECD_ADMIN_TOKEN_FILE", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPECD_ADMIN_TOKEN", "s3cret")
    f = tmp_path / "spec.yaml"
    f.write_text(
        "apiVersion: specd.dev/v1alpha1\nkind: SpecDecodeDeployment\nmetadata: {name: s}\n"
        f"spec: {{model: {{path: {tmp_path / 'missing'}}}}}\n"
    )
    monkeypatch.setenv("SPECD_BENCH_KNOBS", '{"force_accept_len": 2}')
    assert main(["serve", str(f)]) == EXIT_INVALID  # the folder is still checked
    err = capsys.readouterr().err
    assert "warning: SPECD_BENCH_KNOBS is set" in err and "force_accept_len=2.0" in err
    assert "spec.model.path" in err
    monkeypatch.setenv("SPECD_BENCH_KNOBS", "nope")
    assert main(["serve", str(f)]) == EXIT_INVALID
    assert "SPECD_BENCH_KNOBS is not JSON" in capsys.readouterr().err
