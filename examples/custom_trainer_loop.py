"""The how-to's "custom Trainer" section ("Caixa branca: Ajuste fino com Hugging Face usando um Trainer
personalizado") as a whole script: a user's own training loop, changed only where the section says
(`finetuner.build_data_loader` for data parallelism, `engine.compose` for the fused optimizer), plus what is
needed to run here (local model and data; the README lists it). Run it with

    rapidformer --user-script examples/custom_trainer_loop.py --pretrained-model-name-or-path $MODEL \
        --data-path $DATA --train-iters 60 --lr-warmup-iters 6 --lr 5e-5 --micro-batch-size 16
"""
from functools import partial

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

from megatron_patch.data.finetune_data import load_finetune_dataset
from rapidformer import Finetuner, RapidformerEngine, get_args

engine = RapidformerEngine()
finetuner = Finetuner(engine=engine)
args = get_args()

tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path)
raw = load_finetune_dataset(args.dataset_path, args.dataset_name)
tokenized_datasets = raw.map(lambda b: tokenizer(b["sentence1"], b["sentence2"], truncation=True),
                             batched=True, remove_columns=["idx", "sentence1", "sentence2"])
tokenized_datasets = tokenized_datasets.rename_column("label", "labels")
model = AutoModelForSequenceClassification.from_pretrained(args.pretrained_model_name_or_path, num_labels=2)

# the section's change 1: data parallel loaders whose batches arrive on the device (no batch.to(device))
train_dataloader = finetuner.build_data_loader(tokenized_datasets["train"], shuffle=True)
eval_dataloader = finetuner.build_data_loader(tokenized_datasets["validation"])

# the section's change 2: the optimizer comes from engine.compose (apex's fused Adam when installed)
lr_scheduler = partial(
    get_linear_schedule_with_warmup,
    num_warmup_steps=args.lr_warmup_iters,
    num_training_steps=args.train_iters,
)
model, optimizer, lr_scheduler = engine.compose(
    model_obj=model,
    lr_scheduler_fn=lr_scheduler)

step = 0
model.train()
while step < args.train_iters:
    for batch in train_dataloader:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        step += 1
        if step % 10 == 0 and engine.rank == 0:
            print(f"step {step} | loss {loss.item():.4f} | lr {lr_scheduler.get_last_lr()[0]:.2e}", flush=True)
        if step >= args.train_iters:
            break

model.eval()
correct = total = 0
with torch.no_grad():
    for batch in eval_dataloader:
        predictions = model(**batch).logits.argmax(-1)
        gathered, labels = finetuner.gather(predictions), finetuner.gather(batch["labels"])
        correct += int((gathered == labels).sum())
        total += labels.numel()
if engine.rank == 0:
    print(f"validation accuracy {correct / total:.4f} over {total} samples", flush=True)
