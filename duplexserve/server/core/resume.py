"""Resume tokens and detached sessions (docs/protocol.md, "Resuming after a dropped connection").

A session whose connection ends while it is still open is *detached*: it keeps its
slot and its model state, the engine does not step it (no input arrives, so it hears
no invented silence), and its answers wait in the session's replay history. A new
connection that presents the session's current token within ``grace_s`` takes it
over. Tokens are single-use: every take-over issues a new one, so a token that leaked
from an old connection cannot steal the session later.

Behind a proxy of several replicas each replica has a name (``--replica-id``), and its
tokens are ``NAME.random``: the proxy routes a resume on the name to the one replica that
holds the session (docker/nginx/duplexserve.conf), with nothing for the client to keep but
the token. The random part alone is the secret; the name is not.

Detached sessions are kept in the order they detached, and by client (the per-client
quotas' key, core/client_address.py), so that under pressure the one that gives way is
the one detached longest of the client that must give: its own past
``--max-detached-per-client``, else the client holding the most detached sessions
(docs/protocol.md, "Under pressure"). One client's drops thus evict only its own.

The registry knows sessions and an opaque ``owner`` (the connection holding the
session, or None while detached) and ``state`` (what the adapter must carry over, such
as its resamplers); it knows nothing of sockets.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from duplexserve.server.core.session import Session

#: 24 random bytes: 192 bits, above the protocol's floor of 128.
TOKEN_BYTES = 24


@dataclass(eq=False)
class Resumable:
    """One open, resumable session and what its adapter needs to take it over."""

    session: Session
    token: str
    owner: Any  # the connection holding it; None while detached
    state: Any = None  # adapter state kept across connections (formats, codecs)
    client: str | None = None  # the per-client quotas' key while detached; None: not counted per client
    expiry: asyncio.TimerHandle | None = field(default=None, repr=False)


@dataclass(slots=True)
class ResumeCounts:
    resumed: int = 0
    expired: int = 0
    refused: int = 0
    evicted: int = 0


class ResumeRegistry:
    """Current tokens of open sessions; expiry of the detached ones."""

    def __init__(self, grace_s: float, on_expire: Callable[[Session], None], replica_id: str = "") -> None:
        self.grace_s = grace_s
        self._prefix = f"{replica_id}." if replica_id else ""
        self.counts = ResumeCounts()
        self._on_expire = on_expire
        self._by_token: dict[str, Resumable] = {}
        self._by_session: dict[int, Resumable] = {}  # id(session): entry
        self._detached: dict[Resumable, None] = {}  # in the order they detached
        self._detached_by: dict[str | None, dict[Resumable, None]] = {}  # the same, by client

    @property
    def enabled(self) -> bool:
        return self.grace_s > 0

    @property
    def detached(self) -> int:
        return len(self._detached)

    def entries(self) -> list[Resumable]:
        """Every open resumable session's entry (attached or detached): what a drain may move."""
        return list(self._by_session.values())

    def detached_sessions(self) -> list[Session]:
        return [entry.session for entry in self._detached]

    def detached_by(self, client: str | None) -> int:
        return len(self._detached_by.get(client, ()))

    def evict_oldest_of(self, client: str | None) -> Session | None:
        """The session of ``client`` detached longest, counted as evicted; the caller closes it
        (which calls :meth:`forget`, so its token is refused from then on). None if none waits."""
        entry = next(iter(self._detached_by.get(client, ())), None)
        if entry is None:
            return None
        self.counts.evicted += 1
        return entry.session

    def evict_oldest(self) -> Session | None:
        """As :meth:`evict_oldest_of` the client holding the most detached sessions (of several,
        the one whose oldest waited longest): a client with fewer never pays for its drops."""
        most = max(map(len, self._detached_by.values()), default=0)
        entry = next((e for e in self._detached if len(self._detached_by[e.client]) == most), None)
        return None if entry is None else self.evict_oldest_of(entry.client)

    def issue(self, session: Session, owner: Any, state: Any = None) -> Resumable:
        """Make ``session`` resumable; its first token."""
        entry = Resumable(session, self._new_token(), owner, state)
        self._by_token[entry.token] = entry
        self._by_session[id(session)] = entry
        return entry

    def _new_token(self) -> str:
        return self._prefix + secrets.token_urlsafe(TOKEN_BYTES)

    def entry_of(self, session: Session) -> Resumable | None:
        return self._by_session.get(id(session))

    def detach(self, entry: Resumable, loop: asyncio.AbstractEventLoop, client: str | None = None) -> None:
        """The connection is gone; keep the session for ``grace_s``, counted as ``client``'s."""
        entry.owner = None
        entry.session.detached = True
        entry.client = client
        self._detached[entry] = None
        self._detached_by.setdefault(client, {})[entry] = None
        if entry.expiry is not None:
            entry.expiry.cancel()
        entry.expiry = loop.call_later(self.grace_s, self._expire, entry)

    def _expire(self, entry: Resumable) -> None:
        entry.expiry = None
        if entry in self._detached:
            self.counts.expired += 1
            self._on_expire(entry.session)  # closes the session, which calls forget()

    def peek(self, token: str) -> Resumable | None:
        """The open session of a live token, without spending it."""
        entry = self._by_token.get(token)
        return None if entry is None or entry.session.closed else entry

    def claim(self, token: str) -> Resumable | None:
        """Take the session of ``token`` over for ``owner``; the token is spent.

        Returns None (counted as refused) for an unknown, used or expired token. The
        caller must check the entry's previous owner (a half-open connection) itself:
        ``claim`` returns it in ``entry.owner`` until :meth:`attach`.
        """
        entry = self._by_token.pop(token, None)
        if entry is None or entry.session.closed:
            self.counts.refused += 1
            return None
        if entry.expiry is not None:
            entry.expiry.cancel()
            entry.expiry = None
        self._undetach(entry)
        entry.session.detached = False
        return entry

    def _undetach(self, entry: Resumable) -> None:
        if entry in self._detached:
            del self._detached[entry]
            group = self._detached_by[entry.client]
            del group[entry]
            if not group:
                del self._detached_by[entry.client]

    def attach(self, entry: Resumable, owner: Any) -> str:
        """``owner`` now holds the session; its new token."""
        entry.owner = owner
        entry.token = self._new_token()
        self._by_token[entry.token] = entry
        self.counts.resumed += 1
        return entry.token

    def refuse(self) -> None:
        self.counts.refused += 1

    def forget(self, session: Session) -> None:
        """The session ended: its token is dead and it is no longer detached."""
        entry = self._by_session.pop(id(session), None)
        if entry is None:
            return
        self._by_token.pop(entry.token, None)
        self._undetach(entry)
        if entry.expiry is not None:
            entry.expiry.cancel()
            entry.expiry = None
        entry.owner = entry.state = None
