"""Driven by tests/tests/e2e/python.rs: what a Python client raises when
it cannot take part, against a real coordinator (a task that does not
exist, a wrong enrollment token), against no coordinator at all, and
against an HTTP server that is not one (a page where the API should be,
a proxy that refuses). Prints one JSON object, a case per key:
{"case": {"exception": "TaskNotFoundError", "builtin": true, "message": ..., "status": ..., "code": ...}}

    coordinator_errors.py URL TASK TOKEN SCRATCH
"""

import http.server
import json
import os
import socket
import sys
import threading

import cohort


class NotACoordinator(http.server.BaseHTTPRequestHandler):
    """Answers every request as something other than a coordinator would:
    under /page/ a web page (200), under /proxy/ a proxy's refusal (403),
    both HTML."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.do_GET()

    def do_GET(self):
        if self.path.startswith("/proxy/"):
            status, body = 403, b"<html><head><title>403 Forbidden</title></head><body>denied by policy</body></html>"
        else:
            status, body = 200, b"<!doctype html><html><body>Welcome to our website</body></html>"
        self.send_response(status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def closed_port():
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def attempt(url, task, token, state, builtin):
    """Runs a round; what it raised, and whether that is also `builtin`."""
    client = cohort.Client(url, task, token, state, max_attempts=2, progress=False)
    client.train(lambda model, round: cohort.Update(list(model.numpy().values()), 1))
    try:
        result = client.run_round()
    except cohort.CohortError as error:
        return {
            "exception": type(error).__name__,
            "builtin": builtin is None or isinstance(error, builtin),
            "message": str(error),
            "status": getattr(error, "status", None),
            "code": getattr(error, "code", None),
        }
    return {"exception": None, "outcome": result.outcome}


def main():
    url, task, token, scratch = sys.argv[1:5]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotACoordinator)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    other = f"http://127.0.0.1:{server.server_address[1]}"
    state = lambda name: os.path.join(scratch, name)  # noqa: E731
    missing = "0" * 32
    cases = {
        "task_not_found": attempt(url, missing, token, state("missing"), LookupError),
        "unauthorized": attempt(url, task, "not-the-token", state("unauthorized"), PermissionError),
        "unreachable": attempt(f"http://127.0.0.1:{closed_port()}", task, token, state("closed"), ConnectionError),
        "protocol": attempt(f"{other}/page", task, token, state("page"), None),
        "rejected": attempt(f"{other}/proxy", task, token, state("proxy"), None),
    }
    server.shutdown()
    print(json.dumps(cases), flush=True)


if __name__ == "__main__":
    main()
