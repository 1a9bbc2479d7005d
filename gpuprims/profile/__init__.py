"""Model profiles: latency (p50/p99) and peak memory over batch size x GPU%, measured or paper-derived.

``knee`` derives the knee GPU% from a profile (paper IV-C); ``format`` holds the versioned JSON profile and its interpolation; ``measure`` measures one on this
machine (each point in a fresh spawn process with its GPU% applied before torch initialises);
``cli`` is ``gpuprims-profile``.
"""

from __future__ import annotations

from gpuprims.profile.format import (
    FORMAT_VERSION,
    PAPER_MODELS,
    Conditions,
    Profile,
    ProfileError,
    ProfilePoint,
    StageEntry,
    load_profile,
    load_profiles,
    merge_stage_latencies,
    paper_profile,
    paper_profiles,
    profile_from_dict,
    save_profile,
    with_stages,
)
from gpuprims.profile.knee import knee

__all__ = [
    "FORMAT_VERSION",
    "PAPER_MODELS",
    "Conditions",
    "Profile",
    "ProfileError",
    "ProfilePoint",
    "StageEntry",
    "knee",
    "load_profile",
    "load_profiles",
    "merge_stage_latencies",
    "paper_profile",
    "paper_profiles",
    "profile_from_dict",
    "save_profile",
    "with_stages",
]
