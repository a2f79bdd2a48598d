# Two entry points: `make demo` and `make test`. Both build .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.rackmend-installed

.PHONY: demo test bench gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch is pinned here (not in pyproject) so a fresh venv takes the CPU wheel this
# machine carries instead of resolving a multi-GB CUDA build; users keep torch>=2.4.
$(STAMP): $(PY) pyproject.toml
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rackmend demo

# pytest exits 5 when it collects nothing; that counts as a failure here too. Two
# pytest-xdist workers, but never two tests that start processes at once (conftest.py puts
# them in one xdist_group): spread freely over two workers, timing-bound process tests
# failed in 3 runs of 4; one at a time, beside in-process tests, they see the load of an
# ordinary busy machine. `pytest tests` (one process) runs the same tests.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup tests

bench: $(STAMP)
	$(PY) benchmarks/merge.py --quick
	$(PY) benchmarks/transport.py --quick
	$(PY) benchmarks/codecs.py --quick

# Needs a CUDA device (CI has none), a few minutes: the tests marked cuda (device
# codecs, CUDA learners, async TP on 1-2 GPUs) and the GPU benchmarks.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
