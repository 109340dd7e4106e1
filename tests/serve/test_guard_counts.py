"""The guard counters of several front-ends as one view: what each publishes is summed, a front-end's
file outlives it, a file being replaced or broken never breaks the scrape."""

from __future__ import annotations

from types import SimpleNamespace

from azulite.serve import guard_counts
from azulite.serve.metrics import render


def _guard(rejected: dict, audit: dict | None = None):
    # the two things a Guard exposes for metrics: its refusal counts, its audit log's counters
    return SimpleNamespace(rejected=rejected, audit=None if audit is None else SimpleNamespace(**audit))


def _scrape(folder) -> str:
    """As the model host's /metrics renders it."""
    return render(guard_counts.merged_metrics(folder)()).decode()


def test_counts_of_every_front_end_are_summed(tmp_path):
    folder = tmp_path / "guard"
    a = _guard({"UNAUTHENTICATED": 2}, {"written": 3, "write_errors": 0, "dropped": 1})
    b = _guard({"UNAUTHENTICATED": 1, "RESOURCE_EXHAUSTED": 4}, {"written": 5, "write_errors": 2, "dropped": 0})
    pa, pb = guard_counts.Publisher(a, folder, name="a"), guard_counts.Publisher(b, folder, name="b")
    pa.publish()
    pb.publish()
    (folder / "broken.json").write_text("{")  # a torn or foreign file is skipped, never a failed scrape
    assert guard_counts.merged(folder) == {"rejected": {"UNAUTHENTICATED": 3, "RESOURCE_EXHAUSTED": 4},
                                           "audit": {"written": 8, "write_errors": 2, "dropped": 1}}
    # later counts replace the front-end's earlier ones (not added to them); a closed front-end's stay
    a.rejected["UNAUTHENTICATED"] = 5
    a.audit.written = 4
    pa.close()
    b.rejected["RESOURCE_EXHAUSTED"] = 6
    pb.publish()
    lines = set(_scrape(folder).splitlines())
    assert {'azulite_requests_rejected_total{status="UNAUTHENTICATED"} 6', 'azulite_requests_rejected_total{status="RESOURCE_EXHAUSTED"} 6',
            "azulite_audit_lines_written_total 9", "azulite_audit_write_errors_total 2", "azulite_audit_dropped_total 1"} <= lines, lines


def test_no_audit_log_no_audit_families(tmp_path):
    folder = tmp_path / "guard"
    guard_counts.Publisher(_guard({"PERMISSION_DENIED": 1}), folder, name="only").publish()
    text = _scrape(folder)
    assert 'azulite_requests_rejected_total{status="PERMISSION_DENIED"} 1' in text.splitlines()
    assert "azulite_audit" not in text
    assert "# TYPE azulite_requests_rejected counter" in _scrape(tmp_path / "never_written")  # no front-end yet: empty family
