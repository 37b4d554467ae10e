"""API keys (`api_keys.ApiKeys`): where they come from, live rotation through the key
file, failing closed; and `specd serve` refusing to serve a spec that asks for keys
without any."""

from __future__ import annotations

import hashlib
import os

import pytest

from specd.workers.cli import EXIT_INVALID, main
from specd.workers.gateway.api_keys import ApiKeys, key_id, needs_key


def bearer(key: str) -> str:
    return f"Bearer {key}"


def test_keys_come_from_the_environment_comma_separated():
    keys = ApiKeys.from_env({"SPECD_API_KEY": " k1 ,k2,, "})
    assert keys.enabled and keys.current() == ("k1", "k2")
    assert keys.allows(bearer("k1")) and keys.allows("bearer k2")
    for refused in ("", "Bearer", "Bearer ", "Basic k1", bearer("k3"), "k1", bearer("k1k2")):
        assert not keys.allows(refused), refused
    assert not ApiKeys.from_env({}).enabled


def test_the_key_file_is_read_again_when_it_changes(tmp_path):
    path = tmp_path / "api-keys"
    path.write_text("old\n")
    keys = ApiKeys.from_env({"SPECD_API_KEY_FILE": str(path)})
    assert keys.allows(bearer("old")) and not keys.allows(bearer("new"))
    path.write_text("old\nnew\n")  # rotation: the new key joins ...
    assert keys.allows(bearer("old")) and keys.allows(bearer("new"))
    path.write_text("new\n")  # ... then the old one goes
    os.utime(path, ns=(1, 1))  # a change even within the clock's resolution
    assert not keys.allows(bearer("old")) and keys.allows(bearer("new"))


def test_an_unreadable_file_keeps_its_last_keys_and_an_empty_one_refuses_all(tmp_path):
    path = tmp_path / "api-keys"
    path.write_text("k\n")
    keys = ApiKeys(path=str(path))
    assert keys.allows(bearer("k"))
    path.unlink()
    assert keys.allows(bearer("k"))  # e.g. mid-update of a mounted Secret
    path.write_text("\n  \n")
    assert not keys.allows(bearer("k")) and keys.current() == ()
    never = ApiKeys(path=str(tmp_path / "missing"))
    assert never.enabled and not never.allows(bearer("")) and not never.allows(bearer("k"))


def test_only_the_openai_paths_need_a_key():
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/sessions/x.y",
                 "/v1/unknown", "/tokenize", "/detokenize"):  # fmt: skip
        assert needs_key(path), path
    for path in ("/health", "/version", "/metrics", "/admin/status", "/admin/release"):
        assert not needs_key(path), path


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_a_spec_asking_for_keys_is_not_served_without_any(tmp_path, capsys, monkeypatch, command):
    monkeypatch.delenv("SPECD_API_KEY", raising=False)
    monkeypatch.delenv("SPECD_API_KEY_FILE", raising=False)
    f = tmp_path / "spec.yaml"
    f.write_text(
        "apiVersion: specd.dev/v1alpha1\nkind: SpecDecodeDeployment\nmetadata: {name: s}\n"
        "spec: {model: {path: m}, auth: {apiKeySecret: {name: llm-keys}}}\n"
    )
    argv = ["serve", str(f)] if command == "serve" else ["gateway", "--config", str(f)]
    assert main(argv) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "spec.auth.apiKeySecret" in err and "SPECD_API_KEY" in err


BLANK_KEYS = {
    "blank": ({"SPECD_API_KEY": " "}, None, "SPECD_API_KEY"),
    "only commas": ({"SPECD_API_KEY": " , ,"}, None, "SPECD_API_KEY"),
    "empty": ({"SPECD_API_KEY": ""}, None, "SPECD_API_KEY"),
    "file of blank lines": ({}, "\n  \n\n", "SPECD_API_KEY_FILE"),
    "blank file setting": ({"SPECD_API_KEY_FILE": " "}, None, "SPECD_API_KEY_FILE"),
}


@pytest.mark.parametrize(("env", "file_text", "setting"), BLANK_KEYS.values(), ids=BLANK_KEYS)
@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_a_key_setting_holding_no_key_is_refused_naming_it(
    tmp_path, capsys, monkeypatch, command, env, file_text, setting
):
    """Fail closed: a key list that is blank or only blanks would turn authentication off
    without a word; `specd serve` / `specd gateway` exit 2 naming the setting instead."""
    for name in ("SPECD_API_KEY", "SPECD_API_KEY_FILE", "SPECD_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPECD_ADMIN_TOKEN_FILE", str(tmp_path / "admin-token"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if file_text is not None:
        (tmp_path / "keys").write_text(file_text)
        monkeypatch.setenv("SPECD_API_KEY_FILE", str(tmp_path / "keys"))
    keys = ApiKeys.from_env()
    assert setting in " ".join(keys.blank_settings())
    f = tmp_path / "spec.yaml"
    f.write_text(
        "apiVersion: specd.dev/v1alpha1\nkind: SpecDecodeDeployment\nmetadata: {name: s}\n"
        "spec: {model: {path: m}}\n"
    )
    argv = ["serve", str(f)] if command == "serve" else ["gateway", "--config", str(f)]
    assert main(argv) == EXIT_INVALID
    err = capsys.readouterr().err
    assert setting in err and "holding no API key" in err
    assert not (tmp_path / "admin-token").exists()  # refused before anything starts


def test_keys_given_are_not_blank_and_none_given_is_no_auth(tmp_path):
    path = tmp_path / "keys"
    path.write_text("\nk\n")
    env = {"SPECD_API_KEY": "a, b", "SPECD_API_KEY_FILE": str(path)}
    assert ApiKeys.from_env(env).blank_settings() == []
    assert ApiKeys.from_env({}).blank_settings() == [] and not ApiKeys.from_env({}).enabled
    missing = ApiKeys.from_env({"SPECD_API_KEY_FILE": str(tmp_path / "later")})
    assert missing.blank_settings() == [] and missing.enabled  # refuses all until it appears


def test_a_key_is_known_by_its_hash_only():
    assert key_id("k1") == hashlib.sha256(b"k1").hexdigest() != key_id("k2")
