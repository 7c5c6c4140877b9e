"""The chat's terminal: reading lines (with editing and history on a terminal) and Ctrl-C.

On a terminal, prompt_toolkit edits the line (arrows, Home/End, Ctrl-A/E, up/down for
earlier lines); Ctrl-C clears the line and Ctrl-D on an empty line ends the input. Piped
input is read line by line, as plain input().
"""
import signal
import sys


class LineReader:
    """read() -> the next line, "" when Ctrl-C cleared it, None at the end of the input."""

    def __init__(self):
        self.interactive = sys.stdin.isatty()
        self.session = None
        if self.interactive and sys.stdout.isatty():
            try:
                from prompt_toolkit import PromptSession
                self.session = PromptSession()
            except Exception:   # no usable terminal for it (odd TERM): plain lines still work
                self.session = None

    def read(self):
        try:
            if self.session is not None:
                return self.session.prompt([("ansigreen bold", "> ")])
            if self.interactive:
                from nbmoe.cli.common import err_console
                err_console.print("[bold green]> [/]", end="")
            line = sys.stdin.readline()
            return line.rstrip("\n") if line else None
        except KeyboardInterrupt:
            if self.session is None and self.interactive:
                sys.stderr.write("\n")
            return ""
        except EOFError:
            return None


class StopOnCtrlC:
    """While a reply is generated: the first Ctrl-C asks it to stop after the current token
    (`requested`), a second one interrupts at once (KeyboardInterrupt, e.g. in a long prompt)."""

    def __enter__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)
        return False
