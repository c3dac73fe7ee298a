"""The ``cpu`` calibration's cache is used only under the load it was measured at."""

from __future__ import annotations

import json

import meshplan
from meshplan._search.predict import profiles


def _cached(tmp_path, monkeypatch, then, now):
    monkeypatch.setenv("MESHPLAN_CACHE", str(tmp_path))
    monkeypatch.delenv("MESHPLAN_RECALIBRATE", raising=False)
    monkeypatch.setattr(profiles, "load_per_core", lambda: now)
    data = {**meshplan.get_profile("h100").to_dict(), "name": "cpu"}
    if then != "absent":
        data["load_per_core"] = then
    profiles._cache_path(8).write_text(json.dumps(data))
    return profiles._cached_cpu(8)


def test_a_calibration_from_the_same_load_is_kept(tmp_path, monkeypatch):
    cached = _cached(tmp_path, monkeypatch, then=0.5, now=0.7)
    assert cached is not None and cached.name == "cpu" and cached.combines_remat_collectives


def test_a_calibration_from_another_load_is_measured_again(tmp_path, monkeypatch):
    assert _cached(tmp_path, monkeypatch, then=0.1, now=4.0) is None  # busy now: 1/5 the share
    assert _cached(tmp_path, monkeypatch, then=4.0, now=0.1) is None  # quiet now
    assert _cached(tmp_path, monkeypatch, then="absent", now=0.1) is None  # cached before


def test_the_saved_calibration_keeps_its_load(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_CACHE", str(tmp_path))
    monkeypatch.setattr(profiles, "load_per_core", lambda: 1.25)
    profiles._save_cpu(8, meshplan.get_profile("h100"))
    assert json.loads(profiles._cache_path(8).read_text())["load_per_core"] == 1.25
