"""The outgoing-request policy (shared/watch/egress.py) and the webhook POST through it
(shared/watch/webhooks.py), tried as a hostile token holder would: every spelling of a metadata,
link-local, loopback and private address, names that resolve to them (a test resolver), a redirect
chain, proxy variables, a slow and a huge answer. The receivers are real HTTP servers on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from shared.store.port import Delivery
from shared.watch.egress import LOCAL_DEFAULT, Policy, Refused, literal_address
from shared.watch.webhooks import send

AWS = Policy.parse("")  # the template's default: the public internet only
LOCAL = Policy.parse(LOCAL_DEFAULT)  # instantml local: loopback and private too

#: Refused everywhere, whatever a deployment allows: the metadata and credentials services and every
#: other link-local, unspecified, multicast or reserved address, in the spellings resolvers accept.
NEVER = [
    "http://169.254.169.254/latest/meta-data/",
    "http://169.254.170.2/v2/credentials",
    "http://2852039166/",  # decimal
    "http://0251.0376.0251.0376/",  # octal
    "http://0xa9fea9fe/",  # hex
    "http://0xa9.0xfe.0xa9.0xfe/",
    "http://169.254.43518/",  # a.b.c with c 16 bits
    "http://169.16689662/",  # a.b with b 24 bits
    "http://0251.254.169.254/",
    "http://[::ffff:169.254.169.254]/",  # IPv4-mapped
    "http://[::ffff:a9fe:a9fe]/",
    "http://[0:0:0:0:0:ffff:a9fe:a9fe]/",
    "http://[::169.254.169.254]/",  # IPv4-compatible
    "http://[64:ff9b::a9fe:a9fe]/",  # NAT64
    "http://[2002:a9fe:a9fe::1]/",  # 6to4
    "http://[fd00:ec2::254]/",  # EC2's IPv6 metadata
    "http://[fe80::1]/",
    "http://[fe80::a9fe:a9fe]/",
    "http://169.254.0.1:8080/",
    "http://0.0.0.0/",
    "http://0/",
    "http://[::]/",
    "http://224.0.0.1/",
    "http://[ff02::1]/",
    "http://255.255.255.255/",
    "http://240.0.0.1/",
    "http://metadata.google.internal/computeMetadata/v1/",
    "http://metadata/",
    "http://instance-data/latest/",
    "https://169.254.169.254./",
]
#: Refused on AWS unless the template's WebhookAllowedNetworks lists them; allowed by the local stack.
INWARD = [
    "http://127.0.0.1:9/",
    "http://127.1/",
    "http://2130706433/",  # 127.0.0.1, decimal
    "http://017700000001/",  # octal
    "http://0x7f000001/",
    "http://[::1]/",
    "http://[::ffff:127.0.0.1]/",
    "http://localhost:8065/hooks/x",
    "http://LOCALHOST/",
    "http://api.localhost/",
    "http://10.0.0.5/",
    "http://172.16.3.4/",
    "http://192.168.1.10/",
    "http://0xc0a8010a/",  # 192.168.1.10
    "http://[fd12:3456::1]/",
    "http://[::ffff:10.0.0.1]/",
]
#: Private but not in the local stack's default (shared address space, benchmarking, documentation):
#: refused by both policies.
ODD = ["http://100.64.0.1/", "http://198.18.0.1/", "http://192.0.2.1/", "http://[2001:db8::1]/"]


@pytest.mark.parametrize("url", NEVER)
def test_metadata_and_link_local_targets_are_refused_by_every_policy(url: str) -> None:
    for policy in (AWS, LOCAL, Policy.parse("0.0.0.0/0,::/0")):  # even an operator's allow-all
        assert policy.url_refusal(url) is not None, url


@pytest.mark.parametrize("url", INWARD)
def test_loopback_and_private_targets_are_refused_on_aws_and_allowed_locally(url: str) -> None:
    assert AWS.url_refusal(url) is not None
    assert LOCAL.url_refusal(url) is None


@pytest.mark.parametrize("url", ODD)
def test_other_non_public_targets_are_refused_unless_listed(url: str) -> None:
    assert AWS.url_refusal(url) is not None and LOCAL.url_refusal(url) is not None
    assert Policy.parse("100.64.0.0/10,198.18.0.0/15,192.0.2.0/24,2001:db8::/32").url_refusal(url) is None


def test_public_targets_and_names_pass_the_url_check() -> None:
    for url in ("https://hooks.slack.com/services/T/B/x", "http://8.8.8.8/", "http://[2606:4700::1]/"):
        assert AWS.url_refusal(url) is None
    # A name is judged when it is resolved, at send time.
    assert AWS.url_refusal("https://chat.internal.example/hook") is None


def test_the_spellings_tried_are_many_and_all_are_addresses_or_names_that_mean_one() -> None:
    tried = NEVER + INWARD + ODD
    assert len(set(tried)) == len(tried) >= 30
    assert literal_address("2852039166") == literal_address("169.254.169.254")
    assert literal_address("chat.example") is None


def test_a_bad_allowed_network_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="'intranet'"):
        Policy.parse("10.0.0.0/8,intranet")


#: What a hostile name may resolve to, refused by the deployed default.
FORBIDDEN_ON_AWS = [
    "169.254.169.254",
    "fd00:ec2::254",
    "127.0.0.1",
    "10.1.2.3",
    "::ffff:169.254.169.254",
    "fe80::1",
]


@pytest.mark.parametrize("address", FORBIDDEN_ON_AWS)
def test_a_name_resolving_to_a_forbidden_address_is_refused_at_send_time(address: str) -> None:
    def resolve(host: str, port: int) -> list[str]:
        return [address]

    with pytest.raises(Refused, match="resolves to"):
        AWS.check("hooks.example", 443, resolve)


def test_one_forbidden_address_among_a_names_addresses_refuses_it() -> None:
    def resolve(host: str, port: int) -> list[str]:
        return ["93.184.215.14", "169.254.169.254"]

    with pytest.raises(Refused, match=r"169\.254\.169\.254"):
        LOCAL.check("hooks.example", 443, resolve)


class Receiver:
    """A loopback HTTP server answering POSTs with ``answer(handler)``; what it received is kept."""

    def __init__(self, answer: Any = None) -> None:
        self.received: list[tuple[str, bytes]] = []
        self.answer = answer
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.received.append((self.path, body))
                if outer.answer is not None:
                    outer.answer(self)
                    return
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for receiver in made:
        receiver.close()


def delivery(url: str) -> Delivery:
    return Delivery("d1", "p", url, {"text": "CRITICAL p/r: rank 5 stopped"})


def test_a_delivery_goes_to_the_address_checked_with_one_lookup(receivers: list[Receiver]) -> None:
    receiver = Receiver()
    receivers.append(receiver)
    port = receiver.server.server_address[1]
    lookups: list[str] = []

    def rebinding(host: str, port: int) -> list[str]:
        # A rebinding name: harmless the first time, the metadata service every time after.
        lookups.append(host)
        return ["127.0.0.1"] if len(lookups) == 1 else ["169.254.169.254"]

    outcome = send(delivery(f"http://hooks.example:{port}/hook"), LOCAL, timeout=5, resolve=rebinding)
    assert outcome.state == "delivered"
    assert lookups == ["hooks.example"]
    assert [path for path, _ in receiver.received] == ["/hook"]


def test_a_redirect_is_never_followed(receivers: list[Receiver]) -> None:
    target = Receiver()
    receivers.append(target)

    def redirect(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(307)  # 307 keeps the method and body: the worst case to follow
        handler.send_header("Location", target.url)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    first = Receiver(redirect)
    receivers.append(first)
    chain = Receiver(redirect)  # a chain: the first hop's target redirects again
    receivers.append(chain)
    for hop in (first, chain):
        outcome = send(delivery(hop.url), LOCAL, timeout=5)
        assert outcome.state == "failing"
        assert outcome.reason == "the webhook answered HTTP 307: a redirect, not followed"
    assert len(first.received) == len(chain.received) == 1
    assert target.received == []  # redirects followed: 0


def test_proxy_variables_are_ignored(receivers: list[Receiver], monkeypatch: pytest.MonkeyPatch) -> None:
    proxy, receiver = Receiver(), Receiver()
    receivers += [proxy, receiver]
    proxy_url = proxy.url.rsplit("/", 1)[0]
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, proxy_url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert send(delivery(receiver.url), LOCAL, timeout=5).state == "delivered"
    assert proxy.received == [] and len(receiver.received) == 1


def test_a_slow_answer_is_cut_at_the_deadline(receivers: list[Receiver]) -> None:
    released = threading.Event()

    def trickle(handler: BaseHTTPRequestHandler) -> None:
        # A byte of the status line at a time, each within any per-read timeout, never the whole.
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 1000:
            if released.wait(0.05):
                return
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()

    slow = Receiver(trickle)
    receivers.append(slow)
    started = time.monotonic()
    outcome = send(delivery(slow.url), LOCAL, timeout=1.0)
    took = time.monotonic() - started
    released.set()
    assert outcome.state == "failing"
    assert outcome.reason == "the webhook did not answer within 1 s"
    assert took < 10  # bounded by the deadline, not by 1,000 reads of 0.05 s each


def test_a_huge_answer_is_not_read_whole(receivers: list[Receiver]) -> None:
    written: list[int] = []

    def flood(handler: BaseHTTPRequestHandler) -> None:
        size = 200 * 2**20
        handler.send_response(200)
        handler.send_header("Content-Length", str(size))
        handler.end_headers()
        chunk, sent = b"x" * 2**16, 0
        try:
            while sent < size:
                handler.wfile.write(chunk)
                sent += len(chunk)
        except OSError:
            pass
        written.append(sent)

    huge = Receiver(flood)
    receivers.append(huge)
    assert send(delivery(huge.url), LOCAL, timeout=5).state == "delivered"
    deadline = time.monotonic() + 10
    while not written and time.monotonic() < deadline:
        time.sleep(0.01)
    assert written and written[0] < 200 * 2**20  # the sender closed after what it reads (64 KiB)
