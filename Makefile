# The two commands of the README:  make train  (the example run)  and  make test  (install + tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install train test test-slow gpu-check lint format bench clean

$(STAMP): setup.cfg constraints.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: an open range would fetch a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	# litgpt's own GPT for tests/fabric/test_litgpt.py: without its command-line and download
	# requirements (only these two small packages are needed to import litgpt.model)
	$(PY) -m pip install --quiet --no-deps -c constraints.txt litgpt safetensors psutil
	touch $(STAMP)

install: $(STAMP)

train: install
	$(PY) examples/train.py $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q -p no:cacheprovider --durations=40 $(ARGS)

test-slow: install
	$(PY) -m pytest -q -p no:cacheprovider -m slow $(ARGS)

# the tests marked gpu (they skip without CUDA), then the one-GPU overhead benchmark and the
# per-stage GPU memory report (without a GPU each says so and passes), each part bounded by a
# timeout (a part that runs past it fails the target). By default it fits a GPU lent for a few
# minutes (at most 6 min by the bounds: one model, 3 interleaved repeats, as many as fit in 180 s of
# the overhead benchmark's 210, a 512-wide memory model);
# GPU_CHECK=long runs both models, 4 repeats and the 1024-wide memory model. ARGS go to pytest,
# BENCH_ARGS to the overhead benchmark.
GPU_CHECK ?= short
ifeq ($(GPU_CHECK),long)
GPU_TESTS_S := 900
GPU_OVERHEAD := --models gpt_small,gpt_10m --repeats 4
GPU_OVERHEAD_S := 1800
GPU_MEMORY := --width 1024
GPU_MEMORY_S := 600
else
GPU_TESTS_S := 90
GPU_OVERHEAD := --models gpt_10m --repeats 3 --steps 40 --warmup 10 --budget-s 180
GPU_OVERHEAD_S := 210
GPU_MEMORY := --width 512
GPU_MEMORY_S := 60
endif
gpu-check: install
	timeout $(GPU_TESTS_S) $(PY) -m pytest -q -p no:cacheprovider -m gpu -rs tests/gpu $(ARGS)
	timeout $(GPU_OVERHEAD_S) $(PY) benchmarks/bench_gpu_overhead.py --out-dir benchmarks/results $(GPU_OVERHEAD) $(BENCH_ARGS)
	timeout $(GPU_MEMORY_S) $(PY) benchmarks/bench_gpu_memory.py --out-dir benchmarks/results $(GPU_MEMORY)

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: install
	$(PY) benchmarks/bench_step_time.py $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun lightning_logs
