"""LoRA on a tiny GPT-2 in its own process, for tests/checkpoint/test_adapters.py:

    python adapter_trainer.py FOLDER OUT [KILL_AT]

It resumes from FOLDER's newest checkpoint (saved every 3 batches), SIGKILLs itself at the end of global step
KILL_AT (after that batch's save, if any), and writes the adapter's weights to OUT."""

import sys

import torch
from test_adapters import batches, lora_gpt2

from fitforge import Estimator
from fitforge.handlers import CheckpointHandler
from helpers import KillAt


def main(folder, out, kill_at=None):
    model = lora_gpt2()
    trainable = [p for p in model.parameters() if p.requires_grad]
    estimator = Estimator(model, None, optimizer=torch.optim.AdamW(trainable, lr=1e-3), device="cpu")
    handlers = [CheckpointHandler(folder, batch_period=3, resume_from_checkpoint=True)]
    if kill_at is not None:
        handlers.append(KillAt(kill_at))
    estimator.fit(batches(), epochs=2, event_handlers=handlers)  # 12 batches an epoch; the log says it resumed
    torch.save({k: v for k, v in model.state_dict().items() if "lora_" in k}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
