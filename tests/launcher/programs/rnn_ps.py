# SPDX-License-Identifier: BSD-3-Clause
"""An RNN split across a parameter server, trained with distributed autograd
and DistributedOptimizer, written for TensorPipe in the style of upstream's
RPC examples (pytorch/examples distributed/rpc/rnn). Prints one JSON line.

    python rnn_ps.py PORT                         # TensorPipe
    python -m torch_rpc_ext.run rnn_ps.py PORT    # the same program on TORCH_RPC_EXT
"""

import json
import os
import sys
import threading

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
from torch import optim
from torch.distributed.optim import DistributedOptimizer


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


# The parameter server builds both of its modules at once (two rpc.remote calls
# served side by side) and torch's RNG is global: seed and draw under one lock,
# or the weights depend on how the two constructors interleave.
_SEEDED_INIT = threading.Lock()


def _parameter_rrefs(module):
    return [rpc.RRef(p) for p in module.parameters()]


class EmbeddingTable(nn.Module):
    def __init__(self, ntoken, ninp):
        super().__init__()
        with _SEEDED_INIT:
            torch.manual_seed(0)
            self.encoder = nn.Embedding(ntoken, ninp)

    def forward(self, input):
        return self.encoder(input)


class Decoder(nn.Module):
    def __init__(self, ntoken, nhid):
        super().__init__()
        with _SEEDED_INIT:
            torch.manual_seed(1)
            self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, output):
        return self.decoder(output)


class RNNModel(nn.Module):
    def __init__(self, ps, ntoken, ninp, nhid, nlayers):
        super().__init__()
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp))
        torch.manual_seed(2)
        self.rnn = nn.LSTM(ninp, nhid, nlayers)
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid))

    def forward(self, input, hidden):
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, input)
        output, hidden = self.rnn(emb, hidden)
        decoded = _remote_method(Decoder.forward, self.decoder_rref, output)
        return decoded, hidden

    def parameter_rrefs(self):
        params = _remote_method(_parameter_rrefs, self.emb_table_rref)
        params += _parameter_rrefs(self.rnn)
        params += _remote_method(_parameter_rrefs, self.decoder_rref)
        return params


def run_trainer():
    batch, ntoken, ninp, nhid, nlayers = 5, 10, 4, 6, 2
    model = RNNModel("ps", ntoken, ninp, nhid, nlayers)
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.1)
    criterion = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(6):
        data = torch.randint(0, ntoken, (3, batch), generator=gen)
        target = torch.randint(0, ntoken, (3, batch), generator=gen)
        with dist_autograd.context() as ctx:
            hidden = (torch.zeros(nlayers, batch, nhid), torch.zeros(nlayers, batch, nhid))
            output, hidden = model(data, hidden)
            loss = criterion(output.view(-1, ntoken), target.view(-1))
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        losses.append(loss.item())
    agent = type(rpc.api._get_current_rpc_agent()).__name__
    print(json.dumps({"program": "rnn_ps", "agent": agent, "losses": losses}), flush=True)


def run_worker(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = port
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=60, _transports=["uv"])
    if rank == 1:
        rpc.init_rpc("trainer", rank=rank, world_size=world_size, rpc_backend_options=options)
        run_trainer()
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=options)
    rpc.shutdown()


if __name__ == "__main__":
    mp.spawn(run_worker, args=(2, sys.argv[1]), nprocs=2, join=True)
