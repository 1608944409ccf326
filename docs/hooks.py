"""mkdocs hook: the README's guides as pages, so the site and the README never differ.

The README is split at its ``## `` headings, one page per section (the text before
the first is the home page); ``deploy/README.md``, the changelog and the contributing
guide become pages too. Links are rewritten for the site: ``#anchor`` to the page
holding that heading, a repository file to its page or to the repository.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
# Markdown files in the repository that are pages of their own.
PAGES = {"deploy/README.md": "deploy.md", "CHANGELOG.md": "changelog.md"}
PAGES["CONTRIBUTING.md"] = "contributing.md"
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(title: str) -> str:
    """The anchor mkdocs (and GitHub) give a heading."""
    text = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return re.sub(r"[\s]+", "-", text)


def guides() -> dict[str, str]:
    """Page path -> markdown: the README's sections, then the other pages."""
    pages: dict[str, str] = {}
    sections = re.split(r"^(?=## )", (ROOT / "README.md").read_text(), flags=re.MULTILINE)
    pages["index.md"] = sections[0]
    anchors: dict[str, str] = {}
    for section in sections[1:]:
        title = section.splitlines()[0][3:]
        page = f"guides/{slug(title)}.md"
        pages[page] = "#" + section[2:]  # its heading, one level up
        for heading in re.findall(r"^#{2,6} (.+)$", section, flags=re.MULTILINE):
            anchors[slug(heading)] = page
    for source, page in PAGES.items():
        pages[page] = (ROOT / source).read_text()
    return {page: _relink(text, page, anchors) for page, text in pages.items()}


def _relink(text: str, page: str, anchors: dict[str, str]) -> str:
    source = _repository()
    depth = page.count("/")
    up = "../" * depth

    def target(match: re.Match[str]) -> str:
        link = match.group(1)
        if link.startswith(("http://", "https://", "mailto:")):
            return match.group(0)
        if link.startswith("#"):
            where = anchors.get(link[1:])
            return f"]({up}{where}{link})" if where else match.group(0)
        path = link.split("#")[0]
        origin = next((s for s, p in PAGES.items() if p == page), "README.md")
        resolved = (ROOT / origin).parent.joinpath(path).resolve().relative_to(ROOT).as_posix()
        if resolved in PAGES:
            return f"]({up}{PAGES[resolved]})"
        raw = "?raw=true" if resolved.endswith((".png", ".svg")) else ""
        return f"]({source}/blob/main/{resolved}{raw})"

    return _LINK.sub(target, text)


def _repository() -> str:
    with (ROOT / "pyproject.toml").open("rb") as file:
        project: dict[str, Any] = tomllib.load(file)["project"]
    source: str = project["urls"]["Source"]
    return source


def on_files(files: Files, config: Any) -> Files:
    for page, text in guides().items():
        files.append(File.generated(config, page, content=text))
    return files
