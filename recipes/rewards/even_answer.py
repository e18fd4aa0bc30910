"""The rule the tiny reward model's and the tiny judge's preference can be checked by (make demo-rm, make demo-judge):
1.0 when the number after the response's last `####` is even, else 0.0 (verl's compute_score signature).
It is listed with weight 0 in recipes/tiny_cpu_rm.yaml and tiny_cpu_judge.yaml: logged (reward/custom/mean, val acc),
never trained on, so the learned score alone moves the policy."""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    found = re.findall(r"####\s*(-?\d+)", solution_str)
    return 1.0 if found and int(found[-1]) % 2 == 0 else 0.0
