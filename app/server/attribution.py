"""Who a request is, for fair admission (engine/serving/fair_queue.py), the dashboard and
/metrics: its --tokens name when the server has named tokens, else its websocket terminal
(websocket.py), else its remote address. Every HTTP route that submits a generation asks
`client_of(request)`, so each protocol attributes the same way."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import HTTPConnection

__all__ = ["client_of", "USER_KEY", "ClientUsage", "UsageByClient"]

#: The scope key under which the token check (ServerState.check_bearer) leaves the name.
USER_KEY = "panechat.user"


def client_of(request: HTTPConnection) -> str:
    """The client `request` is attributed to: the --tokens name it authenticated with,
    else the address it comes from (all requests from one address are one client)."""
    user = request.scope.get(USER_KEY)
    if user:
        return user
    peer = request.client
    return peer.host if peer is not None else "-"


@dataclass
class ClientUsage:
    """What one client (a /metrics label) has asked of the server."""

    requests: int = 0  # generations submitted and queued
    refused: int = 0  # ... refused with 429 (the queue, or its own part of it, full)
    prompt_tokens: int = 0
    completion_tokens: int = 0


class UsageByClient:
    """Per-client counters for /metrics, labelled by --tokens name. Without named tokens
    every client is "-": addresses and terminal ids are unbounded, so no label of theirs."""

    ANONYMOUS = "-"

    def __init__(self, named: bool):
        self.named = named
        self.by_label: dict[str, ClientUsage] = {}

    def label(self, client: str) -> str:
        return client if self.named and client else self.ANONYMOUS

    def of(self, client: str) -> ClientUsage:
        label = self.label(client)
        u = self.by_label.get(label)
        if u is None:
            u = self.by_label[label] = ClientUsage()
        return u
