"""The generative judge (grpo_lib/rollout/judge.py): the template filled per row, the score parsed by the named function
and scaled, an unparseable text scored 0, counted and logged with a sample, an overlong judge prompt skipped and counted,
one engine call per batch, rows seeded from their prompts; end to end (slow) with a real second vLLM engine in the trainer's process."""

from __future__ import annotations

import logging

import pytest

from grpo_lib.core.types import Generation, PromptBatch
from grpo_lib.rollout.judge import Judge, last_number, last_number_in_tag, make_parser
from grpo_lib.trainer.step import build_rollout_batch
from tests.conftest import read_metrics, run_train, tiny_overrides


@pytest.mark.parametrize("text, tagged, plain", [
    ("The answer is right. <score>7</score>", 7.0, 7.0),
    ("<score>3</score> no wait <score>9/10</score>", 10.0, 10.0),
    ("I'd say 8 out of 10", None, 10.0),
    ("<score>none</score>", None, None),
    ("<score>-2.5</score> (then 4)", -2.5, 4.0),
    ("", None, None),
])
def test_the_named_parsers(text, tagged, plain):
    assert last_number_in_tag(text) == tagged
    assert last_number(text) == plain


def test_a_parser_from_a_file(tmp_path):
    path = tmp_path / "parse.py"
    path.write_text("def parse(text):\n    return 1.0 if 'GOOD' in text else None\n")
    parse = make_parser(f"{path}:parse", tag="score")
    assert parse("GOOD job") == 1.0 and parse("bad") is None
    assert make_parser("last_number_in_tag", tag="grade")("<grade>4</grade><score>1</score>") == 4.0


class FakeEngine:
    """Answers each judge prompt with the next text of `texts`; records the calls and the lifecycle."""

    def __init__(self, texts):
        self.texts, self.prompts, self.events = list(texts), [], []

    def release(self):
        self.events.append("release")

    def prepare_for_generation(self):
        self.events.append("wake")

    def generate(self, prompt_ids, *, n, temperature, max_tokens, logprobs, seeds):
        self.events.append("generate")
        self.prompts += prompt_ids
        self.seeds = seeds
        return [[Generation(token_ids=[1], logprobs=[0.0], text=self.texts.pop(0), finish_reason="stop")] for _ in prompt_ids]


class JudgeSettings:
    max_tokens, temperature, score_scale = 8, 0.0, 10.0


def batch(tokenizer, responses):
    messages = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Q{i}?"}] for i in range(len(responses))]
    prompts = PromptBatch(prompt_ids=[[5, 6]] * len(responses), group_ids=[str(i) for i in range(len(responses))],
                          data_sources=["x"] * len(responses), ground_truths=[f"gt{i}" for i in range(len(responses))],
                          extra_infos=[{}] * len(responses), messages=messages)
    gens = [[Generation(token_ids=[7], logprobs=[0.0], text=r, finish_reason="stop")] for r in responses]
    return build_rollout_batch(prompts, gens, pad_id=0)


def test_scores_are_parsed_scaled_and_an_unparsed_text_is_counted_and_logged(tiny_model_dir, caplog):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = FakeEngine(["fine <score>7</score>", "I cannot tell", "<score>10</score>"])
    judge = Judge(engine, tokenizer, template="P: {prompt} R: {response} G: {ground_truth}",
                  parse=make_parser("last_number_in_tag", tag="score"), cfg=JudgeSettings(), max_model_len=4096)
    with caplog.at_level(logging.WARNING, logger="grpo_lib.rollout.judge"):
        scores = judge.score(batch(tokenizer, ["r0", "r1", "r2"]))
    assert scores == [0.7, 0.0, 1.0]
    assert judge.metrics == {"judge/unparsed": 1.0, "judge/overlong": 0.0}
    assert "1 of 3 texts had no score (scored 0); a sample: 'I cannot tell'" in caplog.text
    assert engine.events == ["generate"], "one engine call per batch, no sleep or wake (resident: judge.py says why)"
    assert len(set(engine.seeds)) == 3, "each row its own seed"
    again = FakeEngine(["<score>7</score>"] * 3)
    Judge(again, tokenizer, template="P: {prompt} R: {response} G: {ground_truth}", parse=last_number, cfg=JudgeSettings(),
          max_model_len=4096).score(batch(tokenizer, ["r0", "r1", "r2"]))
    assert again.seeds == engine.seeds, "a row's seed comes from its judge prompt: the same in another call or a resumed run"
    first = tokenizer.decode(engine.prompts[0])
    assert "P: Q0? R: r0 G: gt0" in first, "the last user message, the response, the ground truth, in the judge's chat"


def test_a_judge_prompt_longer_than_its_context_is_skipped_and_counted(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = FakeEngine(["<score>5</score>"])
    judge = Judge(engine, tokenizer, template="{response}", parse=last_number, cfg=JudgeSettings(), max_model_len=40)
    scores = judge.score(batch(tokenizer, ["short", "long " * 40]))
    assert scores == [0.5, 0.0] and judge.metrics == {"judge/unparsed": 0.0, "judge/overlong": 1.0}
    assert len(engine.prompts) == 1, "the overlong prompt never reaches the engine"


@pytest.mark.slow
def test_a_run_with_a_judge_engine_beside_the_policys(tiny_model_dir, arith_data, tmp_path):
    """The trainer builds the judge's own vLLM engine in its process beside the policy's; the random tiny judge writes no
    score: every response scores 0 from it, is counted (judge/unparsed) and a sample is logged; the run goes on."""
    template = tmp_path / "judge.txt"
    template.write_text("Grade: {response} <score>")
    out = tmp_path / "run"
    proc = run_train(["recipes/tiny_cpu.yaml", *tiny_overrides(tiny_model_dir, arith_data, out, "trainer.total_training_steps=2",
                                                                "judge.enable=true", f"judge.model_path={tiny_model_dir}",
                                                                f"judge.prompt_template={template}", "judge.max_tokens=4",
                                                                "judge.kv_cache_memory_bytes=16777216",
                                                                "reward.max_error_fraction=1.0")])
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["judge/unparsed"] + r["judge/overlong"] == 4 * 4, r  # 4 prompts x 4 responses (tiny_overrides), all 0
        assert r["reward/judge/mean"] == 0.0 and "timing_s/judge" in r, r
    assert "texts had no score (scored 0); a sample:" in proc.stderr + proc.stdout
