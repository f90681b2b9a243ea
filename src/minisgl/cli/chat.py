"""`minisgl chat`: an interactive terminal chat that streams the model's answer.

It talks to a server over the OpenAI chat API: the one at --url, or one it starts itself (a
`minisgl serve` child on a free local port, stopped on exit). The conversation history is kept and
sent with every turn. Commands: /reset (forget the history), /exit (or Ctrl-D). Ctrl-C while the
model answers stops that answer (the server aborts the request)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

from minisgl.utils.host import find_free_port

_HELP = "Type a message; /reset forgets the conversation, /exit or Ctrl-D quits."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="chat with this running server instead of starting one")
    p.add_argument(
        "--model",
        help="for the server started here: a model directory, a .gguf file or a Hugging Face id "
        "(ORG/NAME, ORG/NAME:QUANT; default: the embedded model)",
    )
    p.add_argument("--revision", help="for the server started here: the model id's branch, tag or commit")
    p.add_argument("--download-dir", help="for the server started here: the Hugging Face cache to use")
    p.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="for the server started here"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="for the server started here",
    )
    p.add_argument("--max-seq-len", type=int, metavar="N", help="for the server started here: context length")
    p.add_argument("--system", help="a system prompt")
    p.add_argument("--max-tokens", type=int, default=512, help="answer length limit (default %(default)s)")
    p.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature (default %(default)s)"
    )
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling (default %(default)s)")


class LocalServer:
    """A `minisgl serve` child process for the chat; its output goes to a log file, not the chat."""

    def __init__(self, ns: argparse.Namespace) -> None:
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "minisgl",
            "serve",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            "--device",
            ns.device,
            "--dtype",
            ns.dtype,
        ]
        for flag, value in (
            ("--model", ns.model),
            ("--revision", ns.revision),
            ("--download-dir", ns.download_dir),
        ):
            if value:
                cmd += [flag, value]
        if ns.max_seq_len:
            cmd += ["--max-seq-len", str(ns.max_seq_len)]
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"minisgl-chat-{self.port}.log")
        self.log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        # Its own process group: Ctrl-C in the chat must not reach the server.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited (code {self.proc.returncode}); see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the server did not start within {timeout:g} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def stream_answer(client: httpx.Client, messages: list[dict], ns: argparse.Namespace) -> Iterator[str]:
    body = {
        "messages": messages,
        "stream": True,
        "max_tokens": ns.max_tokens,
        "temperature": ns.temperature,
        "top_p": ns.top_p,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(r.json().get("error", {}).get("message", r.text))
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[len("data: ") :])
            if "error" in obj:
                raise RuntimeError(obj["error"].get("message", "server error"))
            for c in obj.get("choices", []):
                text = (c.get("delta") or {}).get("content")
                if text:
                    yield text


def chat_loop(url: str, ns: argparse.Namespace) -> None:
    history: list[dict] = [{"role": "system", "content": ns.system}] if ns.system else []
    base = len(history)
    print(_HELP)
    with httpx.Client(base_url=url, timeout=httpx.Timeout(600, connect=10)) as client:
        while True:
            try:
                line = input("\nyou> ").strip()
            except EOFError:
                print()
                return
            except KeyboardInterrupt:
                print()
                continue
            if not line:
                continue
            if line in ("/exit", "/quit"):
                return
            if line == "/reset":
                del history[base:]
                print("(conversation forgotten)")
                continue
            history.append({"role": "user", "content": line})
            print("model> ", end="", flush=True)
            answer = []
            try:
                for piece in stream_answer(client, history, ns):
                    answer.append(piece)
                    print(piece, end="", flush=True)
            except KeyboardInterrupt:
                print(" [stopped]", end="")
            except (RuntimeError, httpx.HTTPError) as e:
                print(f"\n(error: {e})")
                history.pop()
                continue
            print()
            history.append({"role": "assistant", "content": "".join(answer)})


def main(ns: argparse.Namespace) -> int:
    if ns.url:
        chat_loop(ns.url.rstrip("/"), ns)
        return 0
    server = LocalServer(ns)
    code = 1
    try:
        print(f"starting a server ({ns.model or 'the embedded model'}); log: {server.log_path}", flush=True)
        server.wait_ready()
        chat_loop(server.url, ns)
        code = 0
    except KeyboardInterrupt:
        code = 130
    except RuntimeError as e:
        print(f"minisgl chat: {e}", file=sys.stderr)
    finally:
        server.stop()
    if code != 1:  # the server's log is kept only when something went wrong
        os.unlink(server.log_path)
    return code
