"""A backend that answers at once, and the paste measurements test_paste.py and the
`-m bench` figure in test_ui_cost.py share: time until a paste shows, and a key's latency
right after it."""

from __future__ import annotations

import time

from textual import events

from panechat.app.clients.base import BackendInfo, ChatBackend, ChatStream, Finished
from panechat.app.tui.widgets.prompt_input import PromptInput


class _Echo(ChatStream):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    async def __aiter__(self):
        yield Finished("stop", self.text, {"prompt_tokens": 1, "completion_tokens": 1})

    def cancel(self) -> None:
        pass


class EchoBackend(ChatBackend):
    """Replies 'ok' at once and keeps every prompt it was sent (`sent`)."""

    profile = "echo"

    def __init__(self):
        self.info = BackendInfo(kind="local", model="echo", ctx=4096)
        self.sent: list[list[dict]] = []

    async def start(self):
        return self.info

    def stream(self, conversation, messages, params, system="", model=""):
        self.sent.append(messages)
        return _Echo("ok")

    def stats(self):
        return None


def filler(n: int, line: int = 80) -> str:
    """`n` characters of prose in lines of `line` characters."""
    words = ("lorem ipsum dolor sit amet consectetur adipiscing elit " * (line // 50 + 2))[: line - 1] + "\n"
    return (words * (n // line + 1))[:n]


async def wait_until(pilot, predicate, timeout: float) -> float:
    """Seconds until predicate() holds (AssertionError after `timeout`)."""
    t0 = time.perf_counter()
    while not predicate():
        if time.perf_counter() - t0 > timeout:
            raise AssertionError(f"not done after {timeout:.0f} s")
        await pilot.pause(0.005)
    return time.perf_counter() - t0


async def paste_figures(pilot, box: PromptInput, text: str, *, as_keys: bool, timeout: float = 10.0) -> tuple[float, float]:
    """Paste `text` into the focused `box` (one Paste event, or as a terminal without
    bracketed paste sends it: one key event per character); returns (seconds until the
    box holds all of it, seconds until a key pressed next shows)."""
    app = pilot.app
    before = box.value
    if as_keys:
        for ch in text:  # what the driver posts for each character read
            app.post_message(events.Key("enter" if ch == "\r" else ch, ch))
    else:
        app.post_message(events.Paste(text))
    shown = await wait_until(pilot, lambda: box.value == before + text, timeout)
    app.post_message(events.Key("x", "x"))
    key = await wait_until(pilot, lambda: box.value.endswith("x"), timeout)
    return shown, key
