"""`hfquant push` against a Hub that never answers or answers something other than JSON: a timeout that says how to
wait longer, one-line errors, exit 1 (issue #11, docs/reliability.md)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from hfquant.publishing.hub import HubError, hub_timeout, push_folder


class _RawServer:
    """A local TCP endpoint that either accepts and never answers ("hang") or answers every request with an HTML page
    ("html"). Stops by itself after `lifetime` seconds."""

    def __init__(self, mode: str, lifetime: float = 60.0):
        self.mode, self.lifetime = mode, lifetime
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self.stop = threading.Event()

    def _serve(self) -> None:
        end = time.monotonic() + self.lifetime
        while not self.stop.is_set() and time.monotonic() < end:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            if self.mode == "hang":
                self.held.append(conn)
                continue
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(65536)
                    body = b"<html><body>Sign in to the network</body></html>"
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n"
                        b"Connection: close\r\n\r\n%s" % (len(body), body)
                    )
                except OSError:
                    pass

    def __enter__(self) -> _RawServer:
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)
        for conn in self.held:
            conn.close()
        self.sock.close()


@pytest.fixture(scope="module")
def small_folder(two_saves):
    return two_saves[0]


def test_push_to_a_hub_that_never_answers_times_out_and_says_how_to_wait_longer(small_folder):
    with _RawServer("hang") as server:
        start = time.monotonic()
        with pytest.raises(HubError, match=r"did not answer within 1 s.*--timeout SECONDS.*HFQUANT_HUB_TIMEOUT"):
            push_folder(small_folder, "me/x", endpoint=server.url, token="hf_test", timeout=1)
        assert time.monotonic() - start < 30


def test_push_of_an_answer_that_is_not_json_is_a_clear_error(small_folder):
    with _RawServer("html") as server:
        with pytest.raises(HubError, match=r"answered something that is not JSON.*HF_ENDPOINT"):
            push_folder(small_folder, "me/x", endpoint=server.url, token="hf_test", timeout=5)


@pytest.mark.parametrize("mode,words", [("hang", "did not answer within 1 s"), ("html", "not JSON")])
def test_cli_push_to_a_silent_or_html_endpoint_is_one_line_exit_1(small_folder, mode, words):
    import os

    with _RawServer(mode) as server:
        env = {**os.environ, "HF_ENDPOINT": server.url, "HF_TOKEN": "hf_test", "HF_HUB_DISABLE_XET": "1"}
        command = [sys.executable, "-m", "hfquant.commands.cli", "push", str(small_folder), "me/x", "--timeout", "1"]
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("hfquant: error:")]
    assert len(lines) == 1 and words in lines[0], result.stderr[-2000:]


def test_hub_timeout_from_the_argument_the_environment_or_the_default(monkeypatch):
    monkeypatch.delenv("HFQUANT_HUB_TIMEOUT", raising=False)
    assert hub_timeout() == 60.0 and hub_timeout(5) == 5.0
    monkeypatch.setenv("HFQUANT_HUB_TIMEOUT", "2.5")
    assert hub_timeout() == 2.5
    for bad in ("soon", "0", "-1", "nan", "inf"):
        monkeypatch.setenv("HFQUANT_HUB_TIMEOUT", bad)
        with pytest.raises(ValueError, match=rf"HFQUANT_HUB_TIMEOUT={bad!r} is not a number of seconds > 0"):
            hub_timeout()
