"""Rank 1 never submits 'never': the stall inspector names it and rank 1, and the job ends."""

import time

import torch

import hpctrain.horovod as hvd

hvd.init()
if hvd.rank() == 0:
    hvd.allreduce(torch.ones(3), name="never")
else:
    time.sleep(60)
print("NOT REACHED", flush=True)
