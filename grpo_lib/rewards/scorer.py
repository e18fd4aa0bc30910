"""Score a step's responses with weighted reward functions: the trainer's one call per step.

    scorer = RewardScorer(functions=[{"name": "accuracy", "weight": 1.0}, {"name": "format", "weight": 0.1}])
    out = scorer.score(responses=["... #### 7"], data_sources=["openai/gsm8k"], ground_truths=["8"],
                       extra_infos=[None])
    out.scores == [0.1]; out.per_function == {"accuracy": [0.0], "format": [1.0]}
    scorer.close()

`functions`: a list of {"name": ..., "weight": ...} (weight optional, 1.0). Names (`FUNCTION_NAMES`):
- `accuracy`: `compute_score` by data_source; with `custom_path` set, the custom function instead (verl's
  custom_reward_function replaces the default reward the same way).
- `format`: `format_score` (1.0 if the final answer is in the format the prompt asks for).
- `custom`: the custom function, explicitly (needs `custom_path`).
- `reward_model`, `judge` (`names.MODEL_REWARD_FUNCTIONS`): learned scorers; listed here for their weight only: the
  trainer scores them and adds weight x score (grpo_lib/trainer/step.py `reward_output`). With `rule_sources` given (a
  model scorer on), a response whose data_source is not in it gets no rule call: its rule functions score 0 and count
  no error (the models alone score it).

A function may return a float or a dict with `score` plus extra fields; extra fields land in
`RewardOutput.extra[field]` (one entry per response, None where absent); if two functions return the same
field, that batch keys it `"<function>/<field>"` for both. A call that raises, returns no usable number
(NaN, no `score`), or passes `timeout_s` scores 0 and is counted; `score` never raises for one response.
With `num_workers=0` everything runs in this process: no pool start-up, but NO timeout enforcement
(a hanging reward hangs the trainer) -- meant for tests and debugging.

The custom file is imported here (so a bad file fails before the engine starts) and by every worker; each import may
take `import_timeout_s` seconds (reward.import_timeout_s), after which the constructor raises an ImportError naming the
file (the trainer exits 2). The workers are started, and their imports waited for, in the constructor.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field

from grpo_lib.core import names
from grpo_lib.rewards.custom import load_custom_reward
from grpo_lib.rewards.gsm8k import GSM8K_MODES
from grpo_lib.rewards.pool import TimeoutPool, WorkerStartError, call_safely
from grpo_lib.rewards.registry import compute_score, format_score, registered_sources

logger = logging.getLogger(__name__)

FUNCTION_NAMES = names.REWARD_FUNCTIONS  # accuracy, format, custom (torch-free, for config validation)
DEFAULT_WEIGHT = 1.0  # a function listed without a weight (the config documents the weight as optional)
_MAX_ERROR_SAMPLES = 5


@dataclass
class RewardOutput:
    """Rewards of one batch of responses; every list has one entry per response."""

    scores: list[float]  # weighted sum over functions, the reward the advantages use
    per_function: dict[str, list[float]]  # raw (unweighted) score of each function, for reward/<name>/mean
    extra: dict[str, list]  # extra fields of dict returns, keyed by field
    num_errors: int  # calls that raised or returned no usable score (each scored 0)
    num_timeouts: int  # calls stopped at timeout_s (each scored 0)
    error_samples: list[str] = field(default_factory=list)  # up to 5 messages, for the log
    num_failed_responses: int = 0  # responses with at least one errored or timed-out call (reward.max_error_fraction)
    model_metrics: dict[str, float] = field(default_factory=dict)  # the model scorers' counters (local sums), added by the trainer


def _as_score(value) -> tuple[float, dict]:
    """float | dict -> (score, extra fields); raises on anything without a finite number."""
    extra = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward returned a dict without 'score' (keys: {sorted(value)})")
        extra = {key: item for key, item in value.items() if key != "score"}
        value = value["score"]
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"reward returned a non-finite score {score}")
    return score, extra


def _normalized(function, **kwargs) -> tuple[float, dict]:
    return _as_score(function(**kwargs))


def build_functions(custom_path: str | None, custom_name: str, gsm8k_mode: str, import_timeout_s: float | None = None) -> dict:
    """{name: callable(data_source, solution_str, ground_truth, extra_info) -> (score, extra)}.

    Module-level so pool workers can build their own copy (and import the custom file themselves, within
    `import_timeout_s` seconds).
    """
    builtin_accuracy = functools.partial(compute_score, gsm8k_mode=gsm8k_mode)
    functions = {"format": functools.partial(_normalized, format_score)}
    if custom_path is not None:
        custom = load_custom_reward(custom_path, custom_name, import_timeout_s=import_timeout_s)
        functions["custom"] = functools.partial(_normalized, custom)
        functions["accuracy"] = functions["custom"]
    else:
        functions["accuracy"] = functools.partial(_normalized, builtin_accuracy)
    return functions


class RewardScorer:
    """Owns the worker pool; `score` once per step, `close` at the end (or use as a context manager)."""

    @classmethod
    def from_config(cls, cfg) -> RewardScorer:
        """The run's scorer, from the `reward:` section (raises as the constructor does)."""
        r = cfg.reward
        models_on = any(fn.get("name") in names.MODEL_REWARD_FUNCTIONS for fn in r.functions if isinstance(fn, dict))
        rule_sources = set(registered_sources()) if models_on and r.custom.path is None else None
        return cls(functions=r.functions, custom_path=r.custom.path, custom_name=r.custom.name, gsm8k_mode=r.gsm8k.mode,
                   timeout_s=r.timeout_s, num_workers=r.num_workers, import_timeout_s=r.import_timeout_s,
                   rule_sources=rule_sources)

    def __init__(self, *, functions: list[dict], custom_path: str | None = None, custom_name: str = "compute_score",
                 gsm8k_mode: str = "strict", timeout_s: float = 10.0, num_workers: int = 2, import_timeout_s: float = 120.0,
                 rule_sources: set[str] | None = None):
        problems = []
        if not functions:
            problems.append(f"functions is empty; give at least one of {list(FUNCTION_NAMES)}")
        listed = [spec.get("name") if isinstance(spec, dict) else None for spec in functions]
        for spec in functions:
            if not isinstance(spec, dict) or "name" not in spec or set(spec) - {"name", "weight"}:
                problems.append(f"each function is {{'name': str, 'weight': float (default 1.0)}}, got {spec!r}")
            elif spec["name"] not in FUNCTION_NAMES:
                problems.append(f"unknown reward function {spec['name']!r}; valid names: {list(FUNCTION_NAMES)}")
            elif isinstance(weight := spec.get("weight", DEFAULT_WEIGHT), bool) \
                    or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                problems.append(f"weight of {spec['name']!r} must be a finite number, got {weight!r}")
        duplicates = sorted({name for name in listed if listed.count(name) > 1})
        if duplicates:
            problems.append(f"reward functions listed more than once: {duplicates}")
        if "custom" in listed and custom_path is None:
            problems.append("reward function 'custom' needs custom_path (a Python file defining custom_name)")
        if gsm8k_mode not in GSM8K_MODES:
            problems.append(f"gsm8k_mode must be one of {list(GSM8K_MODES)}, got {gsm8k_mode!r}")
        if not timeout_s > 0:
            problems.append(f"timeout_s must be > 0 seconds, got {timeout_s}")
        if not import_timeout_s > 0:
            problems.append(f"import_timeout_s must be > 0 seconds, got {import_timeout_s}")
        if num_workers < 0:
            problems.append(f"num_workers must be >= 0 (0 = in-process, no timeouts), got {num_workers}")
        if problems:
            raise ValueError("invalid reward config:\n  " + "\n  ".join(problems))
        self.last_error_samples: list[str] = []
        self.weights = {spec["name"]: float(spec.get("weight", DEFAULT_WEIGHT)) for spec in functions}
        self.rule_names = [name for name in self.weights if name not in names.MODEL_REWARD_FUNCTIONS]  # the workers' calls
        self.rule_sources = rule_sources  # None: every response has its rules
        self.models: dict = {}  # name -> learned scorer (`score(batch)`), attached by the trainer (train_grpo.py's setup)
        factory_args = (custom_path, custom_name, gsm8k_mode, import_timeout_s)
        self._local_functions = build_functions(*factory_args)  # fails fast on a bad custom file
        self._pool = None
        if num_workers > 0:
            self._pool = TimeoutPool(num_workers=num_workers, timeout_s=timeout_s, factory=build_functions,
                                     factory_args=factory_args, import_timeout_s=import_timeout_s)
            try:
                self._pool.start()  # each worker imports the custom file too: bounded, reported here, not mid-run
            except WorkerStartError as error:
                where = f"custom reward file {custom_path}: " if custom_path else ""
                raise ImportError(f"{where}{error}; reward.import_timeout_s={import_timeout_s} s bounds each import "
                                  "(reward.num_workers=0 scores in the trainer alone)") from None

    def score(self, *, responses: list[str], data_sources: list[str], ground_truths: list,
              extra_infos: list[dict | None]) -> RewardOutput:
        """Score every response with every function; see the module docstring for failure handling."""
        num_responses = len(responses)
        lengths = {"data_sources": len(data_sources), "ground_truths": len(ground_truths),
                   "extra_infos": len(extra_infos)}
        assert all(n == num_responses for n in lengths.values()), \
            f"score() lists must all have len(responses)={num_responses}, got {lengths}"
        if self._pool is not None:
            with self.stream() as stream:
                return stream.finish(responses=responses, data_sources=data_sources, ground_truths=ground_truths,
                                     extra_infos=extra_infos)
        names = self.rule_names
        calls = [call for index in range(num_responses)
                 for call in self._calls(index, names, response=responses[index], data_source=data_sources[index],
                                         ground_truth=ground_truths[index], extra_info=extra_infos[index])]
        results = {call_id: call_safely(self._local_functions[name], kwargs) for call_id, name, kwargs in calls}
        return self._collect(results, names, num_responses)

    def stream(self) -> RewardStream | None:
        """A batch whose responses are added as they finish generating, scored by the workers meanwhile
        (`RewardStream`); None with num_workers=0 (the trainer's own thread would score them: nothing to overlap)."""
        return None if self._pool is None else RewardStream(self, self._pool.open_batch())

    def _calls(self, index: int, names: list[str], *, response: str, data_source: str, ground_truth, extra_info) -> list:
        """The calls of response `index`: one per function, call id index * len(names) + position; none for a response
        whose data_source has no rule (`rule_sources`)."""
        if self.rule_sources is not None and data_source not in self.rule_sources:
            return []
        kwargs = dict(data_source=data_source, solution_str=response, ground_truth=ground_truth, extra_info=extra_info)
        return [(index * len(names) + position, name, kwargs) for position, name in enumerate(names)]

    def _collect(self, results: dict, names: list[str], num_responses: int) -> RewardOutput:
        per_function = {name: [0.0] * num_responses for name in names}
        extras_by_function: dict[str, dict[str, list]] = {name: {} for name in names}
        num_errors = num_timeouts = 0
        samples, failed = [], set()
        for index in range(num_responses):
            for position, name in enumerate(names):
                if (call_id := index * len(names) + position) not in results:
                    continue  # no rule for this response's data_source: 0, not an error
                status, value, message = results[call_id]
                if status != "ok":
                    failed.add(index)
                if status == "ok":
                    per_function[name][index] = value[0]
                    for key, item in value[1].items():
                        extras_by_function[name].setdefault(key, [None] * num_responses)[index] = item
                    continue
                num_timeouts += status == "timeout"
                num_errors += status == "error"
                if len(samples) < _MAX_ERROR_SAMPLES:
                    samples.append(f"{name} on response {index}: {status}: {message}")
        extra = {}
        field_owners: dict[str, list[str]] = {}
        for name, fields in extras_by_function.items():
            for key in fields:
                field_owners.setdefault(key, []).append(name)
        for name, fields in extras_by_function.items():
            for key, values in fields.items():
                extra[key if len(field_owners[key]) == 1 else f"{name}/{key}"] = values
        scores = [sum(self.weights[name] * per_function[name][i] for name in names) for i in range(num_responses)]
        self.last_error_samples = samples  # the latest failures, quoted when the trainer stops the run
        if samples:
            logger.warning("reward: %d errors, %d timeouts; first: %s", num_errors, num_timeouts, samples[0])
        return RewardOutput(scores=scores, per_function=per_function, extra=extra, num_errors=num_errors,
                            num_timeouts=num_timeouts, error_samples=samples, num_failed_responses=len(failed))

    def close(self):
        """Stop the worker pool (idempotent)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


class RewardStream:
    """One batch of responses scored while the engine still generates the rest (`RewardScorer.stream`).

        stream = scorer.stream()
        stream.add(5, response="... #### 7", data_source="openai/gsm8k", ground_truth="7", extra_info=None)
        stream.poll()                        # between engine steps: hand out calls, read results; never waits
        out = stream.finish(responses=..., data_sources=..., ground_truths=..., extra_infos=...)  # the whole batch

    `finish` adds every response not added yet, waits for the rest and returns the RewardOutput that
    `RewardScorer.score` returns for the same lists: same values, same order, same counts (the calls are the same,
    only handed out earlier). A response added with another text than the one `finish` gets for its index is a bug
    of the caller (AssertionError). Use as a context manager: leaving it on an exception before `finish` cancels
    the batch (the workers still running its calls are killed, so nothing stale reaches the next batch).
    """

    def __init__(self, scorer: RewardScorer, batch):
        self._scorer, self._batch = scorer, batch
        self._names = scorer.rule_names
        self._added: dict[int, str] = {}  # response index -> the text scored
        self.done = False

    def add(self, index: int, *, response: str, data_source: str, ground_truth, extra_info) -> None:
        """Score response `index` of the batch (its position in finish's lists) from now on."""
        assert index not in self._added, f"RewardStream: response {index} added twice"
        self._added[index] = response
        self._batch.add(self._scorer._calls(index, self._names, response=response, data_source=data_source,
                                            ground_truth=ground_truth, extra_info=extra_info))

    def poll(self) -> None:
        self._batch.poll()

    @property
    def num_added(self) -> int:
        return len(self._added)

    def finish(self, *, responses: list[str], data_sources: list[str], ground_truths: list,
               extra_infos: list[dict | None]) -> RewardOutput:
        """Add what is missing, wait for every call, and collect (RewardScorer.score's output for these lists)."""
        num_responses = len(responses)
        lengths = {"data_sources": len(data_sources), "ground_truths": len(ground_truths), "extra_infos": len(extra_infos)}
        assert all(n == num_responses for n in lengths.values()), \
            f"finish() lists must all have len(responses)={num_responses}, got {lengths}"
        stray = [i for i in self._added if not 0 <= i < num_responses or self._added[i] != responses[i]]
        assert not stray, f"RewardStream: responses {stray[:5]} were added with another text (or index) than finish() got"
        for index in range(num_responses):
            if index not in self._added:
                self.add(index, response=responses[index], data_source=data_sources[index],
                         ground_truth=ground_truths[index], extra_info=extra_infos[index])
        results = self._batch.drain()
        self.done = True
        return self._scorer._collect(results, self._names, num_responses)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc_info):
        if not self.done:
            self._batch.cancel()
            self.done = True
