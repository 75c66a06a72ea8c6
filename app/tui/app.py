"""The panechat Textual App: themes, the command palette, the backend's life cycle."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Iterable

from textual import events, work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen
from textual.theme import Theme

from panechat.backends.errors import one_line
from panechat.themes import DEFAULT_THEME, THEMES
from ..clients.base import BackendError, ChatBackend
from ..store import Store
from .commands import Command
from .screens.help import HelpScreen, key_groups
from .screens.main import APP, MainScreen
from .widgets.dashboard import Dashboard
from .widgets.prompt_input import PromptInput

# Textual's own palette entries that ours replace: its Keys panel (F1's help instead) and
# its Maximize (ctrl+o maximizes the pane)
REPLACED_COMMANDS = {"Keys", "Maximize", "Minimize"}

ShareHook = Callable[["PanechatApp"], Awaitable[str]]


class PanechatApp(App):
    """Conversation panes over one ChatBackend, with a live batch dashboard.

    `share`, when given, is awaited once the backend is up (it hosts the server for
    `--share`) and returns a line to show; `close_share` is awaited at exit."""

    TITLE = "panechat"
    BINDINGS = [
        Command("f1", "help", "Help", show=False, title="Keys", tooltip="This list of the app's keys",
                group_name=APP),
        # shown in the footer (Textual's own ctrl+q is hidden)
        Binding("ctrl+q", "quit", "Quit", priority=True, tooltip="Quit (conversations and layout are saved)"),
    ]
    CSS = """
    Screen { layout: vertical; }
    MainScreen > Horizontal { height: 1fr; }
    MainScreen.-narrow > Horizontal { layout: vertical; }
    """

    def __init__(self, backend: ChatBackend, store: Store, *, share: ShareHook | None = None,
                 close_share: Callable[[], Awaitable[None]] | None = None):
        super().__init__()
        self.backend = backend
        self.store = store
        self.share = share
        self.close_share = close_share
        self.backend_ready = asyncio.Event()
        self.fatal_error: str | None = None
        self.share_line: str | None = None
        self._backend_closed = False  # the backend (and sharing) closed: `_close_backend`
        for theme in THEMES:
            self.register_theme(theme)
        self.theme = self._saved_theme()

    async def on_event(self, event: events.Event) -> None:
        # a printable key for a prompt box goes straight to it: a paste without bracketed
        # paste is one key event per character, and the binding lookup per key is the cost
        if isinstance(event, events.Key) and not event.is_forwarded:
            if not self.app_focus:  # a blurred app (a browser tab) has no focus until a key gives it back:
                self.app_focus = True  # before the check, or this key would land after the rest of its burst
            if isinstance(self.focused, PromptInput) and self.focused.take_typed(event):
                return
        await super().on_event(event)

    def _saved_theme(self) -> str:
        name = self.store.get_setting("theme", DEFAULT_THEME)
        return name if name in self.available_themes else DEFAULT_THEME

    # -- life cycle ------------------------------------------------------------------------
    async def on_mount(self) -> None:
        self.theme_changed_signal.subscribe(self, self._on_theme_changed)
        self.main = MainScreen(self.backend, self.store)
        await self.push_screen(self.main)
        self._start_backend()

    @work(exclusive=True, group="backend")
    async def _start_backend(self) -> None:
        dash = self.main.query_one(Dashboard)
        dash.set_status("loading the model…" if self.backend.info.kind == "local" else "connecting…")
        try:
            await self.backend.start()
        except BackendError as e:
            self._fatal(str(e))
            return
        except Exception as e:  # a model that will not load: one line, exit 2 (as the CLI does)
            self._fatal(one_line(e))
            return
        self.backend_ready.set()
        self.sub_title = f"{self.backend.info.model}"
        for pane in self.main.panes:  # a pane on the default model names it now
            pane.refresh_title()
        if self.share is not None:
            try:
                self.share_line = await self.share(self)
            except Exception as e:  # noqa: BLE001 - the panes still work without sharing
                self.notify(f"--share failed: {e}", severity="error", timeout=10)
            else:
                dash.set_share(self.share_line)
                self.notify(self.share_line, title="sharing", timeout=10)

    def _fatal(self, message: str) -> None:
        self.fatal_error = message
        self.exit(return_code=2)

    async def action_quit(self) -> None:
        if getattr(self, "main", None) is not None:
            self.main.keep_partial_replies()  # before the backend closes and the replies end
        # every stream ends now, not after the app's teardown: that took 0.6 s during a fast
        # reply, and the reply ran on meanwhile (hundreds of tokens, for no one)
        await self._close_backend()
        await super().action_quit()

    async def on_unmount(self) -> None:
        await self._close_backend()  # however the app ends (ctrl+q closed it already)

    async def _close_backend(self) -> None:
        """Stop sharing, then close the backend, once: that ends every stream (engine stopped,
        socket closed, requests cancelled)."""
        if self._backend_closed:
            return
        self._backend_closed = True
        if self.close_share is not None:
            await self.close_share()
        await self.backend.close()

    def _on_theme_changed(self, theme: Theme) -> None:
        self.store.set_setting("theme", theme.name)

    # -- command palette ---------------------------------------------------------------------
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from (c for c in super().get_system_commands(screen) if c.title not in REPLACED_COMMANDS)
        yield SystemCommand("Keys", "The app's keys, by group (f1)", self.action_help)
        if not isinstance(screen, MainScreen):
            return
        yield from screen.palette_commands()

    def help_groups(self) -> dict[str, list[tuple[str, str]]]:
        """The F1 help's key groups, from the bindings that define the keys."""
        palette = Binding(self.COMMAND_PALETTE_BINDING, "command_palette", "Command palette",
                          tooltip="Every command, searchable")
        return key_groups([(APP, MainScreen.BINDINGS), (APP, [palette, *self.BINDINGS]),
                           ("Prompt", [Binding("enter", "", "Send the prompt"), *PromptInput.BINDINGS])])

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.help_groups()))
