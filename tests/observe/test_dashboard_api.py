"""The dashboard's JSON API without a browser (tests/observe/test_dashboard.py drives the pages): a query
parameter that is not a whole number is the client's 400 naming it, not Python's text."""

from __future__ import annotations

import pytest

from azulite.launch.local.store import JobStore
from azulite.observe.dashboard import Dashboard


@pytest.mark.parametrize("path, query, name", [("/api/jobs", {"since": ["abc"]}, "since"),
                                               ("/api/jobs/j-1/log", {"rank": ["x"]}, "rank"),
                                               ("/api/jobs/j-1/log", {"offset": ["1.5"]}, "offset")])
def test_a_query_parameter_that_is_not_a_whole_number_is_a_400_naming_it(tmp_path, path, query, name):
    JobStore(tmp_path / "jobs.db")  # an empty store
    status, body = Dashboard(tmp_path / "jobs.db", serving_urls=[], key=None).api(path, query)
    assert status == 400 and body["error"] == f"?{name}= must be a whole number, got {query[name][0]!r}"


def test_an_empty_store_answers_its_jobs(tmp_path):
    JobStore(tmp_path / "jobs.db")
    status, body = Dashboard(tmp_path / "jobs.db", serving_urls=[], key=None).api("/api/jobs", {"since": [""]})
    assert status == 200 and body["jobs"] == [] and body["error"] is None
