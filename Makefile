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

# pytest exits 5 when it collects nothing; that counts as a failure here too. Two pytest
# runs side by side: the tests marked serial (they start processes and time them;
# conftest.py marks them) one at a time, and every other test beside them (in-process
# ones, and the trainer-stack ones, which start processes but bound no wall time), its
# output held until both end. Spread freely over two pytest-xdist workers, timing-bound
# process tests failed in 3 runs of 4. `pytest tests` runs all in one go.
test: $(STAMP)
	@$(PY) -m pytest -q --durations=15 -m "not serial" tests > .pytest-beside.log 2>&1 & beside=$$!; \
	$(PY) -m pytest -q --durations=15 -m serial tests; serial=$$?; \
	wait $$beside; status=$$?; \
	echo "---- the other tests (run beside the serial ones) ----"; cat .pytest-beside.log; \
	echo "make test: serial tests exit $$serial, the others exit $$status"; \
	test $$serial -eq 0 -a $$status -eq 0

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
