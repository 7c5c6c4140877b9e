"""The chat's terminal: reading lines (with editing and history on a terminal) and Ctrl-C.

On a terminal, prompt_toolkit edits the line (arrows, Home/End, Ctrl-A/E, up/down for
earlier lines); Ctrl-C clears the line and Ctrl-D on an empty line ends the input. Piped
input is read line by line, as plain input().
"""
import signal
import sys
from contextlib import contextmanager


class CtrlC:
    """The chat's SIGINT handler for its whole life, so that a Ctrl-C never lands in the middle
    of other work: during a reply the first asks it to stop after the current token
    (`requested`) and a second interrupts at once (KeyboardInterrupt, e.g. in a long prompt);
    while a plain line is read it clears the line; elsewhere it is ignored."""

    def __init__(self):
        self.mode, self.requested = None, False

    def __enter__(self):
        self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)
        return False

    def _handler(self, signum, frame):
        if self.mode == "reply" and not self.requested:
            self.requested = True
        elif self.mode is not None:
            raise KeyboardInterrupt

    @contextmanager
    def during(self, mode):
        """mode: "reply" or "read"."""
        self.mode, self.requested = mode, False
        try:
            yield self
        finally:
            self.mode = None


class LineReader:
    """read() -> the next line, "" when Ctrl-C cleared it, None at the end of the input."""

    def __init__(self, ctrl_c):
        self.ctrl_c = ctrl_c
        self.interactive = sys.stdin.isatty()
        self.line_editor = None
        if self.interactive and sys.stdout.isatty():
            try:
                from prompt_toolkit import PromptSession
                self.line_editor = PromptSession()
            except Exception:   # no usable terminal for it (odd TERM): plain lines still work
                self.line_editor = None

    def read(self):
        try:
            if self.line_editor is not None:     # raw mode: Ctrl-C is a key, prompt() raises
                return self.line_editor.prompt([("ansigreen bold", "> ")])
            if self.interactive:
                from nbmoe.cli.common import err_console
                err_console.print("[bold green]> [/]", end="")
            with self.ctrl_c.during("read"):
                line = sys.stdin.readline()
            return line.rstrip("\n") if line else None
        except KeyboardInterrupt:
            if self.line_editor is None and self.interactive:
                sys.stderr.write("\n")
            return ""
        except EOFError:
            return None
