"""The SpecDecodeDeployment reference page, generated from the pydantic config models.

One source of truth, as for the CRD (`specd crd`): every field of `SpecDecodeDeployment`
and the models below it in `specd.workers.config`, one table per model, with the YAML
(camelCase) name, the type and its bounds, the default and the description.
``docs/spec-reference.md`` is `render()`'s output; ``workers/tests/test_docs.py`` keeps
them identical.

    python -m specd.devtools.spec_reference > docs/spec-reference.md
    python -m specd.devtools.spec_reference --write
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import types
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, WithJsonSchema
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from specd.workers import config
from specd.workers.config import SpecDecodeDeployment

REGENERATE = "python -m specd.devtools.spec_reference --write"
DEFAULT_OUT = Path(__file__).resolve().parents[3] / "docs" / "spec-reference.md"

# Descriptions for fields whose `Field` has none (the schema's own descriptions win).
# Taken from the comments of the README's annotated example; better moved into
# `Field(description=...)` in specd.workers.config when it is next edited.
_NOTES: dict[tuple[type[BaseModel], str], str] = {
    (config.SpecDecodeDeployment, "api_version"): "The API group and version",
    (config.SpecDecodeDeployment, "status"): "Written by the operator, never by you",
    (config.Metadata, "name"): "The deployment's name (model id default, child names, actor names)",
    (config.Metadata, "namespace"): "Kubernetes namespace; also picks the Ray namespace "
    "`specd-<namespace>` (`specd` when unset)",
    (config.DeploymentSpec, "model"): "The target model",
    (config.DeploymentSpec, "draft"): "The draft model; set it (and `speculative`) for "
    "speculative decoding",
    (config.DeploymentSpec, "speculative"): "Draft steps, branching and verified tokens; "
    "`speculative: {}` takes the defaults",
    (config.DeploymentSpec, "kv_cache"): "The paged KV cache",
    (config.DeploymentSpec, "attention_backend"): "auto: on CPU `cpu` (a C kernel built "
    "on first use; needs a C compiler) for float32 and bfloat16, else torch; on CUDA the "
    "first of flashinfer, triton, torch that is installed and runs the model's dtype and "
    "head size",
    (config.DeploymentSpec, "cuda_graph"): "CUDA graph capture (CUDA backends)",
    (config.DeploymentSpec, "replicas"): "Engine actors; with `autoscaling`, the count "
    "it starts from (`kubectl scale` sets it)",
    (config.DeploymentSpec, "resources"): "Per engine actor (Ray resources)",
    (config.DeploymentSpec, "max_running_requests"): "Requests running at once per replica",
    (config.DeploymentSpec, "scheduler"): "Chunked prefill, overlap scheduling, policy",
    (config.DeploymentSpec, "ray"): "Where the actors run: an existing Ray cluster, or "
    "overrides for the RayCluster the operator manages",
    (config.DeploymentSpec, "sessions"): "Streaming sessions (`/v1/sessions`)",
    (config.DeploymentSpec, "debug"): "Debugging switches",
    (config.ModelSpec, "dtype"): "auto: the checkpoint's `torch_dtype` (float32 when "
    "config.json names none)",
    (config.DraftSpec, "path"): "Local folder of an EAGLE / EAGLE-3 head in the published "
    "layout; relative paths resolve against the YAML file",
    (config.DraftSpec, "algorithm"): "EAGLE (EAGLE-1 layout) or EAGLE3",
    (config.AdaptiveSpec, "enabled"): "Move along `candidateSteps` by acceptance rate",
    (config.CandidateRung, "topk"): "Default: `speculative.topk`",
    (config.CandidateRung, "num_draft_tokens"): "Default: steps + 1 for a chain, else "
    "min(`speculative.numDraftTokens`, topk * steps + 1)",
    (config.KVCacheSpec, "page_size"): "Tokens per KV page",
    (config.ResourcesSpec, "gpus"): "GPUs per replica (Ray `num_gpus`; worker pods get the "
    "ceiling): 0 on CPU, else `parallelism.tensor` (one per rank), or below 1 at tensor 1 "
    "to share a GPU",
    (config.ResourcesSpec, "cpu"): "CPUs per actor (Ray `num_cpus`)",
    (config.ResourcesSpec, "memory"): "Memory limit of a Ray worker pod (a Kubernetes quantity)",
    (config.RaySpec, "address"): "An existing Ray cluster (the operator creates no "
    "RayCluster; the deployment's actors are released on delete)",
    (config.SamplingDefaultsSpec, "top_p"): "Overrides the model's",
    (config.DebugSpec, "strict_mem_check"): "1 or 2: a KV leak check after every step, "
    "failing loudly (also `SPECD_STRICT_MEM_CHECK=1`)",
}

_EXCLUDED_NOTE = "Operator only: not part of the engine config or its hash."


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading (lowercase, spaces to '-', punctuation
    other than '-' and '_' dropped)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _models() -> list[tuple[str, type[BaseModel]]]:
    """Every model below SpecDecodeDeployment with its YAML path, depth first in field
    order (each model once)."""
    out: list[tuple[str, type[BaseModel]]] = []
    seen: set[type[BaseModel]] = set()

    def visit(path: str, model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        out.append((path, model))
        for name, field in model.model_fields.items():
            alias = field.alias or name
            child = f"{path}.{alias}" if path else alias
            for sub, suffix in _submodels(field.annotation):
                visit(child + suffix, sub)

    visit("", SpecDecodeDeployment)
    return out


def _submodels(annotation: Any) -> list[tuple[type[BaseModel], str]]:
    """The models an annotation holds, with ``[]`` for list items."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [(annotation, "")]
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is Annotated:
        return _submodels(args[0])
    if origin is list:
        return [(m, suffix + "[]") for m, suffix in _submodels(args[0])]
    if origin in (Union, types.UnionType):
        return [found for arg in args for found in _submodels(arg)]
    return []


def _heading(path: str, model: type[BaseModel]) -> str:
    return path or model.__name__


def _anchor(model: type[BaseModel]) -> str:
    for path, found in _models():
        if found is model:
            return "#" + slug(_heading(path, found))
    raise KeyError(model.__name__)


def _code(value: Any) -> str:
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, Enum):
        value = value.value
    return f"`{value}`"


def _type(annotation: Any) -> str:
    """A field's type in words, models linked to their table."""
    if annotation is type(None):
        return "null"
    if inspect.isclass(annotation):
        if issubclass(annotation, BaseModel):
            return f"[object]({_anchor(annotation)})"
        if issubclass(annotation, Enum):
            return "one of " + ", ".join(_code(m.value) for m in annotation)
        names = {bool: "boolean", int: "integer", float: "number", str: "string"}
        if annotation in names:
            return names[annotation]
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is Literal:
        return _code(args[0]) if len(args) == 1 else "one of " + ", ".join(map(_code, args))
    if origin in (Union, types.UnionType):
        return " or ".join(_type(a) for a in args if a is not type(None))
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is dict:
        return "object (free-form)"
    if origin is Annotated:
        words = [
            m.json_schema.get("description")
            for m in annotation.__metadata__
            if isinstance(m, WithJsonSchema) and m.json_schema
        ]
        base = _type(args[0])
        return f"{words[0]} ({base})" if words and words[0] else base
    return f"`{annotation}`"


def _bounds(field: FieldInfo) -> list[str]:
    out = []
    for item in field.metadata:
        if isinstance(item, annotated_types.Ge):
            out.append(f">= {item.ge}")
        elif isinstance(item, annotated_types.Gt):
            out.append(f"> {item.gt}")
        elif isinstance(item, annotated_types.Le):
            out.append(f"<= {item.le}")
        elif isinstance(item, annotated_types.Lt):
            out.append(f"< {item.lt}")
        elif isinstance(item, annotated_types.MinLen):
            out.append("not empty" if item.min_length == 1 else f"length >= {item.min_length}")
        elif getattr(item, "pattern", None):
            out.append(f"matches `{item.pattern}`")
    return out


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        made = field.default_factory()
        if isinstance(made, BaseModel):
            return "its defaults"
        return _code("[]" if made == [] else made)
    if field.default is PydanticUndefined:
        return "**required**"
    if field.default is None:
        return "unset"
    return _code(field.default)


def _describe(model: type[BaseModel], name: str, field: FieldInfo) -> str:
    text = field.description or _NOTES.get((model, name), "")
    if not text:
        subs = _submodels(field.annotation)
        doc = subs[0][0].__dict__.get("__doc__") if subs else None
        if doc:
            text = _first_sentence(doc)
    if text.endswith(".") and not text.endswith("..."):
        text = text[:-1]
    if field.exclude:
        text = f"{text}. {_EXCLUDED_NOTE}" if text else _EXCLUDED_NOTE
    return text


def _prose(doc: str) -> str:
    """A docstring as one Markdown paragraph (reST ``code`` -> `code`)."""
    return " ".join(inspect.cleandoc(doc).split()).replace("``", "`")


def _first_sentence(doc: str) -> str:
    text = _prose(doc)
    end = text.find(". ")
    return text if end < 0 else text[:end]


def _cell(text: str) -> str:
    """Table-cell text: pipes escaped, and outside code spans a `<` that would open an
    HTML tag (GitHub would swallow `<think>`)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"<(?=[A-Za-z/!?])", "&lt;", parts[i])
    return "`".join(parts).replace("|", "\\|")


def _table(path: str, model: type[BaseModel]) -> list[str]:
    lines = [f"## {_heading(path, model)}", ""]
    intro = f"Model `{model.__name__}`."
    doc = model.__dict__.get("__doc__")  # its own docstring, never a base class's
    if doc:
        intro += " " + _prose(doc)
    lines += [intro, "", "| field | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        kind = ", ".join([_type(field.annotation), *_bounds(field)])
        row = [f"`{field.alias or name}`", kind, _default(field), _describe(model, name, field)]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    if model.model_config.get("extra") == "allow":
        lines += ["", "Other fields (labels, annotations, ...) are kept as they are."]
    return [*lines, ""]


def render() -> str:
    """The whole page (Markdown)."""
    lines = [
        "<!-- Generated from specd.workers.config; do not edit by hand. -->",
        f"<!-- Regenerate: {REGENERATE} -->",
        "",
        "# SpecDecodeDeployment reference",
        "",
        f"Every field of a `{config.KIND}` (`apiVersion: {config.API_GROUP}/"
        f"{config.API_VERSION}`, short name `sdd`), generated from the pydantic models in "
        "`specd.workers.config`, the models the CRD (`specd crd`) is generated from. "
        "Names are the YAML (camelCase) ones. Unknown fields and bad values are refused "
        "with the field's path (`spec.kvCache.pageSize: Input should be greater than or "
        "equal to 1`). A guide with examples, and the rules that tie fields together: "
        "[deployment.md](deployment.md).",
        "",
        "Gateway-only settings (`routing`, `autoscaling`, `toolCalls`, `auth`, `gateway`, "
        "`reasoning`) and `replicas` are outside the config hash: changing them rolls no "
        "replica. Operator-only fields are marked.",
        "",
    ]
    for path, model in _models():
        lines += _table(path, model)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specd.devtools.spec_reference", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--write",
        nargs="?",
        const=DEFAULT_OUT,
        type=Path,
        metavar="PATH",
        help=f"write the page to PATH (default {DEFAULT_OUT}) instead of stdout",
    )
    args = parser.parse_args(argv)
    text = render()
    if args.write is None:
        sys.stdout.write(text)
    else:
        args.write.write_text(text)
        print(f"wrote {args.write}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
