"""One-step-off on split GPUs (`rollout.n_gpus_per_node` = E > 0): in one `accelerate launch` of W processes the last E
run one engine (its tensor-parallel group) and the first W - E train with FSDP2 (grpo_lib/core/bridge.py makes the
groups). The engine generates step k+1's rollouts with the weights of step k-1 while the trainer updates on step k.

The trainer drives; the engine answers messages in the order they come (`engine_main`):

    trainer process 0 -> engine             engine -> trainer process 0
    ("go", step, prompt rows)              the step's generations (every sample of every row), their weight version
    ("weights", version) + the buckets     -
    ("score", sequences)                   their logprobs (the weight probe, after every push)
    ("generate", requests)                 their generations (validation, remax's baseline: generate's arguments)
    ("stop",)                              - (the engine exits 0)

A step k of the trainer (`OneStepOff`): train on batch k (in hand) -> receive batch k+1 (generated meanwhile) -> push
the weights as version k and score the probe -> log / validate / checkpoint (holding batch k+1) -> send go(k+2).
Each side sends in the order the other receives, so neither waits on a send the other never matches (the update /
push deadlock of one-step-off trainers). Batch k+1 comes from version k-1 (batch 1 and 2 from version 0): one version
stale, its tokens reweighted by the decoupled loss (actor.use_decoupled_loss); its version is checked on arrival.

The prompts of batch k are drawn from the trainer's sampler when go(k) is sent: a checkpoint of step k holds batch
k+1 (grpo_lib/checkpoints/checkpoint.py carry/) and the sampler's position after drawing it, so a resume continues
exactly as the run that was not stopped. The engine holds no state but its weights (pushed at start on a resume).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict

import torch

from grpo_lib.core.bridge import BridgeError
from grpo_lib.core.distributed import all_gather_object, broadcast_object
from grpo_lib.core.seeds import sample_seed
from grpo_lib.core.types import Generation, PromptBatch, ScoreRequest
from grpo_lib.trainer.rounds import GroupFilter, RoundStats, rollout_metrics, round_batch, score_round, train_sampling
from grpo_lib.trainer.step import RunAborted


# ------------------------------------------------------------------------------------------------ the engine side
def engine_main(cfg, bridge, *, world_size: int, rank: int) -> int:
    """The engine processes' run: build the engine, answer the trainer's messages until "stop"; returns the exit
    code. Engine process 0 talks to the trainer; the others follow it (every message broadcast over the engine group)."""
    import signal

    from grpo_lib.core.dtypes import resolve as resolve_dtype
    from grpo_lib.rollout.engines import build_engine

    # A stop (SIGTERM / SIGINT, which a launcher sends every process) is the trainer's to act on: it finishes its step
    # with this engine's batch and push, saves, and sends "stop". The engine exits on that, or when the trainer is gone.
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, signal.SIG_IGN)
    on_cpu = not torch.cuda.is_available()
    engine = build_engine(cfg, on_cpu=on_cpu, world_size=world_size)
    dtype = getattr(torch, resolve_dtype(cfg.rollout.dtype, on_gpu=not on_cpu))
    print(f"engine process {rank}: ready ({cfg.rollout.name}, {world_size} process(es))", file=sys.stderr, flush=True)
    idle_since = time.perf_counter()  # the engine's idle time: from its last answer to the next go
    while True:
        message = broadcast_object(bridge.recv() if rank == 0 else None)
        kind = message[0]
        if kind == "stop":
            return 0
        if kind == "weights":
            weights = _engine_weights(bridge, rank=rank, dtype=dtype)
            engine.push_weights(weights)
            engine.reset_prefix_cache()
            engine.weight_version = message[1]
        elif kind == "score":
            scores = engine.score_logprobs(message[1])
            if rank == 0:
                bridge.send(scores)
        elif kind == "generate":
            out = engine.generate(**message[1])
            if rank == 0:
                bridge.send(out)
        elif kind == "go":
            _, step, prompt_ids = message
            start = time.perf_counter()
            idle = start - idle_since
            sampling = train_sampling(cfg)
            seeds = [sample_seed(cfg.trainer.seed, purpose="train", step=step, round=1, prompt_index=i, n=sampling["n"])
                     for i in range(len(prompt_ids))]
            out = engine.generate(prompt_ids, seeds=seeds, **sampling)
            if rank == 0:
                bridge.send({"step": step, "generations": out, "version": engine.weight_version,
                             "preemptions": engine.pop_metrics("rollout/")["rollout/preemptions"],
                             "gen_s": time.perf_counter() - start, "idle_s": idle})
            idle_since = time.perf_counter()
        else:
            raise RuntimeError(f"engine: unknown message {kind!r} from the trainer")


def _engine_weights(bridge, *, rank: int, dtype):
    """The pushed (name, tensor) pairs on every engine process: process 0 receives them from the trainer and, with
    more engine processes (its tensor-parallel group), hands each one on over the engine group."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        yield from bridge.recv_weights(dtype=dtype)
        return
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    pairs = iter(bridge.recv_weights(dtype=dtype)) if rank == 0 else None
    while True:
        pair = next(pairs, None) if rank == 0 else None
        head = broadcast_object(None if pair is None else (pair[0], tuple(pair[1].shape)))
        if head is None:
            return
        tensor = pair[1].contiguous() if rank == 0 else torch.empty(head[1], dtype=dtype, device=device)
        dist.broadcast(tensor, src=0)
        yield head[0], tensor


# ------------------------------------------------------------------------------------------------ the trainer side
def leader(rank: int, fn):
    """`fn()` on trainer process 0 (its talk with the engine), the result on every trainer process. The engine gone
    (BridgeError on process 0) is RunAborted (exit 3) on every trainer process alike: the last completed step is saved
    and the run stops, instead of waiting for an engine that will never answer; no trainer process is left waiting in a
    collective the others skipped."""
    from grpo_lib.core.bridge import BridgeError

    box, failure = None, None
    if rank == 0:
        try:
            box = ("ok", fn())
        except BridgeError as exc:
            box = ("gone", str(exc))
        except Exception as exc:  # noqa: BLE001 - the others must not wait for an answer that never comes
            box, failure = ("failed", f"{type(exc).__name__}: {exc}"), exc
    box = broadcast_object(box)
    if box[0] == "gone":
        raise RunAborted(f"one-step-off: {box[1]}", exit_code=3)
    if box[0] == "failed":
        raise failure or RuntimeError(f"trainer process 0 failed talking to the engine: {box[1]}")
    return box[1]


class RemoteEngine:
    """The engine seen from the trainer processes: the RolloutEngine calls the step and validation make, as messages to
    the engine processes (trainer process 0 sends; every trainer process gets the answer). Nothing to release: the
    engine has its own GPUs."""

    def __init__(self, cfg, bridge, *, pad_id: int, world_size: int, rank: int):
        from grpo_lib.core.dtypes import resolve as resolve_dtype

        self.cfg, self.bridge, self.pad_id = cfg, bridge, pad_id
        self.world_size, self.rank = world_size, rank
        self.dtype = getattr(torch, resolve_dtype(cfg.rollout.dtype, on_gpu=torch.cuda.is_available()))  # the pushed weights
        self.weight_version = 0
        self.metrics: dict[str, float] = {}
        self.before_ask = lambda: None  # OneStepOff.drain: the batches asked for earlier come back first
        self.owed = lambda: 0  # OneStepOff: batches asked for and not received yet
        self.stopped = False
        self.collective = True  # every trainer process calls generate, with or without prompts (rounds.generate_share)

    def _ask(self, message):
        """`message` to the engine, its answer on every trainer process."""
        self.before_ask()

        def ask():
            self.bridge.send(message)
            return self.bridge.recv()
        return leader(self.rank, ask)

    # lifecycle: the engine's memory is its own
    def release(self) -> None:
        pass

    def prepare_for_generation(self, weights=None, *, free_trainer_memory=None, version: int | None = None) -> None:
        """Push `weights` (every trainer process gathers them, process 0 streams them) as `version`."""
        if weights is not None:
            self.push_weights(weights, version=version)
        if free_trainer_memory is not None:
            free_trainer_memory()

    def push_weights(self, named_tensors, *, version: int | None = None) -> None:
        self.before_ask()
        gone = None
        if self.rank == 0:
            named = iter(named_tensors)
            try:
                self.bridge.send(("weights", version))
                self.bridge.send_weights(named, bucket_bytes=self.cfg.rollout.update_weights_bucket_megabytes * 2**20,
                                         dtype=self.dtype)
            except BridgeError as exc:
                gone = str(exc)
                for _ in named:  # the other trainer processes' FSDP2 gathers go on: take part in them
                    pass
        else:
            for _ in named_tensors:  # the FSDP2 gathers are collectives: every trainer process takes part
                pass
        gone = broadcast_object(gone)
        if gone is not None:
            raise RunAborted(f"one-step-off: {gone}", exit_code=3)
        if version is not None:
            self.weight_version = version

    def score_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        return self._ask(("score", sequences))

    def generate(self, prompt_ids, *, on_finished=None, score: ScoreRequest | None = None, **kwargs) -> list[list[Generation]]:
        """Every trainer process's requests in one engine call (gathered on process 0, answered to each its part);
        `on_finished` hears of them all at the end, `score` is scored after (generate's contract, not its timing)."""
        mine = {"prompt_ids": [list(p) for p in prompt_ids], **kwargs}
        everyone = all_gather_object(mine)
        merged = {k: v for k, v in mine.items() if k not in ("prompt_ids", "seeds", "max_tokens")}
        merged["prompt_ids"] = [p for r in everyone for p in r["prompt_ids"]]
        if kwargs.get("seeds") is not None:
            merged["seeds"] = [s for r in everyone for s in r["seeds"]]
        limits = [r["max_tokens"] if isinstance(r["max_tokens"], list) else [r["max_tokens"]] * len(r["prompt_ids"]) for r in everyone]
        merged["max_tokens"] = [m for part in limits for m in part]
        out = self._ask(("generate", merged))
        start = sum(len(r["prompt_ids"]) for r in everyone[:self.rank])
        result = out[start:start + len(prompt_ids)]
        if on_finished is not None:
            on_finished([(i, k, g) for i, group in enumerate(result) for k, g in enumerate(group)])
        if score is not None:
            score.fill(self.score_logprobs(score.sequences), weight_version=self.weight_version)
        return result

    def pop_metrics(self, prefix: str = "") -> dict[str, float]:
        counters = {"rollout/preemptions": 0.0, **self.metrics}
        self.metrics = {}
        return {k: v for k, v in counters.items() if k.startswith(prefix)}

    def stop(self) -> None:
        """The engine processes exit (once; every way out of the trainer's run, also after a failure): on trainer
        process 0 alone, no collective (another trainer process may be gone): the batches the engine still owes are
        received, then "stop"; an engine gone already is no error here."""
        if self.stopped or self.rank != 0:
            return
        self.stopped = self.bridge.stopped = True  # launch's last word to the engine is said
        try:
            for _ in range(self.owed()):
                self.bridge.recv()
            self.bridge.send(("stop",))
        except BridgeError:
            pass


class OneStepOff:
    """The trainer's side of the pipeline (module docstring): the go messages sent, the batches received, the checks.
    Every trainer process keeps the same state (the batches are broadcast from process 0). The trainer's pipeline
    interface (grpo_lib/trainer/pipelines.py): collect, before_push, step_done, abort, sampler_to_save, state, close."""

    pool = None  # no carry-over pool: `collect` hands the step its batch
    proves_every_push = True  # no generate call of the trainer's carries the weight probe: it is scored after the push

    def __init__(self, cfg, engine: RemoteEngine, dataset, sampler, *, world_size: int, rank: int, total_steps: int):
        self.cfg, self.engine, self.dataset, self.sampler = cfg, engine, dataset, sampler
        self.world_size, self.rank, self.total_steps = world_size, rank, total_steps
        self.sent: list[dict] = []  # {"step", "rows"} of the go messages whose batch is not received yet, in order
        self.received: dict[int, dict] = {}  # step -> {"step", "rows", "sampler", "payload"}: batches not trained yet
        self.current: dict | None = None  # the batch of the step being trained (back in hand if the step is aborted)
        self.waited_s = 0.0  # seconds this process waited for the engine (idle), since the last `pop_waited`
        engine.before_ask = self.drain  # an answer to another message comes after the batches asked for before it
        engine.owed = lambda: len(self.sent)

    def start(self, step: int, saved: dict | None) -> None:
        """Before step `step` + 1 (the resumed step, 0 fresh): the batches of the checkpoint (`state`), and go for
        step + 1 unless it holds that one."""
        for entry in (saved or {}).get("entries", []):
            version = entry["payload"]["version"] if entry["payload"] is not None else None
            if version is None or not max(0, entry["step"] - 2) <= version <= entry["step"] - 1:
                # the wrong version when it came (or saved before that was found): asked for again, the same prompts
                self.send_go({k: entry[k] for k in ("step", "rows", "sampler_before", "sampler")})
            else:
                self.received[entry["step"]] = _restore(entry)
        self.ensure(step + 1)

    def ensure(self, step: int) -> None:
        """Go for `step` unless it was asked for already (or lies past the last step): its prompts drawn now."""
        if step > self.total_steps or step in self.received or any(e["step"] == step for e in self.sent):
            return
        before = self.sampler.state_dict()
        rows = self.sampler.next_batch()
        self.send_go({"step": step, "rows": rows, "sampler_before": before, "sampler": self.sampler.state_dict()})

    def send_go(self, entry: dict) -> None:
        """The go of `entry` (its step and prompt rows) to the engine; the entry waits in `sent` for its batch."""
        rows = entry["rows"]
        leader(self.rank, lambda: self.engine.bridge.send(("go", entry["step"], [self.dataset.prompt_ids[i] for i in rows])))
        self.sent.append(entry)

    def receive(self) -> None:
        """The batch of the oldest go, from the engine (it generated it while the trainer worked)."""
        entry = self.sent[0]
        start = time.perf_counter()
        payload = leader(self.rank, lambda: self.engine.bridge.recv())  # the bridge exists on trainer process 0 only
        self.sent.pop(0)  # only now: a batch that never came is asked for again on resume (`state`)
        self.waited_s += time.perf_counter() - start
        assert payload["step"] == entry["step"], f"the engine answered step {payload['step']} for step {entry['step']}"
        self.received[entry["step"]] = {**entry, "payload": payload}

    def drain(self) -> None:
        """Every batch asked for, received (before a push or any other question to the engine)."""
        while self.sent:
            self.receive()

    def collect(self, step: int, scorer, timings: dict) -> tuple:
        """Step `step`'s batch for this trainer process (its strided share of the rows, scored) and the rollout metrics,
        as rounds.collect_rollouts returns them. Once it is here the next step's is asked for (generated while this one
        trains): the trainer sends nothing while a batch is on its way, the rule that keeps the two sides from both
        sending at once.
        Its weight version must be step - 2 or step - 1 (0 at the start): one-step-off's staleness, never more."""
        self.ensure(step)
        while step not in self.received:
            self.receive()
        self.ensure(step + 1)  # only now: the engine sends nothing while it waits for this (no send meets a send)
        entry = self.current = self.received.pop(step)
        payload = entry["payload"]
        if not max(0, step - 2) <= payload["version"] <= step - 1:
            self.current = {**entry, "payload": None}  # not trained, not kept: asked for again on resume
            raise RunAborted(f"step {step}: the engine generated with weight version {payload['version']}; one-step-off "
                             f"trains step {step} on version {max(0, step - 2)} or {step - 1}: a push did not take; the "
                             "last completed step is saved")
        mine = list(range(self.rank, len(entry["rows"]), self.world_size))  # strided share, as colocated
        prompts: PromptBatch = self.dataset.batch([entry["rows"][i] for i in mine])
        generations = [[_generation(g, payload["version"]) for g in payload["generations"][i]] for i in mine]
        batch = round_batch(self.cfg, prompts, generations, pad_id=self.engine.pad_id, version=step - 1)  # this step's weights
        stats = RoundStats(sums={"rollout/preemptions": payload["preemptions"] if self.rank == 0 else 0.0})
        score_round(self.cfg, scorer, batch, stats, timings=timings)
        groups = GroupFilter(self.cfg, world_size=self.world_size)
        groups.add(batch)
        metrics = rollout_metrics(stats, groups, step=step)
        metrics["timing_s/engine_gen"] = float(payload["gen_s"])  # the engine process's generation of this batch
        metrics["timing_s/engine_idle"] = float(payload["idle_s"])  # ... and its wait for the go before it (pushes included)
        metrics["rollout/staleness_max"] = float(step - 1 - payload["version"])
        return batch, metrics

    def before_push(self) -> dict[str, float]:
        """The next step's batch, generated during this update, comes first; the wait and overlap metrics."""
        self.drain()
        return self.pop_waited()

    def abort(self, sampler_before: dict) -> tuple[dict, dict]:
        """The aborted step's batch back in hand (or, of the wrong version, asked for again on resume), and the
        sampler after its draw; `sampler_before` is not needed (the batch keeps its own)."""
        self.restore_current()
        state = self.state()
        return state, state["sampler"]

    def sampler_to_save(self, sampler) -> dict:
        """The sampler position beside `state()`: after the last batch received (a draw whose batch never came is drawn
        again on resume)."""
        if self.received:
            return self.received[max(self.received)]["sampler"]
        return self.sent[0]["sampler_before"] if self.sent else sampler.state_dict()

    def close(self) -> None:
        self.engine.stop()

    def pop_waited(self) -> dict[str, float]:
        """The trainer's wait for the engine since the last call (timing_s/wait_engine) and the share of the engine's
        generation of the step's next batch hidden behind the trainer's work (timing_s/overlap_share, a share: 1 - wait / generation)."""
        waited, self.waited_s = self.waited_s, 0.0
        nxt = self.received.get(max(self.received)) if self.received else None
        gen = float(nxt["payload"]["gen_s"]) if nxt is not None else 0.0
        return {"timing_s/wait_engine": waited, "timing_s/overlap_share": max(0.0, 1.0 - waited / gen) if gen > 0 else 0.0}

    def restore_current(self) -> None:
        """The batch of a step that was aborted back in hand (a checkpoint of the step before holds it; one of the
        wrong version without its payload: asked for again on resume)."""
        if self.current is not None:
            self.received[self.current["step"]] = self.current
            self.current = None

    def step_done(self) -> None:
        """The step's batch is trained: nothing to give back any more."""
        self.current = None

    def state(self) -> dict:
        """What a checkpoint holds: the batches received and not trained yet (the next step's, after a completed step)
        and the sampler's position right after the last of them was drawn (a go sent after it is asked again)."""
        entries = []
        for entry in sorted(self.received.values(), key=lambda e: e["step"]):
            payload = None
            if entry["payload"] is not None:
                payload = dict(entry["payload"])
                payload["generations"] = [[asdict(g) for g in group] for group in payload["generations"]]
            entries.append({"step": entry["step"], "rows": entry["rows"], "sampler_before": entry["sampler_before"],
                            "sampler": entry["sampler"], "payload": payload})
        return {"split": 1, "entries": entries, "sampler": self.sampler_to_save(self.sampler)}


def _restore(saved: dict) -> dict:
    payload = dict(saved["payload"])
    payload["generations"] = [[Generation(**g) for g in group] for group in payload["generations"]]
    return {"step": saved["step"], "rows": saved["rows"], "sampler_before": saved["sampler_before"],
            "sampler": saved["sampler"], "payload": payload}


def _generation(g: Generation, version: int) -> Generation:
    """A received response, each token tagged with the version that generated it (the decoupled loss reads them)."""
    return Generation(token_ids=list(g.token_ids), logprobs=list(g.logprobs), text=g.text, finish_reason=g.finish_reason,
                      loss_mask=g.loss_mask, versions=[version] * len(g.token_ids))
