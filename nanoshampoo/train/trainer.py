"""``Trainer``: builds the run's components from a ``TrainConfig`` and drives the step loop.

Construction checks everything a run will need before any step (config against the world size,
data, the resume checkpoint, the log files) and fails with a ``UserError`` on every rank.

The loop, in the speedrun's order, for ``step`` in ``0 .. num_iterations``:
validate (every ``val_every`` steps and at the end; not timed), checkpoint (every
``checkpoint_every`` steps and at the end; not timed), then one optimizer step (timed):
``grad_accum_steps`` micro-batches of forward + backward (autocast as resolved), the loss scaled
by ``1 / grad_accum_steps``, gradients synced only after the last micro-batch (DistAdam's hooks;
the trainer's all-reduce of the others; FSDP's reduce-scatter under ``parallel`` ``fsdp2`` /
``hsdp``, where the blocks and then the root are ``fully_shard``-ed); a finiteness check of the
loss and every gradient; set the scheduled learning rates; step every optimizer.

With ``threads=0`` on CPU the thread count is re-probed during the run (:mod:`thread_tuner`).

With ``decay_branches``, at each branch's fork (before that step's checkpoint and validation)
the run snapshots its state, trains the branch as the separate run of its length would
(validations and checkpoints become only their evaluation-point round trips; nothing is
written but the branch's record), and restores the snapshot (:mod:`branches`). A diverged
branch is recorded as such; the main run goes on.

A non-finite loss, gradient, parameter (checked before each checkpoint) or validation loss stops
the run with :class:`TrainingDiverged`, after a ``diverged`` record in the logs; no checkpoint is
written after it, so the last one on disk is the last good state. Any other exception in the
loop closes the logs with a ``failed`` record and propagates; one in a user's optimizer's
``step()`` becomes :class:`OptimizerStepFailed` (one line: the optimizer, the step, the
exception's last line), and a file that cannot be written (a full disk) one line naming it and
the last good checkpoint. The first checkpoint is preceded by a check that every optimizer's
state loads back under ``weights_only=True`` (``checkpoint.check_state_loadable``).

Example:
    >>> result = Trainer(TrainConfig(num_iterations=20, out_dir="/tmp/runs")).run()
    ...                                                                   # doctest: +SKIP
    >>> result.final_val_loss, result.text_log  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import secrets
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanoshampoo.data.loader import DistributedTokenLoader, validation_batches
from nanoshampoo.io_utils import OutputPathError
from nanoshampoo.model.gpt import GPT, GPTConfig, gpt_preset, non_embedding_parameters
from nanoshampoo.optim.errors import NonFiniteGradientError
from nanoshampoo.train.branches import Branch, TrainingSnapshot, branches_to_make, plan_branches
from nanoshampoo.train.checkpoint import (
    CheckpointRecords,
    check_no_checkpoint_replaced,
    check_state_loadable,
    checkpoint_path,
    latest_checkpoint,
    publish_checkpoint,
    read_checkpoint,
    restore_checkpoint,
    save_checkpoint,
    save_sharded_checkpoint,
)
from nanoshampoo.train.compile_choice import CompileChoice, resolve_compile
from nanoshampoo.train.config import TrainConfig, UserError
from nanoshampoo.train.data_source import DataSource, resolve_data
from nanoshampoo.train.distributed import (
    DistributedContext,
    all_reduce_gradients,
    all_reduce_mean_,
    any_rank_true,
    barrier,
    broadcast_object,
    broadcast_parameters,
    first_error_on_any_rank,
    peak_memory_mib,
    setup_distributed,
    shard_model,
    synchronize_device,
    teardown_distributed,
)
from nanoshampoo.train.divergence import DivergenceGuard
from nanoshampoo.train.hardware import AutocastChoice, resolve_autocast
from nanoshampoo.train.interrupt import TrainingInterrupted
from nanoshampoo.train.machine import available_cores, cpu_name
from nanoshampoo.train.optimizers import (
    apply_resumed_settings,
    build_optimizer_setup,
    param_group_settings,
)
from nanoshampoo.train.outcomes import (
    OptimizerStepFailed,
    TrainingDiverged,
    TrainResult,
    is_users_optimizer,
    last_line,
)
from nanoshampoo.train.phases import PhaseClock
from nanoshampoo.train.preflight import check_device, check_dist_timeout, check_memory
from nanoshampoo.train.probe_cache import ProbeCache, cache_path
from nanoshampoo.train.profiling import make_step_profiler
from nanoshampoo.train.progress import Progress, progress_bar
from nanoshampoo.train.run_log import RunLog
from nanoshampoo.train.schedule import (
    apply_lr_multiplier,
    lr_multiplier,
    remember_peak_lrs,
)
from nanoshampoo.train.telemetry import Telemetry, resolve_every
from nanoshampoo.train.tensorboard_scalars import TensorBoardScalars
from nanoshampoo.train.thread_tuner import ThreadTuner
from nanoshampoo.train.throughput import mfu_meter


class Trainer:
    """One training run. Construct (joins the process group, builds and checks everything),
    then ``run``. The process group is torn down when construction or the run fails too."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.clock = PhaseClock()
        built = time.perf_counter()
        self.cfg = cfg
        check_device(cfg.parallel.device)
        check_dist_timeout(cfg.parallel.dist_timeout_s)
        self.ctx = setup_distributed(
            cfg.parallel.device,
            cfg.parallel.dist_timeout_s,
            need_process_group=cfg.parallel.mode != "ddp",
        )
        try:
            self._build()
        except BaseException:
            teardown_distributed(self.ctx)
            raise
        measured = self.clock.seconds["data"] + self.clock.seconds["probes"]
        self.clock.add("setup", time.perf_counter() - built - measured)

    def _build(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        if cfg.data.batch_size % (ctx.world_size * cfg.data.grad_accum_steps):
            raise UserError(
                f"--batch-size {cfg.data.batch_size}: must be divisible by the world size "
                f"({ctx.world_size}) times --grad-accum-steps "
                f"({cfg.data.grad_accum_steps})"
            )
        self.threads = ThreadTuner(cfg.parallel.threads, ctx)
        # Rank 0 probes for every rank, so only it keeps the verdicts.
        self.probe_cache = ProbeCache(cache_path(cfg.run.out_dir) if ctx.is_main else None)
        with self.clock.phase("probes"):
            if ctx.device.type == "cpu":
                self.threads.tune()
            # Every rank must run the same numerics: rank 0's probe decides.
            self.autocast: AutocastChoice = broadcast_object(  # type: ignore[assignment]
                resolve_autocast(cfg.parallel.autocast, ctx.device, self.probe_cache)
                if ctx.is_main
                else None,
                ctx,
            )
        checkpoint = self._read_resume_checkpoint()
        if checkpoint is not None and checkpoint.sharded != (cfg.parallel.mode != "ddp"):
            written = checkpoint.own.get("parallel", "ddp")
            raise UserError(
                f"--resume {checkpoint.directory}: written with --parallel {written}, "
                f"this run uses --parallel {cfg.parallel.mode}"
            )
        self.run_id = self._agree_on_run_id(checkpoint)
        append = checkpoint is not None and self.run_id == checkpoint.run_id
        self.log = RunLog(
            cfg.run.out_dir,
            self.run_id,
            enabled=ctx.is_main,
            append=append,
            embed_source=cfg.run.embed_source,
        )
        self._on_every_rank(self.log.check_can_start)
        kept = checkpoint.step if checkpoint is not None and append else 0
        self._on_every_rank(
            lambda: check_no_checkpoint_replaced(cfg.run.out_dir, self.run_id, kept)
        )
        self.resumed_from = (
            None
            if checkpoint is None
            else {
                "checkpoint": str(checkpoint.directory),
                "run_id": checkpoint.run_id,
                "step": checkpoint.step,
            }
        )
        self.scalars = (
            TensorBoardScalars(cfg.run.tensorboard, self.run_id, ctx.is_main)
            if cfg.run.tensorboard
            else None
        )
        # After the checks above: a refused resume or run id prepares no data on disk.
        with self.clock.phase("data"):
            self.data: DataSource = resolve_data(cfg, ctx)

        self._build_model()
        self.setup = build_optimizer_setup(self.model, cfg, ctx.world_size)
        # DistAdam's gradients may still be in flight (its hooks launched their reduce-scatters)
        # when the trainer checks the others; DistAdam checks its own after waiting for them.
        self.guard = DivergenceGuard(self.model, self.setup.trainer_checked_params(self.model), ctx)
        remember_peak_lrs(self.setup.optimizers)
        every = resolve_every(cfg.run.telemetry_every, cfg.schedule.val_every)
        self.telemetry: Telemetry | None = (
            Telemetry(
                every,
                self.model,
                self.setup.groups["matrix"],
                self.setup.optimizers,
                self.setup.self_reducing_params,
                ctx,
            )
            if every > 0
            else None
        )
        with self.clock.phase("probes"):
            self.compiled: CompileChoice = broadcast_object(  # type: ignore[assignment]
                resolve_compile(
                    cfg.parallel.compile,
                    ctx.device,
                    ctx.world_size,
                    cfg.schedule.num_iterations,
                    self.probe_cache,
                )
                if ctx.is_main
                else None,
                ctx,
            )
        self.forward: nn.Module = torch.compile(self.model) if self.compiled.enabled else self.model  # type: ignore[assignment]
        self.loader = DistributedTokenLoader(
            self.data.train_pattern, cfg.data.batch_size, cfg.data.seq_len, ctx.rank, ctx.world_size
        )
        self.start_step = 0
        self.train_time_ms = 0.0
        self.state_checked = False  # check_state_loadable, before the first checkpoint
        if checkpoint is not None:
            # The config's peak lrs win over the checkpoint's; any other changed setting is
            # refused (the log must record what runs).
            built = param_group_settings(self.setup.optimizers)
            self.start_step, self.train_time_ms = self._on_every_rank(
                lambda: restore_checkpoint(
                    checkpoint, self.model, self.setup.optimizers, self.loader
                )
            )
            self._on_every_rank(
                lambda: apply_resumed_settings(
                    built, self.setup.optimizers, f"--resume {checkpoint.directory}"
                )
            )
            self.setup.resume_training_point()  # a checkpoint holds the evaluation point
            if self.start_step > cfg.schedule.num_iterations:
                raise UserError(
                    f"--resume {checkpoint.directory}: the checkpoint is at step "
                    f"{self.start_step}, beyond --num-iterations {cfg.schedule.num_iterations}"
                )
        self.branches = plan_branches(
            cfg.schedule.decay_branches,
            cfg.schedule.num_iterations,
            cfg.schedule.cooldown_frac,
            cfg.schedule.warmup_steps,
        )
        self._check_pause()

    def _check_pause(self) -> None:
        """``--pause-at-step`` between the step the run starts from and its last."""
        pause, total = self.cfg.run.pause_at_step, self.cfg.schedule.num_iterations
        if pause and not self.start_step < pause < total:
            raise UserError(
                f"--pause-at-step {pause}: must lie after the step the run starts from "
                f"({self.start_step}) and before --num-iterations ({total})"
            )

    def _build_model(self) -> None:
        """The seeded GPT on every rank (rank 0's weights), sharded under fsdp2 / hsdp, and the
        meter of its FLOPs."""
        cfg, ctx = self.cfg, self.ctx
        torch.manual_seed(cfg.run.seed)
        model_config = gpt_preset(cfg.model.name, self.data.vocab_size, cfg.model.combined_linear)
        self._check_model_fits(model_config)
        self.model = GPT(model_config).to(ctx.device)
        self.non_embedding_params = non_embedding_parameters(model_config)
        with self.clock.phase("probes"):  # the matmul peak
            self.mfu = mfu_meter(
                model_config,
                cfg.data.seq_len,
                cfg.data.tokens_per_step,
                ctx.device,
                self.autocast.enabled,
                ctx.world_size,
                self.probe_cache,
            )
        broadcast_parameters(self.model, ctx)
        if cfg.parallel.mode != "ddp":
            # Each rank keeps its dim-0 shard of rank 0's weights.
            shard_model(
                self.model,
                self.model.blocks,
                ctx,
                cfg.parallel.mode,
                cfg.parallel.hsdp_shard_size,
                bf16_params=self.autocast.enabled,
            )
        self.param_names = {id(p): name for name, p in self.model.named_parameters()}

    def _check_model_fits(self, model_config: GPTConfig) -> None:
        """``--seq-len`` within the model's reach, its memory within what the device has."""
        cfg, ctx = self.cfg, self.ctx
        if cfg.data.seq_len > model_config.max_seq_len:
            raise UserError(
                f"--seq-len {cfg.data.seq_len}: exceeds the {cfg.model.name} model's "
                f"max_seq_len ({model_config.max_seq_len})"
            )
        micro_batch = cfg.data.batch_size // (ctx.world_size * cfg.data.grad_accum_steps)
        self._on_every_rank(
            lambda: check_memory(model_config, micro_batch, cfg.data.seq_len, ctx.device)
        )

    def _on_every_rank(self, check: Any) -> Any:
        """Run ``check()``; if it raises ``UserError`` on any rank, raise it on every rank."""
        result, error = None, None
        try:
            result = check()
        except UserError as exc:
            error = str(exc)
        error = first_error_on_any_rank(error, self.ctx)
        if error is not None:
            raise UserError(error)
        return result

    def _read_resume_checkpoint(self) -> CheckpointRecords | None:
        if not self.cfg.run.resume:
            return None
        return self._on_every_rank(
            lambda: read_checkpoint(Path(self.cfg.run.resume), self.ctx.rank, self.ctx.world_size)
        )

    def _agree_on_run_id(self, checkpoint: CheckpointRecords | None) -> str:
        """``--run-id``; else the resumed run's id; else a new unique id (rank 0's, for all).

        New ids have millisecond resolution and a random suffix: two runs started in the same
        second (seeds launched together) never share an id, so never share log files.
        """
        cfg = self.cfg
        if cfg.run.run_id:
            return cfg.run.run_id
        if checkpoint is not None:
            return checkpoint.run_id
        now = time.time()
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
        millis = int(now % 1 * 1000)
        run_id = f"{cfg.run.preset}-s{cfg.run.seed}-{stamp}.{millis:03d}-{secrets.token_hex(2)}"
        return str(broadcast_object(run_id, self.ctx))

    def run(self) -> TrainResult:
        try:
            return self._run()
        finally:
            teardown_distributed(self.ctx)

    def _run(self) -> TrainResult:
        cfg, ctx, total = self.cfg, self.ctx, self.cfg.schedule.num_iterations
        self.steps_done = self.start_step  # for Ctrl-C's report; each step advances it
        self.log.start(self._config_record(), self._environment())
        self.probe_cache.save()  # after every check: a refused run writes nothing
        if ctx.is_main:
            print(self._header(), flush=True)
        bar = progress_bar(total, self.start_step, ctx.is_main and cfg.run.progress, self.run_id)
        recorded: set[int] = broadcast_object(  # type: ignore[assignment]
            self.log.recorded_branch_steps() if ctx.is_main else None, ctx
        )
        self.branches, missed = branches_to_make(self.branches, recorded, self.start_step)
        for branch in missed:
            _say(self.log.branch_not_made(branch, self.start_step), ctx, bar)
        profiler = make_step_profiler(cfg.run.profile_steps, cfg.run.profile_dir, ctx.rank)
        try:
            with profiler:
                val_loss, last_checkpoint, paused = self._loop(bar, profiler)
        except TrainingDiverged as exc:
            if self.telemetry is not None:  # name the first series that ran away, if one did
                first = self.telemetry.watch.first_departure(exc.step)
                if first is not None:
                    exc.reason = f"{exc.reason}; {first}"
            line = self.log.diverged(exc.step, total, exc.reason, self.train_time_ms)
            _say(line, ctx, bar)
            raise
        except KeyboardInterrupt:  # Ctrl-C: the logs are kept; say how to continue
            raise TrainingInterrupted(self.steps_done, total, self._last_checkpoint()) from None
        except Exception as exc:  # the logs say the run failed and why, then it propagates
            error = self._failure(exc)
            reason = str(error) if isinstance(error, UserError) else last_line(error)
            self.log.failed(self.steps_done, total, reason, self.train_time_ms)
            if error is exc:
                raise
            raise error from exc
        finally:
            bar.close()
            if self.scalars is not None:
                self.scalars.close()
        try:
            if paused:
                assert last_checkpoint is not None
                _say(self.log.paused(cfg.run.pause_at_step, total, last_checkpoint), ctx, bar)
            else:
                self._finish(val_loss)
        except OSError as exc:  # the final record on a full disk: one line, not a traceback
            raise self._failure(exc) from exc
        return TrainResult(
            self.run_id,
            math.nan if paused else val_loss,
            self.log.text_path,
            self.log.jsonl_path,
            last_checkpoint,
            paused_at=cfg.run.pause_at_step if paused else None,
        )

    def _resumed_checkpoint(self) -> Path | None:
        return Path(self.cfg.run.resume) if self.cfg.run.resume else None

    def _last_checkpoint(self) -> Path | None:
        """This run's latest checkpoint on disk, else the one it resumed from."""
        return latest_checkpoint(self.cfg.run.out_dir, self.run_id) or self._resumed_checkpoint()

    def _failure(self, exc: Exception) -> Exception:
        """What the user is told of ``exc``: a file that could not be written (a log or a
        trace on a full disk) as one line naming it and the last good checkpoint; else itself."""
        if not isinstance(exc, OSError):
            return exc
        last = self._last_checkpoint()
        return OutputPathError(
            f"could not write {exc.filename or 'a file'} ({exc.strerror or exc}); the last "
            f"good checkpoint is {last if last is not None else 'none of this run'}"
        )

    def _header(self) -> str:
        """The run's first lines on stdout: what runs, then one labelled line per choice."""
        cfg, ctx = self.cfg, self.ctx
        tokens = cfg.schedule.num_iterations * cfg.data.tokens_per_step
        return "\n".join(
            [
                f"run {self.run_id}: {cfg.optimizer}, model {cfg.model.name} "
                f"({self.non_embedding_params:,} non-embedding parameters, {tokens:,} tokens: "
                f"{tokens / self.non_embedding_params:.2g} per parameter)",
                f"  device {ctx.device.type} x{ctx.world_size} ({cfg.parallel.mode})",
                f"  threads {torch.get_num_threads()} ({self.threads.reason})",
                f"  autocast {self.autocast.name} ({self.autocast.reason})",
                f"  compile {self.compiled.name} ({self.compiled.reason}), for the model only",
                f"  {self.mfu.header}",
            ]
        )

    def _loop(self, bar: Progress, profiler: Any) -> tuple[float, Path | None, bool]:
        """``(final val loss, last checkpoint, paused)``: the run to its end, or to
        ``--pause-at-step`` (then the val loss is NaN and the checkpoint is the pause's)."""
        cfg, total = self.cfg, self.cfg.schedule.num_iterations
        val_loss, last_checkpoint = math.nan, None
        for step in range(self.start_step, total + 1):
            for branch in (b for b in self.branches if b.fork_step == step):
                self._run_branch(branch, bar)
            last = step == total
            pause = step == cfg.run.pause_at_step > 0
            if step > self.start_step and (pause or self._checkpoint_due(step, last)):
                with self.setup.evaluation_point():  # before the validation: see its docstring
                    with self.clock.phase("checkpoint"):
                        last_checkpoint = self._save_checkpoint(step)
            if pause:  # the resumed run validates this step if it is due: not twice
                return val_loss, last_checkpoint, True
            if last or (cfg.schedule.val_every and step % cfg.schedule.val_every == 0):
                with self.setup.evaluation_point(), self.clock.phase("validation"):
                    val_loss = self._validation_loss()
                _say(self.log.val(step, total, val_loss, self.train_time_ms), self.ctx, bar)
                if self.scalars is not None:
                    self.scalars.val(step, val_loss)
                self.guard.check_validation(step, val_loss)
            if last:
                break
            self.threads.before_step(step, self.start_step)  # others may take or free cores
            profiler.step(step)  # before the step's work: the profiler records chosen steps
            self._timed_step(step, bar)
        return val_loss, last_checkpoint, False

    def _checkpoint_due(self, step: int, last: bool) -> bool:
        periodic = self.cfg.run.checkpoint_every and step % self.cfg.run.checkpoint_every == 0
        return bool(periodic or (last and self.cfg.run.save_final_checkpoint))

    def _run_branch(self, branch: Branch, bar: Progress) -> None:
        """Train ``branch`` from here (the state after its fork step) as the separate run of
        ``branch.steps`` steps would, validate and record it, then restore the main run."""
        cfg, main_time_ms = self.cfg, self.train_time_ms
        snapshot = TrainingSnapshot(
            self.model,
            [*self.setup.optimizers, self.guard, self.threads],
            self.loader,
            shared=[self.ctx],
        )
        val_loss, diverged = math.nan, None
        try:
            for step in range(branch.fork_step, branch.steps + 1):
                last = step == branch.steps
                if step > self.start_step and self._checkpoint_due(step, last):
                    with self.setup.evaluation_point():  # the run's checkpoint, not written
                        self.guard.check_parameters(step)
                if last or (cfg.schedule.val_every and step % cfg.schedule.val_every == 0):
                    with self.setup.evaluation_point():  # only the last validation is computed
                        with self.clock.phase("validation"):
                            val_loss = self._validation_loss() if last else math.nan
                if last:
                    self.guard.check_validation(step, val_loss)
                    break
                self.threads.before_step(step, self.start_step)
                self._take_step(step, branch.steps)
        except TrainingDiverged as exc:
            diverged = (exc.step, exc.reason)
        branch_time_ms = self.train_time_ms
        snapshot.restore()
        self.train_time_ms = main_time_ms
        _say(
            self.log.branch(
                branch.fraction,
                branch.steps,
                branch.fork_step,
                val_loss,
                branch_time_ms,
                branch.steps * cfg.data.tokens_per_step,
                diverged,
            ),
            self.ctx,
            bar,
        )

    def _take_step(
        self, step: int, schedule_steps: int, snapshot: bool = False
    ) -> tuple[float, torch.Tensor]:
        """One timed optimizer step on the schedule of a ``schedule_steps`` run; returns its
        milliseconds (added to ``train_time_ms``) and its loss. ``snapshot``: telemetry keeps
        the matrices before the optimizers step."""
        synchronize_device(self.ctx)
        start = time.perf_counter()
        loss = self._train_step(step, schedule_steps, snapshot)
        synchronize_device(self.ctx)
        elapsed_ms = 1000 * (time.perf_counter() - start)
        self.train_time_ms += elapsed_ms
        first = self.clock.seconds["first_step"] == 0.0
        self.clock.add("first_step" if first else "steps", elapsed_ms / 1000)
        return elapsed_ms, loss

    def _timed_step(self, step: int, bar: Progress) -> None:
        cfg, total = self.cfg, self.cfg.schedule.num_iterations
        recorded = self.telemetry is not None and self.telemetry.due(step + 1)
        elapsed_ms, loss = self._take_step(step, total, snapshot=recorded)
        done = self.steps_done = step + 1
        if recorded:  # after the timed step, as validation is
            with self.clock.phase("telemetry"):
                records = self.telemetry.record(done)  # type: ignore[union-attr]
            self.log.telemetry(records)
            if self.scalars is not None:
                self.scalars.telemetry(records)
        if done == total or (cfg.run.log_every > 0 and done % cfg.run.log_every == 0):
            train_loss = float(all_reduce_mean_(loss.float(), self.ctx).item())
            if self.telemetry is not None:
                self.telemetry.watch.add_loss(done, train_loss)
            if self.scalars is not None:
                self.scalars.train(done, train_loss, self.setup.optimizers)
            tokens_per_s = cfg.data.tokens_per_step / (elapsed_ms / 1000)
            self.log.train(
                done,
                total,
                train_loss,
                self.train_time_ms,
                tokens_per_s,
                self.mfu.of_step(elapsed_ms / 1000),
            )
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
        bar.update(1)

    def _train_step(self, step: int, schedule_steps: int, snapshot: bool = False) -> torch.Tensor:
        """One optimizer step over ``grad_accum_steps`` micro-batches at the learning rate of a
        ``schedule_steps`` run's step ``step``; returns the mean loss. ``snapshot``: telemetry
        keeps the matrices before the optimizers step (:meth:`Telemetry.snapshot`).

        The rank's batch is split along the batch dim into equal micro-batches, so the summed
        scaled gradients equal the gradient of the whole batch's mean loss.
        """
        accum = self.cfg.data.grad_accum_steps
        inputs, targets = self.loader.next_batch()
        inputs = inputs.to(self.ctx.device, non_blocking=True)
        targets = targets.to(self.ctx.device, non_blocking=True)
        total = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for micro, (x, y) in enumerate(zip(inputs.chunk(accum), targets.chunk(accum))):
            self._set_gradient_sync(micro == accum - 1)
            with torch.autocast(
                self.ctx.device.type, dtype=torch.bfloat16, enabled=self.autocast.enabled
            ):
                loss = self.forward(x, y) / accum
            loss.backward()
            total += loss.detach().float()
        all_reduce_gradients(self.setup.all_reduce_params, self.ctx)
        self.guard.check_step(step, total)
        multiplier = lr_multiplier(
            step, schedule_steps, self.cfg.schedule.cooldown_frac, self.cfg.schedule.warmup_steps
        )
        apply_lr_multiplier(self.setup.optimizers, multiplier)
        if snapshot:
            self.telemetry.snapshot()  # type: ignore[union-attr]
        failed: OptimizerStepFailed | None = None
        for opt in self.setup.optimizers:
            try:
                opt.step()
            except NonFiniteGradientError as exc:  # DistAdam's own check, on every rank
                raise self.guard.non_finite_gradient(step, exc) from None
            except Exception as exc:  # a user's code: one line; the project's: a bug, traceback
                if not is_users_optimizer(opt):
                    raise
                failed = OptimizerStepFailed(opt, step + 1, exc)
                failed.__cause__ = exc
                break
        self._stop_every_rank_if_one_failed(failed)
        for opt in self.setup.optimizers:
            opt.zero_grad(set_to_none=True)
        return total

    def _stop_every_rank_if_one_failed(self, failed: OptimizerStepFailed | None) -> None:
        """Raise ``failed`` here, and its message on every other rank: a user's optimizer may
        raise on one rank only, and the others would wait in the next step's collectives until
        the timeout. One tiny all-reduce per step, only with a user's optimizer on several
        ranks (the project's optimizers raise on every rank alike, or are a bug)."""
        if self.ctx.world_size > 1 and any(map(is_users_optimizer, self.setup.optimizers)):
            if any_rank_true(failed is not None, self.ctx):
                message = first_error_on_any_rank(None if failed is None else str(failed), self.ctx)
                raise failed if failed is not None else UserError(str(message))
        if failed is not None:
            raise failed

    def _set_gradient_sync(self, enabled: bool) -> None:
        """Whether this backward reduces gradients across ranks (the optimizers' hooks, FSDP)."""
        self.setup.set_gradient_sync(enabled)
        set_fsdp_sync = getattr(self.model, "set_requires_gradient_sync", None)
        if set_fsdp_sync is not None:
            set_fsdp_sync(enabled)

    @torch.no_grad()
    def _validation_loss(self) -> float:
        """Mean next-token loss over the first ``val_tokens`` validation tokens, over ranks.

        Every call reads the same tokens, so values are comparable across steps and runs.
        """
        cfg, ctx, model = self.cfg, self.ctx, self.forward
        was_training = model.training
        model.eval()
        total = torch.zeros((), dtype=torch.float32, device=ctx.device)
        batches = validation_batches(
            self.data.val_pattern,
            cfg.data.batch_size,
            cfg.data.seq_len,
            ctx.rank,
            ctx.world_size,
            cfg.data.val_tokens,
        )
        count = 0
        for inputs, targets in batches:
            inputs = inputs.to(ctx.device, non_blocking=True)
            targets = targets.to(ctx.device, non_blocking=True)
            with torch.autocast(
                ctx.device.type, dtype=torch.bfloat16, enabled=self.autocast.enabled
            ):
                total += model(inputs, targets).float()
            count += 1
        model.train(was_training)
        if hasattr(self.model, "reshard"):  # FSDP2 leaves the root gathered after a forward
            self.model.reshard()  # type: ignore[operator]
        return float(all_reduce_mean_(total / count, ctx).item())

    def _save_checkpoint(self, step: int) -> Path:
        """Save a checkpoint of the state after ``step`` steps, unless a parameter is NaN/Inf."""
        self.guard.check_parameters(step)
        if not self.state_checked:  # before anything is written: no .partial is left
            self._on_every_rank(lambda: check_state_loadable(self.setup.optimizers))
            self.state_checked = True
        directory = checkpoint_path(self.cfg.run.out_dir, self.run_id, step)
        if self.cfg.parallel.mode == "ddp":
            save_checkpoint(
                directory,
                self.ctx.rank,
                self.ctx.world_size,
                step,
                self.train_time_ms,
                self.model,
                self.setup.optimizers,
                self.loader,
                self.run_id,
                self._resumed_checkpoint(),
            )
        else:
            save_sharded_checkpoint(
                directory,
                self.ctx.rank,
                step,
                self.train_time_ms,
                self.model,
                self.setup.optimizers,
                self.loader,
                self.run_id,
                self.cfg.parallel.mode,
                self._resumed_checkpoint(),
            )
        barrier(self.ctx)  # every rank has written its file
        if self.ctx.is_main:
            publish_checkpoint(directory)
        barrier(self.ctx)  # the checkpoint exists for everyone
        return directory

    def _finish(self, val_loss: float) -> None:
        allocated, reserved = peak_memory_mib(self.ctx)
        total = self.cfg.schedule.num_iterations
        # train_time_ms counts every step of the run, a resumed one included (as step_avg does).
        mfu = self.mfu.of_step(self.train_time_ms / 1000 / max(total, 1))
        phases = self.clock.record(self.log.write_s)
        self.log.final(total, total, val_loss, self.train_time_ms, allocated, reserved, mfu, phases)
        if self.ctx.is_main:
            print(
                f"final val_loss {val_loss:.4f} after {total} steps "
                f"({self.train_time_ms / 1000:.1f}s training, MFU {100 * mfu:.2f}%); "
                f"log: {self.log.text_path}"
            )

    def _config_record(self) -> dict[str, object]:
        return {
            "kind": "config",
            "run_id": self.run_id,
            "seed": self.cfg.run.seed,
            "preset": self.cfg.run.preset,
            "optimizer": self.cfg.optimizer,
            "world_size": self.ctx.world_size,
            "autocast": self.autocast.name,
            "autocast_reason": self.autocast.reason,
            "compile": self.compiled.name,
            "compile_reason": self.compiled.reason,
            "threads": torch.get_num_threads(),
            "threads_reason": self.threads.reason,
            "resumed_from": self.resumed_from,
            "mfu": dataclasses.asdict(self.mfu),
            "non_embedding_params": self.non_embedding_params,
            # Records of kind "telemetry" in the JSONL (train/telemetry.py): every this many steps.
            "telemetry_every": 0 if self.telemetry is None else self.telemetry.every,
            "config": self.cfg.to_dict(),
        }

    def _environment(self) -> str:
        device = self.ctx.device.type
        if device == "cuda":
            device += f" ({torch.cuda.get_device_name(self.ctx.device)})"
        params = sum(p.numel() for p in self.model.parameters())
        return (
            f"python {platform.python_version()} torch {torch.__version__} device {device} "
            f"cpu {cpu_name()} cores {available_cores()}/{os.cpu_count()} "
            f"world_size {self.ctx.world_size} threads {torch.get_num_threads()} "
            f"autocast {self.autocast.name} ({self.autocast.reason}) "
            f"parameters {params} vocab_size {self.data.vocab_size} "
            f"train {self.data.train_pattern} val {self.data.val_pattern}"
        )


def _say(line: str, ctx: DistributedContext, bar: Progress) -> None:
    """Print on rank 0, above the progress bar when there is one."""
    if ctx.is_main:
        if bar.disable:
            print(line, flush=True)
        else:
            bar.write(line)
