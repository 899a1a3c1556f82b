# Hybrid State Lab. `make help` lists the targets.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
LEDGER_ROOT ?= ledgers/data
REPORT_DIR ?= reports
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help

help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_%-]+:.*## ' $(MAKEFILE_LIST) | sed -e 's/:.*## /\t/' | column -t -s $$'\t'

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP) ## create .venv and install the project with dev extras (idempotent)

test: setup ## run the default test suite
	$(BIN)/python -m pytest -m "not slow"

test-all: setup ## run every test, slow end-to-end ones included
	$(BIN)/python -m pytest

lint: setup ## ruff checks
	$(BIN)/ruff check serving_core experiments analysis ledgers tests bench

plan: setup ## print the budget planner table for b63, b83 and b108 (Falcon-H1-7B)
	@for b in b63 b83 b108; do $(BIN)/python -m serving_core.planner --model falcon_h1_7b --budget $$b; echo; done

bench: setup ## engine benchmarks: default S2 b63 cell, 3,000 and 30,000 requests, profile
	$(BIN)/python -m bench.engine_bench

.PHONY: help setup test test-all lint plan bench
