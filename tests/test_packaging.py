"""What is published: the version, the license, the docs' sources. (.ci/run builds the
sdist and wheel, checks them with twine, runs tests from the sdist and the demo from
the wheel in a fresh venv; `mkdocs build --strict` builds the site.)"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import etcd_leases
from tests.cli import cli_env

ROOT = Path(__file__).resolve().parent.parent


def test_the_version_is_the_installed_distributions() -> None:
    assert etcd_leases.__version__ == importlib.metadata.version("etcd-leases")
    done = subprocess.run(
        [sys.executable, "-m", "etcd_leases", "--version"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == f"etcd-leases {etcd_leases.__version__}"


def test_the_license_file_is_the_one_pyproject_names() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_every_readme_section_is_a_page_of_the_site() -> None:
    """docs/hooks.py makes a page of each README section; mkdocs.yml's nav lists them."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import hooks  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(ROOT / "docs"))
    pages = hooks.guides()
    nav = (ROOT / "mkdocs.yml").read_text()
    guides = sorted(page for page in pages if page.startswith("guides/"))
    assert len(guides) == (ROOT / "README.md").read_text().count("\n## ")
    for page in guides:
        assert f"- {page}\n" in nav, page
    # Each in-page link was pointed at the page that has its heading (none left dangling).
    assert all("](#" not in text for text in pages.values())
    assert "](../guides/try-it.md#try-it)" in pages["guides/quickstart.md"]
