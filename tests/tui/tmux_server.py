"""A private tmux server for one test: its own socket (no other sessions, no user config),
killed when the test ends.

Each test gets its own socket because a server exits when its last session ends: a test that
closes its last session and opens the next one on the same socket can reach the server while
it shuts down, and tmux answers `server exited unexpectedly`. `new-session` retries that."""

from __future__ import annotations

import itertools
import os
import subprocess
import time

_COUNT = itertools.count()


class TmuxServer:
    """`tmux -L <socket>` commands on a server of this test's own."""

    def __init__(self, label: str):
        self.socket = f"panechat-{label}-{os.getpid()}-{next(_COUNT)}"

    def __call__(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, "-f", "/dev/null", *args], check=True,
                              capture_output=True, text=True, timeout=30).stdout

    def new_session(self, name: str, size: tuple[int, int], command: str) -> str:
        """Start `command` in a detached session `name` of `size` (columns, rows)."""
        for attempt in range(5):
            try:
                self("new-session", "-d", "-s", name, "-x", str(size[0]), "-y", str(size[1]), command)
                return name
            except subprocess.CalledProcessError as e:
                if "server exited unexpectedly" not in (e.stderr or "") or attempt == 4:
                    raise
                time.sleep(0.2)  # the previous server is still shutting down
        return name

    def capture(self, session: str) -> str:
        return self("capture-pane", "-p", "-t", session)

    def poll(self, session: str, predicate, timeout: float, what: str, step: float = 0.5) -> str:
        """The screen once `predicate(screen)` holds; fails naming `what` after `timeout` s."""
        return self.timed_poll(session, predicate, timeout, what, step)[0]

    def timed_poll(self, session: str, predicate, timeout: float, what: str,
                   step: float = 0.05) -> tuple[str, float]:
        """`poll`, and the seconds it took (checked every `step` s)."""
        t0 = time.monotonic()
        while True:
            screen = self.capture(session)
            if predicate(screen):
                return screen, time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; the screen was:\n{screen}")
            time.sleep(step)

    def send(self, session: str, text: str) -> None:
        """Type `text` literally, then Enter."""
        self("send-keys", "-t", session, "-l", text)
        self("send-keys", "-t", session, "Enter")

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)
