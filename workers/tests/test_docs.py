"""The README and docs/: short README, links that resolve, the generated spec reference.

Fast and offline: no Ray, no model, no network (external links are not fetched).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from specd.devtools import spec_reference

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (fenced lines become blank)."""
    out, fence = [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line)
    return out


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline markup dropped, lowercase, punctuation other
    than '-' and '_' removed, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose_lines(path.read_text()):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(paths: Iterable[Path]) -> list[str]:
    """Relative Markdown links in ``paths`` that reach no file, or no heading of the
    ``.md`` file they point into; ``"file:line: target (why)"`` each."""
    problems = []
    for path in paths:
        lines = _prose_lines(path.read_text())
        text = re.sub(r"<!--.*?-->", "", "\n".join(lines), flags=re.S)
        text = _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
        for m in _LINK.finditer(text):
            target = m.group(1)
            if _EXTERNAL.match(target):
                continue
            where = f"{path}:{text.count(chr(10), 0, m.start()) + 1}: {target}"
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where} (no heading with anchor #{anchor})")
    return problems


def _doc_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    kind = ROOT / "e2e" / "kind" / "README.md"
    return [*files, kind] if kind.exists() else files


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail to docs/"
    )


def test_every_relative_link_resolves():
    problems = broken_links(_doc_files())
    assert not problems, "broken links:\n  " + "\n  ".join(problems)


def test_spec_reference_matches_the_models():
    committed = (ROOT / "docs" / "spec-reference.md").read_text()
    assert committed == spec_reference.render(), (
        "docs/spec-reference.md is out of date with specd.workers.config; regenerate it: "
        f"{spec_reference.REGENERATE}"
    )


def test_link_checker_reports_broken_links(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Its `code` section, too\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Local part\n\n"
        "[ok](other.md) [ok anchor](other.md#its-code-section-too) [self](#local-part)\n"
        "[external](https://example.invalid/missing.md) `[in code](missing-in-code.md)`\n"
        "[missing file](missing.md)\n"
        "[missing anchor](other.md#no-such-heading)\n"
        "![missing image](img/none.png) [missing self anchor](#nowhere)\n"
        "```\n[in a fence](fenced-missing.md)\n```\n"
    )
    problems = broken_links([page])
    assert [p.split(": ", 1)[1] for p in problems] == [
        "missing.md (no such file)",
        "other.md#no-such-heading (no heading with anchor #no-such-heading)",
        "img/none.png (no such file)",
        "#nowhere (no heading with anchor #nowhere)",
    ]
    assert problems[0].startswith(f"{page}:7:")


def test_github_slugs():
    assert github_slug("Metrics (per replica, prefix `specd_`)") == (
        "metrics-per-replica-prefix-specd_"
    )
    assert github_slug("GPU: bench_gpu.py") == "gpu-bench_gpupy"
    assert github_slug("Attention backends, kernels and CUDA graphs") == (
        "attention-backends-kernels-and-cuda-graphs"
    )
