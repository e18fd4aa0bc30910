"""The models that score the policy's rollouts beside it, set up for a run: the distillation teacher (distillation.enabled,
grpo_lib/model/teacher.py), the reward model (reward_model.enable, grpo_lib/model/reward_model.py) and the generative judge
(judge.enable, grpo_lib/rollout/judge.py). `problems` runs before any weight loads (tokenizers, the fit on the GPU);
`build` loads them: the teacher is returned (the step scores with it), the reward model and the judge go to the rule
scorer (`RewardScorer.models`), whose every scoring call then adds their weighted scores (grpo_lib/trainer/step.py
`add_model_scores`)."""

from __future__ import annotations


def keeps_messages(cfg) -> bool:
    """The prompts' chat messages must be kept: the reward model re-renders responses as text, or the judge quotes them."""
    return (cfg.reward_model.enable and cfg.reward_model.model.input_tokenizer is not None) or cfg.judge.enable


def problems(cfg, tokenizer, *, world_size: int, gpu_bytes: float | None) -> list[str]:
    """Before anything loads: the teacher's and the reward model's tokenizers against the policy's, the judge's tokenizer,
    and their fit in the memory plan."""
    found = []
    if cfg.distillation.enabled:  # the teacher scores the student's token ids and must fit
        from grpo_lib.model.teacher import tokenizer_problem
        from grpo_lib.planning.beside import teacher_fit_problem

        if problem := tokenizer_problem(cfg, tokenizer) or teacher_fit_problem(cfg, world_size=world_size, gpu_bytes=gpu_bytes):
            return [problem]
    if cfg.judge.enable:  # the judge's tokenizer renders its prompts: loadable, with a chat template
        from transformers import AutoTokenizer

        try:
            judge_tokenizer = AutoTokenizer.from_pretrained(cfg.judge.model_path)
        except (OSError, ValueError) as exc:
            found.append(f"judge.model_path={cfg.judge.model_path!r}: cannot load a tokenizer from it ({exc}); point it at a "
                         "Hugging Face model folder or hub name")
        else:
            if not judge_tokenizer.chat_template:
                found.append(f"judge.model_path={cfg.judge.model_path!r}: its tokenizer has no chat template, so the judge "
                             "prompt cannot be rendered as a user message; use a chat (instruct) model")
    if cfg.reward_model.enable:
        from grpo_lib.model.reward_model import tokenizer_problem

        found += [p for p in (tokenizer_problem(cfg, tokenizer),) if p]
    if cfg.reward_model.enable or cfg.judge.enable:
        from grpo_lib.planning.beside import scorer_fit_problem

        found += [p for p in (scorer_fit_problem(cfg, world_size=world_size, gpu_bytes=gpu_bytes),) if p]
    return found


def build(cfg, scorer, *, device, tokenizer, on_cpu: bool):
    """Load the enabled models (every trainer process: the teacher and the reward model are sharded over them); the
    reward model and the judge into `scorer.models`; returns the teacher (None without distillation)."""
    teacher = None
    if cfg.distillation.enabled:  # sharded and offloaded like the reference
        from grpo_lib.model.teacher import Teacher

        teacher = Teacher(cfg, device=device)
    if cfg.reward_model.enable:
        from grpo_lib.model.reward_model import RewardModel

        scorer.models["reward_model"] = RewardModel(cfg, device=device, policy_tokenizer=tokenizer)
    if cfg.judge.enable:
        from grpo_lib.rollout.judge import Judge

        scorer.models["judge"] = Judge.from_config(cfg, on_cpu=on_cpu)
    return teacher
