"""algorithms: the pure math, as verl's core_algos holds it: stateless tensor functions behind small registries.

    advantages.py      the advantage estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++, ReMax, GPG, OPO, ...)
    policy_losses.py   the policy losses (vanilla PPO-clip, dual-clip, GSPO, clip-cov, KL-cov, GPG, ...)
    losses.py          KL estimators (k1 / abs / k2 / k3 and `+`), loss aggregation, the policy-loss entry point,
                       rollout IS weights, the overlong penalty
    distillation.py    on-policy distillation losses (k3, forward-KL top-k)

`grpo_lib.algorithms` itself re-exports losses.py and the advantage entry points (`from grpo_lib import algorithms;
algorithms.policy_loss(...)`, as before the folders). May import: core.
"""

from grpo_lib.algorithms.advantages import ADV_ESTIMATORS, compute_advantages, token_advantages  # noqa: F401
from grpo_lib.algorithms.losses import (  # noqa: F401
    KL_TYPES,
    LOG_RATIO_CLAMP,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    ROLLOUT_IS_MODES,
    PolicyLossParams,
    aggregate_loss,
    entropy_from_logits,
    kl_penalty,
    overlong_penalty,
    policy_loss,
    rollout_is_weights,
    decoupled_weights,
)
