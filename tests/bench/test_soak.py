"""The soak bench's bookkeeping: stable process names and the flatness rule."""

from __future__ import annotations

import os

from bench.soak import flatness, proc_sample, process_keys


def test_process_keys_name_processes_by_app_and_role() -> None:
    st = {"node": {"pid": 1}, "apps": {"a": {"instances": [
        {"name": "a-r3", "pid": 30, "role": "active"}, {"name": "a-s4", "pid": 40, "role": "shadow"},
        {"name": "a-r5", "pid": 50, "role": "active"}, {"name": "a-s6", "pid": None, "role": "shadow"}]}}}
    assert process_keys(st) == {"orchestrator": 1, "a/active": 30, "a/shadow": 40, "a/active/1": 50}


def test_flat_means_no_sample_above_the_baseline_range() -> None:
    times = [0, 60, 120, 180, 240]
    series = {"p": {"rss_mb": [100, 120, 110, 119, 120], "fds": [10, 10, 11, 12, None]},
              "q": {"rss_mb": [None, None, 5, 5, 5], "fds": [1, 1, 1, 1, 1]}}
    f = flatness(times, series, baseline_s=60)
    assert f["p"]["rss_mb"] == {"baseline_max": 120, "after_max": 120, "end": 120, "flat": True}
    assert f["p"]["fds"]["flat"] is False and f["p"]["fds"]["end"] == 12
    assert f["q"]["rss_mb"]["flat"] is None  # nothing in the baseline window to compare with
    assert f["q"]["fds"]["flat"] is True


def test_proc_sample_of_this_process_and_of_none() -> None:
    s = proc_sample(os.getpid())
    assert s is not None and s["rss_mb"] > 0 and s["fds"] > 0 and s["threads"] >= 1
    assert 0 < s["private_mb"] <= s["rss_mb"] and 0 <= s["shared_mb"] <= s["rss_mb"]
    assert proc_sample(2**22 + 12345) is None


def test_an_apps_active_is_judged_on_the_range_of_both_its_roles() -> None:
    # The shadow (4 threads: its pre-warm's idle OpenMP workers) becomes the active at a change.
    times = [0, 60, 120, 180]
    series = {"a/active": {"threads": [3, 3, 4, 4]}, "a/shadow": {"threads": [4, 4, 4, 4]},
              "b/active": {"threads": [3, 3, 4, 4]}, "b/shadow": {"threads": [3, 3, 3, 3]},
              "a/active/1": {"threads": [None, None, 4, 4]}}
    f = flatness(times, series, baseline_s=60)
    assert f["a/active"]["threads"]["flat"] is True and f["a/active"]["threads"]["baseline_max"] == 4
    assert f["b/active"]["threads"]["flat"] is False  # b's shadow never had 4: that is growth
    assert f["a/active/1"]["threads"]["flat"] is None  # not sampled in the baseline window
