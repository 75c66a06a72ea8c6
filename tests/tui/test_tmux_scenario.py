"""Issue 24 items 6, 4, 2 and 5 in a real terminal: one `panechat` in tmux at 80x24, then
the same data folder reopened (the start-up dominates, so one process does all it can).

- 6 (80x24): the panes get the width (the prompt box shows its whole placeholder), the
  dashboard is one line and the footer keeps F2-F5 and Quit. The old layout kept a
  46-column dashboard beside 34-column panes: the placeholder was cut, F2-F5 fell off.
- 4 (a 40 KB paste, tmux `paste-buffer -p`, i.e. bracketed paste): it shows, as one
  `[pasted text #1: ...]` chip, within PASTE_SHOWS_S, and a key typed after it shows within
  KEY_SHOWS_S. The old box soft-wrapped the whole paste (about two minutes at 90% CPU).
- 2 (a prompt longer than the context): it is refused, with the error on screen, and the
  next message gets a reply; the refused prompt reaches neither the store nor the pane's
  name. The old pane kept the refused message, so every later send failed the same way.
- 5 (ctrl+q while decoding): the reopened app shows the partial reply marked `[cut off]`,
  and the store holds it with cut_off. The old app lost the reply (only the prompt stayed).
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

from panechat.app.store import Store

PANECHAT = Path(sys.executable).with_name("panechat")
pytestmark = pytest.mark.skipif(shutil.which("tmux") is None or not PANECHAT.exists(),
                                reason="needs tmux and the panechat script")

PASTE_SHOWS_S = 1.5  # issue 24 asks for a second; half more for a loaded 2-core CI machine
KEY_SHOWS_S = 1.0
CTX = 1024
PASTE = ("lorem ipsum dolor sit amet " * 1500)[:40_000]  # 40 KB: about 10k tokens, far past CTX
CHIP = re.compile(r"\[pasted text #\d+: 40,000 chars\]")
BACK = re.compile(r"\[pasted text #\d+: [\d,]+ chars\]")  # the refused prompt, given back to the box
DECODING = re.compile(r"decoding · [\d.]+ tok/s · (\d+) tok")
PLACEHOLDER = "Message  (Enter sends, ctrl+j newline)"


def test_small_terminal_paste_refusal_and_quit_mid_reply(tmp_path, model_path, tmux):
    data = tmp_path / "data"
    st = Store.open(data)
    st.set_setting("default_max_tokens", "600")  # long enough to be mid-reply at ctrl+q
    st.close()
    paste_file = tmp_path / "paste.txt"
    paste_file.write_text(PASTE)
    env = f"PANECHAT_DATA_DIR={data} PANECHAT_EXPORT_DIR={tmp_path} XDG_CACHE_HOME={tmp_path / 'cache'}"
    run = f"env {env} {PANECHAT} --ctx-size {CTX}"
    s = "scenario"
    tmux.new_session(s, (80, 24), f"{run}; echo PANECHAT-EXIT $?; {run}; echo PANECHAT-EXIT2 $?; sleep 60")
    screen = tmux.poll(s, lambda x: "Message" in x and "batch" in x, 60, "the TUI to start", step=0.3)
    # item 6: the pane has the width, the dashboard a line, the footer its keys
    assert PLACEHOLDER in screen, screen
    assert re.search(r"batch \d+/\d+ +queue \d+", screen), screen
    footer = screen.rstrip().splitlines()[-1]
    assert all(k in footer for k in ("f2 Settings", "f3 Export", "f4 Open", "f5 Model", "Quit")), footer

    # item 4: a 40 KB bracketed paste shows at once, and the keys after it respond
    tmux("load-buffer", str(paste_file))
    tmux("paste-buffer", "-p", "-d", "-t", s)
    _, shown_s = tmux.timed_poll(s, lambda x: CHIP.search(x) is not None, 30, "the paste to show")
    assert shown_s < PASTE_SHOWS_S, f"the 40 KB paste took {shown_s:.2f} s to show"
    tmux("send-keys", "-t", s, "-l", " Zq")
    _, key_s = tmux.timed_poll(s, lambda x: re.search(CHIP.pattern + r" Zq", x) is not None, 30, "the typed keys")
    assert key_s < KEY_SHOWS_S, f"keys after the paste took {key_s:.2f} s to show"

    # item 2: the too-long prompt is refused, the pane still chats
    tmux("send-keys", "-t", s, "Enter")
    screen = tmux.poll(s, lambda x: f"context holds {CTX}" in x and "New chat" in x and BACK.search(x), 30,
                       "the refusal, the prompt back in the box and the pane's name given back")
    # the refusal's toast covers the right of the status line, where the token count is: a fast
    # CPU finishes the 600-token reply (3 s) before the toast's 8 s are up
    tmux.poll(s, lambda x: "pane 1: " not in x, 15, "the refusal's toast to go", step=0.1)
    tmux("send-keys", "-t", s, "C-u")  # clear the box
    tmux.poll(s, lambda x: BACK.search(x) is None, 10, "the box to clear", step=0.05)
    tmux("send-keys", "-t", s, "-l", "Write a long story about a dragon")
    tmux("send-keys", "-t", s, "Enter")

    # item 5: quit while decoding, reopen, the partial reply is there, marked
    tmux.poll(s, lambda x: (m := DECODING.search(x)) is not None and int(m.group(1)) >= 8, 120,
              "the reply to stream", step=0.05)
    tmux("send-keys", "-t", s, "C-q")
    tmux.poll(s, lambda x: "PANECHAT-EXIT 0" in x, 30, "a clean exit", step=0.05)
    screen = tmux.poll(s, lambda x: "[cut off]" in x, 60, "the reopened app to show the cut-off reply", step=0.3)
    tmux("send-keys", "-t", s, "C-q")
    tmux.poll(s, lambda x: "PANECHAT-EXIT2 0" in x, 30, "the second clean exit")

    st = Store.open(data)
    try:
        (conv,) = st.list_conversations()
        assert conv.title.startswith("Write a long story"), conv.title  # not named by the refused paste
        kept = st.messages(conv.id)
    finally:
        st.close()
    assert [(m.role, m.content[:33]) for m in kept][:1] == [("user", "Write a long story about a dragon")], kept
    assert [m.role for m in kept] == ["user", "assistant"] and kept[1].meta.get("cut_off") is True, kept
    assert kept[1].content.strip() and "lorem ipsum" not in kept[0].content
