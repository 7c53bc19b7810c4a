"""Reading and writing Hugging Face model directories, one tensor at a time.

A directory holds `config.json` and its weights as safetensors: `model.safetensors`, or shards
`model-0000i-of-0000N.safetensors` named by `model.safetensors.index.json` (the format transformers
writes and `from_pretrained` reads). Optional files travel with the weights: `generation_config.json`
and the tokenizer's files (`copy_aux_files`).

Host memory stays near one tensor when reading (each `get` opens only the shard that holds the name)
and near one shard when writing (`HFCheckpointWriter` writes a shard as soon as it is full). Pickled
`pytorch_model.bin` checkpoints are not read: unpickling can run code (see DESIGN.md).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from typing import Dict, Iterator, List, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .mapping import TensorIndex

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size="5GB" (decimal, as it parses it)
AUX_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "added_tokens.json",
             "chat_template.jinja", "chat_template.json")
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
# safetensors' dtype names (safe_open's get_slice().get_dtype()) -> torch
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class HFCheckpointError(ValueError):
    """A Hugging Face directory that cannot be read or written; the message names the file and the fix."""


def read_hf_config(path: str) -> Dict:
    """The parsed `config.json` of the Hugging Face model directory `path`."""
    file = os.path.join(path, CONFIG)
    if not os.path.isfile(file):
        raise HFCheckpointError(f"{file} does not exist: a Hugging Face model directory needs its config.json "
                                f"(save the model with save_pretrained, or point at the directory that holds it)")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFCheckpointError(f"{file} is not valid JSON ({e}); restore it from the original model") from None
    if not isinstance(config, dict):
        raise HFCheckpointError(f"{file} holds a {type(config).__name__}, not a JSON object of model settings")
    return config


def _open_safetensors(file: str):
    """safe_open(file), or HFCheckpointError naming the file. safetensors checks the header and that the file
    is as long as the header says, so a truncated download or a file that is not safetensors fails here."""
    from safetensors import SafetensorError

    try:
        return safe_open(file, framework="pt")
    except (SafetensorError, OSError) as e:
        raise HFCheckpointError(f"{file} is not a readable safetensors file ({e}): it is truncated or corrupt; "
                                f"copy or download it again") from None


class HFCheckpointReader(TensorIndex):
    """The tensors of a Hugging Face directory, by name, read one at a time from the shard that holds them.

    `keys()` lists every tensor in the files (tied weights that transformers dropped on saving are
    absent); `get(name)` returns it as stored (dtype included)."""

    def __init__(self, path: str) -> None:
        self.path = path
        index, single = os.path.join(path, INDEX), os.path.join(path, SINGLE)
        if os.path.isfile(index):
            self._where = self._read_index(index)
        elif os.path.isfile(single):
            with _open_safetensors(single) as f:
                self._where = {name: SINGLE for name in f.keys()}
        elif not os.path.isdir(path):
            raise HFCheckpointError(f"{path} does not exist or is not a directory: expected a Hugging Face model "
                                    f"directory (config.json and safetensors weights)")
        else:
            has_bin = any(n.endswith(".bin") for n in os.listdir(path))
            hint = (" Its pickled .bin weights are not read (unpickling can run code): re-save the model with "
                    "save_pretrained(..., safe_serialization=True).") if has_bin else ""
            raise HFCheckpointError(f"{path} has neither {SINGLE} nor {INDEX}: no safetensors weights to read.{hint}")
        self._open_file: Optional[str] = None  # one shard open at a time: the one the last `get` used
        self._handle = None
        self._handle_keys: set = set()

    def _read_index(self, index: str) -> Dict[str, str]:
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"its weight_map is a {type(weight_map).__name__}")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise HFCheckpointError(f"{index} is not a safetensors index (a JSON object with a 'weight_map' "
                                    f"object): {e}; restore it, or remove it if the directory has one model.safetensors"
                                    ) from None
        for shard in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(self.path, shard)):
                raise HFCheckpointError(f"{index} names the shard {shard}, which is not in {self.path}: the download "
                                        f"or copy is incomplete; fetch the missing file")
        return dict(weight_map)

    def check_files(self) -> None:
        """Open every weight file once (its header only): a truncated or corrupt file is reported now, by
        name, rather than when its first tensor is needed."""
        for file in sorted(set(self._where.values())):
            with _open_safetensors(os.path.join(self.path, file)):
                pass

    def file_of(self, name: str) -> str:
        """The path of the file that holds `name`."""
        if name not in self._where:
            searched = INDEX if os.path.isfile(os.path.join(self.path, INDEX)) else SINGLE
            raise HFCheckpointError(f"no tensor {name!r} in {os.path.join(self.path, searched)} "
                                    f"({len(self._where)} tensors; the reader's keys() lists them)")
        return os.path.join(self.path, self._where[name])

    def _file(self, name: str):
        file = self.file_of(name)
        if file != self._open_file:
            self._handle = None  # release the previous shard's map before opening the next one
            self._handle = _open_safetensors(file)
            self._handle_keys = set(self._handle.keys())
            self._open_file = file
        if name not in self._handle_keys:
            raise HFCheckpointError(f"{file} has no tensor {name!r}, although {INDEX} names it there: the index "
                                    f"and the shards disagree; re-save or re-download the model")
        return self._handle

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name`, in full, as stored."""
        return self._file(name).get_tensor(name)

    def shape_of(self, name: str) -> List[int]:
        """The shape of `name`, read from the file header (no data is read)."""
        return list(self._file(name).get_slice(name).get_shape())

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype of `name`, read from the file header (no data is read)."""
        code = self._file(name).get_slice(name).get_dtype()
        if code not in _DTYPES:
            raise HFCheckpointError(f"{self.file_of(name)}: tensor {name!r} has the safetensors dtype {code}, "
                                    f"which the conversion does not handle")
        return _DTYPES[code]

    def items(self) -> Iterator:
        """(name, tensor) pairs, one tensor in memory at a time, shard by shard."""
        for name in sorted(self._where, key=lambda n: self._where[n]):
            yield name, self.get(name)


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the CPU, contiguous, and the only user of its storage.

    safetensors refuses tensors that share storage (tied weights, slices of one stacked tensor), and a
    view would keep its whole base (e.g. a stacked [L, ...] tensor) alive while the shard waits."""
    t = tensor.detach().to("cpu")
    if not t.is_contiguous() or t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


class HFCheckpointWriter:
    """Streams tensors into safetensors shards of at most `max_shard_bytes` (a larger tensor gets a shard
    of its own), as transformers' save_pretrained shards them.

    `add(name, tensor)` appends; a full shard is written at once, so memory holds one shard at most.
    `close(metadata)` gives the shards their final names: `model.safetensors` when there is one, else
    `model-0000i-of-0000N.safetensors` and `model.safetensors.index.json`. Until then the shards have
    temporary names and the index is written last, so an interrupted export never looks complete.
    Use it as a context manager to remove the partial files when the export fails.

    `header_metadata` (strings) goes into every shard's header next to transformers' {"format": "pt"};
    it is given up front because shards are written while tensors are still being added.
    """

    def __init__(self, path: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 header_metadata: Optional[Dict[str, str]] = None) -> None:
        if max_shard_bytes <= 0:
            raise HFCheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        os.makedirs(path, exist_ok=True)
        self.path, self.max_shard_bytes = path, max_shard_bytes
        self._header = {**(header_metadata or {}), "format": "pt"}
        self._shard: Dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._written: List[List[str]] = []  # names of each shard written so far, in order
        self._names = set()
        self._total_bytes = self._total_params = 0
        self._closed = False
        self._token = uuid.uuid4().hex[:8]  # temporary names of our own: another writer's abort leaves ours alone

    def _tmp(self, i: int) -> str:
        return os.path.join(self.path, f".model-part-{self._token}-{i + 1:05d}.safetensors.tmp")

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue `tensor` under `name`; writes the current shard first when `tensor` would overflow it."""
        if self._closed:
            raise HFCheckpointError(f"the writer of {self.path} is closed; {name!r} was added after close()")
        if name in self._names:
            raise HFCheckpointError(f"{name!r} was added twice to {self.path}; each tensor name is written once")
        t = _own_storage(tensor)
        size = t.numel() * t.element_size()
        if self._shard and self._shard_bytes + size > self.max_shard_bytes:
            self._flush()
        self._shard[name] = t
        self._names.add(name)
        self._shard_bytes += size
        self._total_bytes += size
        self._total_params += t.numel()

    def _flush(self) -> None:
        save_file(self._shard, self._tmp(len(self._written)), metadata=self._header)
        self._written.append(list(self._shard))
        self._shard, self._shard_bytes = {}, 0

    def close(self, metadata: Optional[Dict[str, str]] = None) -> List[str]:
        """Write the last shard, name the shards and write the index; returns the names of the files written.

        `metadata`: extra entries for the index's "metadata" object, next to total_size and total_parameters
        (sharded output only: a single model.safetensors has no index; use header_metadata for that)."""
        if self._closed:
            raise HFCheckpointError(f"the writer of {self.path} is already closed")
        if not self._names:
            raise HFCheckpointError(f"no tensor was added to the writer of {self.path}; nothing to write")
        if self._shard:
            self._flush()
        self._closed = True
        self._remove_stale_weights()
        n = len(self._written)
        if n == 1:
            os.replace(self._tmp(0), os.path.join(self.path, SINGLE))
            return [SINGLE]
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {t: names[i] for i, shard in enumerate(self._written) for t in shard}
        totals = {"total_parameters": self._total_params, "total_size": self._total_bytes}
        index = {"metadata": {**(metadata or {}), **totals}, "weight_map": dict(sorted(weight_map.items()))}
        tmp_index = os.path.join(self.path, INDEX + ".tmp")
        with open(tmp_index, "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")  # byte-for-byte as transformers writes it
        for i, name in enumerate(names):
            os.replace(self._tmp(i), os.path.join(self.path, name))
        os.replace(tmp_index, os.path.join(self.path, INDEX))  # last: only now does the directory look complete
        return [*names, INDEX]

    def _remove_stale_weights(self) -> None:
        """Weight files of an earlier export into the same directory would be mixed with ours (transformers
        removes them the same way on save_pretrained)."""
        for name in os.listdir(self.path):
            if name in (SINGLE, INDEX) or _SHARD.match(name):
                os.remove(os.path.join(self.path, name))

    def abort(self) -> None:
        """Remove the temporary shards written so far (the export failed)."""
        self._closed = True
        self._shard = {}
        for i in range(len(self._written)):
            if os.path.exists(self._tmp(i)):
                os.remove(self._tmp(i))

    def __enter__(self) -> "HFCheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()


def copy_aux_files(src: str, dst: str) -> List[str]:
    """Copy the generation config and tokenizer files that `src` has into `dst`; returns their names."""
    os.makedirs(dst, exist_ok=True)
    copied = []
    for name in AUX_FILES:
        file = os.path.join(src, name)
        if os.path.isfile(file):
            tmp = os.path.join(dst, name + ".tmp")
            shutil.copyfile(file, tmp)
            os.replace(tmp, os.path.join(dst, name))
            copied.append(name)
    return copied
