# Set-up and checks. Every target creates .venv when missing and installs what it needs; a second run
# skips the install (the stamp file is newer than every pyproject.toml and the constraints file).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIP    := $(BIN)/python -m pip --quiet --disable-pip-version-check
# torch is pinned in constraints.txt: pip then takes the machine's local CPU wheel, not the CUDA build.
EDITABLE := -e 'packages/ditcore[test]' -e 'apps/prepare[test]' -e 'apps/train[test]' -e 'apps/sample[test]'

.PHONY: help install test test-slow test-demo test-slurm lint bench demo clean

help:
	@echo "make demo       synthetic butterflies -> train a small DiT on the CPU -> sample prompts (~16 min on 2 cores after set-up)"
	@echo "make test       create .venv if needed, install the four packages, run ruff and the fast tests"
	@echo "make test-slow  the tests marked slow, which make test leaves out (~25 min on 2 cores; CI runs them)"
	@echo "make test-demo  make demo in a fresh folder, its samples judged (~20 min on 2 cores; .ci/run runs it)"
	@echo "make test-slurm train.sbatch on a two-node Slurm cluster on this machine (root; apt-get install slurm-wlm munge iproute2)"
	@echo "make bench      benchmarks under bench/ against a peer implementation (diffusers, a ditcore dependency)"
	@echo "make clean      remove .venv and caches"

$(BIN)/python:
	@$(PYTHON) -c 'import sys; v = sys.version_info; sys.exit(0 if v >= (3, 11) else \
		f"ditcore needs Python >= 3.11, but $(PYTHON) is {v.major}.{v.minor}: set PYTHON=/path/to/python3.11")'
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python constraints.txt packages/ditcore/pyproject.toml apps/*/pyproject.toml
	$(PIP) install -c constraints.txt $(EDITABLE)
	@touch $@

install: $(STAMP)

# radon lists every function whose cyclomatic complexity is above 20 (grade D and worse) but exits 0 when it finds
# some: any line it prints fails the target.
lint: install
	$(BIN)/ruff check .
	@out=$$($(BIN)/radon cc -n D -s packages apps) || exit 1; if [ -n "$$out" ]; then echo "$$out"; \
		echo "radon: the functions above have cyclomatic complexity above 20: split them into named helpers"; exit 1; fi

# pytest exits 5 when it collects no tests; that is not a failure of the code under test. Two test files run at a
# time (pytest-xdist; a file's tests stay in one process, so its module fixtures are built once): much of a test's
# time is a subprocess starting up (imports), which the second core overlaps. TEST_WORKERS=0 runs them in order.
TEST_WORKERS ?= 2
test: lint
	$(BIN)/pytest -m "not slow and not slurm" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=5; rc=$$?; \
		if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

# The tests make test leaves out: the 4-process layouts, compile end to end, resharding, whole runs. .ci/run runs
# them after make test.
test-slow: lint
	$(BIN)/pytest -m "slow and not slurm and not demo" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--durations=10

# `make demo` from scratch with its samples judged (tests/apps/test_demo_quality.py): the rates the README states,
# asserted with a margin. .ci/run runs it last.
test-demo: install
	$(BIN)/pytest -m demo -p no:randomly -s --durations=1

# Starts a two-node Slurm cluster on this machine (tests/infra/conftest.py: each node a network namespace with its own
# address, host name and slurmd; slurmctld and munged beside them; all under pytest's tmp folder, all removed at the
# end) and runs prepare.sbatch and train.sbatch on it: one node and two, HSDP and TP x DP across the nodes, SIGUSR1
# preemption, requeue and resume, a node killed mid-step, rendezvous failures; and selftest.sh. Skipped where
# slurm-wlm is not installed or namespaces cannot be made (needs root), a failure where CI=true. Its own target:
# it takes minutes, not part of `make test`.
test-slurm: install
	$(BIN)/pytest -m slurm -p no:randomly --durations=5

bench: install
	@true  # diffusers (the peer) is a ditcore dependency already (its VAE codec)
	$(BIN)/python bench/model_step.py

# The whole system on the embedded default: prepare data, train, sample. A second run reuses the dataset and
# the finished run (--resume auto finds its last checkpoint) and only samples again.
DEMO_DATA := data/butterflies
DEMO_RUN  := runs/demo
# 2064 samples: 2000 to train on and 64 held out (evenly spread) at $(DEMO_DATA)/val for the held-out loss. One in
# ten is a clip (an 8-frame clip is 128 tokens, an image 16: clips are still 47% of the tokens trained on), of a
# butterfly hovering in the middle (--simple). With one in four, 72% of the tokens were clips, whose flight the
# model had no time to learn; its images and clips then broke into 16-pixel tiles (bench/demo_quality.py: frames
# passing every shape test 72/128 against 118/128 with one in ten, same steps).
DEMO_PREPARE := --num 2064 --val-samples 64 --simple --video-ratio 0.1 --pca-patch 4 --pca-channels 16 \
	--latent-norm global
demo: install
	@test -f $(DEMO_DATA)/ditcore.json || $(BIN)/dit-prepare synthetic --out $(DEMO_DATA) $(DEMO_PREPARE) --overwrite
	$(BIN)/dit-train --config demo data.path=$(DEMO_DATA) train.run_dir=$(DEMO_RUN) --resume auto
	@echo
	@echo "Contact sheet (prompts x seeds): $(DEMO_RUN)/samples/grid.png"
	@echo "Loss curve:                      $(DEMO_RUN)/loss.png"
	@echo "Held-out loss per noise level:   $(DEMO_RUN)/heldout.png"
	@echo "Samples (image and 8-frame clip per prompt): $(DEMO_RUN)/samples/step-*/"
	@echo "Metrics: $(DEMO_RUN)/csv/    TensorBoard: $(BIN)/tensorboard --logdir $(DEMO_RUN)/tensorboard"
	@echo "Exported model for sampling on one device: $(DEMO_RUN)/export/"
	@echo "Open the sampler UI:  $(BIN)/dit-sample serve --checkpoint $(DEMO_RUN)   (then http://127.0.0.1:7860)"
	@echo "Or from the shell:    $(BIN)/dit-sample generate --checkpoint $(DEMO_RUN) --prompt 'a red butterfly' --frames 8 --out red.mp4"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
