# SPDX-License-Identifier: BSD-3-Clause
"""An RL agent and its observers (REINFORCE), in the style of upstream's RPC
RL example, with init_rpc naming BackendType.TENSORPIPE explicitly. The
environment is a small deterministic one of ours (no gym needed); actions
are sampled with one seeded generator per observer, so results do not depend
on the order in which observers' requests arrive. Prints one JSON line.

    python rl_observers.py PORT
    python -m torch_rpc_ext.run rl_observers.py PORT
"""

import json
import os
import sys

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributed.rpc import RRef

OBSERVERS = 2
STEPS = 8
GAMMA = 0.9


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


class Corridor:
    """Walk a corridor of 8 cells toward the right end: reward 1 per step right."""

    def __init__(self, seed):
        self.start = seed % 3

    def reset(self):
        self.pos = self.start
        return self.state()

    def state(self):
        return torch.tensor([self.pos / 8.0, 1.0 - self.pos / 8.0, (self.pos % 2) * 1.0, 1.0])

    def step(self, action):
        self.pos = max(0, min(7, self.pos + (1 if action == 1 else -1)))
        return self.state(), 1.0 if action == 1 else 0.0, self.pos == 7


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 16)
        self.affine2 = nn.Linear(16, 2)

    def forward(self, x):
        return F.softmax(self.affine2(F.relu(self.affine1(x))), dim=1)


class Observer:
    def __init__(self):
        self.id = rpc.get_worker_info().id
        self.env = Corridor(self.id)

    def run_episode(self, agent_rref, n_steps):
        state = self.env.reset()
        for _ in range(n_steps):
            action = _remote_method(Agent.select_action, agent_rref, self.id, state)
            state, reward, done = self.env.step(action)
            _remote_method(Agent.report_reward, agent_rref, self.id, reward)
            if done:
                break


class Agent:
    def __init__(self):
        self.ob_rrefs = [rpc.remote(f"observer{r}", Observer) for r in range(1, OBSERVERS + 1)]
        self.agent_rref = RRef(self)
        torch.manual_seed(0)
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        ids = range(1, OBSERVERS + 1)
        self.rewards = {i: [] for i in ids}
        self.saved_log_probs = {i: [] for i in ids}
        self.generators = {i: torch.Generator().manual_seed(100 + i) for i in ids}

    def select_action(self, ob_id, state):
        probs = self.policy(state.unsqueeze(0))
        action = torch.multinomial(probs, 1, generator=self.generators[ob_id]).item()
        self.saved_log_probs[ob_id].append(torch.log(probs[0, action]))
        return action

    def report_reward(self, ob_id, reward):
        self.rewards[ob_id].append(reward)

    def run_episode(self):
        futs = [
            rpc.rpc_async(r.owner(), _call_method, args=(Observer.run_episode, r, self.agent_rref, STEPS))
            for r in self.ob_rrefs
        ]
        for f in futs:
            f.wait()

    def finish_episode(self):
        total, loss = 0.0, []
        for ob_id in sorted(self.rewards):
            R, returns = 0.0, []
            for r in reversed(self.rewards[ob_id]):
                R = r + GAMMA * R
                returns.insert(0, R)
            total += sum(self.rewards[ob_id])
            loss += [-lp * ret for lp, ret in zip(self.saved_log_probs[ob_id], returns)]
            self.rewards[ob_id], self.saved_log_probs[ob_id] = [], []
        self.optimizer.zero_grad()
        loss = torch.stack(loss).sum()
        loss.backward()
        self.optimizer.step()
        return total, loss.item()


def run(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = port
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=60, _channels=["basic"])
    name = "agent" if rank == 0 else f"observer{rank}"
    rpc.init_rpc(name, backend=rpc.BackendType.TENSORPIPE, rank=rank, world_size=world_size,
                 rpc_backend_options=options)
    if rank == 0:
        agent = Agent()
        rewards, losses = [], []
        for _ in range(4):
            agent.run_episode()
            reward, loss = agent.finish_episode()
            rewards.append(reward)
            losses.append(loss)
        kind = type(rpc.api._get_current_rpc_agent()).__name__
        print(json.dumps({"program": "rl_observers", "agent": kind, "rewards": rewards,
                          "losses": losses}), flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run, args=(OBSERVERS + 1, sys.argv[1]), nprocs=OBSERVERS + 1, join=True)
