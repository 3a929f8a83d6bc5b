"""Driven by tests/tests/e2e/python.rs: Flower-style ``NumPyClient``
objects (``get_parameters``, ``fit``; Flower is not installed) take part
in a Cohort task through ``cohort.flower.run_numpy_client``, unchanged.
Each hands in the global model plus 0.01 with 3 examples, a loss of
0.5, and a metric Cohort does not aggregate (dropped with a warning).
Prints one JSON line:
{"clients": [{"outcomes": ["completed"], "configs": [{"lr": 0.1, "server_round": 1}]}, ...],
 "warnings": ["metric 'learning_rate_used' is not sent: ...", ...]}

    flower_clients.py URL TASK TOKEN SCRATCH POLICY_JSON CLIENTS SHAPES_JSON
"""

import json
import logging
import os
import sys
import threading

import numpy as np

from cohort.flower import run_numpy_client


class FlowerClient:
    """What a Flower user's NumPyClient subclass defines."""

    def __init__(self, shapes):
        self.parameters = [np.zeros(shape, dtype=np.float32) for shape in shapes]
        self.configs = []

    def get_parameters(self, config):
        return self.parameters

    def fit(self, parameters, config):
        self.configs.append(dict(config))
        self.parameters = [p + 0.01 for p in parameters]
        return self.parameters, 3, {"loss": 0.5, "learning_rate_used": 0.1}


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main():
    url, task, token, scratch, policy = sys.argv[1:6]
    clients, shapes = int(sys.argv[6]), json.loads(sys.argv[7])
    warnings = Warnings()
    logging.getLogger("cohort").addHandler(warnings)
    flower = [FlowerClient(shapes) for _ in range(clients)]
    endings = [None] * clients

    def run(k):
        results = run_numpy_client(
            flower[k], url, task, token, os.path.join(scratch, f"flower-{k}"),
            config={"lr": 0.1}, rounds=1, policy=json.loads(policy), progress=False,
        )
        endings[k] = [r.outcome for r in results]

    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report = {
        "clients": [{"outcomes": endings[k], "configs": flower[k].configs} for k in range(clients)],
        "warnings": warnings.messages,
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
