"""``Trainer``: builds the run's components from a ``TrainConfig`` and drives the step loop.

The loop, in the speedrun's order, for ``step`` in ``0 .. num_iterations``:
validate (every ``val_every`` steps and at the end; not timed), checkpoint (every
``checkpoint_every`` steps and at the end; not timed), then one optimizer step (timed):
forward + backward under bf16 autocast, average the gradients not owned by a sharded optimizer
across ranks, set the scheduled learning rates, step every optimizer.

Example:
    >>> result = Trainer(TrainConfig(num_iterations=20, out_dir="/tmp/runs")).run()
    ...                                                                   # doctest: +SKIP
    >>> result.final_val_loss, result.text_log  # doctest: +SKIP
"""

from __future__ import annotations

import math
import platform
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from nanoshampoo.data.loader import DistributedTokenLoader
from nanoshampoo.model.gpt import GPT, gpt_preset
from nanoshampoo.train.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.data_source import DataSource, resolve_data
from nanoshampoo.train.distributed import (
    DistributedContext,
    all_reduce_gradients,
    all_reduce_mean_,
    barrier,
    setup_distributed,
    teardown_distributed,
)
from nanoshampoo.train.loop.evaluate import validation_loss
from nanoshampoo.train.optimizers import build_optimizer_setup
from nanoshampoo.train.profiling import make_step_profiler
from nanoshampoo.train.run_log import RunLog
from nanoshampoo.train.schedule import apply_lr_multiplier, lr_multiplier, remember_peak_lrs


@dataclass
class TrainResult:
    run_id: str
    final_val_loss: float
    text_log: Path
    jsonl_log: Path
    last_checkpoint: Path | None


class Trainer:
    """One training run. Construct (joins the process group, builds everything), then ``run``."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.ctx = setup_distributed(cfg.device)
        if cfg.batch_size % self.ctx.world_size:
            raise ValueError(f"TrainConfig.batch_size ({cfg.batch_size}) must be divisible by "
                             f"the world size ({self.ctx.world_size})")
        self.data: DataSource = resolve_data(cfg, self.ctx)
        self.run_id = _agree_on_run_id(cfg, self.ctx)

        torch.manual_seed(cfg.seed)
        model_config = gpt_preset(cfg.model, self.data.vocab_size, cfg.combined_linear)
        if cfg.seq_len > model_config.max_seq_len:
            raise ValueError(f"TrainConfig.seq_len ({cfg.seq_len}) exceeds the {cfg.model} "
                             f"model's max_seq_len ({model_config.max_seq_len})")
        self.model = GPT(model_config).to(self.ctx.device)
        _broadcast_parameters(self.model, self.ctx)
        self.setup = build_optimizer_setup(self.model, cfg, self.ctx.world_size)
        remember_peak_lrs(self.setup.optimizers)
        self.forward: nn.Module = torch.compile(self.model) if cfg.compile else self.model  # type: ignore[assignment]

        self.loader = DistributedTokenLoader(self.data.train_pattern, cfg.batch_size, cfg.seq_len,
                                             self.ctx.rank, self.ctx.world_size)
        self.log = RunLog(cfg.out_dir, self.run_id, enabled=self.ctx.is_main)
        self.start_step = 0
        self.train_time_ms = 0.0
        if cfg.resume:
            self.start_step, self.train_time_ms = load_checkpoint(
                Path(cfg.resume), self.ctx.rank, self.ctx.world_size, self.model,
                self.setup.optimizers, self.loader)
            if self.start_step > cfg.num_iterations:
                raise ValueError(f"TrainConfig.resume: the checkpoint is at step {self.start_step}, "
                                 f"beyond num_iterations={cfg.num_iterations}")

    def run(self) -> TrainResult:
        cfg, ctx, total = self.cfg, self.ctx, self.cfg.num_iterations
        self.log.start(self._config_record(), self._environment())
        bar = tqdm(total=total, initial=self.start_step, disable=not (ctx.is_main and cfg.progress),
                   desc=self.run_id, unit="step", dynamic_ncols=True)
        profiler = make_step_profiler(cfg.profile_steps, cfg.profile_dir, ctx.rank)
        with profiler:
            val_loss, last_checkpoint = self._loop(bar, profiler)
        bar.close()
        self._finish(val_loss)
        teardown_distributed(ctx)
        return TrainResult(self.run_id, val_loss, self.log.text_path, self.log.jsonl_path,
                           last_checkpoint)

    def _loop(self, bar: tqdm, profiler: Any) -> tuple[float, Path | None]:
        cfg, ctx, total = self.cfg, self.ctx, self.cfg.num_iterations
        val_loss, last_checkpoint = math.nan, None
        for step in range(self.start_step, total + 1):
            last = step == total
            if last or (cfg.val_every and step % cfg.val_every == 0):
                val_loss = validation_loss(self.forward, self.data.val_pattern, cfg.batch_size,
                                           cfg.seq_len, cfg.val_tokens, ctx, cfg.autocast_bf16)
                _say(self.log.val(step, total, val_loss, self.train_time_ms), ctx, bar)
            periodic = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
            if step > self.start_step and (periodic or (last and cfg.save_final_checkpoint)):
                last_checkpoint = self._save_checkpoint(step)
            if last:
                break
            profiler.step(step)  # before the step's work: the profiler records chosen steps
            self._timed_step(step, bar)
        return val_loss, last_checkpoint

    def _timed_step(self, step: int, bar: tqdm) -> None:
        cfg, total = self.cfg, self.cfg.num_iterations
        _synchronize(self.ctx)
        start = time.perf_counter()
        loss = self._train_step(step)
        _synchronize(self.ctx)
        elapsed_ms = 1000 * (time.perf_counter() - start)
        self.train_time_ms += elapsed_ms
        done = step + 1
        if done == total or (cfg.log_every > 0 and done % cfg.log_every == 0):
            train_loss = float(all_reduce_mean_(loss.float(), self.ctx).item())
            tokens_per_s = cfg.tokens_per_step / (elapsed_ms / 1000)
            self.log.train(done, total, train_loss, self.train_time_ms, tokens_per_s)
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
        bar.update(1)

    def _train_step(self, step: int) -> torch.Tensor:
        inputs, targets = self.loader.next_batch()
        inputs = inputs.to(self.ctx.device, non_blocking=True)
        targets = targets.to(self.ctx.device, non_blocking=True)
        with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16,
                            enabled=self.cfg.autocast_bf16):
            loss = self.forward(inputs, targets)
        loss.backward()
        all_reduce_gradients(self.setup.all_reduce_params, self.ctx)
        multiplier = lr_multiplier(step, self.cfg.num_iterations, self.cfg.cooldown_frac)
        apply_lr_multiplier(self.setup.optimizers, multiplier)
        for opt in self.setup.optimizers:
            opt.step()
        for opt in self.setup.optimizers:
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    def _save_checkpoint(self, step: int) -> Path:
        directory = checkpoint_path(self.cfg.out_dir, self.run_id, step)
        save_checkpoint(directory, self.ctx.rank, self.ctx.world_size, step, self.train_time_ms,
                        self.model, self.setup.optimizers, self.loader)
        barrier(self.ctx)  # the checkpoint is complete once every rank has written
        return directory

    def _finish(self, val_loss: float) -> None:
        allocated, reserved = _peak_memory_mib(self.ctx)
        total = self.cfg.num_iterations
        self.log.final(total, total, val_loss, self.train_time_ms, allocated, reserved)
        if self.ctx.is_main:
            print(f"final val_loss {val_loss:.4f} after {total} steps "
                  f"({self.train_time_ms / 1000:.1f}s training); log: {self.log.text_path}")

    def _config_record(self) -> dict[str, object]:
        return {"kind": "config", "run_id": self.run_id, "seed": self.cfg.seed,
                "preset": self.cfg.preset, "optimizer": self.cfg.optimizer,
                "world_size": self.ctx.world_size, "config": self.cfg.to_dict()}

    def _environment(self) -> str:
        device = self.ctx.device.type
        if device == "cuda":
            device += f" ({torch.cuda.get_device_name(self.ctx.device)})"
        params = sum(p.numel() for p in self.model.parameters())
        return (f"python {platform.python_version()} torch {torch.__version__} device {device} "
                f"world_size {self.ctx.world_size} threads {torch.get_num_threads()} "
                f"parameters {params} vocab_size {self.data.vocab_size} "
                f"train {self.data.train_pattern} val {self.data.val_pattern}")


def _say(line: str, ctx: DistributedContext, bar: tqdm) -> None:
    """Print on rank 0, above the progress bar when there is one."""
    if ctx.is_main:
        if bar.disable:
            print(line, flush=True)
        else:
            bar.write(line)


def _agree_on_run_id(cfg: TrainConfig, ctx: DistributedContext) -> str:
    run_id = cfg.run_id or f"{cfg.preset}-s{cfg.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    if ctx.world_size > 1:
        box = [run_id]
        dist.broadcast_object_list(box, src=0)
        run_id = box[0]
    return run_id


@torch.no_grad()
def _broadcast_parameters(model: nn.Module, ctx: DistributedContext) -> None:
    """Make every rank start from rank 0's weights (seeding already agrees; this guarantees it)."""
    if ctx.world_size > 1:
        for p in model.parameters():
            dist.broadcast(p, src=0)


def _synchronize(ctx: DistributedContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def _peak_memory_mib(ctx: DistributedContext) -> tuple[float, float]:
    """CUDA: the caching allocator's peaks. CPU: the process's peak resident set, for both."""
    if ctx.device.type == "cuda":
        return (torch.cuda.max_memory_allocated(ctx.device) / 2**20,
                torch.cuda.max_memory_reserved(ctx.device) / 2**20)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    return peak_rss, peak_rss
