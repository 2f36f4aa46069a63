"""The run around the iterations: its lifecycle, as torchtune names a recipe's (setup, train, save_checkpoint, cleanup).

* **start**: the output directory is locked for the whole run (run_lock.py) and leftovers of a killed run removed;
  a resume loads the checkpoint (its checks first: resume_check.py), a fresh run claims the directory (never mixing
  its files with an earlier run's); the resolved config is written first; the starting model is evaluated.
* **iterate**: after each iteration (loop.py) the metrics line, then by cadence the evaluation, the checkpoint and the
  plots; Ctrl-C and SIGTERM finish the iteration and save (a second one stops at once).
* **end**: summary.json, whatever ends the run: completed, interrupted, preempted, stopped, or failed. Any exception
  from the starting model's evaluation on (a user's part, flowrl itself) is caught in one place, ``_fit``; the failure
  path (``_failed``) has the processes agree on it, makes sure the last completed iteration is on disk and says what
  failed and how to resume in one sentence (failure.py names the part; the traceback goes to error.log).

Checkpoints hold every trained role (roles.py): the engine gathers their weights and optimizer states whole
(engine.py), checkpoint.py writes them atomically and verifies them when read.
"""

from __future__ import annotations

import functools
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Protocol

from accelerate.utils import broadcast_object_list, gather_object
from tqdm import tqdm

from ..atomic_files import TEMP_PREFIX, atomic_path, writing
from ..config import to_yaml
from ..errors import FlowRLError, Preempted, first_line
from ..visualize import save_instruments, save_reward_curve
from . import deepspeed_zero, failure, fault_injection
from .checkpoint import STATE_FILE, checkpoint_step, find_latest, read_checkpoint, remove_leftover_temporaries, save_checkpoint
from .distributed import PeerFailed, check_peers, exchange_failures
from .engine import Engine
from .failure import RunFailed
from .flops import device_name, throughput_summary
from .loop import TrainingLoop
from .resume_check import check_resume_config
from .roles import Roles
from .run_lock import RunLock
from .run_logger import RunLogger, json_line


class Evaluates(Protocol):
    """What the run asks of the trainer at an evaluation: the metrics, the shown samples and their spec."""

    def evaluate(self, return_samples: bool = False) -> Any: ...

    def eval_spec(self, metrics: dict[str, float], shown: Any, checkpoint: Path | None) -> dict[str, Any]: ...


class Run:
    def __init__(self, config, accelerator, engine: Engine, roles: Roles, loop: TrainingLoop, modality, trackers, evaluator: Evaluates):
        self.config, self.accelerator, self.engine, self.roles, self.loop = config, accelerator, engine, roles, loop
        self.modality, self.trackers, self.evaluator = modality, trackers, evaluator
        self.is_main, self.world, self.rank = accelerator.is_main_process, accelerator.num_processes, accelerator.process_index
        self.run_dir = Path(config.output_dir)
        self.logger = RunLogger(self.run_dir, enabled=self.is_main, trackers=trackers)
        self.iteration = 0
        self._started_elsewhere = False  # resumed from another run's checkpoint: evaluated before training here too
        self.stop_requested: str | bool = False  # "SIGINT" or "SIGTERM" once asked to stop
        self._lock = RunLock(self.run_dir)
        self._saving = False  # True while a checkpoint is being written
        self._logged = 0  # the last iteration whose metrics line (with its evaluation) is written; a later one is not saved
        self._last_eval_spec: tuple[int, dict[str, Any]] | None = None  # (step, spec) of the last evaluation, main process
        self._stage = ""  # where the run is, as a failure's sentence says it: "in iteration 2"

    # -- the whole run ---------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train ``train.iterations`` iterations (or what is left of them after ``resume_from``): the output directory
        is locked for the whole run, and a run ends with summary.json whatever ends it."""
        self._take_output_dir()
        try:
            return self._fit()
        finally:
            if self.is_main:
                self._lock.release()

    def _fit(self) -> dict[str, Any]:
        self._start()
        started = time.time()
        try:  # the run's one boundary: whatever fails from here on, in whichever part, ends the run in _failed
            if self.iteration == 0 or self._started_elsewhere:  # this run's own "before": the weights it starts from
                self._stage = "in the evaluation before training"
                self._evaluate_and_log(self.iteration, tag="before")
            status, reason = self._iterate()
        except Exception as error:  # KeyboardInterrupt and Preempted (SIGTERM) are not Exceptions: they pass
            raise self._failed(error, time.time() - started) from (None if isinstance(error, FlowRLError) else error)
        if self.iteration >= self.config.train.iterations:  # a stop requested during the last iteration stopped nothing
            status, reason = "completed", None
        return self._finish(time.time() - started, status, reason)

    def _iterate(self) -> tuple[str, str | None]:
        """The iterations, each followed by its log, evaluation and checkpoint by cadence; how they ended."""
        previous = self._catch_stop_signals()
        first = self.iteration
        bar = self._progress_bar()
        status, reason = "completed", None
        try:
            for iteration in bar:
                self._stage = f"in iteration {iteration + 1}"
                metrics = self.loop.iteration(iteration)  # collect -> score -> prepare -> update
                self.iteration = iteration + 1
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
                if self._after_iteration(metrics):  # log -> evaluate -> checkpoint; True: stop here
                    status, reason = self._stopped_by_signal()
                    break
                if self.config.train.stop_after and self.iteration - first >= self.config.train.stop_after:
                    status, reason = "stopped", f"train.stop_after={self.config.train.stop_after} iterations were done."
                    break
            check_peers(self.world)  # the main process alone drew the last plots; the end (summary.json) is collective
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            bar.close()
        return status, reason

    def _start(self) -> None:
        """Resume or claim the output directory, write the config, start the trackers (the starting model is evaluated
        next, in _fit)."""
        resume = self.config.resume_from
        if resume == "latest" and not self._has_checkpoint():
            if self.is_main:  # e.g. killed while writing its first checkpoint: there is nothing to resume
                print(f"flowrl: output_dir '{self.run_dir}' holds no complete checkpoint, so the run starts afresh there.", file=sys.stderr)
            resume = None
        if resume:  # before anything is written: a bad checkpoint must leave no files behind
            self.load(resume)
            self.logger.truncate_after(self.iteration)
        else:
            self._claim_output_dir()
        if self.is_main:
            self._write_config()
            if resume:
                self._remove_error_logs()  # an earlier failure's traceback, which this run continues past
        self.trackers.start(self.accelerator, self.config.model_dump(mode="json"))  # the resolved config, as config.yaml holds it

    def _progress_bar(self) -> tqdm:
        cfg = self.config
        return tqdm(
            range(self.iteration, cfg.train.iterations),
            initial=self.iteration,
            total=cfg.train.iterations,
            desc="flowrl train",
            disable=not (self.is_main and cfg.log.progress),
            dynamic_ncols=True,
        )

    def _stopped_by_signal(self) -> tuple[str, str]:
        if self.stop_requested == "SIGTERM":
            return "preempted", f"stopped by SIGTERM (preemption) after iteration {self.iteration}; resume with resume_from=latest."
        return "interrupted", f"stopped by Ctrl-C after iteration {self.iteration}."

    # -- after each iteration: log, evaluate, checkpoint, plots ------------------------------------------------------
    def _after_iteration(self, metrics: dict[str, float]) -> bool:
        """Returns whether the run stops after this iteration (Ctrl-C). The flag is read once: a Ctrl-C that arrives
        while this iteration is being logged or saved stops the run after the next one, so the stopped weights are
        always evaluated and saved together."""
        cfg, it = self.config, self.iteration
        stopping = self._agreed_stop()
        last = it == cfg.train.iterations
        # After Ctrl-C the stopped weights are evaluated too, so summary.json's final reward is theirs; after SIGTERM
        # (a preemption, with a deadline) they are only saved.
        evaluate = ((cfg.eval.every and it % cfg.eval.every == 0) or last or stopping) and stopping != "SIGTERM"
        if evaluate:
            self._stage = f"in the evaluation after iteration {it}"
            metrics.update(self._evaluate_and_log(it, tag="after" if last or stopping else None, log=False))
        self._stage = f"after iteration {it}"
        fault_injection.reached("log", it)
        self.logger.log(it, metrics)
        self._logged = it
        if (cfg.log.checkpoint_every and it % cfg.log.checkpoint_every == 0) or last or stopping:
            self.save()
        if self.is_main and evaluate:
            self._plots(it)
        return bool(stopping)

    def _plots(self, step: int) -> None:
        """The run directory's reward curve and instruments (reward hacking: docs/instruments.md)."""
        records, title = self.logger.records(), self._title()
        fault_injection.reached("plots", step)
        save_reward_curve(records, self.run_dir / "reward_curve.png", title=title)
        fault_injection.reached("plots:instruments.png", step)
        save_instruments(records, self.run_dir / "instruments.png", title=title)

    def _title(self) -> str:
        return f"{self.config.objective.name} on {self.config.pipeline.pretrained}"

    def _agreed_stop(self) -> str | bool:
        """This iteration's stop request, the same on every process (each got its own signal, maybe not at once)."""
        if self.world == 1:
            return self.stop_requested
        requests = [r for r in gather_object([self.stop_requested]) if r]
        return "SIGTERM" if "SIGTERM" in requests else (requests[0] if requests else False)

    def _evaluate_and_log(self, step: int, tag: str | None, log: bool = True) -> dict[str, float]:
        fault_injection.reached("evaluate", step)
        t0 = time.perf_counter()
        metrics, shown = self.evaluator.evaluate(return_samples=True)
        if self.is_main:  # summary.json records the last one, with the checkpoint that holds its weights (_finish)
            self._last_eval_spec = (step, self.evaluator.eval_spec(metrics, shown, None))
        metrics["perf/eval_s"] = time.perf_counter() - t0
        if self.is_main:
            self.modality.save_eval_samples(shown, self.run_dir, step, tag)
            self.trackers.log_samples(step)
        if log:
            self.logger.log(step, metrics)
        return metrics

    # -- checkpoints ---------------------------------------------------------------------------------------------------
    def save(self) -> Path | None:
        """Every trained role's weights and optimizer state, the objective's state of every process, the iteration and
        the non-finite-reward window, written atomically; a collective (every process takes part)."""
        fault_injection.reached("checkpoint", self.iteration)
        check_peers(self.world)  # the main process alone wrote the metrics line and the samples: had that failed, stop all
        states = gather_object([self.loop.objective_state()])
        self.accelerator.wait_for_everyone()
        self._saving = True
        target = self.run_dir / "checkpoints" / f"step_{self.iteration:06d}"
        weights, optimizer = self.engine.gather(self.roles, keep=self.is_main)
        staging = target.parent / f"{TEMP_PREFIX}{target.name}.deepspeed"
        launch_state = self.engine.save_extra(self.roles, staging)
        check_peers(self.world)  # every process wrote its own part (DeepSpeed's partitions): had one failed, stop all
        path = None
        if self.is_main:
            state = {
                "iteration": self.iteration,
                "objective": states,
                # the non-finite-reward window of the iterations this checkpoint holds (not of one that failed after them),
                # so a resumed run stops where the uninterrupted one would
                "nonfinite_window": [list(entry) for entry in self.loop.nonfinite if entry[0] < self.iteration],
                "roles": self.roles.prefixes(),
                **launch_state,
            }
            extra = self._extra_files(weights, staging if launch_state else None)
            path = save_checkpoint(target, weights, optimizer, state, to_yaml(self.config), extra=extra)
        check_peers(self.world)  # the main process alone wrote the checkpoint: had that failed, the others stop with it
        self._saving = False
        return path

    def _extra_files(self, weights: dict, staging: Path | None):
        """What a checkpoint holds besides flowrl's files: the policy's LoRA in its library's format, DeepSpeed's partitions."""
        pipeline = self.modality.pipeline
        lora = pipeline.save_lora
        if self.engine.shards_weights:  # the gathered tensors: the module holds only this process's shards
            lora = functools.partial(pipeline.save_lora, state_dict=self.roles.split(weights)[self.roles.policy.name])

        def extra(tmp: Path) -> None:
            if pipeline.has_lora:
                lora(tmp)
            if staging is not None:
                deepspeed_zero.move_into(staging, tmp)

        return extra

    def load(self, spec: str) -> None:
        """Resume from checkpoint ``spec`` ("latest": the newest one that verifies): every role's weights and optimizer
        state, the objective's state, the iteration; a checkpoint this launch or config cannot continue is refused."""
        if spec == "latest":  # the newest checkpoint that verifies, said out loud
            directory, notice = find_latest(self.run_dir)
            if self.is_main:
                print(f"flowrl: {notice}", file=sys.stderr, flush=True)
            weights, optim, state = read_checkpoint(directory, verify=False)  # find_latest verified every file
        else:
            directory = Path(spec)
            weights, optim, state = read_checkpoint(directory)
        self.engine.check_resumable(state, directory)
        check_resume_config(self.config, directory, spec)  # after the launch check: no resume_allow mends that one
        try:
            self.engine.load(self.roles, weights, optim, state, directory)
        except (RuntimeError, KeyError, ValueError) as e:
            raise FlowRLError(f"checkpoint '{directory}' does not match this model ({str(e).splitlines()[0][:160]}).") from None
        objective_states = state.get("objective", [])
        if len(objective_states) != self.world:
            raise FlowRLError(f"checkpoint '{directory}' was written by {len(objective_states)} process(es) but this run has {self.world}.")
        self.loop.objective.load_state_dict(objective_states[self.rank])
        self.iteration = self._logged = int(state["iteration"])
        self._started_elsewhere = not directory.resolve().is_relative_to(self.run_dir.resolve())
        if self.is_main and self._started_elsewhere:
            print(
                f"flowrl: starting from another run's checkpoint '{directory}' (its iteration {self.iteration}); the "
                "held-out reward 'before' is of its trained weights, not of the base model.",
                file=sys.stderr,
                flush=True,
            )
        self.loop.nonfinite.clear()  # a checkpoint written before the window was saved: it starts afresh
        self.loop.nonfinite.extend(tuple(int(x) for x in entry) for entry in state.get("nonfinite_window", []))

    # -- the output directory ------------------------------------------------------------------------------------------
    def _take_output_dir(self) -> None:
        """The output directory's lock, taken by the main process and agreed by all: a refusal is every process's."""
        problem = None
        if self.is_main:
            try:
                self._lock.acquire()
                self._remove_leftover_temporaries()
            except FlowRLError as e:
                self._lock.release()
                problem = str(e)
        if self.world > 1:
            problem = broadcast_object_list([problem])[0]
        if problem:
            raise FlowRLError(problem)

    def _remove_leftover_temporaries(self) -> None:
        """A run killed mid-write (kill -9, the OOM killer) leaves its temporary names behind (a hidden half-written
        checkpoint can be gigabytes): the next run removes them, and says so, once it holds the lock, which no live
        run then holds. Where the file system cannot lock, another run may be writing them: they are left."""
        if not self._lock.held:
            return
        removed = remove_leftover_temporaries(self.run_dir)
        if removed:
            shown = ", ".join(p.as_posix() for p in removed[:3]) + (f" and {len(removed) - 3} more" if len(removed) > 3 else "")
            print(
                f"flowrl: removed {len(removed)} temporary file(s) left in '{self.run_dir}' by a write that a killed run "
                f"did not finish: {shown}.",
                file=sys.stderr,
                flush=True,
            )

    def _write_config(self) -> None:
        """The resolved config, first thing in the run directory; a directory this created is removed again
        when the write fails, so an unwritable or full disk leaves nothing behind. A resumed run that changed the
        config keeps the earlier one as config_history/step_<N>.yaml (the config the run had up to step N)."""
        created = [d for d in [self.run_dir, *self.run_dir.parents] if not d.exists()]  # innermost first
        path, text = self.run_dir / "config.yaml", to_yaml(self.config)
        try:
            if self.config.resume_from and path.is_file() and path.read_text() != text:
                with atomic_path(self.run_dir / "config_history" / f"step_{self.iteration:06d}.yaml") as tmp:
                    tmp.write_text(path.read_text())
            with atomic_path(path) as tmp:
                tmp.write_text(text)
        except FlowRLError:
            for d in created:
                try:
                    d.rmdir()
                except OSError:
                    break
            raise

    def _has_checkpoint(self) -> bool:
        """Whether the output directory holds a checkpoint (valid or not: a corrupt one is named by find_latest)."""
        return any(checkpoint_step(p) is not None for p in (self.run_dir / "checkpoints").glob("step_*"))

    def _claim_output_dir(self) -> None:
        """A fresh run never mixes its metrics or checkpoints with an earlier run's. An earlier run that saved no
        checkpoint (killed before or while writing its first) has nothing to resume: it is replaced, and said so."""
        previous = [p for p in ("metrics.jsonl", "checkpoints") if (self.run_dir / p).exists()]
        if not previous:
            return
        if not self._has_checkpoint() and not self.config.overwrite:
            if self.is_main:
                print(f"flowrl: output_dir '{self.run_dir}' holds a run that saved no checkpoint; it is replaced.", file=sys.stderr)
        elif not self.config.overwrite:
            raise FlowRLError(
                f"output_dir '{self.run_dir}' already holds a run; continue it with resume_from=latest, "
                "choose another output_dir, or set overwrite=true to replace it."
            )
        self.accelerator.wait_for_everyone()
        if self.is_main:
            with writing(self.run_dir):
                for name in ("metrics.jsonl", "summary.json", "reward_curve.png", "instruments.png"):
                    (self.run_dir / name).unlink(missing_ok=True)
                self._remove_error_logs()
                for name in ("checkpoints", "samples", "tensorboard"):
                    if (self.run_dir / name).exists():
                        shutil.rmtree(self.run_dir / name)
        self.accelerator.wait_for_everyone()

    # -- the end -------------------------------------------------------------------------------------------------------
    def _finish(self, seconds: float, status: str = "completed", reason: str | None = None, quiet: bool = False) -> dict[str, Any]:
        """Write summary.json: what was done and, when the run did not complete, why (``status``: completed,
        interrupted, preempted, stopped or failed; ``reason``: the sentence). ``quiet``: on the failure path, where a
        second error (a full disk) must not hide the first."""
        records = self.logger.records() if self.is_main else []
        evals = [r for r in records if r.get("eval/reward/mean") is not None]
        summary = {
            "status": status,
            "reason": reason,
            "iterations_completed": self.iteration,
            "iterations_planned": self.config.train.iterations,
            "eval_reward_initial": evals[0]["eval/reward/mean"] if evals else None,
            "eval_reward_initial_step": evals[0]["step"] if evals else None,  # > 0: a resumed checkpoint's weights
            "eval_reward_final": evals[-1]["eval/reward/mean"] if evals else None,
            "eval_reward_final_step": evals[-1]["step"] if evals else None,  # the weights the final reward measured
            "samples_per_iteration": self.config.train.prompts_per_iteration * self.loop.collector.rows_per_prompt,
            "wall_seconds_this_process": round(seconds, 1),
            "stopped_early": self.iteration < self.config.train.iterations,
            "eval_spec": self._final_eval_spec(),
            # the logged iterations' model FLOPs, seconds, FLOP/s and MFU (training/flops.py)
            "throughput": throughput_summary(records, device_name(self.loop.flops.device), self.loop.flops.peak, self.world),
        }
        fault_injection.reached("finish")
        written = self.is_main and (self.run_dir / "config.yaml").is_file()
        try:  # summary.json is the run's last write: a summary that says completed had every other write done
            self.logger.close()  # the trackers' last flush
            if written:
                save_reward_curve(records, self.run_dir / "reward_curve.png", title=self._title())
        except FlowRLError:
            if not quiet:
                raise
        fault_injection.reached("finish:summary.json")
        try:
            if written:
                with atomic_path(self.run_dir / "summary.json") as tmp:
                    tmp.write_text(json_line(summary, indent=2) + "\n")
        except FlowRLError:
            if not quiet:  # on the failure path the first error is the one to say
                raise
        if not quiet:
            self.accelerator.wait_for_everyone()
        return summary

    def _final_eval_spec(self) -> dict[str, Any] | None:
        """The spec of the last evaluation this process ran, naming the checkpoint of its step (``flowrl eval --spec
        summary.json`` re-runs it); the starting model's (step 0) needs none."""
        if self._last_eval_spec is None:
            return None
        step, spec = self._last_eval_spec
        spec = {**spec, "model": dict(spec["model"])}
        if step > 0:
            ckpt = self.run_dir / "checkpoints" / f"step_{step:06d}"
            saved = (ckpt / STATE_FILE).is_file()
            spec["model"]["checkpoint"] = str(ckpt.resolve()) if saved else None
            if not saved:
                spec["model"]["trained_weights_unsaved"] = True
        return spec

    def _failed(self, error: Exception, seconds: float) -> RunFailed:
        """End the run after ``error``, whatever raised it: the processes agree on the failure (the lowest-ranked one's
        when several failed; ``PeerFailed``: another process's, told at the loop's check), the last completed
        iteration is saved where it can be, summary.json says ``failed`` with the sentence, and the sentence comes
        back as a :class:`RunFailed`, which the CLI prints once, with exit 2 (docs/failure_behaviour.md)."""
        own = None if isinstance(error, PeerFailed) else error
        if own is None:
            report = error.report
        else:
            head, internal = failure.describe(own, self._stage, self._user_parts())
            log = None if isinstance(own, FlowRLError) else failure.write_log(self.run_dir, self.rank, own, head)
            report = {"head": head, "internal": internal, "log": None if log is None else str(log)}
        agreed = True
        if own is not None:
            try:
                report = exchange_failures(report, self.world)
            except Exception as lost:  # a process that is gone (killed): nothing collective can be done any more
                agreed, cut = False, first_line(lost)
        saved = (
            self._save_after_failure()
            if agreed
            else f"the other processes could not be reached ({cut}), so nothing more was saved (resume_from=latest "
            "continues from the newest checkpoint)"
        )
        message = failure.sentence(report, saved)
        self._finish(seconds, "failed", message, quiet=True)
        if agreed and self.world > 1:
            self.accelerator.wait_for_everyone()  # summary.json is written before any process leaves
        return RunFailed(message, None if own is None else "".join(traceback.format_exception(own)), together=agreed)

    def _user_parts(self) -> list[failure.Part]:
        try:
            return failure.user_parts(self.config, self.loop.reward, getattr(self.evaluator, "judge", None), self.modality)
        except Exception:  # naming the parts must not hide the failure being said
            return []

    def _remove_error_logs(self) -> None:
        """An earlier failure's tracebacks (failure.py), which a run starting afresh or resuming leaves behind it."""
        for path in [self.run_dir / "error.log", *self.run_dir.glob("error.rank*.log")]:
            path.unlink(missing_ok=True)

    def _save_after_failure(self) -> str:
        """Make sure the last completed iteration is on disk and say where. Weights changed by an unfinished
        update are not saved (they belong to no iteration). Every process calls this once they agreed on the failure
        (_failed), and the main process's view decides (it writes the files, and a failure of its own writes left
        the others a step ahead), so they all save, or none does: saving is collective."""
        said = self._unsaved()
        if self.world > 1:
            said = broadcast_object_list([said])[0]
        if said is not None:
            return said
        try:
            self.save()
        except Exception as e:  # a second failure must not hide the first
            if not isinstance(e, PeerFailed):  # this process's own: the others hear of it at save's last check
                exchange_failures({"head": first_line(e)}, self.world)
            reason = str(e).rstrip(".") if isinstance(e, FlowRLError) else first_line(e)
            return f"iteration {self.iteration} could not be saved either ({reason})"
        directory = self.run_dir / "checkpoints" / f"step_{self.iteration:06d}"
        return f"the run stopped with iteration {self.iteration} saved in {directory} (resume with resume_from=latest)"

    def _unsaved(self) -> str | None:
        """What to say when the last completed iteration is on disk already or cannot be saved now; None: save it."""
        if self.iteration == 0:
            return "no iteration had completed, so there is nothing to resume"
        directory = self.run_dir / "checkpoints" / f"step_{self.iteration:06d}"
        if directory.is_dir():
            return f"the run stopped with iteration {self.iteration} saved in {directory} (resume with resume_from=latest)"
        # the checkpoint write itself failed, the weights are half-updated, or the iteration's evaluation or metrics
        # line is missing (a resume from it would never write them: it is trained again instead)
        if self._saving or self.loop.updating or self._logged < self.iteration:
            earlier = sorted(p.name for p in (self.run_dir / "checkpoints").glob("step_*") if p.is_dir())
            resume = f"resume_from=latest continues from {earlier[-1]}" if earlier else "there is no checkpoint to resume from"
            what = (
                "could not be saved"
                if self._saving
                else "was not saved (the failure came during the next update)"
                if self.loop.updating
                else "was not saved (the failure came before its metrics were logged)"
            )
            return f"iteration {self.iteration} {what}, so {resume}"
        return None

    # -- signals -------------------------------------------------------------------------------------------------------
    def _catch_stop_signals(self) -> dict[int, Any]:
        """Ctrl-C and SIGTERM (what SLURM and Kubernetes send before they kill) finish the iteration and save; the
        handlers they replace, to put back. Off the main thread (a notebook's worker) Python allows no handler."""
        previous = {}
        for signum, handler in ((signal.SIGINT, self.request_stop), (signal.SIGTERM, self.request_preemption)):
            try:
                previous[signum] = signal.signal(signum, handler)
            except ValueError:
                pass
        return previous

    def request_preemption(self, signum, frame) -> None:
        if self.stop_requested == "SIGTERM":  # a second SIGTERM: the deadline is closer than an iteration
            raise Preempted
        self.stop_requested = "SIGTERM"
        tqdm.write("flowrl: SIGTERM: stopping after this iteration and saving a checkpoint (a second SIGTERM stops at once).")

    def request_stop(self, signum, frame) -> None:
        if self.stop_requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.stop_requested = "SIGINT"
        tqdm.write("flowrl: stopping after this iteration, evaluating and saving a checkpoint (Ctrl-C again to abort now).")
