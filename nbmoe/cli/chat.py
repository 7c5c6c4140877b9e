"""Chat with a model: `python -m nbmoe [-m model.gguf] [sampling flags]`.

Type a message and press Enter; the reply streams as it is generated. Ctrl-C stops a reply
(what was said so far stays in the conversation), Ctrl-D on an empty line quits, /help
lists the commands. A conversation longer than the context drops its oldest turns (the
system prompt stays). Piped input works too: `echo "Hi" | python -m nbmoe -n 32` answers
each line in turn.
"""
import argparse
import sys

from nbmoe.cli.checks import Parser, check_threads, check_values, one_line_warnings
from nbmoe.cli.common import (add_engine_args, add_model_args, err_console, friendly_errors,
                              mpi_ranks, open_model, resolve_model, warm_up)
from nbmoe.errors import NbmoeError

HELP = """commands:
  /help    this list
  /reset   forget the conversation (the system prompt stays)
  /stats   speed of the last reply and how full the context is
  /quit    leave (also /exit or Ctrl-D)
keys: Ctrl-C stops a reply or clears the line, Ctrl-D on an empty line quits,
      arrows and Home/End edit the line, Up/Down recall earlier lines"""


def parse_args(argv=None):
    p = Parser(prog="python -m nbmoe", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("-n", "--n-predict", type=int, default=256,
                   help="max tokens per reply (-1 = until the context is full)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096,
                   help="context size in tokens (0 = the model's training context)")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: all cores)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=40, help="top-k sampling (0 = off)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p sampling (1 = off)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p sampling (0 = off)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="repeat penalty (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed (-1 = random)")
    p.add_argument("-sys", "--system-prompt", default=None, help="system message")
    p.add_argument("--ignore-eos", action="store_true",
                   help="go on past the model's end-of-generation tokens (to -n or the context's end)")
    add_engine_args(p)
    args = p.parse_args(argv)
    check_values(p, vars(args))
    args.threads = check_threads(p, args.threads)
    return args


class Chat:
    """A conversation: the messages so far, rendered through the model's chat template."""

    def __init__(self, llm, args):
        from nbmoe.text.sampling import Sampler, SamplingParams
        self.llm, self.args = llm, args
        seed = None if args.seed == -1 else args.seed
        self.sampler = Sampler(SamplingParams(args.temp, args.top_k, args.top_p, args.min_p,
                                              args.repeat_penalty, seed=seed))
        self.reset()

    def reset(self):
        self.messages = [{"role": "system", "content": self.args.system_prompt}] if self.args.system_prompt else []
        self.llm.reset()

    def reserve(self):
        """Room kept for a reply when older turns must go: -n tokens, at most half the context."""
        n_ctx, n = self.llm.n_ctx, self.args.n_predict
        return min(n if n > 0 else n_ctx, n_ctx // 2)

    def prompt_ids(self, text):
        """The prompt for the conversation plus `text`, older turns dropped to fit (with a notice)."""
        from nbmoe.text.chat_template import fit_context
        messages = self.messages + [{"role": "user", "content": text}]
        ids, kept, dropped = fit_context(self.llm.tokenizer, messages, self.llm.n_ctx, self.reserve())
        if dropped:
            err_console.print(f"[yellow]context full: dropped the {dropped} oldest messages "
                              f"(the system prompt stays); prompt {len(ids)} of {self.llm.n_ctx} tokens[/]")
        self.messages = kept
        return ids

    def reply(self, text, out, stop):
        """Stream the answer to `text` into `out`; stop.requested (Ctrl-C) ends it early, and
        what was said so far stays in the conversation. A gpt-oss model's reasoning (its
        analysis channel) is shown dimmed on stderr; only the final channel goes to `out`
        and into the conversation."""
        from nbmoe.text.harmony import reply_stream
        ids = self.prompt_ids(text)
        stream, shown = reply_stream(self.llm.tokenizer), _Shown(out)
        try:
            past_eos = {"stop_ids": ()} if getattr(self.args, "ignore_eos", False) else {}
            for tok in self.llm.generate_ids(ids, self.args.n_predict, self.sampler, **past_eos):
                shown.write(stream.push(tok))
                if stop.requested:
                    break
        except KeyboardInterrupt:       # a second Ctrl-C, e.g. while the prompt is evaluated
            stop.requested = True
        except BaseException:
            self.messages.pop()         # the turn failed: the conversation is as before it
            raise
        shown.write(stream.flush())
        shown.end()
        said = "".join(shown.final).strip()
        if said or not stop.requested:
            self.messages.append({"role": "assistant", "content": said})
        else:                           # stopped before a word: the turn is forgotten
            self.messages.pop()
        if stop.requested:
            err_console.print("[yellow]reply stopped[/]")
        elif self.llm.last_stats.get("stop") == "context":
            err_console.print(f"[yellow]the reply filled the context ({self.llm.n_ctx} tokens) and was cut; "
                              "the next message drops the oldest turns[/]")

    def stats_line(self):
        s = self.llm.last_stats
        if not s:
            return "no reply yet"
        pp = s["n_prompt"] / s["t_prompt"] if s["t_prompt"] else 0.0
        tg = s["n_gen"] / s["t_gen"] if s["t_gen"] else 0.0
        return (f"prompt {s['n_prompt']} tokens {pp:.1f} t/s | generated {s['n_gen']} tokens "
                f"{tg:.1f} t/s | context {len(self.llm.tokens)}/{self.llm.n_ctx}")


class _Shown:
    """Writes (channel, text) pieces of a reply: the final channel to `out`, the others
    (reasoning) dimmed on stderr, a line break where one kind gives way to the other."""

    def __init__(self, out):
        self.out, self.final, self.last = out, [], None

    def write(self, pieces):
        from nbmoe.text.harmony import FINAL
        for channel, text in pieces:
            kind = channel == FINAL
            if self.last is not None and kind != self.last:
                self._newline(self.last)
            self.last = kind
            if kind:
                self.final.append(text)
                self.out.write(text)
                self.out.flush()
            else:
                err_console.print(text, style="dim", end="", markup=False, emoji=False)

    def _newline(self, final):
        if final:
            self.out.write("\n")
            self.out.flush()
        else:
            err_console.print("")

    def end(self):
        """The reply's line break (an empty line on `out` for a reply with no final text)."""
        if self.last is False:
            self._newline(False)
        self._newline(True)


def command(chat, text):
    """Run a /command; False for /quit."""
    name = text.split()[0]
    if name in ("/quit", "/exit"):
        return False
    if name == "/reset":
        chat.reset()
        err_console.print("conversation cleared")
    elif name == "/stats":
        err_console.print(chat.stats_line())
    elif name == "/help":
        err_console.print(HELP, markup=False)
    else:
        err_console.print(f"unknown command {name} (/help lists them)", markup=False)
    return True


def repl(chat, banner):
    """Answer line after line. On a terminal an error in one turn is printed and the chat
    goes on; with piped input it ends the program (status 1), as a script expects."""
    from nbmoe.cli.repl import CtrlC, LineReader
    from nbmoe.text.chat_template import ChatTemplateError
    with CtrlC() as ctrl_c:
        reader = LineReader(ctrl_c)
        if reader.interactive:
            err_console.print(banner)
        while (line := reader.read()) is not None:
            text = line.strip()
            if not text:
                continue
            if text.startswith("/") and " " not in text:
                if not command(chat, text):
                    break
                continue
            try:
                with ctrl_c.during("reply") as stop:
                    chat.reply(text, sys.stdout, stop)
            except (NbmoeError, ChatTemplateError) as e:
                if not reader.interactive:
                    raise NbmoeError(str(e)) from None
                err_console.print(f"[bold red]error:[/] {e}")
                continue
            err_console.print(f"[dim]{chat.stats_line()}[/]")


def main(argv=None):
    one_line_warnings()
    args = parse_args(argv)
    with mpi_ranks(args, args.threads), friendly_errors():
        path = resolve_model(args.model)
        llm = open_model(args, path)
        warm_up(llm)
        chat = Chat(llm, args)
        repl(chat, f"[bold]nbmoe[/] chatting with {llm.cfg.arch} model {path} "
                   f"(context {llm.n_ctx} tokens)\n"
                   "/help lists the commands; Ctrl-C stops a reply, Ctrl-D quits")


if __name__ == "__main__":
    main()
