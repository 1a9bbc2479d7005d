"""Bundled inference apps of gpuprims and their model zoo (`apps.zoo`)."""

from __future__ import annotations
