"""verl's config spellings: aliases onto this trainer's keys, keys accepted and ignored (performance only), keys refused.

`grpo_lib.config.load` reads overrides through `_canonical` and checks the tables here; they are data, no dataclasses.
"""

from __future__ import annotations


# verl spelling -> ours (longest prefix first). Keys under actor_rollout_ref.* and a few renamed leaves.
ALIASES: dict[str, str] = {
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "actor.lr_warmup_steps",
    "actor_rollout_ref.actor.optim.weight_decay": "actor.weight_decay",
    "actor_rollout_ref.actor.optim.lr": "actor.lr",
    "actor_rollout_ref.actor.": "actor.",
    "actor_rollout_ref.rollout.": "rollout.",
    "actor_rollout_ref.model.": "model.",
    "actor_rollout_ref.ref.": "ref.",
    "actor.optim.lr_warmup_steps": "actor.lr_warmup_steps",
    "actor.optim.weight_decay": "actor.weight_decay",
    "actor.optim.lr": "actor.lr",
    "actor.optim.clip_grad": "actor.grad_clip",
    "trainer.log_val_generations": "trainer.val_generations_to_log",
    "custom_reward_function.": "reward.custom.",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    # DAPO's overlong shaping: verl's config key and its DAPO scripts' reward-manager kwargs
    "reward_model.overlong_buffer.": "reward.overlong_buffer.",
    "reward_model.reward_kwargs.overlong_buffer_cfg.": "reward.overlong_buffer.",
    "reward_model.reward_kwargs.max_resp_len": "reward.overlong_buffer.max_resp_len",
    # Earlier spelling of the old-logprob pass's knobs; verl names them under rollout.
    "actor.log_prob_micro_batch_size_per_gpu": "rollout.log_prob_micro_batch_size_per_gpu",
    "actor.log_prob_use_dynamic_bsz": "rollout.log_prob_use_dynamic_bsz",
    "actor.log_prob_max_token_len_per_gpu": "rollout.log_prob_max_token_len_per_gpu",
    "ref.param_offload": "ref.fsdp_config.param_offload",
    # verl nests vLLM's LLM(...) kwargs under the engine's name; here rollout.engine_kwargs is vLLM's (the only engine
    # that takes them)
    "rollout.engine_kwargs.vllm.": "rollout.engine_kwargs.",
    "rollout.engine_kwargs.vllm": "rollout.engine_kwargs",
    "actor.fsdp_config.mixed_precision.param_dtype": "actor.fsdp_config.param_dtype",
    "actor.fsdp_config.mixed_precision.reduce_dtype": "actor.fsdp_config.reduce_dtype",
}

# verl keys that select kernels, loaders or schedulers this trainer does not have. They never change the math, so
# they are accepted and listed once at start as ignored. key (or prefix ending in ".") -> (reason, values accepted;
# None: any). A value outside the accepted ones would change what is computed and is refused.
IGNORED: dict[str, tuple[str, tuple | None]] = {
    "model.use_liger": ("Liger kernels: the output head here is chunked instead (same logprobs, bounded memory)", None),
    "model.use_fused_kernels": ("fused logprob/entropy kernels: the chunked output head computes the same values", None),
    "model.fused_kernel_options.": ("options of model.use_fused_kernels", None),
    "model.use_shm": ("copies the model to /dev/shm before loading: load speed only", None),
    "rollout.layered_summon": ("gathers LoRA weights layer by layer for verl's sync: the push here is its own", None),
    "rollout.load_format": ("how verl's engine reads its first weights: the engine here always loads model.path", None),
    "rollout.mode": ("verl's sync/async rollout workers: single-turn generation is the same, the engine runs in-process",
                     ("sync", "async")),
    "rollout.multi_turn.tokenization_sanity_check_mode": ("episodes keep the sampled token ids and append the chat "
                                                          "template's token delta: nothing is re-tokenized to check", None),
    "rollout.multi_turn.use_inference_chat_template": ("earlier turns stay the tokens the model sampled (verl's false)",
                                                       (False,)),
    "rollout.multi_turn.interaction_config_path": ("simulated-user interactions are not implemented", (None,)),
    "rollout.agent.num_workers": ("agent-loop worker processes: episodes run in the training process here", None),
    "rollout.engine_kwargs.sglang": ("SGLang's engine settings: the engine here is vLLM (or hf)", None),
    "rollout.engine_kwargs.sglang.": ("SGLang's engine settings: the engine here is vLLM (or hf)", None),
    "rollout.disable_log_stats": ("vLLM logging", None),
    "actor.ulysses_sequence_parallel_size": ("sequence parallelism (memory): each process holds whole sequences here", None),
    "ref.ulysses_sequence_parallel_size": ("sequence parallelism (memory): each process holds whole sequences here", None),
    "actor.fsdp_config.fsdp_size": ("FSDP group size: the actor is sharded over all processes", None),
    "actor.fsdp_config.wrap_policy.": ("FSDP wrapping: every decoder layer is its own unit here", None),
    "ref.fsdp_config.wrap_policy.": ("FSDP wrapping: every decoder layer is its own unit here", None),
    "data.return_raw_chat": ("prompts keep their chat messages here in any case", None),
    "data.val_batch_size": ("deprecated in verl too: validation sends all its prompts to the engine at once", None),
    "rollout.max_model_len": ("the engine's context is data.max_prompt_length + data.max_response_length", None),
    "rollout.calculate_log_probs": ("the engine's sampled-token logprobs are always recorded here", None),
    "trainer.default_hdfs_dir": ("no HDFS copy: checkpoints go to trainer.default_local_dir", (None,)),
    "ray_init.": ("there is no Ray: accelerate launches the processes", None),
    "trainer.device": ("the device follows the launch (CUDA when available)", ("cuda", "cpu")),
    "reward_model.strategy": ("fsdp / fsdp2: the reward model is sharded with FSDP2 here", ("fsdp", "fsdp2")),
    "reward_model.model.use_remove_padding": ("the reward model's forwards run on padded rows here (the same scores)", None),
    "reward_model.model.external_lib": ("modules imported to register a model class: use reward_model.model.trust_remote_code",
                                        (None,)),
    "reward_model.model.use_shm": ("copies the model to /dev/shm before loading: load speed only", None),
    "reward_model.ulysses_sequence_parallel_size": ("sequence parallelism (memory): each process holds whole sequences "
                                                    "here", None),
    "reward_model.reward_manager": ("verl's naive manager is this trainer's rule reward by data_source; its dapo manager "
                                    "is that plus the overlong penalty of reward.overlong_buffer (off unless enabled)",
                                    ("naive", "dapo")),
    "reward.overlong_buffer.log": ("verl's per-response overlong log: reward/overlong_penalty_mean is always logged here", None),
    "algorithm.lam": ("GAE's lambda: GAE needs a critic and is refused here; no estimator here reads it", None),
    "actor.optim.warmup_style": ("the schedule here is linear warm-up then constant", ("constant",)),
    # verl's rollout-correction rejection and bypass modes (not implemented): their off values only
    "algorithm.rollout_correction.rollout_rs": ("rejection sampling by the engine/trainer ratio (verl's rollout_rs) is not "
                                                "implemented; algorithm.rollout_correction.mode reweights instead", (None,)),
    "algorithm.rollout_correction.rollout_rs_threshold": ("the bound of verl's rollout_rs rejection, not implemented", (None,)),
    "algorithm.rollout_correction.bypass_mode": ("verl's bypass mode (the engine's logprobs as the old ones) is not "
                                                 "implemented: the old-logprob pass always runs", (False,)),
    "algorithm.rollout_correction.loss_type": ("the loss of verl's bypass mode, not implemented", ("ppo_clip",)),
    # verl serves the distillation teacher from its own GPU pool through an inference server; here it is sharded over the
    # trainer's processes (FSDP2, like the reference) and scored by the trainer's logprob function
    "distillation.n_gpus_per_node": ("the teacher's GPU pool: the teacher is sharded over the trainer's processes here", None),
    "distillation.nnodes": ("the teacher's GPU pool: the teacher is sharded over the trainer's processes here", None),
    "distillation.teacher_key": ("multi-teacher routing: one teacher (teacher_models.teacher_model) here", None),
    "distillation.teacher_models.teacher_model.key": ("multi-teacher routing: one teacher here", None),
    "distillation.teacher_models.teacher_model.num_replicas": ("teacher server replicas: the teacher is sharded over the "
                                                              "trainer's processes here", None),
    "distillation.teacher_models.teacher_model.inference.": ("the teacher's inference server: the trainer's logprob "
                                                             "function scores it here (at temperature 1, as verl's)", None),
    "distillation.distillation_loss.use_chunked_topk": ("memory only: the output head here runs in chunks in any case", None),
    "distillation.distillation_loss.chunked_topk_chunk_size": ("memory only: the output head's chunk is fixed here", None),
}

# verl keys that would change the math and are not implemented: refused with the reason (never ignored).
REFUSED: dict[str, str] = {
    "model.override_config.": "overrides the model's config (changes the model): edit a copy of the model's config.json instead",
    "reward_model.reward_kwargs.": ("reward-manager kwargs other than overlong_buffer_cfg.* and max_resp_len (DAPO's, "
                                    "reward.overlong_buffer.*) are not implemented: drop these lines"),
    "critic.": "GRPO has no critic: drop the critic.* lines",
}


def _canonical(key: str) -> str:
    for _ in range(3):  # verl's long prefix, then an alias of the shortened key
        for prefix in sorted(ALIASES, key=len, reverse=True):
            if key == prefix or key.startswith(prefix) and prefix.endswith("."):
                key = ALIASES[prefix] + key[len(prefix):] if prefix.endswith(".") else ALIASES[prefix]
                break
        else:
            return key
    return key


def _match(key: str, table: dict):
    """The entry of `table` for `key`: an exact key or the longest prefix ending in '.'; None if none."""
    if key in table:
        return table[key]
    prefixes = [k for k in table if k.endswith(".") and key.startswith(k)]
    return table[max(prefixes, key=len)] if prefixes else None
