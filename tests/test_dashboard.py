"""docs/grafana/gouache.json, the Grafana dashboard of gouache's Prometheus metrics: every query
names a series the server exports, groups by labels that series has, and every metric family
the engine exports is on some panel."""

import json
import re
from pathlib import Path

from gouache.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "gouache.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def series() -> dict[str, tuple[str, set[str]]]:
    """Each exported series name -> (its family, the family's labels)."""
    out = {}
    metrics = Metrics()
    for collector in list(metrics.registry._collector_to_names):
        for family in collector.describe():
            labels = set(getattr(collector, "_labelnames", ()))
            for suffix in SUFFIXES[family.type]:
                out[family.name + suffix] = (family.name, labels)
    return out


def test_every_query_names_an_exported_series_by_its_own_labels():
    exported = series()
    dashboard = json.loads(DASHBOARD.read_text())
    shown = set()
    assert dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = re.findall(r"gouache_[a-z_]+", target["expr"])
            assert names, target["expr"]
            for name in names:
                assert name in exported, (panel["title"], name)
                family, labels = exported[name]
                shown.add(family)
                grouped = {label.strip() for group in re.findall(r"by \(([^)]*)\)", target["expr"])
                           for label in group.split(",")}
                assert grouped <= labels | {"le"}, (panel["title"], grouped - labels)
            assert set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"])) <= {
                label for name in names for label in exported[name][1]}, panel["title"]
    assert shown == {family for family, _ in exported.values()}  # every family is on a panel
