"""Chat with a model: `python -m nbmoe [-m model.gguf] [sampling flags]`.

Type a message and press Enter; the reply streams as it is generated. Commands:
/reset (forget the conversation), /stats (speed of the last reply), /quit.
Piped input works too: `echo "Hi" | python -m nbmoe -n 32` answers each line in turn.
"""
import argparse
import sys

from nbmoe.cli.common import (add_model_args, add_placement_args, add_repack_arg, err_console,
                         friendly_errors, placement_kwargs, resolve_model, warm_up)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m nbmoe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("-n", "--n-predict", type=int, default=256, help="max tokens per reply")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: all cores)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=40, help="top-k sampling (0 = off)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p sampling (1 = off)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p sampling (0 = off)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="repeat penalty (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed")
    p.add_argument("-sys", "--system-prompt", default=None, help="system message")
    add_repack_arg(p)
    add_placement_args(p)
    return p.parse_args(argv)


class Chat:
    """A conversation: the messages so far, rendered through the model's chat template."""

    def __init__(self, llm, args):
        from nbmoe.text.sampling import Sampler, SamplingParams
        self.llm, self.args = llm, args
        self.sampler = Sampler(SamplingParams(args.temp, args.top_k, args.top_p, args.min_p,
                                              args.repeat_penalty, seed=args.seed))
        self.reset()

    def reset(self):
        self.messages = [{"role": "system", "content": self.args.system_prompt}] if self.args.system_prompt else []
        self.llm.reset()

    def reply(self, text, out):
        from nbmoe.text.chat_template import chat_prompt_ids
        self.messages.append({"role": "user", "content": text})
        ids = chat_prompt_ids(self.llm.tokenizer, self.messages)   # the GGUF's template
        stream, pieces = self.llm.tokenizer.stream(), []
        for tok in self.llm.generate_ids(ids, self.args.n_predict, self.sampler):
            piece = stream.push(tok)
            if piece:
                pieces.append(piece)
                out.write(piece)
                out.flush()
        pieces.append(stream.flush())
        out.write(pieces[-1] + "\n")
        self.messages.append({"role": "assistant", "content": "".join(pieces).strip()})

    def stats_line(self):
        s = self.llm.last_stats
        if not s:
            return "no reply yet"
        pp = s["n_prompt"] / s["t_prompt"] if s["t_prompt"] else 0.0
        tg = s["n_gen"] / s["t_gen"] if s["t_gen"] else 0.0
        return (f"prompt {s['n_prompt']} tokens {pp:.1f} t/s | generated {s['n_gen']} tokens "
                f"{tg:.1f} t/s | context {len(self.llm.tokens)}/{self.llm.n_ctx}")


def main(argv=None):
    args = parse_args(argv)
    with friendly_errors():
        from nbmoe.engine import load
        path = resolve_model(args.model)
        with err_console.status(f"loading {path}"):
            llm = load(path, n_ctx=args.ctx_size, threads=args.threads, n_ubatch=args.ubatch_size,
                       repack=args.run_time_repack, **placement_kwargs(args))
        warm_up(llm)
        chat = Chat(llm, args)
        interactive = sys.stdin.isatty()
        if interactive:
            err_console.print(f"[bold]nbmoe[/] chatting with {llm.cfg.arch} model {path}\n"
                              "commands: /reset /stats /quit")
        while True:
            if interactive:
                err_console.print("[bold green]> [/]", end="")
            line = sys.stdin.readline()
            if not line:
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/quit", "/exit"):
                break
            if text == "/reset":
                chat.reset()
                err_console.print("conversation cleared")
                continue
            if text == "/stats":
                err_console.print(chat.stats_line())
                continue
            chat.reply(text, sys.stdout)
            err_console.print(f"[dim]{chat.stats_line()}[/]")


if __name__ == "__main__":
    main()
