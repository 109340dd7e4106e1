"""Job data as Azure ML handles it, against real stand-ins: Blob inputs and outputs on Azurite, an https
input from a local TLS server; a content-identity cache; clear errors for missing data and for registered
assets without a workspace."""

from __future__ import annotations

import http.server
import socket
import json
import ssl
import subprocess
import threading
from pathlib import Path

import pytest
from azure.storage.blob import BlobServiceClient

from azulite.errors import InputError
from azulite.launch.data import fetch
from azulite.spec.job import PathInput
from azulite.spec.loader import load_job
from tests.launch.jobkit import backend, home, wait_done, write_job
from tests.train.azurite import ACCOUNT, Azurite

_ = home

# reads every file of the folder input and the file input, writes their sizes to the uploaded output,
# then exits with the code its input says (an attempt that fails still has its output uploaded)
READER = """
import json, os, sys
folder, one, direct, out, code = sys.argv[1:6]
sizes = {p: os.path.getsize(os.path.join(folder, p)) for p in sorted(os.listdir(folder))}
with open(os.path.join(out, "sizes.json"), "w") as f:
    json.dump({"folder": sizes, "file": open(one).read(), "direct": direct}, f)
sys.exit(int(code))
"""

SPEC = """
name: data
code: .
command: python run.py ${{{{inputs.set1}}}} ${{{{inputs.one}}}} ${{{{inputs.raw}}}} ${{{{outputs.result}}}} ${{{{inputs.code}}}}
inputs:
  set1: {{type: uri_folder, path: "wasbs://data@{account}.blob.core.windows.net/set1", mode: download}}
  one: {{type: uri_file, path: "az://data/set1/b.txt", mode: ro_mount}}
  raw: {{type: uri_folder, path: "az://data/set1", mode: direct}}
  code: {code}
outputs:
  result: {{type: uri_folder, path: "az://results/{run}", mode: upload}}
"""


@pytest.fixture(scope="module")
def blob(tmp_path_factory):
    az = Azurite(tmp_path_factory.mktemp("azurite-data")).start()
    try:
        svc = BlobServiceClient.from_connection_string(az.connection_string)
        svc.create_container("data")
        svc.create_container("results")
        c = svc.get_container_client("data")
        c.upload_blob("set1/a.bin", b"x" * 1000)
        c.upload_blob("set1/b.txt", b"hello")
        c.upload_blob("set1/sub/c.bin", b"y" * 10)
        yield az, svc
    finally:
        az.stop()


def _events(rec) -> list[str]:
    return [e["message"] for e in rec.events]


@pytest.mark.slow
def test_blob_inputs_download_once_outputs_upload_even_after_a_failure(home, tmp_path, blob, monkeypatch):
    az, svc = blob
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", az.connection_string)
    first = write_job(tmp_path / "one", READER, SPEC.format(account=ACCOUNT, code=3, run="failed-run"))
    rec = wait_done(backend().submit(load_job(first)).id)
    assert rec.state.value == "failed" and rec.exit_code == 3, rec.reason
    uploaded = json.loads(svc.get_blob_client("results", "failed-run/sizes.json").download_blob().readall())
    assert uploaded["file"] == "hello" and uploaded["direct"] == "az://data/set1"  # direct: the URI itself
    assert sorted(uploaded["folder"]) == ["a.bin", "b.txt", "sub"] and uploaded["folder"]["a.bin"] == 1000
    assert any("set1" in e and "downloaded" in e for e in _events(rec)), _events(rec)

    second = write_job(tmp_path / "two", READER, SPEC.format(account=ACCOUNT, code=0, run="ok-run"))
    rec2 = wait_done(backend().submit(load_job(second)).id)
    assert rec2.state.value == "succeeded", rec2.reason
    events = _events(rec2)
    assert any("input set1" in e and "from the cache" in e for e in events), events
    assert json.loads(svc.get_blob_client("results", "ok-run/sizes.json").download_blob().readall())["file"] == "hello"

    # changed content is a new identity: fetched again
    svc.get_container_client("data").upload_blob("set1/b.txt", b"hello again", overwrite=True)
    env = {"AZURE_STORAGE_CONNECTION_STRING": az.connection_string}
    got = fetch("one", PathInput(type="uri_file", path="az://data/set1/b.txt"), home / "cache" / "inputs", env)
    assert got.downloaded and Path(got.local).read_text() == "hello again"


def test_missing_blob_input_is_refused_at_submit_naming_input_and_credential(home, tmp_path, blob, monkeypatch):
    az, _ = blob
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", az.connection_string)
    spec = write_job(tmp_path / "m", "print(1)\n", "command: python run.py ${{inputs.d}}\n"
                     "inputs: {d: {type: uri_folder, path: 'az://data/nothing-here'}}\n")
    with pytest.raises(InputError) as e:
        backend().submit(load_job(spec))
    msg = str(e.value)
    assert "input 'd'" in msg and "az://data/nothing-here" in msg and "AZURE_STORAGE_CONNECTION_STRING" in msg
    assert "--set inputs.d.path=./data" in msg
    assert backend().list() == []  # nothing started


def test_registered_asset_without_a_workspace_names_the_input_and_the_override(home, tmp_path, monkeypatch):
    for k in ("AZUREML_SUBSCRIPTION_ID", "AZUREML_RESOURCE_GROUP", "AZUREML_WORKSPACE_NAME"):
        monkeypatch.delenv(k, raising=False)
    spec = write_job(tmp_path / "a", "print(1)\n", "command: python run.py ${{inputs.cifar}}\n"
                     "inputs: {cifar: {type: uri_folder, path: 'azureml:cifar-10-example@latest'}}\n")
    with pytest.raises(InputError) as e:
        backend().submit(load_job(spec))
    assert "input 'cifar'" in e.value.message and "azureml:cifar-10-example@latest" in e.value.message
    assert "--set inputs.cifar.path=./data" in e.value.fix and e.value.where == "inputs.cifar.path"


@pytest.fixture
def https_server(tmp_path):
    """A local HTTPS server (self-signed certificate, trusted through SSL_CERT_FILE) serving tmp_path/www."""
    www = tmp_path / "www"
    www.mkdir()
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    handler = lambda *a, **kw: http.server.SimpleHTTPRequestHandler(*a, directory=str(www), **kw)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield www, f"https://localhost:{server.server_address[1]}", cert
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_https_file_input_is_downloaded_into_the_cache(home, tmp_path, https_server, monkeypatch):
    www, base, cert = https_server
    (www / "labels.csv").write_text("a,1\nb,2\n")
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    spec = write_job(tmp_path / "h", "import sys; print('LABELS', open(sys.argv[1]).read().count(','))\n",
                     f"command: python run.py ${{{{inputs.labels}}}}\n"
                     f"inputs: {{labels: {{type: uri_file, path: '{base}/labels.csv'}}}}\n")
    rec = wait_done(backend().submit(load_job(spec)).id)
    assert rec.state.value == "succeeded", rec.reason
    log = next(p.log for p in rec.processes if p.kind == "rank")
    assert "LABELS 2" in Path(log).read_text()
    with pytest.raises(InputError, match="does not exist or cannot be read") as e:
        fetch("x", PathInput(type="uri_file", path=f"{base}/missing.csv"), home / "cache", {"SSL_CERT_FILE": str(cert)})
    assert "404" in str(e.value)  # the server answered: its status is the reason


def test_an_http_server_that_does_not_answer_is_not_called_a_missing_file(home):
    """fsspec's HTTP file system raises FileNotFoundError for a refused connection too: the reason given is
    the connection's, so a user looks at the server, not at the path."""
    with socket.socket() as held:  # bound, never listening: a connection to it is refused
        held.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{held.getsockname()[1]}/labels.csv"
        with pytest.raises(InputError) as e:
            fetch("labels", PathInput(type="uri_file", path=uri), home / "cache", {})
    msg = str(e.value)
    assert "input 'labels'" in msg and "ClientConnectorError" in msg and "not found" not in msg, msg


def test_an_input_whose_host_does_not_resolve_fails_at_once(home):
    """No network, or a typo in the host: every credential of the chain was tried against it, with retries,
    for minutes before the error came (2m45s measured). ".invalid" never resolves (RFC 2606)."""
    uri = "https://no-such-account.invalid/datasets/iris.csv"
    with pytest.raises(InputError) as e:
        fetch("iris", PathInput(type="uri_file", path=uri), home / "cache", {})
    assert "the host 'no-such-account.invalid'" in str(e.value) and "cannot be resolved" in str(e.value)
