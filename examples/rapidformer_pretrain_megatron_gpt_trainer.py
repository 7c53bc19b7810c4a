"""The how-to's Megatron GPT PreTrainer sample, runnable. Lines marked `# changed:` differ from the document."""
import torch

from rapidformer import (PreTrainer, RapidformerEngine, build_train_valid_test_datasets,  # changed: all from rapidformer
                         get_args, get_ltor_masks_and_position_ids, get_tokenizer, mpu)
from megatron_patch.models import GPTModel  # changed: the document's `from yourmodel import GPTModel`


class MyGPTPreTrainer(PreTrainer):
    def __init__(self, engine):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        args = get_args()
        train_ds, valid_ds, test_ds = build_train_valid_test_datasets(
            data_prefix=args.data_path,
            data_impl=args.data_impl,
            splits_string=args.split,
            train_valid_test_num_samples=train_val_test_num_samples,
            seq_length=args.seq_length,
            seed=args.seed,
            skip_warmup=(not args.mmap_warmup))
        return train_ds, valid_ds, test_ds

    def model_optimizer_lr_scheduler_provider(self):
        model = GPTModel()
        return model, None, None

    def run_forward_step(self, data_iterator, model):
        """Forward step."""
        args = get_args()
        tokenizer = get_tokenizer()

        keys = ['text']
        datatype = torch.int64

        data = next(data_iterator) if data_iterator is not None else None
        data_b = mpu.broadcast_data(keys, data, datatype)

        tokens_ = data_b['text'].long()
        labels = tokens_[:, 1:].contiguous()
        tokens = tokens_[:, :-1].contiguous()

        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens,
            tokenizer.eod,
            args.reset_position_ids,
            args.reset_attention_mask,
            args.eod_mask_loss)

        output_tensor = model(tokens, position_ids, attention_mask, labels=labels)

        losses = output_tensor.float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()

        return loss


if __name__ == "__main__":  # changed: the document runs these three lines at import
    engine = RapidformerEngine()
    trainer = MyGPTPreTrainer(engine=engine)
    trainer.train()
