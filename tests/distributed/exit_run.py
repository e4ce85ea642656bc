"""Run under torchrun: the exit that could abort. The group is made as fitforge makes it and stays
referenced to the end, as a DDP wrapper or an FSDP mesh holds it; small all-reduces whose tensors
are let go of at once leave gloo's worker threads to free them, and the script ends right after.
Without fitforge's wait at exit, a worker that asks for the GIL while the interpreter shuts down
aborts the rank (SIGABRT, "terminate called without an active exception")."""

import torch
import torch.distributed as dist

from fitforge.distributed.process_group import init_process_group

init_process_group(torch.device("cpu"))
group = dist.group.WORLD
for step in range(20):
    dist.all_reduce(torch.tensor([step]), group=group)
