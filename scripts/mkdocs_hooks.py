"""MkDocs hook (mkdocs.yml, ``hooks:``): links from docs/ to the rest of the repository.

The pages are written to be read on GitHub as well as on the site, so they link to files outside docs/ by relative
path (``../configs/digits/grpo.yaml``, ``../../bench/RESULTS.md``, ``../README.md``). The site holds only docs/, so
such a link is rewritten to the file in the repository, ``<repo_url>/blob/<extra.repo_branch>/<path>`` (``tree`` for
a folder), after checking that the file exists in this checkout: a link to a missing file is a warning, which fails
``mkdocs build --strict``. A link that leaves docs/ and comes back into it (``../docs/objectives/grpo.md`` written
from docs/) is written as the page-relative link it means, so MkDocs checks it, its anchor included, like any other.
Links inside docs/ are left to MkDocs' own validation (mkdocs.yml, ``validation:``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote

from mkdocs.plugins import get_plugin_logger

log = get_plugin_logger("repo_links")

# An inline code span (left as it is) or the target of an inline link or image: ](target) or ](target "title").
_LINK = re.compile(r"(?P<code>(`+).+?\2)|\]\((?P<target><[^>]*>|[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def repo_link(target: str, page_dir: Path, docs_dir: Path, root: Path, repo: str, branch: str) -> tuple[str, str | None]:
    """``target`` as the site should link it from a page in ``page_dir``, and a warning when it points at nothing."""
    if not target or target.startswith(("#", "/")) or _SCHEME.match(target):
        return target, None  # an anchor on the page, a URL, or an absolute link (which MkDocs' validation reports)
    path, hash_, fragment = target.partition("#")
    resolved = Path(os.path.normpath(page_dir / unquote(path)))
    if resolved.is_relative_to(docs_dir):
        return (os.path.relpath(resolved, page_dir).replace(os.sep, "/") + hash_ + fragment), None
    if not resolved.is_relative_to(root):
        return target, f"a link '{target}' that points outside the repository"
    relative = resolved.relative_to(root).as_posix()
    if not resolved.exists():
        return target, f"a link '{target}' that points to '{relative}', which is not in the repository"
    kind = "tree" if resolved.is_dir() else "blob"
    return f"{repo}/{kind}/{branch}/{relative}{hash_}{fragment}", None


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    root = Path(config["config_file_path"]).resolve().parent
    repo_url = (config.get("repo_url") or "").rstrip("/")
    if not repo_url:
        raise ValueError("mkdocs.yml needs repo_url: links from docs/ to other files of the repository point there")
    branch = config["extra"].get("repo_branch", "main")
    page_dir = Path(page.file.abs_src_path).resolve().parent

    def one(match: re.Match) -> str:
        if match.group("code"):
            return match.group(0)
        raw = match.group("target")
        target = raw[1:-1] if raw.startswith("<") else raw
        link, problem = repo_link(target, page_dir, docs_dir, root, repo_url, branch)
        if problem:
            log.warning(f"Doc file '{page.file.src_uri}' contains {problem}.")
        if link == target:
            return match.group(0)
        return f"]({link}{match.group('title') or ''})"

    lines, in_fence = [], None
    for line in markdown.split("\n"):
        fence = _FENCE.match(line)
        if fence and (in_fence is None or fence.group(1) == in_fence):
            in_fence = fence.group(1) if in_fence is None else None
        elif in_fence is None:
            line = _LINK.sub(one, line)
        lines.append(line)
    return "\n".join(lines)


# A Sphinx role in a docstring (":class:`Config`"), which the API page's Markdown shows as the role's name followed by
# the code span: the code span is kept, the role dropped.
_ROLE = re.compile(r":(?:class|meth|func|attr|mod|obj|data):(<code>)~?")


def on_page_content(html: str, page, config, files) -> str:
    return _ROLE.sub(r"\1", html)
