# slm_bench: `make run` and `make test` are all a fresh machine needs (Python >= 3.11, no GPU).
# Both bootstrap .venv on first use; later calls skip setup while settings.ini, setup.py and the
# kernelspec are unchanged (the stamp file's name is their hash).

SHELL := /bin/bash
.DEFAULT_GOAL := help
.PHONY: help setup js-assets sandbox-deps run replicate profile ablation-validate test test-slow check-sync nbdev-test pytest lab bench export report clean-runs

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build of torch (on disk on these machines); a GPU node sets TORCH_SPEC to its CUDA build.
TORCH_SPEC ?= torch==2.13.0
PROFILE ?= tiny
RUN ?= runs/$(PROFILE)
# empty: every recipe; RECIPE=phi4 (or tinygsm,phi4) runs those recipes and the stages they need
RECIPE ?=
# independent stages run side by side, sharing the cores (slm-bench run --jobs; 1: one by one)
JOBS ?= 2
# make replicate: how many training seeds (replicate 0 is the plain run)
SEEDS ?= 3
HTML_MANAGER ?= @jupyter-widgets/html-manager@1.0.15
REQUIREJS ?= requirejs@2.3.8
JS_DIR := $(VENV)/share/slm-bench/js
SETUP_HASH := $(shell cat settings.ini setup.py kernels/slm-bench/kernel.json | sha256sum | cut -c1-16)
STAMP := $(VENV)/.setup-$(SETUP_HASH)
# pip must never stop to ask; nothing here downloads models or datasets.
export PIP_NO_INPUT := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

help:
	@echo "make run      run every recipe on the embedded tiny world (CPU) and print the report path"
	@echo "make run RECIPE=phi4   one recipe (and the stages it needs)"
	@echo "make replicate SEEDS=3   every recipe with 3 training seeds on the same data (runs/tiny-replicate); slm-bench findings pools them"
	@echo "make ablation-validate   TinyGSM's unchecked SFT data against the same SFT on validated solutions (= make run RECIPE=tinygsm-ablations)"
	@echo "make test     notebook/library sync check, nbdev_test, then pytest (all but the slow integration tests)"
	@echo "make test-slow   the slow integration tests: the smoke profile end to end, through Slurm, JupyterLab in a browser"
	@echo "make lab      JupyterLab with the slm-bench kernel"
	@echo "make bench    benchmarks (slm-bench bench)"
	@echo "make profile  make run under py-spy into \$$(RUN)-profile, then where its time went (slm-bench stacks)"
	@echo "make export   nbdev_export + nbdev_clean (after editing notebooks)"
	@echo "make report RUN=runs/tiny   re-render a run's HTML report"

setup: $(STAMP)

$(STAMP):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "slm_bench needs Python >= 3.11: run make PYTHON=python3.11 ...")'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@rm -f $(VENV)/.setup-*
	@echo "setting up $(VENV) (first run only; later runs skip this)"
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/jupyter kernelspec install kernels/slm-bench --sys-prefix --replace >/dev/null
	@$(MAKE) --no-print-directory js-assets
	@touch $@

# Offline widget rendering for HTML reports: require.js and html-manager's dist files, from the npm registry.
js-assets:
	@if [ -f $(JS_DIR)/require.js ] && [ -f $(JS_DIR)/html-manager/embed-amd.js ]; then exit 0; fi; \
	if ! command -v npm >/dev/null; then echo "npm not found: reports will show static figures instead of widget snapshots"; exit 0; fi; \
	tmp=$$(mktemp -d); trap 'rm -rf $$tmp' EXIT; \
	(cd $$tmp && npm pack --silent $(HTML_MANAGER) $(REQUIREJS) >/dev/null) || { echo "npm pack failed: reports will show static figures only"; exit 0; }; \
	mkdir -p $$tmp/hm $$tmp/rq $(JS_DIR)/html-manager; \
	tar xzf $$tmp/jupyter-widgets-html-manager-*.tgz -C $$tmp/hm && tar xzf $$tmp/requirejs-*.tgz -C $$tmp/rq && \
	cp -r $$tmp/hm/package/dist/. $(JS_DIR)/html-manager/ && cp $$tmp/rq/package/require.js $(JS_DIR)/require.js && \
	echo "widget assets installed in $(JS_DIR)"

# The sandbox's namespaces come from bubblewrap (Debian package `bubblewrap`): installed here when we can (root with
# apt-get); otherwise the sandbox itself refuses with a message that says how to get it.
sandbox-deps:
	@command -v bwrap >/dev/null && exit 0; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing bubblewrap (the sandbox's namespaces)"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; }; \
	else echo "bubblewrap (bwrap) is not installed: the sandbox needs it (sudo apt install bubblewrap)"; fi

run: $(STAMP) sandbox-deps
	$(BIN)/slm-bench run --profile $(PROFILE) --jobs $(JOBS) $(if $(RECIPE),--recipe $(RECIPE))

# The same run with SEEDS training seeds on the same data: one run folder per replicate under runs/$(PROFILE)-replicate, the
# data stages computed once; `slm-bench findings runs/$(PROFILE)-replicate` pools the findings over the seeds.
replicate: $(STAMP) sandbox-deps
	$(BIN)/slm-bench replicate --seeds $(SEEDS) --profile $(PROFILE) --jobs $(JOBS) $(if $(RECIPE),--recipe $(RECIPE))

test: $(STAMP) sandbox-deps
	$(BIN)/python tests/nbdev_sync.py
	$(BIN)/nbdev_test --path nbs --skip_folder_re '^(stages|[_.].*)$$'
	$(BIN)/python -m pytest tests -m "not slow"
# The integration tests marked slow (pytest -m slow): the smoke profile end to end through the runner (and again through
# a one-node Slurm), and JupyterLab in a browser. Minutes each, so outside `make test`; CI (.ci/run) runs both.
test-slow: $(STAMP) sandbox-deps
	$(BIN)/python -m pytest tests -m slow
# TinyGSM keeps the teacher's solutions unchecked (curate's default). The control (stage validated_sft, on request) is the
# same SFT from the same pretrained model on the validated solutions, in the same run folder.
ablation-validate: $(STAMP) sandbox-deps
	$(BIN)/slm-bench run --profile $(PROFILE) --jobs $(JOBS) --recipe tinygsm-ablations

lab: $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[dev,lab]"
	$(BIN)/jupyter lab --notebook-dir=. $(if $(filter 0,$(shell id -u)),--allow-root)

# Where a whole run's time goes: every stage kernel sampled from outside by py-spy (the `profile` extra), 10 stacks a second,
# into a fresh $(RUN)-profile (a cached run would time nothing), then summed into parts (bench.stacks).
profile: $(STAMP) sandbox-deps
	$(BIN)/python -m pip install --quiet -e ".[profile]"
	mkdir -p $(RUN)-profile
	$(BIN)/py-spy record --subprocesses --nonblocking --rate 10 --format raw -o $(RUN)-profile/stacks.txt -- \
	  $(BIN)/slm-bench run --profile $(PROFILE) --run-dir $(RUN)-profile --jobs $(JOBS) $(if $(RECIPE),--recipe $(RECIPE))
	$(BIN)/slm-bench stacks $(RUN)-profile/stacks.txt

bench: $(STAMP) sandbox-deps
	$(BIN)/slm-bench bench

export: $(STAMP)
	$(BIN)/nbdev_export
	$(BIN)/nbdev_clean

report: $(STAMP)
	$(BIN)/slm-bench report $(RUN)

clean-runs:
	rm -rf runs reports/*/
