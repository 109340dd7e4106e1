"""``azulite dashboard``: its flags checked at startup, before anything listens (a URL that is none was taken
and failed on every poll; a 3-character key guarded a dashboard open to the network)."""

from __future__ import annotations

import pytest

from azulite.cli.dashboard import check_key, check_metrics_url
from tests.cli.inprocess import exit_code as run


@pytest.mark.parametrize("args, words", [
    (("--serve-metrics", "notaurl"), "error: --serve-metrics: 'notaurl' is not an http(s) URL of a server's metrics"),
    (("--serve-metrics", "http://127.0.0.1:8002/metrics", "--serve-metrics", "ftp://h/metrics"), "'ftp://h/metrics' is not"),
    (("--serve-metrics", "http://:8002/metrics"), "'http://:8002/metrics' is not"),
    (("--serve-metrics", "http://h:99999/metrics"), "'http://h:99999/metrics' is not"),
    (("--host", "0.0.0.0", "--key", "abc"), "error: --key: the key is 3 characters; at least 16 are needed"),
    (("--key", "x" * 15), "the key is 15 characters"),
])
def test_bad_flags_are_refused_before_it_listens(capsys, monkeypatch, tmp_path, args, words):
    monkeypatch.setenv("AZULITE_HOME", str(tmp_path))
    monkeypatch.delenv("AZULITE_DASHBOARD_KEY", raising=False)
    assert run("dashboard", "--port", "0", *args) == 2
    captured = capsys.readouterr()
    assert words in " ".join(captured.err.split()) and "fix: " in captured.err and "azulite dashboard:" not in captured.err


def test_good_urls_and_keys_pass():
    assert check_metrics_url(" http://127.0.0.1:8002/metrics ") == "http://127.0.0.1:8002/metrics"
    assert check_metrics_url("https://serve.example.com/metrics") == "https://serve.example.com/metrics"
    assert check_key("k" * 16) == "k" * 16
