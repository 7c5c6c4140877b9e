"""The chat REPL as a user meets it: on a terminal (a pseudo-terminal that is the child's
controlling terminal, so Ctrl-C is a keystroke that the kernel turns into SIGINT), and with
piped input through a conversation longer than its context."""
import fcntl
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time

import pytest

ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]|\r")


@pytest.fixture(scope="module")
def moe_model(tiny_model):
    return tiny_model("llama", n_expert=4, n_expert_used=2, default_type="Q4_1")


class Terminal:
    """A child process on a pseudo-terminal: type into it, wait for its screen text."""

    def __init__(self, argv):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, b"\x18\x00\x78\x00\x00\x00\x00\x00")  # 24 x 120
        env = dict(os.environ, TERM="xterm", PROMPT_TOOLKIT_NO_CPR="1")

        def controlling_terminal():     # after setsid: the pty becomes the child's terminal
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     start_new_session=True, preexec_fn=controlling_terminal)
        os.close(slave)
        self.fd, self.raw, self.pos = master, b"", 0

    def _read(self, timeout):
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if ready:
            try:
                data = os.read(self.fd, 65536)
            except OSError:         # the child closed the terminal
                data = b""
            self.raw += data
            return bool(data)
        return False

    def text(self):
        """What was written so far, escape sequences and carriage returns removed."""
        return ANSI.sub(b"", self.raw).decode("utf-8", "replace")

    def expect(self, pattern, timeout=300):
        """Wait for `pattern` (a regex) after the last match; return the match."""
        end = time.monotonic() + timeout
        while True:
            m = re.compile(pattern).search(self.text(), self.pos)
            if m:
                self.pos = m.end()
                return m
            left = end - time.monotonic()
            if left <= 0 or (not self._read(min(left, 1.0)) and self.proc.poll() is not None):
                raise AssertionError(f"no {pattern!r} in:\n{self.text()[self.pos:][-3000:]}")

    def in_raw_mode(self):
        return not termios.tcgetattr(self.fd)[3] & termios.ISIG     # the pty's shared modes

    def wait_prompt(self, timeout=300):
        """Wait until the line editor reads keys (raw mode: Ctrl-C is a key)."""
        end = time.monotonic() + timeout
        while not self.in_raw_mode():
            assert time.monotonic() < end and self.proc.poll() is None, self.text()[-2000:]
            self._read(0.05)

    def wait_reply(self, n_chars=200, timeout=300):
        """Wait until the line editor has handed the terminal back (signals on: Ctrl-C is
        SIGINT again) and `n_chars` more characters have arrived: more than the line editor's
        last redraw, so the reply is running (a Ctrl-C between the two is ignored)."""
        end = time.monotonic() + timeout
        while self.in_raw_mode():
            assert time.monotonic() < end, "the terminal stayed in raw mode"
            self._read(0.05)
        self.pos = len(self.text())
        while len(self.text()) < self.pos + n_chars:
            assert time.monotonic() < end, f"only {self.text()[self.pos:]!r}"
            self._read(1.0)

    def send(self, keys):
        os.write(self.fd, keys.encode())

    def type(self, keys):
        """Send keys once the prompt reads them."""
        self.wait_prompt()
        self.send(keys)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.fd)


@pytest.fixture
def terminal():
    opened = []

    def start(*args):
        opened.append(Terminal([sys.executable, "-m", "nbmoe", *args]))
        return opened[-1]

    yield start
    for t in opened:
        t.close()


def test_terminal_keys(terminal, moe_model):
    """/help, line editing and history, Ctrl-C at the prompt and during a reply, Ctrl-D."""
    # --ignore-eos: a reply runs until Ctrl-C stops it (the random model could end one at once)
    t = terminal("-m", moe_model, "-n", "-1", "-c", "32768", "--temp", "0", "-t", "1", "--ignore-eos")
    t.expect(r"/help lists the commands; Ctrl-C stops a reply, Ctrl-D quits", timeout=1200)  # cold compile
    t.type("/help\r")
    t.expect(r"/reset +forget the conversation")
    t.expect(r"Up/Down recall earlier lines")
    t.type("some text")             # Ctrl-C clears the line: "/stats" then runs alone
    t.expect(r"some text")
    t.send("\x03")
    t.type("/stats\r")
    t.expect(r"no reply yet")
    t.type("/tats\x1b[D\x1b[D\x1b[D\x1b[Ds\r")   # typed "/tats", 4 x Left, "s": /stats
    t.expect(r"no reply yet")
    t.type("\x1b[A\r")              # Up: the last line again
    t.expect(r"no reply yet")
    assert "unknown command" not in t.text()

    t.type("hello\r")               # -n -1: the reply would run to the context's end
    t.wait_reply()
    t.send("\x03")                  # a keystroke: the terminal sends SIGINT
    t.expect(r"reply stopped")
    t.type("/stats\r")
    m = t.expect(r"generated (\d+) tokens .* context (\d+)/32768")
    assert 0 < int(m.group(1)) and int(m.group(2)) < 32768
    t.type("say more\r")            # the conversation goes on after the stop
    t.wait_reply()
    t.proc.send_signal(signal.SIGINT)
    t.expect(r"reply stopped")
    t.type("\x04")                  # Ctrl-D on an empty line
    assert t.proc.wait(timeout=60) == 0
    assert "Traceback" not in t.text()


def test_piped_conversation_overflows_context(moe_model):
    """-c 128, -n -1: every reply runs into the context's end (said so); the next turn drops
    the oldest turns (said so) and the conversation goes on to the end of the input."""
    r = subprocess.run([sys.executable, "-m", "nbmoe", "-m", moe_model, "-c", "128", "-n", "-1",
                        "--temp", "0", "-t", "1"], input="hello\nhow are you\nbye\n/stats\n",
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.count("the reply filled the context (128 tokens) and was cut") == 3, r.stderr
    dropped = re.findall(r"context full: dropped the (\d+) oldest messages .*; prompt (\d+) of 128",
                         r.stderr)
    assert len(dropped) == 2 and all(int(n) >= 2 and int(p) <= 64 for n, p in dropped), r.stderr
    assert re.search(r"context 128/128", r.stderr)
