"""Training of the LRA classifier from one YAML config, resumable after any interruption.

Batches are a pure function of (seed, step): step s reads slice s of a per-epoch permutation,
and the dropout generator is re-seeded from (seed, step, rank) every step. A resumed run
therefore continues exactly where the interrupted one stood, given the weights, optimizer,
scheduler (and loss scaler) state in the last checkpoint (`checkpoint.py`); on a GPU bit for
bit with train.deterministic (see `deterministic_algorithms`). Ctrl-C or SIGTERM ends a run with
a checkpoint (`StopSignals`).

Devices, mixed precision (train.mixed_precision: no / fp16 / bf16) and data-parallel runs come
from accelerate; on several GPUs the global batch is split over the processes:

    accelerate launch --num_processes 4 -m magicube.eval.cli train --config lra_text
"""
from __future__ import annotations

import contextlib
import inspect
import json
import math
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, is_initialized
from tqdm.auto import tqdm

from magicube.model.lra import QUANTIZED, LRAClassifier, LRAConfig
from magicube.train import data as data_mod
from magicube.train.checkpoint import latest_checkpoint, load_checkpoint, load_weights, save_checkpoint
from magicube.train.config import check_count, check_flag, check_real, dump_config, load_config
from magicube.train.files import check_writable, write_atomic

# What the train section may hold (a finetune section's train keys are merged into it).
TRAIN_KEYS = ("steps", "batch_size", "lr", "schedule", "warmup", "scale_lr", "betas", "eps", "weight_decay",
              "grad_clip", "mixed_precision", "cpu", "log_every", "eval_every", "eval_batch_size", "eval_batches",
              "checkpoint_every", "keep_checkpoints", "max_minutes", "init_from", "deterministic")
# What the model section may hold: LRAConfig's own arguments (the task gives the vocabulary and classes).
MODEL_KEYS = tuple(k for k in inspect.signature(LRAConfig.__init__).parameters
                   if k not in ("self", "kwargs", "vocab_size", "num_classes"))


MIXED_PRECISIONS = ("no", "fp16", "bf16")  # train.mixed_precision, as accelerate names them

# The train section's counts, and the least each may be (a batch of 0 divided by zero, and a negative
# step count trained nothing, without a word); then those that may be null: evaluated and saved at the
# end only, every checkpoint kept, the whole evaluation split.
TRAIN_COUNTS = {"steps": 0, "batch_size": 1, "warmup": 0, "eval_batch_size": 1, "log_every": 1}
OPTIONAL_COUNTS = {"eval_every": 0, "checkpoint_every": 0, "keep_checkpoints": 1, "eval_batches": 1}
# The sections and settings of a run config's top level.
CONFIG_KEYS = ("name", "seed", "out_dir", "data", "model", "train", "finetune", "eval")
# What the data section may hold (limit: a fixed random subset of each split, for quick runs), and
# the eval section (`magicube evaluate`'s defaults for the run).
DATA_KEYS = ("task", "path", "auto_generate", "cache_dir", "generate", "limit")
EVAL_KEYS = ("split", "batch_size", "backends")
# What a finetune section may hold (`from` and `source_attention` are written into the run's own).
FINETUNE_KEYS = ("precision", "scales", "granularity", "calibration_batches", "out_dir", "train", "from",
                 "source_attention")


def check_keys(cfg: dict, section: str | None, known: tuple[str, ...], required: bool = False) -> None:
    """A section is a mapping, and a key the code does not read is a typo (`train.max_minute=8` would
    train without a limit, `trian.steps=8` with the config's steps, and LRAConfig, a transformers
    config, keeps any keyword): refused by name. section None: the config's top level."""
    settings = cfg if section is None else cfg.get(section, None if required else {})
    if not isinstance(settings, dict):
        raise ValueError(f"{section}: expected a section of key: value settings, got {settings!r}")
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ValueError(f"{section or 'config'}: unknown key{'s' * (len(unknown) > 1)} {', '.join(unknown)}; "
                         f"expected keys among {', '.join(known)}")


def model_config(cfg: dict) -> LRAConfig:
    check_keys(cfg, "model", MODEL_KEYS)
    task = data_mod.check_task(cfg["data"].get("task"))
    return LRAConfig(vocab_size=data_mod.VOCAB_SIZE[task], num_classes=data_mod.NUM_CLASSES[task],
                     **cfg.get("model", {}))


def check_config(cfg: dict) -> None:
    """The config's top level, its data, eval, finetune and train sections and the seed, setting by
    setting, before anything is written (a negative clip norm would flip the gradients, a log
    interval of 0 divide by zero; the model section is model_config's and LRAConfig's to check)."""
    check_keys(cfg, None, CONFIG_KEYS)
    check_keys(cfg, "data", DATA_KEYS, required=True)
    check_count("data.limit", cfg["data"].get("limit"), 1, optional=True)
    check_flag("data.auto_generate", cfg["data"].get("auto_generate", False))
    # `magicube evaluate` and `magicube finetune` read these sections; a typo is better found before
    # the training
    check_keys(cfg, "eval", EVAL_KEYS)
    check_count("eval.batch_size", cfg.get("eval", {}).get("batch_size"), 1, optional=True)
    check_keys(cfg, "finetune", FINETUNE_KEYS)
    check_keys(cfg, "train", TRAIN_KEYS, required=True)
    tc = cfg["train"]
    check_count("seed", cfg.get("seed", 0), 0)
    for key, least in TRAIN_COUNTS.items():
        check_count(f"train.{key}", tc.get(key, least), least)
    for key, least in OPTIONAL_COUNTS.items():
        check_count(f"train.{key}", tc.get(key), least, optional=True)
    check_real("train.lr", tc.get("lr"), least=0)  # 0 trains nothing: a run that only shows where it starts
    for key in ("scale_lr", "eps", "weight_decay"):
        check_real(f"train.{key}", tc.get(key, 0), least=0)
    for key in ("grad_clip", "max_minutes"):
        check_real(f"train.{key}", tc.get(key), above=0, optional=True)
    betas = tc.get("betas", (0.9, 0.98))
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        raise ValueError(f"train.betas: expected two numbers in [0, 1) (Adam's decays), got {betas!r}")
    for i, beta in enumerate(betas):
        check_real(f"train.betas[{i}]", beta, least=0, below=1)
    lr_lambda(tc)  # refuses an unknown schedule
    mixed = tc.get("mixed_precision") or "no"  # YAML reads a bare `no` as False
    if mixed not in MIXED_PRECISIONS:
        raise ValueError(f"train.mixed_precision: expected one of {MIXED_PRECISIONS}, got {mixed!r}")
    for key in ("cpu", "deterministic"):
        check_flag(f"train.{key}", tc.get(key, False))


def lra_lr_lambda(warmup: int):
    """LRA's `constant * linear_warmup * rsqrt_decay`, as a factor of the base lr (step counts from 1)."""
    def factor(step: int) -> float:
        s = step + 1
        return min(1.0, s / max(warmup, 1)) / math.sqrt(max(s, warmup))  # warm-up 0: rsqrt decay from step 1
    return factor


def lr_lambda(tc: dict):
    """train.schedule: "lra" (warm-up then rsqrt decay) or "constant" (warm-up then flat, for finetuning)."""
    schedule, warmup = tc.get("schedule", "lra"), int(tc["warmup"])
    if schedule == "lra":
        return lra_lr_lambda(warmup)
    if schedule == "constant":
        return lambda step: min(1.0, (step + 1) / max(warmup, 1))
    raise ValueError(f"train.schedule: expected 'lra' or 'constant', got {schedule!r}")


def param_groups(model, tc: dict) -> list[dict]:
    """Weights, and learned quantization scales apart: their own lr (train.scale_lr), no weight decay."""
    scales = [p for n, p in model.named_parameters() if n.endswith("qkv_scale")]
    weights = [p for n, p in model.named_parameters() if not n.endswith("qkv_scale")]
    groups = [{"params": weights}]
    if scales:
        groups.append({"params": scales, "lr": float(tc.get("scale_lr", tc["lr"])), "weight_decay": 0.0})
    return groups


def batch_indices(step: int, n: int, batch_size: int, seed: int) -> torch.Tensor:
    per_epoch = n // batch_size
    if per_epoch == 0:
        raise ValueError(f"batch size {batch_size} exceeds the {n} training examples")
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return perm[i * batch_size:(i + 1) * batch_size]


def step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step) * 1_009 + rank


# ---- resuming ----------------------------------------------------------------------------

def _comparable(cfg: dict) -> dict:
    """The parts of a config a resumed run must share with its checkpoint (not its length or logging)."""
    train = {k: v for k, v in cfg.get("train", {}).items()
             if k not in ("steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "max_minutes",
                          "deterministic")}
    return {"seed": cfg.get("seed"), "data": cfg.get("data"), "model": cfg.get("model"), "train": train}


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records an interrupted run logged after the checkpoint it resumes from.

    A record is written with its newline in one write, so text after the last newline is the torn
    record of a run killed while logging; it was logged after the checkpoint, and goes too."""
    if not path.is_file():
        return
    whole = path.read_text().rpartition("\n")[0]
    keep = [line for line in whole.splitlines() if line.strip() and json.loads(line)["step"] <= step]
    write_atomic(path, "".join(line + "\n" for line in keep))


# ---- evaluation --------------------------------------------------------------------------

@torch.no_grad()
def accuracy(model, ids: torch.Tensor, labels: torch.Tensor, batch_size: int, accelerator: Accelerator,
             max_batches: int | None = None, progress: bool = False, desc: str = "eval") -> dict:
    """Accuracy and mean loss over a split (or max_batches of it), sharded over the processes.

    An example whose logits are not all finite (a NaN attention row: an fp16 score overflowed)
    counts as wrong, whatever argmax makes of a NaN, and is counted in "nonfinite"; the loss is
    then NaN."""
    # The bare module: DDP's forward would sync buffers, and shards may differ by one batch.
    model = accelerator.unwrap_model(model)
    was_training = model.training
    model.eval()
    if max_batches is not None and max_batches * batch_size < len(labels):
        # A fixed random subset: splits may be sorted by label, so a prefix would be one class.
        keep = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))[:max_batches * batch_size]
        keep = keep.sort().values
        ids, labels = ids[keep], labels[keep]
    n = len(labels)
    rank, world = accelerator.process_index, accelerator.num_processes
    totals = torch.zeros(4, dtype=torch.float64, device=accelerator.device)  # correct, loss sum, count, nonfinite
    starts = range(rank * batch_size, n, world * batch_size)
    for start in tqdm(starts, desc=desc, disable=not progress or not accelerator.is_main_process, leave=False):
        x = ids[start:start + batch_size].to(accelerator.device)
        y = labels[start:start + batch_size].to(accelerator.device)
        with accelerator.autocast():
            logits = model(x).logits.float()
        finite = logits.isfinite().all(-1)
        totals += torch.stack([((logits.argmax(-1) == y) & finite).sum().double(),
                               torch.nn.functional.cross_entropy(logits, y, reduction="sum").double(),
                               torch.tensor(float(len(y)), dtype=torch.float64, device=totals.device),
                               (~finite).sum().double()])
    totals = accelerator.reduce(totals, reduction="sum")
    model.train(was_training)
    correct, loss, count, nonfinite = totals.tolist()
    return {"accuracy": correct / max(count, 1), "loss": loss / max(count, 1), "examples": int(count),
            "nonfinite": int(nonfinite)}


def _most_over_processes(accelerator: Accelerator, value: int) -> int:
    return int(accelerator.reduce(torch.tensor(value, device=accelerator.device), "max").item())


# ---- training ----------------------------------------------------------------------------

def _accelerator(mixed: str, cpu: bool) -> Accelerator:
    """The run's accelerator. accelerate keeps one state a process: a second run in a process (a
    notebook, a script training two configs) must ask for the device and precision of the first."""
    try:
        return Accelerator(mixed_precision=mixed, cpu=cpu)
    except ValueError:
        if not is_initialized():
            raise
        state = AcceleratorState()
        if state.mixed_precision == mixed and not (cpu and state.device.type != "cpu"):
            raise
        raise ValueError(f"train.mixed_precision={mixed!r}, train.cpu={cpu}: this process already trains with "
                         f"mixed precision {state.mixed_precision!r} on {state.device.type} (set by an earlier run "
                         f"in it), and accelerate keeps one state a process; run this config in a new process, or "
                         f"give it the same settings") from None


class StopSignals:
    """Ctrl-C (SIGINT) or a job scheduler's notice (SIGTERM) while training: the run ends with a
    checkpoint, as at train.max_minutes, rather than losing the steps since the last one: after
    the step it is in, or with several processes at the next logging step, where they agree (a
    scheduler's grace must cover train.log_every steps then). A second signal stops at once.

    One within a second of the first is the same one twice: a launcher (torchrun, accelerate
    launch) passes the terminal's Ctrl-C on to its workers, which had it from the terminal too.
    A signal the process ignores (Ctrl-C in a shell script's background job) stays ignored, and
    outside the main thread (where Python delivers no signals) nothing changes. The handlers in
    place before are restored afterwards."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    REPEAT_S = 1.0

    def __init__(self, announce: bool, when: str):
        self.announce, self.when, self.received, self.before, self.since = announce, when, 0, {}, 0.0

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self.before = {s: signal.signal(s, self._handle) for s in self.SIGNALS
                           if signal.getsignal(s) is not signal.SIG_IGN}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.before.items():
            signal.signal(s, handler)
        self.before = {}

    def _handle(self, signum: int, frame) -> None:
        if not self.received:
            self.received, self.since = signum, time.monotonic()
            if self.announce:
                print(f"\n{signal.Signals(signum).name}: stopping with a checkpoint {self.when}; send it again "
                      "to stop at once", file=sys.stderr, flush=True)
        elif time.monotonic() - self.since >= self.REPEAT_S:
            self.__exit__()
            signal.raise_signal(signum)  # to the handler of before: KeyboardInterrupt, or the end


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool):
    """train.deterministic: PyTorch's deterministic algorithms for the run, so that it repeats bit
    for bit on a GPU, and a resumed run matches an uninterrupted one. Without them two runs part
    in the first step on an H200: the embedding's backward adds its rows with atomics, and masked
    attention's (memory-efficient SDPA) splits the keys and adds the parts with atomics. Strict
    (an op with no deterministic kernel raises, naming itself): the warn-only mode leaves SDPA as
    it is. The cost is SDPA's backward, one key block after another: on an H200 a step of LRA
    text's model (batch 32, 4096 tokens) takes 3.2x as long, of LRA ListOps' (2000 tokens) 2x, of
    the tiny config's (128) up to 1.4x (its 1,000 steps: 12 s). The process's setting is restored
    afterwards."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if enabled:
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def train(cfg: dict, resume: bool = True, progress: bool = True, stop_after: int | None = None,
          init_model=None) -> dict:
    """Train as the config says; returns a summary. `stop_after` ends early (as an interruption would);
    so does a signal (`StopSignals`), whose name the summary then holds under "signal".

    `init_model(config, train_split, device, resuming)` builds the model in place of a fresh
    one (finetuning starts from trained weights); when resuming, the checkpoint's weights follow.
    """
    check_config(cfg)
    with deterministic_algorithms(cfg["train"].get("deterministic", False)):
        return _train(cfg, resume, progress, stop_after, init_model)


def _train(cfg: dict, resume: bool, progress: bool, stop_after: int | None, init_model) -> dict:
    mcfg = model_config(cfg)  # checked, as the config was, before anything is written
    tc = cfg["train"]
    seed = cfg.get("seed", 0)
    out_dir = Path(cfg.get("out_dir") or f"runs/{cfg.get('name', 'run')}")
    accelerator = _accelerator(tc.get("mixed_precision") or "no", tc.get("cpu", False))
    main = accelerator.is_main_process
    if main:
        check_writable(out_dir, "out_dir").mkdir(parents=True, exist_ok=True)
        dump_config(cfg, out_dir / "config.yaml")

    torch.manual_seed(seed)  # weight initialization
    with accelerator.main_process_first():
        splits = data_mod.load_tensors(cfg["data"], mcfg.input_len)
    train_ids, train_labels = splits["train"]
    eval_ids, eval_labels = splits[data_mod.EVAL_SPLIT[cfg["data"]["task"]]]

    ckpt = latest_checkpoint(out_dir) if resume else None
    if init_model is None:
        model = LRAClassifier(mcfg)
        if tc.get("init_from") and ckpt is None:
            # e.g. a sparse model from trained dense weights: every weight but the masks, which are this config's
            load_weights(model, tc["init_from"], skip=("attn.mask", "qkv_scale"))
    else:
        model = init_model(mcfg, (train_ids, train_labels), accelerator.device, ckpt is not None)
    optimizer = torch.optim.AdamW(param_groups(model, tc), lr=float(tc["lr"]),
                                  betas=tuple(map(float, tc.get("betas", (0.9, 0.98)))), eps=float(tc.get("eps", 1e-9)),
                                  weight_decay=float(tc.get("weight_decay", 0.0)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tc))
    model, optimizer = accelerator.prepare(model, optimizer)

    start = 0
    if ckpt is not None:
        start = load_checkpoint(ckpt, model, optimizer, scheduler, accelerator)
        accelerator.print(f"resuming from {ckpt} (step {start})")
        if _comparable(load_config(ckpt / "run_config.yaml")) != _comparable(cfg):
            accelerator.print(f"warning: the config differs from the one {ckpt} was trained with "
                              "(pass --no-resume to start over)")
    metrics_path = out_dir / "metrics.jsonl"
    if main:
        if start:
            _truncate_metrics(metrics_path, start)
        elif metrics_path.exists():
            metrics_path.unlink()

    steps, bs = int(tc["steps"]), int(tc["batch_size"])
    if start >= steps:
        accelerator.print(f"{ckpt} is at step {start} and train.steps={steps}: nothing to train (raise train.steps to "
                          "go on, or pass --no-resume to start over)")
    world, rank = accelerator.num_processes, accelerator.process_index
    if bs % world:
        raise ValueError(f"train.batch_size {bs} is not divisible by the {world} processes")
    log_every, eval_every = int(tc.get("log_every", 10)), int(tc.get("eval_every", 0) or 0)
    ckpt_every = int(tc.get("checkpoint_every", 0) or 0)
    eval_bs = int(tc.get("eval_batch_size", bs))
    eval_batches = tc.get("eval_batches")
    grad_clip = tc.get("grad_clip")
    # A wall-clock budget for one part of a long run: it ends with a checkpoint and the next
    # part resumes from it. Checked at logging steps, with the signals, where every process agrees:
    # the most of 0 (go on), 1 (out of time) and a signal's number (2 or 15) over the processes. A
    # single process also stops on a signal at once, after the step it is in.
    deadline = time.time() + 60 * float(tc["max_minutes"]) if tc.get("max_minutes") else None
    # The ops serve inference; evaluation during training runs the same function as training.
    eval_impl = "masked" if mcfg.attention in ("sparse", *QUANTIZED) else None

    def log(record: dict):
        if main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def evaluate_now(step: int) -> dict:
        net = accelerator.unwrap_model(model)
        saved = net.config.sparse_impl
        if eval_impl:
            net.config.sparse_impl = eval_impl
        r = accuracy(model, eval_ids, eval_labels, eval_bs, accelerator, eval_batches)
        net.config.sparse_impl = saved
        log({"step": step, "eval_accuracy": r["accuracy"], "eval_loss": r["loss"], "eval_examples": r["examples"]})
        return r

    model.train()
    bar = tqdm(total=steps, initial=start, desc=cfg.get("name", "train"), disable=not (progress and main),
               dynamic_ncols=True)
    last_eval, window, loss, t0 = None, [], float("nan"), time.time()
    step, stop = start, 0
    with StopSignals(announce=main, when="after this step" if world == 1 else "at the next logging step") as signals:
        while step < steps:
            torch.manual_seed(step_seed(seed, step, rank))
            idx = batch_indices(step, len(train_labels), bs, seed)[rank::world]
            x, y = train_ids[idx].to(accelerator.device), train_labels[idx].to(accelerator.device)
            with accelerator.autocast():
                out = model(x, labels=y)
            accelerator.backward(out.loss)
            if grad_clip:
                accelerator.clip_grad_norm_(model.parameters(), float(grad_clip))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            # kept on the device: reading it every step would stall the GPU queue
            window.append(torch.stack([out.loss.detach().float(), (out.logits.argmax(-1) == y).float().mean()]))
            stop = 0
            if step % log_every == 0 and step < steps:
                out_of_time = deadline is not None and time.time() > deadline
                stop = _most_over_processes(accelerator, signals.received or int(out_of_time))
            elif world == 1 and step < steps:
                stop = signals.received  # one process agrees with itself at any step, without a sync
            if step % log_every == 0 or step == steps or stop:
                loss, acc = torch.stack(window).mean(0).tolist()
                log({"step": step, "loss": loss, "accuracy": acc, "lr": scheduler.get_last_lr()[0],
                     "elapsed_s": round(time.time() - t0, 3)})
                bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.3f}",
                                **({"eval": f"{last_eval:.3f}"} if last_eval is not None else {}))
                window = []
            if (eval_every and step % eval_every == 0) or step == steps:
                last_eval = evaluate_now(step)["accuracy"]
                bar.set_postfix(loss=f"{loss:.3f}", eval=f"{last_eval:.3f}")
            if (ckpt_every and step % ckpt_every == 0) or step == steps or stop:
                accelerator.wait_for_everyone()
                if main:
                    save_checkpoint(out_dir, step, model, optimizer, scheduler, accelerator, cfg,
                                    tc.get("keep_checkpoints"))
                accelerator.wait_for_everyone()
            bar.update(1)
            if stop:
                why = (f"{signal.Signals(stop).name} received" if stop > 1 else
                       f"train.max_minutes={tc['max_minutes']} reached")
                accelerator.print(f"stopping at step {step}: {why}; run the same command again to resume")
                break
            if stop_after is not None and step >= stop_after:
                break
    bar.close()
    return {"out_dir": str(out_dir), "step": step, "eval_accuracy": last_eval,
            "checkpoint": str(latest_checkpoint(out_dir)), "seconds": round(time.time() - t0, 2),
            "signal": signal.Signals(stop).name if stop > 1 else None}
