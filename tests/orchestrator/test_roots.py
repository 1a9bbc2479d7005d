"""The modules that name the checkout's root (the instances' and holders' working directory, the demo's
default config, doctor's results directory) name the directory that holds pyproject.toml, whatever room
of orchestrator/ they sit in (the rooms' move left four of them one level short, and make demo found no
examples/apps.yaml)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli import demo, doctor
from orchestrator.node import launcher, supervisor

CHECKOUT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("root", [demo.ROOT, doctor.ROOT, launcher._ROOT, supervisor._ROOT],
                         ids=["demo", "doctor", "launcher", "supervisor"])
def test_each_root_is_the_checkout(root: Path) -> None:
    assert root == CHECKOUT and (root / "pyproject.toml").is_file() and (root / "orchestrator").is_dir()


def test_the_demo_finds_its_default_config() -> None:
    assert (demo.ROOT / "examples" / "apps.yaml").is_file()
