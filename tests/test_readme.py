"""The README's examples run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end >= 0 else None]


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.DOTALL)


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def test_the_first_two_commands_run_the_demo_and_the_tests() -> None:
    first, second = code_blocks(README, "sh")[:2]
    assert first.rstrip().endswith("etcd-leases demo")
    assert second.rstrip().endswith("python -m pytest")


def test_the_testing_section_runs_as_written(tmp_path: Path) -> None:
    script, test = code_blocks(section("Testing against a real etcd"), "python")
    (tmp_path / "example.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr

    (tmp_path / "test_example.py").write_text(test)
    plugins = ["-p", "etcd_leases.testing", "-p", "pytest_asyncio.plugin"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *plugins, "-o", "asyncio_mode=auto"],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_the_test_count_is_the_suites() -> None:
    (said,) = re.findall(r"\(([0-9,]+) tests\)", README)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    collected = re.search(r"^(\d+) tests? collected", done.stdout, re.MULTILINE)
    assert collected is not None, done.stdout[-2000:] + done.stderr
    assert int(said.replace(",", "")) == int(collected.group(1))
