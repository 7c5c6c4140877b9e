"""Serve a model over an OpenAI-compatible HTTP API:
`python -m nbmoe.server -m model.gguf [--port 8080] [-np 4] [placement flags]`.

Routes: /v1/chat/completions, /v1/completions (streamed or not), /v1/models, /health.
-np N slots share the context -c (n_ctx // N tokens each); their generated tokens are
decoded as one batch a step; more requests than slots wait in a queue.
"""
import argparse

from nbmoe.cli.checks import Parser, check_threads, check_values, one_line_warnings
from nbmoe.cli.common import (add_engine_args, add_model_args, err_console, friendly_errors,
                              mpi_ranks, open_model, resolve_model, warm_up)


def parse_args(argv=None):
    p = Parser(prog="python -m nbmoe.server", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096,
                   help="context size in tokens, shared by the slots (0 = the model's training context)")
    p.add_argument("-np", "--parallel", type=int, default=1,
                   help="parallel slots: requests served at once, each with ctx-size / N tokens")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: all cores)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--alias", default=None, help="the model name the API reports (default: the file name)")
    cb = p.add_mutually_exclusive_group()
    cb.add_argument("-cb", "--cont-batching", dest="batch", action="store_const", const=True,
                    default=None, help="decode the generating slots' tokens as one batch (default: "
                                       "unless MoE experts are in RAM beside a GPU, where turns are faster)")
    cb.add_argument("-nocb", "--no-cont-batching", dest="batch", action="store_const", const=False,
                    help="the generating slots take turns, a token each")
    add_engine_args(p)
    args = p.parse_args(argv)
    check_values(p, vars(args))
    if args.parallel < 1:
        p.error(f"argument -np/--parallel: must be at least 1, got {args.parallel}")
    if not 0 <= args.port <= 65535:
        p.error(f"argument --port: must be between 0 and 65535, got {args.port}")
    args.threads = check_threads(p, args.threads)
    return args


def main(argv=None):
    one_line_warnings()
    args = parse_args(argv)
    with mpi_ranks(args, args.threads), friendly_errors():
        import uvicorn
        from nbmoe.server.app import create_app
        from nbmoe.server.slots import batch_decoding
        path = resolve_model(args.model)
        llm = open_model(args, path, n_slots=args.parallel)
        warm_up(llm)
        batch = batch_decoding(llm) if args.batch is None else args.batch
        app = create_app(llm, alias=args.alias, api_key=args.api_key, batch=batch)
        err_console.print(f"[bold]nbmoe[/] serving {llm.cfg.arch} model {path} on "
                          f"http://{args.host}:{args.port}/v1 ({len(llm.slots)} slot(s) of "
                          f"{llm.n_ctx} tokens{', batched' if batch and len(llm.slots) > 1 else ''})")
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
