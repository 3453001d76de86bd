"""Client secrets (``POST /v1/realtime/client_secrets``): keys a browser may hold.

A backend that holds the server's API key mints one and hands it to its web page; the
page presents it as its bearer key to ``POST /v1/realtime/calls``. Each secret is good
for one call and for ``expires_after.seconds`` (10 to 7200, default 600), whichever ends
first; OpenAI's may start several sessions until they expire, these only one, so a
secret that leaks from a page is worth one conversation at most. Only an answered call
spends it: a request that fails (a bad offer, a body over the limit, a full server) leaves
it good, so a page can try again; such a request costs the server no more than the 64 KiB
a body may have (server/request_body.py), however often it is repeated. The session config a
secret was minted with applies to its call, under what the call's own ``session`` says.
Kept in memory: a restart forgets them (a page asks its backend for a new one).
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

DEFAULT_TTL_S = 600
MIN_TTL_S, MAX_TTL_S = 10, 7200
#: Secrets outstanding at most; minting past it forgets the oldest.
MAX_SECRETS = 10_000
PREFIX = "ek_"


@dataclass(slots=True)
class Secret:
    value: str
    expires_at: float  # epoch seconds, as the response says
    session: dict[str, Any]
    model: str

    def response(self) -> dict[str, Any]:
        """What OpenAI's endpoint answers (the SDK's ``ClientSecretCreateResponse``)."""
        session = {"type": "realtime", "object": "realtime.session", "id": "sess_" + self.value[-12:],
                   "model": self.session.get("model", self.model), "expires_at": int(self.expires_at)}
        return {"value": self.value, "expires_at": int(self.expires_at), "session": session}


class ClientSecrets:
    def __init__(self, clock: Any = time.time) -> None:
        self._clock = clock
        self._secrets: dict[str, Secret] = {}

    def mint(self, spec: Any, model: str) -> Secret:
        """A new secret from the request body (``expires_after``, ``session``); ValueError
        says what in it is wrong."""
        if not isinstance(spec, dict):
            raise ValueError("the body is a JSON object")
        expires = spec.get("expires_after") or {}
        if not isinstance(expires, dict) or expires.get("anchor", "created_at") != "created_at":
            raise ValueError("expires_after is {'anchor': 'created_at', 'seconds': n}")
        ttl = expires.get("seconds", DEFAULT_TTL_S)
        if not isinstance(ttl, int) or isinstance(ttl, bool) or not MIN_TTL_S <= ttl <= MAX_TTL_S:
            raise ValueError(f"expires_after.seconds is an integer from {MIN_TTL_S} to {MAX_TTL_S}")
        session = spec.get("session")
        session = {} if session is None else session
        if not isinstance(session, dict):
            raise ValueError("session is an object")
        if session.get("type", "realtime") != "realtime":
            raise ValueError("only session.type 'realtime' is supported")
        self._purge()
        while len(self._secrets) >= MAX_SECRETS:
            self._secrets.pop(next(iter(self._secrets)))
        secret = Secret(PREFIX + secrets.token_urlsafe(24), self._clock() + ttl, session, model)
        self._secrets[secret.value] = secret
        return secret

    def take(self, presented: Iterable[str]) -> Secret | None:
        """The unexpired secret among ``presented``, removed (single use); None if none.
        A call that is then not answered gives it back (:meth:`give_back`)."""
        found = self._find(presented)
        if found is not None:
            del self._secrets[found.value]
        return found

    def valid(self, presented: Iterable[str]) -> bool:
        """Whether an unexpired secret is among ``presented``, left unspent."""
        return self._find(presented) is not None

    def _find(self, presented: Iterable[str]) -> Secret | None:
        """The unexpired secret among ``presented`` (an expired one found is forgotten)."""
        now = self._clock()
        for key in presented:
            if not key.startswith(PREFIX):
                continue
            found = self._secrets.get(key)
            # The dict lookup finds the candidate; the constant-time compare is the check.
            if found is not None and hmac.compare_digest(found.value.encode(), key.encode()):
                if found.expires_at > now:
                    return found
                del self._secrets[key]
        return None

    def give_back(self, secret: Secret | None) -> None:
        """A call that failed before it was answered did not use its secret."""
        if secret is not None and secret.expires_at > self._clock():
            self._secrets[secret.value] = secret

    def _purge(self) -> None:
        now = self._clock()
        for value in [v for v, s in self._secrets.items() if s.expires_at <= now]:
            del self._secrets[value]
