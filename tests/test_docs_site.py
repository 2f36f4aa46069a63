"""The documentation site (mkdocs.yml, `make docs`): it builds with ``--strict``, with the pages and the API reference
in it, and ``--strict`` fails on a broken link, a missing anchor, a link to a file the repository lacks or a page left
out of the nav (scripts/mkdocs_hooks.py turns links out of docs/ into links into the repository)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
HOOKS = REPO / "scripts" / "mkdocs_hooks.py"


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def repo_url() -> str:
    text = (REPO / "mkdocs.yml").read_text()
    return next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("repo_url:"))


@pytest.mark.slow
def test_the_site_builds_strictly_with_its_pages_and_api_reference(tmp_path):
    site = tmp_path / "site"
    built = mkdocs_build(REPO / "mkdocs.yml", site)
    assert built.returncode == 0, built.stderr[-4000:]
    for page in ("index.html", "api/index.html", "config_reference/index.html", "objectives/grpo/index.html", "results/index.html"):
        assert (site / page).is_file(), page
    api = (site / "api" / "index.html").read_text()
    for name in ("flowrl.trainer.Trainer", "flowrl.config.load_config", "flowrl.register_reward", "flowrl.sections.ObjectiveSection"):
        assert f'id="{name}"' in api, name
    assert ":class:" not in api  # docstrings' Sphinx roles are dropped, their code spans kept
    assert "train.iterations" in (site / "config_reference" / "index.html").read_text()


# -- the strict build's link checks, on a two-page site built with the repository's settings and hook -------------


def small_site(tmp_path: Path, index: str, extra_page: bool = False) -> Path:
    """A site inheriting mkdocs.yml (theme, validation, markdown, hook) with docs/index.md = ``index`` and docs/other.md;
    the folder holds configs/a.yaml and pkg/ as "the repository" links out of docs/ point into."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(f"# Home\n\n{index}\n")
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A section\n\nText.\n")
    if extra_page:
        (tmp_path / "docs" / "orphan.md").write_text("# Not in the nav\n")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "a.yaml").write_text("seed: 0\n")
    (tmp_path / "pkg").mkdir()
    config = {
        "INHERIT": str(REPO / "mkdocs.yml"),
        "docs_dir": "docs",
        "hooks": [str(HOOKS)],
        "plugins": ["search"],  # no API reference on this site: mkdocstrings is not needed
        "nav": ["index.md", "other.md"],
    }
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    return tmp_path / "mkdocs.yml"


def test_links_within_docs_and_out_to_the_repository_build(tmp_path):
    index = "[other](other.md#a-section), [config](../configs/a.yaml#L1), [folder](../pkg/), [back in](../docs/other.md)"
    built = mkdocs_build(small_site(tmp_path, index), tmp_path / "site")
    assert built.returncode == 0, built.stderr
    html = (tmp_path / "site" / "index.html").read_text()
    base = repo_url()
    assert 'href="other/#a-section"' in html
    assert f'href="{base}/blob/main/configs/a.yaml#L1"' in html
    assert f'href="{base}/tree/main/pkg"' in html
    assert re.search(r'href="other/"[^>]*>back in<', html)  # ../docs/other.md written from docs/ is the page other.md


@pytest.mark.parametrize(
    ("index", "extra_page", "message"),
    [
        ("[missing](missing.md)", False, "'missing.md', but the target is not found"),
        ("[anchor](other.md#no-such-section)", False, "does not contain an anchor '#no-such-section'"),
        ("[here](#nowhere)", False, "there is no such anchor on this page"),
        ("[file](../configs/missing.yaml)", False, "points to 'configs/missing.yaml', which is not in the repository"),
        ("[outside](../../elsewhere.md)", False, "points outside the repository"),
        ("no links", True, "orphan.md"),
    ],
    ids=["missing-page", "missing-anchor", "missing-own-anchor", "missing-repository-file", "outside-repository", "page-not-in-nav"],
)
def test_the_strict_build_fails_on(tmp_path, index, extra_page, message):
    built = mkdocs_build(small_site(tmp_path, index, extra_page), tmp_path / "site")
    assert built.returncode != 0
    output = built.stdout + built.stderr
    assert "Aborted with" in output and message in output, output


def test_the_hook_leaves_code_and_urls_alone(tmp_path):
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", HOOKS)
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (tmp_path / "README.md").write_text("# r\n")
    args = (docs / "sub", docs, tmp_path, "https://example.org/r", "main")
    assert hooks.repo_link("https://x.org/a.md", *args) == ("https://x.org/a.md", None)
    assert hooks.repo_link("#a", *args) == ("#a", None)
    assert hooks.repo_link("../other.md#b", *args) == ("../other.md#b", None)
    assert hooks.repo_link("../../README.md#c", *args) == ("https://example.org/r/blob/main/README.md#c", None)

    class Page:
        class file:
            abs_src_path = str(docs / "sub" / "p.md")
            src_uri = "sub/p.md"

    config = {"docs_dir": str(docs), "config_file_path": str(tmp_path / "mkdocs.yml"), "repo_url": "https://example.org/r", "extra": {}}
    markdown = '`[a](../../README.md)` [b](../../README.md)\n```\n[c](../../README.md)\n```\n[d](<../../README.md> "t")'
    out = hooks.on_page_markdown(markdown, Page, config, None)
    readme = "https://example.org/r/blob/main/README.md"
    assert out == f'`[a](../../README.md)` [b]({readme})\n```\n[c](../../README.md)\n```\n[d]({readme} "t")'
