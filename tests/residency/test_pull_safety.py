"""Pulls that cannot reach into the LAN, cannot promise one disk's free bytes twice, never write one
file twice, end with a message when the folder cannot be written, keep signed URLs out of sight, and
do their file work off serve's event loop."""

from __future__ import annotations

import http.client
import ipaddress
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from app.devtools.hub_server import HubServer, tiny_gguf
from app.residency.fetch import HostPolicy, PullError, address_kind, redact, redact_url
from app.residency.library import DISK_RESERVE_BYTES, DiskLedger, Library, Source, part_path, pull, resolve
from app.residency.offload import FILE_THREAD_NICE
from app.store.settings import Invalid, validate
from tests.helpers import wait_until

SECRET = "s3cr3t-signature"


@pytest.fixture()
def weights(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    return tiny_gguf(src / "tiny.gguf")


@pytest.fixture()
def hub(weights):
    server = HubServer({"tiny-Q4_K_M.gguf": weights})
    yield server
    server.close()


@pytest.fixture()
def models(tmp_path):
    d = tmp_path / "models"
    d.mkdir()
    return d


def _ended(p, timeout_s: float = 30.0):
    wait_until(lambda: not p.active, timeout_s, lambda: f"pull still {p.state}")
    return p


def _only_the_probe_connected(server: HubServer) -> bool:
    """True when the server accepted no connection before this probe: its answer proves the accept loop
    has taken every earlier connection (they queue in order), and the count then holds the probe alone."""
    host = server.url.split("//")[1].rsplit(":", 1)[0].strip("[]")
    conn = http.client.HTTPConnection(host, int(server.url.rsplit(":", 1)[1]), timeout=10)
    conn.request("GET", "/probe")
    conn.getresponse().read()
    conn.close()
    return server.connections == 1


# -- redaction -------------------------------------------------------------------------------------


def test_signed_urls_are_redacted_keeping_host_and_path():
    url = f"https://user:pw@cdn.example.com/repo/model.gguf?X-Amz-Signature={SECRET}&X-Amz-Credential=AKIA&token={SECRET}"
    assert redact_url(url) == ("https://***@cdn.example.com/repo/model.gguf"
                               "?X-Amz-Signature=***&X-Amz-Credential=***&token=***")
    sha = "ab" * 32
    assert redact_url(f"https://h.example/m.gguf#sha256={sha}") == f"https://h.example/m.gguf#sha256={sha}"
    assert redact_url(f"https://h.example/m.gguf#access_token={SECRET}") == "https://h.example/m.gguf#***"
    assert redact_url("hf.co/owner/repo:Q4_K_M") == "hf.co/owner/repo:Q4_K_M"  # not a URL: as it is
    text = redact(f"GET http://mirror.example:8080/a.gguf?sig={SECRET} answered 403")
    assert SECRET not in text and "http://mirror.example:8080/a.gguf?sig=***" in text
    assert SECRET not in str(PullError(f"https://x.example/a.gguf?token={SECRET} answered HTTP 500"))


def test_a_refused_signed_url_shows_and_logs_no_token(hub, models, caplog):
    lib = Library(models, check_header=lambda m: None, on_done=lambda path: None)
    spec = f"http://tok:{SECRET}@127.0.0.1:{hub.url.rsplit(':', 1)[1]}/files/tiny-Q4_K_M.gguf?token={SECRET}"
    with caplog.at_level(logging.DEBUG, logger="app.residency.library"):
        p = _ended(lib.start(spec))
        # The pull thread ends the pull, then logs why: wait for the line, not only for the end.
        wait_until(lambda: any("refused" in r.getMessage() for r in caplog.records), 10, "the refusal's log line")
    assert p.state == "refused" and p.code == "host_refused"
    assert SECRET not in p.label and SECRET not in p.error and "127.0.0.1" in p.label and "/files/" in p.label
    assert not [r for r in caplog.records if SECRET in r.getMessage()]


# -- which hosts a pull may reach ------------------------------------------------------------------


@pytest.mark.parametrize("address, kind", [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("10.1.2.3", "private"), ("172.16.5.4", "private"),
    ("192.168.1.1", "private"), ("169.254.169.254", "link-local"), ("0.0.0.0", "unspecified"),
    ("224.0.0.251", "multicast"), ("100.64.0.1", "carrier-grade NAT (100.64.0.0/10)"), ("::1", "loopback"),
    ("::", "unspecified"), ("fc00::1", "private"), ("fd12:3456::1", "private"), ("fe80::1", "link-local"),
    ("ff02::1", "multicast"), ("::ffff:10.0.0.1", "private"), ("::ffff:127.0.0.1", "loopback"),
    ("64:ff9b::a00:1", "private"), ("2002:c0a8:101::", "private"),
    ("8.8.8.8", None), ("1.1.1.1", None), ("2606:4700:4700::1111", None), ("::ffff:8.8.8.8", None),
])
def test_address_kinds(address, kind):
    assert address_kind(ipaddress.ip_address(address)) == kind


def test_allowed_hosts_setting_is_checked():
    policy = HostPolicy.parse("mirror.lan, 192.168.1.20 10.0.0.0/8,[::1]")
    assert policy.allows("mirror.lan", ipaddress.ip_address("192.168.7.7"))
    assert policy.allows("other", ipaddress.ip_address("10.9.9.9"))
    assert policy.allows("other", ipaddress.ip_address("::ffff:192.168.1.20"))  # the mapped form is the same host
    assert policy.allows("other", ipaddress.ip_address("::1"))
    assert not policy.allows("other", ipaddress.ip_address("192.168.1.21"))
    assert not HostPolicy().allows("localhost", ipaddress.ip_address("127.0.0.1"))  # safe by default
    assert validate("pull_allowed_hosts", "mirror.lan, 192.168.1.0/24") == "mirror.lan, 192.168.1.0/24"
    for bad in ("http://mirror.lan", "mirror.lan:8080", "*", "10.0"):
        with pytest.raises(Invalid, match="not a host name, an address or a network"):
            validate("pull_allowed_hosts", bad)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_pull_to_this_machine_is_refused_before_any_byte(weights, models, host):
    server = HubServer({"tiny.gguf": weights}, host=host)
    try:
        lib = Library(models, check_header=lambda m: None, on_done=lambda path: None)
        p = _ended(lib.start(f"{server.url}/files/tiny.gguf"))
        assert p.state == "refused" and p.code == "host_refused", p.error
        assert "a loopback address" in p.error and "pull_allowed_hosts" in p.error
        with pytest.raises(PullError, match="loopback") as e:
            resolve(f"{server.url}/files/tiny.gguf")
        assert e.value.code == "host_refused"
        assert _only_the_probe_connected(server)
        assert list(models.iterdir()) == []
    finally:
        server.close()


@pytest.mark.parametrize("location, kind", [
    ("http://127.0.0.2:{b}/files/tiny.gguf", "loopback"),
    ("http://[::1]:{b6}/files/tiny.gguf", "loopback"),
    ("http://10.0.0.7/tiny.gguf", "private"),
    ("http://192.168.1.1/cgi-bin/tiny.gguf", "private"),
    ("http://169.254.169.254/latest/meta-data/tiny.gguf", "link-local"),
    ("http://[fd00::1]/tiny.gguf", "private"),
    ("http://[::ffff:192.168.0.1]/tiny.gguf", "private"),
])
def test_a_redirect_into_the_lan_is_refused_at_that_hop(weights, models, location, kind):
    """The first host is allowed (as a LAN mirror would be); its redirect to a host that is not allowed
    is refused before anything is sent there, on the HEAD and the GET alike."""
    a = HubServer({"tiny.gguf": weights})
    b = HubServer({"tiny.gguf": weights}, host="127.0.0.2")
    b6 = HubServer({"tiny.gguf": weights}, host="::1")
    try:
        a.redirects["/files/tiny.gguf"] = location.format(b=b.url.rsplit(":", 1)[1], b6=b6.url.rsplit(":", 1)[1])
        lib = Library(models, check_header=lambda m: None, on_done=lambda path: None)
        p = _ended(lib.start(f"{a.url}/files/tiny.gguf", allowed_hosts="127.0.0.1"))
        assert p.state == "refused" and p.code == "host_refused" and f"a {kind} address" in p.error, p.error
        with pytest.raises(PullError, match=kind):
            resolve(f"{a.url}/files/tiny.gguf", hosts=HostPolicy.parse("127.0.0.1"))  # its HEAD
        source = Source("mirror", f"{a.url}/files/tiny.gguf", "tiny.gguf", weights.stat().st_size)
        with pytest.raises(PullError, match=kind):
            pull(source, models, hosts=HostPolicy.parse("127.0.0.1"))  # its GET
        assert [r[1] for r in a.log] == ["/files/tiny.gguf"] * 3  # HEAD, HEAD, GET: each answered by the redirect
        assert _only_the_probe_connected(b) and _only_the_probe_connected(b6)
        assert list(models.iterdir()) == []
    finally:
        for s in (a, b, b6):
            s.close()


def test_the_connection_goes_to_the_address_that_was_checked(weights, models, monkeypatch):
    """DNS rebinding: whatever a second lookup would answer, a pull connects only where its check looked."""
    a = HubServer({"tiny.gguf": weights})
    port = int(a.url.rsplit(":", 1)[1])
    b = HubServer({"tiny.gguf": weights}, host="127.0.0.2", port=port)
    real = socket.getaddrinfo
    answers = iter(["127.0.0.1", "127.0.0.2"] * 10)  # allowed, then not, then allowed…

    def rebinding(host, *args, **kwargs):
        if host == "rebind.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), port))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    try:
        hosts = HostPolicy.parse("127.0.0.1")
        source = resolve(f"http://rebind.test:{port}/files/tiny.gguf", hosts=hosts)  # HEAD: 127.0.0.1
        assert source.size_bytes == weights.stat().st_size
        with pytest.raises(PullError, match=r"rebind.test \(127.0.0.2, a loopback address\)"):
            pull(source, models, hosts=hosts)  # GET: the lookup said 127.0.0.2, refused, not connected
        monkeypatch.setattr(socket, "getaddrinfo", real)
        assert a.connections == 1 and _only_the_probe_connected(b)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("allowed", ["localhost", "127.0.0.0/8"])
def test_a_lan_mirror_the_admin_allowed_is_pulled_from(weights, models, allowed):
    server = HubServer({"tiny.gguf": weights})
    try:
        lib = Library(models, check_header=lambda m: None, on_done=lambda path: None)
        p = _ended(lib.start(f"http://localhost:{server.url.rsplit(':', 1)[1]}/files/tiny.gguf", allowed_hosts=allowed))
        assert p.state == "done", p.error
        assert (models / "tiny.gguf").read_bytes() == weights.read_bytes()
    finally:
        server.close()


def test_the_hugging_face_endpoint_the_admin_set_is_reachable(hub, models):
    """hf_endpoint names the host: a LAN mirror needs no second setting (this hub is on loopback)."""
    src = resolve("hf.co/owner/repo:Q4_K_M", endpoint=hub.url)
    assert pull(src, models).read_bytes() == hub.files["tiny-Q4_K_M.gguf"].read_bytes()



def test_a_host_that_does_not_exist_ends_the_pull_at_once_with_a_message(models):
    lib = Library(models, check_header=lambda m: None, on_done=lambda path: None)
    p = _ended(lib.start("https://no-such-host.invalid/model.gguf"))
    assert p.state == "failed" and p.error.startswith("cannot find the host of https://no-such-host.invalid/model.gguf")
    assert list(models.iterdir()) == []

# -- one pull per file, disk reserved --------------------------------------------------------------


def test_one_pull_per_file_whatever_its_source_is_called(hub, models):
    hub.hold = threading.Event()
    lib = Library(models, check_header=lambda m: None, on_done=lambda path: None, endpoint=lambda: hub.url)
    first = lib.start("hf.co/owner/repo:Q4_K_M")
    wait_until(lambda: hub.held == 1, 30, "the first pull never reached the hub")
    assert lib.start("hf.co/owner/repo:Q4_K_M") is first  # the same source joins it
    second = _ended(lib.start("owner/repo/tiny-Q4_K_M.gguf"))  # another name of the same file
    assert second.state == "refused" and second.code == "busy"
    assert f"being pulled already (pull {first.id}, hf.co/owner/repo:Q4_K_M" in second.error
    # Another process (or a direct pull) meets the part file's lock instead.
    source = resolve("owner/repo/tiny-Q4_K_M.gguf", endpoint=hub.url)
    with pytest.raises(PullError, match="being pulled already") as e:
        pull(source, models)
    assert e.value.code == "busy" and part_path(models / "tiny-Q4_K_M.gguf").exists()
    hub.hold.set()
    assert _ended(first).state == "done", first.error
    assert (models / "tiny-Q4_K_M.gguf").read_bytes() == hub.files["tiny-Q4_K_M.gguf"].read_bytes()


def test_fifty_pulls_at_once_cannot_each_pass_the_disk_check(weights, models):
    size = weights.stat().st_size
    server = HubServer({f"m{i:02d}.gguf": weights for i in range(50)})
    server.hold = threading.Event()
    try:
        free = 3 * size + DISK_RESERVE_BYTES + size // 2  # room for three and a half
        lib = Library(models, check_header=lambda m: None, on_done=lambda path: None,
                      disk_free=lambda folder: free, ledger=DiskLedger())
        pulls = [lib.start(f"{server.url}/files/m{i:02d}.gguf", allowed_hosts="127.0.0.1") for i in range(50)]
        refused = lambda: [p for p in pulls if p.state == "refused"]  # noqa: E731
        wait_until(lambda: server.held == 3 and len(refused()) == 47, 60,
                   lambda: f"held {server.held}, states {sorted(p.state for p in pulls)}")
        assert {p.code for p in refused()} == {"disk_full"}
        assert all("promised to 3 other pulls under way" in p.error for p in refused())
        server.hold.set()
        done = [p for p in pulls if _ended(p).state == "done"]
        assert len(done) == 3 and len(list(models.glob("*.gguf"))) == 3
        assert not list(models.glob(".*.part"))  # the refused ones left no empty part behind
    finally:
        server.close()


def test_the_ledger_counts_only_what_is_still_to_be_written(tmp_path):
    ledger = DiskLedger()
    free = 10 * 2**30
    held = ledger.reserve(tmp_path, "a.gguf", 6 * 2**30, lambda folder: free)
    with pytest.raises(PullError, match="promised to 1 other pull under way"):
        ledger.reserve(tmp_path, "b.gguf", 5 * 2**30, lambda folder: free)
    held.written_bytes = 2 * 2**30
    free -= 2 * 2**30  # what it wrote is no longer free, and no longer promised
    ledger.reserve(tmp_path, "b.gguf", 3 * 2**30, lambda folder: free)
    ledger.release(held)
    assert ledger.promised_bytes() == 3 * 2**30


# -- a folder that cannot be written ---------------------------------------------------------------


def _mount(*args: str) -> bool:
    return shutil.which("mount") is not None and subprocess.run(["mount", *args], capture_output=True).returncode == 0


@contextmanager
def _read_only(folder: Path):
    """`folder` read-only until the block's `writable()` is called: by its mode for a user, by a
    read-only tmpfs for root (whom modes do not stop); skipped where neither can be had."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield lambda: folder.chmod(0o755)
        folder.chmod(0o755)
        return
    if not _mount("-t", "tmpfs", "-o", "ro,size=1g", "tmpfs", str(folder)):
        pytest.skip("a read-only folder needs a user other than root, or root that may mount")
    try:
        yield lambda: _mount("-o", "remount,rw", str(folder))
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)


def test_a_read_only_models_folder_ends_the_pull_with_a_message_and_a_retry_works(hub, models):
    lib = Library(models, check_header=lambda m: None, on_done=lambda path: None, endpoint=lambda: hub.url)
    with _read_only(models) as writable:
        p = _ended(lib.start("hf.co/owner/repo:Q4_K_M"))
        assert p.state == "failed" and p.code == "read_only", p.error
        assert p.error.startswith("the models folder is read-only")
        writable()
        again = _ended(lib.start("hf.co/owner/repo:Q4_K_M"))
        assert again is not p and again.state == "done", again.error
        assert (models / "tiny-Q4_K_M.gguf").read_bytes() == hub.files["tiny-Q4_K_M.gguf"].read_bytes()


def test_a_disk_that_fills_mid_download_ends_the_pull_and_keeps_the_part(hub, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a small file system needs root that may mount")
    small = tmp_path / "small"
    small.mkdir()
    if not _mount("-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)):
        pytest.skip("this root may not mount")
    try:
        source = resolve("owner/repo/tiny-Q4_K_M.gguf", endpoint=hub.url)
        with pytest.raises(PullError, match="No space left") as e:
            pull(source, small, disk_free=lambda folder: 2**40)  # a disk that lied about its room
        assert e.value.code == "write_failed" and "pull it again to resume" in str(e.value)
        assert part_path(small / source.filename).stat().st_size > 0
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


# -- off the event loop ----------------------------------------------------------------------------

_GEVENT_PULL = """
from gevent import monkey
monkey.patch_all()
import json, os, sys
from pathlib import Path
from gevent.monkey import get_original
from app.residency import library

native_id = get_original("_thread", "get_native_id")
seen = {"main": native_id()}
for name in ("_hash_of", "_append", "_read_head"):
    def spy(*args, _real=getattr(library, name), _name=name):
        seen.setdefault(_name, set()).add(native_id())
        seen.setdefault("nice", set()).add(os.getpriority(os.PRIO_PROCESS, native_id()))
        return _real(*args)
    setattr(library, name, spy)
url, models, size = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
source = library.Source("test", url, "tiny.gguf", size)
part = library.part_path(models / "tiny.gguf")
part.write_bytes(Path(sys.argv[4]).read_bytes()[: 3 * 1024 * 1024])  # a partial file to resume
path = library.pull(source, models, hosts=library.HostPolicy.parse("127.0.0.1"))
print(json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in seen.items()} | {"size": path.stat().st_size}))
"""


def test_under_gevent_hashing_and_writing_run_on_other_threads(weights, models):
    server = HubServer({"tiny.gguf": weights})
    try:
        out = subprocess.run([sys.executable, "-c", _GEVENT_PULL, f"{server.url}/files/tiny.gguf", str(models),
                              str(weights.stat().st_size), str(weights)],
                             capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
        assert out.returncode == 0, out.stderr
        seen = json.loads(out.stdout.strip().splitlines()[-1])
        assert seen["size"] == weights.stat().st_size
        for name in ("_hash_of", "_append", "_read_head"):
            assert seen[name] and seen["main"] not in seen[name], (name, seen)
        assert seen["nice"] == [FILE_THREAD_NICE]  # the pool's threads yield the CPU to the serving loop
        assert server.log[-1][2] == f"bytes={3 * 1024 * 1024}-"  # it resumed, after hashing the part
    finally:
        server.close()


# -- /api/show's reading, cached -------------------------------------------------------------------


def test_file_facts_are_read_once_per_version_of_the_file(weights, tmp_path, monkeypatch):
    from app.residency import catalog

    reads = []
    real = catalog._read_facts
    monkeypatch.setattr(catalog, "_read_facts", lambda path: reads.append(path) or real(path))
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(weights, copy)
    first = catalog.file_facts(copy)
    assert catalog.file_facts(copy) is first and reads == [copy]
    assert first.fields["general.architecture"] == "llama"
    os.utime(copy, ns=(1, 1))  # a new version (a pull over it, an edit): read again
    assert catalog.file_facts(copy) is not first and reads == [copy, copy]

