"""A Python participant for the end-to-end tests (tests/tests/e2e/python.rs):
the 2NN in PyTorch on a shard written by `cohort partition`, one epoch of
SGD per round. It saves each update it sends (local weights minus the
global model, and its example count) to OUT/update-ROUND.npz so that the
test can recompute the aggregate, and prints one JSON line at the end.

    federated_client.py URL TASK TOKEN STATE_DIR SHARD OUT POLICY_JSON [--die-in-round N]

With --die-in-round N the process kills itself (SIGKILL) in the middle of
round N's training: a client that dies mid-round.
"""

import argparse
import json
import logging
import os
import signal

import numpy as np
import torch

import cohort


class TwoNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(784, 200)
        self.fc2 = torch.nn.Linear(200, 200)
        self.fc3 = torch.nn.Linear(200, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def main():
    parser = argparse.ArgumentParser()
    for name in ("url", "task", "token", "state", "shard", "out", "policy"):
        parser.add_argument(name)
    parser.add_argument("--die-in-round", type=int)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    with open(os.path.join(args.shard, "images.idx"), "rb") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 784)
    with open(os.path.join(args.shard, "labels.idx"), "rb") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    x = torch.from_numpy(images.astype(np.float32) / 255.0)
    y = torch.from_numpy(labels.astype(np.int64))
    net = TwoNN()
    os.makedirs(args.out, exist_ok=True)

    client = cohort.Client(args.url, args.task, args.token, args.state, policy=json.loads(args.policy))

    @client.train
    def train(model: cohort.Model, round: cohort.Round) -> cohort.Update:
        net.load_state_dict(model.torch())
        if args.die_in_round == round.number:
            os.kill(os.getpid(), signal.SIGKILL)
        torch.manual_seed(round.nonce)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
        total = 0.0
        for batch in torch.randperm(len(y)).split(32):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        update = cohort.Update(net.state_dict(), examples=len(y), metrics={"loss": total / len(y)})
        local = np.concatenate([a.reshape(-1) for a in update.tensors(model.layout)])
        np.savez(os.path.join(args.out, f"update-{round.number}.npz"), delta=local - model.flat, examples=len(y))
        return update

    results = client.run()
    print(json.dumps({
        "participant": client.participant_id,
        "outcomes": [[r.round, r.outcome] for r in results],
    }))


if __name__ == "__main__":
    main()
