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

# pytest exits 5 when it collects nothing; that counts as a failure here too. Two workers
# (pytest-xdist), a file per worker at a time: most tests wait on processes they started,
# so two at once use the 2 cores that one leaves half idle (16 min serial, 11 with two).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

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
