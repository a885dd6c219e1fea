"""Bearer tokens, principals and scopes (docs/protocol.md D7).

With a tokens file every request needs `Authorization: Bearer <token>`; the
token is compared, in constant time, against every configured token (so the
time taken says nothing about which token nearly matched). Without one, the
service only listens on loopback, answers only requests addressed to a loopback name
or to a name given with `--allow-host`, and everyone is the principal "local".
Tokens are never logged, and never appear in an error's detail.
"""

import hashlib
import hmac
import ipaddress
import json
import re
from dataclasses import dataclass
from pathlib import Path

from lmsp_min.problems import Problem

SCOPES = ("models:read", "responses:write", "responses:read", "tasks:write", "tasks:read",
          "tools:execute")
LOCAL_PRINCIPAL = "local"


def _digest(token: str) -> bytes:
    """Tokens are kept and compared as SHA-256 digests: equal lengths, so the
    comparison's time does not even say how long a configured token is."""
    return hashlib.sha256(token.encode("utf-8")).digest()


@dataclass(frozen=True)
class Token:
    digest: bytes  # SHA-256 of the token
    principal: str
    scopes: frozenset[str]

    def __repr__(self) -> str:  # never print a secret, even in a debugging session
        return f"Token(principal={self.principal!r}, scopes={sorted(self.scopes)})"


class Auth:
    """Who is calling, and may they call this route?"""

    def __init__(self, tokens: list[Token] | None = None, allowed_hosts=()):
        self.tokens = list(tokens or [])
        # --allow-host: names a request may be addressed to without tokens, beside the loopback ones
        self.allowed_hosts = frozenset(map(host_name, allowed_hosts))

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    @classmethod
    def from_file(cls, path: str | Path) -> "Auth":
        """Read a tokens file: a JSON list of {"token", "principal", "scopes"}.

        Raises ValueError with a message for the command line (never quoting a token).
        """
        try:
            entries = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"cannot read the tokens file {path}: {exc.strerror}") from None
        except ValueError:
            raise ValueError(f"the tokens file {path} is not valid JSON") from None
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"the tokens file {path} must hold a non-empty JSON list")
        tokens = []
        for index, entry in enumerate(entries):
            where = f"the tokens file {path}, entry {index}"
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: must be an object")
            secret, principal, scopes = entry.get("token"), entry.get("principal"), entry.get("scopes")
            if not isinstance(secret, str) or not secret:
                raise ValueError(f"{where}: 'token' must be a non-empty string")
            if not _sendable(secret):
                raise ValueError(f"{where}: 'token' must be printable ASCII without spaces around it, "
                                 "as a client can send it in 'Authorization: Bearer <token>'")
            if not isinstance(principal, str) or not principal:
                raise ValueError(f"{where}: 'principal' must be a non-empty string")
            if not isinstance(scopes, list) or not all(isinstance(s, str) for s in scopes):
                raise ValueError(f"{where}: 'scopes' must be a list of strings")
            unknown = [s for s in scopes if s not in SCOPES]
            if unknown:
                raise ValueError(f"{where}: unknown scope {unknown[0]!r} (known: {', '.join(SCOPES)})")
            if any(hmac.compare_digest(_digest(secret), t.digest) for t in tokens):
                raise ValueError(f"{where}: the same token appears twice")
            tokens.append(Token(_digest(secret), principal, frozenset(scopes)))
        return cls(tokens)

    def _addressed_locally(self, host: str) -> bool:
        """Whether a Host header ("localhost:8080", "[::1]:8080") names this machine, by a
        loopback name or one of `allowed_hosts`."""
        name = (host.partition("]")[0] + "]") if host.startswith("[") else host.partition(":")[0]
        name = name.lower().rstrip(".")
        # RFC 6761: *.localhost is loopback
        return name.endswith(".localhost") or is_loopback(name) or name in self.allowed_hosts

    def authenticate(self, authorization: str | None, scope: str, host: str | None) -> str:
        """The principal of a request that needs `scope`, or a 401 / 403 problem.

        Without tokens, only a request addressed to a loopback name (its `Host`) is
        the principal "local": a web page can point its own domain name at 127.0.0.1
        (DNS rebinding), and the user's browser would then send it requests that pass
        as the same origin; they carry that domain as their Host. A request without a
        Host (HTTP/1.0) comes from no browser, and passes. A name given with `--allow-host`
        passes too (host.docker.internal, as a container addresses this machine): a page can
        only send it from a domain of that name, whose DNS its owner controls.
        """
        if not self.tokens:
            if host is not None and not self._addressed_locally(host):
                raise Problem("invalid_request", "without tokens this service answers only requests "
                              "addressed to this machine by a loopback name or address "
                              "(localhost, 127.0.0.1, [::1]) or by a name given with --allow-host")
            return LOCAL_PRINCIPAL
        challenge = [("WWW-Authenticate", 'Bearer realm="lmsp"')]
        scheme, _, credentials = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            raise Problem("unauthorized", "a bearer token is required", headers=challenge)
        presented = _digest(credentials.strip())
        match = None
        for token in self.tokens:  # no early exit: every token is compared
            if hmac.compare_digest(presented, token.digest):
                match = token
        if match is None:
            invalid = [("WWW-Authenticate", 'Bearer realm="lmsp", error="invalid_token"')]
            raise Problem("unauthorized", "the bearer token is not valid", headers=invalid)
        if scope not in match.scopes:
            raise Problem(
                "insufficient_scope",
                f"this request needs the scope '{scope}'",
                headers=[("WWW-Authenticate", f'Bearer realm="lmsp", error="insufficient_scope", scope="{scope}"')],
            )
        return match.principal


def _sendable(token: str) -> bool:
    """Whether a request can present `token`: header values arrive as ASCII (other bytes are
    read as Latin-1, and a client sends UTF-8), and the credentials are stripped of spaces.
    A token that fails this could never match, and its principal would only ever get 401."""
    return token.isascii() and token.isprintable() and token == token.strip()


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the service on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# A host name or IP address without a port (an IPv6 address in brackets)
_HOST_NAME = re.compile(r"[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?|\[[0-9a-f:.]+\]")


def host_name(text: str) -> str:
    """`--allow-host`'s value as a Host header names it (lowercase, no final dot); ValueError
    with a message for the command line."""
    name = text.strip().lower().rstrip(".")
    if not _HOST_NAME.fullmatch(name):
        raise ValueError(f"{text!r} is not a host name or address (without a port): "
                         "e.g. host.docker.internal")
    return name
