"""`pretrain(cfg)`: the training loop on megatron-core.

Order of set-up: process groups -> tokenizer and data -> model chunks (one per virtual pipeline stage)
-> mixed-precision wrapper -> megatron-core DDP (ZeRO-1: its distributed optimizer) or Megatron-FSDP
(ZeRO-2: gradients and optimizer state sharded) -> optimizer and lr schedule -> checkpoint load. Each iteration runs megatron-core's forward/backward schedule (no
pipelining, 1F1B, or interleaved 1F1B), one optimizer step, then logging, evaluation and saving.
"""
from __future__ import annotations

import math
import time
from functools import partial
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_patch.config import Config
from megatron_patch.config.fit import fit_warning
from megatron_patch.config.memory_model import NotModelled
from megatron_patch.models import build
from megatron_patch.models.build import WeightLoader, model_vocab_size, wrap_model
from megatron_patch.parallel import current_device, initialize, print_rank_0, watchdog

from .checkpoint import Checkpointer, TrainState
from .data import build_datasets, build_iterator, tokenizer_from_config
from .evaluation import ValidationStream, Validator
from .memory import model_state_bytes
from .moe_metrics import MoEMetrics
from .optimizer import build_optimizer, build_scheduler
from .profiling import Profiler
from .reporting import Reporter
from .step import CountingIterator, count_parameters, forward_step, materialize, mean_losses, stage_flags
from .step_clock import StepClock


class TrainingDiverged(RuntimeError):
    """Raised when the loss becomes NaN/Inf (with --exit-on-nan, the default)."""


class Trainer:
    """Holds the state of one pretraining run; `train()` runs it."""

    # The losses the forward step's loss function reports; the objective ("loss" in the metrics) is their
    # sum, and with more than one each is also logged on its own (BERT: "lm loss" and "sop loss").
    loss_keys: Sequence[str] = ("lm loss",)
    # Which ranks _reads_data picks, in words (the log says it after the first step).
    reads_where = "tensor-parallel rank 0 of the first and last pipeline stages"
    # Finish a step's metrics (read them from the device) only once the next step is queued: None = on a GPU,
    # where the device works asynchronously (see train()).
    defer_step_metrics: Optional[bool] = None

    def __init__(self, cfg: Config, load_weights: Optional[WeightLoader] = None) -> None:
        """`load_weights`: weights from outside the engine (--load-hf: the entry point passes
        conversion.hf_source.weights_for(cfg)), loaded into the model before its wrappers."""
        self.load_weights = load_weights
        cfg = self.cfg = self._initialize(cfg)  # the validated Config (resolved defaults): used from here on
        self.tokenizer = tokenizer_from_config(cfg)
        # Data first: a bad --data-path or out-of-vocabulary ids are reported before the model is built.
        self.train_ds, self.valid_ds, self.test_ds = self._build_datasets()
        vocab = self.vocab_size = model_vocab_size(cfg, self.tokenizer)
        self._warn_if_too_big(vocab)
        self.model = wrap_model(cfg, self._build_chunks(vocab))
        self.optimizer, self.optimizer_name = build_optimizer(cfg, self.model)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        tconfig = self.model[0].config
        tconfig.finalize_model_grads_func = finalize_model_grads
        tconfig.grad_scale_func = self.optimizer.scale_loss
        if cfg.zero_2_memory_optimization:
            tconfig.no_sync_func = self.model[0].no_sync  # reduce-scatter once per step, not per micro batch
        self.checkpointer = Checkpointer(cfg, self.model, self.optimizer, self.scheduler, model_info=self._model_info(vocab))
        self.state = (self.checkpointer.load() if cfg.load else None) or TrainState()
        stream = ValidationStream(cfg, self.valid_ds, partial(self._iterators, cycle=True), self.evaluate)
        self.validator = Validator(stream, every=stream.every)
        self.num_params = count_parameters(self.model)
        self.moe_metrics = MoEMetrics(cfg, self.model) if cfg.num_experts else None
        self.fwd_bwd = get_forward_backward_func()
        self.history: List[Dict[str, float]] = []
        self.loss_components: Dict[str, float] = {}  # of the last global batch (see _objective)
        self.eval_components: Dict[str, float] = {}  # of the last evaluation

    # ---- the parts a template (megatron_patch.templates.pretrain_megatron) replaces -----------------------
    def _initialize(self, cfg: Config) -> Config:
        return initialize(cfg)

    def _warn_if_too_big(self, vocab: int) -> None:
        """Before any model memory is taken: the planner's memory model against this GPU (one line on rank 0)."""
        if not torch.cuda.is_available():
            return
        try:
            line = fit_warning(self.cfg, vocab, dist.get_world_size(), torch.cuda.get_device_properties(0).total_memory)
        except NotModelled:
            return
        if line:
            print_rank_0(line)

    def _build_datasets(self):
        return build_datasets(self.cfg, self.tokenizer)

    def _build_chunks(self, vocab: int) -> List[torch.nn.Module]:
        return build.build_model_chunks(self.cfg, vocab, self.load_weights)

    def _model_info(self, vocab: int) -> Dict:
        """What the checkpoint records about the model (with --load-hf, the Hugging Face config.json)."""
        hf_config = self.load_weights.hf_config if self.load_weights is not None else None
        return build.model_info(self.cfg, vocab, hf_config)

    def _forward_step_func(self):
        """megatron-core's forward-step contract: (data_iterator, model) -> (output, loss_func)."""
        return partial(forward_step, packed=self.packed, per_token_loss=self.cfg.calculate_per_token_loss)

    @property
    def packed(self) -> bool:
        """Whether micro batches run as packed sequences (--sft without --no-pack-sequences)."""
        return self.cfg.sft and self.cfg.pack_sequences

    def _iterator(self, dataset, consumed: int, cycle: bool):
        return build_iterator(dataset, self.cfg, consumed, cycle)

    @property
    def iteration(self) -> int:
        return self.state.iteration

    def _reads_data(self, chunk: torch.nn.Module) -> bool:
        """Tensor-parallel rank 0 of the stages that need batches (first: tokens; last: labels; with packed sequences
        every stage: where conversations start) reads them."""
        return mpu.get_tensor_model_parallel_rank() == 0 and (self.packed or any(stage_flags(chunk)))

    def _iterators(self, dataset, consumed: int, cycle: bool):
        """One iterator per model chunk (virtual pipeline stages each read the micro batches); None where the
        chunk's rank does not read (it receives the batch, or needs none)."""
        its = [self._iterator(dataset, consumed, cycle) if self._reads_data(c) else None for c in self.model]
        its = [CountingIterator(i) if i is not None else None for i in its]
        return its if len(its) > 1 else its[0]

    def _report_reads(self, iterator) -> None:
        """One line after the first step: how many ranks read batches, and how many batches were read."""
        its = iterator if isinstance(iterator, list) else [iterator]
        t = torch.tensor([float(any(i is not None and i.count for i in its)),
                          float(sum(i.count for i in its if i is not None))], device=current_device())
        dist.all_reduce(t)
        where = "tensor-parallel rank 0 of every pipeline stage" if self.packed else self.reads_where
        print_rank_0(f"data: {int(t[0])} of {dist.get_world_size()} ranks read batches ({where}; the "
                     f"others receive them or need none): {int(t[1])} micro batches read in the first iteration")

    def _run_batches(self, iterator, forward_only: bool):
        cfg = self.cfg
        # packed: a micro batch travels between pipeline stages as one sequence of all its tokens
        seq_length, micro_batch = (cfg.seq_length * cfg.micro_batch_size, 1) if self.packed else \
            (cfg.seq_length, cfg.micro_batch_size)
        return self.fwd_bwd(
            forward_step_func=self._forward_step_func(), data_iterator=iterator,
            model=self.model, num_microbatches=cfg.num_microbatches, seq_length=seq_length,
            micro_batch_size=micro_batch, forward_only=forward_only,
        )

    def train_step(self, iterator) -> Dict[str, float]:
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self._run_batches(iterator, forward_only=False)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=self.cfg.global_batch_size)
        # Loss, grad norm and loss scale stay on the device (see train()); `materialize` makes them floats.
        metrics = {"loss": self._objective(losses), "grad_norm": grad_norm if grad_norm is not None else float("nan"),
                   "skipped": float(not ok), "lr": lr, "loss_scale": self._loss_scale()}
        metrics.update(self.loss_components)
        if self.moe_metrics is not None:
            metrics.update(self.moe_metrics.report(self.cfg.num_microbatches, self.state.iteration + 1))
        return metrics

    def _objective(self, losses: List[Dict[str, torch.Tensor]]) -> torch.Tensor:
        """The global batch's objective (sum of the reported losses, a 0-dim tensor on the device); sets
        `loss_components` to each of them by its metrics name ("lm_loss", "sop_loss") when there is more than one,
        else to {}."""
        means = mean_losses(losses, self.loss_keys)
        self.loss_components = {k.replace(" ", "_"): v for k, v in means.items()} if len(means) > 1 else {}
        return sum(means.values())

    def _loss_scale(self):
        """The loss scale after this step's update (fp16 dynamic scaling lowers it on a skipped step); a tensor
        on the device or 1.0."""
        # a copy: the report may read it after the next step, whose scaler update must not show through
        return self.optimizer.get_loss_scale().detach().clone() if hasattr(self.optimizer, "get_loss_scale") else 1.0

    @torch.no_grad()
    def evaluate(self, iterator, iters: int) -> float:
        """Mean loss of the next `iters` global batches of `iterator` (forward only)."""
        for m in self.model:
            m.eval()
        total, components = 0.0, {}
        for _ in range(iters):
            total += self._objective(self._run_batches(iterator, forward_only=True))
            for k, v in self.loss_components.items():
                components[k] = components.get(k, 0.0) + v / iters
        for m in self.model:
            m.train()
        if self.moe_metrics is not None:
            self.moe_metrics.clear()
        self.eval_components = materialize(components)  # the reporter logs them with the evaluation
        return materialize({"loss": total / iters})["loss"]

    def _describe(self) -> str:
        cfg = self.cfg
        vpp = cfg.virtual_pipeline_model_parallel_size
        zero = cfg.zero_stage
        return (f"model: {cfg.model_family or 'custom'} {self.num_params / 1e6:.1f}M parameters, {cfg.num_layers} layers, "
                f"hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}, seq {cfg.seq_length} | "
                f"TP {cfg.tensor_model_parallel_size} PP {cfg.pipeline_model_parallel_size} DP {cfg.data_parallel_size}"
                f"{' VPP ' + str(vpp) if vpp else ''}{self._describe_moe()} | {cfg.params_dtype_name}"
                f"{' (bf16 gradients)' if cfg.grad_reduce_in_bf16 else ''}"
                f"{f' + FP8 GEMMs ({cfg.fp8_format}, {cfg.fp8_recipe})' if cfg.fp8_format else ''} | ZeRO-{zero} | "
                f"micro batch {cfg.micro_batch_size} x {cfg.num_microbatches} accumulation x DP {cfg.data_parallel_size} = "
                f"global batch {cfg.global_batch_size} | optimizer: {self.optimizer_name} | "
                f"recompute {self.model[0].config.recompute_granularity or 'off'}"  # the built model's own setting
                f"{self._describe_loss()}")

    def _describe_loss(self) -> str:
        cfg = self.cfg
        if not cfg.cross_entropy_loss_fusion:
            return ""
        if cfg.cross_entropy_fusion_impl == "linear":
            return " | loss: fused output layer + cross entropy (linear, chunked: no full logits)"
        if cfg.cross_entropy_fusion_impl == "triton":
            return " | loss: fused cross entropy (triton: one read forward, gradient over the logits)"
        return f" | loss: fused cross entropy ({cfg.cross_entropy_fusion_impl})"

    def _describe_moe(self) -> str:
        cfg = self.cfg
        if not cfg.num_experts:
            return ""
        where = (f"every {cfg.moe_layer_freq} layer(s)" if isinstance(cfg.moe_layer_freq, int)
                 else f"in layers {cfg.moe_layers()}")
        shared = (f" + a shared expert ({cfg.moe_shared_expert_intermediate_size}"
                  f"{', gated' if cfg.moe_shared_expert_gate else ''})" if cfg.moe_shared_expert_intermediate_size else "")
        return (f" | MoE {cfg.num_experts} experts top-{cfg.moe_router_topk}{shared} {where}, "
                f"{cfg.moe_token_dispatcher_type} dispatcher, EP {cfg.expert_model_parallel_size} ETP "
                f"{cfg.expert_tp_size} expert-DP {cfg.expert_data_parallel_size}")

    def train(self) -> List[Dict[str, float]]:
        cfg, state = self.cfg, self.state
        print_rank_0(self._describe())
        if cfg.skip_train:
            return self._final_evaluation()
        reporter = Reporter(cfg, self.num_params, state.iteration)
        profiler = Profiler(cfg, dist.get_rank())
        train_iter = self._iterators(self.train_ds, state.consumed_samples, cycle=False)
        start = state.iteration
        t0, since = time.time(), 0
        self._clock = StepClock(torch.cuda.is_available())
        pending = None  # the previous step's metrics, still on the device, and the mark of its end
        lag = torch.cuda.is_available() if self.defer_step_metrics is None else self.defer_step_metrics
        while state.iteration < cfg.train_iters:
            # On a GPU a step's metrics stay on the device until the next step is queued: the host then waits for
            # the previous step only, and the GPU does not idle between steps. Iterations that log, evaluate, save
            # or stop are finished at once (a NaN loss is caught at most one iteration late otherwise). On the
            # CPU the work is synchronous anyway: every step is finished at once. Step times come from the
            # clock's marks (CUDA events on a GPU), not from when the host reads a step.
            watchdog.mark(state.iteration + 1, "train step")
            metrics = self.train_step(train_iter)
            end = self._clock.mark()
            self.checkpointer.poll()  # --async-save: publish a checkpoint whose files are all written
            state.iteration += 1
            state.consumed_samples += cfg.global_batch_size
            since += 1
            metrics["iteration"] = state.iteration
            if cfg.compile:  # graphs dynamo built so far: a step that adds one recompiled
                metrics["compiled_graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
                # reduce-overhead: graphs inductor could not capture as CUDA graphs (they run uncaptured)
                metrics["cudagraph_skips"] = int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])
            if pending is not None:
                self._finish_step(*pending, reporter, train_iter, start)
            pending = (metrics, end)
            profiler.step(state.iteration)
            logging = state.iteration % cfg.log_interval == 0 or state.iteration == cfg.train_iters
            validating = self.validator.should_run(state.iteration)
            stopping = bool(cfg.exit_interval and state.iteration % cfg.exit_interval == 0)
            saving = self.checkpointer.should_save(state.iteration, stopping=stopping)
            if lag and not (logging or validating or saving or stopping or state.iteration == start + 1):
                continue
            self._finish_step(*pending, reporter, train_iter, start)
            pending = None
            if logging:
                reporter.log(metrics, time.time() - t0, since)
                t0, since = time.time(), 0
            if validating:
                watchdog.mark(state.iteration, "evaluation")
                reporter.validation(state.iteration, self.validator.run(state), components=self.eval_components)
            if saving:
                watchdog.mark(state.iteration, "checkpoint save")
                self.checkpointer.save(state)
            if validating or saving:  # neither is the next step's time
                t0 = time.time()
                self._clock.restart()
            if stopping:
                print_rank_0(f"exiting at iteration {state.iteration} (--exit-interval {cfg.exit_interval})")
                break
        if self.checkpointer.should_save(state.iteration, stopping=True):
            watchdog.mark(state.iteration, "checkpoint save")
            self.checkpointer.save(state)
        self.checkpointer.finish()  # --async-save: the last checkpoint published before the run ends
        reporter.close()
        return self.history

    def _finish_step(self, metrics: Dict, end, reporter: Reporter, train_iter, start: int) -> None:
        """A step's metrics once the GPU has finished it: floats, its time (from the end of the previous step to
        `end`, the clock's mark after it), peak memory; then the run's records and the NaN check."""
        materialize(metrics)  # waits for this step's GPU work
        metrics["step_time"] = self._clock.elapsed(end)
        metrics["wall_time"] = time.time()  # benchmarks measure time to first step from their launch
        if torch.cuda.is_available():
            metrics["max_memory_bytes"] = torch.cuda.max_memory_allocated()
        if metrics["iteration"] == start + 1:
            self._report_memory(metrics)
            self._report_reads(train_iter)
        self.history.append(metrics)
        reporter.step(metrics)
        self._check_finite(metrics["loss"])

    def _report_memory(self, metrics: Dict[str, float]) -> None:
        mine = model_state_bytes(self.model, self.optimizer)
        metrics.update({f"bytes_{k}": v for k, v in mine.items()})
        # every rank's (weights, grads, optimizer): ranks differ by pipeline stage and by ZeRO shard
        t = torch.tensor([mine["weights"], mine["grads"], mine["optimizer"]], dtype=torch.int64, device=current_device())
        everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, t)
        metrics["bytes_per_rank"] = [x.tolist() for x in everyone]
        metrics["vocab_size"] = self.vocab_size  # before padding: what config.memory_model predicts from
        metrics["num_params"] = self.num_params
        print_rank_0(f"model state on rank 0: weights {metrics['bytes_weights'] / 2**20:.1f} MiB, gradient "
                     f"buffers {metrics['bytes_grads'] / 2**20:.1f} MiB, optimizer state "
                     f"{metrics['bytes_optimizer'] / 2**20:.1f} MiB ({self.num_params / 1e6:.1f}M parameters)")

    def _check_finite(self, loss: float) -> None:
        if math.isfinite(loss):
            return
        msg = f"loss is {loss} at iteration {self.state.iteration}"
        print_rank_0("error: " + msg)
        if self.cfg.exit_on_nan:
            raise TrainingDiverged(msg + " (pass --no-exit-on-nan to continue)")

    def _final_evaluation(self) -> List[Dict[str, float]]:
        """--skip-train: the next validation batches (as the run would have evaluated them) and the test set."""
        cfg = self.cfg
        valid = self.validator.run(self.state) if self.valid_ds is not None and cfg.eval_iters > 0 else float("nan")
        components = dict(self.eval_components)  # the test evaluation replaces them
        test = self.evaluate(self._iterators(self.test_ds, 0, cycle=True), cfg.eval_iters) \
            if self.test_ds is not None and cfg.eval_iters > 0 else float("nan")
        reporter = Reporter(cfg, self.num_params, self.state.iteration)
        reporter.validation(self.state.iteration, valid, test, components=components)
        reporter.close()
        result = {"iteration": self.state.iteration, "valid_loss": valid, "test_loss": test}
        self.history.append(result)
        return self.history


def pretrain(cfg: Config, load_weights: Optional[WeightLoader] = None) -> Trainer:
    """Build and run a pretraining job; returns the Trainer (its `history` holds per-iteration metrics).
    `load_weights`: see Trainer."""
    trainer = Trainer(cfg, load_weights)
    trainer.train()
    return trainer
