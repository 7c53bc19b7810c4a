#!/usr/bin/env bash
# The data pipeline end to end on the built-in demo corpus: build the data, then read it back through
# megatron-core (its own IndexedDataset, and GPT training samples via BlendedMegatronDatasetBuilder).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/pretrain_scripts/resolve_python.sh"  # PY: $PY, else .venv, else python3
DATA=$(bash "$ROOT/pretrain_scripts/prepare_demo_data.sh" | tail -n 1)
DIR=$(dirname "$DATA")
PYTHONWARNINGS=ignore "$PY" - "$DATA" "$DIR" <<'PYEOF'
import sys
import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset as CoreIndexedDataset
from megatron_patch.data.datasets import build_gpt_datasets
from megatron_patch.data.dynamic_shape import DocumentSamples, VariableLengthBatches
from megatron_patch.data.indexed_dataset import IndexedDataset
from megatron_patch.data.tokenizers import build_tokenizer

data, d = sys.argv[1], sys.argv[2]
tok = build_tokenizer("GPT2BPETokenizer", vocab_file=f"{d}/gpt2-vocab.json", merge_file=f"{d}/gpt2-merges.txt")
ours, core = IndexedDataset(data), CoreIndexedDataset(data)
same = all(np.array_equal(ours[i], core[i]) for i in range(len(ours)))
print(f"{data}: {ours.num_documents} documents, {int(ours.sequence_lengths.sum())} tokens ({ours.dtype}); "
      f"megatron-core reads identical tokens: {same}")
train, valid, test = build_gpt_datasets([data], tok, 256, (1000, 100, 100), split="969,30,1", cache_dir=f"{d}/cache")
print(f"GPT datasets (seq 256, split 969,30,1): train {len(train)}, valid {len(valid)}, test {len(test)} samples")
print("train[0]:", repr(tok.detokenize(train[0]["tokens"][:48].tolist()))[:200], "...")
for it in ("fixed-shape", "dynamic-shape"):
    s = VariableLengthBatches(DocumentSamples(ours), it, 8, 512, pad_id=0, multiple=8).stats()
    print(f"--data-iterator {it:<13}: padding {100 * s.padding_fraction:5.1f}% of {s.padded_tokens} computed tokens")
PYEOF
