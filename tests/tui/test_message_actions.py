"""Message actions under Pilot on the real engine: regenerate (the earlier reply kept as a
branch, flipped back with alt+left), edit and resend, delete, copy; branches survive a restart."""

from __future__ import annotations

from panechat.app.tui.widgets.transcript import AssistantMessage, BranchLabel, UserMessage

from .conftest import make_app, type_and_send, wait_for

SIZE = (160, 45)


def _idle(pane):
    return lambda: not pane.busy and pane.last_finish is not None


async def _reply(pilot, pane, n_replies: int):
    await wait_for(pilot, lambda: not pane.busy and sum(m.role == "assistant" for m in pane.history) == n_replies,
                   timeout=90, what=f"{n_replies} replies")


async def test_regenerate_keeps_the_earlier_reply_as_a_branch_that_flips_back(tui_engine, store):
    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        pane = app.main.panes[0]
        await type_and_send(pilot, pane, "Say hello")
        await _reply(pilot, pane, 1)
        first = pane.history[-1].content
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: pane.busy or pane.history[-1].role == "assistant", what="the regenerate")
        await _reply(pilot, pane, 1)
        await pilot.pause()
        assert [m.role for m in pane.history] == ["user", "assistant"]
        labels = [str(w.render()) for w in pane.query(BranchLabel)]
        assert labels and labels[0].startswith("< 2/2 >")
        conv = pane.conversation.id
        assert store.branches(conv)[1]["current"] == 1  # persisted
        pane.history[-1].content = "edited in memory only"  # flipping stores the live tail first
        await pilot.press("alt+left")
        await pilot.pause()
        assert pane.history[-1].content == first
        assert str(pane.query(BranchLabel).first().render()).startswith("< 1/2 >")
        assert [m.content for m in store.messages(conv)][-1] == first
        await pilot.press("alt+right")
        await pilot.pause()
        assert pane.history[-1].content == "edited in memory only"
    app = make_app(tui_engine, store)  # a restart reopens the branch point as it was left
    async with app.run_test(size=SIZE) as pilot:
        pane = app.main.panes[0]
        await pilot.pause()
        assert str(pane.query(BranchLabel).first().render()).startswith("< 2/2 >")
        pane.focus_input()
        await pilot.press("alt+left")
        await pilot.pause()
        assert pane.history[-1].content == first


async def test_edit_resends_and_keeps_what_followed_as_a_branch(tui_engine, store):
    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        pane = app.main.panes[0]
        await type_and_send(pilot, pane, "Name a color")
        await _reply(pilot, pane, 1)
        await type_and_send(pilot, pane, "Name a fruit")
        await _reply(pilot, pane, 2)
        # from the end ctrl+up selects reply 2, prompt 2, reply 1; ctrl+down comes back to prompt 2
        await pilot.press("ctrl+up", "ctrl+up", "ctrl+up", "ctrl+down")
        assert pane.selected == 2 and pane.query(UserMessage)[1].has_class("-selected")
        await pilot.press("ctrl+g")
        await pilot.pause()
        box = pane.query_one("PromptInput")
        assert box.value == "Name a fruit"
        box.clear()
        await pilot.press(*"Name an animal", "enter")
        await _reply(pilot, pane, 2)
        assert [m.content for m in pane.history][:3] == ["Name a color", pane.history[1].content, "Name an animal"]
        assert len(pane.history) == 4
        assert [m.content for m in store.messages(pane.conversation.id)][2] == "Name an animal"
        await pilot.press("alt+left")
        await pilot.pause()
        assert pane.history[2].content == "Name a fruit" and len(pane.history) == 4


async def test_delete_and_copy(tui_engine, store):
    app = make_app(tui_engine, store)
    copied = []
    app.copy_to_clipboard = copied.append
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        pane = app.main.panes[0]
        await type_and_send(pilot, pane, "Say hi")
        await _reply(pilot, pane, 1)
        await pilot.press("ctrl+l")
        assert copied == [pane.history[-1].content]
        pane.history[-1].content = "Here:\n```python\nprint(1)\n```\n"
        await pilot.press("ctrl+b")
        assert copied[-1] == "print(1)"
        await pilot.press("f8")
        await pilot.pause()
        assert [m.role for m in pane.history] == ["user"]
        assert len(pane.query(AssistantMessage)) == 0
        assert [m.role for m in store.messages(pane.conversation.id)] == ["user"]
        await pilot.press("ctrl+r")  # a prompt left without a reply is answered again
        await _reply(pilot, pane, 1)
        assert [m.role for m in store.messages(pane.conversation.id)] == ["user", "assistant"]


async def test_the_message_actions_are_in_the_command_palette(tui_engine, store):
    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE) as pilot:
        titles = [c.title for c in app.get_system_commands(app.main)]
        for t in ("Regenerate reply", "Edit prompt", "Delete message", "Copy reply", "Copy code block",
                  "Previous branch"):
            assert t in titles


async def test_a_refused_regenerate_keeps_the_prompt_and_the_old_reply_as_a_branch(tui_engine, store):
    from panechat.app.clients.local import LocalStream

    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        pane = app.main.panes[0]
        await type_and_send(pilot, pane, "Say hello")
        await _reply(pilot, pane, 1)
        first = pane.history[-1].content
        real = app.backend.stream
        app.backend.stream = lambda *a, **k: LocalStream(None, error="the engine queue is full")  # a refusal
        before = pane.last_finish
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: pane.last_finish is not before and not pane.busy, what="the refusal")
        app.backend.stream = real
        assert [m.role for m in pane.history] == ["user"] and pane.history[0].content == "Say hello"
        assert [m.content for m in store.messages(pane.conversation.id)] == ["Say hello"]
        await pilot.press("alt+left")
        await pilot.pause()
        assert pane.history[-1].content == first


async def test_broadcast_while_editing_does_not_replace_the_edited_prompt(tui_engine, store):
    app = make_app(tui_engine, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, app.backend_ready.is_set, what="the backend")
        pane = app.main.panes[0]
        await type_and_send(pilot, pane, "Name a color")
        await _reply(pilot, pane, 1)
        await pilot.press("ctrl+g")
        assert pane.send("Name a fruit")  # what broadcast does: a new turn, not the edit
        await _reply(pilot, pane, 2)
        assert [m.content for m in pane.history][::2] == ["Name a color", "Name a fruit"]
        assert not pane.branches
