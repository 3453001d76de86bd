"""``/v1/twilio/MODEL``: the model of a Twilio call named in the path.

Twilio drops the query string of a ``<Stream url=...>``, and its ``<Parameter>`` values arrive
only in the ``start`` message, after the upgrade a gateway routes. So ``?model=`` cannot pick
a model's pool for a phone call; a path can (docker/nginx/duplexserve.conf and the Gateway's
HTTPRoute route ``/v1/twilio/MODEL`` to MODEL's replicas). The replica reads the same name as
``?model=``: refused ``model_not_found`` where it does not serve it.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

PREFIX = "/v1/twilio/"


def rewrite_model_path(scope: dict[str, Any]) -> None:
    """Turn ``/v1/twilio/MODEL`` into ``/v1/twilio?model=MODEL`` in ``scope``, in place (one
    segment only; the path's name wins over a ``?model=``, which comes first). Any other path is
    left as is."""
    path = scope.get("path", "")
    if not path.startswith(PREFIX):
        return
    model = path[len(PREFIX):]
    if not model or "/" in model:
        return
    query = scope.get("query_string", b"")
    extra = b"model=" + quote(model, safe="").encode("ascii")
    scope["path"] = PREFIX.rstrip("/")
    scope["query_string"] = query + b"&" + extra if query else extra
