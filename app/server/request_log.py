"""One log line per HTTP request, written when its response is complete (pure ASGI, so
streaming is not buffered); handlers add detail with `set_log_detail`."""

from __future__ import annotations

import logging
import time

from starlette.requests import Request


class RequestLog:
    """Logs one line per HTTP request when its response is complete; handlers may add
    detail by setting `request.scope["panechat.log"]["detail"]`."""

    def __init__(self, app, logger: logging.Logger):
        self.app = app
        self.log = logger

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        holder = scope["panechat.log"] = {"status": 0, "detail": ""}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                holder["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            client = scope.get("client") or ("-", 0)
            detail = holder["detail"]
            self.log.info('%s:%s "%s %s" %s %.2fs%s', client[0], client[1], scope["method"], scope["path"],
                          holder["status"] or "-", time.perf_counter() - t0, f" {detail}" if detail else "")


def set_log_detail(request: Request, detail: str) -> None:
    holder = request.scope.get("panechat.log")
    if holder is not None:
        holder["detail"] = detail
