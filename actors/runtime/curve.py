"""Links between nodes: ZMQ over TCP with CurveZMQ, its keys derived from a secret the nodes share.

The secret comes from the environment (SLUICE_CLUSTER_SECRET; `--cluster-secret` sets it in the launcher, so it never
appears in a child's command line or spawn config). Each end derives two key pairs from it (PBKDF2-HMAC-SHA256, a
salt per role): the server's, which a client must know to complete a handshake with it, and the one client key the
server accepts (its ZAP handler refuses any other, with a log line). Traffic is encrypted and authenticated: a peer
without the secret neither reads nor sends one message. `derive` makes other keys from it (a gang's store's), never
sending or storing the secret itself. A client watches its handshakes (a socket monitor): three that fail in a row
(a wrong secret at either end) raise `Refused`.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from messages.codec import BadFrame, Codec
from messages.wire import Msg

log = logging.getLogger("sluice.curve")
SECRET_ENV = "SLUICE_CLUSTER_SECRET"
_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


class Refused(Exception):
    """The other end refused the handshake (or could not be authenticated): the secrets differ."""


def cluster_secret() -> str:
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise ValueError(f"nodes authenticate with a shared secret: set {SECRET_ENV} (or --cluster-secret)")
    return secret


@functools.cache
def _stretched(secret: str, role: str) -> bytes:
    """32 bytes of `secret` for `role` (PBKDF2-HMAC-SHA256, 100,000 rounds: slow to guess, not strong if it is weak)."""
    return hashlib.pbkdf2_hmac("sha256", secret.encode(), f"sluice-cluster-{role}".encode(), 100_000)


def keypair(secret: str, role: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys of `role` ("server" or "client") for this cluster secret."""
    private = z85.encode(_stretched(secret, role))
    return zmq.curve_public(private), private


def derive(secret: str, label: str) -> bytes:
    """A 32-byte key for `label` (e.g. a gang's store: gpu/distributed/store.py): HMAC-SHA256 under the secret
    stretched as the key pairs' seeds are, so what it keys tells nothing of the secret and a guess costs a PBKDF2."""
    return hmac.digest(_stretched(secret, "derived"), label.encode(), "sha256")


class _OneClient:
    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        if key != self.public:
            log.warning("refused a node whose key is not derived from this cluster's secret")
        return key == self.public


def server(ctx: zmq.asyncio.Context, secret: str, address: str) -> tuple[zmq.asyncio.Socket, AsyncioAuthenticator]:
    """A ROUTER bound at `address` (tcp://host:port) that accepts only this secret's clients; stop the authenticator
    when the socket is closed."""
    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_OneClient(keypair(secret, "client")[0]))
    sock = ctx.socket(zmq.ROUTER)
    sock.curve_publickey, sock.curve_secretkey = keypair(secret, "server")
    sock.curve_server = True
    sock.linger = 0
    sock.bind(address)
    return sock, auth


def client(
    ctx: zmq.asyncio.Context, secret: str, address: str, identity: bytes
) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
    """A DEALER connecting (and reconnecting, under the same `identity`) to `address` as this secret's client, and
    its monitor (`handshakes`)."""
    sock = ctx.socket(zmq.DEALER)
    sock.routing_id = identity
    sock.curve_serverkey = keypair(secret, "server")[0]
    sock.curve_publickey, sock.curve_secretkey = keypair(secret, "client")
    sock.linger = 0
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | _FAILED)
    sock.connect(address)
    return sock, monitor


async def log_refusals(monitor: zmq.asyncio.Socket) -> None:
    """A server's side: a log line per failed handshake (`server_monitor`)."""
    while True:
        message = await recv_monitor_message(monitor)
        log.warning("refused a peer at %s: its handshake failed (a wrong cluster secret?)", message["endpoint"])


def server_monitor(sock: zmq.asyncio.Socket) -> zmq.asyncio.Socket:
    return sock.get_monitor_socket(_FAILED)


async def handshakes(monitor: zmq.asyncio.Socket, address: str, tries: int = 3) -> None:
    """Logs each handshake with `address`; raises Refused after `tries` failed in a row (one alone may be a server
    that died in the middle of it)."""
    failed = 0
    while True:
        event = (await recv_monitor_message(monitor))["event"]
        failed = failed + 1 if event & _FAILED else 0
        if failed >= tries:
            raise Refused(f"{address} refused the handshake: is the cluster secret the same on every node?")
        if not failed:
            log.info("authenticated with %s", address)


async def receive(sock: zmq.asyncio.Socket, codec: Codec, who: str) -> tuple[bytes, Msg]:
    """A server's next well-formed message and its peer; a malformed one is logged (naming `who` sent it) and
    dropped."""
    while True:
        frames = await sock.recv_multipart()
        try:
            peer, frame = frames
            return peer, codec.decode(frame)
        except (ValueError, BadFrame) as e:
            log.warning("dropped a bad message from %s: %s", who, e)
