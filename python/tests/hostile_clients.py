"""Driven by tests/tests/e2e/hostile_clients.rs (and python.rs's async
test): Python clients run against a scripted malicious coordinator (or a
plain one) until each has seen the given number of round outcomes, ended
with an exception, or the patience ran out. Each
hands in a fixed update (the global model plus 0.01 everywhere). Prints
one JSON line:
[{"outcomes": [{"outcome": "completed", "rule": null}], "error": ..., "rule": ..., "exception": ...,
  "privacy_spent": ...}]

    hostile_clients.py URL TASK TOKEN SCRATCH POLICY_JSON CLIENTS ROUNDS PATIENCE_MS [CA_CERT]

CA_CERT: a PEM file the clients trust instead of the web PKI (a
coordinator over TLS with a private CA).
"""

import json
import os
import re
import sys
import threading
import time

import cohort


def rule_in(reason):
    """The rule a refusal names in its reason ("rule replay: ..."), or None."""
    match = re.search(r"rule (\w+)", reason or "")
    return match.group(1) if match else None


def run(url, task, token, state, policy, rounds, endings, k, ca_cert):
    outcomes = []
    endings[k] = {"outcomes": outcomes, "error": "still waiting", "rule": None, "exception": None}
    ending = {"error": None, "rule": None, "exception": None}
    client = None
    try:
        client = cohort.Client(url, task, token, state, ca_cert=ca_cert, policy=policy, progress=False)

        @client.train
        def train(model, round):
            return cohort.Update([a + 0.01 for a in model.numpy().values()], examples=3)

        while len(outcomes) < rounds:
            result = client.run_round()
            if result.outcome == "task_finished":
                break
            outcomes.append({"outcome": result.outcome, "rule": rule_in(result.reason)})
    except cohort.CohortError as error:
        ending = {"error": str(error), "rule": getattr(error, "rule", None), "exception": type(error).__name__}
    spent = client.privacy_spent if client is not None else None
    endings[k] = {"outcomes": outcomes, **ending, "privacy_spent": spent}


def main():
    url, task, token, scratch, policy = sys.argv[1:6]
    clients, rounds, patience = int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8])
    ca_cert = sys.argv[9] if len(sys.argv) > 9 else None
    endings = [None] * clients
    threads = [
        threading.Thread(
            target=run,
            args=(url, task, token, os.path.join(scratch, f"client-{k}"), json.loads(policy), rounds, endings, k, ca_cert),
            daemon=True,
        )
        for k in range(clients)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + patience / 1000
    for thread in threads:
        thread.join(max(0.001, deadline - time.monotonic()))
    never = {"outcomes": [], "error": "never started", "rule": None, "exception": None}
    print(json.dumps([e if e is not None else never for e in endings]), flush=True)
    # Clients still waiting go with the process.
    os._exit(0)


if __name__ == "__main__":
    main()
