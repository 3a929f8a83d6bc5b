"""What masking and sending an update costs from Python against the native
client, for the same update (issue 48's goal: at most 1.1x).

Starts `cohort serve` on a fresh SQLite database, and for each kind runs a
task of ROUNDS rounds with three clients of that kind, each in its own
process, handing in a fixed update of DIM float32 parameters (local
weights = global + a fixed delta): the native kind is
`mobile/examples/update_cost.rs` (MobileClient, the core the Python package
wraps), the Python kind this file in client mode (`cohort.Client`). Each
client reports, per round, its process's CPU time for the whole round
(check-in, the model's download, the hand-off, quantization, masking and
every request) and from the hand-off to the round's end, and that wall
time. Prints a table and one JSON line.

    python update_cost.py --cohort PATH --native PATH [--dim 10000000] [--rounds 4]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ADMIN = "update-cost-admin-token"


def cpu_seconds():
    """This process's CPU time as the native client reads its own
    (/proc/self/stat, ticks of 1/100 s), so both read the same clock."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0


def client_main(url, task, token, state, policy):
    import numpy as np

    import cohort

    dim = int(os.environ["UPDATE_COST_DIM"])
    delta = ((np.arange(dim) % 97).astype(np.float32) - 48.0) * np.float32(1e-4)
    local = np.empty(dim, np.float32)
    handed = {}
    client = cohort.Client(url, task, token, state, policy=json.loads(policy), progress=False)

    @client.train
    def train(model, round):
        handed["at"] = (time.monotonic(), cpu_seconds())
        np.add(model.flat, delta, out=local)
        return cohort.Update([local.reshape(shape) for _, shape in model.layout], examples=10)

    while True:
        start, start_cpu = time.monotonic(), cpu_seconds()
        result = client.run_round()
        if result.outcome == "task_finished":
            return
        end, end_cpu = time.monotonic(), cpu_seconds()
        at, at_cpu = handed.pop("at", (start, start_cpu))
        print(json.dumps({
            "round": result.round,
            "outcome": result.outcome,
            "round_cpu_s": round(end_cpu - start_cpu, 2),
            "after_handoff_cpu_s": round(end_cpu - at_cpu, 2),
            "after_handoff_wall_s": round(end - at, 3),
        }), flush=True)


def admin(url, method, path, body=None):
    request = urllib.request.Request(
        url + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request) as reply:
        return json.loads(reply.read() or b"null")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_kind(kind, args, url, scratch):
    spec = {
        "name": f"update cost {kind}",
        "rounds": args.rounds,
        "clients_per_round": 3,
        "model": {"architecture": "linear", "layout": {"tensors": [{"name": "w", "shape": [args.dim]}]}},
        "secure_aggregation": {"graph": "complete", "threshold": 2},
        "validation": {"norm": "none"},
        "deadlines": {"advertise_keys_ms": 600000, "share_keys_ms": 600000, "masked_input_ms": 600000,
                      "unmasking_ms": 600000},
    }
    created = admin(url, "POST", "/admin/tasks", spec)
    policy = json.dumps({"min_clients": 3, "min_threshold": 2, "min_collusion_margin": 1, "collusion": None})
    env = dict(os.environ, UPDATE_COST_DIM=str(args.dim))
    processes = []
    for k in range(3):
        state = os.path.join(scratch, f"{kind}-{k}")
        common = [url, created["id"], created["enrollment_token"], state, policy]
        command = [args.native, *common] if kind == "native" else [sys.executable, __file__, "--client", *common]
        processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, env=env, text=True))
    rows = []
    for process in processes:
        out, _ = process.communicate(timeout=3600)
        if process.returncode != 0:
            raise SystemExit(f"a {kind} client failed ({process.returncode})")
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    rows = [r for r in rows if r["outcome"].lower() == "completed"]
    # Round 1 of each client pays for the first model's download into a
    # cold process; it is reported but the means are over the later rounds.
    later = [r for r in rows if r["round"] > 1] or rows
    return {
        "kind": kind,
        "rounds": len(rows),
        "round_cpu_s": statistics.mean(r["round_cpu_s"] for r in later),
        "after_handoff_cpu_s": statistics.mean(r["after_handoff_cpu_s"] for r in later),
        "after_handoff_wall_s": statistics.mean(r["after_handoff_wall_s"] for r in later),
    }


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        return client_main(*sys.argv[2:7])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cohort", required=True, help="the cohort binary (a release build)")
    parser.add_argument("--native", required=True, help="the update_cost example of cohort-mobile (release)")
    parser.add_argument("--dim", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(
            [args.cohort, "serve", "--bind", f"127.0.0.1:{port}", "--database-url",
             f"sqlite://{scratch}/cost.db"],
            env=dict(os.environ, COHORT_ADMIN_TOKEN=ADMIN),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            for _ in range(200):
                try:
                    admin(url, "GET", "/admin/tasks")
                    break
                except OSError:
                    time.sleep(0.1)
            results = [run_kind(kind, args, url, scratch) for kind in ("native", "python")]
        finally:
            server.kill()
            server.wait()
    native, python = results
    print(f"{'':8} {'round CPU':>10} {'after hand-off CPU':>19} {'after hand-off wall':>20}   (per client and round, s)")
    for r in results:
        print(f"{r['kind']:8} {r['round_cpu_s']:10.3f} {r['after_handoff_cpu_s']:19.3f} {r['after_handoff_wall_s']:20.3f}")
    ratio = {key: python[key] / native[key] for key in ("round_cpu_s", "after_handoff_cpu_s", "after_handoff_wall_s")}
    print("python / native: " + ", ".join(f"{k} {v:.3f}" for k, v in ratio.items()))
    print(json.dumps({"dim": args.dim, "native": native, "python": python, "ratio": ratio}))


if __name__ == "__main__":
    main()
