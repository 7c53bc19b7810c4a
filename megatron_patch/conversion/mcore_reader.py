"""Reading an engine checkpoint as full (unsharded) tensors with global megatron-core names, one at a time.

The names are those of the unwrapped GPTModel's (BertModel's: `encoder.layers.`) state dict at TP1 PP1 with
our layer spec, e.g.
`embedding.word_embeddings.weight`, `decoder.layers.3.self_attention.linear_qkv.weight`,
`decoder.layers.3.input_layernorm.weight`, `decoder.final_layernorm.weight`, `output_layer.weight`
(only when the output layer is untied); no `_extra_state`. Tensors keep megatron-core's TP-independent
layout (QKV rows grouped by query group, SwiGLU fc1 = [gate; up], padded vocabulary) and the dtype
they were saved in.

Both checkpoint formats are torch.distributed.checkpoint (DCP) directories, read without a process
group; DCP assembles every tensor from the chunks the ranks saved (any TP/PP/VPP/DP layout):

  torch_dist (ZeRO-0/1, megatron-core dist_checkpointing): layers are stacked, `decoder.layers.<name>`
      of shape [num_layers, ...], each layer saved as its own chunk(s); the norms carry Transformer
      Engine's names (`self_attention.linear_qkv.layer_norm_weight` is `input_layernorm.weight`,
      `mlp.linear_fc1.layer_norm_weight` is `pre_mlp_layernorm.weight`). One layer is read as the
      region [i:i+1] of the stacked tensor, so only that layer's chunks are read, in any order. A model
      whose layers differ (mixture of experts with --moe-layer-freq other than 1) is saved per layer
      instead: `decoder.layers.<i>.<name>`. megatron-core saves a layer's routed experts stacked too:
      `mlp.experts.experts.linear_fc1.weight` [num_experts, ...] (after the layer dimension when layers
      are stacked), read here as `mlp.experts.local_experts.<e>.linear_fc1.weight`, e global.
  fsdp_dtensor (ZeRO-2): `model.<state dict name>` with global layer numbers, in uneven row shards; a
      tied output layer's copy on the last pipeline stage is stored too and is left out here. These
      are Megatron-FSDP's fp32 main weights: a bf16 run's checkpoint reads as float32 (torch_dist saves
      the model's own bf16 weights). SwiGLU's fc1 is stored as its halves `linear_fc1.weight_w` (gate)
      and `_v` (up), read here as one [gate; up] tensor; an older checkpoint stored it whole, which at
      TP > 1 interleaves the ranks' halves ([g0; u0; g1; u1]): put back in order here.

Megatron-LM checkpoints without our checkpoint.json are refused (the stored configuration is needed).
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_patch.compat import apply_safe_loading
from megatron_patch.config import checkpoint_layout as directory
from megatron_patch.config.checkpoint_layout import CheckpointError

from .mapping import TensorIndex

TORCH_DIST, FSDP_DTENSOR = "torch_dist", "fsdp_dtensor"
STACKED = ("decoder.layers.", "encoder.layers.")  # GPTModel's, BertModel's
# dist_checkpointing names our spec's norms after Transformer Engine's fused norm+linear modules
TE_NORMS = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
            "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm."}
_LAYER = re.compile(r"^((?:decoder|encoder)\.layers\.)(\d+)\.(.+)$")
# optimizer state: megatron-core's ChainedOptimizer (experts apart, EP > 1 or ETP != TP) saves chained_<n>.optimizer.*
_OPTIMIZER = re.compile(r"^(chained_\d+\.)?optimizer\.")
_SWIGLU_HALF = re.compile(r"^(.*\.linear_fc1\.(?:weight|bias))_([wv])$")  # fsdp_dtensor's split SwiGLU fc1
_SWIGLU_FC1 = re.compile(r"\.linear_fc1\.(weight|bias)$")
STACKED_EXPERTS = "mlp.experts.experts."  # a layer's routed experts, stacked along a leading expert dimension


def local_norm_name(name: str) -> str:
    """A layer-relative name with Transformer Engine's norm names replaced by our spec's
    (`self_attention.linear_qkv.layer_norm_weight` -> `input_layernorm.weight`); others unchanged."""
    for te, local in TE_NORMS.items():
        if name.startswith(te):
            return local + name[len(te):]
    return name


class _MetadataOnce(FileSystemReader):
    """A FileSystemReader that unpickles `.metadata` once (it can be large: it describes every optimizer
    shard too) instead of at each of the thousands of per-tensor loads."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._metadata: Optional[Metadata] = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class _RegionPlanner(LoadPlanner):
    """Plans the read of one region (`offsets`, `buffer.shape`) of the checkpoint tensor `key` into `buffer`.

    DCP's own resharding (`create_read_items_for_chunk_list`) finds the saved chunks that overlap the
    region and where each lands; only those chunks are read."""

    def __init__(self, key: str, offsets: Sequence[int], buffer: torch.Tensor) -> None:
        self.key, self.offsets, self.buffer = key, list(offsets), buffer

    def set_up_planner(self, state_dict, metadata: Optional[Metadata] = None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        region = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.buffer.shape)
        saved = self.metadata.state_dict_metadata[self.key]
        return LoadPlan(create_read_items_for_chunk_list(self.key, saved, [region]))

    def create_global_plan(self, global_plan: List[LoadPlan]) -> List[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value) -> None:
        raise CheckpointError(f"{self.key} is stored as an object, not a tensor")  # never planned: tensors only

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self.buffer  # the part of the region this read fills: DCP copies the saved chunk's overlap into it
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # the reader copied into our buffer's view already


def resolve_checkpoint(path: str) -> str:
    """The `iter_XXXXXXX` directory to read: `path` itself, or the checkpoint a --save root's tracker names
    (the newest complete one, as resuming would choose)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} does not exist: give an engine checkpoint (an iter_XXXXXXX directory) or "
                              f"the --save directory that holds them")
    if os.path.isfile(os.path.join(path, directory.MANIFEST)) or os.path.isfile(os.path.join(path, ".metadata")):
        reason = directory.incomplete_reason(path)
        if reason is not None:
            raise CheckpointError(f"{path} cannot be read: {reason}. Use a complete checkpoint (its --save "
                                  f"directory picks the newest complete one)")
        return path
    iteration, notes = directory.select_checkpoint(path)
    for note in notes:
        warnings.warn(note, stacklevel=3)
    if iteration is None:
        raise CheckpointError(f"{path} holds no checkpoint (no {directory.TRACKER}, no iter_XXXXXXX directory, no "
                              f"{directory.MANIFEST}): give a checkpoint written with --save")
    return directory.checkpoint_dir(path, iteration)


class MegatronCheckpointReader(TensorIndex):  # keys(): embedding, layers 0..L-1, final norm, output layer
    """The model weights of an engine checkpoint (any layout, ZeRO-0/1/2, fp32 or bf16) as full tensors.

    `path`: an `iter_XXXXXXX` directory or the --save root (its tracker names the checkpoint).
    `keys()` are global megatron-core names (module docstring); `get(name)` reads that one tensor.
    `.manifest` is the checkpoint's checkpoint.json, `.config` the engine configuration stored in it.
    """

    def __init__(self, path: str) -> None:
        apply_safe_loading()  # .metadata and objects unpickle through allow-lists: reading never runs code
        self.path = resolve_checkpoint(path)  # complete: its checkpoint.json is there and every file it lists
        self.manifest: Dict = directory.read_manifest(self.path)
        self.config: Dict = self.manifest.get("config", {})
        self.format: str = self.manifest.get("format", "")
        manifest_file = os.path.join(self.path, directory.MANIFEST)
        if self.format not in (TORCH_DIST, FSDP_DTENSOR):
            raise CheckpointError(f"{manifest_file}: unknown format {self.format!r} (expected {TORCH_DIST} or "
                                  f"{FSDP_DTENSOR}); was it written by a newer megatron_patch?")
        if not isinstance(self.config.get("num_layers"), int):
            raise CheckpointError(f"{manifest_file} stores no configuration with num_layers; the reader needs the "
                                  f"configuration the checkpoint was trained with")
        self._halves: Dict[str, Dict[str, str]] = {}  # fsdp_dtensor: a SwiGLU fc1 name -> its _w and _v keys
        self._storage = _MetadataOnce(self.path)
        self._metadata = self._read_metadata()
        self._where = self._index()

    def _read_metadata(self) -> Metadata:
        from megatron_patch.compat.safe_loading import UnsafeCheckpointError

        file = os.path.join(self.path, ".metadata")
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing: the checkpoint's DCP metadata is needed to read its tensors")
        try:
            return self._storage.read_metadata()
        except UnsafeCheckpointError as e:
            raise CheckpointError(f"{file}: {e}. Reading a checkpoint never runs code it contains; this one was "
                                  f"not written by megatron_patch or has been tampered with.") from None

    @property
    def num_layers(self) -> int:
        return int(self.config["num_layers"])

    @property
    def tied(self) -> bool:
        """True when the output layer shares the word embedding (then there is no `output_layer.weight`)."""
        return not self.config.get("untie_embeddings_and_output_weights", False)

    def _index(self) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
        """global name -> (checkpoint key, indices into its leading stacked dimensions: layer and/or expert),
        in the model's order."""
        where: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
        for key, md in self._metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata) or "_extra_state" in key:
                continue
            if self.format == FSDP_DTENSOR:
                if not key.startswith("model."):
                    continue  # optimizer state
                name = key[len("model."):]
                m = _LAYER.match(name)
                if m:
                    name = f"{m.group(1)}{m.group(2)}.{local_norm_name(m.group(3))}"
                half = _SWIGLU_HALF.match(name)
                if half:  # gate (_w) and up (_v) of one fc1: read as one tensor (get())
                    self._halves.setdefault(half.group(1), {})[half.group(2)] = key
                    name = half.group(1)
                where[name] = (key, ())
            elif _OPTIMIZER.match(key):
                continue
            elif _LAYER.match(key):  # saved per layer (layers of different kinds)
                m = _LAYER.match(key)
                self._add_layer(where, key, md, f"{m.group(1)}{m.group(2)}.", local_norm_name(m.group(3)), ())
            elif key.startswith(STACKED):
                if md.size[0] != self.num_layers:
                    raise CheckpointError(f"{self.path}: {key} stacks {md.size[0]} layers, the stored configuration "
                                          f"says num_layers={self.num_layers}; the checkpoint is inconsistent")
                stack = next(p for p in STACKED if key.startswith(p))
                rest = local_norm_name(key[len(stack):])
                for i in range(self.num_layers):
                    self._add_layer(where, key, md, f"{stack}{i}.", rest, (i,))
            else:
                where[key] = (key, ())
        if self.tied:
            where.pop("output_layer.weight", None)  # the last stage's copy of the embedding (fsdp_dtensor, PP > 1)
        if "embedding.word_embeddings.weight" not in where and "output_layer.weight" not in where:
            raise CheckpointError(f"{self.path} holds no model weights (no embedding, no output layer): is it a "
                                  f"{self.format} checkpoint of a GPT model?")
        self._check_layers(where)
        return dict(sorted(where.items(), key=lambda kv: _order(kv[0])))

    def _add_layer(self, where: Dict, key: str, md: TensorStorageMetadata, layer: str, rest: str,
                   index: Tuple[int, ...]) -> None:
        """One layer's tensor `rest` of checkpoint `key` (at `index` in its stacked dimensions); stacked
        experts become one global name per expert."""
        if not rest.startswith(STACKED_EXPERTS):
            where[layer + rest] = (key, index)
            return
        experts = md.size[len(index)]
        if experts != self.config.get("num_experts"):
            raise CheckpointError(f"{self.path}: {key} holds {experts} experts, the stored configuration says "
                                  f"num_experts={self.config.get('num_experts')}; the checkpoint is inconsistent")
        for e in range(experts):
            where[f"{layer}mlp.experts.local_experts.{e}.{rest[len(STACKED_EXPERTS):]}"] = (key, index + (e,))

    def _check_layers(self, where: Dict) -> None:
        layers = {int(m.group(2)) for m in map(_LAYER.match, where) if m}
        if layers and layers != set(range(self.num_layers)):
            raise CheckpointError(f"{self.path}: the checkpoint has layers {sorted(layers)}, the stored configuration "
                                  f"says num_layers={self.num_layers}; the checkpoint is incomplete or inconsistent")

    def _lookup(self, name: str) -> Tuple[str, Tuple[int, ...], TensorStorageMetadata]:
        if name not in self._where:
            tied = " (the output layer is tied to embedding.word_embeddings.weight)" if name == "output_layer.weight" \
                and self.tied else ""
            raise CheckpointError(f"no tensor {name!r} in {self.path} ({self.format}){tied}; keys() lists the "
                                  f"{len(self._where)} global names it has")
        key, index = self._where[name]
        return key, index, self._metadata.state_dict_metadata[key]

    def shape_of(self, name: str) -> List[int]:
        """The full shape of `name` (from the metadata; nothing is read)."""
        _, index, md = self._lookup(name)
        shape = list(md.size[len(index):])
        if name in self._halves:  # gate and up, of one shape each
            shape[0] *= 2
        return shape

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype `name` was saved in (bf16 runs save bf16 weights in torch_dist; see the module docstring)."""
        return self._lookup(name)[2].properties.dtype

    def get(self, name: str) -> torch.Tensor:
        """The full tensor `name`, read from the checkpoint's chunks that hold it (and only those)."""
        key, index, md = self._lookup(name)
        if name in self._halves:
            halves = self._halves[name]
            return torch.cat([self._read(halves[h], index, self._metadata.state_dict_metadata[halves[h]])
                              for h in ("w", "v")])
        t = self._read(key, index, md)
        tp = self._interleaved_tp(name)
        if tp > 1:  # an older ZeRO-2 checkpoint's fc1 at TP > 1: [g0; u0; g1; u1] -> [g0; g1; u0; u1]
            t = t.reshape(tp, 2, t.shape[0] // (2 * tp), *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        return t

    def _interleaved_tp(self, name: str) -> int:
        """The TP size over which an older ZeRO-2 checkpoint interleaved SwiGLU fc1 `name` (1: not interleaved)."""
        if self.format != FSDP_DTENSOR or not self.config.get("swiglu") or not _SWIGLU_FC1.search(name) \
                or self.manifest.get("optimizer_sharding") == "fully_reshardable":
            return 1
        lay = self.manifest.get("layout", {})
        return int(lay.get("etp", lay.get("tp", 1)) if ".experts." in name else lay.get("tp", 1))

    def _read(self, key: str, index: Tuple[int, ...], md: TensorStorageMetadata) -> torch.Tensor:
        shape = list(md.size)
        offsets = [0] * len(shape)
        for dim, i in enumerate(index):  # one layer / one expert of a stacked tensor: a region of size 1 there
            offsets[dim], shape[dim] = i, 1
        buffer = torch.empty(shape, dtype=md.properties.dtype)
        with warnings.catch_warnings():  # dcp.load warns on every call that no process group is used: intended
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({key: buffer}, storage_reader=self._storage, planner=_RegionPlanner(key, offsets, buffer),
                     no_dist=True)
        return buffer.reshape(shape[len(index):])


def _order(name: str) -> Tuple:
    """The order of the TP1 PP1 model's state dict, the same for every format: embedding, layers by number
    (norm, attention, norm, MLP; weight before bias), final norm, output layer."""
    module, _, leaf = name.rpartition(".")
    leaf_rank = {"weight": 0, "bias": 1}.get(leaf, 2)
    m = _LAYER.match(module + ".")
    if m:
        rest = m.group(3)
        steps = ("input_layernorm.", "self_attention.", "post_attention_layernorm.", "pre_mlp_layernorm.", "mlp.",
                 "post_mlp_layernorm.")
        part = next((i for i, p in enumerate(steps) if rest.startswith(p)), len(steps))
        expert = re.search(r"\.local_experts\.(\d+)\.", rest)  # experts by number: 2 before 10
        return 1, int(m.group(2)), part, int(expert.group(1)) if expert else -1, rest, leaf_rank, leaf
    group = 0 if name.startswith("embedding.") else 3 if name.startswith(("output_layer.", "lm_head.")) else 2
    return group, 0, 0, -1, "", leaf_rank, ""  # ties keep the checkpoint's order (word before position embeddings)
