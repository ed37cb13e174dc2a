# Two commands do all the set-up on a fresh machine:
#   make demo   - creates .venv if missing, installs podmonitor, runs the main job (trains the tiny
#                 GPT on TinyShakespeare with PODMonitor, about 5 minutes on 2 CPU cores)
#   make test   - creates .venv if missing, installs podmonitor with its test extras, runs the tests
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.podmonitor-installed

.PHONY: demo demo-synthetic test test-slow bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,wandb,hf,pretrained]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m podmonitor.cli fit --config examples/configs/gpt_tiny.yaml

demo-synthetic: $(STAMP)
	$(PY) -m podmonitor.demo

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) benchmarks/bench_engine.py

lint: $(STAMP)
	$(VENV)/bin/ruff check podmonitor tests benchmarks

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
