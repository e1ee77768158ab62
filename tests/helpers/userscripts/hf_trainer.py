"""A Hugging Face Trainer script as users write them, with trainguard's one line
(``trainguard.integrations.hf.train(trainer)`` instead of ``trainer.train()``). A tiny GPT-2
built from its config (no download), random token data, DDP over gloo when launched with
several ranks. Rank 0 appends ``step loss`` lines to LOSSES_FILE from the Trainer's logs.

    trainguard run --nproc-per-node 2 hf_trainer.py OUTPUT_DIR LOSSES_FILE [--plain]

``--plain`` calls ``trainer.train()`` (no trainguard), for the reference run.
"""

import sys

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

out_dir, losses_file = sys.argv[1], sys.argv[2]
plain = "--plain" in sys.argv


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=256, length=16):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LogLosses(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kw):
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(losses_file, "a") as f:
                f.write(f"{state.global_step} {logs['loss']!r}\n")


set_seed(0)  # before the model is built: its initial weights are the same every run
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
args = TrainingArguments(
    output_dir=out_dir,
    max_steps=24,
    per_device_train_batch_size=4,
    logging_steps=1,
    learning_rate=1e-3,
    warmup_steps=4,
    save_strategy="no",
    report_to=[],
    use_cpu=True,
    seed=0,
    dataloader_num_workers=0,
    disable_tqdm=True,
)
trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[LogLosses()])
if plain:
    trainer.train()
else:
    import trainguard.integrations.hf

    trainguard.integrations.hf.train(trainer)
if torch.distributed.is_initialized():  # as users end a torchrun script (gloo: no abort at exit)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
