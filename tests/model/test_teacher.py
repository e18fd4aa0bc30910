"""The distillation teacher (grpo_lib/model/teacher.py): refused before any load when its tokenizer is not the student's or
it does not fit the GPU; in the memory plan and `--print-plan`; scoring the loss tokens through the one logprob
function; and (slow) a tiny run that trains with it end to end.
Run: `.venv/bin/python -m pytest tests/model/test_teacher.py`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from grpo_lib.config import load_config
from grpo_lib.planning.beside import teacher_fit_problem
from grpo_lib.planning.memory import GIB
from grpo_lib.planning.plan import print_plan
from tests.helpers.cli import run_main
from tests.conftest import HF_ENGINE, REPO, read_metrics, run_train, tiny_overrides

DATA = REPO / "tests" / "data"
RECIPE = REPO / "recipes" / "qwen3_1_7b_from_8b_gsm8k_distill.yaml"
TEACHER_KEY = "distillation.teacher_models.teacher_model.model_path"


def swapped_tokenizer_copy(model_dir: Path, out: Path) -> Path:
    """A copy of the tiny model whose tokenizer gives two tokens each other's ids: same size, another vocabulary."""
    shutil.copytree(model_dir, out)
    path = out / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(tok))
    return out


def test_a_teacher_with_another_tokenizer_is_refused_at_start_naming_both(monkeypatch, tiny_model_dir, arith_data, tmp_path):
    other = swapped_tokenizer_copy(tiny_model_dir, tmp_path / "other_teacher")
    args = tiny_overrides(tiny_model_dir, arith_data, tmp_path / "run", "distillation.enabled=true", f"{TEACHER_KEY}={other}")
    result = run_main(monkeypatch, "recipes/tiny_cpu.yaml", *args, setup=True)  # the engine is refused: it comes first
    assert result.returncode == 2, result.stderr[-2000:]
    assert "different tokenizers" in result.stderr and str(other) in result.stderr and str(tiny_model_dir) in result.stderr


def test_the_same_tokenizer_passes_the_check(tiny_model_dir):
    from transformers import AutoTokenizer

    from grpo_lib.model.teacher import tokenizer_problem

    cfg = load_config(REPO / "recipes/tiny_cpu.yaml", [f"model.path={tiny_model_dir}", "distillation.enabled=true",
                                                        f"{TEACHER_KEY}={tiny_model_dir}"])
    assert tokenizer_problem(cfg, AutoTokenizer.from_pretrained(tiny_model_dir)) is None


def test_forward_kl_topk_refuses_a_teacher_with_another_head_width(tiny_model_dir, tmp_path):
    """The same tokenizer but a wider head (Qwen2.5-0.5B's 151936 against 7B's 152064 logits, say): its top-k ids could
    index past the student's head, so forward_kl_topk refuses it naming both; k3 reads the sampled token only."""
    from transformers import AutoTokenizer

    from grpo_lib.model.teacher import tokenizer_problem

    wider = tmp_path / "wider_teacher"
    shutil.copytree(tiny_model_dir, wider)
    config = json.loads((wider / "config.json").read_text())
    config["vocab_size"] += 64
    (wider / "config.json").write_text(json.dumps(config))
    overrides = [f"model.path={tiny_model_dir}", "distillation.enabled=true", f"{TEACHER_KEY}={wider}"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    topk = load_config(REPO / "recipes/tiny_cpu.yaml", [*overrides, "distillation.distillation_loss.loss_mode=forward_kl_topk"])
    problem = tokenizer_problem(topk, tokenizer)
    assert problem and "forward_kl_topk" in problem and str(wider) in problem and str(tiny_model_dir) in problem, problem
    assert tokenizer_problem(load_config(REPO / "recipes/tiny_cpu.yaml", overrides), tokenizer) is None


def folders(tmp_path: Path) -> tuple[Path, Path]:
    """Model folders holding only Qwen3-1.7B's and Qwen3-8B's config.json (the plan reads nothing else)."""
    student, teacher = tmp_path / "student", tmp_path / "teacher"
    for folder, name in ((student, "qwen3_1_7b_config.json"), (teacher, "qwen3_8b_config.json")):
        folder.mkdir()
        shutil.copy(DATA / name, folder / "config.json")
    return student, teacher


def test_a_teacher_that_does_not_fit_is_refused_before_any_load(tmp_path):
    student, teacher = folders(tmp_path)
    cfg = load_config(RECIPE, [f"model.path={student}", f"{TEACHER_KEY}={teacher}", "ref.fsdp_config.param_offload=false"],
                      world_size=4)
    assert teacher_fit_problem(cfg, world_size=4, gpu_bytes=80 * GIB) is None
    problem = teacher_fit_problem(cfg, world_size=4, gpu_bytes=12 * GIB)  # 8.2B teacher in bf16: 3.8 GiB of shards alone
    assert problem and TEACHER_KEY in problem and "8.19B parameters" in problem and "param_offload" in problem, problem
    assert teacher_fit_problem(cfg, world_size=4, gpu_bytes=None) is None, "on CPU there is no GPU to fit"


def plan(capsys, *argv):
    code = print_plan([*argv, "--print-plan"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_print_plan_shows_the_teachers_terms_and_refuses_one_that_does_not_fit(capsys):
    flags = ("--model-config", str(DATA / "qwen3_1_7b_config.json"), "--teacher-model-config", str(DATA / "qwen3_8b_config.json"))
    code, out = plan(capsys, str(RECIPE), *flags)
    assert code == 0, out
    # Qwen3-8B: 36 layers, untied 151936 x 4096 embedding and head. Offloaded: 0 resident; gathered root + one layer
    # in bf16: 2 x (2 x 151936 x 4096 + 4096 + 218.1M) = 2.68 GiB
    for needle in ("teacher: 8.19B parameters (36 layers", "teacher pass: runs (distillation, loss_mode=k1",
                   "teacher                       0.00 GiB", "teacher gathered units        2.68 GiB", "teacher pass   "):
        assert needle in out, f"{needle!r} not in:\n{out}"
    code, out = plan(capsys, str(RECIPE), *flags, "ref.fsdp_config.param_offload=false", "--gpu-memory-gb", "12")
    # not offloaded: 2 x 8.19e9 / 4 processes = 3.81 GiB resident through every phase
    assert code == 4 and "teacher                       3.81 GiB" in out and "DOES NOT FIT" in out, out
    code, out = plan(capsys, str(RECIPE), "--model-config", str(DATA / "qwen3_1_7b_config.json"))
    assert code == 0 and "teacher: not planned" in out, "without the teacher's config.json the plan says so"


def test_teacher_scores_loss_tokens_with_its_top_k(tiny_model_dir):
    """Teacher.score: the loss tokens' logprobs at temperature 1 and the top-k of the full distribution there, 0
    elsewhere, in the batch's row order, whatever the micro-batching."""
    from grpo_lib.model.teacher import Teacher
    from tests.scripts import grad_case as case

    torch.set_num_threads(1)
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "data.train_files=[unused.parquet]", "rollout.n=2",
                             "rollout.temperature=0.7", "model.dtype=float32", "ref.log_prob_micro_batch_size_per_gpu=3",
                             "actor.ppo_micro_batch_size_per_gpu=3", "distillation.enabled=true", f"{TEACHER_KEY}={tiny_model_dir}",
                             "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=3"])
    teacher = Teacher(cfg, device=torch.device("cpu"))
    batch = case.with_holes(case.make_batch(teacher.model))
    teacher.score(batch)
    ids, mask = batch.input_ids, batch.attention_mask
    with torch.no_grad():
        logits = teacher.model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()  # [B, T, V]
    logp = torch.nn.functional.pad(logits[:, :-1].log_softmax(-1), (0, 0, 1, 0))  # temperature 1, not the rollout's
    loss = batch.loss_mask.bool()  # [B, T]
    # float32 forwards two ways (padded batch vs micro-batches): ~1e-6 per logprob
    torch.testing.assert_close(batch.teacher_logprobs[loss], logp.gather(-1, ids[..., None]).squeeze(-1)[loss], rtol=0, atol=1e-5)
    values, top = logp.topk(3, dim=-1)
    assert torch.equal(batch.teacher_topk_ids[loss], top[loss])
    torch.testing.assert_close(batch.teacher_topk_logprobs[loss], values[loss], rtol=0, atol=1e-5)
    assert not batch.teacher_logprobs[~loss].any() and not batch.teacher_topk_ids[~loss].any(), "only the loss tokens"


@pytest.mark.slow
def test_tiny_distillation_run_trains_with_the_teacher(tiny_model_dir, arith_data, tmp_path):
    """3 steps with the tiny model as its own teacher's student (a second seed: another model, the same tokenizer):
    the teacher pass runs (timing_s/teacher), the distillation metrics are logged and finite, the run exits 0."""
    from data_prep.tiny_model import make_tiny_model

    teacher = make_tiny_model(tmp_path / "teacher", warmup_steps=0, seed=1)
    out = tmp_path / "run"
    run_train(["recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, arith_data, out, "distillation.enabled=true", HF_ENGINE,
                                                        f"{TEACHER_KEY}={teacher}", "distillation.distillation_loss.loss_mode=forward_kl_topk",
                                                        "distillation.distillation_loss.topk=4")])
    steps = [m for m in read_metrics(out) if m.get("step", 0) >= 1 and "distillation/loss" in m]
    assert len(steps) == 3
    for m in steps:
        assert m["timing_s/teacher"] > 0 and m["distillation/kl_mean"] > 0
        assert m["distillation/loss_min"] <= m["distillation/kl_mean"] <= m["distillation/loss_max"]
        assert 0 < m["distillation/teacher_mass"] <= 1 + 1e-6 and 0 < m["distillation/student_mass"] <= 1 + 1e-6


# verl's examples/on_policy_distillation_trainer/run_qwen3_8b_fsdp.sh, its EXTRA block as the script expands it
VERL_DISTILL_LINES = [
    "distillation.enabled=True", "distillation.n_gpus_per_node=4", "distillation.nnodes=1",
    "distillation.teacher_models.teacher_model.model_path=Qwen/Qwen3-8B",
    "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=2",
    "distillation.teacher_models.teacher_model.inference.name=vllm",
    "distillation.teacher_models.teacher_model.inference.gpu_memory_utilization=0.4",
    "distillation.teacher_models.teacher_model.inference.max_model_len=3073",
    "distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.topk=64",
    "distillation.distillation_loss.use_task_rewards=False", "distillation.distillation_loss.use_policy_gradient=True",
    "distillation.distillation_loss.loss_max_clamp=10.0", "distillation.distillation_loss.log_prob_min_clamp=-10.0",
]


def test_verls_distillation_lines_pass_print_plan_with_the_resolved_values(capsys):
    flags = ("--model-config", str(DATA / "qwen3_4b_config.json"), "--teacher-model-config", str(DATA / "qwen3_8b_config.json"))
    code, out = plan(capsys, str(REPO / "recipes/qwen3_4b_gsm8k.yaml"), *VERL_DISTILL_LINES, *flags)
    assert code == 0, out
    for needle in ("teacher pass: runs (distillation, loss_mode=k1; the negative divergence as the advantage of a PPO clip)",
                   "loss = the distillation term alone", "distillation.distillation_loss.clip_ratio_low=0.2 clip_ratio_high=0.2",
                   "distillation.n_gpus_per_node=4: the teacher's GPU pool",
                   "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=2: the teacher's inference server",
                   "teacher: 8.19B parameters"):
        assert needle in out, f"{needle!r} not in:\n{out}"
    cfg = load_config(REPO / "recipes/qwen3_4b_gsm8k.yaml", VERL_DISTILL_LINES, world_size=4)
    dl = cfg.distillation.distillation_loss
    assert (dl.loss_mode, dl.topk, dl.use_task_rewards, dl.use_policy_gradient, dl.loss_max_clamp, dl.log_prob_min_clamp) == \
        ("k1", 64, False, True, 10.0, -10.0)
