"""LoRA in rapidformer: `--lora-rank` on a Hugging Face model goes through peft, with the ZeRO/FSDP switches, and
the run saves PEFT's adapter directory (adapters and the task head only), which peft loads onto the base model."""
from __future__ import annotations

import json

import pytest
import torch

from finetune_utils import explain, metrics_lines, rapidformer, tiny_model
from megatron_patch.demo.task_files import write_task_dataset


@pytest.mark.parametrize("workers", [("2", ["--fsdp-memory-optimization"]),
                                     pytest.param(("1", []), marks=pytest.mark.slow)],
                         ids=["two_workers_fsdp", "one_worker"])
def test_black_box_lora_saves_a_peft_adapter(tmp_path, workers):
    data = write_task_dataset("sequence_classification", str(tmp_path / "data"), n_train=96, n_valid=32, n_test=16)
    model = tiny_model("bert", str(tmp_path / "model"))
    save = tmp_path / "out"
    proc = rapidformer("--task", "sequence_classification", "--pretrained-model-name-or-path", model, "--data-path",
                       data, "--micro-batch-size", "16", "--seq-length", "96", "--lr", "3e-3", "--epochs", "1",
                       "--save", str(save), "--lora-rank", "8", "--lora-alpha", "16", "--lora-target", "query", "value",
                       "--nproc-per-node", workers[0], *workers[1])
    assert proc.returncode == 0, explain(proc)
    out = proc.stdout + proc.stderr
    assert "LoRA (peft): rank 8, alpha 16 on query value, task head trained" in out
    assert ("FSDP" in out) == (workers[0] == "2")
    assert "saved the LoRA adapter" in out
    config = json.loads((save / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and sorted(config["target_modules"]) == ["query", "value"]
    assert config["base_model_name_or_path"] == model
    from safetensors.torch import load_file

    saved = load_file(str(save / "adapter_model.safetensors"))
    assert all(".lora_" in k or ".classifier." in k for k in saved), sorted(saved)  # adapter-only: no base weights
    assert sum(".lora_A." in k for k in saved) == 4  # 2 layers x (query, value)
    valid = [x for x in metrics_lines(str(save / "metrics.jsonl")) if x["split"] == "validation"]

    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    base = AutoModelForSequenceClassification.from_pretrained(model, num_labels=2).eval()
    tuned = PeftModel.from_pretrained(base, str(save)).eval()
    for k, v in saved.items():  # what was saved is what peft loaded
        name = k.replace(".weight", ".default.weight").replace(".bias", ".default.bias") if ".lora_" in k else k
        params = dict(tuned.named_parameters())
        match = [p for n, p in params.items() if n == name or n == k.replace("classifier.", "classifier.modules_to_save.default.")]
        assert match and torch.equal(match[0].detach(), v), k
    assert all(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k)  # trained (B starts at 0)
    assert [x["epoch"] for x in valid] == [1]
